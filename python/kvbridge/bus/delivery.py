"""The subscriber's last step for every update, and the state its rooms share.

An update that the ordering rules let through (:mod:`kvbridge.bus.subscriber`'s live messages,
:mod:`kvbridge.bus.resync`'s replays and snapshots) is applied here, in this order: to the index
(a reset first removes the worker), to the worker's view, to the counts (``_deliver``); then
handed to ``on_update`` and to the async iterator's bounded queue (``_notify``), which never
waits for the iterator: one that falls ``queue_size`` updates behind is marked behind, and
catches up from every worker's current state (the subscriber's ``_catch_up``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from typing import Any, Awaitable, Callable, Iterator

from kvbridge.metrics import tally
from kvbridge.config import Config
from kvbridge.bus.connection import Permissions
from kvbridge.bus.loads import LoadReports
from kvbridge.bus.update import Body, Update
from kvbridge.bus.worker import Worker
from kvbridge.wire.events import KVEventBatch

__all__ = ["Delivery"]

log = logging.getLogger("kvbridge.subscriber")


class Delivery:
    """Updates applied and handed on; the workers, the connection and the counts."""

    def __init__(
        self,
        config: Config,
        subject: str,
        *,
        on_update: Callable[[Update], Awaitable[None] | None] | None,
        track_views: bool | None,
        queue_size: int,
        index: Any,
    ) -> None:
        if on_update is not None and not callable(on_update):
            raise TypeError(f"on_update must be a callable (update) -> None or an awaitable, got {type(on_update).__name__}")
        if index is not None and not all(callable(getattr(index, m, None)) for m in ("apply", "remove_worker")):
            raise TypeError(f"index must be a kvbridge.Index (or have apply() and remove_worker()), got "
                            f"{type(index).__name__}")  # fmt: skip
        self.config = config
        self.prefix = config.subject_prefix
        self.subject = subject
        self._on_update = on_update
        self.index = index
        self.track_views = index is None if track_views is None else track_views
        # Scanning builds Python hash lists for views; an index reads the bytes itself.
        self._raw_bodies = index is not None and not self.track_views
        if not isinstance(queue_size, int) or isinstance(queue_size, bool) or queue_size < 1:
            raise ValueError(f"queue_size must be an integer >= 1, got {queue_size!r}")
        self._queue_size = queue_size
        # The async iterator's side: a bounded queue that deliveries never wait on (module doc).
        self._iter_queue: deque[Update] | None = None
        self._iter_wake = asyncio.Event()
        self._iter_behind = False
        self._iter_known: set[tuple[str, str]] = set()
        self._workers: dict[tuple[str, str], Worker] = {}
        self._loads = LoadReports()  # each worker's latest, forgotten with the worker
        self._nc: Any = None
        self._closed = False
        self._permissions = Permissions(f"subscriber {self.subject}")
        self._counts = dict.fromkeys(
            ("messages", "events", "bytes", "duplicates", "gaps", "replays", "replays_gone", "snapshots",
             "epoch_changes", "epoch_conflicts", "malformed", "request_timeouts", "request_errors", "callback_errors",
             "expired", "iterator_behind"),
            0,
        )  # fmt: skip

    def _parked(self, w: Worker) -> Iterator[Update]:
        """Delivers the parked messages that are next in order."""
        ready, stale = w.seq.ready()
        self._counts["duplicates"] += stale
        for seq, batch in ready:
            yield self._deliver(w, seq, batch, "live")

    async def _drain_parked(self, w: Worker) -> None:
        for update in self._parked(w):
            await self._notify(update)

    def _deliver(self, w: Worker, seq: int, batch: Body | KVEventBatch, source: str, reset: bool = False) -> Update:
        """Applies one update to the index, the worker's view and the counts; handing it on to
        ``on_update`` and the iterator is ``_notify``'s."""
        update = Update(w.model, w.worker, w.epoch or "", seq, batch, reset, source)
        if reset:  # a resync's outcome: the epoch it adopted answered just now
            w.followed_heard = time.monotonic()
        n_events = update.n_events if self.index is None else self._index_apply(w, update)
        if w.view is not None:
            w.view.apply(update)
        else:
            update._body.read = None  # what only a view reads
        self._counts["events"] += n_events
        return update

    async def _notify(self, update: Update) -> None:
        if self._on_update is not None:
            try:
                result = self._on_update(update)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                self._counts["callback_errors"] += 1
                log.exception("kvbridge on_update callback failed")
        if self._iter_queue is not None:
            self._enqueue(update)

    def _enqueue(self, update: Update) -> None:
        """Hand ``update`` to the iterator without ever waiting for it."""
        queue = self._iter_queue
        if queue is None or self._iter_behind:
            return  # behind: the catch-up will carry this update's effect
        if len(queue) >= self._queue_size:
            queue.clear()
            self._iter_behind = True
            if (n := tally(self._counts, "iterator_behind")) is not None:
                log.warning("kvbridge subscriber: the async iterator fell %d updates behind; it continues from "
                            "a reset per worker carrying the current view (%d time(s) so far)", self._queue_size, n)  # fmt: skip
        else:
            queue.append(update)
            self._iter_known.add((update.model, update.worker))
        self._iter_wake.set()

    def _index_apply(self, w: Worker, update: Update) -> int:
        """Feeds one update to the index; returns its number of events (0 if unreadable)."""
        body = update._body
        if update.reset:
            self._index_forget(w)
        if body.payload is not None:
            return self.index.apply(w.worker, body.payload, body.fmt)
        return self.index.apply(w.worker, body.batch)

    def _index_forget(self, w: Worker) -> None:
        """Drops everything the index holds for ``w`` (a reset, or a worker gone)."""
        if self.index is not None:
            self.index.remove_worker(w.worker)
