"""Which workers, and which incarnation of each, are alive.

The expiry of workers silent past their timeout (:mod:`kvbridge.bus.worker`), only once the
subscriber's own link has answered a PING, and a full timeout for everyone after a reconnect;
of two incarnations on one subject, which one is dead and which is a second live publisher. The
rules are stated in :mod:`kvbridge.bus.subscriber`'s module doc; this room applies them.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvbridge.bus.delivery import Delivery
from kvbridge.bus.sequencer import MAX_RETIRED
from kvbridge.bus.update import Update
from kvbridge.bus.worker import Worker
from kvbridge.wire.events import KVEventBatch

__all__ = ["Liveness"]

log = logging.getLogger("kvbridge.subscriber")

# An epoch given up that sends new seqs is a second live publisher only if it keeps at it for
# longer than this (or the worker's heartbeat interval, if longer): what a dead incarnation had
# in flight when its successor was adopted arrives within a route's delay, not a heartbeat's.
_CONFLICT_AFTER_S = 1.0


class Liveness(Delivery):
    """Expiry of silent workers, and which of a worker's incarnations speaks."""

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

    def _due(self, timeout: float) -> list[tuple[tuple[str, str], Worker]]:
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

    async def _expire(self, key: tuple[str, str], w: Worker) -> None:
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

    def _outlived(self, w: Worker) -> bool:
        """Whether the incarnation ``w`` follows has been silent past the worker's timeout while
        another (given up) has just spoken: then the followed one is the dead one."""
        limit = w.timeout(self.config.worker_timeout_s)
        return limit is not None and w.last_heard - w.followed_heard > limit

    @staticmethod
    def _still_speaking(w: Worker, epoch: str) -> bool:
        """Whether ``epoch`` (given up) has been sending new seqs for longer than a late message
        of a dead incarnation can take to arrive (``_CONFLICT_AFTER_S``)."""
        now = time.monotonic()
        since = w.speaking_since.setdefault(epoch, now)
        if len(w.speaking_since) > MAX_RETIRED:  # forged epochs: keep the newest
            del w.speaking_since[next(iter(w.speaking_since))]
        return now - since > max(_CONFLICT_AFTER_S, w.heartbeat_s or 0.0)

    def _epoch_conflict(self, w: Worker, other: str) -> None:
        self._counts["epoch_conflicts"] += 1
        if not w.conflict_warned:
            w.conflict_warned = True
            log.warning(
                "kvbridge subscriber: two live publishers on %s (epochs %s and %s): two engines share the worker "
                "id %r; only one of them is tracked. Give each engine its own worker_id.",
                w.subjects.events, w.epoch, other, w.worker,
            )  # fmt: skip
