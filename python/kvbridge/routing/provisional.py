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
from typing import Callable, Iterable, Sequence

__all__ = ["ProvisionalResidency"]


class ProvisionalResidency:
    """Per block key, the workers expected to hold it and until when.

    Bounded: at most ``max_entries`` (key, worker) entries; past that the oldest are dropped and
    counted (``stats["dropped"]``). Not thread-safe: the router calls it under its lock.
    """

    def __init__(self, ttl_s: float = 2.0, *, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s >= 0:
            raise ValueError(f"provisional_ttl_s must be a number of seconds >= 0, got {ttl_s!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_provisional must be an int >= 1, got {max_entries!r}")
        self.ttl_s = float(ttl_s)
        self.max_entries = max_entries
        self.clock = clock
        self._by_key: dict[int, dict[str, float]] = {}
        # (expiry, key, worker) in the order added; the TTL is one for all, so also expiry order.
        # An entry renewed or removed since leaves a stale item here, skipped when it comes up.
        self._order: deque[tuple[float, int, str]] = deque()
        self._entries = 0
        self.stats = {"added": 0, "confirmed": 0, "expired": 0, "dropped": 0, "reset": 0}

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def __len__(self) -> int:
        """(key, worker) entries alive (expired ones included until the next call prunes them)."""
        return self._entries

    def add(self, worker: str, keys: Iterable[int], *, ttl_s: float | None = None) -> None:
        """``worker`` is about to hold blocks ``keys`` (a prompt's chain, first block first).
        ``ttl_s``: the time left of a peer's decision (default the full TTL)."""
        if not self.enabled:
            return
        now = self.clock()
        expiry = now + (self.ttl_s if ttl_s is None else min(ttl_s, self.ttl_s))
        if expiry <= now:
            return
        self._prune(now)
        by_key, order = self._by_key, self._order
        for k in keys:
            holders = by_key.get(k)
            if holders is None:
                holders = by_key[k] = {}
            if worker not in holders:
                self._entries += 1
                self.stats["added"] += 1
            holders[worker] = expiry
            order.append((expiry, k, worker))
        while self._entries > self.max_entries:
            self._pop_oldest("dropped")
        if len(order) > 4 * max(self._entries, 1024):
            # Renewals leave stale items behind until their expiry: keep the queue near the entries.
            self._order = deque(item for item in order if self._by_key.get(item[1], {}).get(item[2]) == item[0])

    def scores(self, keys: Sequence[int]) -> dict[str, int]:
        """Per worker, how many leading blocks of ``keys`` it is expected to hold."""
        if not self._entries:
            return {}
        self._prune(self.clock())
        by_key = self._by_key
        first = by_key.get(keys[0]) if keys else None
        if not first:
            return {}
        out = dict.fromkeys(first, 1)
        alive = set(first)
        for i in range(1, len(keys)):
            holders = by_key.get(keys[i])
            alive = alive.intersection(holders) if holders else set()
            if not alive:
                break
            for w in alive:
                out[w] = i + 1
        return out

    def confirm(self, worker: str, keys: Sequence[int]) -> None:
        """The worker's own events now show it holding ``keys``: its provisional entries for
        them are done."""
        if self._remove(worker, keys):
            self.stats["confirmed"] += 1

    def reset(self, worker: str) -> None:
        """The worker's cache was reset, cleared or it is gone: nothing it was sent stays."""
        dropped = 0
        for k in [k for k, holders in self._by_key.items() if worker in holders]:
            dropped += self._remove(worker, (k,))
        if dropped:
            self.stats["reset"] += 1

    def clear(self) -> None:
        self._by_key.clear()
        self._order.clear()
        self._entries = 0

    def _remove(self, worker: str, keys: Iterable[int]) -> int:
        removed = 0
        for k in keys:
            holders = self._by_key.get(k)
            if holders is not None and holders.pop(worker, None) is not None:
                removed += 1
                if not holders:
                    del self._by_key[k]
        self._entries -= removed
        return removed

    def _prune(self, now: float) -> None:
        order = self._order
        while order and order[0][0] <= now:
            self._pop_oldest("expired")

    def _pop_oldest(self, why: str) -> None:
        expiry, k, worker = self._order.popleft()
        holders = self._by_key.get(k)
        if holders is None or holders.get(worker) != expiry:
            return  # renewed or removed since: a stale item
        del holders[worker]
        if not holders:
            del self._by_key[k]
        self._entries -= 1
        self.stats[why] += 1
