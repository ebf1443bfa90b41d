"""The engine side: batches in, an ordered, replayable stream of NATS messages out.

Threading contract
------------------
* ``publish(batch_or_events)`` may be called from any thread (the engine's step thread, typically).
  It appends to a bounded hand-off queue under a tiny lock and returns; it never waits for the
  network, the event loop or the pool lock. When the queue is full, the oldest hand-offs are
  dropped and counted, and the seq skips so consumers see the hole and resync.
* Everything else -- coalescing, framing (:mod:`kvbridge.bus.framer`: encoding within the
  limits, slices, holes), seq assignment, the ring buffer, sending, answering replay and snapshot
  requests -- runs on the publisher's asyncio loop. ``BackgroundPublisher``
  runs that loop in its own thread for engines that are not asyncio programs.
* Snapshots read the attached pool from the loop thread, under ``publisher.lock``. The engine must
  hold the same lock while it mutates the pool (``with publisher.lock: manager.allocate(...)``) and
  hand the pool's events over with ``publisher.step()``, which takes them under that lock. Holding
  the lock makes a snapshot see a pool that is not changing; ``step()`` may then wait for a snapshot
  in progress (proportional to the pool's size), ``publish()`` never does.
* Seqs are given when hand-offs are coalesced into messages, on the loop. A snapshot marks its
  position in the hand-off queue (after the pool's last events) and the loop reports the seq of
  the last message before that mark: the snapshot equals the state after every message <= that
  seq, and no message after it is part of the snapshot.

Delivery (docs/delivery.md): messages are kept, encoded, in a ring buffer bounded in
bytes. They are sent in seq order while connected; while NATS is down they wait in the ring, and
are sent after the reconnect unless the ring had to evict them (every connection's max_payload is
read anew, and held messages it refuses are re-framed: ``_learn_max_payload``). Consumers repair
any hole through replay (served from the ring) or a snapshot. An idle publisher sends an empty
batch every ``heartbeat_s`` (and one right after a reconnect) so that a lost tail shows as a hole.

JetStream mode (``jetstream=True``) sends the same ring messages with acks and re-sends what the
stream has not acknowledged; see :mod:`kvbridge.bus.jetstream`. Its hooks here are marked ``_js``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
import time
from collections import deque
from typing import Any, Sequence

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from kvbridge._native import EventRecord, KVCacheManager, eventfd_consume, eventfd_signal, timerfd_every, timerfd_new
from kvbridge.metrics import register, start_exporter
from kvbridge.config import Config
from kvbridge.bus.connection import PermissionDeniedError, Permissions, WorkerIdInUseError, connect
from kvbridge.bus.framer import EVENT_CLASSES, Frame, Framer, number
from kvbridge.bus.outbox import Outbox
from kvbridge.wire.events import KVEventBatch
from kvbridge.wire.subjects import (
    CONTENT_TYPES,
    HDR_CONTENT_TYPE,
    HDR_COUNT,
    HDR_EPOCH,
    HDR_HEARTBEAT,
    HDR_MSG_ID,
    HDR_OLDEST,
    HDR_REPLY,
    HDR_SEQ,
    REPLY_END,
    REPLY_ERROR,
    REPLY_GONE,
    REPLY_SNAPSHOT,
    REPLY_SNAPSHOT_END,
    REPLY_UNAVAILABLE,
    WorkerSubjects,
)

__all__ = ["BackgroundPublisher", "KvEventPublisher"]

log = logging.getLogger("kvbridge.publisher")

# Marks a snapshot's position in the hand-off queue.
_CUT = object()
# Marks where mark_loss() was called: the seq skips there.
_HOLE = object()

# After this long without hand-offs the loop stops polling and sleeps until the next publish()
# wakes it. A wake costs the engine thread a syscall and a cross-thread wake-up (~7-20 us on a
# busy 2-core box), a poll costs it nothing -- but each poll costs the process a loop wake-up
# (tens of us of CPU), so polling pays only while hand-offs come faster than the polls: two
# empty polls and the loop sleeps. (At 50 ms, an engine stepping every few ms kept the loop
# polling for good: ~10 wake-ups per step, 2.5x vLLM's own publisher's CPU per block event at
# 100k block events/s in bench/engine_route.py.)
_IDLE_BEFORE_SLEEP_S = 0.0005
# linger_ms 0: the poll interval while hand-offs keep coming (a timerfd: asyncio's own timers
# round up to whole milliseconds). Adds at most this to latency; costs the loop ~4k wake-ups/s.
_POLL_NS = 250_000
# Room left in the server's max_payload for the headers (NATS counts them in): ours are < 200 B.
_HEADER_ROOM = 1024
# Messages a direct write takes at most (``_send_now``): a relay forwarding a burst of engine
# steps hands the sender several at once, and one write each cost it more kernel time than the
# messages' own bytes; a bound keeps the parts within IOV_MAX and the copy of what the socket
# does not take at once small.
_SEND_BATCH = 64
# ... and at most about this many payload bytes (a message more only to hold one): a full-speed
# engine's messages are up to max_batch_bytes each, and what the socket leaves of a write is
# copied into the transport's buffer.
_SEND_BATCH_BYTES = 256 << 10
# At start, how long another publisher serving our worker id has to answer the probe.
_PROBE_TIMEOUT_S = 0.5

_EXPECTED = "a KVEventBatch, an EventRecord or a list of events (BlockStored, BlockRemoved, AllBlocksCleared)"
# step() takes a pool's record instead of its events when take_events is the native one's (a
# subclass that overrides it is asked for its events).
_NATIVE_TAKE_EVENTS = KVCacheManager.take_events


def _check_events(events: Any, what: str) -> None:
    """TypeError naming the first element that is not an event; C-speed when all are."""
    if not EVENT_CLASSES.issuperset(map(type, events)):
        for i, ev in enumerate(events):
            if type(ev) not in EVENT_CLASSES:
                raise TypeError(
                    f"{what}[{i}] is {type(ev).__name__}, expected BlockStored, BlockRemoved or AllBlocksCleared"
                )


class _Own:
    """A ``publish_batch`` / ``publish_payload`` hand-off: goes out as a message of its own, as
    ``payload`` if given. ``batch`` None: only the bytes were handed over (decoded if they
    cannot go as they are)."""

    __slots__ = ("batch", "payload", "n_events")

    def __init__(self, batch: KVEventBatch | None, payload: bytes | None, n_events: int) -> None:
        self.batch, self.payload, self.n_events = batch, payload, n_events


class _Waker:
    """Wakes the loop from the engine thread through an eventfd written with the GIL held
    (``rust/wake.rs`` says why that matters). The fd is closed only when the last reference goes,
    so a publish() racing with close() can never write into a reused fd number. ``tick_fd`` is a
    timerfd the loop polls with while busy (-1 if unavailable)."""

    __slots__ = ("fd", "signal", "tick_fd")

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        fd, signal = self.fd, eventfd_signal
        self.signal = lambda: signal(fd)
        self.tick_fd = timerfd_new()

    def ticking(self, on: bool) -> None:
        timerfd_every(self.tick_fd, _POLL_NS if on else 0)

    # Resets the eventfd (or the timerfd) with the GIL held: rust/wake.rs says why.
    consume = staticmethod(eventfd_consume)

    def __del__(self) -> None:
        os.close(self.fd)
        if self.tick_fd >= 0:
            os.close(self.tick_fd)


class KvEventPublisher:
    """Publishes one worker's KV events to ``<prefix>.events.<model>.<worker>``.

    ``await start()`` connects (failing fast with :class:`kvbridge.ConnectError` /
    :class:`kvbridge.AuthenticationError`), ``publish()`` hands events over from any thread,
    ``await close()`` sends what is left and disconnects. Also an async context manager.
    """

    def __init__(self, config: Config | None = None, **options: Any) -> None:
        config = Config.resolve(config, **options)
        self.config = config
        #: A fresh random id per incarnation: consumers drop their view of this worker when it changes.
        self.epoch = secrets.token_hex(8)
        self.subjects = WorkerSubjects.build(config.subject_prefix, config.model, config.worker_id)
        #: The pool lock of the threading contract (re-entrant, so step() works inside it).
        self.lock = threading.RLock()
        self.metric_labels = {"model": config.model, "worker": config.worker_id}

        # Shared with engine threads. deque.append/popleft are atomic, so the common path takes no
        # lock: a lock the loop thread holds can be held across a GIL switch, which would make
        # publish() wait for a whole scheduling slice. _drop_lock only serialises overflow drops.
        self._queue: deque[Any] = deque()
        self._queue_max = config.queue_max_batches
        self._drop_lock = threading.Lock()
        self._dropped_batches = 0
        self._dropped_events = 0
        self._sleeping = False  # read without the lock by publish(): a stale read costs one wake
        self._waker: _Waker | None = None

        # Loop side only.
        self._manager: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._nc: Any = None
        self._sender: asyncio.Task | None = None
        self._js: Any = None  # kvbridge.bus.jetstream.acks.JetStreamAcks in JetStream mode
        self._closing = False
        self._dropped_seen = 0
        self._outbox = Outbox(config.ring_buffer_bytes)
        self._last_emit = 0.0
        self._beat_due = False  # the heartbeat's timer found heartbeat_s without an emit
        self._parked = False  # the sender is asleep until woken (on_wake may send for it)
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
        self._idle_ticks = 0
        self._permissions = Permissions(f"publisher {config.model}/{config.worker_id}")
        self._counts = dict.fromkeys(
            ("messages", "events", "bytes", "publish_errors", "reconnects", "replays",
             "replays_gone", "snapshots", "snapshot_errors", "heartbeats", "max_payload_changes", "refitted"),
            0,
        )  # fmt: skip
        register("publisher", self)

    # -- engine side (any thread) -------------------------------------------------------------------

    def publish(self, batch_or_events: KVEventBatch | Sequence[Any] | EventRecord) -> None:
        """Hand a batch (or a list of events, or a native ``KVCacheManager``'s ``take_record()``)
        to the publisher. Never blocks; see the module doc.

        Raises TypeError, before anything is queued, for anything but a ``KVEventBatch``, an
        ``EventRecord`` or a list/tuple of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``."""
        cls = batch_or_events.__class__
        if cls is KVEventBatch:
            events = batch_or_events.events  # type: ignore[union-attr]
            if events.__class__ is not list:
                raise TypeError(f"publish(): batch.events must be a list of events, got {type(events).__name__}")
            _check_events(events, "publish(): batch.events")
            item = (batch_or_events.ts, events)  # type: ignore[union-attr]
        elif cls is list or cls is tuple:
            _check_events(batch_or_events, "publish(): events")
            item = (time.time(), batch_or_events)  # type: ignore[assignment]
        elif cls is EventRecord:  # a native pool's events, never made into Python objects here
            item = (time.time(), batch_or_events)  # type: ignore[assignment]
        else:
            raise TypeError(f"publish() takes {_EXPECTED}, got {cls.__name__}")
        if not item[1]:
            return
        q = self._queue
        q.append(item)
        if len(q) > self._queue_max:
            self._drop_oldest()
        if self._sleeping:
            self._nudge()

    def publish_batch(self, batch: KVEventBatch, payload: bytes | None = None) -> None:
        """Hand over ``batch`` to go out as a message of its own, with its own ``ts`` and
        ``data_parallel_rank`` (the configured ``dp_rank`` when it has none), even if empty -- so a
        relay re-publishes another publisher's stream batch for batch. ``payload``: the batch's
        msgpack bytes as received; in msgpack mode they are sent unchanged, as one message,
        whatever ``max_batch_events``/``max_batch_bytes`` say, as long as the server accepts them
        (beyond its ``max_payload`` the batch is encoded and split like any other, counted in
        ``stats["split_batches"]``). Never blocks, like :meth:`publish`; the two may be mixed."""
        if batch.__class__ is not KVEventBatch:
            raise TypeError(f"publish_batch() takes a KVEventBatch, got {type(batch).__name__}")
        if batch.events.__class__ is not list:
            raise TypeError(f"publish_batch(): batch.events must be a list of events, got {type(batch.events).__name__}")
        _check_events(batch.events, "publish_batch(): batch.events")
        if payload is not None and not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"publish_batch(): payload must be bytes, got {type(payload).__name__}")
        q = self._queue
        q.append(_Own(batch, None if payload is None else bytes(payload), len(batch.events)))
        if len(q) > self._queue_max:
            self._drop_oldest()
        if self._sleeping:
            self._nudge()

    def publish_payload(self, payload: bytes, n_events: int) -> None:
        """Hand over a msgpack ``KVEventBatch``'s bytes (``n_events`` events in it) to go out
        unchanged as a message of its own: :meth:`publish_batch` without the decoded batch, for a
        relay that forwards an engine's bytes and never builds its events. In JSON mode, or
        beyond the server's ``max_payload``, the bytes are decoded when sent and go out as
        ``publish_batch`` would send them (a payload that does not decode then is counted in
        ``stats["invalid_events"]``). The caller vouches that the bytes are a batch
        (``_native.read_batch`` or ``decode_batch`` read them). Never blocks."""
        if payload.__class__ is not bytes:
            raise TypeError(f"publish_payload(): payload must be bytes, got {type(payload).__name__}")
        q = self._queue
        q.append(_Own(None, payload, n_events))
        if len(q) > self._queue_max:
            self._drop_oldest()
        if self._sleeping:
            self._nudge()

    def mark_loss(self) -> None:
        """Leave a hole in the seq at this point of the hand-off order, so that consumers resync
        by snapshot: for a relay whose source lost batches it could not recover. As with dropped
        hand-offs, messages before the hole that are not sent yet go with it: whoever is behind the
        hole needs the snapshot anyway, and it covers them."""
        self._queue.append(_HOLE)
        if self._sleeping:
            self._nudge()

    def _nudge(self) -> None:
        self._sleeping = False
        waker = self._waker
        if waker is not None:
            waker.signal()
            return
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._wake.set)  # type: ignore[union-attr]
            except RuntimeError:  # loop closed: the hand-off stays queued, bounded
                pass

    def _drop_oldest(self) -> None:
        q = self._queue
        with self._drop_lock:
            while len(q) > self._queue_max:
                try:
                    old = q.popleft()
                except IndexError:  # the loop drained it meanwhile
                    return
                if old is _CUT or old is _HOLE:  # markers must survive; rare, so just stop here
                    q.appendleft(old)
                    return
                self._dropped_batches += 1
                self._dropped_events += old.n_events if old.__class__ is _Own else len(old[1])

    def attach(self, manager: Any) -> None:
        """Serve snapshots from ``manager`` (a :class:`kvbridge.engine.pool.KVCacheManager` or anything with
        ``take_events()`` and ``snapshot()``), and let ``step()`` publish its events."""
        with self.lock:
            self._manager = manager

    def step(self) -> int:
        """Publish the attached pool's new events (under ``self.lock``); returns how many."""
        with self.lock:
            manager = self._manager
            # A native pool hands over its record: its events are written from it, never made
            # into Python objects (kvbridge.bus.framer).
            native = manager.__class__.take_events is _NATIVE_TAKE_EVENTS
            events = manager.take_record() if native else manager.take_events()
            if len(events):
                self.publish(events)
        return len(events)

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> KvEventPublisher:
        if self._nc is not None:
            return self
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._nc = await connect(self.config, reconnected_cb=self._on_reconnected, error_cb=self._permissions.on_error)
        self._learn_max_payload(at_start=True)
        try:
            await self._check_worker_id_free()
            await self._nc.subscribe(self.subjects.replay, cb=self._on_replay)
            await self._nc.subscribe(self.subjects.snapshot, cb=self._on_snapshot)
            if self.config.jetstream:
                from kvbridge.bus.jetstream.acks import JetStreamAcks

                self._js = JetStreamAcks(
                    self._nc, self.config, self._outbox, send=self._send, wake=self._wake.set, settle=self._settle,
                    permissions=self._permissions,
                )
                await self._js.start()
            publish_probe: tuple[str, ...] = ()
            if self.config.heartbeat_s > 0:
                # The first heartbeat goes out now: it announces this epoch, and doubles as the
                # probe of our publish permission. (Without heartbeats nothing is sent before the
                # first events, and a refusal shows at run time: logged, counted as refused.)
                self._emit(time.time(), [])
                self._counts["heartbeats"] += 1
                await self._send_pending()
                publish_probe = (self.subjects.events,)
            # The server reports refusals asynchronously, ahead of the PONG that ends a flush.
            await self._nc.flush()
            self._permissions.raise_if_denied(
                publish=publish_probe, subscribe=(self.subjects.replay, self.subjects.snapshot)
            )
        except BaseException:
            if self._js is not None:
                await self._js.stop()
            await self._nc.close()
            self._nc = self._js = None
            raise
        if self.config.metrics_port is not None:
            start_exporter(self.config.metrics_port, self.config.metrics_addr)
        self._sender = asyncio.create_task(self._run_sender(), name=f"kvbridge-sender-{self.config.worker_id}")
        return self

    async def _check_worker_id_free(self) -> None:
        """Refuse to start as a worker id that a live publisher already serves: two incarnations
        alternating on one subject would make every view flip between them. Its replay subject
        answers if it is alive; no responders, no answer, or no right to ask: go on."""
        self._permissions.ignore_publish(self.subjects.replay)
        try:
            reply = await self._nc.request(
                self.subjects.replay, b'{"from": 0, "to": -1}', timeout=min(_PROBE_TIMEOUT_S, self.config.request_timeout_s)
            )
        except (NoRespondersError, NatsError, asyncio.TimeoutError):
            return
        finally:
            await self._nc.flush()  # a refusal of the probe arrives before this returns
            self._permissions.ignore_publish(None)
        other = (reply.headers or {}).get(HDR_EPOCH)
        if other:
            raise WorkerIdInUseError(
                f"worker id {self.config.worker_id!r} (model {self.config.model!r}) is already served by a live "
                f"publisher (epoch {other}) on {self.subjects.events}: give each engine its own worker_id "
                f"(KVBRIDGE_WORKER_ID)"
            )

    async def close(self, timeout: float = 5.0) -> None:
        """Send everything handed over so far (best effort within ``timeout``), then disconnect."""
        if self._nc is None or self._closing:
            return
        if self._js is not None:  # JetStream: closed means stored, as far as the timeout allows
            t0 = time.monotonic()
            await self._js.wait_acked(timeout)
            timeout = max(0.5, timeout - (time.monotonic() - t0))
        self._closing = True
        self._wake.set()  # type: ignore[union-attr]
        try:
            await asyncio.wait_for(asyncio.shield(self._sender), timeout)  # type: ignore[arg-type]
        except (asyncio.TimeoutError, Exception):
            self._sender.cancel()  # type: ignore[union-attr]
        if self._js is not None:
            await self._js.stop()
        try:
            if self._nc.is_connected:
                await self._nc.flush(timeout=max(timeout, 1))
        except Exception:
            pass
        await self._nc.close()

    async def __aenter__(self) -> KvEventPublisher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def max_payload(self) -> int:
        """The largest payload one message may carry: the server's max_payload less room for
        our headers (read at start and on every reconnect; 1 MiB, the server default, before)."""
        return self._max_payload - _HEADER_ROOM

    @property
    def stats(self) -> dict[str, int]:
        s = dict(self._counts)
        s.update(self._framer.counts)
        s.update(
            dropped_batches=self._dropped_batches,
            dropped_events=self._dropped_events,
            queue_depth=len(self._queue),
            ring_bytes=self._outbox.nbytes,
            ring_messages=len(self._outbox),
            unsent=self._outbox.unsent,
            evicted_unsent=self._outbox.evicted_unsent,
            oldest_seq=self._outbox.first,
            last_seq=self._outbox.last_seq,
            refused=self._permissions.refused_publish(self.subjects.events),
            permission_errors=self._permissions.count,
            link_failures=self._nc.link_failures if self._nc is not None else 0,
            max_payload=self.max_payload,
        )
        # A publish the server refused was counted as sent when nats-py took it.
        s["messages"] = max(0, s["messages"] - s["refused"])
        if self._js is not None:
            s.update(self._js.stats)
        return s

    # -- loop side: hand-offs -> messages -------------------------------------------------------------

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
                if item is _CUT:
                    at_cut = self._outbox.last_seq
                elif item is _HOLE:
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

    def _emit(
        self, ts: float, events: list[Any], rank: int | None = None, records: list[EventRecord] | None = None
    ) -> None:
        """Frame ``events``, or ``records`` if any (kvbridge.bus.framer), and number the frames
        into the ring."""
        if records:
            self._number(self._framer.records(ts, records, rank))
        else:
            self._number(self._framer.frame(ts, events, rank))

    def _emit_own(self, own: _Own) -> None:
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

    # -- loop side: sending ---------------------------------------------------------------------------

    async def _run_sender(self) -> None:
        loop = asyncio.get_running_loop()
        linger = self.config.linger_ms / 1000.0
        heartbeat = self.config.heartbeat_s
        wake = self._wake
        assert wake is not None
        waker = self._install_waker(loop, wake)
        # One timer for the heartbeat, re-armed when it fires (about once a heartbeat_s), not each
        # time the sender sleeps: it wakes the sender once heartbeat_s has passed with nothing emitted.
        beat: asyncio.TimerHandle | None = None

        def on_beat() -> None:
            nonlocal beat
            delay = self._last_emit + heartbeat - time.monotonic()
            if delay <= 0:
                self._beat_due = True
                wake.set()
                delay = heartbeat
            beat = loop.call_later(delay, on_beat)

        if heartbeat > 0:
            beat = loop.call_later(max(0.0, self._last_emit + heartbeat - time.monotonic()), on_beat)
        try:
            await self._send_loop(loop, linger, heartbeat, wake, waker if waker and waker.tick_fd >= 0 else None)
        finally:
            if beat is not None:
                beat.cancel()
            if waker is not None:
                self._waker = None
                loop.remove_reader(waker.fd)
                if waker.tick_fd >= 0:
                    waker.ticking(False)
                    loop.remove_reader(waker.tick_fd)

    def _install_waker(self, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> _Waker | None:
        if not hasattr(os, "eventfd"):
            return None  # not Linux: publish() falls back to call_soon_threadsafe
        waker = _Waker()

        def on_wake() -> None:
            waker.consume(waker.fd)
            # The sender asleep and one hand-off (an engine stepping slower than we send): its
            # pass is done here, in this callback, when it can go out without waiting; waking the
            # sender task for it would cost another pass of the loop and a future. Anything else
            # (several hand-offs: the sender's polling decides; a heartbeat due; closing;
            # JetStream; nats-py's path needed) is the sender's.
            if self._parked and len(self._queue) == 1 and not (self._beat_due or self._closing or self._js is not None):
                self._drain()
                if self._send_now():
                    self._sleeping = True
                    if not self._queue:  # else handed over meanwhile, maybe unseen: the sender's
                        return
                    self._sleeping = False
            wake.set()

        idle_ticks_before_sleep = int(_IDLE_BEFORE_SLEEP_S * 1e9 / _POLL_NS)

        def on_tick() -> None:
            waker.consume(waker.tick_fd)
            if self._queue or self._closing:
                self._idle_ticks = 0
                wake.set()
            else:
                # Nothing handed over: after a while, let the loop go idle (stop ticking, sleep
                # until the next publish() or heartbeat) instead of polling forever.
                self._idle_ticks += 1
                if self._idle_ticks >= idle_ticks_before_sleep:
                    self._idle_ticks = 0
                    wake.set()

        try:
            loop.add_reader(waker.fd, on_wake)
            if waker.tick_fd >= 0:
                loop.add_reader(waker.tick_fd, on_tick)
        except NotImplementedError:  # a loop without add_reader (Windows proactor)
            return None
        self._waker = waker
        return waker

    async def _send_loop(
        self, loop: asyncio.AbstractEventLoop, linger: float, heartbeat: float, wake: asyncio.Event,
        ticker: _Waker | None,
    ) -> None:
        # linger 0 (the default) adapts by itself. Busy (hand-offs piled up in the last 0.5 ms): poll the
        # queue every 250 us; what arrives while the loop encodes and sends is coalesced into the
        # next messages. Idle: sleep until publish() wakes it, then send at once.
        last_busy = loop.time()
        ticking = False
        while True:
            wake.clear()
            if self._beat_due:
                self._beat_due = False
                if not self._queue and time.monotonic() - self._last_emit >= heartbeat:
                    self._emit(time.time(), [])
                    self._counts["heartbeats"] += 1
            handed = len(self._queue)
            self._drain()
            await self._send_pending()
            if self._closing:
                if self._queue:  # handed over while we were sending: close() promises those too
                    continue
                return
            now = loop.time()
            # Polling pays when hand-offs pile up while the loop sends; one at a time (an engine
            # stepping slower than the loop sends) is cheaper woken by each publish(). A heartbeat
            # or a re-send is not traffic either.
            if handed > 1 or self._queue:
                last_busy = now
            if self._queue:
                await asyncio.sleep(0)
                continue
            if now - last_busy < _IDLE_BEFORE_SLEEP_S:
                if linger > 0:
                    await asyncio.sleep(linger)
                    continue
                if ticker is not None:
                    if not ticking:
                        ticker.ticking(True)
                        ticking = True
                    await wake.wait()
                    continue
            if ticking:
                ticker.ticking(False)  # type: ignore[union-attr]
                ticking = False
            self._sleeping = True
            if self._queue or self._closing:
                self._sleeping = False
                continue
            # The heartbeat's timer wakes it too (_run_sender): a wait_for here would cost a task,
            # a timer and three more passes of the loop for every message.
            self._parked = True
            try:
                await wake.wait()
            finally:
                self._parked = False
            self._sleeping = False

    async def _send_pending(self) -> int:
        nc, outbox = self._nc, self._outbox
        if nc.max_payload != self._max_payload:
            self._learn_max_payload()
        if self._js is not None:
            return await self._js.send_pending()
        start = outbox.cursor
        # What can go at once goes in few writes; the rest (nats-py's queue or the socket's buffer
        # not empty, a reconnect) one message at a time, nats-py's way.
        done = self._send_now()
        sent = outbox.cursor - start
        if done:
            return sent
        while outbox.cursor < outbox.end and nc.is_connected:
            if nc.max_payload != self._max_payload:  # reconnected while we awaited a send
                self._learn_max_payload()
                continue
            if await self._send(outbox.cursor) is None:
                break
            sent += 1
        return sent

    async def _send(self, seq: int, reply: str = "") -> tuple[bytes, int] | None:
        """Send held message ``seq`` and move the send cursor past it; None if NATS refused it.

        Core and JetStream sending share this (JetStream adds a reply subject for the ack and
        may send a seq again); a seq counts as published the first time it goes out."""
        payload, n_events = self._outbox.get(seq)
        try:
            await self._nc.publish_headed(self.subjects.events, payload, self._header_block(seq), reply)
        except NatsError:
            # Broker gone or nats-py's buffer full: the message stays held and goes out after
            # the reconnect (or is evicted, and consumers resync); JetStream re-sends it.
            self._counts["publish_errors"] += 1
            return None
        self._sent(seq, payload, n_events)
        return payload, n_events

    def _sent(self, seq: int, payload: bytes, n_events: int) -> None:
        if self._outbox.sent(seq):  # its first time out (JetStream re-sends some)
            counts = self._counts
            counts["messages"] += 1
            counts["events"] += n_events
            counts["bytes"] += len(payload)

    def _send_now(self) -> bool:
        """Send what is numbered and unsent without waiting (core mode, ``Client.publish_many_now``:
        up to ``_SEND_BATCH`` messages a write); False when something is left that needs the
        sender's way (``_send``)."""
        nc, outbox, subject = self._nc, self._outbox, self.subjects.events
        if nc.max_payload != self._max_payload:  # a reconnect not yet learnt: the sender's to handle
            return False
        get, header_block = outbox.get, self._header_block
        while outbox.cursor < outbox.end:
            first = outbox.cursor
            held, size = [], 0
            for seq in range(first, min(outbox.end, first + _SEND_BATCH)):
                held.append(item := get(seq))
                size += len(item[0])
                if size >= _SEND_BATCH_BYTES:
                    break
            if not nc.publish_many_now(subject, [(payload, header_block(first + i)) for i, (payload, _) in enumerate(held)]):
                return False
            for i, (payload, n_events) in enumerate(held):
                self._sent(first + i, payload, n_events)
        return True

    def _settle(self) -> bool:
        """Number what has been handed over; True when no hand-off is left queued."""
        self._drain()
        return not self._queue

    async def _on_reconnected(self) -> None:
        self._counts["reconnects"] += 1
        self._learn_max_payload()
        # Messages the dead broker swallowed leave a hole only a later message reveals.
        self._drain()
        self._emit(time.time(), [])
        if self._js is not None:
            self._js.on_reconnected()
        self._wake.set()  # type: ignore[union-attr]

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

    # -- loop side: replay and snapshot ----------------------------------------------------------------

    async def _reply(self, inbox: str, payload: bytes, headers: dict[str, str] | bytes) -> bool:
        """``headers``: a dict, or a held message's header block (a replay sends it as it went live)."""
        try:
            if isinstance(headers, bytes):
                await self._nc.publish_headed(inbox, payload, headers)
            else:
                await self._nc.publish(inbox, payload, headers=headers)
            return True
        except NatsError:
            return False  # the requester times out and asks again

    async def _reply_error(self, inbox: str, why: str) -> None:
        """A request never goes unanswered while we can send: say what went wrong."""
        await self._reply(inbox, why.encode(), {HDR_REPLY: REPLY_ERROR, HDR_EPOCH: self.epoch})

    async def _on_replay(self, msg: Any) -> None:
        if not msg.reply:
            return
        self._drain()
        self._wake.set()  # type: ignore[union-attr]
        outbox = self._outbox
        last = outbox.last_seq
        try:
            req = json.loads(msg.data or b"{}")
            start = int(req.get("from", 0))
            end = last if req.get("to") is None else min(int(req["to"]), last)
        except (ValueError, TypeError, AttributeError) as exc:
            await self._reply_error(msg.reply, f"bad replay request: {exc}")
            return
        self._counts["replays"] += 1
        if start < outbox.first and start <= end:
            self._counts["replays_gone"] += 1
            body = json.dumps({"error": "gone", "from": start, "oldest": outbox.first, "last": last}).encode()
            await self._reply(
                msg.reply, body, {HDR_REPLY: REPLY_GONE, HDR_EPOCH: self.epoch, HDR_OLDEST: str(outbox.first), HDR_SEQ: str(last)}
            )
            return
        batch = outbox.held(start, end)  # copied out: the ring can move while we await the sends
        for seq, payload in batch:
            if not await self._reply(msg.reply, payload, self._header_block(seq)):
                return
        await self._reply(msg.reply, b"", {HDR_REPLY: REPLY_END, HDR_EPOCH: self.epoch, HDR_SEQ: str(last)})

    async def _on_snapshot(self, msg: Any) -> None:
        if not msg.reply:
            return
        if self._manager is None:
            await self._reply(msg.reply, b"no pool attached", {HDR_REPLY: REPLY_UNAVAILABLE, HDR_EPOCH: self.epoch})
            return
        try:
            blocks, seq = self.take_snapshot()
            # The same cuts as live messages: an event too large for one message goes in slices.
            payloads = self._framer.snapshot(time.time(), blocks) if blocks else []
        except Exception as exc:  # the pool failed us: the requester is told, and asks again later
            self._counts["snapshot_errors"] += 1
            log.exception("kvbridge publisher %s: snapshot failed", self.config.worker_id)
            await self._reply_error(msg.reply, f"snapshot failed: {type(exc).__name__}: {exc}")
            return
        finally:
            self._wake.set()  # type: ignore[union-attr]  # the sender may have new messages
        self._counts["snapshots"] += 1
        headers = {HDR_REPLY: REPLY_SNAPSHOT, HDR_EPOCH: self.epoch, HDR_CONTENT_TYPE: self._content_type}
        for payload in payloads:
            if not await self._reply(msg.reply, payload, headers):
                return
        end = {HDR_REPLY: REPLY_SNAPSHOT_END, HDR_EPOCH: self.epoch, HDR_SEQ: str(seq), HDR_COUNT: str(len(payloads))}
        await self._reply(msg.reply, b"", end)

    def take_snapshot(self) -> tuple[list[Any], int]:
        """The attached pool's cached blocks and the seq they are consistent with (loop thread)."""
        manager = self._manager
        with self.lock:
            events = manager.take_events()
            if events:
                self.publish(events)
            blocks = list(manager.snapshot())
            self._queue.append(_CUT)
        return blocks, self._drain()


class BackgroundPublisher:
    """A :class:`KvEventPublisher` running its asyncio loop in a daemon thread, for engines whose
    step loop is plain threaded code. ``publish``, ``attach``, ``step`` and ``lock`` are the
    publisher's own (thread-safe); ``start()`` blocks until connected or raises the connect error."""

    def __init__(self, config: Config | None = None, **options: Any) -> None:
        self.publisher = KvEventPublisher(config, **options)
        self.config = self.publisher.config
        self.epoch = self.publisher.epoch
        self.lock = self.publisher.lock
        self.publish = self.publisher.publish
        self.attach = self.publisher.attach
        self.step = self.publisher.step
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def stats(self) -> dict[str, int]:
        return self.publisher.stats

    def start(self) -> BackgroundPublisher:
        if self._thread is not None:
            return self
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="kvbridge-publisher", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.publisher.start(), loop).result()
        except BaseException:
            self._stop_loop()
            raise
        return self

    def call(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the publisher's loop and wait for its result (for tests and tools)."""
        assert self._loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def close(self, timeout: float = 5.0) -> None:
        if self._loop is None:
            return
        try:
            self.call(self.publisher.close(timeout), timeout + 5)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(10)
        loop.close()

    def __enter__(self) -> BackgroundPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

