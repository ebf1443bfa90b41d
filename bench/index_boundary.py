"""kvbridge.Index's query from Python, on bench/native's workload: what the Python boundary adds
to the native call (bench/native's kvbridge rows, same index, same queries).

    make bench-native            (runs bench/native, then this on its --dump)
    python bench/index_boundary.py DIR [--rounds 5]

DIR holds bench/native's ``--dump``: the msgpack payloads of its stream (applied here to an
``Index(key="engine")`` and an ``Index(key="tokens")``) and its 2,000 128-block queries with the
brute-force answers. Each way of asking runs the whole query set per round, the ways in turn;
p50 / p99 of single calls (``perf_counter_ns`` around the call, its input built before), the
best round of each. Every answer is checked against brute force.
"""

from __future__ import annotations

import argparse
import gc
import struct
import sys
import time
from array import array
from pathlib import Path
from typing import Any, Callable

from kvbridge import Index


def load(d: Path) -> tuple[list[tuple[str, bytes]], list[tuple[array, array, dict[str, int]]], int]:
    raw = (d / "payloads.bin").read_bytes()
    payloads, p = [], 0
    while p < len(raw):
        worker, n = struct.unpack_from("<II", raw, p)
        payloads.append((f"worker-{worker}", raw[p + 8 : p + 8 + n]))
        p += 8 + n
    q = (d / "queries.bin").read_bytes()
    n_queries, blocks, bs = struct.unpack_from("<III", q, 0)
    p, queries = 12, []
    for _ in range(n_queries):
        hashes = array("Q", q[p : p + 8 * blocks])
        p += 8 * blocks
        tokens = array("I", q[p : p + 4 * blocks * bs])
        p += 4 * blocks * bs
        (n,) = struct.unpack_from("<I", q, p)
        pairs = struct.unpack_from(f"<{2 * n}I", q, p + 4)
        p += 4 + 8 * n
        queries.append((hashes, tokens, {f"worker-{pairs[i]}": pairs[i + 1] for i in range(0, 2 * n, 2)}))
    if sys.byteorder != "little":
        for hashes, tokens, _ in queries:
            hashes.byteswap()
            tokens.byteswap()
    return payloads, queries, bs


TOP_K = 4


def agrees(answer: Any, expect: dict[str, int]) -> bool:
    if isinstance(answer, dict):
        return answer == expect
    workers, counts = answer
    got = dict(zip(workers, counts))
    if len(got) == len(expect):
        return got == expect
    # top_k: the k longest hits (which of equal ones is the index's choice), longest first.
    longest = sorted(expect.values(), reverse=True)[:TOP_K]
    return counts == longest and all(expect.get(w) == n for w, n in got.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    payloads, queries, bs = load(args.dir)
    engine, tokens_ix = Index(bs, key="engine"), Index(bs, key="tokens")
    for worker, payload in payloads:
        engine.apply(worker, payload)
        tokens_ix.apply(worker, payload)
    # (label, the call, its input for a query)
    ways: list[tuple[str, Callable[[Any], Any], Callable[[tuple], Any]]] = [
        ("engine: dict <- list of int hashes", lambda x: engine.find_matches(block_hashes=x), lambda q: q[0].tolist()),
        ("engine: lists <- array('Q') hashes", lambda x: engine.find_matches(block_hashes=x, lists=True), lambda q: array("Q", q[0])),
        ("engine: lists <- bytes of hashes", lambda x: engine.find_matches(block_hashes=x, lists=True), lambda q: q[0].tobytes()),
        (f"engine: top_k={TOP_K} lists <- array('Q')", lambda x: engine.find_matches(block_hashes=x, top_k=TOP_K, lists=True), lambda q: array("Q", q[0])),
        ("tokens: dict <- list of int tokens", lambda x: tokens_ix.find_matches(x), lambda q: q[1].tolist()),
        ("tokens: lists <- array('I') tokens", lambda x: tokens_ix.find_matches(x, lists=True), lambda q: array("I", q[1])),
        (f"tokens: top_k={TOP_K} lists <- array('I') tokens", lambda x: tokens_ix.find_matches(x, top_k=TOP_K, lists=True), lambda q: array("I", q[1])),
    ]
    best: dict[str, tuple[float, float]] = {}
    wrong: dict[str, int] = {}
    gc.disable()
    for _ in range(args.rounds):
        for label, call, prep in ways:
            times = []
            for q in queries:
                x = prep(q)
                t = time.perf_counter_ns()
                answer = call(x)
                times.append(time.perf_counter_ns() - t)
                if not agrees(answer, q[2]):
                    wrong[label] = wrong.get(label, 0) + 1
            times.sort()
            p50, p99 = times[len(times) // 2], times[int(len(times) * 0.99)]
            old = best.get(label, (float("inf"), float("inf")))
            best[label] = (min(old[0], p50), min(old[1], p99))
    gc.enable()
    clock = min(b - a for a, b in ((time.perf_counter_ns(), time.perf_counter_ns()) for _ in range(1000)))
    print(f"From Python: {len(queries)} queries x {args.rounds} rounds, p50 / p99 of the best round; "
          f"perf_counter_ns pair: {clock} ns (included)")
    print()
    print("| query (index key: answer <- input) | p50 / p99 (us) | scores vs brute force |")
    print("|---|---|---|")
    for label, (p50, p99) in best.items():
        agree = f"DISAGREE on {wrong[label]}" if label in wrong else "agree"
        print(f"| {label} | {p50 / 1e3:.2f} / {p99 / 1e3:.2f} | {agree} |")
    if wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
