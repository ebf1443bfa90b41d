"""Routing policies a replay compares, each fed only what it would get in production.

* ``rr``: worker ``i mod W`` in arrival order (Dynamo's ``round_robin``).
* ``random``: a seeded uniform pick.
* ``kv``: :class:`kvbridge.Router` with the defaults ``kvbridge proxy`` uses, over a
  :class:`kvbridge.Index` fed the engines' KV event payloads; its loads are the router's own
  in-flight accounting (``loads="flight"``) or the workers' LoadReports plus what was routed since
  (``loads="reports"``, the proxy's mode).
* ``dynamo``: a port of Dynamo 1.6.1's default KV router (``dynamo-custom-policy-builtin``
  ``DefaultScorer::score_worker``, scorer.rs 165-228, and the state of ``dynamo-kv-router``'s
  ``ActiveSequencesMultiWorker``; ``dynamo-replay-model.md`` section 5): per worker the prompt
  blocks of its active requests (refcounted) and the uncached prompt tokens of those not yet
  through their first token, ``cost = max(0, (active_prefill + ISL) / bs - overlap) +
  active_blocks + n - active_overlap``, the minimum winning, exact ties broken at random (seeded here).
"""

from __future__ import annotations

import random
from typing import Any

from kvbridge._native import Index
from kvbridge.replay.engine import Seq
from kvbridge.routing.router import Router
from kvbridge.wire.hashing import hash_blocks

__all__ = ["POLICIES", "make_policy"]


class Policy:
    """The callbacks the replay loop makes. ``needs_events``: the policy reads KV events (the
    engines then record them); ``needs_reports``: it reads load reports."""

    name = "?"
    needs_events = False
    needs_reports = False

    def attach(self, fleet: Any) -> None:
        self.fleet = fleet
        self.names = fleet.names

    def route(self, seq: Seq) -> int:
        raise NotImplementedError

    def events(self, worker: int, payload: bytes) -> None:
        pass

    def first_token(self, seq: Seq) -> None:
        pass

    def finished(self, seq: Seq) -> None:
        pass

    def load_report(self, worker: int, report: Any) -> None:
        pass


class RoundRobin(Policy):
    name = "rr"

    def attach(self, fleet: Any) -> None:
        super().attach(fleet)
        self._next = 0

    def route(self, seq: Seq) -> int:
        w = self._next
        self._next = (w + 1) % len(self.names)
        return w


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, seq: Seq) -> int:
        return self._rng.randrange(len(self.names))


class _Indexed(Policy):
    """A policy that keeps a :class:`kvbridge.Index` from the engines' KV event payloads."""

    needs_events = True

    def attach(self, fleet: Any) -> None:
        super().attach(fleet)
        self.block_size = fleet.config.engine.block_size
        self.index = Index(self.block_size)
        self._by_name = {n: i for i, n in enumerate(self.names)}

    def events(self, worker: int, payload: bytes) -> None:
        self.index.apply(self.names[worker], payload)


class KvRouterPolicy(_Indexed):
    """:class:`kvbridge.Router` with its defaults (as ``kvbridge proxy`` builds it), told the
    engines' model, on the replay's virtual clock."""

    name = "kv"

    def __init__(self, seed: int = 0, loads: str = "flight") -> None:
        if loads not in ("flight", "reports"):
            raise ValueError(f"loads must be 'flight' or 'reports', got {loads!r}")
        self.seed = seed
        self.needs_reports = loads == "reports"
        if loads == "reports":
            self.name = "kv-reports"

    def attach(self, fleet: Any) -> None:
        super().attach(fleet)
        engine = fleet.config.engine.model()
        self._reports: dict[str, Any] = {}
        self.router = Router(
            self.index, block_size=self.block_size, seed=self.seed, workers=self.names, engine=engine,
            reports=self._reports.get if self.needs_reports else None, clock=lambda: fleet.now / 1000.0,
        )

    def route(self, seq: Seq) -> int:
        worker, _ = self.router.choose(seq.prompt(), request_id=seq.id)
        return self._by_name[worker]

    def first_token(self, seq: Seq) -> None:
        self.router.first_token(self.names[seq.worker], seq.id)

    def finished(self, seq: Seq) -> None:
        self.router.done(self.names[seq.worker], seq.id)

    def load_report(self, worker: int, report: Any) -> None:
        self._reports[self.names[worker]] = report


class DynamoDefault(_Indexed):
    """Dynamo 1.6.1's default KV router (module doc)."""

    name = "dynamo"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def attach(self, fleet: Any) -> None:
        super().attach(fleet)
        n = len(self.names)
        self.active: list[dict[int, int]] = [{} for _ in range(n)]  # block key -> requests
        self.prefill = [0] * n  # active prefill tokens
        self.blocks = [0] * n  # distinct active prompt blocks

    def costs(self, seq: Seq) -> tuple[list[float], list[int], list[int]]:
        """Per worker: Dynamo's cost for ``seq``, its overlap in blocks; and the prompt's block
        keys (scorer.rs 215-224: ``max(0, (active_prefill + ISL) / bs - overlap) + active_blocks
        + n - active_overlap``)."""
        bs = self.block_size
        tokens = seq.prompt()
        isl = len(tokens)
        keys = hash_blocks(tokens, bs, algo="xxh3")
        n = len(keys)
        by_name = self._by_name
        over = [0] * len(self.names)
        for name, v in self.index.find_matches(tokens).items():
            over[by_name[name]] = v
        costs = []
        for w, active in enumerate(self.active):
            shared = 0  # active_overlap: leading blocks shared with requests active here
            if active:
                for k in keys:
                    if k not in active:
                        break
                    shared += 1
            prefill = (self.prefill[w] + isl) / bs - over[w]
            costs.append((prefill if prefill > 0 else 0.0) + self.blocks[w] + n - shared)
        return costs, over, keys

    def route(self, seq: Seq) -> int:
        costs, over, keys = self.costs(seq)
        best = min(costs)
        tied = [w for w, c in enumerate(costs) if c == best]
        w = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        # The prefill load hint: ISL less the chosen worker's overlap in tokens (mod.rs 1199-1233).
        hint = seq.req.input_length - round(self.block_size * over[w])
        seq.decision = (keys, hint)
        self.prefill[w] += hint
        active = self.active[w]
        for k in keys:
            c = active.get(k)
            if c is None:
                active[k] = 1
                self.blocks[w] += 1
            else:
                active[k] = c + 1
        return w

    def first_token(self, seq: Seq) -> None:
        self.prefill[seq.worker] -= seq.decision[1]

    def finished(self, seq: Seq) -> None:
        w = seq.worker
        keys, hint = seq.decision
        if seq.first_token_ms < 0:  # refused by the engine: it never had a first token
            self.prefill[w] -= hint
        active = self.active[w]
        for k in keys:
            c = active[k]
            if c == 1:
                del active[k]
                self.blocks[w] -= 1
            else:
                active[k] = c - 1


POLICIES = ("kv", "kv-reports", "dynamo", "rr", "random")


def make_policy(name: str, *, seed: int = 0) -> Policy:
    """A fresh policy by name (one per replay: they keep state)."""
    if name == "rr":
        return RoundRobin()
    if name == "random":
        return RandomPolicy(seed)
    if name == "dynamo":
        return DynamoDefault(seed)
    if name == "kv":
        return KvRouterPolicy(seed)
    if name == "kv-reports":
        return KvRouterPolicy(seed, loads="reports")
    raise ValueError(f"unknown policy {name!r}: expected one of {', '.join(POLICIES)}")
