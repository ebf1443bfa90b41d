"""JetStream mode's consuming side: an ordered reader of the stream that follows it across node losses.

``KvEventSubscriber(config_with_jetstream, stream_start=None)`` creates the stream if it is
missing (a router may start before any worker; it never changes an existing one) and reads it
through an ordered, ephemeral push consumer (:class:`StreamReader`) filtered to its subject -- from the stream's first
message (default), a stream sequence (``int``) or a time (aware ``datetime``) -- and stays on
it for live messages. The per-worker ``(epoch, seq)`` contract is unchanged: duplicates are
dropped, holes are repaired. What the stream adds: an incarnation whose seq 0 is in the stream
is rebuilt from the stream (a ``reset=True`` update with ``seq=-1``, no events and
``source="stream"``, then seq 0, 1, ...) without asking the worker for a snapshot, so a
subscriber that starts after the workers are gone still gets every view. A hole first gets
half a second for the stream to fill it -- after a broker crash, nats-py flushes its own
reconnect buffer before our re-send of the lost messages lands, so a worker's messages can be
out of order in the stream -- and only then is the worker asked (replay, then snapshot). An
incarnation whose beginning has aged out of the stream (or a start position in its middle)
still needs the worker's snapshot: with the worker gone, that view cannot be rebuilt.
The reader (:class:`StreamReader`, an ordered consumer of our own) re-creates its consumer
where it left off within about 1.5 s of silence, or at once on a delivery gap or a "consumer
deleted" status: after a broker restart, or in a cluster when the node its consumer lived on
dies.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import logging
import time
from typing import Any, Awaitable, Callable

from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import APIError

from kvbridge.config import Config
from kvbridge.bus.jetstream.admin import OUTAGE_LOG_EVERY_S, START_PATIENCE_S, JetStreamError, api_failure, ensure_stream

__all__ = ["StreamReader", "subscribe_stream"]

log = logging.getLogger("kvbridge.jetstream")

# Idle heartbeat of the subscriber's stream consumer; this many intervals without a message or a
# heartbeat and the consumer is re-created where it left off (how a reader survives the loss of
# the node its consumer lived on, or a broker restart).
_CONSUMER_HEARTBEAT_S = 1.0
_SILENT_HEARTBEATS = 1.5
# Pause between attempts to re-create a stream consumer while JetStream does not answer.
_RETRY_S = 0.5


class StreamReader:
    """An ordered, ephemeral push consumer on the stream, filtered to one subject, from ``start``,
    that follows the stream across node losses.

    nats-py 2.16 has an ordered consumer, but it re-creates the consumer only once two idle
    heartbeats went missing (checked every two intervals: 2-4 s of silence), tries once per check,
    and hands a "409 Consumer Deleted" status to the message callback as if it were a message. In a
    cluster the consumer lives on one node; when that node dies, or the stream's leader moves, a
    reader should be back within a second or two, so this one keeps its own clock: no message and
    no heartbeat for 1.5 heartbeat intervals (while connected), a gap in the consumer's delivery
    sequence, a heartbeat naming a later delivery than we saw, or a 409 status -> the consumer is
    created again from the stream sequence after the last one delivered, retried every
    ``_RETRY_S`` until the stream answers (a leader election takes a few seconds).

    Each consumer incarnation delivers to its own inbox; a lock serialises the callback across the
    old and the new subscription, so the callback sees one message at a time, in stream order, and
    never a message from a consumer that was replaced."""

    def __init__(self, nc: Any, config: Config, subject: str, cb: Callable[[Any], Awaitable[None]],
                 start: int | datetime.datetime | None = None, permissions: Any = None) -> None:  # fmt: skip
        self._nc = nc
        self._permissions = permissions
        self.config = config
        self.subject = subject
        self._cb = cb
        self._first = _start_config(start)
        self._hb = _CONSUMER_HEARTBEAT_S
        self._sseq = 0  # stream sequence of the last message delivered to the callback
        self._dseq = 1  # next delivery sequence expected from the current consumer
        self._deliver = ""
        self._sub: Any = None
        self._consumer: str | None = None
        self._lock = asyncio.Lock()
        self._last_activity = time.monotonic()
        self._reset: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._closed = False
        self._deletes: set[asyncio.Task] = set()  # best-effort deletions of replaced consumers
        self._failures_logged = 0.0
        self.counts = dict.fromkeys(("stream_consumer_resets", "stream_status_messages"), 0)

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.counts)

    @property
    def stream_seq(self) -> int:
        """The stream sequence of the last message handed to the callback (0: none yet)."""
        return self._sseq

    async def start(self) -> StreamReader:
        # The stream may not exist yet when a router starts before any worker.
        await ensure_stream(self._nc, self.config, update=False, patience=START_PATIENCE_S,
                            permissions=self._permissions)  # fmt: skip
        deadline = time.monotonic() + START_PATIENCE_S
        while True:
            try:
                await self._create()
                break
            except JetStreamError as exc:
                if not exc.transient or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(_RETRY_S)
        self._watchdog = asyncio.create_task(self._watch(), name=f"kvbridge-stream-reader-{self.subject}")
        return self

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in (self._watchdog, self._reset, *self._deletes) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _consumer_config(self, deliver: str) -> api.ConsumerConfig:
        cc = api.ConsumerConfig(
            deliver_subject=deliver,
            filter_subject=self.subject,
            ack_policy=api.AckPolicy.NONE,
            max_deliver=1,
            flow_control=True,
            idle_heartbeat=self._hb,
            num_replicas=1,
            mem_storage=True,
        )
        if self._sseq:
            cc.deliver_policy, cc.opt_start_seq = api.DeliverPolicy.BY_START_SEQUENCE, self._sseq + 1
        else:
            cc.deliver_policy, cc.opt_start_seq, cc.opt_start_time = self._first
        return cc

    async def _create(self) -> None:
        """A new consumer from the stream sequence after the last delivered, on a new inbox."""
        nc = self._nc
        deliver = nc.new_inbox()
        sub = await nc.subscribe(deliver, cb=functools.partial(self._on_raw, deliver), pending_msgs_limit=1 << 20,
                                 pending_bytes_limit=512 * 1024 * 1024)  # fmt: skip
        async with self._lock:  # the old subscription's callback in flight finishes first
            old, old_consumer = self._sub, self._consumer
            self._sub, self._deliver, self._dseq, self._consumer = sub, deliver, 1, None
            cc = self._consumer_config(deliver)
        self._last_activity = time.monotonic()
        if old is not None:
            try:
                await old.unsubscribe()
            except NatsError:
                pass
        jsm = nc.jetstream(timeout=self.config.request_timeout_s)
        if old_consumer is not None:
            # Best effort: a consumer that still lives would push to an inbox nobody reads until
            # the server drops it as inactive.
            task = asyncio.create_task(_quietly(jsm.delete_consumer(self.config.stream_name, old_consumer)))
            self._deletes.add(task)
            task.add_done_callback(self._deletes.discard)
        try:
            info = await jsm.add_consumer(self.config.stream_name, config=cc)
        except (APIError, NatsError, asyncio.TimeoutError) as exc:
            raise api_failure(
                f"cannot read JetStream stream {self.config.stream_name!r} for {self.subject} "
                f"(from stream seq {cc.opt_start_seq or cc.deliver_policy})", exc, self.config
            ) from exc  # fmt: skip
        if self._deliver == deliver:
            self._consumer = info.name

    def _reset_soon(self, why: str) -> None:
        if self._closed or (self._reset is not None and not self._reset.done()):
            return
        self.counts["stream_consumer_resets"] += 1
        log.info("kvbridge: stream reader %s: re-creating its consumer from stream seq %d (%s)",
                 self.subject, self._sseq + 1, why)  # fmt: skip
        self._reset = asyncio.create_task(self._recreate(), name=f"kvbridge-stream-reset-{self.subject}")

    async def _recreate(self) -> None:
        since = time.monotonic()
        while not self._closed:
            if self._nc.is_connected:
                try:
                    await self._create()
                    return
                except JetStreamError as exc:
                    now = time.monotonic()
                    if now - self._failures_logged >= OUTAGE_LOG_EVERY_S:
                        self._failures_logged = now
                        log.warning("kvbridge: stream reader %s without a consumer for %.1fs, retrying: %s",
                                    self.subject, now - since, exc)  # fmt: skip
            await asyncio.sleep(_RETRY_S)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._hb / 4)
            if not self._nc.is_connected or (self._reset is not None and not self._reset.done()):
                # Disconnected: the clock waits for the reconnect (which re-subscribes our inbox).
                self._last_activity = time.monotonic()
                continue
            silent = time.monotonic() - self._last_activity
            if silent > _SILENT_HEARTBEATS * self._hb:
                self._reset_soon(f"no message or heartbeat for {silent:.1f}s")

    async def _on_raw(self, deliver: str, msg: Any) -> None:
        async with self._lock:
            if deliver != self._deliver:
                return  # from a consumer we replaced (data messages keep their stream subject)
            self._last_activity = time.monotonic()
            headers = msg.headers
            status = headers.get(api.Header.STATUS) if headers else None
            if status:
                await self._on_status(msg, status, headers)
                return
            try:
                meta = msg.metadata
                sseq, dseq = meta.sequence.stream, meta.sequence.consumer
            except Exception:
                self._reset_soon(f"a message without JetStream metadata (reply {msg.reply!r})")
                return
            if dseq != self._dseq:
                self._reset_soon(f"delivery {dseq} after {self._dseq - 1}: messages missed")
                return
            self._dseq, self._sseq = dseq + 1, sseq
            await self._cb(msg)

    async def _on_status(self, msg: Any, status: str, headers: dict[str, str]) -> None:
        if status == api.StatusCode.CONTROL_MESSAGE:
            # Flow control (with a reply) or an idle heartbeat. Callbacks run one at a time in
            # delivery order, so everything before this message has been handed over already.
            reply = msg.reply or headers.get(api.Header.CONSUMER_STALLED)
            if reply:
                try:
                    await self._nc.publish(reply)
                except NatsError:
                    pass
            last = headers.get(api.Header.LAST_CONSUMER)
            if not msg.reply and last is not None and int(last) != self._dseq - 1:
                self._reset_soon(f"the consumer delivered {last}, we saw {self._dseq - 1}")
            return
        self.counts["stream_status_messages"] += 1
        # 409 "Consumer Deleted" (its stream or node went away), or anything else unexpected.
        self._reset_soon(f"status {status} {headers.get(api.Header.DESCRIPTION, '')}".strip())


def _start_config(start: int | datetime.datetime | None) -> tuple[api.DeliverPolicy, int | None, datetime.datetime | None]:
    if start is None:
        return api.DeliverPolicy.ALL, None, None
    if isinstance(start, datetime.datetime):
        if start.tzinfo is None:
            raise ValueError("stream_start: a datetime needs a timezone")
        return api.DeliverPolicy.BY_START_TIME, None, start
    if isinstance(start, int) and not isinstance(start, bool) and start >= 1:
        return api.DeliverPolicy.BY_START_SEQUENCE, start, None
    raise ValueError(f"stream_start must be None, a stream sequence >= 1 or an aware datetime, got {start!r}")


async def _quietly(coro: Awaitable[Any]) -> None:
    try:
        await coro
    except Exception:
        pass


async def subscribe_stream(
    nc: Any,
    config: Config,
    subject: str,
    cb: Callable[[Any], Awaitable[None]],
    start: int | datetime.datetime | None = None,
    permissions: Any = None,
) -> StreamReader:
    """A started :class:`StreamReader` on the stream, filtered to ``subject``, from ``start``."""
    return await StreamReader(nc, config, subject, cb, start, permissions).start()
