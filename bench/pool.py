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

    python bench/pool.py                 # both modes, defaults below
    python bench/pool.py --mode chunk --repeat 5
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import time
from collections import deque

from kvbridge import KVCacheManager
from kvbridge.events import BlockRemoved, BlockStored


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


def run(args, mode: str, seed: int) -> dict:
    rng = random.Random(seed)
    convs = build_conversations(args, rng)
    step = args.chunk if mode == "chunk" else 1
    m = KVCacheManager(args.blocks, args.block_size, algo=args.algo)
    clock = time.perf_counter
    # ``--active`` conversations are in flight; a finished one makes room for the next.
    queue = deque((c, 0) for c in range(min(args.active, len(convs))))
    waiting = deque(range(len(queue), len(convs)))
    running: dict = {}  # rid -> [conv, turn, decoded]
    stored = removed = calls = prompt_tokens = hit_tokens = preempted = 0
    next_rid = 0
    elapsed = 0.0
    gc.disable()  # the pool allocates few objects; keep collector pauses out of the numbers
    try:
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
    finally:
        gc.enable()
    total_tokens = sum(len(p) + len(r) for turns in convs for p, r in turns)
    # Every full block a turn hashes: its whole prompt (hits included) and its reply.
    processed = sum((len(p) + len(r)) // args.block_size for turns in convs for p, r in turns)
    return dict(
        mode=mode,
        seconds=elapsed,
        stored=stored,
        removed=removed,
        processed=processed,
        calls=calls,
        tokens=total_tokens,
        hit_rate=hit_tokens / prompt_tokens,
        preempted=preempted,
    )


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
    args = ap.parse_args()
    modes = ["chunk", "token"] if args.mode == "both" else [args.mode]
    print(
        f"# pool bench: {platform.python_implementation()} {platform.python_version()}, "
        f"algo={args.algo}, block_size={args.block_size}, blocks={args.blocks}, "
        f"{args.conversations} conversations x {args.turns} turns, {args.active} active, "
        f"batch={args.batch}, chunk={args.chunk}"
    )
    for mode in modes:
        best = min((run(args, mode, seed=1) for _ in range(args.repeat)), key=lambda r: r["seconds"])
        s = best["seconds"]
        print(
            f"{mode:5}: {best['stored'] / s / 1e6:5.2f} M blocks stored/s, "
            f"{s / best['stored'] * 1e6:5.2f} us per block stored | "
            f"{best['processed'] / s / 1e6:5.2f} M blocks processed/s, "
            f"{s / best['processed'] * 1e6:5.2f} us per block processed | "
            f"{s / best['calls'] * 1e6:5.2f} us per call | "
            f"prefix hit rate {best['hit_rate']:.1%}, {best['removed']} evicted, "
            f"{best['preempted']} preempted, {s:.2f} s"
        )


if __name__ == "__main__":
    main()
