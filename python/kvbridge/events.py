"""The KV-cache event schema, wire-identical to vLLM 0.33's ``vllm/distributed/kv_events.py``.

One msgspec Struct per concept. The struct options are part of the wire format: a batch is
array-like (``[ts, [events...], data_parallel_rank]``), events are tagged maps (``{"type":
"BlockStored", ...}``) whose trailing optional fields are omitted when they hold their default.
``lora_id``, ``medium`` and ``lora_name`` have no default in vLLM, so they are always written
(as nil when unset) -- giving them defaults here would change the bytes.

Decoding is more forgiving than encoding: it also accepts the older positional (array-encoded)
events that vLLM < 0.10 and SGLang publish, SGLang's map events, map-encoded batches, int or
bytes block hashes, and unknown extra fields (``kvbridge._compat``).

Encoding uses the native (Rust) encoder when it can, msgspec otherwise; the bytes are the same.
"""

from __future__ import annotations

from typing import Any, Union, overload

import msgspec

from kvbridge import _native
from kvbridge.errors import Error
from kvbridge.subjects import Format

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventBatch",
    "LoadReport",
    "MEDIUM_GPU",
    "decode_batch",
    "decode_load_report",
    "encode_batch",
    "encode_load_report",
    "slice_event",
]

#: vLLM publishes 64-bit ints (the last 8 bytes of the digest) or, in some modes, full digests.
ExternalBlockHash = Union[int, bytes]
MEDIUM_GPU = "GPU"


class DecodeError(Error, ValueError):
    """A payload that is not a KV event batch. The message says what was wrong."""


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event union; the tag field is ``type`` and holds the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks became cached, as one chain: ``block_hashes[0]``'s parent is ``parent_block_hash``."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    #: One entry per block: what vLLM mixed into that block's hash (LoRA name, mm hashes, salt).
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    #: Tokens beyond each block that vLLM's lookahead hashing mixed into its hash, one list per
    #: block; None when lookahead hashing is off.
    lookahead_token_ids: list[list[int]] | None = None
    #: SGLang's typed block metadata (``BlockStoredWithMetadata``), carried through as a map.
    #: vLLM 0.33's BlockStored has 15 fields, which makes msgspec write a map16 header
    #: (``de 00 0n``) rather than a fixmap: the field count is part of the bytes.
    metadata: dict[str, Any] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks were evicted from ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The worker's whole prefix cache was reset."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one engine step produced; one NATS message carries one batch."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_native_encode = _native.encode_batch_msgpack
_decoders: dict[str, msgspec.msgpack.Decoder[KVEventBatch] | msgspec.json.Decoder[KVEventBatch]] = {
    "msgpack": msgspec.msgpack.Decoder(KVEventBatch),
    "json": msgspec.json.Decoder(KVEventBatch),
}


def _check_format(format: str) -> None:
    if format not in _decoders:
        raise ValueError(f"format must be 'msgpack' or 'json', got {format!r}")


def encode_batch(batch: KVEventBatch, format: Format = "msgpack", *, native: bool | None = None) -> bytes:
    """Encode ``batch`` to the exact bytes vLLM publishes (msgpack), or the same structure as JSON.

    ``native`` chooses the msgpack encoder; both write identical bytes. ``None`` (the default, and
    the fastest) uses the Rust encoder and quietly hands the batch to msgspec when it holds a value
    the Rust encoder does not represent (it raises TypeError for those, never other bytes).
    ``True`` insists on the Rust encoder and lets that TypeError through; ``False`` is msgspec.
    Errors msgspec would raise too (an int beyond 64 bits, a lone surrogate) propagate either way.
    """
    _check_format(format)
    if not isinstance(batch, KVEventBatch):
        raise TypeError(f"batch must be a KVEventBatch, got {type(batch).__name__}")
    if format == "json":
        if native:
            raise ValueError("the native encoder writes msgpack only")
        return _json_encoder.encode(batch)
    if native is False:
        return _msgpack_encoder.encode(batch)
    try:
        return _native_encode(batch)
    except TypeError:
        if native:
            raise
    return _msgpack_encoder.encode(batch)


@overload
def slice_event(ev: BlockStored, first: int, end: int) -> BlockStored: ...
@overload
def slice_event(ev: BlockRemoved, first: int, end: int) -> BlockRemoved: ...
def slice_event(ev: BlockStored | BlockRemoved, first: int, end: int) -> BlockStored | BlockRemoved:
    """Blocks ``first:end`` of ``ev`` as an event of their own.

    A slice of a ``BlockStored`` is still one chain: its ``parent_block_hash`` is the hash of the
    block before it, so the slices of an event, applied in order, are the event. What is per
    block -- ``token_ids`` (``block_size`` each), ``extra_keys`` and ``lookahead_token_ids`` (one
    entry per block) -- is sliced with the blocks; a field that is not per block (an offload
    placeholder's empty ``token_ids``, anything of another length) goes whole with the last slice,
    empty lists stay empty. Used to cut events too large for one NATS message, and to cut a
    stored run out of an event for a snapshot.
    """
    n = len(ev.block_hashes)
    if first == 0 and end == n:
        return ev
    if isinstance(ev, BlockRemoved):
        return msgspec.structs.replace(ev, block_hashes=ev.block_hashes[first:end])
    last = end == n

    def per_block(values: Any, width: int, elsewhere: Any) -> Any:
        if values is None or len(values) != n * width:
            return values if last else elsewhere
        return values[first * width : end * width]

    changes: dict[str, Any] = {
        "block_hashes": ev.block_hashes[first:end],
        "parent_block_hash": ev.block_hashes[first - 1] if first else ev.parent_block_hash,
        "token_ids": per_block(ev.token_ids, ev.block_size, []),
        "extra_keys": per_block(ev.extra_keys, 1, None),
        "lookahead_token_ids": per_block(ev.lookahead_token_ids, 1, None),
    }
    return msgspec.structs.replace(ev, **changes)


def decode_batch(payload: bytes | bytearray | memoryview, format: Format = "msgpack") -> KVEventBatch:
    """Decode one batch. Anything that is not a batch raises :class:`DecodeError`, nothing else.

    vLLM 0.33's shape decodes in one pass; older vLLM and SGLang shapes (see ``kvbridge._compat``)
    take a second look only when that fails.
    """
    _check_format(format)
    try:
        return _decoders[format].decode(payload)
    except RecursionError:
        raise DecodeError(f"not a KVEventBatch ({format}): nested too deeply") from None
    except (msgspec.DecodeError, TypeError) as exc:
        first_error = exc
    from kvbridge._compat import decode_foreign  # imports this module: bind at first use

    batch = decode_foreign(payload, format)
    if batch is None:
        raise DecodeError(f"not a KVEventBatch ({format}): {first_error}") from None
    return batch


# -- load reports -----------------------------------------------------------------------------------
# Not part of vLLM's wire format: kvbridge's own message on <prefix>.load.<model>.<worker>, sent by
# kvbridge.vllm's stat logger. A map (field names on the wire) so that fields can be added.


class LoadReport(msgspec.Struct, kw_only=True, gc=False):
    """One engine's load as vLLM's scheduler counts it, at ``ts`` (wall clock, seconds).

    ``kv_cache_usage`` (0..1), ``running`` and ``waiting`` (vLLM's waiting gauge: waiting plus
    skipped-waiting requests) are gauges, the latest values. ``prefix_cache_queries`` and
    ``prefix_cache_hits`` (tokens) are counters since the previous report of the same API server
    (``api_rank``), over ``interval_s`` seconds: with several API servers each step's stats reach
    one of them, so a consumer takes the newest gauges and adds the counters.
    """

    ts: float
    kv_cache_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    interval_s: float = 0.0
    api_rank: int = 0
    engine_index: int = 0
    dp_rank: int | None = None


_load_decoders: dict[str, msgspec.msgpack.Decoder[LoadReport] | msgspec.json.Decoder[LoadReport]] = {
    "msgpack": msgspec.msgpack.Decoder(LoadReport),
    "json": msgspec.json.Decoder(LoadReport),
}


def encode_load_report(report: LoadReport, format: Format = "msgpack") -> bytes:
    _check_format(format)
    return (_json_encoder if format == "json" else _msgpack_encoder).encode(report)


def decode_load_report(payload: bytes | bytearray | memoryview, format: Format = "msgpack") -> LoadReport:
    """Decode one report; anything else raises :class:`DecodeError`."""
    _check_format(format)
    try:
        return _load_decoders[format].decode(payload)
    except (msgspec.DecodeError, TypeError, RecursionError) as exc:
        raise DecodeError(f"not a LoadReport ({format}): {exc}") from None
