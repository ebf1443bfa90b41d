"""The hybrid pool's own streams against every view: random multi-turn workloads on
``KVCacheManager(groups=...)`` pools small enough to evict (so sliding-window groups drop blocks
early and recomputed chains leave physical copies), their events applied to an ``Index`` in both
key modes and to a ``Residency``; after every step the index scores each probe exactly as the
pool's own coordinator hit (``hit_blocks``: vLLM's ``HybridKVCacheCoordinator.
find_longest_cache_hit``), and the view equals the pool's snapshot, copies included. Then the
snapshot alone rebuilds the same index answers (what a late router or a resync gets)."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from kvbridge import Index, KVCacheManager, KVEventBatch, hash_blocks
from kvbridge.wire.residency import Residency

BS = 4
GROUPS = {
    "full+window": [("full_attention", None), ("sliding_window", 8)],
    "full+two windows": [("full_attention", None), ("sliding_window", 5), ("sliding_window", 13)],
}


def _probe(prompt: list[int]) -> list[int]:
    # The pool never counts a prompt's last token as hit (vLLM recomputes it); the index answers
    # whole blocks held. The prompt's full blocks plus one token asks both the same question.
    return prompt[: len(prompt) // BS * BS] + [0]


def _expected(pools: dict[str, KVCacheManager], prompt: list[int]) -> dict[str, int]:
    hits = {name: pool.hit_blocks(_probe(prompt)) for name, pool in pools.items()}
    return {name: n for name, n in hits.items() if n}


def _snapshot_residency(pool: KVCacheManager) -> dict:
    r = Residency()
    r.apply(pool.snapshot())
    return r.held


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1), shape=st.sampled_from(sorted(GROUPS)), key=st.sampled_from(["tokens", "engine"]),
    retention=st.sampled_from([None, 0]),
)
def test_index_and_views_follow_hybrid_pools_exactly(seed, shape, key, retention):
    """``retention=0`` is vLLM's default retention: window groups announce only the blocks they
    keep (sparse stores, all the tokens); None caches every block."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(3, 9) * BS)] for _ in range(3)]
    pools = {f"w{i}": KVCacheManager(rng.randrange(12, 24), BS, groups=GROUPS[shape], retention_interval=retention)
             for i in range(2)}
    index = Index(BS, key=key)
    views = {name: Residency() for name in pools}
    live: dict[str, list[str]] = {name: [] for name in pools}
    prompts: list[list[int]] = []
    for step in range(40):
        name = rng.choice(sorted(pools))
        pool = pools[name]
        op = rng.random()
        if op < 0.55:
            prompt = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(0, 3 * BS))]
            rid = f"r{step}"
            if pool.allocate(rid, prompt) is not None:
                live[name].append(rid)
                pool.append(rid, [rng.randrange(1000) for _ in range(rng.randrange(1, 2 * BS))])
                prompts.append(prompt)
        elif op < 0.9 and live[name]:
            pool.free(live[name].pop(rng.randrange(len(live[name]))))
        elif op < 0.93:
            for rid in live[name]:
                pool.free(rid)
            live[name].clear()
            pool.reset()
        events = pool.take_events()
        views[name].apply(events)
        index.apply(name, KVEventBatch(float(step), events))
        for prompt in prompts[-4:] + systems:
            if key == "tokens":
                got = index.find_matches(prompt)
            else:
                got = index.find_matches(block_hashes=hash_blocks(prompt, BS))
            assert got == _expected(pools, prompt), (step, name)
        assert views[name].held == _snapshot_residency(pool), step
    # A late router: the pools' snapshots alone give the same answers.
    late = Index(BS, key=key)

    for name, pool in pools.items():
        late.apply(name, KVEventBatch(0.0, pool.snapshot()))
    for prompt in prompts[-8:] + systems:
        if key == "tokens":
            assert late.find_matches(prompt) == _expected(pools, prompt)
    assert sum(v.stats["bad_groups"] + v.stats["unknown_kinds"] for v in views.values()) == 0


def test_the_workload_really_makes_copies_and_early_window_drops():
    """The premise of the property test: its pools do evict sliding-window blocks while the full
    group keeps them, and do hold duplicate physical copies."""
    rng = random.Random(3)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(3, 9) * BS)] for _ in range(3)]
    pool = KVCacheManager(16, BS, groups=GROUPS["full+window"])
    view = Residency()
    window_only_drops = copies = 0
    live = []
    for step in range(300):
        if rng.random() < 0.6:
            prompt = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(0, 3 * BS))]
            if pool.allocate(f"r{step}", prompt) is not None:
                live.append(f"r{step}")
                pool.append(f"r{step}", [rng.randrange(1000) for _ in range(rng.randrange(1, 2 * BS))])
        elif live:
            pool.free(live.pop(rng.randrange(len(live))))
        view.apply(pool.take_events())
        held = view.held
        full, window = held.get(("GPU", 0), {}), held.get(("GPU", 1), {})
        window_only_drops = max(window_only_drops, len(set(full) - set(window)))
        copies = max(copies, max((c for g in held.values() for c in g.values()), default=0))
    assert window_only_drops > 0
    assert copies >= 2
