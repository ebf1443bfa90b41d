"""What was tried to lower kv's TTFT mean at k = 1 (issue 30), each a policy over kvbridge's
replay beside kv and the Dynamo port in the same run: bench/RESULTS.md "Routing by time",
"Reading the figures", quotes this script's output.

    python bench/routing_experiments.py                        # conv2k 4w k=1, synth 4w k=1
    python bench/routing_experiments.py --cells conv:4:1,conv2k:8:4 --variants kv,ext-signals
    python bench/routing_experiments.py --variants ext-signals --seeds 4

Variants (none is a production policy; the oracles read the simulated engines' state):

* ``kv``: kvbridge.Router with the proxy's defaults (the replay's own ``kv``).
* ``oracle``: the router's formula fed each engine's exact state: its waiting prompts' uncached
  tokens now, the pass in progress, the decode context.
* ``oracle-ext``: ``oracle`` plus the delay a prompt adds to the requests that get their first
  token at the end of the pass it joins (``m * (T(r + add) - T(r))``).
* ``ext-signals``: kv's cost plus that delay weighed from the router's own signals (what it sent
  and has not seen a first token of, its queue drained at its rate).
* ``size-interval``: prompts longer than ``--long`` tokens go only to the first W - 1 workers.
* ``home``: each prompt family (its first distinct 512-token block: the second for the
  conversation trace, whose first is shared by all) has a home worker, kept when its predicted
  TTFT is within ``--slack`` of the best (``home-always``: kept whatever it costs).
* ``evict``: among workers within 0-25% of the best predicted TTFT, the one whose free queue's
  head (the blocks the prompt would evict) holds the fewest prompt blocks (stop 34).
* ``blocks-x4``: kv on workers with 4x the KV blocks (where reuse would go with more memory).

``--seeds N`` repeats each variant with tie-break seeds 0..N-1 (the spread of kv itself).
Prints a Markdown table: reuse, TTFT mean / p99 in simulated ms, the mean against the Dynamo
port, and "own prefill": the mean of each request's uncached prompt computed alone (no queue, no
pass in progress, no decode step), what the TTFT mean would be if nothing ever waited; under each
cell the issue's target, 0.85x the port's mean.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import zlib
from pathlib import Path
from typing import Any

from kvbridge.replay.engine import EngineConfig
from kvbridge.replay.fleet import FleetConfig, simulate
from kvbridge.replay.policies import DynamoDefault, KvRouterPolicy
from kvbridge.replay.report import summarize
from kvbridge.replay.trace import load_trace

TRACES_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "routing" / "traces"
TRACES = {"conv2k": ("conversation_trace.jsonl", 2000), "conv": ("conversation_trace.jsonl", None),
          "synth": ("synthetic_trace.jsonl", None)}  # fmt: skip
VARIANTS = ("kv", "oracle", "oracle-ext", "ext-signals", "size-interval", "home", "home-always", "evict", "blocks-x4")


class Experiment(KvRouterPolicy):
    """kv, with the pick made by ``pick(seq, tokens) -> worker name`` (None: kv's own choice)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.rng = random.Random(seed)

    def attach(self, fleet: Any) -> None:
        super().attach(fleet)
        self.model = fleet.config.engine.model()

    def pick(self, seq: Any, tokens: Any) -> str | None:
        return None

    def route(self, seq: Any) -> int:
        tokens = seq.prompt()
        name = self.pick(seq, tokens)
        worker, _ = self.router.choose(tokens, request_id=seq.id, workers=None if name is None else [name])
        return self._by_name[worker]

    def argmin(self, costs: dict[str, float]) -> str:
        items = list(costs.items())
        self.rng.shuffle(items)  # ties by the seed
        return min(items, key=lambda kv: kv[1])[0]

    def todo(self, tokens: Any, held: int) -> int:
        bs = self.block_size
        return len(tokens) - min(held, (len(tokens) - 1) // bs) * bs


class Oracle(Experiment):
    """The router's formula on each engine's exact state; ``ext``: plus the delay to its pass."""

    def __init__(self, seed: int, ext: float = 0.0) -> None:
        super().__init__(seed)
        self.ext = ext

    def attach(self, fleet: Any) -> None:
        super().attach(fleet)
        self.started: dict[int, tuple[float, float]] = {}
        for e in fleet.engines:
            start = e.start_pass

            def timed(e: Any = e, start: Any = start) -> float:
                d = start()
                self.started[e.index] = (fleet.now, d)
                return d

            e.start_pass = timed

    def pending(self, e: Any) -> list[int]:
        """Uncached prompt tokens still to compute on ``e``, first come first served."""
        out = []
        if e.running and e.running[-1].target > e.running[-1].computed:
            out.append(e.running[-1].target - e.running[-1].computed)
        for s in e.waiting:
            t = e._prompt(s)
            out.append(self.todo(t, e.pool.hit_blocks(t)))
        return out

    def pick(self, seq: Any, tokens: Any) -> str | None:
        costs = {}
        for e in self.fleet.engines:
            now = self.fleet.now
            rest = 0.0
            if e.busy:
                t0, d = self.started[e.index]
                rest = max(0.0, t0 + d - now)
            pending = self.pending(e)
            todo = self.todo(tokens, e.pool.hit_blocks(tokens))
            step = self.model.decode_ms(e._context_base + e._decoders * e.tick) if e._decoders else 0.0
            cost = rest + self.model.prompt_ms(sum(pending) + todo, step)
            if self.ext:
                cost += self.ext * pass_delay(self.model, e.config.max_num_batched_tokens - e._decoders, pending, todo)
            costs[self.names[e.index]] = cost
        return self.argmin(costs)


def pass_delay(model: Any, budget: int, pending: list[float], todo: float) -> float:
    """The delay ``todo`` more prompt tokens add to the requests whose first token comes at the
    end of the last pass of ``pending`` (first come first served, ``budget`` tokens a pass)."""
    r, m = 0.0, 0
    for p in pending:
        while p > 0:
            take = min(budget - r, p)
            r, p = r + take, p - take
            if r == budget and p > 0:
                r, m = 0.0, 0
        m += 1
        if r == budget:
            r, m = 0.0, 0
    if not r:
        return 0.0
    return m * (model.prefill_ms(r + min(todo, budget - r)) - model.prefill_ms(r))


class ExtSignals(Experiment):
    """kv's cost plus the pass delay from what the router knows: the requests it sent and has
    not seen a first token of (uncached tokens when sent), its queue drained at its rate."""

    def attach(self, fleet: Any) -> None:
        super().attach(fleet)
        n = len(fleet.engines)
        self.budget = fleet.config.engine.max_num_batched_tokens
        self.sent: list[dict[int, int]] = [{} for _ in range(n)]
        self.queue = [(0.0, 0.0)] * n  # (tokens, at ms)
        self.rate = self.model.tokens_per_ms(self.model.decode_ms(0.0))

    def queued(self, w: int) -> float:
        q, at = self.queue[w]
        return max(0.0, q - (self.fleet.now - at) * self.rate)

    def pick(self, seq: Any, tokens: Any) -> str | None:
        costs = self.router.costs(tokens)
        held = self.index.find_matches(tokens)
        for name in costs:
            w = self._by_name[name]
            q = self.queued(w)
            if q > 0 and self.sent[w]:
                r = q % self.budget
                m, acc = 0, 0.0
                for u in reversed(self.sent[w].values()):  # those ending in the tail pass
                    m, acc = m + 1, acc + u
                    if acc >= r:
                        break
                add = min(self.todo(tokens, held.get(name, 0)), self.budget - r)
                costs[name] += m * (self.model.prefill_ms(r + add) - self.model.prefill_ms(r))
        name = self.argmin(costs)
        w = self._by_name[name]
        todo = self.todo(tokens, held.get(name, 0))
        self.queue[w] = (self.queued(w) + todo, self.fleet.now)
        self.sent[w][seq.id] = todo
        return name

    def _out(self, seq: Any) -> None:
        w = seq.worker
        if self.sent[w].pop(seq.id, None) is not None:
            self.queue[w] = (float(sum(self.sent[w].values())), self.fleet.now)

    def first_token(self, seq: Any) -> None:
        super().first_token(seq)
        self._out(seq)

    def finished(self, seq: Any) -> None:
        super().finished(seq)
        self._out(seq)


class SizeInterval(Experiment):
    def __init__(self, seed: int, long: int) -> None:
        super().__init__(seed)
        self.long = long

    def pick(self, seq: Any, tokens: Any) -> str | None:
        if len(tokens) <= self.long:
            return None
        return self.argmin(self.router.costs(tokens, workers=self.names[:-1]))


class Home(Experiment):
    def __init__(self, seed: int, block: int, slack: float) -> None:
        super().__init__(seed)
        self.block, self.slack = block, slack

    def pick(self, seq: Any, tokens: Any) -> str | None:
        family = tokens[512 * self.block : 512 * (self.block + 1)]
        if len(family) < 512:
            return None
        home = self.names[zlib.crc32(bytes(family)) % len(self.names)]
        costs = self.router.costs(tokens)
        return home if costs[home] <= min(costs.values()) * (1 + self.slack) else None


class Evict(Experiment):
    """Stop 34's oracle: the engines' free queues say which blocks a prompt would evict."""

    def __init__(self, seed: int, rel: float) -> None:
        super().__init__(seed)
        self.rel = rel

    def attach(self, fleet: Any) -> None:
        super().attach(fleet)
        self.prompt_blocks: list[set[int]] = [set() for _ in fleet.engines]
        self.ids: dict[int, list[int]] = {}

    def pick(self, seq: Any, tokens: Any) -> str | None:
        costs = self.router.costs(tokens)
        best = min(costs.values())
        near = [w for w, c in costs.items() if c <= best * (1 + self.rel)]
        if len(near) < 2:
            return None
        held = self.index.find_matches(tokens)

        def harm(name: str) -> int:
            i = self._by_name[name]
            need = max(0, len(tokens) // self.block_size - held.get(name, 0))
            return sum(b in self.prompt_blocks[i] for b in self.fleet.engines[i].pool.free_block_ids()[:need])

        return min(near, key=lambda n: (harm(n), costs[n]))

    def first_token(self, seq: Any) -> None:
        super().first_token(seq)
        try:
            ids = self.fleet.engines[seq.worker].pool.get_block_ids(seq.id)
        except KeyError:
            return
        self.ids[seq.id] = ids[: seq.req.input_length // self.block_size]

    def finished(self, seq: Any) -> None:
        super().finished(seq)
        self.prompt_blocks[seq.worker].update(self.ids.pop(seq.id, ()))


def make(variant: str, seed: int, args: argparse.Namespace, trace: str) -> tuple[Any, EngineConfig]:
    engine = EngineConfig()
    if variant == "kv":
        return Experiment(seed), engine
    if variant == "oracle":
        return Oracle(seed), engine
    if variant == "oracle-ext":
        return Oracle(seed, ext=args.ext), engine
    if variant == "ext-signals":
        return ExtSignals(seed), engine
    if variant == "size-interval":
        return SizeInterval(seed, args.long), engine
    if variant in ("home", "home-always"):
        block = 1 if trace.startswith("conv") else 0  # every conversation shares its first block
        return Home(seed, block, float("inf") if variant == "home-always" else args.slack), engine
    if variant == "evict":
        return Evict(seed, args.evict_rel), engine
    if variant == "blocks-x4":
        return Experiment(seed), EngineConfig(num_blocks=4 * engine.num_blocks)
    raise SystemExit(f"--variants: unknown {variant!r}; expected some of {', '.join(VARIANTS)}")


def own_prefill(seqs: Any, fleet: Any) -> float:
    """The mean time of each request's prompt alone (the part its first admission found
    uncached, on an idle engine: no queue, no pass in progress, no decode step): the TTFT it
    would get if the fleet never made it wait. Against the 0.85x target it says how much waiting
    a policy may leave at all."""
    model = fleet.config.engine.model()
    done = [q for q in seqs if q.first_token_ms >= 0]
    return sum(model.prompt_ms(q.req.input_length - max(q.cached_first, 0), 0.0) for q in done) / max(1, len(done))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="conv2k:4:1,synth:4:1", help="TRACE:WORKERS:K,... (TRACE: conv2k, conv, synth)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--seeds", type=int, default=1, help="tie-break seeds per variant (default 1)")
    p.add_argument("--ext", type=float, default=1.0, help="oracle-ext: the weight of the pass delay (default 1)")
    p.add_argument("--long", type=int, default=16000, help="size-interval: longest prompt all workers take")
    p.add_argument("--slack", type=float, default=0.2, help="home: kept within this much of the best TTFT")
    p.add_argument("--evict-rel", type=float, default=0.1, help="evict: workers within this much of the best")
    p.add_argument("--traces-dir", type=Path, default=TRACES_DIR)
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    cells = []
    for part in args.cells.split(","):
        m = re.fullmatch(r"(conv2k|conv|synth):(\d+):(\d+)", part.strip())
        if not m:
            raise SystemExit(f"--cells: {part!r} is not TRACE:WORKERS:K (TRACE: conv2k, conv, synth)")
        cells.append((m.group(1), int(m.group(2)), int(m.group(3))))
    print(f"`python bench/routing_experiments.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print("| cell | variant | seed | reuse 1st | TTFT mean | x port | own prefill | p99 |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    loaded: dict[str, list] = {}
    for trace, workers, k in cells:
        file, first = TRACES[trace]
        requests = loaded.setdefault(trace, load_trace(args.traces_dir / file, limit=first))
        cfg = FleetConfig(workers=workers, arrival_speedup=k * workers / 4)
        seqs, fleet, wall = simulate(requests, DynamoDefault(0), cfg)
        port = summarize("dynamo", seqs, fleet, wall)
        cell = f"{trace} {workers}w k={k}"
        print(f"| {cell} | dynamo port | 0 | {port.reuse_first_admission:.1%} | {port.ttft_mean:.1f} | 1 | "
              f"{own_prefill(seqs, fleet):.1f} | {port.ttft_p99:,.0f} |", flush=True)  # fmt: skip
        for variant in variants:
            for seed in range(args.seeds):
                policy, engine = make(variant, seed, args, trace)
                run = simulate(requests, policy, FleetConfig(workers=workers, engine=engine, arrival_speedup=k * workers / 4))
                s = summarize(variant, *run)
                print(f"| {cell} | {variant} | {seed} | {s.reuse_first_admission:.1%} | {s.ttft_mean:.1f} | "
                      f"{s.ttft_mean / port.ttft_mean:.3f} | {own_prefill(*run[:2]):.1f} | {s.ttft_p99:,.0f} |",
                      flush=True)  # fmt: skip
        print(f"| {cell} | 0.85x the port (the issue's target) | | | {0.85 * port.ttft_mean:.1f} | 0.85 | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
