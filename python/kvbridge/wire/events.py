"""The KV-cache event schema, wire-identical to vLLM 0.33's ``vllm/distributed/kv_events.py``.

One msgspec Struct per concept. The struct options are part of the wire format: a batch is
array-like (``[ts, [events...], data_parallel_rank]``), events are tagged maps (``{"type":
"BlockStored", ...}``) whose trailing optional fields are omitted when they hold their default.
``lora_id``, ``medium`` and ``lora_name`` have no default in vLLM, so they are always written
(as nil when unset) -- giving them defaults here would change the bytes.

Decoding is more forgiving than encoding: it also accepts the older positional (array-encoded)
events that vLLM < 0.10 and SGLang publish, SGLang's map events, map-encoded batches, int or
bytes block hashes, and unknown extra fields (the "foreign shapes" section at the end).

Encoding uses the native (Rust) encoder when it can, msgspec otherwise; the bytes are the same.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, TypeVar, Union, overload

import msgspec

from kvbridge._native import BatchDecoder, encode_batch_msgpack
from kvbridge.errors import Error
from kvbridge.wire.subjects import Format

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
    "merge_runs",
    "slice_event",
]

#: vLLM publishes 64-bit ints (the last 8 bytes of the digest) or, in some modes, full digests.
ExternalBlockHash = Union[int, bytes]
MEDIUM_GPU = "GPU"
R = TypeVar("R")


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
_native_encode = encode_batch_msgpack
_decoders: dict[str, msgspec.msgpack.Decoder[KVEventBatch] | msgspec.json.Decoder[KVEventBatch]] = {
    "msgpack": msgspec.msgpack.Decoder(KVEventBatch),
    "json": msgspec.json.Decoder(KVEventBatch),
}


# vLLM 0.33's msgpack shape, decoded natively with one shared int per token id value (msgspec
# makes a fresh int per token id, most of its time on these batches): equal to msgspec's decode,
# which takes over for anything it does not read (rust/decode.rs).
_native_decode = BatchDecoder(KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared).decode


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


def merge_runs(blocks: Iterable[tuple[R, int]], cut: Callable[[R, int, int], BlockStored]) -> list[BlockStored]:
    """Blocks given as ``(run, index in run)`` in snapshot order, back into as few ``BlockStored``
    as they were stored in: consecutive blocks of one run become one event, ``cut(run, first,
    end)``. Pool and relay snapshots both end here, so a long chain is a few events, not one per
    block."""
    out: list[BlockStored] = []
    run: Any = None
    first = end = 0
    for r, i in blocks:
        if r is run and i == end:
            end += 1
            continue
        if run is not None:
            out.append(cut(run, first, end))
        run, first, end = r, i, i + 1
    if run is not None:
        out.append(cut(run, first, end))
    return out


def decode_batch(payload: bytes | bytearray | memoryview, format: Format = "msgpack") -> KVEventBatch:
    """Decode one batch. Anything that is not a batch raises :class:`DecodeError`, nothing else.

    vLLM 0.33's shape decodes in one pass (msgpack ``bytes``: natively, token ids sharing one
    int object per value; the result is equal to msgspec's); older vLLM and SGLang shapes (the
    "foreign shapes" section below) take a second look only when that fails.
    """
    _check_format(format)
    if format == "msgpack" and payload.__class__ is bytes:
        batch: KVEventBatch | None = _native_decode(payload)  # type: ignore[assignment]
        if batch is not None:
            return batch
    try:
        return _decoders[format].decode(payload)
    except RecursionError:
        raise DecodeError(f"not a KVEventBatch ({format}): nested too deeply") from None
    except (msgspec.DecodeError, TypeError) as exc:
        first_error = exc
    batch = _decode_foreign(payload, format)
    if batch is None:
        raise DecodeError(f"not a KVEventBatch ({format}): {first_error}") from None
    return batch


# -- load reports -----------------------------------------------------------------------------------
# Not part of vLLM's wire format: kvbridge's own message on <prefix>.load.<model>.<worker>, sent by
# kvbridge.vllm's stat logger. A map (field names on the wire) so that fields can be added.


class LoadReport(msgspec.Struct, kw_only=True, gc=False):
    """One engine's load as vLLM's scheduler counts it, reported at ``ts`` (wall clock, seconds).

    ``kv_cache_usage`` (0..1), ``running`` and ``waiting`` (vLLM's waiting gauge: waiting plus
    skipped-waiting requests) are gauges, the latest values. ``prefix_cache_queries`` and
    ``prefix_cache_hits`` (tokens) are counters since the previous report of the same API server
    (``api_rank``), over ``interval_s`` seconds: with several API servers each step's stats reach
    one of them, so a consumer takes the freshest gauges and adds the counters: ``gauges_ts`` is
    when the gauges were read (the wall time of the last step whose stats reached this API
    server, or of its start while none has: zeros; None: at ``ts``), which for an API server the
    steps have not reached lately is well before ``ts``. ``dp_rank`` and ``url`` say where a request for this worker goes: ``url``, with
    vLLM's ``X-data-parallel-rank: <dp_rank>`` header.
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
    #: The engine's OpenAI-compatible API server as clients reach it (``http://host:port``), for a
    #: gateway (``kvbridge proxy``) to forward requests to; None when unknown. Last, defaulted:
    #: reports without it still decode.
    url: str | None = None
    gauges_ts: float | None = None


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


# --- foreign shapes ----------------------------------------------------------------------------
#
# decode_batch() tries vLLM 0.33's exact shape first and comes here only when that fails, so none
# of this costs anything on vLLM 0.33 traffic. Each shape below is what a real publisher's
# msgspec Structs produce:
#
# - positional events (["BlockStored", hashes, parent, tokens, block_size, lora_id, medium,
#   lora_name]): vLLM < 0.10, with fewer trailing fields the older it is; SGLang's array-like
#   events, where an 8th element is BlockStoredWithMetadata's metadata map and the batch's third
#   element is attn_dp_rank;
# - tagged-map events that lack fields vLLM 0.33 always writes (medium, lora_name): SGLang's map
#   events, whose cache_salt is carried into metadata;
# - a map-encoded batch ({"ts": ..., "events": [...], "data_parallel_rank": ...}), as vLLM builds
#   without array_like on EventBatch publish.
#
# msgspec cannot mix array-like and map-like structs in one union, hence one decoder per shape.


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


def _canonical(ev: Any) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if isinstance(ev, _MapBlockStored):
        return _stored_from_map(ev)
    if isinstance(ev, _PosBlockStored):
        return _stored_from_positional(ev)
    if isinstance(ev, _MapBlockRemoved):
        return BlockRemoved(**msgspec.structs.asdict(ev))
    if isinstance(ev, _PosBlockRemoved):
        return BlockRemoved(block_hashes=ev.block_hashes, medium=ev.medium)
    return AllBlocksCleared()


def _foreign_decoders(module: Any) -> list[Any]:
    return [module.Decoder(shape) for shape in (_MapEventsBatch, _PosBatch, _MapBatch)]


_FOREIGN_DECODERS = {"msgpack": _foreign_decoders(msgspec.msgpack), "json": _foreign_decoders(msgspec.json)}


def _decode_foreign(payload: Any, format: str) -> KVEventBatch | None:
    """The batch in any of the shapes above, or None when it is none of them."""
    for decoder in _FOREIGN_DECODERS[format]:
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
