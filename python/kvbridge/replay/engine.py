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

import heapq
import math
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvbridge._native import KVCacheManager
from kvbridge.replay.trace import Request
from kvbridge.routing.work import EngineModel

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
    of ``capacity_tokens`` (at least 1 ms before ``speedup`` divides it)."""
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
        if self.max_num_seqs > self.max_num_batched_tokens:  # vLLM's SchedulerConfig refuses it too
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every seat decodes a token per pass")  # fmt: skip
        if isinstance(self.speedup, bool) or not isinstance(self.speedup, (int, float)) or not self.speedup > 0 or math.isinf(self.speedup):
            raise ValueError(f"speedup must be a finite number > 0, got {self.speedup!r}")

    def fits(self, input_length: int) -> bool:
        """Whether a prompt of ``input_length`` tokens fits the whole pool: Dynamo's engine
        refuses one that does not (aisimulate-core vllm/policy.rs 260-275)."""
        return -(-input_length // self.block_size) <= self.num_blocks

    def model(self) -> EngineModel:
        """This engine as a router's :class:`~kvbridge.routing.work.EngineModel` knows it."""
        sp = self.speedup
        return EngineModel(
            prefill=(PREFILL_C / sp, PREFILL_B / sp, PREFILL_A / sp),
            decode=(DECODE_C / sp, DECODE_B / sp, DECODE_A / sp),
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_capacity_tokens=self.num_blocks * self.block_size,
        )


class Seq:
    """A request's life in the replay: where it went, what it has computed and generated, when."""

    __slots__ = (
        "req", "id", "worker", "target", "computed", "generated", "appended", "cached_first",
        "cached_best", "admissions", "first_token_ms", "done_ms", "routed_ms", "decision",
        "order", "base", "gen", "tokens", "last_token_ms",
    )

    def __init__(self, req: Request) -> None:
        self.req = req
        self.id = req.index
        self.worker = -1
        self.target = 0  # tokens this admission prefills: the prompt (+ output after a preemption)
        self.computed = 0  # of those, tokens with KV
        self.generated = 0  # output tokens produced (while decoding: the engine's tick - base)
        self.appended = 0  # output tokens handed to the pool (only when a block boundary needs it)
        self.cached_first = -1  # cached tokens at the first admission
        self.cached_best = 0  # the most cached tokens of any admission (Dynamo's reuse counts it)
        self.admissions = 0
        self.first_token_ms = -1.0
        self.done_ms = -1.0
        self.routed_ms = 0.0
        self.decision: Any = None  # what the policy keeps for this request
        self.order = 0  # admission order on its engine: running order
        self.base = 0  # while decoding, generated = engine tick - base
        self.gen = 0  # incarnation: bumps at each preemption, voiding its scheduled decode events
        self.tokens: array | None = None  # from routing to the end of its prefill: its tokens
        self.last_token_ms = -1.0  # set when it stops decoding (preempted)


    def prompt(self) -> array:
        """The prompt's token ids, made once and kept until the prefill is done (the router
        and the engine both read them)."""
        if self.tokens is None:
            self.tokens = self.req.tokens
        return self.tokens


class Engine:
    """One worker: the scheduler and pool of the module doc. The loop calls :meth:`start_pass`
    when the worker is idle and has work, and :meth:`end_pass` at the time it returned.

    Decoding is kept in aggregate, not walked per request per pass: every decoding request gets
    one token per pass (seats never exhaust the budget: ``EngineConfig`` holds ``max_num_seqs <=
    max_num_batched_tokens``, as vLLM's SchedulerConfig does; and a request mid-prefill is
    always last in running order: nobody is admitted behind it until its prompt is done), so
    a decoder's output count is the engine's pass count (``tick``) minus its ``base``, the
    decoders' context ``S`` is ``sum(L - base) + n * tick``, and the passes at which each
    decoder needs its next block or finishes are known in advance (two heaps).
    """

    def __init__(self, index: int, config: EngineConfig, *, events: bool = True, pool: KVCacheManager | None = None) -> None:
        """``pool``: schedule over this manager (e.g. a hybrid one whose events a publisher
        sends) instead of a new one of ``config``'s size (``events``: whether it records them)."""
        self.index = index
        self.config = config
        self.pool = KVCacheManager(config.num_blocks, config.block_size, enable_events=events) if pool is None else pool
        self.capacity_tokens = config.num_blocks * config.block_size
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # admission order
        self.busy = False
        self.tick = 0  # passes completed
        self.passes = 0  # passes started
        self.preemptions = 0
        self.rejected = 0
        self.prefill_tokens = 0  # prompt tokens computed, over the whole replay
        #: (duration ms, tokens) per pass with decode tokens: every decoder's gap is the pass.
        self.itl: list[tuple[float, int]] = []
        self.itl_extra = array("d")  # gaps of requests recomputed after a preemption
        self._orders = 0
        self._decoders = 0
        self._context_base = 0  # sum over decoders of L - base
        self._grow: list[tuple[int, int, int, Seq]] = []  # (tick, order, gen, seq): needs a block
        self._finish: list[tuple[int, int, int, Seq]] = []  # (tick, order, gen, seq): last token
        # The pass in progress: who gets a first token, its decode tokens, its duration.
        self._prefilled: list[Seq] = []
        self._pass_decoders = 0
        self._pass_ms = 0.0
        self._last_end = 0.0  # when the last pass ended

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queued_tokens(self) -> int:
        """Prompt tokens this worker still has to compute: the waiting requests' and the rest of
        the one mid-prefill."""
        q = sum(s.req.input_length + s.generated for s in self.waiting)
        if self.running:
            last = self.running[-1]
            q += last.target - last.computed
        return q

    def enqueue(self, seq: Seq) -> bool:
        """Queues a routed request; False (refused, as Dynamo's engine refuses it) when its
        prompt needs more blocks than the whole pool."""
        if not self.config.fits(seq.req.input_length):
            self.rejected += 1
            return False
        self.waiting.append(seq)
        return True

    @staticmethod
    def _prompt(seq: Seq) -> array:
        """The tokens a (re)admitted request prefills: its prompt, and after a preemption the
        output it had generated (vLLM recomputes both)."""
        if not seq.generated:
            return seq.prompt()
        return seq.req.tokens + array("I", (OUTPUT_TOKEN,)) * seq.generated

    # -- decoders in aggregate -------------------------------------------------------------------

    def _start_decoding(self, seq: Seq) -> None:
        """``seq`` just got a token from its prefill (at the end of pass ``tick``): from the next
        pass on it decodes."""
        seq.base = self.tick - seq.generated
        self._decoders += 1
        self._context_base += seq.req.input_length - seq.base
        left = seq.req.output_length - seq.generated
        heapq.heappush(self._finish, (self.tick + left, seq.order, seq.gen, seq))
        self._schedule_growth(seq)

    def _schedule_growth(self, seq: Seq) -> None:
        # The pass that starts with L + generated = (blocks held) * bs + 1 tokens needs a block.
        bs = self.config.block_size
        held = seq.req.input_length + seq.appended
        tick = seq.base + (held + bs - 1) // bs * bs + 1 - seq.req.input_length
        heapq.heappush(self._grow, (tick, seq.order, seq.gen, seq))

    def _stop_decoding(self, seq: Seq) -> None:
        seq.generated = self.tick - seq.base
        seq.last_token_ms = self._last_end
        self._decoders -= 1
        self._context_base -= seq.req.input_length - seq.base
        seq.gen += 1  # its scheduled growth and finish are void

    def _preempt(self, victim: Seq) -> None:
        if victim.computed >= victim.target:
            self._stop_decoding(victim)
        self.pool.free(victim.id)
        victim.computed = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1

    def _prefill(self, seq: Seq, before: int, chunk: int, sums: list[int]) -> None:
        """``chunk`` tokens of ``seq`` computed from ``before`` on. The timing model counts the
        prompt part only: output recomputed after a preemption takes budget, not time
        (``aisimulate-core`` core.rs 2794-2820)."""
        seq.computed = before + chunk
        L = seq.req.input_length
        lo = before if before < L else L
        hi = seq.computed if seq.computed < L else L
        if hi > lo:
            sums[0] += lo
            sums[1] += hi
            sums[2] += 1
        self.prefill_tokens += chunk

    # -- one pass --------------------------------------------------------------------------------

    def start_next(self, now: float) -> tuple[float | None, list[Seq]]:
        """An idle engine with work starts a pass: ``(its duration in ms, or None if none
        started; the requests refused meanwhile)``. A pass that runs nothing (a request gave way
        to itself: it is admitted again in the next) ends at once; twice nothing means the
        waiting queue's head can never fit this pool (its prompt and output outgrow it, or a
        hybrid pool's groups take blocks each): it is refused, counted in ``rejected``."""
        refused: list[Seq] = []
        stalled = False
        while not self.busy and self.has_work():
            duration = self.start_pass()
            if duration > 0 or self.running:
                return duration, refused
            self.end_pass(now)  # nothing ran: nothing comes out
            if stalled:
                self.rejected += 1
                refused.append(self.waiting.popleft())
            stalled = not stalled
        return None, refused

    def start_pass(self) -> float:
        """Schedules one pass; returns its duration in ms."""
        cfg = self.config
        bs = cfg.block_size
        pool = self.pool
        budget = cfg.max_num_batched_tokens
        running = self.running
        tick = self.tick
        preempted = False
        # 1. Decoders whose next token starts a block get it first (vLLM's allocate_slots, in
        # running order); none free: the last running request is preempted (lifo), maybe itself.
        grow = self._grow
        while grow and grow[0][0] <= tick:
            _, _, gen, seq = heapq.heappop(grow)
            if gen != seq.gen:
                continue
            total = seq.req.input_length + tick - seq.base
            need = total - seq.req.input_length - seq.appended
            while not pool.append(seq.id, array("I", (OUTPUT_TOKEN,)) * need):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.gen == gen:
                seq.appended += need
                self._schedule_growth(seq)
        decoders = self._decoders
        budget -= decoders
        prefilled: list[Seq] = []
        sums = [0, 0, 0]  # over this pass's prompt chunks: tokens before, tokens after, chunks
        # 2. The request mid-prefill, always last in running order, continues: its chunk's
        # blocks are allocated now, and if they cannot be it gives way itself (lifo).
        if running and budget > 0:
            seq = running[-1]
            if seq.computed < seq.target:
                chunk = seq.target - seq.computed
                if chunk > budget:
                    chunk = budget
                assert seq.tokens is not None
                if pool.append(seq.id, seq.tokens[seq.computed : seq.computed + chunk]):
                    self._prefill(seq, seq.computed, chunk, sums)
                    budget -= chunk
                    if seq.computed == seq.target:
                        prefilled.append(seq)
                else:
                    running.pop()
                    self._preempt(seq)
                    preempted = True
        # 3. Admissions, first come first served, head-of-line blocking on blocks.
        if not preempted:
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
                seq = waiting[0]
                tokens = self._prompt(seq)
                if not pool.can_allocate(tokens):
                    break  # the whole sequence must fit; everyone behind waits too
                waiting.popleft()
                total = len(tokens)
                cap = (total - 1) // bs * bs
                hit = pool.hit_blocks(tokens) * bs
                cached = hit if hit < cap else cap
                chunk = total - cached
                if chunk > budget:
                    chunk = budget
                # Only the hit and the first chunk take blocks now; later chunks take theirs.
                pool.allocate(seq.id, tokens[: cached + chunk])
                seq.admissions += 1
                if seq.cached_first < 0:
                    seq.cached_first = cached
                if cached > seq.cached_best:
                    seq.cached_best = cached
                seq.appended = seq.generated
                seq.target = total
                seq.tokens = tokens
                self._orders += 1
                seq.order = self._orders
                seq.computed = cached
                self._prefill(seq, cached, chunk, sums)
                budget -= chunk
                running.append(seq)
                if seq.computed == total:
                    prefilled.append(seq)
        prefix_sum, end_sum, n_prefill = sums
        # A request done recomputing after a preemption decodes in this pass's count too.
        context = 0
        for seq in prefilled:
            if seq.generated:
                decoders += 1
                context += seq.req.input_length + seq.generated
        duration = 0.0
        if n_prefill:
            # Dynamo's mean-based T (perf_model.rs: B * (floor(mean isl) - floor(mean prefix))).
            duration = prefill_ms(n_prefill * (end_sum // n_prefill - prefix_sum // n_prefill), cfg.speedup)
        if decoders:
            context += self._context_base + self._decoders * tick
            duration += decode_ms(context, self.capacity_tokens, cfg.speedup)
        self._prefilled = prefilled
        self._pass_decoders = self._decoders
        self._pass_ms = duration
        self.busy = True
        self.passes += 1
        return duration

    def end_pass(self, now: float) -> tuple[list[Seq], list[Seq]]:
        """The pass's tokens come out at ``now``: ``(first tokens, finished)``; the finished
        requests' blocks are released."""
        self.busy = False
        self._last_end = now
        self.tick += 1
        tick = self.tick
        if self._pass_decoders:
            self.itl.append((self._pass_ms, self._pass_decoders))
        first: list[Seq] = []
        finished: list[Seq] = []
        for seq in self._prefilled:
            seq.tokens = None
            seq.generated += 1
            if seq.first_token_ms < 0:
                seq.first_token_ms = now
                first.append(seq)
            else:  # recomputed after a preemption: one gap since its last token
                self.itl_extra.append(now - seq.last_token_ms)
            if seq.generated >= seq.req.output_length:
                finished.append(seq)
            else:
                self._start_decoding(seq)
        fin = self._finish
        while fin and fin[0][0] <= tick:
            _, _, gen, seq = heapq.heappop(fin)
            if gen == seq.gen:
                self._stop_decoding(seq)
                finished.append(seq)
        if finished:
            done = set(map(id, finished))
            self.running = [s for s in self.running if id(s) not in done]
            for seq in finished:
                seq.done_ms = now
                self.pool.free(seq.id)
        self._prefilled = []
        return first, finished
