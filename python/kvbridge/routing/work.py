"""The work a router has sent each worker, and how long a new prompt would wait there.

A router exists to cut time to first token, so it weighs everything in one unit: milliseconds.
For a prompt of ``L`` tokens of which worker ``w`` holds a prefix, it predicts::

    ttft(w) = T(queued(w) + uncached(w))

* ``uncached(w)``: the prompt's tokens ``w`` must compute. The hit is counted as vLLM counts it:
  at most ``floor((L - 1) / block_size)`` blocks (the last token is always computed for its
  logits: ``vllm/v1/core/kv_cache_manager.py``, ``get_computed_blocks``).
* ``queued(w)``: prompt tokens routed to ``w`` whose first token has not come out yet, less what
  the engine has done of them since: vLLM's scheduler serves running prefills then the waiting
  queue first come first served, so a new prompt's first token waits for all of it. Its first
  token tells the router that it, and what was routed before it, is done.
* ``T(x)``: the time an engine needs for ``x`` prompt tokens, in passes of at most
  ``max_num_batched_tokens`` (:class:`EngineModel`), each pass also running a decode step of the
  worker's active requests (longer as their context fills the KV cache).

The default :class:`EngineModel` is the polynomial one NVIDIA Dynamo 1.6.1's replay uses for a
vLLM engine (``aisimulate-core`` ``engine/common/perf_model.rs``); give a router the engines'
own constants (or measure them: ``kvbridge replay`` reports what a fleet of them does).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

__all__ = ["EngineModel", "Flight", "WorkerWork", "time_costs"]


@dataclass(frozen=True, slots=True)
class EngineModel:
    """How long an engine takes: ``prefill_ms(T) = c0 + c1 T + c2 T^2`` for a pass with ``T``
    new prompt tokens (``prefill``), ``decode_ms(u) = max(1, d0 + d1 u + d2 u^2)`` for a decode
    step at KV-cache use ``u`` (``decode``), at most ``max_num_batched_tokens`` tokens a pass,
    ``kv_capacity_tokens`` tokens of KV cache per worker (None: unknown, then the decode step
    costs ``decode_ms(0)``). Defaults: Dynamo 1.6.1's replay model
    of a vLLM engine (16,384 blocks of 64 tokens)."""

    prefill: tuple[float, float, float] = (16.50142, 1.518344e-02, 4.209989e-07)
    decode: tuple[float, float, float] = (5.74, 54.01, -25.74)
    max_num_batched_tokens: int = 8192
    kv_capacity_tokens: int | None = 16384 * 64

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or len(v) != 3 or not all(
                isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in v
            ):
                raise ValueError(f"{name} must be three finite coefficients (c0, c1, c2), got {v!r}")
        b = self.max_num_batched_tokens
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ValueError(f"max_num_batched_tokens must be a positive int, got {b!r}")
        c = self.kv_capacity_tokens
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c <= 0):
            raise ValueError(f"kv_capacity_tokens must be a positive int or None, got {c!r}")

    def prefill_ms(self, tokens: float) -> float:
        """One pass's prefill time for ``tokens`` new prompt tokens (0 for none)."""
        if tokens <= 0:
            return 0.0
        c0, c1, c2 = self.prefill
        return c0 + c1 * tokens + c2 * tokens * tokens

    def decode_ms(self, context_tokens: float) -> float:
        """One decode step's time when the decoding requests hold ``context_tokens``."""
        cap = self.kv_capacity_tokens
        u = min(1.0, context_tokens / cap) if cap else 0.0
        d0, d1, d2 = self.decode
        return max(1.0, d0 + d1 * u + d2 * u * u)

    def prompt_ms(self, tokens: float, step_ms: float) -> float:
        """Time to compute ``tokens`` prompt tokens in full passes and a last partial one, each
        pass also taking ``step_ms`` of decoding."""
        if tokens <= 0:
            return 0.0
        budget = self.max_num_batched_tokens
        if tokens <= budget:
            return self.prefill_ms(tokens) + step_ms
        return tokens / budget * (self.prefill_ms(budget) + step_ms)

    def tokens_per_ms(self, step_ms: float) -> float:
        """Prompt tokens a busy engine computes per ms (full passes)."""
        budget = self.max_num_batched_tokens
        return budget / (self.prefill_ms(budget) + step_ms)


class Flight:
    """A request a router sent a worker: its prompt length, the tokens it was expected to
    compute, when it was sent (clock seconds), the decision's id and (once seen) when its first
    token came."""

    __slots__ = ("prompt", "uncached", "sent", "id", "first_token")

    def __init__(self, prompt: int, uncached: float, sent: float, id: int = 0) -> None:
        self.prompt = prompt
        self.uncached = uncached
        self.sent = sent
        self.id = id
        self.first_token: float | None = None


class WorkerWork:
    """One worker's requests in flight, oldest first, and its queued prompt work.

    ``queued`` is kept as an estimate anchored at the last event: a routing adds the prompt's
    uncached tokens, time drains it at the engine's speed, a first token resets it to what
    the requests still waiting for theirs were expected to compute."""

    __slots__ = ("flights", "decoding", "_queued", "_anchor")

    def __init__(self) -> None:
        self.flights: OrderedDict[Hashable, Flight] = OrderedDict()
        #: Prompt tokens of the requests past their first token: what their KV cache holds
        #: (output left out: a few hundred tokens against prompts of thousands).
        self.decoding = 0
        self._queued = 0.0
        self._anchor = 0.0

    def __len__(self) -> int:
        return len(self.flights)

    def queued(self, now: float, rate: float) -> float:
        """Prompt tokens still to compute before a prompt routed now, ``rate`` tokens per
        second of draining since the last event."""
        q = self._queued
        if q > 0 and now > self._anchor:
            q -= (now - self._anchor) * rate
            if q < 0:
                q = 0.0
        return q

    def add(self, key: Hashable, flight: Flight, now: float, rate: float) -> None:
        self._queued = self.queued(now, rate) + flight.uncached
        self._anchor = now
        self.flights[key] = flight

    def first_token(self, key: Hashable | None, now: float) -> Flight | None:
        """The request ``key`` (None: the oldest without one) has its first token: it and
        everything routed before it are through the queue."""
        flight = self._waiting_flight(key)
        if flight is None:
            return None
        flight.first_token = now
        self.decoding += flight.prompt
        self._requeue(now)
        return flight

    def done(self, key: Hashable | None, now: float) -> Flight:
        """The request ``key`` (None: the oldest) ended; KeyError if unknown."""
        if key is None:
            key = next(iter(self.flights))
        flight = self.flights.pop(key)
        if flight.first_token is not None:
            self.decoding -= flight.prompt
        else:  # ended without a first token seen (an error, a cancel)
            self._requeue(now)
        return flight

    def _requeue(self, now: float) -> None:
        """What is queued, exactly as sent, from a signal at ``now`` on."""
        self._queued = sum(f.uncached for f in self._still_waiting())
        self._anchor = now

    def _still_waiting(self) -> Iterator[Flight]:
        return (f for f in self.flights.values() if f.first_token is None)

    def _waiting_flight(self, key: Hashable | None) -> Flight | None:
        if key is not None:
            flight = self.flights.get(key)
            return flight if flight is not None and flight.first_token is None else None
        return next(self._still_waiting(), None)


def time_costs(
    engine: EngineModel,
    works: Mapping[str, WorkerWork],
    held: Mapping[str, float],
    candidates: Sequence[str],
    num_tokens: int,
    block_size: int,
    *,
    weight: float = 1.0,
    backlog_weight: float = 0.0,
    now: float,
    reports: Callable[[str], Any] | None = None,
    uncached: dict[str, float] | None = None,
) -> dict[str, float]:
    """``{worker: predicted ms to first token}`` for a prompt of ``num_tokens`` of which each
    candidate holds ``held[w]`` leading blocks (the module doc's cost). ``works``: what each
    worker was sent; ``reports``: ``worker -> LoadReport | None``; ``uncached``: filled with
    each candidate's uncached tokens."""
    # vLLM computes the last token for its logits: a hit stops one token short of the prompt.
    cap = (num_tokens - 1) // block_size if num_tokens else 0
    capacity = engine.kv_capacity_tokens
    if uncached is None:
        uncached = {}
    uncached.clear()
    rows = []
    idle: list[str] = []  # nothing cached, nothing sent, nothing reported running: one cost
    for w in candidates:
        h = held.get(w, 0.0)
        work = works.get(w)
        report = reports(w) if reports is not None else None
        if not h and work is None and (report is None or not report.running):
            idle.append(w)
            continue
        todo = num_tokens - (h if h < cap else cap) * block_size
        uncached[w] = todo
        # The decode step's context: the prompts of the requests decoding there, or the KV cache
        # the engine reports in use while it says requests are running.
        decoding = 0.0 if work is None else float(work.decoding)
        if report is not None and capacity and report.running:
            decoding = max(decoding, report.kv_cache_usage * capacity)
        step = engine.decode_ms(decoding) if decoding else 0.0
        queued = 0.0 if work is None else work.queued(now, engine.tokens_per_ms(step) * 1000.0)
        rows.append((w, todo, queued, step))
    # When every worker has a backlog, a token of prefill added anywhere also delays the requests
    # that will queue behind it there: the prompt's own work weighs more, by the candidates'
    # shortest backlog in passes.
    if not idle:
        backlog = min((r[2] for r in rows), default=0.0) / engine.max_num_batched_tokens
        weight *= 1.0 + backlog_weight * backlog
    costs = {}
    for w, todo, queued, step in rows:
        costs[w] = engine.prompt_ms(queued + weight * todo, step)
    if idle:
        c = engine.prompt_ms(weight * num_tokens, 0.0)
        for w in idle:
            costs[w] = c
            uncached[w] = num_tokens
    return costs
