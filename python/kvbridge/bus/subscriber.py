"""The consumer side of the delivery contract (docs/delivery.md).

``KvEventSubscriber`` subscribes to event subjects and, per worker, turns whatever arrives --
in order, duplicated, with holes, from a restarted worker, or garbage -- into an exactly-once,
in-order sequence of :class:`Update` s:

* in-order live messages are delivered as they come;
* a hole (a seq beyond the next expected one) parks later messages and asks the worker's replay
  subject for the missing range; if the worker answers "gone", or the worker is new to us, or it
  changed epoch (restarted), it asks for a snapshot, delivered as one ``reset=True`` update, and
  continues with the parked messages after the snapshot's seq;
* anything that is not a well-formed event message is counted (``stats["malformed"]``) and skipped;
  a malformed message where a replay should have filled a hole makes the worker resync by snapshot
  (it would come back the same on every replay);
* a worker not heard from for ``worker_timeout_s`` (never sooner than 3 of its own advertised
  heartbeat intervals, ``Kv-Heartbeat``; never, if it sends none) is dropped: its view goes, one
  ``reset=True`` update with ``source="expired"`` and no events says so, and it costs no more
  requests. A worker whose subject never syncs (nobody answers) costs a few requests with growing
  pauses until it expires. Silence is never blamed on the workers before the subscriber's own
  link has answered a PING (docs/delivery.md, "Dead links");
* two live publishers on one subject (two epochs alternating) are logged once, at WARNING, with
  both epochs, and counted (``stats["epoch_conflicts"]``) -- once an epoch given up has kept
  sending new seqs for longer than the worker's heartbeat interval (1 s at least): a dead
  incarnation's messages still in flight when its successor was adopted (a cluster can route
  them late) are duplicates, not a second publisher. If the incarnation followed falls
  silent past the worker's timeout while one given up keeps speaking, the followed one was the
  dead one (its snapshot answer was read after its successor had spoken): the speaker is
  resynced and followed, counted as an epoch change.

Views never wait for anyone: ``async for`` reads from a bounded queue; an iterator that falls
``queue_size`` updates behind is told so (``stats["iterator_behind"]``): the queue is dropped and
the iterator continues with one ``reset=True`` update per worker (``source="behind"``) carrying the
worker's current view (``WorkerView.as_events``: per medium and group, its block hashes, one per
copy, as one ``BlockStored`` without token ids, and each group's kind and largest block size;
without tracked views, the worker is resynced by snapshot), so a consumer that rebuilds state
from updates stays exact. An abandoned iterator is detached.

Everything runs on the subscriber's asyncio loop; one resync task per worker at most.
"""

from __future__ import annotations

import asyncio
import datetime
import inspect
import json
import logging
import time
from collections import deque
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

from nats.errors import NoRespondersError

from kvbridge.metrics import register, start_exporter, tally
from kvbridge.config import Config
from kvbridge.bus.connection import Permissions, connect
from kvbridge.bus.loads import LoadReports, parse_load_msg
from kvbridge.bus.sequencer import MAX_RETIRED, Sequencer, Verdict
from kvbridge.bus.update import Body, Update, WorkerView, decode, parse_event_msg
from kvbridge.wire.events import DecodeError, KVEventBatch
from kvbridge.wire.events import Event, LoadReport
from kvbridge.wire.subjects import (
    FORMATS,
    HDR_CONTENT_TYPE,
    HDR_COUNT,
    HDR_EPOCH,
    HDR_HEARTBEAT,
    HDR_REPLY,
    HDR_SEQ,
    REPLY_END,
    REPLY_ERROR,
    REPLY_GONE,
    REPLY_SNAPSHOT,
    REPLY_SNAPSHOT_END,
    REPLY_UNAVAILABLE,
    WorkerSubjects,
    events_pattern,
    load_subject,
    parse_events_subject,
)

__all__ = ["KvEventSubscriber", "Update", "WorkerView"]

log = logging.getLogger("kvbridge.consumer")

# JetStream mode: how long a hole may wait for the stream to fill it before the worker is asked.
_STREAM_HOLE_GRACE_S = 0.5
# A worker is never expired sooner than this many of its own heartbeat intervals.
_HEARTBEATS_BEFORE_EXPIRY = 3
# Resync back-off: first pause, and the longest; nobody serving the subject starts it higher.
_BACKOFF_S = 0.05
_BACKOFF_NO_RESPONDERS_S = 0.5
_BACKOFF_MAX_S = 4.0
# Events subjects remembered with their (model, worker); far more than any deployment's workers.
_MAX_SUBJECT_KEYS = 4096
# An epoch given up that sends new seqs is a second live publisher only if it keeps at it for
# longer than this (or the worker's heartbeat interval, if longer): what a dead incarnation had
# in flight when its successor was adopted arrives within a route's delay, not a heartbeat's.
_CONFLICT_AFTER_S = 1.0


class _Worker:
    """A worker as the subscriber knows it: its sequencer (the (epoch, seq) rules), its view,
    its resync task and when it was last heard from."""

    __slots__ = (
        "model", "worker", "subjects", "seq", "syncing", "view", "last_heard", "followed_heard", "heartbeat_raw",
        "heartbeat_s", "conflict_warned", "speaking_since",
    )  # fmt: skip

    def __init__(self, prefix: str, model: str, worker: str, track_view: bool) -> None:
        self.model, self.worker = model, worker
        self.subjects = WorkerSubjects.build(prefix, model, worker)
        self.seq = Sequencer()
        self.syncing: asyncio.Task | None = None
        self.view = WorkerView() if track_view else None
        # When any incarnation, and the one followed (or since it was adopted), was last heard.
        self.last_heard = self.followed_heard = time.monotonic()
        self.heartbeat_raw: str | None = None
        self.heartbeat_s: float | None = None  # None: not advertised
        self.conflict_warned = False
        # Epoch given up -> when it was first heard sending a seq newer than any seen from it.
        self.speaking_since: dict[str, float] = {}

    @property
    def epoch(self) -> str | None:
        return self.seq.epoch

    def heard(self, epoch: str, heartbeat_raw: str | None) -> None:
        self.last_heard = now = time.monotonic()
        if epoch == self.seq.epoch:
            self.followed_heard = now
        if heartbeat_raw != self.heartbeat_raw:
            self.heartbeat_raw = heartbeat_raw
            try:
                hb = float(heartbeat_raw) if heartbeat_raw is not None else None
            except ValueError:
                hb = None
            self.heartbeat_s = hb if hb is None or hb >= 0 else None

    def timeout(self, worker_timeout_s: float) -> float | None:
        """Seconds of silence after which this worker is gone; None: never by time."""
        if worker_timeout_s <= 0 or self.heartbeat_s == 0:
            return None
        if self.heartbeat_s is None:
            return worker_timeout_s
        return max(worker_timeout_s, _HEARTBEATS_BEFORE_EXPIRY * self.heartbeat_s)


class KvEventSubscriber:
    """Subscribes to ``<prefix>.events.<model>.<worker>`` (``None`` = every model / worker, or an
    explicit ``subject`` pattern) and delivers :class:`Update` s per worker, in order, exactly once.

    Deliveries go to ``on_update(update)`` (sync or async) if given, and to ``async for update in
    subscriber`` once iteration has begun. ``on_update`` is chosen before ``start()``: without one
    nothing is ever awaited per message, and messages are handled in the connection's read loop
    (no nats-py ``Msg``, queue or task each); with one, through nats-py's callback. ``views``
    holds a :class:`WorkerView` per ``(model, worker)`` unless ``track_views=False``.

    ``index``: a :class:`kvbridge.Index` to keep up to date. Each delivered update's payload bytes
    go straight to ``index.apply(worker, payload)`` (a snapshot, already decoded, as its batch);
    a reset (snapshot, restart) first does ``index.remove_worker(worker)``. The index is keyed by
    the subject's worker token alone, so subscribe to one model per Index. With an index,
    ``track_views`` defaults to False and messages are neither scanned nor decoded in Python; a
    payload the index cannot read is counted in ``index.stats["malformed_payloads"]`` (its seq
    still counts as delivered), and ``update.batch`` / ``n_events`` decode on first access.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        model: str | None = None,
        worker: str | None = None,
        subject: str | None = None,
        on_update: Callable[[Update], Awaitable[None] | None] | None = None,
        track_views: bool | None = None,
        queue_size: int = 1024,
        stream_start: int | datetime.datetime | None = None,
        index: Any = None,
        **options: Any,
    ) -> None:
        config = Config.resolve(config, **options)
        self.config = config
        self.prefix = config.subject_prefix
        self.subject = subject or events_pattern(self.prefix, model, worker)
        self._on_update = on_update
        # Messages handled in the client's read loop (no on_update at start()).
        self._direct = False
        self.index = index
        self.track_views = index is None if track_views is None else track_views
        # Scanning builds Python hash lists for views; an index reads the bytes itself.
        self._raw_bodies = index is not None and not self.track_views
        self.metric_labels = {"subject": self.subject}
        if not isinstance(queue_size, int) or isinstance(queue_size, bool) or queue_size < 1:
            raise ValueError(f"queue_size must be an integer >= 1, got {queue_size!r}")
        self._queue_size = queue_size
        #: JetStream mode (``config.jetstream``): where in the stream to begin; see kvbridge.bus.jetstream.
        self.stream_start = stream_start
        # The async iterator's side: a bounded queue that deliveries never wait on (module doc).
        self._iter_queue: deque[Update] | None = None
        self._iter_wake = asyncio.Event()
        self._iter_behind = False
        self._iter_known: set[tuple[str, str]] = set()
        self._workers: dict[tuple[str, str], _Worker] = {}
        # Subject -> (model, worker), for the subjects seen (bounded: see _subject_key).
        self._subject_keys: dict[str, tuple[str, str]] = {}
        self._load_subject = load_subject(self.prefix, model, worker)
        self._loads = LoadReports()
        self._nc: Any = None
        self._expiry: asyncio.Task | None = None
        self._stream_reader: Any = None  # kvbridge.bus.jetstream.reader.StreamReader in JetStream mode
        self._closed = False
        self._permissions = Permissions(f"subscriber {self.subject}")
        self._counts = dict.fromkeys(
            ("messages", "events", "bytes", "duplicates", "gaps", "replays", "replays_gone", "snapshots",
             "epoch_changes", "epoch_conflicts", "malformed", "request_timeouts", "request_errors", "callback_errors",
             "expired", "iterator_behind"),
            0,
        )  # fmt: skip
        register("subscriber", self)

    @property
    def on_update(self) -> Callable[[Update], Awaitable[None] | None] | None:
        return self._on_update

    @on_update.setter
    def on_update(self, callback: Callable[[Update], Awaitable[None] | None] | None) -> None:
        if callback is not None and self._direct:
            raise RuntimeError(
                "on_update must be given before start(): this subscriber started without one and handles "
                "messages in the connection's read loop, where nothing is awaited"
            )
        self._on_update = callback

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> KvEventSubscriber:
        if self._nc is not None:
            return self
        self._nc = await connect(self.config, reconnected_cb=self._on_reconnected, error_cb=self._permissions.on_error)
        try:
            if self.config.jetstream:
                from kvbridge.bus.jetstream.reader import subscribe_stream

                self._stream_reader = await subscribe_stream(
                    self._nc, self.config, self.subject, self._on_msg, self.stream_start, self._permissions
                )
            elif self.on_update is None:
                # Nothing to await per message: handled in the read loop (kvbridge.bus.natsclient).
                await self._nc.subscribe_direct(self.subject, self._on_event_now)
                self._direct = True
            else:
                await self._nc.subscribe(
                    self.subject, cb=self._on_msg, pending_msgs_limit=1 << 20, pending_bytes_limit=512 * 1024 * 1024
                )
            await self._nc.subscribe(self._load_subject, cb=self._on_load)
            # A refused subscription is reported asynchronously, ahead of the PONG ending a flush.
            await self._nc.flush()
            self._permissions.raise_if_denied(subscribe=(self.subject,))
        except BaseException:
            if self._stream_reader is not None:
                await self._stream_reader.close()
            await self._nc.close()
            self._nc = None
            raise
        self._expiry = asyncio.create_task(self._expire_loop(), name=f"kvbridge-expiry-{self.subject}")
        if self.config.metrics_port is not None:
            start_exporter(self.config.metrics_port, self.config.metrics_addr)
        return self

    async def close(self) -> None:
        """Stop: cancel resyncs, disconnect, end any ``async for``. Never raises."""
        if self._closed:
            return
        self._closed = True
        tasks = [w.syncing for w in self._workers.values() if w.syncing is not None]
        if self._expiry is not None:
            tasks.append(self._expiry)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._stream_reader is not None:
            await self._stream_reader.close()
        if self._nc is not None:
            try:
                await self._nc.close()
            except Exception as exc:  # closing must not fail the caller's shutdown
                log.debug("kvbridge subscriber: error closing the NATS connection: %r", exc)
        self._iter_wake.set()

    async def __aenter__(self) -> KvEventSubscriber:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __aiter__(self) -> AsyncIterator[Update]:
        if self._iter_queue is None:
            self._iter_queue = deque()
        return self._iterate(self._iter_queue)

    async def _iterate(self, queue: deque[Update]) -> AsyncIterator[Update]:
        try:
            while True:
                if self._iter_behind:
                    self._iter_behind = False
                    for update in self._catch_up():
                        yield update
                    continue
                if queue:
                    yield queue.popleft()
                    continue
                if self._closed:
                    return
                self._iter_wake.clear()
                await self._iter_wake.wait()
        finally:
            # Left early (break, or the generator was dropped): stop queueing for it.
            if self._iter_queue is queue:
                self._iter_queue = None
                self._iter_behind = False
                self._iter_known.clear()

    def _enqueue(self, update: Update) -> None:
        """Hand ``update`` to the iterator without ever waiting for it."""
        queue = self._iter_queue
        if queue is None or self._iter_behind:
            return  # behind: the catch-up will carry this update's effect
        if len(queue) >= self._queue_size:
            queue.clear()
            self._iter_behind = True
            if (n := tally(self._counts, "iterator_behind")) is not None:
                log.warning("kvbridge subscriber: the async iterator fell %d updates behind; it continues from "
                            "a reset per worker carrying the current view (%d time(s) so far)", self._queue_size, n)  # fmt: skip
        else:
            queue.append(update)
            self._iter_known.add((update.model, update.worker))
        self._iter_wake.set()

    def _catch_up(self) -> list[Update]:
        """For an iterator that fell behind: every worker's state now, as reset updates."""
        now = time.time()
        out = []
        for key in list(self._iter_known):
            if key not in self._workers:  # expired meanwhile
                self._iter_known.discard(key)
                out.append(Update(key[0], key[1], "", -1, KVEventBatch(now, []), True, "expired"))
        for key, w in self._workers.items():
            if w.epoch is None or w.seq.need_snapshot:
                continue  # not in sync yet: its snapshot is still to come, and will be queued
            if w.view is None:
                # No view to carry over: the worker's own snapshot will be the reset.
                w.seq.need_snapshot = True
                self._ensure_sync(w)
                continue
            events: list[Event] = list(w.view.as_events())
            out.append(Update(w.model, w.worker, w.epoch, w.view.seq, KVEventBatch(now, events), True, "behind"))
            self._iter_known.add(key)
        return out

    @property
    def views(self) -> dict[tuple[str, str], WorkerView]:
        return {key: w.view for key, w in self._workers.items() if w.view is not None}

    @property
    def stats(self) -> dict[str, int]:
        s = dict(self._counts)
        s["workers"] = len(self._workers)
        s["permission_errors"] = self._permissions.count
        s["reconnects"] = self._nc.stats["reconnects"] if self._nc is not None else 0
        # Our own link found dead (keepalive or the probe before an expiry), not the workers.
        s["link_failures"] = self._nc.link_failures if self._nc is not None else 0
        if self._stream_reader is not None:
            s.update(self._stream_reader.stats)
        return s

    @property
    def connected_url(self) -> str | None:
        """The NATS server this subscriber is connected to now (None while it is not)."""
        url = self._nc.connected_url if self._nc is not None and self._nc.is_connected else None
        return url.geturl() if url is not None else None

    def in_sync(self) -> bool:
        """True when no worker is resyncing (handy for tests and tools)."""
        return all(w.syncing is None and not w.seq.need_snapshot for w in self._workers.values())

    def worker_states(self) -> dict[tuple[str, str], tuple[str, str | None]]:
        """Per ``(model, worker)`` heard from: ``("exact", epoch)`` while its stream is applied in
        order, ``("resyncing", epoch)`` while a hole or a restart is being repaired (what is known
        of it may be stale). A router weighs the two differently (``Router(subscriber=...)``)."""
        return {
            key: ("resyncing" if w.syncing is not None or w.seq.need_snapshot else "exact", w.epoch)
            for key, w in self._workers.items()
        }

    # -- load reports (kvbridge.vllm's stat logger) --------------------------------------------------

    @property
    def loads(self) -> dict[tuple[str, str], tuple[LoadReport, float]]:
        """Each ``(model, worker)``'s latest :class:`LoadReport` and its age in seconds. When several
        API servers report one worker (each sees part of the steps), the gauges are the newest
        report's and the prefix-cache counters add up each API server's latest report that is at
        most two of its intervals older than the newest (kvbridge.bus.loads)."""
        return self._loads.latest()

    async def _on_load(self, msg: Any) -> None:
        try:
            key, report = parse_load_msg(msg.subject, msg.headers, msg.data, self.prefix)
        except DecodeError as exc:
            if (n := tally(self._counts, "malformed")) is not None:
                log.warning("kvbridge: malformed load report on %s skipped (%d malformed so far): %s", msg.subject, n, exc)
            return
        self._loads.add(key, report)

    # -- live messages ----------------------------------------------------------------------------

    async def _on_msg(self, msg: Any) -> None:
        """nats-py's callback (and the stream reader's): used when there is an ``on_update`` to
        await, and in JetStream mode."""
        for update in self._on_event(msg.subject, msg.headers, msg.data):
            await self._notify(update)

    def _on_event_now(self, subject: str, headers: dict[str, str] | None, data: bytes) -> None:
        """The client's read loop calls this itself when nothing needs awaiting (no ``on_update``):
        no message object, queue or task per message (kvbridge.bus.natsclient)."""
        try:
            for update in self._on_event(subject, headers, data):
                self._enqueue(update)
        except Exception:  # never into the connection's read loop
            log.exception("kvbridge subscriber: a message on %s could not be handled", subject)

    def _on_event(self, subject: str, headers: dict[str, str] | None, data: bytes) -> Iterator[Update]:
        """One live message: ordering, resync, and the updates it delivers, each applied (index,
        views, counts) when the caller asks for the next one, i.e. after it has handed on the last."""
        counts = self._counts
        counts["messages"] += 1
        counts["bytes"] += len(data)
        try:
            key = self._subject_keys.get(subject) or self._subject_key(subject)
            if not headers:
                raise DecodeError("no headers")
            epoch, seq, batch = parse_event_msg(headers, data, self._raw_bodies)
        except DecodeError:
            counts["malformed"] += 1
            return
        w = self._workers.get(key)
        if w is None:
            w = self._workers[key] = _Worker(self.prefix, key[0], key[1], self.track_views)
        w.heard(epoch, headers.get(HDR_HEARTBEAT))
        syncing, jetstream = w.syncing is not None, self.config.jetstream
        verdict = w.seq.offer(epoch, seq, batch, syncing=syncing, jetstream=jetstream)
        if (verdict is Verdict.DUPLICATE or verdict is Verdict.CONFLICT) and epoch != w.seq.epoch and self._outlived(w):
            log.warning("kvbridge subscriber: %s: epoch %s silent for %.1fs while an epoch given up speaks: "
                        "resyncing to follow the one alive", w.subjects.events, w.epoch,
                        w.last_heard - w.followed_heard)  # fmt: skip
            w.seq.revive(epoch)
            w.speaking_since.pop(epoch, None)
            verdict = w.seq.offer(epoch, seq, batch, syncing=syncing, jetstream=jetstream)
        if verdict is Verdict.DELIVER:
            yield self._deliver(w, seq, batch, "live")
            if w.seq.parked:
                yield from self._parked(w)
        elif verdict is Verdict.DUPLICATE:
            counts["duplicates"] += 1
        elif verdict is Verdict.GAP:
            counts["gaps"] += 1
            self._ensure_sync(w)
        elif verdict is Verdict.FIRST_CONTACT or verdict is Verdict.EPOCH_CHANGE:
            # First contact or a restart (new epoch): parked, and resynced from a snapshot.
            if verdict is Verdict.EPOCH_CHANGE:
                counts["epoch_changes"] += 1
            self._ensure_sync(w)
        elif verdict is Verdict.STREAM_START:
            yield from self._begin_epoch_from_stream(w, epoch, batch)
        elif verdict is Verdict.CONFLICT:
            counts["duplicates"] += 1
            if self._still_speaking(w, epoch):
                self._epoch_conflict(w, epoch)
        # Verdict.PARKED: a resync is under way and will take it from there.

    def _subject_key(self, subject: str) -> tuple[str, str]:
        """``(model, worker)`` of an events subject, remembered: one dict lookup per message after
        the first. Forgotten all at once past a bound, so made-up subjects cannot grow it."""
        key = parse_events_subject(subject, self.prefix)
        if key is None:
            raise DecodeError("not an events subject")
        if len(self._subject_keys) >= _MAX_SUBJECT_KEYS:
            self._subject_keys.clear()
        self._subject_keys[subject] = key
        return key

    def _outlived(self, w: _Worker) -> bool:
        """Whether the incarnation ``w`` follows has been silent past the worker's timeout while
        another (given up) has just spoken: then the followed one is the dead one."""
        limit = w.timeout(self.config.worker_timeout_s)
        return limit is not None and w.last_heard - w.followed_heard > limit

    @staticmethod
    def _still_speaking(w: _Worker, epoch: str) -> bool:
        """Whether ``epoch`` (given up) has been sending new seqs for longer than a late message
        of a dead incarnation can take to arrive (``_CONFLICT_AFTER_S``)."""
        now = time.monotonic()
        since = w.speaking_since.setdefault(epoch, now)
        if len(w.speaking_since) > MAX_RETIRED:  # forged epochs: keep the newest
            del w.speaking_since[next(iter(w.speaking_since))]
        return now - since > max(_CONFLICT_AFTER_S, w.heartbeat_s or 0.0)

    def _epoch_conflict(self, w: _Worker, other: str) -> None:
        self._counts["epoch_conflicts"] += 1
        if not w.conflict_warned:
            w.conflict_warned = True
            log.warning(
                "kvbridge subscriber: two live publishers on %s (epochs %s and %s): two engines share the worker "
                "id %r; only one of them is tracked. Give each engine its own worker_id.",
                w.subjects.events, w.epoch, other, w.worker,
            )  # fmt: skip

    def _begin_epoch_from_stream(self, w: _Worker, epoch: str, batch: Body) -> Iterator[Update]:
        """JetStream hook: the stream holds this incarnation from its first message, and a new
        incarnation starts with an empty cache, so it is rebuilt from the stream: no snapshot."""
        if w.epoch is not None and not w.seq.need_snapshot:
            self._counts["epoch_changes"] += 1
        w.seq.begin_stream(epoch)
        try:
            ts, rank = batch.ts, batch.rank
        except DecodeError:  # a raw body (index mode) the index will count as malformed
            ts, rank = time.time(), None
        yield self._deliver(w, -1, KVEventBatch(ts, [], rank), "stream", reset=True)
        yield self._deliver(w, 0, batch, "live")
        yield from self._parked(w)

    def _parked(self, w: _Worker) -> Iterator[Update]:
        """Delivers the parked messages that are next in order."""
        ready, stale = w.seq.ready()
        self._counts["duplicates"] += stale
        for seq, batch in ready:
            yield self._deliver(w, seq, batch, "live")

    async def _drain_parked(self, w: _Worker) -> None:
        for update in self._parked(w):
            await self._notify(update)

    def _deliver(self, w: _Worker, seq: int, batch: Body | KVEventBatch, source: str, reset: bool = False) -> Update:
        """Applies one update to the index, the worker's view and the counts; handing it on to
        ``on_update`` and the iterator is ``_notify``'s."""
        update = Update(w.model, w.worker, w.epoch or "", seq, batch, reset, source)
        if reset:  # a resync's outcome: the epoch it adopted answered just now
            w.followed_heard = time.monotonic()
        n_events = update.n_events if self.index is None else self._index_apply(w, update)
        if w.view is not None:
            w.view.apply(update)
        else:
            update._body.read = None  # what only a view reads
        self._counts["events"] += n_events
        return update

    async def _notify(self, update: Update) -> None:
        if self.on_update is not None:
            try:
                result = self.on_update(update)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                self._counts["callback_errors"] += 1
                log.exception("kvbridge on_update callback failed")
        if self._iter_queue is not None:
            self._enqueue(update)

    # -- expiry -------------------------------------------------------------------------------------

    async def _expire_loop(self) -> None:
        timeout = self.config.worker_timeout_s
        if timeout <= 0:
            return
        interval = max(0.1, min(1.0, timeout / 4))
        while not self._closed:
            await asyncio.sleep(interval)
            due = self._due(timeout)
            if not due:
                continue
            # Silence is the workers' fault only if our own link works: a dead path (no FIN, no
            # RST) silences every worker at once. No PONG: the link is replaced, and everyone is
            # given a full timeout again from the reconnect (_on_reconnected).
            why = f"{len(due)} worker(s) silent past their timeout"
            if not await self._nc.link_alive(self.config.request_timeout_s, why):
                continue
            for key, w in self._due(timeout):
                await self._expire(key, w)

    def _due(self, timeout: float) -> list[tuple[tuple[str, str], _Worker]]:
        """The workers silent for longer than their timeout, now."""
        now = time.monotonic()
        return [(key, w) for key, w in self._workers.items()
                if (limit := w.timeout(timeout)) is not None and now - w.last_heard > limit]  # fmt: skip

    async def _on_reconnected(self) -> None:
        # Whatever was sent while we were away is not the workers' silence: each gets a full
        # timeout from now, and a hole shows at its next message or heartbeat (then: replay).
        now = time.monotonic()
        for w in self._workers.values():
            w.last_heard = w.followed_heard = now

    async def _expire(self, key: tuple[str, str], w: _Worker) -> None:
        """Forget a worker that went silent: its view, its resync, and (by an update) everyone's state."""
        del self._workers[key]
        self._loads.forget(key)
        self._index_forget(w)
        if w.syncing is not None:
            w.syncing.cancel()
        self._counts["expired"] += 1
        log.info("kvbridge subscriber: worker %s/%s not heard from for %.1fs: dropped", w.model, w.worker,
                 time.monotonic() - w.last_heard)  # fmt: skip
        if w.epoch is not None:
            await self._notify(Update(w.model, w.worker, w.epoch, -1, KVEventBatch(time.time(), []), True, "expired"))

    # -- index feed ---------------------------------------------------------------------------------

    def _index_apply(self, w: _Worker, update: Update) -> int:
        """Feeds one update to the index; returns its number of events (0 if unreadable)."""
        body = update._body
        if update.reset:
            self._index_forget(w)
        if body.payload is not None:
            return self.index.apply(w.worker, body.payload, body.fmt)
        return self.index.apply(w.worker, body.batch)

    def _index_forget(self, w: _Worker) -> None:
        """Drops everything the index holds for ``w`` (a reset, or a worker gone)."""
        if self.index is not None:
            self.index.remove_worker(w.worker)

    # -- resync -------------------------------------------------------------------------------------

    def _ensure_sync(self, w: _Worker) -> None:
        if w.syncing is None and not self._closed:
            w.syncing = asyncio.create_task(self._resync(w), name=f"kvbridge-resync-{w.worker}")

    async def _resync(self, w: _Worker) -> None:
        backoff = _BACKOFF_S
        try:
            if self.config.jetstream:
                await asyncio.sleep(_STREAM_HOLE_GRACE_S)
            seq = w.seq
            while not self._closed:
                if seq.hole_filled:
                    # The hole filled itself (JetStream: re-sends after a broker crash land in the
                    # stream behind later messages), possibly while the worker did not answer.
                    await self._drain_parked(w)
                    if not seq.parked:
                        return
                ok = await (self._snapshot(w) if seq.need_snapshot else self._replay(w))
                if ok is not True:
                    if ok is _NO_RESPONDERS:  # nobody serves this subject (yet): no hurry
                        backoff = max(backoff, _BACKOFF_NO_RESPONDERS_S)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    continue
                backoff = _BACKOFF_S
                await self._drain_parked(w)
                if not seq.need_snapshot and not seq.parked:
                    return
        finally:
            w.syncing = None

    async def _request(self, subject: str, payload: bytes, until: tuple[str, ...]) -> list[Any] | object | None:
        """Send a request and collect the reply stream up to a message whose Kv-Reply is in ``until``
        (or an error reply); None if nobody answered in time (the worker may be down: the caller
        retries), ``_NO_RESPONDERS`` if nobody serves the subject."""
        nc = self._nc
        inbox = nc.new_inbox()
        try:
            sub = await nc.subscribe(inbox, pending_msgs_limit=1 << 20, pending_bytes_limit=1 << 30)
            try:
                await nc.publish(subject, payload, reply=inbox)
                replies = []
                while True:
                    m = await sub.next_msg(timeout=self.config.request_timeout_s)
                    headers = m.headers or {}
                    kind = headers.get(HDR_REPLY)
                    if kind in until:
                        replies.append(m)
                        return replies
                    if kind == REPLY_ERROR:
                        self._counts["request_errors"] += 1
                        log.warning("kvbridge subscriber: %s answered with an error: %s", subject,
                                    m.data[:500].decode(errors="replace"))  # fmt: skip
                        return None
                    if kind is None and HDR_SEQ not in headers:
                        # nats-py hands the server's 503 "no responders" status to the inbox as a message.
                        return _NO_RESPONDERS if headers.get("Status") == "503" else None
                    replies.append(m)
            finally:
                await sub.unsubscribe()
        except NoRespondersError:
            return _NO_RESPONDERS
        except Exception as exc:  # timeouts, disconnects, a closing client
            if not self._closed:
                self._counts["request_timeouts"] += 1
                if self._permissions.denied("publish", subject):
                    log.debug("kvbridge request on %s refused by NATS permissions", subject)
                else:
                    log.debug("kvbridge request on %s failed: %r", subject, exc)
            return None

    async def _replay(self, w: _Worker) -> object:  # True, False or _NO_RESPONDERS
        self._counts["replays"] += 1
        sq = w.seq
        parked_before = set(sq.parked)
        replies = await self._request(
            w.subjects.replay, json.dumps({"from": sq.next_seq, "epoch": sq.epoch}).encode(), (REPLY_END, REPLY_GONE)
        )
        if not isinstance(replies, list):
            return replies or False
        end = replies[-1].headers
        if end.get(HDR_EPOCH) != sq.epoch or end[HDR_REPLY] == REPLY_GONE:
            if end[HDR_REPLY] == REPLY_GONE:
                self._counts["replays_gone"] += 1
            sq.need_snapshot = True
            return True
        for m in replies[:-1]:
            try:
                epoch, seq, batch = parse_event_msg(m.headers or {}, m.data, self._raw_bodies)
            except DecodeError:
                # The worker's own copy is bad: every replay would bring it back. Only a snapshot
                # gets past it.
                self._counts["malformed"] += 1
                sq.need_snapshot = True
                return True
            take = sq.replayed(epoch, seq)
            if take is None:
                return False  # the publisher skipped: ask again (it will say "gone")
            if take:
                await self._notify(self._deliver(w, seq, batch, "replay"))
        # A parked message beyond what the worker had published when it answered was not sent by it.
        try:
            last = int(end.get(HDR_SEQ, "-1"))
        except ValueError:
            return False
        self._counts["malformed"] += sq.drop_bogus(parked_before, last)
        return True

    async def _snapshot(self, w: _Worker) -> object:  # True, False or _NO_RESPONDERS
        replies = await self._request(w.subjects.snapshot, b"{}", (REPLY_SNAPSHOT_END, REPLY_UNAVAILABLE))
        if not isinstance(replies, list):
            return replies or False
        end = replies[-1].headers
        epoch = end.get(HDR_EPOCH)
        if not epoch:
            return False
        if end[HDR_REPLY] == REPLY_UNAVAILABLE:
            # No pool behind this publisher: nothing to rebuild from. Join the live stream where it is.
            at = w.seq.join_live(epoch)
            self._counts["snapshots"] += 1
            await self._notify(self._deliver(w, at, KVEventBatch(time.time(), []), "snapshot", reset=True))
            return True
        try:
            seq = int(end[HDR_SEQ])
            count = int(end[HDR_COUNT])
            chunks = [m for m in replies[:-1] if (m.headers or {}).get(HDR_REPLY) == REPLY_SNAPSHOT]
            if len(chunks) != count:
                return False  # part of the stream was lost: ask again
            events: list[Any] = []
            ts, rank = time.time(), None
            for m in chunks:
                batch = decode(m.data, FORMATS.get(m.headers.get(HDR_CONTENT_TYPE), "msgpack"))
                events.extend(batch.events)
                ts, rank = batch.ts, batch.data_parallel_rank
        except (KeyError, ValueError):
            self._counts["malformed"] += 1
            return False
        w.seq.snapshot_taken(epoch, seq)
        self._counts["snapshots"] += 1
        await self._notify(self._deliver(w, seq, KVEventBatch(ts, events, rank), "snapshot", reset=True))
        return True


# _request's answer when nobody subscribes to the subject (a made-up or gone worker).
_NO_RESPONDERS = object()
