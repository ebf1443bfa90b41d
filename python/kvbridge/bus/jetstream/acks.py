"""JetStream mode's publishing side: the ack window over the publisher's outbox, and re-sends.

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
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable

from kvbridge.config import Config, ConfigError
from kvbridge.bus.jetstream.admin import OUTAGE_LOG_EVERY_S, START_PATIENCE_S, JetStreamError, ensure_stream
from kvbridge.bus.outbox import Outbox

__all__ = ["MAX_IN_FLIGHT", "JetStreamAcks"]

log = logging.getLogger("kvbridge.jetstream")

#: Unacknowledged messages allowed on the wire per publisher.
MAX_IN_FLIGHT = 1024


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
        if now - self._outage_logged < OUTAGE_LOG_EVERY_S:
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
