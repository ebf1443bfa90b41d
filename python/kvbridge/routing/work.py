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
  token takes its prompt out: the queue is reset to the uncached prompt tokens of the requests
  still waiting for theirs.
* ``T(x)``: the time an engine needs for ``x`` prompt tokens, in passes of at most
  ``max_num_batched_tokens`` (:class:`EngineModel`), each pass also running a decode step of the
  worker's active requests (longer as their context fills the KV cache).

The default :class:`EngineModel` is the polynomial one NVIDIA Dynamo 1.6.1's replay uses for a
vLLM engine (``aisimulate-core`` ``engine/common/perf_model.rs``); give a router the engines'
own constants (or measure them: ``kvbridge replay`` reports what a fleet of them does).

The router's accounting (each worker's requests in flight, its queued work, the cost per
candidate) runs in its native core (rust/route/work.rs), one call a decision; the formulas there
are :class:`EngineModel`'s, evaluated in the same order (tests/test_router_native.py holds them
equal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["EngineModel", "hit_tokens"]


def hit_tokens(tokens: Any, block_size: int) -> Any:
    """The part of a prompt vLLM looks for a hit in: its full blocks, a token short of the
    prompt (``get_computed_blocks``: ``max_cache_hit_length = num_tokens - 1``). A hybrid
    worker's window rule must hold at that length, so an index is asked about this part, not
    the whole prompt (rust/route/work.rs ``hit_cap`` is the same rule)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    n = len(tokens)
    return tokens[: (n - 1) // block_size * block_size] if n else tokens


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
        """One decode step's time when the decoding requests hold ``context_tokens``:
        ``max(1, d0 + d1 u + d2 u^2)``, ``u = min(1, context_tokens / kv_capacity_tokens)`` (0
        when the capacity is unknown)."""
        cap = self.kv_capacity_tokens
        u = min(1.0, context_tokens / cap) if cap else 0.0
        d0, d1, d2 = self.decode
        return max(1.0, d0 + d1 * u + d2 * u * u)

    def prompt_ms(self, tokens: float, step_ms: float) -> float:
        """Time to compute ``tokens`` prompt tokens, each pass also taking ``step_ms`` of decoding:
        one pass when they fit the budget, else ``tokens / budget`` full passes' time (the last,
        partial pass prorated)."""
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
