#!/usr/bin/env python3
"""NVIDIA Dynamo 1.6.1's own offline fleet replay on a Mooncake trace: the anchor kvbridge's
replay is checked against (bench/replay.py runs this in a subprocess).

Runs with the interpreter of a separate venv holding ``ai-dynamo-runtime==1.6.1`` (bench-only:
never a dependency of kvbridge or of its tests; it needs nothing of kvbridge)::

    python3 -m venv /work/dynamo-venv && /work/dynamo-venv/bin/pip install ai-dynamo-runtime==1.6.1
    /work/dynamo-venv/bin/python bench/dynamo_replay.py --trace conversation_trace.jsonl \\
        --first 2000 --workers 4 --speedup 3 --router kv_router --runs 3 --json

The call is ``dynamo._core.run_mocker_trace_replay([trace], extra_engine_args={"engine":
{"block_size": B, "num_gpu_blocks": G}}, num_workers=W, router_mode=..., router_config=
KvRouterConfig() (kv_router only), arrival_speedup_ratio=S, trace_block_size=512)``: the settings
of ``dynamo-replay-results.md``. round_robin is deterministic; kv_router breaks exact ties with an
unseeded RNG, so its runs differ (``--runs``).

Per run (one JSON object a line with ``--json``, else one readable line):

* ``reuse``: prefix_cache_reused_ratio (per request the most cached prefix of its admissions, over
  all prompt tokens); ``reuse_first_admission``: the same at the first admission only;
* ``ttft_mean/p50/p90/p99``, ``itl_mean/p99``, ``e2e_mean``: simulated ms; ``rps``: completed
  requests per simulated second;
* ``wall_s``: wall-clock seconds of the replay call alone (it reads and parses the trace itself);
* ``fingerprint``: a hash of every summary scalar but the wall-clock ones (equal = the same
  simulation); ``version``: ai-dynamo-runtime's; ``summary``: Dynamo's whole summary dict;
* ``per_worker`` (``--per-worker``: per-request capture on): requests and TTFT mean per worker.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from importlib import metadata

# Dynamo's kv_router logs every routing decision at INFO: keep stderr quiet unless asked.
os.environ.setdefault("DYN_LOG", "warn")

WALL_CLOCK_KEYS = ("wall_time_ms", "processed_tokens_per_s", "processed_output_tokens_per_s")


def first_lines(path: str, first: int) -> str:
    """A temporary file holding the first ``first`` non-empty lines of ``path`` (caller unlinks)."""
    with open(path, encoding="utf-8") as f:
        lines = [line if line.endswith("\n") else line + "\n" for line in f if line.strip()][:first]
    tmp = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
    with tmp:
        tmp.writelines(lines)
    return tmp.name


def fingerprint(summary: dict) -> str:
    # Means are summed in uuid order (random per run): compare floats at 9 significant digits.
    core = {k: (float(f"{v:.9g}") if isinstance(v, float) else v)
            for k, v in summary.items() if k not in WALL_CLOCK_KEYS}  # fmt: skip
    return hashlib.sha256(json.dumps(core, sort_keys=True, default=str).encode()).hexdigest()[:16]


def per_worker(records: list, workers: int) -> list:
    out = []
    for w in range(workers):
        ttft = [p["ttft_ms"] for p in records if p.get("decode_worker_idx") == w and p.get("ttft_ms") is not None]
        n = sum(1 for p in records if p.get("decode_worker_idx") == w)
        out.append({"worker": w, "requests": n, "ttft_mean": sum(ttft) / len(ttft) if ttft else None})
    return out


def run_once(args: argparse.Namespace, trace_path: str) -> dict:
    from dynamo._core import KvRouterConfig, run_mocker_trace_replay  # type: ignore[import-not-found]

    kwargs = dict(
        extra_engine_args={"engine": {"block_size": args.block_size, "num_gpu_blocks": args.num_gpu_blocks}},
        num_workers=args.workers,
        router_mode=args.router,
        arrival_speedup_ratio=float(args.speedup),
        trace_block_size=args.trace_block_size,
        capture_per_request=args.per_worker,
    )
    if args.router == "kv_router":
        rc = {}
        if args.overlap_score_credit is not None:
            rc["overlap_score_credit"] = args.overlap_score_credit
        kwargs["router_config"] = KvRouterConfig(**rc)
        if args.kv_event_lag_ms:
            kwargs["kv_event_lag_ms"] = float(args.kv_event_lag_ms)
    t = time.perf_counter()
    result = run_mocker_trace_replay([trace_path], **kwargs)
    wall_s = time.perf_counter() - t
    s = dict(result.summary)
    out = {
        "trace": os.path.abspath(args.trace), "first": args.first or None, "workers": args.workers,
        "speedup": args.speedup, "router": args.router, "version": metadata.version("ai-dynamo-runtime"),
        "reuse": s["prefix_cache_reused_ratio"],
        "reuse_first_admission": s["first_admission_prefix_cache_reused_ratio"],
        "ttft_mean": s["mean_ttft_ms"], "ttft_p50": s["median_ttft_ms"], "ttft_p90": s["p90_ttft_ms"],
        "ttft_p99": s["p99_ttft_ms"], "itl_mean": s["mean_itl_ms"], "itl_p99": s["p99_itl_ms"],
        "e2e_mean": s["mean_e2e_latency_ms"], "rps": s["request_throughput_rps"], "completed": s["completed_requests"],
        "wall_s": wall_s, "fingerprint": fingerprint(s), "summary": s,
    }
    if args.per_worker:
        out["per_worker"] = per_worker(result.per_request or [], args.workers)
    return out


def human(o: dict) -> str:
    return (f"{o['router']:<11} W={o['workers']} x{o['speedup']:g}: reuse {100 * o['reuse']:.2f}% "
            f"(1st {100 * o['reuse_first_admission']:.2f}%) TTFT mean {o['ttft_mean']:.0f} p50 {o['ttft_p50']:.0f} "
            f"p90 {o['ttft_p90']:.0f} p99 {o['ttft_p99']:.0f} | ITL {o['itl_mean']:.1f} p99 {o['itl_p99']:.1f} | "
            f"e2e {o['e2e_mean']:.0f} | rps {o['rps']:.2f} | wall {o['wall_s']:.2f}s | "
            f"fp {o['fingerprint']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="Mooncake JSONL trace")
    ap.add_argument("--first", type=int, default=0, help="only the first N requests (0: all)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--speedup", type=float, default=1.0, help="arrival_speedup_ratio")
    ap.add_argument("--router", choices=("round_robin", "kv_router"), default="round_robin")
    ap.add_argument("--runs", type=int, default=1, help="repeat the call (kv_router's ties are random)")
    ap.add_argument("--json", action="store_true", help="one JSON object per run on stdout")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--num-gpu-blocks", type=int, default=16384)
    ap.add_argument("--trace-block-size", type=int, default=512)
    ap.add_argument("--overlap-score-credit", type=float, default=None, help="kv_router only")
    ap.add_argument("--kv-event-lag-ms", type=float, default=None, help="kv_router only")
    ap.add_argument("--per-worker", action="store_true", help="capture per request; report per-worker counts")
    args = ap.parse_args(argv)

    trace_path = first_lines(args.trace, args.first) if args.first else args.trace
    try:
        for i in range(args.runs):
            o = run_once(args, trace_path)
            o["run"] = i
            print(json.dumps(o, default=str) if args.json else human(o), flush=True)
    finally:
        if trace_path != args.trace:
            os.unlink(trace_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
