"""One replay as the CLI runs it: a trace, a fleet, several policies, their summaries (and a plot)."""

from __future__ import annotations

import sys
from typing import Any, Sequence

from kvbridge.replay.fleet import FleetConfig, simulate
from kvbridge.replay.policies import make_policy
from kvbridge.replay.report import Summary, summarize
from kvbridge.replay.trace import Request

__all__ = ["compare", "plot"]


def compare(
    requests: Sequence[Request],
    policies: Sequence[str],
    config: FleetConfig,
    *,
    seed: int = 0,
    progress: bool = False,
    sample_ms: float = 0.0,
) -> tuple[list[Summary], dict[str, Any]]:
    """Each policy replayed over the same requests and fleet: ``(summaries, {policy: (outcomes,
    fleet)})``. ``progress``: a bar per policy on stderr (tqdm)."""
    summaries: list[Summary] = []
    runs: dict[str, Any] = {}
    for name in policies:
        policy = make_policy(name, seed=seed)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc=f"replay {name}", unit="req", file=sys.stderr, leave=False)

        def tick(n: int, bar: Any = bar) -> None:
            bar.update(n - bar.n)

        try:
            seqs, fleet, wall = simulate(requests, policy, config, progress=tick if bar is not None else None,
                                         sample_ms=sample_ms)  # fmt: skip
        finally:
            if bar is not None:
                bar.close()
        summaries.append(summarize(policy.name, seqs, fleet, wall))
        runs[policy.name] = (seqs, fleet)
    return summaries, runs


def plot(path: str, runs: dict[str, Any], title: str) -> None:
    """TTFT CDF per policy and, per policy, each worker's queued prompt tokens over time, in one
    PNG (matplotlib, the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("kvbridge replay: --plot needs matplotlib: pip install 'kvbridge[plot]'") from None
    n = len(runs)
    fig, axes = plt.subplots(1 + n, 1, figsize=(9, 3.2 * (1 + n)), squeeze=False)
    cdf = axes[0][0]
    for name, (seqs, _) in runs.items():
        ttft = sorted(s.first_token_ms - s.routed_ms for s in seqs if s.done_ms >= 0)  # the table's requests
        if ttft:
            cdf.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name)
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (ms, simulated)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title(title)
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend()
    for ax, (name, (_, fleet)) in zip((row[0] for row in axes[1:]), runs.items()):
        if fleet.samples:
            xs = [t / 1000.0 for t, _ in fleet.samples]
            for i, label in enumerate(fleet.names):
                ax.plot(xs, [q[i] for _, q in fleet.samples], label=label, linewidth=0.8)
        ax.set_title(f"{name}: queued prompt tokens per worker")
        ax.set_xlabel("simulated s")
        ax.set_ylabel("tokens")
        ax.grid(True, alpha=0.3)
        if len(fleet.names) <= 8:
            ax.legend(fontsize="small", ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
