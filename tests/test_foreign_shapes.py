"""Batches as other publishers write them decode to the same canonical events.

Each publisher is mirrored by its own msgspec Structs, with the options that shape its bytes:
- vLLM < 0.10 (examples/online_serving/kv_events_subscriber.py of that era): array-like batch
  and events, ``medium`` added later, ``data_parallel_rank`` later still;
- vLLM builds whose ``EventBatch`` is a plain (map-encoded) struct, events with
  ``kv_cache_spec_*`` but not yet ``locality``/``ownership``/``session_id``;
- SGLang (sglang/srt/disaggregation/kv_events.py): array-like batch ``[ts, events,
  attn_dp_rank]``; array-like events, ``BlockStoredWithMetadata`` appending a metadata struct;
  and the later tagged-map events with ``cache_salt``/``session_id`` and ``medium`` omitted.
"""

from typing import Any, Optional, Union

import msgspec
import pytest

from engine_shapes import SglBatch, SglBlockRemoved, SglBlockStored
from kvbridge.wire import events
from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

H1, H2, PARENT = 2**63 + 5, 17, 2**64 - 1
TOKENS = [1, 2, 300, 70000]


# --- vLLM < 0.10: positional ----------------------------------------------------------------


class OldVllmEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldVllmStored(OldVllmEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]


class OldVllmStoredMedium(OldVllmStored, tag="BlockStored"):
    medium: Optional[str]


class OldVllmRemoved(OldVllmEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class OldVllmRemovedMedium(OldVllmRemoved, tag="BlockRemoved"):
    medium: Optional[str]


class OldVllmCleared(OldVllmEvent, tag="AllBlocksCleared"):
    pass


class OldVllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class OldVllmBatchDp(OldVllmBatch):
    data_parallel_rank: Optional[int] = None


def test_vllm_positional_without_medium():
    payload = msgspec.msgpack.encode(
        OldVllmBatch(1.0, [OldVllmStored([H1, H2], None, TOKENS, 2, None), OldVllmRemoved([H1]), OldVllmCleared()])
    )
    assert events.decode_batch(payload) == KVEventBatch(
        1.0,
        [BlockStored([H1, H2], None, TOKENS, 2, None, None, None), BlockRemoved([H1], None), AllBlocksCleared()],
    )


def test_vllm_positional_with_medium_and_rank():
    batch = OldVllmBatchDp(
        2.0, [OldVllmStoredMedium([H1], PARENT, TOKENS, 4, 3, "GPU"), OldVllmRemovedMedium([H2], "CPU")], 1
    )
    for format, codec in (("msgpack", msgspec.msgpack), ("json", msgspec.json)):
        assert events.decode_batch(codec.encode(batch), format) == KVEventBatch(
            2.0, [BlockStored([H1], PARENT, TOKENS, 4, 3, "GPU", None), BlockRemoved([H2], "CPU")], 1
        )


# --- vLLM with a map-encoded batch ----------------------------------------------------------


class MapVllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapVllmStored(MapVllmEvent, tag="BlockStored"):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class MapVllmRemoved(MapVllmEvent, tag="BlockRemoved"):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]
    group_idx: Optional[int] = None


class MapVllmBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


def test_vllm_map_encoded_batch():
    digest = bytes(range(32))
    batch = MapVllmBatch(
        3.0,
        [
            MapVllmStored([digest], None, TOKENS, 4, None, "GPU", "lora", [("lora",)], 1, "sliding_window", 128),
            MapVllmRemoved([digest], "GPU", 1),
        ],
        2,
    )
    expected = KVEventBatch(
        3.0,
        [
            BlockStored([digest], None, TOKENS, 4, None, "GPU", "lora", [("lora",)], 1, "sliding_window", 128),
            BlockRemoved([digest], "GPU", 1),
        ],
        2,
    )
    for format, codec in (("msgpack", msgspec.msgpack), ("json", msgspec.json)):
        assert events.decode_batch(codec.encode(batch), format) == expected


# --- SGLang ---------------------------------------------------------------------------------


class SglEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class SglStored(SglEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class SglMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class SglStoredWithMetadata(SglStored, tag="BlockStored", kw_only=True):
    metadata: SglMetadata


class SglRemoved(SglEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class SglCleared(SglEvent, tag="AllBlocksCleared"):
    pass


def test_sglang_array_events_with_metadata_and_attn_dp_rank():
    batch = SglBatch(
        4.0,
        [
            SglStored([H1], None, TOKENS, 4, None),  # seven elements
            SglStoredWithMetadata([H2], H1, TOKENS, 4, None, "CPU_PINNED", metadata=SglMetadata("salt")),  # eight
            SglRemoved([H1], "GPU"),
            SglCleared(),
        ],
        attn_dp_rank=3,
    )
    payload = msgspec.msgpack.encode(batch)
    assert events.decode_batch(payload) == KVEventBatch(
        4.0,
        [
            BlockStored([H1], None, TOKENS, 4, None, None, None),
            BlockStored([H2], H1, TOKENS, 4, None, "CPU_PINNED", None, metadata={"cache_salt": "salt"}),
            BlockRemoved([H1], "GPU"),
            AllBlocksCleared(),
        ],
        3,
    )


def test_sglang_oldest_two_element_batch():
    class OldSglBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]

    payload = msgspec.msgpack.encode(OldSglBatch(5.0, [SglStored([H1], None, TOKENS, 4, 9)]))
    assert events.decode_batch(payload) == KVEventBatch(5.0, [BlockStored([H1], None, TOKENS, 4, 9, None, None)])


@pytest.mark.parametrize("format, codec", [("msgpack", msgspec.msgpack), ("json", msgspec.json)])
def test_sglang_map_events(format, codec):
    batch = SglBatch(
        6.0,
        [
            SglBlockStored([H1], None, TOKENS, 4, None),  # medium omitted, no lora_name at all
            SglBlockStored([H2], H1, TOKENS, 4, 2, "GPU", cache_salt="s", session_id="sess"),
            SglBlockRemoved([H1]),
        ],
        0,
    )
    assert events.decode_batch(codec.encode(batch), format) == KVEventBatch(
        6.0,
        [
            BlockStored([H1], None, TOKENS, 4, None, None, None),
            BlockStored([H2], H1, TOKENS, 4, 2, "GPU", None, session_id="sess", metadata={"cache_salt": "s"}),
            BlockRemoved([H1], None),
        ],
        0,
    )


def test_reencoding_a_foreign_batch_gives_vllm_033_bytes():
    payload = msgspec.msgpack.encode(SglBatch(7.0, [SglStored([H1], None, TOKENS, 4, None)], 1))
    reencoded = events.encode_batch(events.decode_batch(payload))
    assert reencoded == msgspec.msgpack.encode(
        KVEventBatch(7.0, [BlockStored([H1], None, TOKENS, 4, None, None, None)], 1)
    )
    assert reencoded[11:14] == b"\xde\x00\x08"  # map16 event header, as vLLM 0.33 writes it


def test_the_map_form_copy_of_block_stored_keeps_every_field():
    # SGLang's map events decode through a copy with every field optional: a field added to
    # BlockStored and forgotten there would be dropped from those events without a word.
    from kvbridge.wire.events import BlockRemoved, BlockStored, _MapBlockRemoved, _MapBlockStored

    assert set(BlockStored.__struct_fields__) <= set(_MapBlockStored.__struct_fields__)
    assert set(BlockRemoved.__struct_fields__) <= set(_MapBlockRemoved.__struct_fields__)
