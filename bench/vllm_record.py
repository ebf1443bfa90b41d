"""Cost of the vLLM stat logger's ``record()`` per call, on vLLM's thread.

vLLM calls ``record()`` once per engine step and per engine, on the API server's event loop; the
target (docs/architecture.md) is a few microseconds, publishing happening off that path. The stats are shaped
like vLLM 0.33's ``SchedulerStats`` (a dataclass with a ``PrefixCacheStats``).

Anchor: the least any Python stat logger can do -- a method that reads the same five numbers from
the same objects and stores them on itself. kvbridge's ``record()`` is printed beside it, as a
ratio, in both of vLLM's call forms, and with ``scheduler_stats`` None (most calls in vLLM).
Interleaved rounds, best of ``--repeat``.

    python bench/vllm_record.py
    python bench/vllm_record.py --calls 200000 --repeat 9
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

import kvbridge.engine.vllm as kv_vllm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from engine_shapes import PrefixCacheStats, SchedulerStats  # noqa: E402  (vLLM's shapes, as the tests build them)


class Anchor:
    """The floor: store the same numbers, nothing else."""

    def __init__(self) -> None:
        self.usage = 0.0
        self.running = self.waiting = self.queries = self.hits = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        s = scheduler_stats
        self.usage = s.kv_cache_usage
        self.running = s.num_running_reqs
        self.waiting = s.num_waiting_reqs + s.num_skipped_waiting_reqs
        self.queries += s.prefix_cache_stats.queries
        self.hits += s.prefix_cache_stats.hits


def per_call_ns(fn, calls: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()

    cfg = NS(
        kv_events_config=NS(enable_kv_cache_events=True, publisher="null", endpoint="tcp://*:5557", topic=""),
        parallel_config=NS(data_parallel_size=2, data_parallel_size_local=2, data_parallel_index=0, _api_process_rank=0),
        model_config=NS(served_model_name="bench"),
    )  # fmt: skip
    # publisher "null" and no load reports: record() alone, with no relay or NATS connection behind it.
    logger = kv_vllm.logger_factory(servers=["nats://127.0.0.1:1"], load_interval_s=0)(vllm_config=cfg, engine_indexes=[0, 1])
    anchor = Anchor()
    stats = SchedulerStats(num_running_reqs=12, num_waiting_reqs=3, num_skipped_waiting_reqs=1, kv_cache_usage=0.42,
                           prefix_cache_stats=PrefixCacheStats(requests=1, queries=512, hits=256))  # fmt: skip
    rows = {
        "anchor (store the numbers)": lambda: anchor.record(stats, None, mm_cache_stats=None, engine_idx=1),
        "record(s, it, mm_cache_stats=, engine_idx=)": lambda: logger.record(stats, None, mm_cache_stats=None, engine_idx=1),
        "record(scheduler_stats=, ..., engine_idx=)": lambda: logger.record(
            scheduler_stats=stats, iteration_stats=None, mm_cache_stats=None, engine_idx=1),
        "record(None, it, ...)": lambda: logger.record(None, None, mm_cache_stats=None, engine_idx=1),
    }  # fmt: skip
    best = dict.fromkeys(rows, float("inf"))
    try:
        for _ in range(args.repeat):
            for name, fn in rows.items():
                best[name] = min(best[name], per_call_ns(fn, args.calls))
    finally:
        kv_vllm.shutdown()
    assert logger.stats["record_errors"] == 0 and logger._slots[1].running == stats.num_running_reqs

    print(f"CPython {platform.python_version()}, {args.calls} calls x best of {args.repeat}")
    print(f"{'call':<46} {'ns/call':>9} {'vs anchor':>10}")
    a = best["anchor (store the numbers)"]
    for name, ns in best.items():
        print(f"{name:<46} {ns:>9.0f} {ns / a:>9.2f}x")


if __name__ == "__main__":
    main()
