"""What a subscriber delivers: :class:`Update` (one step of one worker's stream), its lazily
decoded body, and :class:`WorkerView` (what a worker holds, as its events say).

Reading a message's body is most of a subscriber's work, so a body is decoded only as far as
someone needs it (:class:`Body`); :func:`parse_event_msg` checks an event message's headers and
wraps its payload. No I/O: kvbridge.bus.subscriber does the ordering and the network.
"""

from __future__ import annotations

from typing import Any

from kvbridge._native import scan_batch_msgpack
from kvbridge.wire.events import DecodeError, KVEventBatch, decode_batch
from kvbridge.wire.residency import Residency, ops_of
from kvbridge.wire.subjects import FORMATS, HDR_CONTENT_TYPE, HDR_EPOCH, HDR_REPLY, HDR_SEQ, Format

__all__ = ["Body", "Update", "WorkerView", "decode", "parse_event_msg"]

_scan = scan_batch_msgpack


class Body:
    """A message's batch, decoded only as far as someone needs it.

    Views need only the block hashes and what the residency rule reads (medium, group, kind,
    window, parent None-ness: ``kvbridge.wire.residency.Op``); a full decode builds a Python int for every token id, which
    is most of a subscriber's work. vLLM-shaped msgpack payloads are scanned natively instead
    (``kvbridge._native.scan_batch_msgpack``, which validates the whole payload against the schema), and
    the KVEventBatch is decoded on first access to ``batch``. Everything else is decoded at once,
    as before, so a malformed payload is still rejected on arrival.
    """

    __slots__ = ("payload", "fmt", "_batch", "ts", "rank", "n_events", "n_blocks", "ops")
    payload: bytes | None
    fmt: Format | None
    _batch: KVEventBatch | None

    def __init__(self, payload: bytes, fmt: Format, raw: bool = False) -> None:
        self.payload, self.fmt = payload, fmt
        if raw:
            # An Index reads the bytes itself: nothing is scanned or decoded unless asked for.
            self._batch = None
            return
        scanned = _scan(payload) if fmt == "msgpack" and payload.__class__ is bytes else None
        if scanned is None:
            self._set_batch(decode(payload, fmt))
        else:
            self._batch = None
            self.ts, self.rank, self.n_events, self.n_blocks, self.ops = scanned

    @classmethod
    def of(cls, batch: KVEventBatch) -> Body:
        body = cls.__new__(cls)
        body.payload, body.fmt = None, None
        body._set_batch(batch)
        return body

    def _set_batch(self, batch: KVEventBatch) -> None:
        self._batch = batch
        self.ts, self.rank, self.n_events = batch.ts, batch.data_parallel_rank, len(batch.events)
        self.ops, self.n_blocks = ops_of(batch.events)

    @property
    def batch(self) -> KVEventBatch:
        batch = self._batch
        if batch is None:
            # The scan vouched for these bytes, so this decode cannot fail (a raw body's can:
            # DecodeError).
            batch = self._batch = decode(self.payload, self.fmt)  # type: ignore[arg-type]
        return batch

    def __getattr__(self, name: str) -> Any:
        # Only a raw body's unset slots get here: decode on first use.
        if name in ("ts", "rank", "n_events", "n_blocks", "ops"):
            self._set_batch(self.batch)
            return object.__getattribute__(self, name)
        raise AttributeError(name)


class Update:
    """One step of one worker's event stream, delivered exactly once, in seq order.

    ``reset=True`` (snapshots): forget everything known about this worker, then apply ``batch``;
    ``seq`` is then the seq the snapshot is consistent with. ``source``: "live" | "replay" |
    "snapshot" | "stream" (an incarnation's start, JetStream).

    ``batch`` (the KVEventBatch) is decoded on first access; ``ts``, ``n_events`` and
    ``n_blocks`` (block hashes stored + removed) are known without decoding it.
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
        return (
            f"Update(model={self.model!r}, worker={self.worker!r}, epoch={self.epoch!r}, seq={self.seq}, "
            f"events={self.n_events}, blocks={self.n_blocks}, reset={self.reset}, source={self.source!r})"
        )


class WorkerView:
    """What a worker holds, as its events say (no prefix structure): ``residency``, a
    :class:`~kvbridge.wire.residency.Residency` (per ``(medium, group)``, each hash's copies; each
    group's kind; what was skipped), and ``blocks``, the hashes held anywhere."""

    __slots__ = ("residency", "epoch", "seq")

    def __init__(self) -> None:
        self.residency = Residency()
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
        if update.reset:
            self.residency.clear()
        self.residency.apply_ops(update._body.ops)
        self.epoch, self.seq = update.epoch, update.seq

    def apply_events(self, events: list[Any]) -> None:
        self.residency.apply(events)


def parse_event_msg(headers: dict[str, str], data: bytes, raw: bool = False) -> tuple[str, int, Body]:
    """An event message's ``(epoch, seq, body)``; DecodeError when its headers (or, unless
    ``raw``, its payload) are not those of one."""
    epoch = headers.get(HDR_EPOCH)
    raw_seq = headers.get(HDR_SEQ)
    if not epoch or raw_seq is None or HDR_REPLY in headers:
        raise DecodeError("missing Kv-Epoch / Kv-Seq")
    try:
        seq = int(raw_seq)
    except ValueError:
        raise DecodeError("Kv-Seq is not an integer") from None
    if seq < 0:
        raise DecodeError("negative Kv-Seq")
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
