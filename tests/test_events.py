import os

import msgspec
import pytest
from event_strategies import batches
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.wire import events
from kvbridge.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    KVEventBatch,
    decode_batch,
    encode_batch,
    slice_event,
)


def test_vllm_batches_roundtrip_byte_identical(load_vectors):
    vectors = load_vectors("vllm_event_batches.json")["vectors"]
    assert vectors
    for vec in vectors:
        payload = bytes.fromhex(vec["payload_hex"])
        batch = events.decode_batch(payload)
        assert events.encode_batch(batch) == payload, vec["name"]
        assert len(batch.events) == len(vec["decoded"][1])


def test_zmq_frame_payloads_roundtrip(load_vectors):
    for frame in load_vectors("vllm_zmq_frames.json")["frames"]:
        payload = bytes.fromhex(frame["payload_hex"])
        assert events.encode_batch(events.decode_batch(payload)) == payload


def test_json_mode_roundtrip(load_vectors):
    for vec in load_vectors("vllm_event_batches.json")["vectors"]:
        batch = events.decode_batch(bytes.fromhex(vec["payload_hex"]))
        assert events.decode_batch(events.encode_batch(batch, "json"), "json") == batch


def test_positional_and_sglang_events_decode():
    payload = msgspec.msgpack.encode(
        [
            2.5,
            [
                ["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, "GPU", "lora-x"],
                ["BlockStored", [3], 2, [5, 6], 2, None, "CPU_PINNED", {"prefill_len": 2}],
                ["BlockRemoved", [5]],
                ["AllBlocksCleared"],
            ],
            1,
        ]
    )
    batch = events.decode_batch(payload)
    assert batch.data_parallel_rank == 1
    first, second, removed, cleared = batch.events
    assert first == BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", "lora-x")
    assert second.metadata == {"prefill_len": 2} and second.lora_name is None
    assert removed == BlockRemoved([5], None)
    assert isinstance(cleared, AllBlocksCleared)


def test_unknown_fields_ignored_and_bytes_hashes():
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [b"\x01" * 32, 7], "medium": "GPU", "future": [1]}]]
    )
    (ev,) = events.decode_batch(payload).events
    assert ev.block_hashes == [b"\x01" * 32, 7]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"\x93",
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"], "medium": None}]]),
        msgspec.msgpack.encode(["ts", []]),
        "not bytes",
    ],
)
def test_garbage_raises_decode_error(payload):
    with pytest.raises(DecodeError) as info:
        events.decode_batch(payload)
    assert isinstance(info.value, ValueError)
    assert "KVEventBatch" in str(info.value)


def test_bad_format_and_batch_type():
    with pytest.raises(ValueError, match="format"):
        events.encode_batch(KVEventBatch(1.0, []), "yaml")
    with pytest.raises(TypeError, match="KVEventBatch"):
        events.encode_batch([1.0, []])


# --- properties over random batches ---------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(batches("msgpack"))
def test_msgpack_roundtrip(batch):
    assert events.decode_batch(events.encode_batch(batch)) == batch


@settings(max_examples=300, deadline=None)
@given(batches("json"))
def test_json_roundtrip(batch):
    assert events.decode_batch(events.encode_batch(batch, "json"), "json") == batch


# --- whatever arrives, the only failure is DecodeError --------------------------------------


def _assert_batch_or_decode_error(payload, format="msgpack"):
    try:
        batch = events.decode_batch(payload, format)
    except DecodeError as exc:
        assert str(exc).startswith(f"not a KVEventBatch ({format}): ") and len(str(exc)) > 30
    else:
        assert isinstance(batch, KVEventBatch)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400), st.sampled_from(["msgpack", "json"]))
def test_random_bytes(payload, format):
    _assert_batch_or_decode_error(payload, format)


@settings(max_examples=200, deadline=None)
@given(batches("any"), st.data())
def test_corrupted_payloads(batch, data):
    payload = bytearray(events.encode_batch(batch))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(payload) - 1))
        payload[at] = data.draw(st.integers(0, 255))
    _assert_batch_or_decode_error(bytes(payload))


def test_every_truncation_of_every_vector(load_vectors):
    payloads = [v["payload_hex"] for v in load_vectors("vllm_event_batches.json")["vectors"]]
    payloads += [f["payload_hex"] for f in load_vectors("vllm_zmq_frames.json")["frames"]]
    for payload in map(bytes.fromhex, payloads):
        as_json = events.encode_batch(events.decode_batch(payload), "json")
        for format, full in (("msgpack", payload), ("json", as_json)):
            for end in range(len(full)):
                with pytest.raises(DecodeError, match="KVEventBatch"):
                    events.decode_batch(full[:end], format)


def _batch_with(event):
    return msgspec.msgpack.encode([1.0, [event], None])


_STORED = {
    "type": "BlockStored",
    "block_hashes": [1],
    "parent_block_hash": None,
    "token_ids": [1, 2],
    "block_size": 2,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_hashes", ["x"]),
        ("block_hashes", [1.5]),
        ("block_hashes", 7),
        ("parent_block_hash", [1]),
        ("token_ids", [1.5]),
        ("token_ids", "abc"),
        ("token_ids", None),
        ("block_size", None),
        ("block_size", "16"),
        ("lora_id", "x"),
        ("medium", 5),
        ("lora_name", b"x"),
        ("extra_keys", [5]),
        ("extra_keys", {"a": 1}),
        ("group_idx", "0"),
        ("kv_cache_spec_sliding_window", 1.0),
        ("metadata", [1]),
        ("type", 5),
        ("type", "BlockEvicted"),
    ],
)
def test_wrong_types_inside_events(field, value):
    with pytest.raises(DecodeError, match="KVEventBatch"):
        events.decode_batch(_batch_with({**_STORED, field: value}))


@pytest.mark.parametrize(
    "payload",
    [
        _batch_with({k: v for k, v in _STORED.items() if k != "block_size"}),
        _batch_with({"type": "BlockRemoved"}),
        _batch_with(["BlockStored", [1]]),
        _batch_with(5),
        _batch_with(None),
        msgspec.msgpack.encode([1.0, {"type": "AllBlocksCleared"}, None]),
        msgspec.msgpack.encode([None, [], None]),
        msgspec.msgpack.encode([1.0, [], "rank"]),
        msgspec.msgpack.encode({"ts": 1.0, "events": "none"}),
        msgspec.msgpack.encode([]),
        msgspec.msgpack.encode(1.0),
        b"\x93\xcb" + b"\x00" * 8 + b"\x90\xc0" + b"trailing",
    ],
)
def test_malformed_batches(payload):
    with pytest.raises(DecodeError, match="KVEventBatch"):
        events.decode_batch(payload)


_MB = 1 << 20
_DEEP_EXTRA_KEYS = _batch_with({**_STORED, "extra_keys": None})[:-2] + b"\x91" * _MB


@pytest.mark.parametrize(
    "payload, format",
    [
        (os.urandom(_MB), "msgpack"),
        (os.urandom(_MB), "json"),
        (b"\x00" * _MB, "msgpack"),
        (b"\x91" * _MB, "msgpack"),  # a million nested arrays
        (_DEEP_EXTRA_KEYS, "msgpack"),  # ... where the schema says Any
        (b"[" * _MB, "json"),
        (b'[1.0,[{"type":"BlockStored","metadata":{"a":' + b"[" * _MB, "json"),
        (b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff" + b"\x80" * _MB, "msgpack"),  # 4G events claimed
        (b"\x93\xcb" + b"\x00" * 8 + b"\x90\xc0" + os.urandom(_MB), "msgpack"),  # valid, then junk
        (msgspec.msgpack.encode([1.0, [{**_STORED, "medium": "x" * _MB, "block_size": "2"}]]), "msgpack"),
    ],
    ids=["random", "random-json", "zeros", "nested", "nested-in-any", "nested-json", "nested-json-any",
         "huge-count", "trailing", "big-string"],
)
def test_megabyte_blobs(payload, format):
    assert len(payload) >= _MB
    with pytest.raises(DecodeError, match="KVEventBatch"):
        events.decode_batch(payload, format)


def test_vllm_033_lookahead_token_ids_roundtrip_byte_identical():
    from engine_shapes import VllmBatch, VllmBlockRemoved, VllmBlockStored

    from kvbridge import _native

    stored = VllmBlockStored(
        [11, 12], 10, list(range(8)), 4, None, "GPU", None, session_id="s", lookahead_token_ids=[[8, 9], [70000]]
    )
    payload = msgspec.msgpack.encode(VllmBatch(1.5, [stored, VllmBlockRemoved([10], "GPU")], 0))
    batch = events.decode_batch(payload)
    assert batch.events[0].lookahead_token_ids == [[8, 9], [70000]]
    assert batch.events[0].session_id == "s" and batch.events[0].metadata is None
    for native in (None, True, False):
        assert events.encode_batch(batch, native=native) == payload
    assert events.decode_batch(events.encode_batch(batch, "json"), "json") == batch
    ts, rank, n_events, n_blocks, _ = _native.scan_batch_msgpack(payload)  # the fast path takes it too
    assert (ts, rank, n_events, n_blocks) == (1.5, 0, 2, 3)


# -- slicing an event into parent-linked pieces --------------------------------------------------


@st.composite
def _stored_and_cuts(draw):
    n = draw(st.integers(1, 12))
    bs = draw(st.integers(1, 4))
    hashes = draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n, unique=True))
    per_block_tokens = draw(st.booleans())
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * bs, max_size=n * bs)) if per_block_tokens else []
    extra = draw(st.none() | st.lists(st.none() | st.tuples(st.text(max_size=3)), min_size=n, max_size=n))
    look = draw(st.none() | st.lists(st.lists(st.integers(0, 9), max_size=3), min_size=n, max_size=n))
    ev = BlockStored(hashes, draw(st.none() | st.integers(0, 9)), tokens, bs, None, "GPU", "lora", extra_keys=extra,
                     lookahead_token_ids=look)  # fmt: skip
    cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=n)) if n > 1 else []))
    return ev, [0, *cuts, n]


@settings(max_examples=200, deadline=None)
@given(_stored_and_cuts())
def test_slices_of_a_stored_event_are_the_event(case):
    ev, bounds = case
    parts = [slice_event(ev, a, b) for a, b in zip(bounds, bounds[1:])]
    assert [h for p in parts for h in p.block_hashes] == ev.block_hashes
    parent = ev.parent_block_hash
    for p in parts:  # one chain: each slice hangs off the block before it
        assert p.parent_block_hash == parent
        parent = p.block_hashes[-1]
    assert [t for p in parts for t in p.token_ids] == ev.token_ids
    if ev.extra_keys is not None:
        assert [k for p in parts for k in p.extra_keys] == ev.extra_keys
    if ev.lookahead_token_ids is not None:
        assert [k for p in parts for k in p.lookahead_token_ids] == ev.lookahead_token_ids
    assert all(p.lora_name == "lora" and p.medium == "GPU" and p.block_size == ev.block_size for p in parts)
    # Each slice is a valid event on the wire.
    batch = KVEventBatch(1.0, parts)
    assert decode_batch(encode_batch(batch)) == batch


def test_slices_of_a_removal_are_the_removal():
    ev = BlockRemoved(list(range(10)), "GPU")
    parts = [slice_event(ev, 0, 3), slice_event(ev, 3, 10)]
    assert [h for p in parts for h in p.block_hashes] == list(range(10))
    assert slice_event(ev, 0, 10) is ev
