"""The consumer side of the delivery contract (DESIGN.md, "Delivery guarantees").

``KvEventSubscriber`` subscribes to event subjects and, per worker, turns whatever arrives --
in order, duplicated, with holes, from a restarted worker, or garbage -- into an exactly-once,
in-order sequence of :class:`Update` s:

* in-order live messages are delivered as they come;
* a hole (a seq beyond the next expected one) parks later messages and asks the worker's replay
  subject for the missing range; if the worker answers "gone", or the worker is new to us, or it
  changed epoch (restarted), it asks for a snapshot, delivered as one ``reset=True`` update, and
  continues with the parked messages after the snapshot's seq;
* anything that is not a well-formed event message is counted (``stats["malformed"]``) and skipped.

Everything runs on the subscriber's asyncio loop; one resync task per worker at most.
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import inspect
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from kvbridge import _native, metrics
from kvbridge.config import Config
from kvbridge.connection import connect
from kvbridge.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, KVEventBatch, decode_batch
from kvbridge.subjects import (
    FORMATS,
    HDR_CONTENT_TYPE,
    HDR_COUNT,
    HDR_EPOCH,
    HDR_REPLY,
    HDR_SEQ,
    REPLY_END,
    REPLY_GONE,
    REPLY_SNAPSHOT,
    REPLY_SNAPSHOT_END,
    REPLY_UNAVAILABLE,
    WorkerSubjects,
    events_pattern,
    parse_events_subject,
)

__all__ = ["KvEventSubscriber", "Update", "WorkerView"]

log = logging.getLogger("kvbridge.consumer")

# Parked out-of-order messages per worker; beyond this the oldest are let go (replay fetches them).
_MAX_PARKED = 65536
# JetStream mode: how long a hole may wait for the stream to fill it before the worker is asked.
_STREAM_HOLE_GRACE_S = 0.5
# Epochs proven stale per worker (old incarnations, forged headers); bounded, oldest forgotten.
_MAX_RETIRED = 64


_STORED, _REMOVED, _CLEARED = 0, 1, 2


class _Body:
    """A message's batch, decoded only as far as someone needs it.

    Views need only the block hashes; a full decode builds a Python int for every token id, which
    is most of a subscriber's work. vLLM-shaped msgpack payloads are scanned natively instead
    (``_native.scan_batch_msgpack``, which validates the whole payload against the schema), and
    the KVEventBatch is decoded on first access to ``batch``. Everything else is decoded at once,
    as before, so a malformed payload is still rejected on arrival.
    """

    __slots__ = ("payload", "fmt", "_batch", "ts", "rank", "n_events", "n_blocks", "ops")

    def __init__(self, payload: bytes, fmt: str, raw: bool = False) -> None:
        self.payload, self.fmt = payload, fmt
        if raw:
            # An Index reads the bytes itself: nothing is scanned or decoded unless asked for.
            self._batch = None
            return
        scanned = _scan(payload) if fmt == "msgpack" and payload.__class__ is bytes else None
        if scanned is None:
            self._set_batch(_decode(payload, fmt))
        else:
            self._batch = None
            self.ts, self.rank, self.n_events, self.n_blocks, self.ops = scanned

    @classmethod
    def of(cls, batch: KVEventBatch) -> _Body:
        body = cls.__new__(cls)
        body.payload, body.fmt = None, None
        body._set_batch(batch)
        return body

    def _set_batch(self, batch: KVEventBatch) -> None:
        self._batch = batch
        self.ts, self.rank, self.n_events = batch.ts, batch.data_parallel_rank, len(batch.events)
        self.ops, self.n_blocks = _ops_of(batch.events)

    @property
    def batch(self) -> KVEventBatch:
        batch = self._batch
        if batch is None:
            # The scan vouched for these bytes, so this decode cannot fail (a raw body's can:
            # DecodeError).
            batch = self._batch = _decode(self.payload, self.fmt)  # type: ignore[arg-type]
        return batch

    def __getattr__(self, name: str) -> Any:
        # Only a raw body's unset slots get here: decode on first use.
        if name in ("ts", "rank", "n_events", "n_blocks", "ops"):
            self._set_batch(self.batch)
            return object.__getattribute__(self, name)
        raise AttributeError(name)


def _ops_of(events: list[Any]) -> tuple[list[tuple[int, list[Any]]], int]:
    """The scan's ``(kind, hashes)`` ops for decoded events, and the block count."""
    ops: list[tuple[int, list[Any]]] = []
    n_blocks = 0
    for ev in events:
        cls = ev.__class__
        if cls is BlockStored:
            kind, hashes = _STORED, ev.block_hashes
        elif cls is BlockRemoved:
            kind, hashes = _REMOVED, ev.block_hashes
        elif cls is AllBlocksCleared:
            kind, hashes = _CLEARED, []
        else:
            continue
        n_blocks += len(hashes)
        if ops and ops[-1][0] == kind:
            ops[-1][1].extend(hashes)
        else:
            ops.append((kind, list(hashes)))
    return ops, n_blocks


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
        batch: KVEventBatch | _Body,
        reset: bool = False,
        source: str = "live",
    ) -> None:
        self.model, self.worker, self.epoch, self.seq = model, worker, epoch, seq
        self.reset, self.source = reset, source
        self._body = batch if batch.__class__ is _Body else _Body.of(batch)  # type: ignore[arg-type]

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
    """The set of block hashes a worker holds, as its events say (no prefix structure)."""

    __slots__ = ("blocks", "epoch", "seq")

    def __init__(self) -> None:
        self.blocks: set[Any] = set()
        self.epoch: str | None = None
        self.seq = -1

    def apply(self, update: Update) -> None:
        if update.reset:
            self.blocks.clear()
        blocks = self.blocks
        for kind, hashes in update._body.ops:
            if kind == _STORED:
                blocks.update(hashes)
            elif kind == _REMOVED:
                blocks.difference_update(hashes)
            else:
                blocks.clear()
        self.epoch, self.seq = update.epoch, update.seq

    def apply_events(self, events: list[Any]) -> None:
        blocks = self.blocks
        for ev in events:
            cls = ev.__class__
            if cls is BlockStored:
                blocks.update(ev.block_hashes)
            elif cls is BlockRemoved:
                blocks.difference_update(ev.block_hashes)
            elif cls is AllBlocksCleared:
                blocks.clear()


class _Malformed(Exception):
    pass


class _Worker:
    __slots__ = (
        "model", "worker", "subjects", "epoch", "next_seq", "parked", "parked_epoch", "retired",
        "need_snapshot", "syncing", "view",
    )  # fmt: skip

    def __init__(self, prefix: str, model: str, worker: str, track_view: bool) -> None:
        self.model, self.worker = model, worker
        self.subjects = WorkerSubjects.build(prefix, model, worker)
        self.epoch: str | None = None
        self.next_seq = 0
        self.parked: dict[int, _Body] = {}
        self.parked_epoch: str | None = None
        self.retired: list[str] = []
        self.need_snapshot = True
        self.syncing: asyncio.Task | None = None
        self.view = WorkerView() if track_view else None

    def retire(self, epoch: str | None) -> None:
        if epoch is not None and epoch not in self.retired:
            self.retired.append(epoch)
            del self.retired[:-_MAX_RETIRED]


class KvEventSubscriber:
    """Subscribes to ``<prefix>.events.<model>.<worker>`` (``None`` = every model / worker, or an
    explicit ``subject`` pattern) and delivers :class:`Update` s per worker, in order, exactly once.

    Deliveries go to ``on_update(update)`` (sync or async) if given, and to ``async for update in
    subscriber`` once iteration has begun. ``views`` holds a :class:`WorkerView` per
    ``(model, worker)`` unless ``track_views=False``.

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
        if config is None:
            config = Config.from_env(**options)
        elif options:
            config = config.replace(**options)
        self.config = config
        self.prefix = config.subject_prefix
        self.subject = subject or events_pattern(self.prefix, model, worker)
        self.on_update = on_update
        self.index = index
        self.track_views = index is None if track_views is None else track_views
        # Scanning builds Python hash lists for views; an index reads the bytes itself.
        self._raw_bodies = index is not None and not self.track_views
        self.metric_labels = {"subject": self.subject}
        self._queue_size = queue_size
        #: JetStream mode (``config.jetstream``): where in the stream to begin; see kvbridge.jetstream.
        self.stream_start = stream_start
        self._queue: asyncio.Queue | None = None
        self._workers: dict[tuple[str, str], _Worker] = {}
        self._nc: Any = None
        self._closed = False
        self._counts = dict.fromkeys(
            ("messages", "events", "bytes", "duplicates", "gaps", "replays", "replays_gone", "snapshots",
             "epoch_changes", "malformed", "request_timeouts", "callback_errors"),
            0,
        )  # fmt: skip
        metrics.register("subscriber", self)

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> KvEventSubscriber:
        if self._nc is not None:
            return self
        self._nc = await connect(self.config)
        if self.config.jetstream:
            from kvbridge.jetstream import subscribe_stream

            try:
                await subscribe_stream(self._nc, self.config, self.subject, self._on_msg, self.stream_start)
            except BaseException:
                await self._nc.close()
                self._nc = None
                raise
        else:
            await self._nc.subscribe(
                self.subject, cb=self._on_msg, pending_msgs_limit=1 << 20, pending_bytes_limit=512 * 1024 * 1024
            )
        await self._nc.flush()
        if self.config.metrics_port is not None:
            metrics.start_exporter(self.config.metrics_port, self.config.metrics_addr)
        return self

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [w.syncing for w in self._workers.values() if w.syncing is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._nc is not None:
            await self._nc.close()
        if self._queue is not None:
            self._queue.put_nowait(None)

    async def __aenter__(self) -> KvEventSubscriber:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __aiter__(self) -> AsyncIterator[Update]:
        if self._queue is None:
            self._queue = asyncio.Queue(self._queue_size)
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Update]:
        assert self._queue is not None
        while True:
            update = await self._queue.get()
            if update is None:
                return
            yield update

    @property
    def views(self) -> dict[tuple[str, str], WorkerView]:
        return {key: w.view for key, w in self._workers.items() if w.view is not None}

    @property
    def stats(self) -> dict[str, int]:
        s = dict(self._counts)
        s["workers"] = len(self._workers)
        return s

    def in_sync(self) -> bool:
        """True when no worker is resyncing (handy for tests and tools)."""
        return all(w.syncing is None and not w.need_snapshot for w in self._workers.values())

    # -- live messages ----------------------------------------------------------------------------

    async def _on_msg(self, msg: Any) -> None:
        counts = self._counts
        counts["messages"] += 1
        counts["bytes"] += len(msg.data)
        try:
            key = parse_events_subject(msg.subject, self.prefix)
            if key is None:
                raise _Malformed("not an events subject")
            epoch, seq, batch = _parse_event_msg(msg, self._raw_bodies)
        except (_Malformed, DecodeError):
            counts["malformed"] += 1
            return
        w = self._workers.get(key)
        if w is None:
            w = self._workers[key] = _Worker(self.prefix, key[0], key[1], self.track_views)
        if epoch != w.epoch:
            if epoch in w.retired:
                counts["duplicates"] += 1
                return
            if seq == 0 and self.config.jetstream and w.syncing is None:
                await self._begin_epoch_from_stream(w, epoch, batch)
                return
            # First contact or a restart (new epoch): park, and resync from a snapshot.
            if w.parked_epoch != epoch:
                w.parked.clear()
                w.parked_epoch = epoch
            self._park(w, seq, batch)
            if w.epoch is not None and not w.need_snapshot:
                counts["epoch_changes"] += 1
            w.need_snapshot = True
            self._ensure_sync(w)
            return
        if seq < w.next_seq:
            counts["duplicates"] += 1
            return
        if w.syncing is not None:
            w.parked_epoch = epoch
            self._park(w, seq, batch)
            return
        if seq == w.next_seq:
            w.next_seq = seq + 1
            await self._deliver(w, seq, batch, "live")
            if w.parked:
                await self._drain_parked(w)
            return
        counts["gaps"] += 1
        w.parked_epoch = epoch
        self._park(w, seq, batch)
        self._ensure_sync(w)

    async def _begin_epoch_from_stream(self, w: _Worker, epoch: str, batch: _Body) -> None:
        """JetStream hook: the stream holds this incarnation from its first message, and a new
        incarnation starts with an empty cache, so it is rebuilt from the stream: no snapshot."""
        if w.epoch is not None and not w.need_snapshot:
            self._counts["epoch_changes"] += 1
        self._adopt_epoch(w, epoch)
        w.need_snapshot = False
        w.next_seq = 0
        try:
            ts, rank = batch.ts, batch.rank
        except DecodeError:  # a raw body (index mode) the index will count as malformed
            ts, rank = time.time(), None
        await self._deliver(w, -1, KVEventBatch(ts, [], rank), "stream", reset=True)
        w.next_seq = 1
        await self._deliver(w, 0, batch, "live")
        await self._drain_parked(w)

    def _park(self, w: _Worker, seq: int, batch: _Body) -> None:
        parked = w.parked
        parked[seq] = batch
        if len(parked) > _MAX_PARKED:
            del parked[min(parked)]

    async def _drain_parked(self, w: _Worker) -> None:
        parked = w.parked
        for stale in [s for s in parked if s < w.next_seq]:
            del parked[stale]
            self._counts["duplicates"] += 1
        while parked:
            batch = parked.pop(w.next_seq, None)
            if batch is None:
                break
            seq = w.next_seq
            w.next_seq = seq + 1
            await self._deliver(w, seq, batch, "live")

    async def _deliver(
        self, w: _Worker, seq: int, batch: _Body | KVEventBatch, source: str, reset: bool = False
    ) -> None:
        update = Update(w.model, w.worker, w.epoch or "", seq, batch, reset, source)
        n_events = update.n_events if self.index is None else self._index_apply(w, update)
        if w.view is not None:
            w.view.apply(update)
        self._counts["events"] += n_events
        if self.on_update is not None:
            try:
                result = self.on_update(update)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                self._counts["callback_errors"] += 1
                log.exception("kvbridge on_update callback failed")
        if self._queue is not None:
            await self._queue.put(update)

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
        backoff = 0.05
        try:
            if self.config.jetstream:
                await asyncio.sleep(_STREAM_HOLE_GRACE_S)
            while not self._closed:
                if not w.need_snapshot and w.next_seq in w.parked:
                    # The hole filled itself (JetStream: re-sends after a broker crash land in the
                    # stream behind later messages), possibly while the worker did not answer.
                    await self._drain_parked(w)
                    if not w.parked:
                        return
                ok = await (self._snapshot(w) if w.need_snapshot else self._replay(w))
                if not ok:
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                    continue
                backoff = 0.05
                await self._drain_parked(w)
                if not w.need_snapshot and not w.parked:
                    return
        finally:
            w.syncing = None

    async def _request(self, subject: str, payload: bytes, until: tuple[str, ...]) -> list[Any] | None:
        """Send a request and collect the reply stream up to a message whose Kv-Reply is in ``until``;
        None if nobody answered in time (the worker may be down: the caller retries)."""
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
                    if kind is None and HDR_SEQ not in headers:
                        return None  # a "no responders" status, or noise
                    replies.append(m)
            finally:
                await sub.unsubscribe()
        except Exception as exc:  # timeouts, disconnects, a closing client
            if not self._closed:
                self._counts["request_timeouts"] += 1
                log.debug("kvbridge request on %s failed: %r", subject, exc)
            return None

    async def _replay(self, w: _Worker) -> bool:
        self._counts["replays"] += 1
        parked_before = set(w.parked)
        replies = await self._request(
            w.subjects.replay, json.dumps({"from": w.next_seq, "epoch": w.epoch}).encode(), (REPLY_END, REPLY_GONE)
        )
        if replies is None:
            return False
        end = replies[-1].headers
        if end.get(HDR_EPOCH) != w.epoch or end[HDR_REPLY] == REPLY_GONE:
            if end[HDR_REPLY] == REPLY_GONE:
                self._counts["replays_gone"] += 1
            w.need_snapshot = True
            return True
        for m in replies[:-1]:
            try:
                epoch, seq, batch = _parse_event_msg(m, self._raw_bodies)
            except (_Malformed, DecodeError):
                self._counts["malformed"] += 1
                return False
            if epoch != w.epoch or seq < w.next_seq:
                continue
            if seq > w.next_seq:
                return False  # the publisher skipped: ask again (it will say "gone")
            w.next_seq = seq + 1
            await self._deliver(w, seq, batch, "replay")
        # A parked message beyond what the worker had published when it answered was not sent by it.
        try:
            last = int(end.get(HDR_SEQ, "-1"))
        except ValueError:
            return False
        bogus = [s for s in parked_before if s > last and s in w.parked]
        for s in bogus:
            del w.parked[s]
        self._counts["malformed"] += len(bogus)
        return True

    async def _snapshot(self, w: _Worker) -> bool:
        replies = await self._request(w.subjects.snapshot, b"{}", (REPLY_SNAPSHOT_END, REPLY_UNAVAILABLE))
        if replies is None:
            return False
        end = replies[-1].headers
        epoch = end.get(HDR_EPOCH)
        if not epoch:
            return False
        if end[HDR_REPLY] == REPLY_UNAVAILABLE:
            # No pool behind this publisher: nothing to rebuild from. Join the live stream where it is.
            self._adopt_epoch(w, epoch)
            w.next_seq = min(w.parked) if w.parked else w.next_seq
            w.need_snapshot = False
            await self._deliver(w, w.next_seq - 1, KVEventBatch(time.time(), []), "snapshot", reset=True)
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
                batch = _decode(m.data, FORMATS.get(m.headers.get(HDR_CONTENT_TYPE), "msgpack"))
                events.extend(batch.events)
                ts, rank = batch.ts, batch.data_parallel_rank
        except (KeyError, ValueError):
            self._counts["malformed"] += 1
            return False
        self._adopt_epoch(w, epoch)
        w.next_seq = seq + 1
        w.need_snapshot = False
        self._counts["snapshots"] += 1
        await self._deliver(w, seq, KVEventBatch(ts, events, rank), "snapshot", reset=True)
        return True

    def _adopt_epoch(self, w: _Worker, epoch: str) -> None:
        if w.epoch != epoch:
            w.retire(w.epoch)
        if w.parked_epoch != epoch:
            w.retire(w.parked_epoch)
            w.parked.clear()
        w.epoch = w.parked_epoch = epoch


def _parse_event_msg(msg: Any, raw: bool = False) -> tuple[str, int, _Body]:
    headers = msg.headers
    if not headers:
        raise _Malformed("no headers")
    epoch = headers.get(HDR_EPOCH)
    raw_seq = headers.get(HDR_SEQ)
    if not epoch or raw_seq is None or HDR_REPLY in headers:
        raise _Malformed("missing Kv-Epoch / Kv-Seq")
    try:
        seq = int(raw_seq)
    except ValueError:
        raise _Malformed("Kv-Seq is not an integer") from None
    if seq < 0:
        raise _Malformed("negative Kv-Seq")
    content_type = headers.get(HDR_CONTENT_TYPE)
    fmt = "msgpack" if content_type is None else FORMATS.get(content_type)
    if fmt is None:
        raise _Malformed(f"unknown Content-Type {content_type!r}")
    return epoch, seq, _Body(msg.data, fmt, raw)


_scan = _native.scan_batch_msgpack


def _decode(payload: bytes, fmt: str) -> KVEventBatch:
    # A batch is thousands of small lists (token ids): letting the cyclic GC run in the middle of
    # decoding them more than doubles the cost, and they cannot form cycles. Pausing it for the
    # call changes nothing else; the objects stay tracked and are collected as usual afterwards.
    if gc.isenabled():
        gc.disable()
        try:
            return decode_batch(payload, fmt)
        finally:
            gc.enable()
    return decode_batch(payload, fmt)
