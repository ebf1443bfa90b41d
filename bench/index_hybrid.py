"""kvbridge.Index on a hybrid model's stream beside the same workload on a one-group model, in one run.

    python bench/index_hybrid.py [--workers 32] [--steps 60] [--window 128] [--queries 1000] [--runs 3]

The workload is bench/index.py's (``make_stream``: vLLM-shaped steps over shared 160-block
documents, evictions when the pools fill), once on one-group pools and once on pools with a
full-attention and a sliding-window group of ``--window`` tokens (``KVCacheManager(groups=...)``:
one event per group per step, window blocks released as requests advance, so the window group
holds only the tails). Rows, each the best of ``--runs`` in this process:

* apply: block events/s (hashes stored + removed) from the steps' msgpack payloads, key="tokens";
* find_matches p50 / p99 for 128-block prompts, tokens in: the hybrid index applies vLLM's
  coordinator rule (the window group must hold the blocks before the hit's end) per worker;
* memory per (block, worker, group) entry (``Index.memory_bytes``).

Every answer is checked: against brute force over the cached hashes (one group) and against
each pool's own hit (``KVCacheManager.hit_blocks``, vLLM's rule) for the hybrid model.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import index as base  # noqa: E402  (bench/index.py: the same stream, percentiles)

from kvbridge import Index, KVCacheManager, KVEventBatch, encode_batch  # noqa: E402


def stream(n_workers: int, steps: int, window: int | None) -> tuple[list, list, list]:
    groups = [("full_attention", None), ("sliding_window", window)] if window else None
    real = base.KVCacheManager
    base.KVCacheManager = lambda n, bs: real(n, bs, groups=groups)  # type: ignore[assignment]
    try:
        return base.make_stream(n_workers, steps)
    finally:
        base.KVCacheManager = real


def apply_rate(payloads: list[tuple[int, bytes]], n_events: int, runs: int) -> tuple[float, Index]:
    best, idx = float("inf"), None
    for _ in range(runs):
        idx = Index(base.BS)
        gc.disable()
        t0 = time.perf_counter()
        for w, p in payloads:
            idx.apply(f"w{w}", p)
        best = min(best, time.perf_counter() - t0)
        gc.enable()
    assert idx is not None
    return n_events / best, idx


def expected(pools: list[KVCacheManager], prompt: list[int], hybrid: bool) -> dict[str, int]:
    bs = base.BS
    if hybrid:
        probe = prompt[: len(prompt) // bs * bs] + [0]  # the pool never hits a prompt's last token
        hits = {f"w{i}": p.hit_blocks(probe) for i, p in enumerate(pools)}
        return {w: n for w, n in hits.items() if n}
    cached = [set(p.pool.cached_block_hashes()) for p in pools]
    return base.brute_force(cached, base.hash_blocks(prompt, bs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--window", type=int, default=128, help="sliding window in tokens (default 128)")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for name, window in (("one group (full attention)", None), (f"hybrid: full + window {args.window}", args.window)):
        docs, pools, steps = stream(args.workers, args.steps, window)
        payloads = [(w, encode_batch(KVEventBatch(0.0, evs))) for w, evs in steps]
        n_events = sum(base.block_events(evs) for _, evs in steps)
        rate, idx = apply_rate(payloads, n_events, args.runs)
        rnd = random.Random(11)
        prompts = [docs[rnd.randrange(len(docs))][: base.QUERY_BLOCKS * base.BS] for _ in range(args.queries)]
        wrong = sum(idx.find_matches(p) != expected(pools, p, window is not None) for p in prompts)
        p50, p99 = base.latency(idx.find_matches, prompts, rounds=args.runs)
        entries = sum(len(p.pool.cached_block_hashes()) for p in pools)
        matched = sum(len(idx.find_matches(p)) for p in prompts) / len(prompts)
        rows.append((name, n_events, rate, p50, p99, idx.memory_bytes / max(entries, 1), wrong, matched))
    print(f"kvbridge.Index, {args.workers} workers, {args.steps} steps each, best of {args.runs}")
    print(f"{'stream':<30} {'block events':>12} {'apply M/s':>10} {'p50 us':>7} {'p99 us':>7} "
          f"{'B/entry':>8} {'workers hit':>11} {'wrong':>6}")  # fmt: skip
    for name, n, rate, p50, p99, mem, wrong, matched in rows:
        print(f"{name:<30} {n:>12,} {rate / 1e6:>10.2f} {p50:>7.1f} {p99:>7.1f} {mem:>8.1f} {matched:>11.1f} {wrong:>6}")
    if any(r[6] for r in rows):
        raise SystemExit("an answer differed from the pools' own")


if __name__ == "__main__":
    main()
