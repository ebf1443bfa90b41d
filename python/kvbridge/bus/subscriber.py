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

The subscriber is built in rooms: :mod:`kvbridge.bus.worker` (one worker's record and how long
it may be silent), :mod:`kvbridge.bus.delivery` (each update applied and handed on; the state
the rooms share), :mod:`kvbridge.bus.resync` (replay and snapshot requests),
:mod:`kvbridge.bus.liveness` (expiry, and which incarnation of a worker speaks); here:
connecting, the live messages' ordering, the async iterator, load reports and the stats.

Everything runs on the subscriber's asyncio loop; one resync task per worker at most.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections import deque
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

from kvbridge.metrics import register, start_exporter, tally
from kvbridge.config import Config
from kvbridge.bus.connection import connect
from kvbridge.bus.liveness import Liveness
from kvbridge.bus.loads import parse_load_msg
from kvbridge.bus.resync import Resync
from kvbridge.bus.sequencer import Verdict
from kvbridge.bus.update import Body, Update, WorkerView, parse_event_msg
from kvbridge.bus.worker import Worker
from kvbridge.wire.events import DecodeError, KVEventBatch
from kvbridge.wire.events import Event, LoadReport
from kvbridge.wire.subjects import HDR_HEARTBEAT, events_pattern, load_subject, parse_events_subject

__all__ = ["KvEventSubscriber", "Update", "WorkerView"]

log = logging.getLogger("kvbridge.subscriber")

# Events subjects remembered with their (model, worker); far more than any deployment's workers.
_MAX_SUBJECT_KEYS = 4096


class KvEventSubscriber(Liveness, Resync):
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
        super().__init__(
            config, subject or events_pattern(config.subject_prefix, model, worker), on_update=on_update,
            track_views=track_views, queue_size=queue_size, index=index,
        )  # fmt: skip
        # Messages handled in the client's read loop (no on_update at start()).
        self._direct = False
        self.metric_labels = {"subject": self.subject}
        #: JetStream mode (``config.jetstream``): where in the stream to begin; see kvbridge.bus.jetstream.
        self.stream_start = stream_start
        # Subject -> (model, worker), for the subjects seen (bounded: see _subject_key).
        self._subject_keys: dict[str, tuple[str, str]] = {}
        self._load_subject = load_subject(self.prefix, model, worker)
        self._expiry: asyncio.Task | None = None
        self._stream_reader: Any = None  # kvbridge.bus.jetstream.reader.StreamReader in JetStream mode
        register("subscriber", self)

    @property
    def on_update(self) -> Callable[[Update], Awaitable[None] | None] | None:
        return self._on_update

    @on_update.setter
    def on_update(self, callback: Callable[[Update], Awaitable[None] | None] | None) -> None:
        if callback is not None and not callable(callback):
            raise TypeError(f"on_update must be a callable (update) -> None or an awaitable, got {type(callback).__name__}")
        if callback is not None and self._direct:
            raise RuntimeError(
                "on_update must be given before start(): this subscriber started without one and handles "
                "messages in the connection's read loop, where nothing is awaited"
            )
        self._on_update = callback

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> KvEventSubscriber:
        if self._closed:
            raise RuntimeError("a closed KvEventSubscriber cannot be started again: make a new one")
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
            if self.config.metrics_port is not None:
                start_exporter(self.config.metrics_port, self.config.metrics_addr)
        except BaseException:
            if self._stream_reader is not None:
                await self._stream_reader.close()
            await self._nc.close()
            self._nc = None
            raise
        self._expiry = asyncio.create_task(self._expire_loop(), name=f"kvbridge-expiry-{self.subject}")
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
        if self._nc is None and not self._closed:  # it would wait forever for updates that never come
            raise RuntimeError("start() the KvEventSubscriber first (or `async with` it), then iterate")
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
        API servers report one worker (each sees part of the steps), the gauges are the freshest
        (``gauges_ts``) and the prefix-cache counters add up each API server's latest report that
        is at most two of its intervals older than the newest (kvbridge.bus.loads)."""
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
        except DecodeError as exc:
            if (n := tally(counts, "malformed")) is not None:
                log.warning("kvbridge: malformed event message on %s skipped (%d malformed so far): %s", subject, n, exc)
            return
        w = self._workers.get(key)
        if w is None:
            w = self._workers[key] = Worker(self.prefix, key[0], key[1], self.track_views)
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

    def _begin_epoch_from_stream(self, w: Worker, epoch: str, batch: Body) -> Iterator[Update]:
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
