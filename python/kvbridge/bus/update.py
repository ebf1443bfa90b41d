"""What a subscriber delivers: :class:`Update` (one step of one worker's stream), its lazily
decoded body, and :class:`WorkerView` (what a worker holds, as its events say).

Reading a message's body is most of a subscriber's work, so a body is decoded only as far as
someone needs it (:class:`Body`); :func:`parse_event_msg` checks an event message's headers and
wraps its payload. No I/O: kvbridge.bus.subscriber does the ordering and the network.
"""

from __future__ import annotations

from typing import Any

from kvbridge._native import ReadBatch, ResidencyView, read_batch
from kvbridge.wire.events import BlockRemoved, BlockStored, DecodeError, KVEventBatch, decode_batch
from kvbridge.wire.residency import state_events, view_payload
from kvbridge.wire.subjects import FORMATS, HDR_CONTENT_TYPE, HDR_EPOCH, HDR_REPLY, HDR_SEQ, Format

__all__ = ["Body", "Update", "WorkerView", "decode", "parse_event_msg"]

_WITH_BLOCKS = (BlockStored, BlockRemoved)


class Body:
    """A message's batch, decoded only as far as someone needs it.

    A full decode builds Python objects for every event and token id (natively for vLLM's
    msgpack shape, ``kvbridge.wire.events.decode_batch``), most of a subscriber's work.
    vLLM-shaped msgpack payloads are read natively instead (``kvbridge._native.read_batch``, which
    validates the whole payload against the schema and keeps its events' hashes and what the
    residency rule reads, making no Python object per hash: ``read``, which a :class:`WorkerView`
    applies without reading the bytes again, then drops), and the KVEventBatch is decoded on first
    access to ``batch``. Everything else is decoded at once, so a malformed payload is rejected on
    arrival.
    """

    __slots__ = ("payload", "fmt", "_batch", "read", "ts", "rank", "n_events", "n_blocks")
    payload: bytes | None
    fmt: Format | None
    _batch: KVEventBatch | None

    def __init__(self, payload: bytes, fmt: Format, raw: bool = False) -> None:
        self.payload, self.fmt = payload, fmt
        self.read: ReadBatch | None = None
        if raw:
            # An Index reads the bytes itself: nothing is read or decoded unless asked for.
            self._batch = None
            return
        read = read_batch(payload) if fmt == "msgpack" and payload.__class__ is bytes else None
        if read is None:
            self._set_batch(decode(payload, fmt))
        else:
            self._batch, self.read = None, read
            self.ts, self.rank, self.n_events, self.n_blocks = read.ts, read.rank, read.n_events, read.n_blocks

    @classmethod
    def of(cls, batch: KVEventBatch) -> Body:
        body = cls.__new__(cls)
        body.payload, body.fmt, body.read = None, None, None
        body._set_batch(batch)
        return body

    def _set_batch(self, batch: KVEventBatch) -> None:
        self._batch = batch
        self.ts, self.rank, self.n_events = batch.ts, batch.data_parallel_rank, len(batch.events)
        self.n_blocks = sum(len(ev.block_hashes) for ev in batch.events if ev.__class__ in _WITH_BLOCKS)

    @property
    def batch(self) -> KVEventBatch:
        batch = self._batch
        if batch is None:
            # read_batch vouched for these bytes, so this decode cannot fail (a raw body's can:
            # DecodeError).
            batch = self._batch = decode(self.payload, self.fmt)  # type: ignore[arg-type]
        return batch

    def __getattr__(self, name: str) -> Any:
        # Only a raw body's unset slots get here: decode on first use.
        if name in ("ts", "rank", "n_events", "n_blocks"):
            self._set_batch(self.batch)
            return object.__getattribute__(self, name)
        raise AttributeError(name)


class Update:
    """One step of one worker's event stream, delivered exactly once, in seq order.

    ``reset=True``: forget everything known about this worker, then apply ``batch`` (a snapshot,
    a stream's start, a view handed to an iterator that fell behind); ``seq`` is then the seq the
    state is consistent with. ``source``: "live" | "replay" | "snapshot" | "stream" (an
    incarnation's start, JetStream) | "behind" (the state given to an iterator that fell behind)
    | "expired" (the worker was dropped: no events, ``seq`` -1).

    ``batch`` (the KVEventBatch) is decoded on first access; ``ts``, ``n_events`` and
    ``n_blocks`` (block hashes stored + removed) are known without decoding it, except for a
    payload read natively for an index (then decoded on first access: DecodeError if it is not
    one).
    """

    __slots__ = ("model", "worker", "epoch", "seq", "reset", "source", "_body")

    def __init__(
        self,
        model: str,
        worker: str,
        epoch: str,
        seq: int,
        batch: KVEventBatch | Body,
        reset: bool = False,
        source: str = "live",
    ) -> None:
        self.model, self.worker, self.epoch, self.seq = model, worker, epoch, seq
        self.reset, self.source = reset, source
        self._body = batch if batch.__class__ is Body else Body.of(batch)  # type: ignore[arg-type]

    @property
    def batch(self) -> KVEventBatch:
        return self._body.batch

    @property
    def ts(self) -> float:
        return self._body.ts

    @property
    def n_events(self) -> int:
        return self._body.n_events

    @property
    def n_blocks(self) -> int:
        return self._body.n_blocks

    def __repr__(self) -> str:
        try:  # a raw payload decodes here: a log line must not raise
            counts = f"events={self.n_events}, blocks={self.n_blocks}"
        except DecodeError:
            counts = "payload=undecodable"
        return (
            f"Update(model={self.model!r}, worker={self.worker!r}, epoch={self.epoch!r}, seq={self.seq}, "
            f"{counts}, reset={self.reset}, source={self.source!r})"
        )


class WorkerView:
    """What a worker holds, as its events say (no prefix structure): ``residency``, a hash-only
    :class:`kvbridge._native.ResidencyView` (``sources=False``: the rule of
    :mod:`kvbridge.wire.residency` run in Rust, read like a ``Residency``: per ``(medium,
    group)``, each hash's copies; each group's kind and largest block size; what was skipped),
    ``held`` (``{(medium, group): {hash: copies}}``), ``blocks`` (every hash held anywhere), and
    ``epoch`` / ``seq``, those of the last update applied."""

    __slots__ = ("residency", "epoch", "seq")

    def __init__(self) -> None:
        self.residency = ResidencyView(sources=False)
        self.epoch: str | None = None
        self.seq = -1

    @property
    def blocks(self) -> set[Any]:
        return self.residency.blocks()

    @property
    def held(self) -> dict[tuple[str | None, int], dict[Any, int]]:
        """``{(medium, group): {hash: copies}}``."""
        return self.residency.held

    def apply(self, update: Update) -> None:
        """Applies one update: a msgpack payload as read on arrival (``Body.read``), anything else
        (JSON, other engines' shapes, a batch built in Python) as its events."""
        body = update._body
        if update.reset:
            self.residency.clear()
        read = body.read
        if read is not None:
            self.residency.apply_read(read)
            body.read = None  # applied: its hashes are not kept with the update
        else:
            self.apply_events(body.batch.events)
        self.epoch, self.seq = update.epoch, update.seq

    def apply_events(self, events: list[Any]) -> None:
        """Applies decoded (or hand-built) events, encoded for the view (:func:`view_payload`).
        ValueError, applying none, for events whose bytes the view cannot read (a field of a type
        the wire does not have)."""
        if self.residency.apply(view_payload(events, lean=True)) is None:
            raise ValueError("events the view cannot read")

    def as_events(self) -> list[BlockStored]:
        """The state as events (:func:`kvbridge.wire.residency.state_events`: per ``(medium,
        group)`` one store of its hashes, a hash once per copy, without token ids; each group's kind
        and largest block size): what an iterator that fell behind is given."""
        return state_events(self.residency.held, self.residency.kinds, self.residency.sizes)


def parse_event_msg(headers: dict[str, str], data: bytes, raw: bool = False) -> tuple[str, int, Body]:
    """An event message's ``(epoch, seq, body)``; DecodeError when its headers (or, unless
    ``raw``, its payload) are not those of one."""
    epoch = headers.get(HDR_EPOCH)
    raw_seq = headers.get(HDR_SEQ)
    if HDR_REPLY in headers:
        raise DecodeError(f"a reply ({HDR_REPLY}: {headers[HDR_REPLY]!r}) on an events subject")
    if not epoch or raw_seq is None:
        raise DecodeError(f"missing {HDR_EPOCH} / {HDR_SEQ}")
    try:
        seq = int(raw_seq)
    except ValueError:
        raise DecodeError(f"{HDR_SEQ} {raw_seq!r} is not an integer") from None
    if seq < 0:
        raise DecodeError(f"{HDR_SEQ} {raw_seq!r} is negative")
    content_type = headers.get(HDR_CONTENT_TYPE)
    fmt = "msgpack" if content_type is None else FORMATS.get(content_type)
    if fmt is None:
        raise DecodeError(f"unknown Content-Type {content_type!r}")
    return epoch, seq, Body(data, fmt, raw)


def decode(payload: bytes, fmt: Format) -> KVEventBatch:
    # The GC stays on: pausing it here (as this once did) switches it off for every thread of the
    # application meanwhile. Structs are gc=False (untracked); the lists in them are tracked and
    # cost 3-30% of decode time (bench/decode_gc.py, bench/RESULTS.md).
    return decode_batch(payload, fmt)
