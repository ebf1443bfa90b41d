"""The publisher's loop side, second step: the numbered messages go out, in seq order.

The write path: what can go at once goes in few writes (``_send_now``: up to ``_SEND_BATCH``
messages a write, straight to the socket); the rest, and everything while the connection is
being replaced, one message at a time through nats-py (``_send``). A message NATS refuses stays
unsent in the ring and goes after the reconnect. JetStream mode hands the same ring to
:mod:`kvbridge.bus.jetstream.acks`, which sends with ``_send`` and re-sends what the stream has
not acknowledged.

The schedule: the sender task polls the hand-off queue while hand-offs keep coming, and sleeps
until the next ``publish()`` wakes it (the :class:`~kvbridge.bus.handoff.Waker`'s eventfd; a
single hand-off then goes out from the wake-up's callback itself) once they stop. An idle
publisher sends an empty batch every ``heartbeat_s``, and one right after a reconnect, so that a
lost tail shows consumers a hole.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from nats.errors import Error as NatsError

from kvbridge.config import Config
from kvbridge.bus.coalescer import Coalescer
from kvbridge.bus.handoff import Waker

__all__ = ["Sender"]

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
# Messages a direct write takes at most (``_send_now``): a relay forwarding a burst of engine
# steps hands the sender several at once, and one write each cost it more kernel time than the
# messages' own bytes; a bound keeps the parts within IOV_MAX and the copy of what the socket
# does not take at once small.
_SEND_BATCH = 64
# ... and at most about this many payload bytes (a message more only to hold one): a full-speed
# engine's messages are up to max_batch_bytes each, and what the socket leaves of a write is
# copied into the transport's buffer.
_SEND_BATCH_BYTES = 256 << 10


class Sender(Coalescer):
    """The sender task and the write path it and JetStream's acks share."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._js: Any = None  # kvbridge.bus.jetstream.acks.JetStreamAcks in JetStream mode
        self._closing = False
        self._beat_due = False  # the heartbeat's timer found heartbeat_s without an emit
        self._parked = False  # the sender is asleep until woken (on_wake may send for it)
        self._idle_ticks = 0
        self._counts.update(dict.fromkeys(
            ("messages", "events", "bytes", "publish_errors", "reconnects", "heartbeats"), 0
        ))  # fmt: skip

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
                    waker.ticking(0)
                    loop.remove_reader(waker.tick_fd)

    def _install_waker(self, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> Waker | None:
        if not hasattr(os, "eventfd"):
            return None  # not Linux: publish() falls back to call_soon_threadsafe
        waker = Waker()

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
        ticker: Waker | None,
    ) -> None:
        # linger 0 (the default) adapts by itself. Busy (hand-offs piled up in the last 0.5 ms): poll the
        # queue every 250 us; what arrives while the loop encodes and sends is coalesced into the
        # next messages. Idle: sleep until publish() wakes it, then send at once.
        last_busy = loop.time()
        ticking = False
        closing_passes = 0
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
                # close() promises what was handed over before it: one more pass takes all of that
                # (close may have come while this one sent). Not more: an engine that keeps
                # publishing would keep the sender, and close(timeout) with it, from ever ending.
                if self._queue and closing_passes == 0:
                    closing_passes = 1
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
                        ticker.ticking(_POLL_NS)
                        ticking = True
                    await wake.wait()
                    continue
            if ticking:
                ticker.ticking(0)  # type: ignore[union-attr]
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

    async def _on_reconnected(self) -> None:
        self._counts["reconnects"] += 1
        self._learn_max_payload()
        # Messages the dead broker swallowed leave a hole only a later message reveals.
        self._drain()
        self._emit(time.time(), [])
        if self._js is not None:
            self._js.on_reconnected()
        self._wake.set()  # type: ignore[union-attr]
