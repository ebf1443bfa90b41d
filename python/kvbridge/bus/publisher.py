"""The engine side: batches in, an ordered, replayable stream of NATS messages out.

:class:`KvEventPublisher` is one object built in rooms, one concern each, from the engine thread
to the wire:

* :mod:`kvbridge.bus.handoff` -- ``publish()`` and the other hand-offs from any thread, the pool
  lock, and the threading contract every engine attachment relies on;
* :mod:`kvbridge.bus.coalescer` -- on the loop, hand-offs coalesced and framed into numbered
  messages in the ring, fitted to the server's ``max_payload``;
* :mod:`kvbridge.bus.sender` -- the write path and the sender task's schedule, heartbeats, a
  reconnect;
* :mod:`kvbridge.bus.answers` -- replay requests answered from the ring, snapshot requests from
  the attached pool;
* here -- connecting and closing, the stats, and :class:`BackgroundPublisher` for engines that
  are not asyncio programs.

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
import threading
import time
from typing import Any

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from kvbridge.metrics import register, start_exporter
from kvbridge.config import Config
from kvbridge.bus.answers import Answers
from kvbridge.bus.connection import Permissions, WorkerIdInUseError, connect
from kvbridge.bus.sender import Sender
from kvbridge.wire.subjects import HDR_EPOCH

__all__ = ["BackgroundPublisher", "KvEventPublisher"]

# At start, how long another publisher serving our worker id has to answer the probe.
_PROBE_TIMEOUT_S = 0.5


class KvEventPublisher(Sender, Answers):
    """Publishes one worker's KV events to ``<prefix>.events.<model>.<worker>``.

    ``await start()`` connects (failing fast with :class:`kvbridge.ConnectError`,
    :class:`kvbridge.AuthenticationError`, :class:`kvbridge.PermissionDeniedError`,
    :class:`kvbridge.WorkerIdInUseError` or, with JetStream, :class:`kvbridge.JetStreamError`),
    ``publish()`` hands events over from any thread,
    ``await close()`` sends what is left and disconnects. Also an async context manager.
    """

    def __init__(self, config: Config | None = None, **options: Any) -> None:
        config = Config.resolve(config, **options)
        super().__init__(config)
        self.metric_labels = {"model": config.model, "worker": config.worker_id}
        self._sender: asyncio.Task | None = None
        self._permissions = Permissions(f"publisher {config.model}/{config.worker_id}")
        register("publisher", self)

    async def start(self) -> KvEventPublisher:
        if self._closing:  # its epoch's stream has ended: a new one is a new publisher
            raise RuntimeError("a closed KvEventPublisher cannot be started again: make a new one")
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
            if self.config.metrics_port is not None:
                start_exporter(self.config.metrics_port, self.config.metrics_addr)
        except BaseException:
            if self._js is not None:
                await self._js.stop()
            await self._nc.close()
            self._nc = self._js = None
            raise
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
        """Send everything handed over so far, then disconnect. Best effort: the sending (with
        JetStream, the stream's acks first) waits up to ``timeout``, the server's confirmation of
        the flush up to ``max(timeout, 1)`` more."""
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

