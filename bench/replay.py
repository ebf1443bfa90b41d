"""kvbridge's replay against NVIDIA Dynamo 1.6.1's own, cell by cell: issue 30's Validation,
Quality and Speed criteria, judged.

    python bench/replay.py --dynamo-python /work/dynamo-venv/bin/python [--runs 3] [--json FILE]
    python bench/replay.py --quick                       # conv2k and synth only
    python bench/replay.py --cells conv2k:4:1,synth:8:2  # trace:workers:k

A cell is a trace (conv2k: Mooncake's conversation trace, first 2,000 requests; conv: all
12,031; synth: Mooncake's synthetic trace), a worker count W (4, 8) and a per-worker load k
(1-4): arrivals sped up by ``k * W / 4``. 64-token blocks, 16,384 blocks per worker, the engine
defaults of both replays. Per cell, side by side (the same minutes, so the same machine load):

* Dynamo's replay (``bench/dynamo_replay.py`` run by ``--dynamo-python``, a venv with
  ``ai-dynamo-runtime==1.6.1``; bench-only, never a kvbridge dependency): round_robin once (it is
  deterministic), kv_router ``--runs`` times (its exact ties are random: the runs give a band).
  Without ``--dynamo-python`` the figures come from a results file (``--dynamo-results``, default
  ``../shared/routing/dynamo-replay-results.md`` beside the repo): one kv_router run per cell and
  that file's wall times, measured another day.
* kvbridge's replay, in this process: rr, dynamo (its port of Dynamo's default router), kv
  (``kvbridge.Router`` fed in-flight loads) and kv-reports (fed LoadReports: the proxy's mode).

stdout is Markdown, ready for bench/RESULTS.md with the command line it prints; stderr shows
progress. Each criterion is spelled out in ``LEGEND`` below.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "routing"
TRACES = {  # name: (file, first N requests or None)
    "conv2k": ("conversation_trace.jsonl", 2000),
    "conv": ("conversation_trace.jsonl", None),
    "synth": ("synthetic_trace.jsonl", None),
}
POLICIES = ("rr", "dynamo", "kv", "kv-reports")
KV_POLICIES = ("kv", "kv-reports")
FIELDS = ("reuse", "reuse_first_admission", "ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99", "itl_mean", "itl_p99",
          "e2e_mean", "rps", "wall_s")  # fmt: skip
SPEED_CELL = ("conv", 8, 2)
SPEED_LIMIT = 3.0


# ---------------------------------------------------------------------------------------- cells


@dataclass
class Cell:
    trace: str
    workers: int
    k: int
    dyn_rr: dict | None = None  # Dynamo round_robin: FIELDS
    dyn_kv: list[dict] = field(default_factory=list)  # Dynamo kv_router runs
    kvb: dict[str, dict] = field(default_factory=dict)  # kvbridge policy: Summary dict (+ wall_s incl. load)
    cmp: dict[tuple[str, str], tuple[float, float, float]] = field(default_factory=dict)  # see judge()
    checks: dict[str, tuple[bool, str]] = field(default_factory=dict)  # criterion: (passed, detail)

    @property
    def speedup(self) -> float:
        return self.k * self.workers / 4

    @property
    def name(self) -> str:
        return f"{self.trace} {self.workers}w k={self.k}"


def grid(quick: bool) -> list[Cell]:
    traces = ("conv2k", "synth") if quick else ("conv2k", "conv", "synth")
    return [Cell(t, w, k) for t in traces for w in (4, 8) for k in (1, 2, 3, 4)]


def parse_cells(text: str) -> list[Cell]:
    cells = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\w+):(\d+):(\d+)", part)
        if not m or m.group(1) not in TRACES:
            raise SystemExit(f"--cells: {part!r} is not TRACE:WORKERS:K with TRACE in {', '.join(TRACES)}")
        cells.append(Cell(m.group(1), int(m.group(2)), int(m.group(3))))
    return cells


# ------------------------------------------------------------------------------- Dynamo's figures


def dynamo_runs(python: str, traces_dir: Path, cell: Cell, router: str, runs: int) -> list[dict]:
    """Dynamo's replay of a cell in a subprocess of its own venv (no kvbridge on its path)."""
    file, first = TRACES[cell.trace]
    cmd = [python, str(REPO / "bench" / "dynamo_replay.py"), "--trace", str(traces_dir / file),
           "--workers", str(cell.workers), "--speedup", f"{cell.speedup:g}", "--router", router,
           "--runs", str(runs), "--json"]  # fmt: skip
    if first:
        cmd += ["--first", str(first)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"Dynamo's replay failed ({shlex.join(cmd)}):\n{out.stderr[-2000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def dynamo_version(python: str) -> str:
    code = "from importlib import metadata; print(metadata.version('ai-dynamo-runtime'))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


def parse_results(path: Path) -> dict[tuple[str, int, int, str], dict]:
    """The grid tables of dynamo-replay-results.md: ``(trace, W, k, router) -> FIELDS``. Only the
    tables under a ``### <trace>:`` heading count (the sections after the grid are other studies)."""
    out: dict[tuple[str, int, int, str], dict] = {}
    trace, header = None, None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            trace = None
        elif m := re.match(r"### (\w+):", line):
            trace, header = m.group(1), None
        elif trace and line.startswith("|"):
            cols = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cols
            elif not set(cols[0]) <= set("-:"):
                row = dict(zip(header, cols))
                out[(trace, int(row["W"]), int(row["k"]), row["router"])] = {
                    "reuse": _num(row["reuse"]), "reuse_first_admission": _num(row["reuse 1st adm."]),
                    "ttft_mean": _num(row["TTFT mean"]), "ttft_p50": _num(row["p50"]), "ttft_p90": _num(row["p90"]),
                    "ttft_p99": _num(row["p99"]), "itl_mean": _num(row["ITL mean"]), "itl_p99": _num(row["ITL p99"]),
                    "e2e_mean": _num(row["e2e mean"]), "rps": _num(row["rps"]), "wall_s": _num(row["wall s"]),
                }  # fmt: skip
        elif not line.strip():
            header = None
    return out


def _num(text: str) -> float:
    text = text.replace(",", "")
    return float(text[:-1]) / 100 if text.endswith("%") else float(text)


# ------------------------------------------------------------------------------ kvbridge's replay


def load(traces_dir: Path, trace: str) -> tuple[list, float]:
    from kvbridge.replay.trace import load_trace

    file, first = TRACES[trace]
    t = time.perf_counter()
    requests = load_trace(traces_dir / file, limit=first)
    return requests, time.perf_counter() - t


def kvbridge_cell(requests: list, load_s: float, cell: Cell, seed: int, port_seeds: int) -> dict[str, Any]:
    """The four policies over the cell, in this process, and the Dynamo port again with
    ``port_seeds - 1`` more seeds (its exact ties are broken at random, as Dynamo's are: a band,
    ``dynamo_runs``). ``wall_s`` adds the trace's parsing (``load_s``) to each replay: Dynamo's
    call parses its trace too."""
    from kvbridge.replay.fleet import FleetConfig
    from kvbridge.replay.run import compare

    config = FleetConfig(workers=cell.workers, arrival_speedup=cell.speedup)
    summaries, _ = compare(requests, POLICIES, config, seed=seed)
    out: dict[str, Any] = {}
    for s in summaries:
        d = s.as_dict()
        d["replay_wall_s"] = d["wall_s"]
        d["wall_s"] = d["wall_s"] + load_s
        out[s.policy] = d
    out["dynamo_runs"] = [out["dynamo"]] + [
        compare(requests, ["dynamo"], config, seed=seed + i)[0][0].as_dict() for i in range(1, port_seeds)
    ]
    return out


# ------------------------------------------------------------------------------------- criteria

LEGEND = """\
Figures: reuse 1st = first-admission prefix reuse (cached prompt tokens / prompt tokens); TTFT in simulated ms;
wall s = wall-clock seconds of one replay (kvbridge: its trace's parsing included, as Dynamo's call parses its
own). "Dynamo kv_router" rows give min-max over its runs (ties are random), its wall the runs' mean.
Comparisons: `x` = ratio, `pt` = difference in percentage points of reuse.
* rr row: against Dynamo's round_robin (D). **V** PASS iff at k = 1-3 reuse (all admissions and first) within
  0.5 pt, TTFT mean and p99 within 5% (the Δ shown is the larger of the two reuse differences).
* dynamo row: the port replayed with `--port-seeds` seeds (its ties are random, as Dynamo's) against the band of
  Dynamo's kv_router runs (D; band to band, nearest edges: 0 pt and 1x when they overlap). **V** PASS iff at
  k = 1-3 reuse 1st, TTFT mean and p99 each overlap Dynamo's band or lie within 5% (relative) of it.
* kv / kv-reports rows: `vs dynamo` = against kvbridge's `dynamo` in the same replay; `(D)` = against the mean of
  Dynamo's own kv_router runs; `x rr` = TTFT mean / p99 against the same replay's rr. Checks, each
  `same replay·Dynamo's`: **mean** TTFT <= 0.85x; **p99** <= 0.9x at k = 2, 3 and <= 1x at k = 1;
  **reuse** 1st >= (k = 1-3); **rr**: mean and p99 <= rr's, k = 1-4 (k = 4: only this one is judged)."""


def judge(cell: Cell) -> None:
    """Fill ``cell.cmp`` (comparisons: ``(policy, against) -> (reuse pt, mean x, p99 x)``) and
    ``cell.checks`` (criterion -> (passed, detail))."""
    kvb, k, cmp, checks = cell.kvb, cell.k, cell.cmp, cell.checks
    if cell.dyn_rr:
        rr, d = kvb["rr"], cell.dyn_rr
        dr = max((rr[f] - d[f] for f in ("reuse", "reuse_first_admission")), key=abs) * 100
        cmp["rr", "D"] = (dr, rr["ttft_mean"] / d["ttft_mean"], rr["ttft_p99"] / d["ttft_p99"])
        if k <= 3:
            _, m, p = cmp["rr", "D"]
            ok = abs(dr) <= 0.5 and abs(m - 1) <= 0.05 and abs(p - 1) <= 0.05
            checks["V rr"] = (ok, f"{dr:+.2f} pt, mean {m:.3f}x, p99 {p:.3f}x")
    if cell.dyn_kv:
        port = kvb.get("dynamo_runs") or [kvb["dynamo"]]
        fields = ("reuse_first_admission", "ttft_mean", "ttft_p99")
        r, m, p = (band_gap([x[f] for x in port], [x[f] for x in cell.dyn_kv]) for f in fields)
        reuse = [x["reuse_first_admission"] for x in cell.dyn_kv]
        mine = [x["reuse_first_admission"] for x in port]
        dr = 100 * (min(mine) - max(reuse) if min(mine) > max(reuse) else max(mine) - min(reuse) if max(mine) < min(reuse) else 0.0)
        cmp["dynamo", "D"] = (dr, m, p)  # band to band: 0 pt and 1x when they overlap
        if k <= 3:
            ok = all(abs(x - 1) <= 0.05 for x in (r, m, p))
            checks["V dynamo"] = (ok, f"reuse {dr:+.2f} pt ({r:.3f}x), mean {m:.3f}x, p99 {p:.3f}x of the band"
                                      f" ({len(port)} seeds against {len(cell.dyn_kv)} runs)")  # fmt: skip
    refs = {"": kvb["dynamo"], "rr": kvb["rr"]}
    if cell.dyn_kv:
        refs["D"] = {f: sum(r[f] for r in cell.dyn_kv) / len(cell.dyn_kv) for f in FIELDS}
    for pol in KV_POLICIES:
        kv = kvb[pol]
        for tag, ref in refs.items():
            cmp[pol, tag] = ((kv["reuse_first_admission"] - ref["reuse_first_admission"]) * 100,
                             kv["ttft_mean"] / ref["ttft_mean"], kv["ttft_p99"] / ref["ttft_p99"])  # fmt: skip
        for tag in ("", "D") if k <= 3 else ():
            if (pol, tag) not in cmp:
                continue
            dr, m, p = cmp[pol, tag]
            p99_limit = 1.0 if k == 1 else 0.9
            name = f"{pol} vs {'Dynamo kv_router' if tag else 'dynamo'}"
            checks[f"{name}: mean"] = (m <= 0.85, f"{m:.3f}x")
            checks[f"{name}: p99"] = (p <= p99_limit, f"{p:.3f}x, limit {p99_limit:g}x")
            checks[f"{name}: reuse"] = (dr >= 0, f"{dr:+.2f} pt")
        _, m, p = cmp[pol, "rr"]
        checks[f"{pol} vs rr"] = (m <= 1 and p <= 1, f"mean {m:.3f}x, p99 {p:.3f}x")


def band_gap(mine: list[float], runs: list[float]) -> float:
    """How far the band of ``mine`` lies from the band of ``runs``, as a ratio of the nearest
    edges (1.0 when they overlap)."""
    lo, hi = min(runs), max(runs)
    return min(mine) / hi if min(mine) > hi else max(mine) / lo if max(mine) < lo else 1.0


# ------------------------------------------------------------------------------------ rendering


def pf(ok: bool | None) -> str:
    return "—" if ok is None else "PASS" if ok else "FAIL"


def fig(runs: list[dict], f: str) -> str:
    """One figure, or a min-max band over several runs."""
    vals = [r[f] for r in runs]
    fmt = (lambda v: f"{100 * v:.1f}%") if f.startswith("reuse") else (lambda v: f"{v:,.0f}")
    lo, hi = fmt(min(vals)), fmt(max(vals))
    return lo if lo == hi else f"{lo}–{hi}"


def trace_table(cells: list[Cell]) -> list[str]:
    head = ("W", "k", "speedup", "row", "reuse 1st", "TTFT mean", "p99", "wall s", "vs dynamo: reuse pt", "mean x",
            "p99 x", "(D) reuse pt", "(D) mean x", "(D) p99 x", "x rr mean / p99", "checks")  # fmt: skip
    rule = "|" + "|".join("---" if h in ("row", "checks") else "---:" for h in head) + "|"
    out = ["| " + " | ".join(head) + " |", rule]
    for c in cells:
        lead = [str(c.workers), str(c.k), f"{c.speedup:g}"]
        if c.dyn_rr:
            out.append(_row(lead, "Dynamo round_robin", [c.dyn_rr], [""] * 8))
        if c.dyn_kv:
            out.append(_row(lead, f"Dynamo kv_router ×{len(c.dyn_kv)}", c.dyn_kv, [""] * 8))
        for pol in POLICIES:
            out.append(_row(lead, f"kvbridge {pol}", [c.kvb[pol]], _compare_cols(c, pol)))
    return out


def _row(lead: list[str], label: str, runs: list[dict], rest: list[str]) -> str:
    wall = sum(r["wall_s"] for r in runs) / len(runs)
    figs = [fig(runs, "reuse_first_admission"), fig(runs, "ttft_mean"), fig(runs, "ttft_p99"), f"{wall:.2f}"]
    return "| " + " | ".join(lead + [label] + figs + rest) + " |"


def _compare_cols(c: Cell, pol: str) -> list[str]:
    """The 8 comparison columns of a kvbridge row (see LEGEND)."""
    ch = c.checks

    def three(key: tuple[str, str], reuse: str = "{:+.2f}") -> list[str]:
        if key not in c.cmp:
            return ["", "", ""]
        r, m, p = c.cmp[key]
        return [reuse.format(r), f"{m:.3f}", f"{p:.3f}"]

    if pol in ("rr", "dynamo"):
        v = ch.get(f"V {pol}")
        return ["", "", ""] + three((pol, "D")) + ["", f"V {pf(v[0]) if v else '—'}"]
    rr = c.cmp[pol, "rr"]
    marks = []
    for crit in ("mean", "p99", "reuse"):
        got = [ch[n][0] for n in (f"{pol} vs dynamo: {crit}", f"{pol} vs Dynamo kv_router: {crit}") if n in ch]
        if got:
            marks.append(f"{crit} " + "·".join(pf(g) for g in got))
    marks.append(f"rr {pf(ch[f'{pol} vs rr'][0])}")
    return three((pol, "")) + three((pol, "D")) + [f"{rr[1]:.2f} / {rr[2]:.2f}", ", ".join(marks)]


def summary_lines(cells: list[Cell]) -> list[str]:
    """Per criterion: how many cells pass, and which fail (with the figure)."""
    names: list[str] = []
    for c in cells:
        names += [n for n in c.checks if n not in names]
    out = ["| criterion | PASS | FAIL | failing cells |", "|---|---:|---:|---|"]
    for n in names:
        res = [(c, c.checks[n]) for c in cells if n in c.checks]
        fails = [f"{c.name} ({d})" for c, (ok, d) in res if not ok]
        out.append(f"| {n} | {len(res) - len(fails)} | {len(fails)} | {'; '.join(fails)} |")
    return out


def wall_lines(cells: list[Cell]) -> list[str]:
    """kvbridge's wall time over Dynamo's, per policy pair (rr / round_robin, the rest / kv_router's mean)."""
    out = ["| cell | D round_robin s | kvbridge rr s | x | D kv_router s | kvbridge dynamo s | x | kv s | x | "
           "kv-reports s | x |", "|---|" + "---:|" * 10]  # fmt: skip
    for c in cells:
        if not (c.dyn_rr and c.dyn_kv):
            continue
        d_rr, d_kv = c.dyn_rr["wall_s"], sum(r["wall_s"] for r in c.dyn_kv) / len(c.dyn_kv)
        cols = [f"{d_rr:.2f}", f"{c.kvb['rr']['wall_s']:.2f}", f"{c.kvb['rr']['wall_s'] / d_rr:.1f}", f"{d_kv:.2f}"]
        for pol in ("dynamo", "kv", "kv-reports"):
            cols += [f"{c.kvb[pol]['wall_s']:.2f}", f"{c.kvb[pol]['wall_s'] / d_kv:.1f}"]
        out.append(f"| {c.name} | " + " | ".join(cols) + " |")
    return out


def speed_line(cells: list[Cell]) -> str:
    c = next((c for c in cells if (c.trace, c.workers, c.k) == SPEED_CELL), None)
    if c is None or not c.dyn_kv:
        return "Speed (conv 8w k=2, kv / Dynamo kv_router wall <= 3x): not measured in this run."
    d_kv = sum(r["wall_s"] for r in c.dyn_kv) / len(c.dyn_kv)
    parts = [f"{pol} {c.kvb[pol]['wall_s']:.1f} s / {d_kv:.1f} s = {c.kvb[pol]['wall_s'] / d_kv:.1f}x "
             f"{pf(c.kvb[pol]['wall_s'] / d_kv <= SPEED_LIMIT)}" for pol in KV_POLICIES]  # fmt: skip
    return f"**Speed** (conv 8w k=2, kvbridge / Dynamo kv_router wall, <= {SPEED_LIMIT:g}x): " + "; ".join(parts)


# ------------------------------------------------------------------------------------------ main


def kvbridge_dir() -> str:
    import kvbridge

    return str(Path(kvbridge.__file__).parent)


def machine(dynamo: str) -> list[str]:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()

    exe = os.path.relpath(sys.executable)
    dirty = git("status", "--porcelain", "--", "python", "rust", "Cargo.toml", "pyproject.toml")
    commit = git("rev-parse", "HEAD") + (" (+ uncommitted changes under python/ or rust/)" if dirty else "")
    return [
        "```", shlex.join([exe if not exe.startswith("..") else sys.executable, *sys.argv]), "```", "",
        f"- machine: {platform.machine()}, nproc {os.cpu_count()} (usable {len(os.sched_getaffinity(0))}), "
        f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"- Python {platform.python_version()}, kvbridge commit {commit}, imported from {kvbridge_dir()}",
        f"- Dynamo: {dynamo}",
        f"- started {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dynamo-python", help="a python with ai-dynamo-runtime==1.6.1: run Dynamo's replay side by side")
    ap.add_argument("--dynamo-results", type=Path, help="without --dynamo-python: Dynamo's figures from this "
                    "results file (default ../shared/routing/dynamo-replay-results.md beside the repo, "
                    "if it exists)")  # fmt: skip
    ap.add_argument("--traces-dir", type=Path, default=SHARED / "traces", help="where the Mooncake traces are")
    ap.add_argument("--runs", type=int, default=3, help="Dynamo kv_router runs per cell (default 3)")
    ap.add_argument("--cells", help="only these cells: TRACE:WORKERS:K,... (TRACE in conv2k, conv, synth)")
    ap.add_argument("--quick", action="store_true", help="conv2k and synth only")
    ap.add_argument("--seed", type=int, default=0, help="kvbridge's replay seed (default 0)")
    ap.add_argument("--port-seeds", type=int, default=3,
                    help="seeds the Dynamo port is replayed with, for its band (default 3, as --runs)")  # fmt: skip
    ap.add_argument("--json", type=Path, metavar="FILE", help="dump every figure and check here")
    args = ap.parse_args(argv)

    cells = parse_cells(args.cells) if args.cells else grid(args.quick)
    results = None
    if args.dynamo_python:
        source = f"ai-dynamo-runtime {dynamo_version(args.dynamo_python)} run side by side ({args.dynamo_python}), " \
                 f"kv_router {args.runs} runs per cell"  # fmt: skip
    else:
        path = args.dynamo_results or SHARED / "dynamo-replay-results.md"
        if args.dynamo_results or path.exists():
            results = parse_results(path)
            source = f"figures from {path} (one kv_router run per cell; wall times from that run, not side by side)"
        else:
            source = "none (no --dynamo-python, no results file): kvbridge's figures only"
    print("# kvbridge replay against Dynamo's replay (bench/replay.py)\n")
    print("\n".join(machine(source)) + "\n")
    print(LEGEND + "\n")
    started = time.perf_counter()
    loaded: dict[str, tuple[list, float]] = {}  # the current trace: (requests, seconds to parse them)
    for c in cells:
        t0 = time.perf_counter()
        if args.dynamo_python:
            c.dyn_rr = dynamo_runs(args.dynamo_python, args.traces_dir, c, "round_robin", 1)[0]
            c.dyn_kv = dynamo_runs(args.dynamo_python, args.traces_dir, c, "kv_router", args.runs)
        elif results is not None:
            c.dyn_rr = results.get((c.trace, c.workers, c.k, "round_robin"))
            c.dyn_kv = [r for r in [results.get((c.trace, c.workers, c.k, "kv_router"))] if r]
        if c.trace not in loaded:
            loaded = {c.trace: load(args.traces_dir, c.trace)}
        c.kvb = kvbridge_cell(*loaded[c.trace], c, args.seed, args.port_seeds)
        judge(c)
        walls = " ".join(f"{p} {c.kvb[p]['wall_s']:.1f}s" for p in POLICIES)
        print(f"[{time.perf_counter() - started:7.0f}s] {c.name}: {time.perf_counter() - t0:.0f}s (kvbridge {walls})",
              file=sys.stderr, flush=True)  # fmt: skip
    for trace in dict.fromkeys(c.trace for c in cells):
        file, first = TRACES[trace]
        n = f"first {first} requests" if first else "all requests"
        print(f"## {trace}: {file}, {n}\n")
        print("\n".join(trace_table([c for c in cells if c.trace == trace])) + "\n")
    print("## Criteria\n")
    print("\n".join(summary_lines(cells)) + "\n")
    print("## Wall time, kvbridge / Dynamo\n")
    print("\n".join(wall_lines(cells)) + "\n")
    print(speed_line(cells) + "\n")
    print(f"Total {time.perf_counter() - started:.0f} s; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}.")  # fmt: skip
    if args.json:
        dump = [{"trace": c.trace, "workers": c.workers, "k": c.k, "speedup": c.speedup,
                 "dynamo_round_robin": c.dyn_rr, "dynamo_kv_router": c.dyn_kv, "kvbridge": c.kvb, "checks": c.checks,
                 "comparisons": {f"{p} vs {t or 'dynamo'}": v for (p, t), v in c.cmp.items()}}
                for c in cells]  # fmt: skip
        args.json.write_text(json.dumps({"command": sys.argv, "dynamo": source, "cells": dump}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
