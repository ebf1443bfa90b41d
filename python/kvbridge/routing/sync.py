"""Router replicas that share what they routed: ``RouteSync`` over ``<prefix>.route.<model>``.

N routers of one model in front of one fleet each see only their own decisions. Each shares every
decision (worker, the prompt's block keys, when) and its end on the model's route subject and
applies its peers', so the replicas hold the same provisional residency and count the same
requests in flight: a burst split across them still lands where the first request went.

A message is one msgpack array ``[op, replica, id, worker, ts, keys]``: ``op`` "route" or "done",
``keys`` the block keys as little-endian u64s in one byte string (8 bytes a block). A replica that
starts late or reconnects has nothing to catch up on: provisional entries live one TTL, so it
agrees with its peers one TTL after it hears them. Malformed messages are counted and ignored.

    async with RouteSync(router, servers=[...], model="llama-3-8b"):
        worker, overlap = router.choose(prompt_ids)
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
from collections import deque
from typing import Any

import msgspec

from kvbridge.config import Config
from kvbridge.bus.connection import connect
from kvbridge.routing.router import Decision, Router
from kvbridge.wire.subjects import route_subject

__all__ = ["RouteSync"]

log = logging.getLogger("kvbridge.sync")

_OPS = ("route", "done")


class _Wire(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    op: str
    replica: str
    id: int
    worker: str
    ts: float
    keys: bytes


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Wire)


def encode_decision(d: Decision) -> bytes:
    return _encoder.encode(_Wire(d.op, d.replica, d.id, d.worker, d.ts, struct.pack(f"<{len(d.keys)}Q", *d.keys)))


def decode_decision(payload: bytes) -> Decision:
    """ValueError naming what is wrong with a message that is not a decision."""
    try:
        w = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a routing decision: {exc}") from None
    if w.op not in _OPS:
        raise ValueError(f"op must be 'route' or 'done', got {w.op!r}")
    if len(w.keys) % 8:
        raise ValueError(f"keys are 8 bytes each, got {len(w.keys)} bytes")
    if not w.worker or not w.replica:
        raise ValueError("worker and replica must be non-empty")
    keys = list(struct.unpack(f"<{len(w.keys) // 8}Q", w.keys))
    return Decision(w.op, w.replica, w.id, w.worker, w.ts, keys)  # type: ignore[arg-type]


class RouteSync:
    """Publishes ``router``'s decisions on the model's route subject and applies its peers'.

    ``router.choose`` may run on any thread: decisions are handed to this object's loop and
    published in order by one task, never waited on by the caller. ``stats``: published,
    applied (peers' messages), own (this router's, heard back and skipped), malformed.
    """

    def __init__(self, router: Router, config: Config | None = None, *, model: str | None = None, **options: Any) -> None:
        if not isinstance(router, Router):
            raise TypeError(f"router must be a kvbridge.Router, got {type(router).__name__}")
        if model is not None:
            options["model"] = model
        config = Config.resolve(config, **options)
        self.router = router
        self.config = config
        self.subject = route_subject(config.subject_prefix, config.model)
        self.stats = {"published": 0, "applied": 0, "own": 0, "malformed": 0}
        self._nc: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._outbox: deque[Decision] = deque()
        self._wake = asyncio.Event()
        self._sender: asyncio.Task | None = None
        self._closing = False

    async def start(self) -> RouteSync:
        if self._closing:
            raise RuntimeError("a closed RouteSync cannot be started again: make a new one")
        if self._nc is not None:
            return self
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        nc = await connect(self.config)
        try:
            await nc.subscribe(self.subject, cb=self._on_msg)
            await nc.flush()  # subscribed at the server before start() returns: no decision missed after it
        except BaseException:  # nothing kept: a second start() tries again
            await nc.close()
            raise
        self._nc = nc
        self._sender = asyncio.create_task(self._send_loop(), name="kvbridge-route-sync")
        self.router.listeners.append(self._on_decision)
        return self

    async def close(self) -> None:
        if self._nc is None:
            return
        if self._on_decision in self.router.listeners:
            self.router.listeners.remove(self._on_decision)
        self._closing = True
        self._wake.set()
        if self._sender is not None:
            await self._sender  # sends what was decided before close()
        nc, self._nc = self._nc, None
        try:
            await nc.drain()
        except Exception as exc:  # the broker down: nothing left to drain to; let the connection go
            log.warning("kvbridge: RouteSync could not drain its connection (%r): closing it", exc)
            try:
                await nc.close()
            except Exception:
                pass

    async def __aenter__(self) -> RouteSync:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _on_decision(self, decision: Decision) -> None:
        self._outbox.append(decision)  # deque.append is atomic: safe from any thread
        loop = self._loop
        if loop is None:
            return
        if threading.get_ident() == self._thread:
            self._wake.set()
        else:
            loop.call_soon_threadsafe(self._wake.set)

    async def _send_loop(self) -> None:
        outbox = self._outbox
        while True:
            await self._wake.wait()
            self._wake.clear()
            while outbox:
                decision = outbox.popleft()
                try:
                    await self._nc.publish(self.subject, encode_decision(decision))
                    self.stats["published"] += 1
                except Exception as exc:  # disconnected beyond the reconnect buffer: peers get the next one
                    log.debug("kvbridge route sync: publish failed: %r", exc)
            if self._closing:
                return

    async def _on_msg(self, msg: Any) -> None:
        try:
            decision = decode_decision(msg.data)
        except ValueError as exc:
            self.stats["malformed"] += 1
            if self.stats["malformed"] == 1 or self.stats["malformed"] % 1000 == 0:
                log.warning("kvbridge route sync on %s: %s (%d malformed so far)", self.subject, exc,
                            self.stats["malformed"])  # fmt: skip
            return
        if decision.replica == self.router.replica:
            self.stats["own"] += 1
            return
        self.stats["applied"] += 1
        self.router.apply_peer(decision)
