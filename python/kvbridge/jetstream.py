"""JetStream mode: the event subjects stored in a stream, so consumers can catch up without workers.

Core NATS keeps nothing: a consumer that starts late, or a worker that has gone, leaves only the
replay/snapshot protocol of docs/delivery.md, which needs the worker alive. With
``jetstream=True`` (``KVBRIDGE_JETSTREAM=1``) the same messages -- same subjects, same headers, same
payload bytes -- are also stored in a JetStream stream, and a subscriber can rebuild every worker's
view from the stream alone.

The stream
    One stream, ``stream_name`` (default ``KV_EVENTS``), over ``<prefix>.events.>``: every model
    and worker under the prefix. One stream per prefix rather than per model because stream
    subjects may not overlap, so per-model streams would need per-model names and every consumer
    would need to know them; a subscriber filters by model/worker with the consumer's filter
    subject instead. File storage, limits retention, ``max_age = stream_max_age_s``,
    ``duplicate_window = stream_duplicate_window_s`` (de-duplication on ``Nats-Msg-Id``).

    Every publisher ensures the stream at start: created if missing, otherwise *updated in place*
    (never deleted and re-created, so what other workers stored stays) when our subject is not
    covered or the limits differ from this publisher's config. Updating with a smaller max age
    drops older messages: that is the operator's choice, made by configuring it.

Publishing
    ``publish()`` is the same non-blocking hand-off. The sender sends ring messages with a reply
    subject ``<ack inbox>.<seq>``; the stream's ack comes back there. At most ``max_in_flight``
    messages are unacknowledged at a time; a message leaves the must-re-send state only when
    acked. If acks stop coming for ``request_timeout_s`` (a broker crash swallows in-flight
    messages and their acks), or the connection comes back, everything from the oldest unacked
    message is sent again: ``Nats-Msg-Id = <worker>:<epoch>:<seq>`` makes the stream drop the
    copies it already has (within the duplicate window). The ring buffer is the re-send store, so
    it also bounds memory here; an unacked message the ring had to evict is counted
    (``stats["js_unacked_evicted"]``) and is a hole consumers repair by replay/snapshot.
    ``close()`` waits (up to its timeout) until everything handed over is acked: a closed
    publisher's events are in the stream.
    Heartbeats (empty batches) are stored too, so an idle worker adds ``1 / heartbeat_s`` tiny
    messages per second to the stream; core-NATS subscribers keep working alongside.

    Why not nats-py's ``js.publish_async``: in 2.16 its futures have no timeout (an ack lost with a
    crashed broker leaves them pending forever), a failing ``nc.publish`` inside it leaves an
    orphaned future holding a window slot, and a stream error reply raises inside the client's
    reader instead of failing the future (nats-io/nats.py#985). Acks keyed by our own seq also make
    "re-send from the oldest unacked" a counter, not a search.

Consuming
    ``KvEventSubscriber(config_with_jetstream, stream_start=None)`` creates the stream if it is
    missing (a router may start before any worker; it never changes an existing one) and reads it
    through an ordered, ephemeral push consumer filtered to its subject -- from the stream's first
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
    After a broker restart nats-py re-creates the ordered consumer where it left off once two of
    its 1 s idle heartbeats are missing.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import time
from typing import Any, Awaitable, Callable

from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from kvbridge.config import Config, ConfigError
from kvbridge.errors import Error
from kvbridge.outbox import Outbox

__all__ = ["JetStreamAcks", "JetStreamError", "ensure_stream", "stream_subjects", "subscribe_stream"]

log = logging.getLogger("kvbridge.jetstream")

#: Unacknowledged messages allowed on the wire per publisher.
MAX_IN_FLIGHT = 1024
# Idle heartbeat of the subscriber's ordered consumer: two missed ones make nats-py re-create the
# consumer where it left off, which is how a subscriber recovers from a broker restart.
_CONSUMER_HEARTBEAT_S = 1.0
# JetStream API error code: "stream name already in use" (another worker created it first).
_ERR_STREAM_NAME_IN_USE = 10058


class JetStreamError(Error, RuntimeError):
    """JetStream is not available, or the stream cannot be created/updated as configured."""


def stream_subjects(config: Config) -> list[str]:
    return [f"{config.subject_prefix}.events.>"]


async def ensure_stream(nc: Any, config: Config, *, update: bool = True) -> api.StreamInfo:
    """Create the stream, or update it in place to cover our subject with our limits (``update``;
    subscribers only create a missing one: a reader should not change what writers keep)."""
    if config.stream_duplicate_window_s > config.stream_max_age_s:
        raise ConfigError(
            "kvbridge config stream_duplicate_window_s (KVBRIDGE_STREAM_DUPLICATE_WINDOW_S): "
            f"{config.stream_duplicate_window_s}s is longer than stream_max_age_s ({config.stream_max_age_s}s)"
        )
    jsm = nc.jetstream(timeout=config.request_timeout_s)
    want = stream_subjects(config)
    try:
        for _ in range(3):  # create/update races with other workers starting at the same time
            try:
                info = await jsm.stream_info(config.stream_name)
            except NotFoundError:
                try:
                    return await jsm.add_stream(
                        api.StreamConfig(
                            name=config.stream_name,
                            subjects=want,
                            storage=api.StorageType.FILE,
                            retention=api.RetentionPolicy.LIMITS,
                            discard=api.DiscardPolicy.OLD,
                            max_age=config.stream_max_age_s,
                            duplicate_window=config.stream_duplicate_window_s,
                        )
                    )
                except APIError as exc:
                    if exc.err_code == _ERR_STREAM_NAME_IN_USE:
                        continue
                    raise
            current = info.config
            subjects = list(current.subjects or [])
            missing = [s for s in want if s not in subjects]
            if not update or (
                not missing
                and _same(current.max_age, config.stream_max_age_s)
                and _same(current.duplicate_window, config.stream_duplicate_window_s)
            ):
                return info
            log.info(
                "kvbridge: updating stream %s in place (subjects +%s, max_age %ss, duplicate_window %ss)",
                config.stream_name, missing, config.stream_max_age_s, config.stream_duplicate_window_s,
            )  # fmt: skip
            return await jsm.update_stream(
                current.evolve(
                    subjects=subjects + missing,
                    max_age=config.stream_max_age_s,
                    duplicate_window=config.stream_duplicate_window_s,
                )
            )
        raise JetStreamError(f"stream {config.stream_name}: kept changing while being created")
    except (APIError, NatsError, asyncio.TimeoutError) as exc:
        if isinstance(exc, JetStreamError):
            raise
        if isinstance(exc, ServiceUnavailableError):
            # nats-py's text for "no responders on $JS.API" is a row of Nones; say what it means.
            raise JetStreamError(
                f"JetStream is not enabled on the NATS server at {', '.join(config.servers)} (nothing answers "
                f"$JS.API, so stream {config.stream_name!r} cannot be used): start nats-server with -js, "
                f"or unset KVBRIDGE_JETSTREAM"
            ) from exc
        raise JetStreamError(
            f"cannot create or update JetStream stream {config.stream_name!r} over {want}: "
            f"{type(exc).__name__}: {exc} (is the server running with JetStream, -js?)"
        ) from exc


def _same(seconds: float | None, want: float) -> bool:
    return seconds is not None and abs(seconds - want) < 1e-3


class JetStreamAcks:
    """The JetStream half of a :class:`kvbridge.KvEventPublisher`: stream set-up, the ack window,
    re-sends. It drives the publisher's :class:`kvbridge.outbox.Outbox` through its public
    methods only: ``send(seq, reply)`` sends a held message and moves the cursor (the
    publisher's, which also owns headers and counters), ``wake()`` wakes the publisher's send
    loop, ``settle()`` numbers queued hand-offs and says whether any are left."""

    def __init__(
        self,
        nc: Any,
        config: Config,
        outbox: Outbox,
        *,
        send: Callable[[int, str], Awaitable[Any]],
        wake: Callable[[], None],
        settle: Callable[[], bool],
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self.nc, self.config, self.outbox = nc, config, outbox
        self._send, self._wake, self._settle = send, wake, settle
        self.max_in_flight = max_in_flight
        self.ack_timeout = config.request_timeout_s
        #: Every seq below this is acked (or released without an ack, see js_unacked_evicted).
        self.acked_below = 0
        self._acked_ahead: set[int] = set()  # acks that arrived before an older one's
        self._high = 0  # first seq never sent: lower ones are re-sends
        self._progress_t = time.monotonic()
        self._reply_prefix = ""
        self._ack_sub: Any = None
        self._watchdog: asyncio.Task | None = None
        self._stream_lost = False
        self._all_acked = asyncio.Event()
        self.counts = dict.fromkeys(("js_acks", "js_duplicates", "js_resent", "js_rewinds", "js_ack_errors",
                                     "js_unacked_evicted"), 0)  # fmt: skip

    async def start(self) -> None:
        await ensure_stream(self.nc, self.config)
        inbox = self.nc.new_inbox()
        self._reply_prefix = inbox + "."
        self._ack_sub = await self.nc.subscribe(inbox + ".*", cb=self._on_ack)
        self._watchdog = asyncio.create_task(self._watch(), name=f"kvbridge-js-acks-{self.config.worker_id}")

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)

    @property
    def stats(self) -> dict[str, int]:
        s = dict(self.counts)
        s["js_in_flight"] = max(0, self.outbox.cursor - self.acked_below)
        s["js_unacked"] = max(0, self.outbox.end - self.acked_below)
        return s

    # -- sending ----------------------------------------------------------------------------------

    async def send_pending(self) -> int:
        outbox = self.outbox
        self._release_evicted()
        sent = 0
        while self.nc.is_connected:
            seq = outbox.cursor
            if seq >= outbox.end or seq - self.acked_below >= self.max_in_flight:
                break
            if seq in self._acked_ahead:
                outbox.sent(seq)
                continue
            if self.acked_below == seq:  # the ack clock starts when the oldest is (re)sent
                self._progress_t = time.monotonic()
            if await self._send(seq, self._reply_prefix + str(seq)) is None:
                break  # stays unacked: the watchdog sends it again
            if seq < self._high:
                self.counts["js_resent"] += 1
            else:
                self._high = seq + 1
            sent += 1
        return sent

    def _release_evicted(self) -> None:
        """Unacked messages the ring evicted (or skipped past) can never be re-sent: let them go."""
        first = self.outbox.first
        if self.acked_below < first:
            self.counts["js_unacked_evicted"] += sum(
                1 for s in range(self.acked_below, min(first, self._high)) if s not in self._acked_ahead
            )
            self._acked_ahead = {s for s in self._acked_ahead if s >= first}
            self.acked_below = first
            self._progress_t = time.monotonic()

    def rewind(self) -> None:
        """Send everything unacked again, oldest first (the stream drops what it already has)."""
        self._release_evicted()
        if self.outbox.cursor > self.acked_below:
            self.counts["js_rewinds"] += 1
            self.outbox.rewind(self.acked_below)
        self._progress_t = time.monotonic()
        self._wake()

    def on_reconnected(self) -> None:
        self.rewind()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.ack_timeout / 4)
            if not self.nc.is_connected:
                continue
            if self._stream_lost:
                # Someone deleted the stream, or the broker came back without its store.
                try:
                    await ensure_stream(self.nc, self.config)
                    self._stream_lost = False
                except (JetStreamError, ConfigError) as exc:
                    log.warning("kvbridge: %s", exc)
                    continue
            if self.outbox.cursor > self.acked_below and time.monotonic() - self._progress_t > self.ack_timeout:
                self.rewind()

    # -- acks -------------------------------------------------------------------------------------

    async def _on_ack(self, msg: Any) -> None:
        try:
            seq = int(msg.subject[len(self._reply_prefix) :])
        except ValueError:
            return
        data = msg.data
        # A bare status (503: no stream for the subject) or an API error: not stored.
        if not data or b'"error"' in data:
            self.counts["js_ack_errors"] += 1
            lost = not data or b"10059" in data  # no stream listens on the subject / stream not found
            if lost and not self._stream_lost or self.counts["js_ack_errors"] == 1:
                log.warning("kvbridge: JetStream did not store seq %d: %s", seq, data[:200] or msg.headers)
            self._stream_lost = self._stream_lost or lost
            return  # stays unacked: the watchdog re-sends it (after re-creating the stream if lost)
        if b'"seq"' not in data:
            return  # not a stream ack: someone answered our reply subject (it rides on every message)
        if b'"duplicate"' in data and json.loads(data).get("duplicate"):
            self.counts["js_duplicates"] += 1
        if seq < self.acked_below:
            return
        self.counts["js_acks"] += 1
        if seq != self.acked_below:
            self._acked_ahead.add(seq)
            return
        below = seq + 1
        ahead = self._acked_ahead
        while below in ahead:
            ahead.discard(below)
            below += 1
        self.acked_below = below
        self._progress_t = time.monotonic()
        outbox = self.outbox
        if outbox.cursor < outbox.end:
            self._wake()  # the window has room again
        if below >= outbox.end:
            self._all_acked.set()

    async def wait_acked(self, timeout: float) -> bool:
        """Until every message handed over so far is acked; False if ``timeout`` came first."""
        deadline = time.monotonic() + timeout
        while True:
            settled = self._settle()
            self._release_evicted()
            if settled and self.acked_below >= self.outbox.end:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._all_acked.clear()
            self._wake()
            try:
                await asyncio.wait_for(self._all_acked.wait(), min(left, 0.05))
            except asyncio.TimeoutError:
                pass


# -- consumer side ------------------------------------------------------------------------------


async def subscribe_stream(
    nc: Any,
    config: Config,
    subject: str,
    cb: Callable[[Any], Awaitable[None]],
    start: int | datetime.datetime | None = None,
) -> Any:
    """An ordered, ephemeral push consumer on the stream, filtered to ``subject``, from ``start``."""
    cc = api.ConsumerConfig()
    if start is None:
        cc.deliver_policy = api.DeliverPolicy.ALL
    elif isinstance(start, datetime.datetime):
        if start.tzinfo is None:
            raise ValueError("stream_start: a datetime needs a timezone")
        cc.deliver_policy = api.DeliverPolicy.BY_START_TIME
        cc.opt_start_time = start
    elif isinstance(start, int) and not isinstance(start, bool) and start >= 1:
        cc.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
        cc.opt_start_seq = start
    else:
        raise ValueError(f"stream_start must be None, a stream sequence >= 1 or an aware datetime, got {start!r}")
    # The stream may not exist yet when a router starts before any worker.
    await ensure_stream(nc, config, update=False)
    js = nc.jetstream(timeout=config.request_timeout_s)
    try:
        sub = await js.subscribe(
            subject,
            cb=cb,
            stream=config.stream_name,
            config=cc,
            ordered_consumer=True,
            idle_heartbeat=_CONSUMER_HEARTBEAT_S,
            pending_msgs_limit=1 << 20,
            pending_bytes_limit=512 * 1024 * 1024,
        )
    except (APIError, NatsError, asyncio.TimeoutError) as exc:
        raise JetStreamError(
            f"cannot read JetStream stream {config.stream_name!r} for {subject}: {type(exc).__name__}: {exc}"
        ) from exc
    # nats-py re-creates an ordered consumer from this same config object, switched to "by start
    # sequence"; a start time left in it would make the server reject that (both set).
    cc.opt_start_time = None
    return sub
