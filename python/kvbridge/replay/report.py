"""What a replay reports per policy, computed the way Dynamo's replay reports it
(``aisimulate-core`` ``replay/report.rs`` and ``report/bounded.rs``): exact samples, nearest-rank
percentiles (``rank = round((n - 1) * p / 100)``), reuse as cached prompt tokens over all prompt
tokens, ITL pooled over every gap of every request.

``reuse`` is Dynamo's ``prefix_cache_reused_ratio``: a request preempted and admitted again
counts what it finds cached then, its own generated tokens included (the engine recomputes
prompt and output), so under heavy preemption it rises for a reason unrelated to routing and can
pass 100%; ``reuse_first_admission`` (Dynamo's ``first_admission_...``) is the routing's own."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from kvbridge.replay.engine import Seq

__all__ = ["Summary", "percentile", "summarize", "format_table"]


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest rank of sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    return float(sorted_values[math.floor((len(sorted_values) - 1) * p / 100 + 0.5)])


def weighted_percentile(samples: Sequence[tuple[float, int]], p: float) -> float:
    """:func:`percentile` of values given as ``(value, count)``."""
    total = sum(n for _, n in samples)
    if not total:
        return 0.0
    rank = math.floor((total - 1) * p / 100 + 0.5)
    for value, n in sorted(samples):
        if rank < n:
            return float(value)
        rank -= n
    raise AssertionError("unreachable")


@dataclass
class Summary:
    """One policy's replay."""

    policy: str
    requests: int
    completed: int
    reuse: float  # per request the most cached tokens of its admissions (output too), over prompt tokens
    reuse_first_admission: float  # ... at the first admission only
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_mean: float
    itl_p99: float
    e2e_mean: float
    rps: float  # completed / (last completion - first arrival), simulated seconds
    preemptions: int
    rejected: int  # requests a worker refused (prompt, or prompt and output, larger than its pool): no figures
    prefill_tokens: int  # prompt tokens the fleet computed
    per_worker: list[int] = field(default_factory=list)  # requests routed per worker
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(policy: str, seqs: Sequence[Seq], fleet: Any, wall_s: float) -> Summary:
    done = [s for s in seqs if s.done_ms >= 0]
    ttft = sorted(s.first_token_ms - s.routed_ms for s in done)
    e2e = [s.done_ms - s.routed_ms for s in done]
    isl = sum(s.req.input_length for s in done) or 1
    itl = [(ms, n) for e in fleet.engines for ms, n in e.itl] + [(x, 1) for e in fleet.engines for x in e.itl_extra]
    span = (max((s.done_ms for s in done), default=0.0) - min((s.routed_ms for s in seqs), default=0.0)) / 1000.0
    per_worker = [0] * len(fleet.engines)
    for s in seqs:
        if s.worker >= 0:
            per_worker[s.worker] += 1
    n = len(done) or 1
    return Summary(
        policy=policy,
        requests=len(seqs),
        completed=len(done),
        reuse=sum(s.cached_best for s in done) / isl,
        reuse_first_admission=sum(max(s.cached_first, 0) for s in done) / isl,
        ttft_mean=sum(ttft) / n,
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        itl_mean=sum(ms * n for ms, n in itl) / max(1, sum(n for _, n in itl)),
        itl_p99=weighted_percentile(itl, 99),
        e2e_mean=sum(e2e) / n,
        rps=len(done) / span if span > 0 else 0.0,
        preemptions=sum(e.preemptions for e in fleet.engines),
        rejected=sum(e.rejected for e in fleet.engines),
        prefill_tokens=sum(e.prefill_tokens for e in fleet.engines),
        per_worker=per_worker,
        wall_s=wall_s,
    )


_COLUMNS = (
    ("policy", "policy", "{}"),
    ("reuse", "reuse", "{:.1%}"),
    ("reuse_first_admission", "1st adm.", "{:.1%}"),
    ("ttft_mean", "TTFT mean", "{:,.0f}"),
    ("ttft_p50", "p50", "{:,.0f}"),
    ("ttft_p90", "p90", "{:,.0f}"),
    ("ttft_p99", "p99", "{:,.0f}"),
    ("itl_mean", "ITL mean", "{:,.1f}"),
    ("itl_p99", "ITL p99", "{:,.1f}"),
    ("e2e_mean", "e2e mean", "{:,.0f}"),
    ("rps", "req/s", "{:.3g}"),  # three digits: a slow replay's 0.00123 is not 0.00
    ("preemptions", "preempt", "{}"),
    ("rejected", "rejected", "{}"),
    ("wall_s", "wall s", "{:.2f}"),
)


def format_table(summaries: Sequence[Summary]) -> str:
    """A Markdown table, one row per policy (times in ms), then requests per worker."""
    head = "| " + " | ".join(h for _, h, _ in _COLUMNS) + " |"
    rule = "|" + "|".join("---" if k == "policy" else "---:" for k, _, _ in _COLUMNS) + "|"
    rows = [head, rule]
    for s in summaries:
        d = s.as_dict()
        rows.append("| " + " | ".join(f.format(d[k]) for k, _, f in _COLUMNS) + " |")
    rows.append("")
    for s in summaries:
        rows.append(f"requests per worker, {s.policy}: {' '.join(map(str, s.per_worker))}")
    for s in summaries:
        if s.completed < s.requests:
            rows.append(f"{s.policy}: {s.requests - s.completed} of {s.requests} requests not completed ({s.rejected} "
                        f"rejected: prompt and output outgrew a worker's pool); reuse, TTFT and e2e "
                        f"are over the {s.completed} completed, ITL over every decode step, as Dynamo pools it")  # fmt: skip
    return "\n".join(rows)
