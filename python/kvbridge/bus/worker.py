"""The subscriber's record of one worker (:class:`Worker`), and how long it may be silent before
it is dropped: not sooner than ``worker_timeout_s`` nor than three of its own advertised
heartbeat intervals (``Kv-Heartbeat``); never, if it advertises 0 or ``worker_timeout_s`` is 0.
No I/O: the subscriber's rooms read and change it.
"""

from __future__ import annotations

import asyncio
import time

from kvbridge.bus.sequencer import Sequencer
from kvbridge.bus.update import WorkerView
from kvbridge.wire.subjects import WorkerSubjects

__all__ = ["Worker"]

# A worker is never expired sooner than this many of its own heartbeat intervals.
_HEARTBEATS_BEFORE_EXPIRY = 3


class Worker:
    """A worker as the subscriber knows it: its sequencer (the (epoch, seq) rules), its view,
    its resync task and when it was last heard from."""

    __slots__ = (
        "model", "worker", "subjects", "seq", "syncing", "view", "last_heard", "followed_heard", "heartbeat_raw",
        "heartbeat_s", "conflict_warned", "speaking_since",
    )  # fmt: skip

    def __init__(self, prefix: str, model: str, worker: str, track_view: bool) -> None:
        self.model, self.worker = model, worker
        self.subjects = WorkerSubjects.build(prefix, model, worker)
        self.seq = Sequencer()
        self.syncing: asyncio.Task | None = None
        self.view = WorkerView() if track_view else None
        # When any incarnation, and the one followed (or since it was adopted), was last heard.
        self.last_heard = self.followed_heard = time.monotonic()
        self.heartbeat_raw: str | None = None
        self.heartbeat_s: float | None = None  # None: not advertised
        self.conflict_warned = False
        # Epoch given up -> when it was first heard sending a seq newer than any seen from it.
        self.speaking_since: dict[str, float] = {}

    @property
    def epoch(self) -> str | None:
        return self.seq.epoch

    def heard(self, epoch: str, heartbeat_raw: str | None) -> None:
        self.last_heard = now = time.monotonic()
        if epoch == self.seq.epoch:
            self.followed_heard = now
        if heartbeat_raw != self.heartbeat_raw:
            self.heartbeat_raw = heartbeat_raw
            try:
                hb = float(heartbeat_raw) if heartbeat_raw is not None else None
            except ValueError:
                hb = None
            self.heartbeat_s = hb if hb is None or hb >= 0 else None

    def timeout(self, worker_timeout_s: float) -> float | None:
        """Seconds of silence after which this worker is gone; None: never by time."""
        if worker_timeout_s <= 0 or self.heartbeat_s == 0:
            return None
        if self.heartbeat_s is None:
            return worker_timeout_s
        return max(worker_timeout_s, _HEARTBEATS_BEFORE_EXPIRY * self.heartbeat_s)

