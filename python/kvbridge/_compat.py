"""Decoding of the wire shapes other engines and older versions publish.

:func:`kvbridge.events.decode_batch` tries vLLM 0.33's exact shape first and comes here only
when that fails, so none of this costs anything on vLLM 0.33 traffic. Each shape below is
what a real publisher's msgspec Structs produce:

- positional events (``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium,
  lora_name]``): vLLM < 0.10, with fewer trailing fields the older it is; SGLang's
  array-like events, where an 8th element is ``BlockStoredWithMetadata``'s metadata map and
  the batch's third element is ``attn_dp_rank``;
- tagged-map events that lack fields vLLM 0.33 always writes (``medium``, ``lora_name``):
  SGLang's map events, whose ``cache_salt`` is carried into ``metadata``;
- a map-encoded batch (``{"ts": ..., "events": [...], "data_parallel_rank": ...}``), as
  vLLM builds without ``array_like`` on ``EventBatch`` publish.

msgspec cannot mix array-like and map-like structs in one union, hence one decoder per shape.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from kvbridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    ExternalBlockHash,
    KVEventBatch,
)

# --- positional events ----------------------------------------------------------------------


class _PosEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class _PosBlockStored(_PosEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    # vLLM writes lora_name here; SGLang's BlockStoredWithMetadata writes a metadata map instead.
    lora_name_or_metadata: Any = None


class _PosBlockRemoved(_PosEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None


class _PosAllBlocksCleared(_PosEvent, tag="AllBlocksCleared"):
    pass


class _PosBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[_PosBlockStored, _PosBlockRemoved, _PosAllBlocksCleared]]
    data_parallel_rank: int | None = None


# --- map events with every field optional ---------------------------------------------------


class _MapEvent(msgspec.Struct, gc=False, tag=True):
    pass


class _MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None
    metadata: dict[str, Any] | None = None
    cache_salt: str | None = None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


_MapEvents = list[Union[_MapBlockStored, _MapBlockRemoved, _MapAllBlocksCleared]]


class _MapEventsBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: _MapEvents
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct, gc=False):
    ts: float
    events: _MapEvents
    data_parallel_rank: int | None = None


# --- conversion to the canonical structs ----------------------------------------------------


def _stored_from_map(ev: _MapBlockStored) -> BlockStored:
    fields = msgspec.structs.asdict(ev)
    salt = fields.pop("cache_salt")
    if salt is not None:
        fields["metadata"] = {**(fields["metadata"] or {}), "cache_salt": salt}
    return BlockStored(**fields)


def _stored_from_positional(ev: _PosBlockStored) -> BlockStored:
    extra = ev.lora_name_or_metadata
    return BlockStored(
        block_hashes=ev.block_hashes,
        parent_block_hash=ev.parent_block_hash,
        token_ids=ev.token_ids,
        block_size=ev.block_size,
        lora_id=ev.lora_id,
        medium=ev.medium,
        lora_name=extra if isinstance(extra, str) else None,
        metadata=extra if isinstance(extra, dict) else None,
    )


def _canonical(ev: Any) -> Event:
    if isinstance(ev, _MapBlockStored):
        return _stored_from_map(ev)
    if isinstance(ev, _PosBlockStored):
        return _stored_from_positional(ev)
    if isinstance(ev, _MapBlockRemoved):
        return BlockRemoved(**msgspec.structs.asdict(ev))
    if isinstance(ev, _PosBlockRemoved):
        return BlockRemoved(block_hashes=ev.block_hashes, medium=ev.medium)
    return AllBlocksCleared()


def _decoders(module: Any) -> list[Any]:
    return [module.Decoder(shape) for shape in (_MapEventsBatch, _PosBatch, _MapBatch)]


_DECODERS = {"msgpack": _decoders(msgspec.msgpack), "json": _decoders(msgspec.json)}


def decode_foreign(payload: Any, format: str) -> KVEventBatch | None:
    """The batch in any of the shapes above, or None when it is none of them."""
    for decoder in _DECODERS[format]:
        try:
            batch = decoder.decode(payload)
        except (msgspec.DecodeError, TypeError, RecursionError):
            continue
        return KVEventBatch(
            ts=batch.ts,
            events=[_canonical(ev) for ev in batch.events],
            data_parallel_rank=batch.data_parallel_rank,
        )
    return None
