"""The publisher's loop side, first step: queued hand-offs become numbered messages in the ring.

Hand-offs are coalesced in queue order into runs of events (a native pool's records kept as
records), framed by :mod:`kvbridge.bus.framer` and given seqs in the
:class:`~kvbridge.bus.outbox.Outbox`; a loss marked by ``mark_loss()`` and dropped hand-offs
become seq holes where they stand, and a snapshot's cut marks the seq its snapshot is consistent
with. Messages are framed for the server's
``max_payload``, read from every connection anew: held messages a smaller one refuses are
re-framed (``_refit``). Each message's header block is made here too, for the live send and the
replay alike. Nothing here awaits: the sender (:mod:`kvbridge.bus.sender`) and the replay and
snapshot answers (:mod:`kvbridge.bus.answers`) call it on the loop.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from kvbridge._native import EventRecord
from kvbridge.config import Config
from kvbridge.bus.framer import Frame, Framer, number
from kvbridge.bus.handoff import CUT, HOLE, HandOff, Own
from kvbridge.bus.outbox import Outbox
from kvbridge.wire.subjects import (
    CONTENT_TYPES,
    HDR_CONTENT_TYPE,
    HDR_EPOCH,
    HDR_HEARTBEAT,
    HDR_MSG_ID,
    HDR_SEQ,
    WorkerSubjects,
)

__all__ = ["Coalescer"]

log = logging.getLogger("kvbridge.publisher")

# Room left in the server's max_payload for the headers (NATS counts them in): ours are < 200 B.
_HEADER_ROOM = 1024


class Coalescer(HandOff):
    """Hand-offs to the ring's numbered messages, within the server's ``max_payload``."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.config = config
        #: A fresh random id per incarnation: consumers drop their view of this worker when it changes.
        self.epoch = secrets.token_hex(8)
        self.subjects = WorkerSubjects.build(config.subject_prefix, config.model, config.worker_id)
        self._nc: Any = None  # the connection, whose server's max_payload the messages fit
        self._outbox = Outbox(config.ring_buffer_bytes)
        self._dropped_seen = 0
        self._last_emit = 0.0
        self._max_events = config.max_batch_events
        self._max_payload = 1 << 20
        self._framer = Framer(config.encoding, max_events=config.max_batch_events, max_bytes=config.max_batch_bytes,
                              dp_rank=config.dp_rank, max_payload=self.max_payload, name=config.worker_id)  # fmt: skip
        self._content_type = CONTENT_TYPES[config.encoding]
        # An event message's headers (live and replayed: _header_block) as the block on the wire,
        # all but the seq made once (kvbridge.bus.natsclient: nats-py would check and encode five
        # headers per message).
        self._block_parts = (
            f"NATS/1.0\r\n{HDR_SEQ}: ".encode(),
            f"\r\n{HDR_EPOCH}: {self.epoch}\r\n{HDR_MSG_ID}: {config.worker_id}:{self.epoch}:".encode(),
            f"\r\n{HDR_CONTENT_TYPE}: {self._content_type}\r\n{HDR_HEARTBEAT}: {config.heartbeat_s:g}\r\n\r\n".encode(),
        )
        self._counts = dict.fromkeys(("max_payload_changes", "refitted"), 0)

    @property
    def max_payload(self) -> int:
        """The largest payload one message may carry: the server's max_payload less room for
        our headers (read at start and on every reconnect; 1 MiB, the server default, before)."""
        return self._max_payload - _HEADER_ROOM

    def _drain(self) -> int:
        """Turn queued hand-offs into ring messages; returns the seq of the last message made before
        a snapshot's cut marker (or the last seq, without one). Runs on the loop without awaiting,
        so nothing else on the loop sees a half-drained state."""
        q = self._queue
        at_cut = None
        max_events = self._max_events
        ts = 0.0
        pending: list[Any] = []
        # Consecutive native pool records, framed from the records (never with `pending`: a list
        # hand-off after them makes them events, a record after a list is made events).
        records: list[EventRecord] = []
        n_records = 0
        popleft = q.popleft
        for _ in range(len(q)):  # only what is there now: engines may keep appending
            if self._dropped_batches != self._dropped_seen:
                # Engine hand-offs were dropped ahead of what follows: put the hole right here so
                # consumers resync. (A cut still queued is behind the drops: its seq lands after.)
                if pending or records:
                    self._emit(ts, pending, records=records)
                    pending, records, n_records = [], [], 0
                self._dropped_seen = self._dropped_batches
                self._skip_seq()
            try:
                item = popleft()
            except IndexError:  # dropped under us
                break
            if item.__class__ is not tuple:  # a marker, or a batch that stays a message of its own
                if pending or records:
                    self._emit(ts, pending, records=records)
                    pending, records, n_records = [], [], 0
                if item is CUT:
                    at_cut = self._outbox.last_seq
                elif item is HOLE:
                    self._skip_seq()
                else:
                    self._emit_own(item)
                continue
            events = item[1]
            if events.__class__ is EventRecord and not pending:
                if records and n_records + len(events) > max_events:  # a message is whole records
                    self._emit(ts, pending, records=records)
                    records, n_records = [], 0
                if not records:
                    ts = item[0]
                records.append(events)
                n_records += len(events)
                if n_records >= max_events:
                    self._emit(ts, pending, records=records)
                    records, n_records = [], 0
                continue
            if records:  # a list after records: one run of events, as if all were lists
                pending = [ev for rec in records for ev in rec.events()]
                records, n_records = [], 0
            if not pending:
                ts = item[0]
            pending.extend(events.events() if events.__class__ is EventRecord else events)
            if len(pending) >= max_events:
                self._emit(ts, pending)
                pending = []
        if pending or records:
            self._emit(ts, pending, records=records)
        if self._dropped_batches != self._dropped_seen:
            self._dropped_seen = self._dropped_batches
            self._skip_seq()
        return self._outbox.last_seq if at_cut is None else at_cut

    def _settle(self) -> bool:
        """Number what has been handed over; True when no hand-off is left queued."""
        self._drain()
        return not self._queue

    def _emit(
        self, ts: float, events: list[Any], rank: int | None = None, records: list[EventRecord] | None = None
    ) -> None:
        """Frame ``events``, or ``records`` if any (kvbridge.bus.framer), and number the frames
        into the ring."""
        if records:
            self._number(self._framer.records(ts, records, rank))
        else:
            self._number(self._framer.frame(ts, events, rank))

    def _emit_own(self, own: Own) -> None:
        """A publish_batch() / publish_payload() hand-off: its own message, the given bytes when they
        can go as they are."""
        self._number(self._framer.forwarded(own.batch, own.payload, own.n_events))

    def _number(self, frames: list[Frame]) -> None:
        if frames:
            number(self._outbox, frames)
            self._last_emit = time.monotonic()

    def _skip_seq(self) -> None:
        """Leave a hole in the seq (see kvbridge.bus.outbox: the ring restarts after it)."""
        self._outbox.skip()

    def _header_block(self, seq: int) -> bytes:
        """Message ``seq``'s header block: ``Kv-Seq``, ``Kv-Epoch``, ``Nats-Msg-Id``
        (``<worker>:<epoch>:<seq>``), ``Content-Type``, ``Kv-Heartbeat``, in that order."""
        head, mid, tail = self._block_parts
        s = b"%d" % seq
        return b"".join((head, s, mid, s, tail))

    def _learn_max_payload(self, *, at_start: bool = False) -> None:
        """Take the server's max_payload from the INFO of the connection just made (at start and
        on every reconnect: another server, or the same one restarted with another config, may
        take less than the last). Held messages the new limit refuses are fitted to it
        (``_refit``): sent as they are, each would be refused every time it was tried, and
        nothing after it would go out. The sender checks this before sending, too: nats-py sets
        the new limit before it calls ``_on_reconnected``, and the sender may run in between."""
        server = self._nc.max_payload
        if server == self._max_payload:
            return
        before = self.max_payload
        self._max_payload = server
        self._framer.limit(self.max_payload)
        if not at_start:  # at start, the server's limit is news to nobody
            self._counts["max_payload_changes"] += 1
            log.warning("kvbridge publisher %s: the server's max_payload is now %d bytes (was %d)",
                        self.config.worker_id, server, before + _HEADER_ROOM)  # fmt: skip
        if self.max_payload < before:
            self._refit()

    def _refit(self) -> None:
        """Held messages over the (smaller) limit: those sent already are let go, so a replay asking
        for them is told they are gone and the requester takes a snapshot; if any unsent one is
        over, every unsent message leaves a seq hole and goes out again behind it, re-framed
        within the limit. New seqs, not the old ones: a replay or a snapshot's seq may already
        have shown the old framing to consumers. They see the hole and resync by snapshot, which
        is consistent with the messages behind it (numbered before any later snapshot's cut)."""
        outbox, limit = self._outbox, self.max_payload
        over = [seq for seq, payload in outbox.held(outbox.first, outbox.last_seq) if len(payload) > limit]
        if not over:
            return
        if over[-1] < outbox.cursor:
            outbox.forget(over[-1])
            log.warning("kvbridge publisher %s: %d sent message(s) over the new max_payload (%d) can no longer "
                        "be replayed: requests for them are answered as gone", self.config.worker_id, len(over),
                        limit)  # fmt: skip
            return
        hole, unsent = outbox.skip_unsent()
        refitted = 0
        for payload, n_events in unsent:
            if len(payload) <= limit:
                outbox.append(payload, n_events)
            else:
                refitted += 1
                self._number(self._framer.refit(payload, n_events))
        self._counts["refitted"] += refitted
        log.warning("kvbridge publisher %s: held messages over the new max_payload (%d): seq %d left as a hole "
                    "(consumers resync), the %d unsent message(s) numbered again behind it, %d of them re-framed",
                    self.config.worker_id, limit, hole, len(unsent), refitted)  # fmt: skip
