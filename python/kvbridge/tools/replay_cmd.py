"""``kvbridge replay``: the parser and the runner of the subcommand (kvbridge.replay does the work)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from typing import Any

from kvbridge.tools.argtypes import non_negative, positive, positive_int

__all__ = ["add_parser", "run"]

_POLICY_HELP = (
    "kv: kvbridge.Router with the proxy's defaults, told loads by its own accounting; kv-reports: the same "
    "with the workers' LoadReports too (the proxy's mode); dynamo: a port of Dynamo 1.6.1's default KV router; "
    "rr: round robin; random"
)


def add_parser(sub: Any) -> None:
    r = sub.add_parser(
        "replay", help="replay a request trace through a simulated fleet and compare routing policies by time",
        description="Replay a request trace (Mooncake JSONL: timestamp ms, input_length, output_length, hash_ids; "
        "or JSONL of token ids: timestamp, output_length, tokens) through a simulated fleet in virtual time: per "
        "worker a vLLM engine model (scheduler, prefix cache, chunked prefill, preemption) timed by NVIDIA Dynamo "
        "1.6.1's polynomial model, the router fed the production signals (KV events as the pool emits them, load "
        "reports, first token, completion). Prints per policy: prefix reuse, TTFT/ITL/e2e in simulated ms, "
        "requests/s, preemptions, requests rejected, requests per worker, wall time. Deterministic for a --seed. docs/routing.md.",
    )  # fmt: skip
    r.add_argument("traces", nargs="+", metavar="TRACE", help="trace file(s), each replayed on its own")
    r.add_argument("--policy", default="kv,kv-reports,dynamo,rr,random",
                   help=f"comma-separated policies to compare (default all). {_POLICY_HELP}")  # fmt: skip
    r.add_argument("--workers", type=positive_int, default=4, help="simulated workers (default 4)")
    r.add_argument("--speedup", type=positive, default=1.0, help="divide the trace's arrival times by this (default 1)")
    r.add_argument("--first", type=positive_int, metavar="N", help="replay only the first N requests")
    r.add_argument("--block-size", type=positive_int, default=64, help="tokens per KV block (default 64)")
    r.add_argument("--num-blocks", type=positive_int, default=16384, help="KV blocks per worker (default 16384)")
    r.add_argument("--max-num-batched-tokens", type=positive_int, default=8192,
                   help="the engine's token budget per pass (default 8192)")  # fmt: skip
    r.add_argument("--max-num-seqs", type=positive_int, default=256, help="the engine's seats (default 256)")
    r.add_argument("--engine-speedup", type=positive, default=1.0,
                   help="divide the timing model's prefill and decode times by this (default 1)")  # fmt: skip
    r.add_argument("--trace-block-size", type=positive_int, default=512,
                   help="tokens per hash_id in a Mooncake trace (default 512); a line's own hash_block_size, as "
                   "`kvbridge proxy --record` writes it, overrides it")  # fmt: skip
    r.add_argument("--event-lag-ms", type=non_negative, default=0.0,
                   help="KV events reach the router this long after their pass ends (default 0)")  # fmt: skip
    r.add_argument("--report-interval-ms", type=positive, default=100.0,
                   help="load reports every this many ms, for kv-reports (default 100; the vLLM plugin sends one "
                   "per load_interval_s, 1 s by default: 1000 matches it)")  # fmt: skip
    r.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    r.add_argument("--json", action="store_true",
                   help="print JSON instead of tables (one object; a list of them for several traces)")  # fmt: skip
    r.add_argument("--plot", metavar="FILE.png", help="write TTFT CDFs and per-worker queued work over time "
                   "(needs matplotlib: the 'plot' extra); with several traces, one file each (FILE-<n>.png)")  # fmt: skip
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from kvbridge.replay.engine import EngineConfig
    from kvbridge.replay.fleet import FleetConfig
    from kvbridge.replay.policies import POLICIES
    from kvbridge.replay.report import format_table
    from kvbridge.replay.run import compare, plot
    from kvbridge.replay.trace import TraceError, load_trace

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if not policies or unknown:
        print(f"kvbridge replay: --policy: unknown {', '.join(unknown) or '(none given)'}; "
              f"expected a comma-separated list of {', '.join(POLICIES)}", file=sys.stderr)  # fmt: skip
        return 2
    twice = sorted({p for p in policies if policies.count(p) > 1})
    if twice:
        print(f"kvbridge replay: --policy: {', '.join(twice)} given twice (each policy is one row)", file=sys.stderr)
        return 2
    try:
        engine = EngineConfig(
            num_blocks=args.num_blocks, block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs, speedup=args.engine_speedup,
        )
    except ValueError as exc:  # a combination of flags (each is checked by argparse), named as flags
        why = str(exc)
        for field in ("max_num_batched_tokens", "max_num_seqs"):
            why = why.replace(field, "--" + field.replace("_", "-"))
        print(f"kvbridge replay: {why}", file=sys.stderr)
        return 2
    config = FleetConfig(
        workers=args.workers, engine=engine, arrival_speedup=args.speedup, event_lag_ms=args.event_lag_ms,
        report_interval_ms=args.report_interval_ms,
    )
    progress = not args.no_progress and sys.stderr.isatty()
    targets = [args.plot if len(args.traces) == 1 else f"{os.path.splitext(args.plot)[0]}-{n}.png"
               for n in range(len(args.traces))] if args.plot else []  # fmt: skip
    if targets:  # what would fail after minutes of replay fails now
        if importlib.util.find_spec("matplotlib") is None:
            print("kvbridge replay: --plot needs matplotlib: pip install 'kvbridge[plot]'", file=sys.stderr)
            return 2
        folder = os.path.dirname(os.path.abspath(targets[0]))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            print(f"kvbridge replay: --plot {args.plot}: cannot write in {folder}", file=sys.stderr)
            return 2
    traces = []  # every trace read and checked before the first replay
    for path in args.traces:
        try:
            requests = load_trace(path, trace_block_size=args.trace_block_size, limit=args.first)
        except OSError as exc:
            print(f"kvbridge replay: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        except TraceError as exc:
            print(f"kvbridge replay: {exc}", file=sys.stderr)
            return 2
        if not requests:
            print(f"kvbridge replay: {path}: no requests", file=sys.stderr)
            return 2
        too_long = next((r for r in requests if not engine.fits(r.input_length)), None)
        if too_long is not None:
            print(f"kvbridge replay: {path}: request {too_long.index + 1} ({too_long.input_length} tokens) does not fit "
                  f"a worker's {args.num_blocks} blocks of {args.block_size} tokens", file=sys.stderr)  # fmt: skip
            return 2
        if not math.isfinite(requests[-1].arrival_ms / args.speedup):
            print(f"kvbridge replay: {path}: request {len(requests)} arrives {requests[-1].arrival_ms:g} ms after the "
                  f"first: divided by --speedup {args.speedup:g}, past a float's range", file=sys.stderr)  # fmt: skip
            return 2
        traces.append((path, requests))
    out = []
    for n, (path, requests) in enumerate(traces):
        summaries, runs = compare(requests, policies, config, seed=args.seed, progress=progress,
                                  sample_ms=1000.0 if args.plot else 0.0)  # fmt: skip
        title = (f"{path}: {len(requests)} requests, {args.workers} workers, arrivals x{args.speedup:g}, "
                 f"{args.num_blocks} x {args.block_size}-token blocks")  # fmt: skip
        if targets:
            try:
                plot(targets[n], runs, title)
            except OSError as exc:
                print(f"kvbridge replay: cannot write {targets[n]}: {exc.strerror or exc}", file=sys.stderr)
                return 2
        if args.json:
            # Everything the figures depend on (wall_s aside: the only figure that is not simulated).
            out.append({"trace": path, "requests": len(requests), "workers": args.workers, "speedup": args.speedup,
                        "seed": args.seed, "first": args.first, "trace_block_size": args.trace_block_size,
                        "event_lag_ms": args.event_lag_ms, "report_interval_ms": args.report_interval_ms,
                        "engine": {k: getattr(engine, k) for k in engine.__slots__},
                        "policies": [s.as_dict() for s in summaries]})  # fmt: skip
        else:
            print(f"{title}; times in simulated ms\n")
            print(format_table(summaries))
            print()
    if args.json:
        print(json.dumps(out[0] if len(out) == 1 else out, indent=1))
    return 0
