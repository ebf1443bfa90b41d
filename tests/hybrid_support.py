"""Hand-built hybrid event streams (several KV-cache groups, two media, copies, re-announces,
clears, bad events) and the plain model of what they leave, for the view tests on and off NATS."""

from __future__ import annotations

import copy
import random
from collections import Counter
from typing import Any

from kvbridge.engine.relay import RelayView
from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def stored(hashes: list, parent: Any = None, medium: str | None = "GPU", m: int = 1, **kw: Any) -> BlockStored:
    """A store of blocks of ``m * BS`` tokens (a group of larger blocks when m > 1)."""
    return BlockStored(list(hashes), parent, [0] * BS * m * len(hashes), BS * m, None, medium, None, **kw)


def removed(hashes: list, medium: str | None = "GPU", **kw: Any) -> BlockRemoved:
    return BlockRemoved(list(hashes), medium, **kw)


HYBRID = ("sliding_window", "sliding_window_mla", "mamba")
KINDS = {0: [None, "full_attention"], 1: [None, "sliding_window"], 2: [None, "mamba", "cross_attention"]}
MEDIA = ["GPU", "CPU"]


class Model:
    """The rule as the spec states it, event by event, without ops or fast paths."""

    def __init__(self) -> None:
        self.held: dict[tuple, Counter] = {}
        self.kinds: dict[int, tuple] = {}

    def apply_batch(self, batch: list[Any]) -> None:
        # A batch naming a window or mamba group makes the worker hybrid for all of it.
        windows = any(isinstance(ev, BlockStored) and ev.kv_cache_spec_kind in HYBRID for ev in batch)
        for ev in batch:
            self.apply(ev, windows)

    def apply(self, ev: Any, windows: bool = False) -> None:
        if isinstance(ev, AllBlocksCleared):
            self.held, self.kinds = {}, {}
            return
        g = 0 if ev.group_idx is None else ev.group_idx
        if type(g) is not int or not 0 <= g < 64:
            return
        held = self.held.setdefault((ev.medium, g), Counter())
        if isinstance(ev, BlockStored):
            kind, window = ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window
            if kind is not None and kind.startswith("sliding_window"):
                if type(window) is not int or window < 1:
                    return
            elif kind not in (None, "full_attention", "mamba", "cross_attention"):
                return
            if kind is not None:
                self.kinds[g] = (kind, window if kind.startswith("sliding_window") else None)
            # The re-announce exception: only in a worker with no window or mamba group.
            plain = not windows and not any(k in HYBRID for k, _ in self.kinds.values())
            if not (plain and ev.parent_block_hash is None and all(h in held for h in ev.block_hashes)):
                held.update(ev.block_hashes)
        else:
            for h in ev.block_hashes:
                if held[h] > 0:
                    held[h] -= 1
                held += Counter()  # drops the zeros

    def residency(self) -> dict:
        return {k: dict(v) for k, v in self.held.items() if v}


class Stream:
    """Random hybrid event batches over a fixed prefix tree (a hash always has one parent, as
    chained hashes do): 2-3 groups (some of blocks 2 or 4 times BS, a few of their stores of
    one BS block, as vLLM's partial-tail entries), 2 media, copies, re-announces, clears, bad
    events."""

    def __init__(self, rnd: random.Random, n_groups: int) -> None:
        self.rnd, self.n_groups = rnd, n_groups
        self.sizes = [1] + [rnd.choice([1, 2, 4]) for _ in range(n_groups - 1)]
        self.parent: dict[int, int | None] = {}
        for h in range(1, 41):
            self.parent[h] = None if h <= 4 or rnd.random() < 0.1 else rnd.randrange(1, h)
        self.model = Model()

    def _path(self, start: int) -> list[int]:
        path = [start]
        children = [h for h, p in self.parent.items() if p == path[-1]]
        while children and len(path) < 5 and self.rnd.random() < 0.8:
            path.append(self.rnd.choice(children))
            children = [h for h, p in self.parent.items() if p == path[-1]]
        return path

    def _attrs(self, g: int) -> dict:
        rnd = self.rnd
        kind = rnd.choice(KINDS[g])
        attrs: dict[str, Any] = {"group_idx": None if g == 0 and rnd.random() < 0.3 else g, "kv_cache_spec_kind": kind}
        if kind == "sliding_window":
            attrs["kv_cache_spec_sliding_window"] = rnd.choice([8, 16])
        return attrs

    def event(self) -> Any:
        rnd = self.rnd
        r = rnd.random()
        g, medium = rnd.randrange(self.n_groups), rnd.choice(MEDIA)
        held = self.model.held.get((medium, g), Counter())
        if r < 0.02:
            return AllBlocksCleared()
        if r < 0.07:
            return rnd.choice([
                stored([1], medium=medium, group_idx=rnd.choice([64, -1])),
                stored([2], medium=medium, kv_cache_spec_kind="no_such_kind"),
                stored([3], medium=medium, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=0),
                removed([1], medium=medium, group_idx=99),
            ])  # fmt: skip
        if r < 0.4 and held:
            gone = rnd.sample(sorted(+held), min(len(+held), rnd.randrange(1, 3)))
            if rnd.random() < 0.1:
                gone.append(1000)  # not held
            return removed(gone, medium=medium, group_idx=g)
        start = rnd.choice(list(self.parent))
        path = self._path(start)
        parent = self.parent[start]
        if parent is None and path[0] in held:
            # A parent-None store whose first block is held: vLLM's full-report re-announce of the
            # held prefix (a partly new one is the documented edge snapshots cannot carry).
            n = 0
            while n < len(path) and path[n] in held:
                n += 1
            path = path[:n]
        m = self.sizes[g] if rnd.random() < 0.9 else 1
        return stored(path, parent, medium=medium, m=m, **self._attrs(g))

    def batches(self, n: int) -> list[list[Any]]:
        out = []
        for _ in range(n):
            batch = []
            before = copy.deepcopy(self.model)
            for _ in range(self.rnd.randrange(1, 6)):
                batch.append(self.event())
                self.model.apply(batch[-1])  # the next event is drawn against what this one left
            self.model = before
            self.model.apply_batch(batch)  # and the batch as a whole is what the rule applies
            out.append(batch)
        return out




class HybridEngine:
    """A worker whose cache is a :class:`Stream`: each ``step()`` publishes a batch under the
    publisher's lock, and a :class:`RelayView` fed the same events serves its snapshots (the
    pool with hybrid groups is not this test's subject; the model is what views are held to)."""

    def __init__(self, publisher: Any, seed: int, n_groups: int = 3) -> None:
        self.publisher = publisher
        self.stream = Stream(random.Random(seed), n_groups)
        self.pool = RelayView()
        publisher.attach(self.pool)
        self.published = 0

    def step(self) -> None:
        with self.publisher.lock:
            (events,) = self.stream.batches(1)
            self.pool.apply(events)
            self.publisher.publish(events)
        self.published += 1

    def expected(self) -> tuple[dict, dict]:
        """(held, kinds) now, read under the lock as a snapshot would be."""
        with self.publisher.lock:
            return self.stream.model.residency(), dict(self.stream.model.kinds)
