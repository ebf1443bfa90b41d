"""The publisher's framing rules: events in, message payloads out, each one the bus can carry.

No I/O, no clock, no asyncio: :class:`Framer` turns a run of events into ``Frame`` s and
:func:`number` gives them seqs in an :class:`~kvbridge.bus.outbox.Outbox`; the publisher only
calls them (tests/test_framer.py checks every rule in a table, without a broker). The rules:

* anything that is not an event (a hand-off list can change after ``publish()`` checked it) is
  dropped and counted (``invalid_events``) before anything is numbered: garbage never takes a seq;
* a message holds at most ``max_events`` events and ``max_bytes`` bytes. Runs are cut by a running
  bytes-per-event estimate (to 80% of ``max_bytes``) so that encoding twice stays rare; a payload
  over ``max_bytes`` anyway is thrown away and its events encoded again in halves;
* one event over ``max_bytes`` is cut into halves of its chain (``wire.events.slice_event``: each
  slice's parent is the block before it, so the slices applied in order are the event), counted
  once per event (``split_events``), whether for a live message or a snapshot;
* an event msgspec cannot write (an int beyond 64 bits...) is found by halves and dropped, counted
  as invalid; the rest of its run still goes out;
* a single block larger than the server's ``max_payload`` can never be delivered: it becomes a
  frame with no payload, which :func:`number` turns into a seq hole (consumers resync by
  snapshot), counted (``oversize_dropped``), instead of a message that would fail forever;
* a native pool's records (``KVCacheManager.take_record``) are written as msgpack from the
  records (``_native.encode_records``, the bytes ``encode_batch`` writes for their events) when
  they fit ``max_bytes`` (else in halves, records whole); a record over it alone, one
  ``encode_records`` leaves to msgspec, or JSON: its events are built and framed as above;
* a forwarded batch (``publish_batch`` with its bytes) goes as those bytes when they are msgpack
  and within ``max_payload``; otherwise it is encoded and cut like any other, and counted
  (``split_batches``) when its bytes were too large;
* a held message framed for a larger ``max_payload`` than the server's now (a reconnect to a server
  that takes less) is decoded and framed again by these rules (``refit``).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from kvbridge._native import EventRecord, encode_records
from kvbridge.bus.outbox import Outbox
from kvbridge.metrics import tally
from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, KVEventBatch
from kvbridge.wire.events import decode_batch, encode_batch, slice_event
from kvbridge.wire.subjects import Format

__all__ = ["EVENT_CLASSES", "Frame", "Framer", "number"]

log = logging.getLogger("kvbridge.publisher")

EVENT_CLASSES = frozenset((BlockStored, BlockRemoved, AllBlocksCleared))
# Runs are cut to this share of max_bytes by the running bytes-per-event estimate, so that an
# oversized encode (thrown away and redone in halves) stays rare.
_BYTES_HEADROOM = 0.8
# The server default max_payload, until the publisher learns the server's own.
_DEFAULT_MAX_PAYLOAD = 1 << 20


class Frame(NamedTuple):
    """One message to be: its encoded batch, or None for a seq hole (too large for the bus)."""

    payload: bytes | None
    n_events: int


class Framer:
    """The framing rules of one publisher (module doc); ``counts`` are its four counters."""

    def __init__(self, fmt: Format = "msgpack", *, max_events: int, max_bytes: int, dp_rank: int | None = None,
                 max_payload: int = _DEFAULT_MAX_PAYLOAD, name: str = "") -> None:  # fmt: skip
        self.format = fmt
        self.max_events = max_events
        self._max_bytes_wanted = max_bytes
        self.max_payload = self.max_bytes = 0
        self.limit(max_payload)
        self.dp_rank = dp_rank
        self.name = name  # for the logs: which publisher
        self.counts = dict.fromkeys(("invalid_events", "split_events", "split_batches", "oversize_dropped"), 0)
        self._bytes_per_event = 0.0  # running estimate, sizes runs before encoding them
        self._splitting = False  # inside the split of one oversize event (counted once)

    def limit(self, max_payload: int) -> None:
        """The largest payload the bus takes (the server's, less room for headers)."""
        self.max_payload = max_payload
        self.max_bytes = min(self._max_bytes_wanted, max_payload)

    # -- live messages -------------------------------------------------------------------------

    def frame(self, ts: float, events: list[Any], rank: int | None = None) -> list[Frame]:
        """The messages for ``events`` (one empty batch for none: a heartbeat), holes included;
        [] when nothing valid was given. ``rank`` None is the configured ``dp_rank``."""
        if not EVENT_CLASSES.issuperset(map(type, events)):
            valid = [ev for ev in events if type(ev) in EVENT_CLASSES]
            self._invalid(len(events) - len(valid), "not an event (BlockStored, BlockRemoved, AllBlocksCleared)")
            if not valid:
                return []
            events = valid
        return [self._carriable(payload, n) for payload, n in self.encode(ts, events, rank)]

    def records(self, ts: float, records: list[EventRecord], rank: int | None = None) -> list[Frame]:
        """The messages for the records' events, in order, as ``frame`` would make of them but
        each message whole records (module doc). ``rank`` None is the configured ``dp_rank``."""
        if rank is None:
            rank = self.dp_rank
        payload = encode_records(records, ts, rank) if self.format == "msgpack" else None
        n_events = sum(map(len, records))
        if payload is not None and len(payload) <= self.max_bytes and n_events <= self.max_events:
            return [Frame(payload, n_events)]
        if payload is not None and len(records) > 1:
            half = len(records) // 2
            return self.records(ts, records[:half], rank) + self.records(ts, records[half:], rank)
        return self.frame(ts, [ev for rec in records for ev in rec.events()], rank)

    def forwarded(self, batch: KVEventBatch | None, payload: bytes | None, n_events: int = 0) -> list[Frame]:
        """A batch handed over to go as a message of its own, as ``payload`` when that can go as it
        is. ``batch`` None: only the bytes were handed over (``n_events`` events in them), decoded
        only when they cannot go as they are; bytes that do not decode are dropped as invalid."""
        if payload is not None and self.format == "msgpack":
            if len(payload) <= self.max_payload:
                return [Frame(payload, n_events if batch is None else len(batch.events))]
            self.counts["split_batches"] += 1
        if batch is None:
            try:
                batch = decode_batch(payload)  # type: ignore[arg-type]
            except DecodeError as exc:
                self._invalid(n_events, f"a payload handed over is not a batch: {exc}")
                return []
        return self.frame(batch.ts, batch.events, batch.data_parallel_rank)

    def refit(self, payload: bytes, n_events: int) -> list[Frame]:
        """A message framed for a larger ``max_payload`` (its bytes in this framer's format), framed
        again within the current limit; bytes that do not decode are dropped as invalid."""
        try:
            batch = decode_batch(payload, self.format)
        except DecodeError as exc:
            self._invalid(n_events, f"a held message does not decode: {exc}")
            return []
        return self.frame(batch.ts, batch.events, batch.data_parallel_rank)

    def snapshot(self, ts: float, events: list[Any]) -> list[bytes]:
        """A snapshot's payloads: cut like live messages; a block too large for any message is left
        out (counted in ``oversize_dropped``), as it was a hole in the live stream: sent, the reply
        would fail every time and the requester would ask again forever."""
        frames = (self._carriable(payload, n, "left out of a snapshot") for payload, n in self.encode(ts, events))
        return [frame.payload for frame in frames if frame.payload is not None]

    def _carriable(self, payload: bytes, n_events: int, fate: str = "left as a seq hole") -> Frame:
        if len(payload) <= self.max_payload:
            return Frame(payload, n_events)
        self.counts["oversize_dropped"] += 1
        log.error("kvbridge: a %d-byte message cannot be sent (max_payload %d); %s",
                  len(payload), self.max_payload, fate)  # fmt: skip
        return Frame(None, n_events)

    # -- encoding within the limits (live messages and snapshots) -----------------------------

    def encode(self, ts: float, events: list[Any], rank: int | None = None) -> list[tuple[bytes, int]]:
        """``(payload, events in it)`` within the event and byte limits, in order (no hole: a
        snapshot sends what it has)."""
        if rank is None:
            rank = self.dp_rank
        out: list[tuple[bytes, int]] = []
        step = self.max_events
        if self._bytes_per_event > 0:
            step = max(1, min(step, int(self.max_bytes * _BYTES_HEADROOM / self._bytes_per_event)))
        for i in range(0, max(len(events), 1), step):
            self._within_bytes(ts, events[i : i + step], rank, out)
        if events:
            per_event = sum(len(payload) for payload, _ in out) / len(events)
            bpe = self._bytes_per_event
            self._bytes_per_event = 0.7 * bpe + 0.3 * per_event if bpe else per_event
        return out

    def _within_bytes(self, ts: float, events: list[Any], rank: int | None, out: list[tuple[bytes, int]]) -> None:
        try:
            payload = encode_batch(KVEventBatch(ts, events, rank), self.format)
        except (TypeError, ValueError, OverflowError) as exc:  # a value msgspec cannot write either
            if len(events) == 1:
                self._invalid(1, f"cannot encode {type(events[0]).__name__}: {exc}")
                return
            payload = b""  # find the culprit by halves; the rest still goes out
        if len(payload) > self.max_bytes or not payload:
            if len(events) > 1:
                half = len(events) // 2
                self._within_bytes(ts, events[:half], rank, out)
                self._within_bytes(ts, events[half:], rank, out)
                return
            # One event larger than a message may be: cut its chain into parent-linked slices.
            ev = events[0]
            n = len(getattr(ev, "block_hashes", ()))
            if n > 1:
                if not self._splitting:
                    self.counts["split_events"] += 1
                outer, self._splitting = self._splitting, True
                try:
                    self._within_bytes(ts, [slice_event(ev, 0, n // 2)], rank, out)
                    self._within_bytes(ts, [slice_event(ev, n // 2, n)], rank, out)
                finally:
                    self._splitting = outer
                return
        out.append((payload, len(events)))

    def _invalid(self, n: int, why: str) -> None:
        if tally(self.counts, "invalid_events", n) is not None or n > 1:
            log.warning("kvbridge publisher %s: %d invalid event(s) dropped before numbering (%d so far): %s",
                        self.name, n, self.counts["invalid_events"], why)  # fmt: skip


def number(outbox: Outbox, frames: list[Frame]) -> None:
    """Give each frame the next seq in ``outbox``: a frame without a payload takes a seq as a hole."""
    for payload, n_events in frames:
        if payload is None:
            outbox.skip()
        else:
            outbox.append(payload, n_events)
