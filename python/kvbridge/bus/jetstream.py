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

In a cluster
    ``stream_replicas`` (default 1) is the replica count a *new* stream gets; more than the
    cluster has JetStream servers, or more than 1 on a single server, is refused with a
    :class:`JetStreamError` saying so. An existing stream keeps its count (a mismatch is logged):
    workers configured differently never scale a shared stream up and down. Losing the node that
    leads the stream means a few seconds (4-9 s measured on one machine) in which the stream
    stores nothing and its API may not answer: publishers keep everything in the ring, log the
    outage (at most every 5 s) and re-send when the new leader answers; starting publishers and
    subscribers wait up to ``START_PATIENCE_S`` for JetStream to answer.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import json
import logging
import time
from typing import Any, Awaitable, Callable

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js import api
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from kvbridge.config import Config, ConfigError
from kvbridge.errors import Error
from kvbridge.bus.outbox import Outbox

__all__ = ["JetStreamAcks", "JetStreamError", "StreamReader", "ensure_stream", "stream_subjects", "subscribe_stream"]

log = logging.getLogger("kvbridge.jetstream")

#: Unacknowledged messages allowed on the wire per publisher.
MAX_IN_FLIGHT = 1024
# How long a publisher or subscriber starting keeps trying while JetStream does not answer (a
# cluster electing a leader takes a few seconds); a server without JetStream fails at once.
START_PATIENCE_S = 15.0
# A stream outage is logged at most this often while it lasts.
_OUTAGE_LOG_EVERY_S = 5.0
# Idle heartbeat of the subscriber's stream consumer; this many intervals without a message or a
# heartbeat and the consumer is re-created where it left off (how a reader survives the loss of
# the node its consumer lived on, or a broker restart).
_CONSUMER_HEARTBEAT_S = 1.0
_SILENT_HEARTBEATS = 1.5
# Pause between attempts to re-create a stream consumer while JetStream does not answer.
_RETRY_S = 0.5
# JetStream API error code: "stream name already in use" (another worker created it first).
_ERR_STREAM_NAME_IN_USE = 10058
# "JetStream system temporarily unavailable": a cluster without a meta leader for now.
_ERR_UNAVAILABLE = 10008
# Replica counts the server cannot place: 10074 "replicas > 1 not supported in non-clustered mode",
# 10005 "no suitable peers for placement", 10023 "insufficient resources", 10052 "replicas > 5".
_ERR_REPLICAS = (10074, 10005, 10023, 10052)


class JetStreamError(Error, RuntimeError):
    """JetStream is not available, or the stream cannot be created/updated as configured.
    ``transient``: JetStream did not answer in time (a leader election, an overload): try later."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def stream_subjects(config: Config) -> list[str]:
    return [f"{config.subject_prefix}.events.>"]


async def ensure_stream(nc: Any, config: Config, *, update: bool = True, patience: float = 0.0,
                        permissions: Any = None) -> api.StreamInfo:  # fmt: skip
    """Create the stream, or update it in place to cover our subject with our limits (``update``;
    subscribers only create a missing one: a reader should not change what writers keep).

    The creator sets ``stream_replicas``; an existing stream keeps its replica count whatever our
    config says (a mismatch is logged): publishers configured differently must not scale a shared
    stream up and down against each other. JetStream not answering for a while is what a cluster
    electing a leader looks like: tried again for up to ``patience`` seconds -- unless
    ``permissions`` (:class:`kvbridge.bus.connection.Permissions`) shows that the server refused the
    request itself, which also looks like no answer: then PermissionDeniedError names the subject."""
    if config.stream_duplicate_window_s > config.stream_max_age_s:
        raise ConfigError(
            "kvbridge config stream_duplicate_window_s (KVBRIDGE_STREAM_DUPLICATE_WINDOW_S): "
            f"{config.stream_duplicate_window_s}s is longer than stream_max_age_s ({config.stream_max_age_s}s)"
        )
    deadline = time.monotonic() + patience
    while True:
        try:
            return await _ensure_stream_once(nc, config, update)
        except JetStreamError as exc:
            if exc.transient and permissions is not None:
                name = config.stream_name
                permissions.raise_if_denied(
                    publish=[f"$JS.API.STREAM.{op}.{name}" for op in ("INFO", "CREATE", "UPDATE")]
                )
            if not exc.transient or time.monotonic() + config.request_timeout_s / 2 > deadline:
                raise
            log.info("kvbridge: %s; trying again", exc)
            await asyncio.sleep(min(0.5, config.request_timeout_s / 2))


async def _ensure_stream_once(nc: Any, config: Config, update: bool) -> api.StreamInfo:
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
                            num_replicas=config.stream_replicas,
                        )
                    )
                except APIError as exc:
                    if exc.err_code == _ERR_STREAM_NAME_IN_USE:
                        continue
                    if exc.err_code in _ERR_REPLICAS:
                        raise JetStreamError(
                            f"cannot create JetStream stream {config.stream_name!r} with stream_replicas="
                            f"{config.stream_replicas} (KVBRIDGE_STREAM_REPLICAS): the server refused "
                            f"({exc.description or exc}); a stream cannot have more replicas than the cluster "
                            f"has JetStream servers, and a single server (no cluster) takes 1 only"
                        ) from exc
                    raise
            current = info.config
            have = current.num_replicas or 1
            if have != config.stream_replicas:
                log.warning(
                    "kvbridge: JetStream stream %s exists with %d replica(s), this config says stream_replicas=%d: "
                    "keeping the stream's (whoever creates a stream sets its replicas; change it with the "
                    "nats CLI, not by starting workers configured otherwise)",
                    config.stream_name, have, config.stream_replicas,
                )  # fmt: skip
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
            # evolve() keeps everything else, num_replicas included.
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
        raise _api_failure(f"cannot create or update JetStream stream {config.stream_name!r} over {want}", exc,
                           config) from exc  # fmt: skip


def _api_failure(what: str, exc: BaseException, config: Config) -> JetStreamError:
    """A JetStream API call failed: say whether JetStream is absent or only unavailable for now."""
    if isinstance(exc, (ServiceUnavailableError, NoRespondersError)):
        # A server without -js answers the API with "no responders" at once.
        # nats-py's text for it is a row of Nones: say what it means.
        return JetStreamError(
            f"JetStream is not enabled on the NATS server at {', '.join(config.servers)} (nothing answers $JS.API, "
            f"so {what}): "
            f"start nats-server with -js, or unset KVBRIDGE_JETSTREAM"
        )
    timeout = config.request_timeout_s
    if isinstance(exc, asyncio.TimeoutError) or (isinstance(exc, APIError) and exc.err_code == _ERR_UNAVAILABLE):
        why = (f"JetStream did not answer within {timeout}s ({type(exc).__name__}: {exc}); a JetStream cluster "
               f"electing a leader (after a node loss: a few seconds) or an overloaded server")  # fmt: skip
        return JetStreamError(f"{what}: {why}", transient=True)
    return JetStreamError(f"{what}: {type(exc).__name__}: {exc}")


def _same(seconds: float | None, want: float) -> bool:
    return seconds is not None and abs(seconds - want) < 1e-3


class JetStreamAcks:
    """The JetStream half of a :class:`kvbridge.KvEventPublisher`: stream set-up, the ack window,
    re-sends. It drives the publisher's :class:`kvbridge.bus.outbox.Outbox` through its public
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
        permissions: Any = None,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self.nc, self.config, self.outbox = nc, config, outbox
        self._send, self._wake, self._settle = send, wake, settle
        self._permissions = permissions
        self.max_in_flight = max_in_flight
        self.ack_timeout = config.request_timeout_s
        #: Every seq below this is acked (or released without an ack, see js_unacked_evicted).
        self.acked_below = 0
        self._acked_ahead: set[int] = set()  # acks that arrived before an older one's
        self._progress_t = time.monotonic()
        self._reply_prefix = ""
        self._ack_sub: Any = None
        self._watchdog: asyncio.Task | None = None
        self._stream_lost = False
        self._outage_since: float | None = None  # when the stream stopped storing our messages
        self._outage_logged = 0.0
        self._all_acked = asyncio.Event()
        self.counts = dict.fromkeys(("js_acks", "js_duplicates", "js_resent", "js_rewinds", "js_ack_errors",
                                     "js_unacked_evicted", "js_outages"), 0)  # fmt: skip

    async def start(self) -> None:
        await ensure_stream(self.nc, self.config, patience=START_PATIENCE_S, permissions=self._permissions)
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
        # The stream has no leader (or is gone): new messages would only bounce, and land ahead of
        # the re-sends once it is back. They wait in the ring until the watchdog sees it again.
        while self.nc.is_connected and not self._stream_lost:
            seq = outbox.cursor
            if seq >= outbox.end or seq - self.acked_below >= self.max_in_flight:
                break
            if seq in self._acked_ahead:
                outbox.sent(seq)
                continue
            if self.acked_below == seq:  # the ack clock starts when the oldest is (re)sent
                self._progress_t = time.monotonic()
            resend = seq < outbox.never_sent
            if await self._send(seq, self._reply_prefix + str(seq)) is None:
                break  # stays unacked: the watchdog sends it again
            if resend:
                self.counts["js_resent"] += 1
            sent += 1
        return sent

    def _release_evicted(self) -> None:
        """Unacked messages the ring evicted (or skipped past) can never be re-sent: let them go."""
        first = self.outbox.first
        if self.acked_below < first:
            self.counts["js_unacked_evicted"] += sum(
                1 for s in range(self.acked_below, min(first, self.outbox.never_sent)) if s not in self._acked_ahead
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
                # No leader for the stream (an election), the stream deleted, or the broker came
                # back without its store: re-sending waits until the stream answers again.
                try:
                    info = await ensure_stream(self.nc, self.config)
                except (JetStreamError, ConfigError) as exc:
                    self._outage(str(exc))
                    continue
                if info.cluster is not None and not info.cluster.leader:
                    self._outage("the stream has no leader yet (an election)")
                    continue
                self._stream_lost = False
                self.rewind()
                continue
            if self.outbox.cursor > self.acked_below and time.monotonic() - self._progress_t > self.ack_timeout:
                self._outage(f"no acknowledgement for {self.ack_timeout}s")
                self.rewind()

    def _outage(self, why: str) -> None:
        """The stream is not storing our messages: an expected event in a cluster (a leader
        election after a node loss takes a few seconds). Say so, at most every few seconds; the
        ring keeps everything for the re-send."""
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since = now
            self.counts["js_outages"] += 1
        if now - self._outage_logged < _OUTAGE_LOG_EVERY_S:
            return
        self._outage_logged = now
        cfg = self.config
        log.warning(
            "kvbridge publisher %s/%s: JetStream stream %s is not storing our messages (for %.1fs so far: %s); "
            "%d message(s) kept for re-sending, publishing goes on",
            cfg.model, cfg.worker_id, cfg.stream_name, now - self._outage_since, why,
            max(0, self.outbox.end - self.acked_below),
        )  # fmt: skip

    def _outage_over(self) -> None:
        since, self._outage_since = self._outage_since, None
        if since is not None:
            self._outage_logged = 0.0
            cfg = self.config
            log.warning("kvbridge publisher %s/%s: JetStream stream %s stores again after %.1fs",
                        cfg.model, cfg.worker_id, cfg.stream_name, time.monotonic() - since)  # fmt: skip

    # -- acks -------------------------------------------------------------------------------------

    async def _on_ack(self, msg: Any) -> None:
        try:
            seq = int(msg.subject[len(self._reply_prefix) :])
        except ValueError:
            return
        data = msg.data
        # A bare status (503 no responders: the stream has no leader right now, or there is no
        # stream for the subject) or an API error: not stored.
        if not data or b'"error"' in data:
            self.counts["js_ack_errors"] += 1
            lost = not data or b"10059" in data  # no stream listens on the subject / stream not found
            if lost:
                self._outage("no responders for the stream subject: no stream leader (an election) or no stream")
            elif self.counts["js_ack_errors"] == 1:
                log.warning("kvbridge: JetStream did not store seq %d: %s", seq, data[:200] or msg.headers)
            self._stream_lost = self._stream_lost or lost
            return  # stays unacked: the watchdog re-sends it (after re-creating the stream if lost)
        if b'"seq"' not in data:
            return  # not a stream ack: someone answered our reply subject (it rides on every message)
        if b'"duplicate"' in data and json.loads(data).get("duplicate"):
            self.counts["js_duplicates"] += 1
        if self._outage_since is not None:
            self._outage_over()
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
            raise _api_failure(
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
                    if now - self._failures_logged >= _OUTAGE_LOG_EVERY_S:
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
