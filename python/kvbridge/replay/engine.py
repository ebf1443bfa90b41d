"""The engine a replay simulates per worker: vLLM's scheduler over a prefix-caching block pool,
timed by Dynamo 1.6.1's polynomial model.

What it follows is Dynamo's offline replay (``aisimulate-core`` 0.13.0, the vLLM backend; section
numbers below are ``shared/routing/dynamo-replay-model.md``'s, which cites file and line), since
that is the reference the replay is validated against; the prefix cache is kvbridge's own
:class:`~kvbridge.KVCacheManager` (vLLM's free-block LRU, tail-first release, eviction on reuse),
whose KV events are what a router hears.

One pass (:meth:`Engine.start_pass`, section 3):

* the token budget is ``max_num_batched_tokens``; running requests go first, in admission order:
  a decoding request takes one token (and a new block when its next token starts one: if none
  is free the *last* running request is preempted, possibly itself, vLLM's ``lifo``); a request
  in chunked prefill takes ``min(what is left of its prompt, budget)``;
* then the waiting queue, first come first served, while seats (``max_num_seqs``) and budget
  remain and nobody was preempted in this pass: the head's cached prefix is looked up (capped at
  ``floor((L - 1) / block_size)`` blocks: vLLM recomputes the last token for its logits), and it
  is admitted only if the pool can hold its whole prompt (the blocks its hit does not already pin),
  else it waits and so does everyone behind it (head-of-line blocking);
* the pass lasts ``prefill_ms(T) + decode_ms(S)`` (section 4): ``T`` the pass's new prompt tokens,
  ``S`` the context of the requests decoding in it; every token of the pass comes out at its end,
  where a request whose prompt is done gets its first token and a finished one releases its
  blocks (tail first, so a chain's suffix is evicted before its prefix).

A preempted request loses its computed tokens (its blocks stay cached, so it usually hits them
again) and goes back to the head of the waiting queue.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvbridge._native import KVCacheManager
from kvbridge.replay.trace import Request

__all__ = ["EngineConfig", "Engine", "Seq", "decode_ms", "prefill_ms"]

# Dynamo 1.6.1's polynomial timing model (aisimulate-core src/engine/common/perf_model.rs,
# polynomial_prefill_time and polynomial_decode_time), in ms.
PREFILL_A, PREFILL_B, PREFILL_C = 4.209989e-07, 1.518344e-02, 16.50142
DECODE_A, DECODE_B, DECODE_C = -25.74, 54.01, 5.74

#: The token id generated tokens carry: their blocks are chained after a request's own prompt,
#: so they never match another request's blocks.
OUTPUT_TOKEN = 0x7FFFFFFF


def prefill_ms(new_tokens: int, speedup: float = 1.0) -> float:
    """A pass's prefill time for ``new_tokens`` prompt tokens (0 for none)."""
    if new_tokens <= 0:
        return 0.0
    return (PREFILL_A * new_tokens * new_tokens + PREFILL_B * new_tokens + PREFILL_C) / speedup


def decode_ms(context_tokens: int, capacity_tokens: int, speedup: float = 1.0) -> float:
    """A pass's decode time when its decoding requests hold ``context_tokens`` tokens of a pool
    of ``capacity_tokens`` (at least 1 ms)."""
    u = min(1.0, context_tokens / capacity_tokens)
    return max(1.0, DECODE_A * u * u + DECODE_B * u + DECODE_C) / speedup


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One worker's engine: ``num_blocks`` of ``block_size`` tokens (Dynamo's replay defaults:
    16,384 of 64), ``max_num_batched_tokens`` per pass, ``max_num_seqs`` seats, and the timing
    model's ``speedup`` (divides both polynomials)."""

    num_blocks: int = 16384
    block_size: int = 64
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    speedup: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if isinstance(self.speedup, bool) or not isinstance(self.speedup, (int, float)) or not self.speedup > 0 or math.isinf(self.speedup):
            raise ValueError(f"speedup must be a finite number > 0, got {self.speedup!r}")


class Seq:
    """A request's life in the replay: where it went, what it has computed and generated, when."""

    __slots__ = (
        "req", "id", "worker", "target", "computed", "generated", "appended", "cached_first", "cached_total",
        "admissions", "first_token_ms", "done_ms", "last_token_ms", "routed_ms", "decision",
    )

    def __init__(self, req: Request) -> None:
        self.req = req
        self.id = req.index
        self.worker = -1
        self.target = 0  # tokens this admission prefills: the prompt (+ output after a preemption)
        self.computed = 0  # of those, tokens with KV
        self.generated = 0  # output tokens produced
        self.appended = 0  # output tokens handed to the pool (only when a block boundary needs it)
        self.cached_first = -1  # cached tokens at the first admission
        self.cached_total = 0  # cached tokens summed over admissions
        self.admissions = 0
        self.first_token_ms = -1.0
        self.done_ms = -1.0
        self.last_token_ms = -1.0
        self.routed_ms = 0.0
        self.decision: Any = None  # what the policy keeps for this request


class Engine:
    """One worker: the scheduler and pool of the module doc. The loop calls :meth:`start_pass`
    when the worker is idle and has work, and :meth:`end_pass` at the time it returned."""

    def __init__(self, index: int, config: EngineConfig, *, events: bool = True) -> None:
        self.index = index
        self.config = config
        self.pool = KVCacheManager(config.num_blocks, config.block_size, enable_events=events)
        self.capacity_tokens = config.num_blocks * config.block_size
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.busy = False
        self.passes = 0
        self.preemptions = 0
        # The pass in progress: who gets a first token, who decodes, its duration.
        self._prefilled: list[Seq] = []
        self._decoded: list[Seq] = []
        self.prefill_tokens = 0  # prompt tokens computed, over the whole replay
        self.itl = array("d")  # every inter-token gap, ms

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def enqueue(self, seq: Seq) -> None:
        self.waiting.append(seq)

    # -- one pass --------------------------------------------------------------------------------

    def _prompt(self, seq: Seq) -> array:
        """The tokens a (re)admitted request prefills: its prompt, and after a preemption the
        output it had generated (vLLM recomputes both)."""
        tokens = seq.req.tokens
        if seq.generated:
            tokens = tokens + array("I", [OUTPUT_TOKEN]) * seq.generated
        return tokens

    def _preempt(self, victim: Seq) -> None:
        self.pool.free(victim.id)
        victim.computed = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1

    def start_pass(self) -> float:
        """Schedules one pass; returns its duration in ms."""
        cfg = self.config
        bs = cfg.block_size
        pool = self.pool
        budget = cfg.max_num_batched_tokens
        running = self.running
        prefilled: list[Seq] = []
        decoded: list[Seq] = []
        prefix_sum = 0  # sum of tokens computed before this pass, over the prefill requests
        end_sum = 0  # ... and after
        n_prefill = 0
        context = 0
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.computed < seq.target:  # chunked prefill continues
                chunk = seq.target - seq.computed
                if chunk > budget:
                    chunk = budget
                prefix_sum += seq.computed
                seq.computed += chunk
                end_sum += seq.computed
                n_prefill += 1
                budget -= chunk
                if seq.computed == seq.target:
                    prefilled.append(seq)
                i += 1
                continue
            total = seq.req.input_length + seq.generated
            # Decoding: one token; its slot must exist before the step (vLLM allocate_slots).
            # The pool is handed output tokens only when a block boundary needs them.
            held = seq.req.input_length + seq.appended
            if (total + bs - 1) // bs > (held + bs - 1) // bs:
                need = total - held
                victim = None
                while not pool.append(seq.id, array("I", [OUTPUT_TOKEN]) * need):
                    victim = running.pop()  # lifo: the last running request gives way
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if victim is seq:
                    break  # it was the last running request: nothing after it
                seq.appended += need
            context += total
            decoded.append(seq)
            budget -= 1
            i += 1
        if not preempted:
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
                seq = waiting[0]
                tokens = seq.req.tokens if not seq.generated else self._prompt(seq)
                total = len(tokens)
                hit = pool.allocate(seq.id, tokens)
                if hit is None:
                    break  # head-of-line: everyone behind waits too
                waiting.popleft()
                cap = (total - 1) // bs * bs
                cached = hit if hit < cap else cap
                seq.admissions += 1
                if seq.cached_first < 0:
                    seq.cached_first = cached
                seq.cached_total += cached
                seq.appended = seq.generated
                seq.target = total
                chunk = total - cached
                if chunk > budget:
                    chunk = budget
                prefix_sum += cached
                seq.computed = cached + chunk
                end_sum += seq.computed
                n_prefill += 1
                budget -= chunk
                running.append(seq)
                if seq.computed == total:
                    prefilled.append(seq)
        new_tokens = 0
        if n_prefill:
            # Dynamo's mean-based T (perf_model.rs: B * (floor(mean isl) - floor(mean prefix))).
            new_tokens = n_prefill * (end_sum // n_prefill - prefix_sum // n_prefill)
            self.prefill_tokens += end_sum - prefix_sum
        duration = prefill_ms(new_tokens, cfg.speedup)
        if decoded:
            duration += decode_ms(context, self.capacity_tokens, cfg.speedup)
        self._prefilled = prefilled
        self._decoded = decoded
        self.busy = True
        self.passes += 1
        return duration

    def end_pass(self, now: float) -> tuple[list[Seq], list[Seq]]:
        """The pass's tokens come out at ``now``: ``(first tokens, finished)``; the finished
        requests' blocks are released."""
        self.busy = False
        first: list[Seq] = []
        finished: list[Seq] = []
        itl = self.itl
        for seq in self._prefilled:
            seq.generated += 1
            if seq.first_token_ms < 0:
                seq.first_token_ms = now
                first.append(seq)
            else:  # recomputed after a preemption
                itl.append(now - seq.last_token_ms)
            seq.last_token_ms = now
            if seq.generated >= seq.req.output_length:
                finished.append(seq)
        for seq in self._decoded:
            seq.generated += 1
            itl.append(now - seq.last_token_ms)
            seq.last_token_ms = now
            if seq.generated >= seq.req.output_length:
                finished.append(seq)
        if finished:
            done = set(map(id, finished))
            self.running = [s for s in self.running if id(s) not in done]
            for seq in finished:
                seq.done_ms = now
                self.pool.free(seq.id)
        self._prefilled = self._decoded = []
        return first, finished
