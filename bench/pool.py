"""Block pool cost on a multi-turn chat workload with shared system prompts.

An engine loop over ``KVCacheManager``: conversations start from one of a few system prompts;
``--active`` of them are in flight at a time;
each turn's prompt is the whole conversation so far plus a new user message (so most of it is
a prefix hit), the reply is decoded, the request is freed and the next turn queued. Up to
``--batch`` requests run at once; a request that cannot be admitted waits, one whose append
fails is preempted (freed and re-queued, as vLLM recomputes). ``take_events()`` after every
step, as the publisher does. The pool is smaller than the working set, so blocks are evicted.

Two decode granularities:
  chunk -- a step appends ``--chunk`` tokens per request (a simulator advancing many tokens);
  token -- a step appends one token per request (an engine step), dominated by call overhead.

Only the manager's calls are timed (token lists are built beforehand). Reported per block
stored (a ``BlockStored`` block: hashing + bookkeeping + event recording, including the hits,
evictions and frees around it) and per block processed (every full block a request hashed).

Each mode runs the native manager (``NativeKVCacheManager``, what ``KVCacheManager`` is) and the
Python reference (``PyKVCacheManager``) on the same workload, interleaved, and prints the ratio.

    python bench/pool.py                 # both modes, both managers, defaults below
    python bench/pool.py --mode chunk --repeat 5
    python bench/pool.py --impl native   # one manager only
"""

from __future__ import annotations

import argparse
import gc
import itertools
import platform
import random
import time
from collections import deque

from kvbridge.engine._reference_pool import PyKVCacheManager
from kvbridge.engine.pool import NativeKVCacheManager
from kvbridge.wire.events import BlockRemoved, BlockStored


def build_conversations(args, rng):
    systems = [
        [rng.randrange(100_000) for _ in range(rng.randrange(256, 1025))]
        for _ in range(args.systems)
    ]
    convs = []
    for _ in range(args.conversations):
        history = list(rng.choice(systems))
        turns = []
        for _ in range(args.turns):
            history += [rng.randrange(100_000) for _ in range(rng.randrange(32, 257))]
            reply = [rng.randrange(100_000) for _ in range(rng.randrange(64, 385))]
            turns.append((list(history), reply))
            history += reply
        convs.append(turns)
    return convs


def drive(m, convs, args, step: int) -> dict:
    """The engine loop; only the manager's calls are timed."""
    clock = time.perf_counter
    # ``--active`` conversations are in flight; a finished one makes room for the next.
    queue = deque((c, 0) for c in range(min(args.active, len(convs))))
    waiting = deque(range(len(queue), len(convs)))
    running: dict = {}  # rid -> [conv, turn, decoded]
    stored = removed = calls = prompt_tokens = hit_tokens = preempted = 0
    next_rid = 0
    elapsed = 0.0
    while queue or running:
        t0 = clock()
        while queue and len(running) < args.batch:  # admit
            c, turn = queue[0]
            prompt = convs[c][turn][0]
            hit = m.allocate(next_rid, prompt)
            calls += 1
            if hit is None:
                if not running:
                    raise SystemExit("the pool cannot hold one request: raise --blocks")
                break
            queue.popleft()
            running[next_rid] = [c, turn, 0]
            next_rid += 1
            prompt_tokens += len(prompt)
            hit_tokens += hit
        for rid, state in list(running.items()):  # one decode step
            c, turn, done = state
            reply = convs[c][turn][1]
            ok = m.append(rid, reply[done : done + step])
            calls += 1
            if not ok:
                m.free(rid)
                calls += 1
                del running[rid]
                queue.appendleft((c, turn))
                preempted += 1
                continue
            state[2] = done = done + step
            if done >= len(reply):
                m.free(rid)
                calls += 1
                del running[rid]
                if turn + 1 < args.turns:
                    queue.append((c, turn + 1))
                elif waiting:
                    queue.append((waiting.popleft(), 0))
        events = m.take_events()
        calls += 1
        elapsed += clock() - t0
        for e in events:
            if type(e) is BlockStored:
                stored += len(e.block_hashes)
            elif type(e) is BlockRemoved:
                removed += len(e.block_hashes)
    return dict(
        seconds=elapsed,
        stored=stored,
        removed=removed,
        calls=calls,
        hit_rate=hit_tokens / prompt_tokens,
        preempted=preempted,
    )


IMPLS = {"native": NativeKVCacheManager, "python": PyKVCacheManager}


def run(args, mode: str, convs, impl: str) -> dict:
    m = IMPLS[impl](args.blocks, args.block_size, algo=args.algo)
    step = args.chunk if mode == "chunk" else 1
    if args.no_gc:
        gc.disable()
    gc.collect()
    try:
        if args.instructions:
            # The only starmap call in the run: callgrind's --toggle-collect=starmap_next then
            # counts exactly the engine loop (see bench/RESULTS.md).
            (out,) = itertools.starmap(drive, [(m, convs, args, step)])
        else:
            out = drive(m, convs, args, step)
    finally:
        gc.enable()
    # Every full block a turn hashes: its whole prompt (hits included) and its reply.
    out["processed"] = sum((len(p) + len(r)) // args.block_size for t in convs for p, r in t)
    out["mode"] = mode
    return out


def calibrate() -> float:
    """ns per iteration of a trivial Python loop: how fast this shared machine is right now."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x = 0
        for i in range(1_000_000):
            x += i
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mode", choices=["chunk", "token", "both"], default="both")
    ap.add_argument("--algo", default="xxh3")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=8192, help="pool size in blocks")
    ap.add_argument("--systems", type=int, default=8, help="distinct system prompts")
    ap.add_argument("--conversations", type=int, default=256)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--active", type=int, default=96, help="conversations in flight")
    ap.add_argument("--batch", type=int, default=32, help="requests running at once")
    ap.add_argument("--chunk", type=int, default=64, help="tokens per append in chunk mode")
    ap.add_argument("--repeat", type=int, default=3, help="runs per mode; the best is reported")
    ap.add_argument("--no-gc", action="store_true", help="pause the cyclic GC during runs")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--impl", choices=["both", *IMPLS], default="both")
    ap.add_argument(
        "--instructions", action="store_true", help="one run per mode, inside itertools.starmap"
    )
    args = ap.parse_args()
    if args.instructions:
        args.repeat = 1
    convs = build_conversations(args, random.Random(args.seed))
    modes = ["chunk", "token"] if args.mode == "both" else [args.mode]
    print(
        f"# pool bench: {platform.python_implementation()} {platform.python_version()}, "
        f"algo={args.algo}, block_size={args.block_size}, blocks={args.blocks}, "
        f"{args.conversations} conversations x {args.turns} turns, {args.active} active, "
        f"batch={args.batch}, chunk={args.chunk}, gc={'off' if args.no_gc else 'on'}"
    )
    impls = list(IMPLS) if args.impl == "both" else [args.impl]
    for mode in modes:
        speed = calibrate()
        results = {impl: [] for impl in impls}
        for _ in range(args.repeat):  # interleaved, so both see the same machine load
            for impl in impls:
                results[impl].append(run(args, mode, convs, impl))
        best = {impl: min(rs, key=lambda r: r["seconds"]) for impl, rs in results.items()}
        for impl, b in best.items():
            s = b["seconds"]
            print(
                f"{mode:5} {impl:6}: {b['stored'] / s / 1e6:5.2f} M blocks stored/s, "
                f"{s / b['stored'] * 1e6:5.2f} us per block stored | "
                f"{b['processed'] / s / 1e6:5.2f} M blocks processed/s, "
                f"{s / b['processed'] * 1e6:5.3f} us per block processed | "
                f"{s / b['calls'] * 1e6:5.2f} us per call | "
                f"prefix hit rate {b['hit_rate']:.1%}, {b['removed']} evicted, "
                f"{b['preempted']} preempted, {s:.2f} s | calibration {speed:.0f} ns/loop"
            )
        if len(best) == 2:
            ratio = best["python"]["seconds"] / best["native"]["seconds"]
            same = all(best["native"][k] == best["python"][k] for k in ("stored", "removed", "calls"))
            print(f"{mode:5} native is {ratio:.1f}x the Python reference; same work: {same}")

if __name__ == "__main__":
    main()
