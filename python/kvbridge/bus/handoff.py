"""The publisher's engine-facing side: the hand-off queue, the pool lock, and how a hand-off wakes
the loop. Everything here may run on any thread; what the loop does with a hand-off is
:mod:`kvbridge.bus.coalescer`'s.

Threading contract
------------------
* ``publish(batch_or_events)`` may be called from any thread (the engine's step thread, typically).
  It appends to a bounded hand-off queue without a lock (one serialises only overflow drops) and
  returns; it never waits for the network, the event loop or the pool lock. When the queue is full, the oldest hand-offs are
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
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from typing import Any, Sequence

from kvbridge._native import EventRecord, KVCacheManager, eventfd_consume, eventfd_signal, timerfd_every, timerfd_new
from kvbridge.config import Config
from kvbridge.bus.framer import EVENT_CLASSES
from kvbridge.wire.events import KVEventBatch

__all__ = ["CUT", "HOLE", "HandOff", "Own", "Waker"]

# Marks a snapshot's position in the hand-off queue.
CUT = object()
# Marks where mark_loss() was called: the seq skips there.
HOLE = object()

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


class Own:
    """A ``publish_batch`` / ``publish_payload`` hand-off: goes out as a message of its own, as
    ``payload`` if given. ``batch`` None: only the bytes were handed over (decoded if they
    cannot go as they are)."""

    __slots__ = ("batch", "payload", "n_events")

    def __init__(self, batch: KVEventBatch | None, payload: bytes | None, n_events: int) -> None:
        self.batch, self.payload, self.n_events = batch, payload, n_events


class Waker:
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

    def ticking(self, interval_ns: int) -> None:
        """Poll every ``interval_ns`` from now on; 0 stops."""
        timerfd_every(self.tick_fd, interval_ns)

    # Resets the eventfd (or the timerfd) with the GIL held: rust/wake.rs says why.
    consume = staticmethod(eventfd_consume)

    def __del__(self) -> None:
        os.close(self.fd)
        if self.tick_fd >= 0:
            os.close(self.tick_fd)


class HandOff:
    """The engine threads' side of a :class:`~kvbridge.bus.publisher.KvEventPublisher`: hand-offs
    queued (and dropped past ``queue_max_batches``), the pool attached, the loop woken."""

    def __init__(self, config: Config) -> None:
        #: The pool lock of the threading contract (re-entrant, so step() works inside it).
        self.lock = threading.RLock()
        # Shared with engine threads. deque.append/popleft are atomic, so the common path takes no
        # lock: a lock the loop thread holds can be held across a GIL switch, which would make
        # publish() wait for a whole scheduling slice. _drop_lock only serialises overflow drops.
        self._queue: deque[Any] = deque()
        self._queue_max = config.queue_max_batches
        self._drop_lock = threading.Lock()
        self._dropped_batches = 0
        self._dropped_events = 0
        self._sleeping = False  # read without the lock by publish(): a stale read costs one wake
        self._manager: Any = None
        # How a hand-off reaches the loop: the waker while the sender runs, else the loop's own
        # thread-safe call (the loop side sets them).
        self._waker: Waker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    def publish(self, batch_or_events: KVEventBatch | Sequence[Any] | EventRecord) -> None:
        """Hand a batch (or a list of events, or a native ``KVCacheManager``'s ``take_record()``)
        to the publisher. Never blocks; see :mod:`kvbridge.bus.handoff`.

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
        q.append(Own(batch, None if payload is None else bytes(payload), len(batch.events)))
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
        q.append(Own(None, payload, n_events))
        if len(q) > self._queue_max:
            self._drop_oldest()
        if self._sleeping:
            self._nudge()

    def mark_loss(self) -> None:
        """Leave a hole in the seq at this point of the hand-off order, so that consumers resync
        by snapshot: for a relay whose source lost batches it could not recover. As with dropped
        hand-offs, messages before the hole that are not sent yet go with it: whoever is behind the
        hole needs the snapshot anyway, and it covers them."""
        self._queue.append(HOLE)
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
                if old is CUT or old is HOLE:  # markers must survive; rare, so just stop here
                    q.appendleft(old)
                    return
                self._dropped_batches += 1
                self._dropped_events += old.n_events if old.__class__ is Own else len(old[1])

    def attach(self, manager: Any) -> None:
        """Serve snapshots from ``manager`` (a :class:`kvbridge.engine.pool.KVCacheManager` or anything with
        ``take_events()`` and ``snapshot()``), and let ``step()`` publish its events."""
        with self.lock:
            self._manager = manager

    def step(self) -> int:
        """Publish the attached pool's new events (under ``self.lock``); returns how many."""
        with self.lock:
            manager = self._manager
            if manager is None:
                raise RuntimeError("step() publishes an attached pool's events: attach(manager) first")
            # A native pool hands over its record: its events are written from it, never made
            # into Python objects (kvbridge.bus.framer).
            native = manager.__class__.take_events is _NATIVE_TAKE_EVENTS
            events = manager.take_record() if native else manager.take_events()
            if len(events):
                self.publish(events)
        return len(events)
