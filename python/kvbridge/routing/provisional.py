"""Provisional residency: what a router has just sent a worker, before the worker says it holds it.

A ``BlockStored`` reaches the index only after the chosen worker has run the prefill. Until then
the router is blind to its own decision, and a burst of requests sharing a new prefix scatters
(or herds onto one worker by a stale load). So when a router chooses a worker for a request, it
records that worker as about to hold the request's full blocks, for ``ttl_s`` seconds or until the
worker's own events confirm them (the index then scores at least as many blocks) or its state is
reset. Scores are ``max(index, provisional)`` per worker. The same idea as llm-d's speculative index
entries (2 s TTL) and Dynamo's predicted active blocks.

Keys are the router's own chained hashes of the prompt's blocks (``hash_blocks(..., algo="xxh3")``
with the LoRA name and extra keys: what a token-keyed ``Index`` uses), so router replicas that
share decisions agree on them whatever hash the engines use.
"""

from __future__ import annotations

import time
from collections import deque
from itertools import repeat
from typing import Callable, Sequence

__all__ = ["ProvisionalResidency"]


def _leading(held: dict[int, float], keys: Sequence[int]) -> int:
    """How many leading ``keys`` ``held`` has, by binary search: keys are chained hashes, so a
    held key's whole prefix is held (every decision adds a chain from its first block, and
    expiry, the cap and confirmation only ever take a chain's tail or a prefix of all chains
    through it). Callers check ``keys[0]`` first."""
    lo, hi = 1, len(keys)  # keys[:lo] held; keys[hi:] not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if keys[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ProvisionalResidency:
    """Per worker, the block keys it is expected to hold and until when.

    Bounded: at most ``max_entries`` (key, worker) entries; past that the oldest decisions are
    dropped and counted (``stats["dropped"]``, in entries). Not thread-safe: the router calls it
    under its lock. Work per decision is a few C-level dict operations over its keys, not a
    Python loop per block: a 128-block prompt costs microseconds.
    """

    def __init__(self, ttl_s: float = 2.0, *, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s >= 0:
            raise ValueError(f"provisional_ttl_s must be a number of seconds >= 0, got {ttl_s!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_provisional must be an int >= 1, got {max_entries!r}")
        self.ttl_s = float(ttl_s)
        self.max_entries = max_entries
        self.clock = clock
        # worker -> {key: expiry}; a key seen in several decisions keeps the latest expiry.
        self._held: dict[str, dict[int, float]] = {}
        # (expiry, worker, keys) per decision, in the order made: one TTL for all, so expiry order.
        self._decisions: deque[tuple[float, str, Sequence[int]]] = deque()
        self._entries = 0
        self.stats = {"added": 0, "confirmed": 0, "expired": 0, "dropped": 0, "reset": 0}

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def __len__(self) -> int:
        """(key, worker) entries held."""
        return self._entries

    def add(self, worker: str, keys: Sequence[int], *, ttl_s: float | None = None) -> None:
        """``worker`` is about to hold blocks ``keys`` (a prompt's chain, first block first).
        ``ttl_s``: the time left of a peer's decision (default the full TTL)."""
        if not self.enabled or not keys:
            return
        now = self.clock()
        expiry = now + (self.ttl_s if ttl_s is None else min(ttl_s, self.ttl_s))
        if expiry <= now:
            return
        self._prune(now)
        held = self._held.get(worker)
        if held is None:
            held = self._held[worker] = {}
        before = len(held)
        held.update(dict.fromkeys(keys, expiry))
        self._entries += len(held) - before
        self.stats["added"] += len(held) - before
        self._decisions.append((expiry, worker, keys))
        while self._entries > self.max_entries and self._decisions:
            self.stats["dropped"] += self._forget(*self._decisions.popleft())

    def scores(self, keys: Sequence[int]) -> dict[str, int]:
        """Per worker, how many leading blocks of ``keys`` it is expected to hold."""
        if not self._entries or not keys:
            return {}
        self._prune(self.clock())
        first = keys[0]
        out = {}
        for worker, held in self._held.items():
            if first in held:
                out[worker] = _leading(held, keys)
        return out

    def confirm(self, worker: str, keys: Sequence[int]) -> None:
        """The worker's own events now show it holding ``keys``: its provisional entries for
        them are done (a later eviction within the TTL is then not covered up)."""
        held = self._held.get(worker)
        if held is None:
            return
        before = len(held)
        # Every provisional chain of the worker through these keys ends with them: its leading
        # keys are gone. (map over dict.pop runs the loop in C.)
        deque(map(held.pop, keys, repeat(None)), maxlen=0)
        if len(held) < before:
            self._entries -= before - len(held)
            self.stats["confirmed"] += 1

    def reset(self, worker: str) -> None:
        """The worker's cache was reset, cleared or it is gone: nothing it was sent stays."""
        held = self._held.pop(worker, None)
        if held:
            self._entries -= len(held)
            self.stats["reset"] += 1

    def _prune(self, now: float) -> None:
        decisions = self._decisions
        while decisions and decisions[0][0] <= now:
            self.stats["expired"] += self._forget(*decisions.popleft())

    def _forget(self, expiry: float, worker: str, keys: Sequence[int]) -> int:
        """Drops a decision's entries that no later decision renewed; how many."""
        held = self._held.get(worker)
        if not held:
            return 0
        before = len(held)
        deque(map(held.pop, [k for k in keys if held.get(k) == expiry]), maxlen=0)
        if not held:
            del self._held[worker]
        self._entries -= before - len(held)
        return before - len(held)
