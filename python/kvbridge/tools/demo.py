"""The end-to-end demo behind ``kvbridge demo``: everything real, on loopback, judged by time.

A real nats-server and three fleets of simulated engine workers serve the same stream of
multi-turn chats over a few shared system prompts. Each worker is the engine model
``kvbridge.replay`` simulates (:class:`kvbridge.replay.engine.Engine`: vLLM's scheduler -- token
budget, seats, chunked prefill, head-of-line blocking on blocks, preemption -- over the worker's
:class:`KVCacheManager`, each pass timed by Dynamo 1.6.1's polynomial model), and publishes its
pool's KV events through a :class:`KvEventPublisher` at the end of every pass. Simulated time
runs with the wall clock, one simulated millisecond per millisecond, so the events travel over
NATS while the engines run, and a request's time to first token counts its wait in the queue.
Each fleet routes by its own policy:

* KV-aware: :class:`kvbridge.routing.router.Router` with its default cost (the predicted time to
  first token on each worker) over a :class:`kvbridge.Index` built only from the fleet's NATS
  event stream, told each request's first token and end;
* round-robin, and uniformly random.

Mid-run the broker is SIGKILLed and restarted. After the chats come bursts of requests sharing a
new prefix, arriving together (agentic fan-out): the KV-aware router holds each burst's first
choice as provisionally caching the prefix until the worker's events confirm it, and keeps the
burst there while queueing behind it costs less than prefilling the prefix on another worker.
At the end the demo prints, per worker, the requests it served and the prompt tokens it
computed; per policy the hit rate, the time to first token (mean and percentiles) and the
fleet's prompt work; and how the stream fared (events/s, latency, events lost). Every
subscriber's view must equal its worker's pool, block for block, and the index must score like
the pools (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import math
import os
import random
import statistics
import time
import urllib.parse
from dataclasses import dataclass, field

from kvbridge._native import Index
from kvbridge.config import Config
from kvbridge.bus.subscriber import KvEventSubscriber
from kvbridge.bus.update import Update
from kvbridge.replay.engine import OUTPUT_TOKEN, Engine, EngineConfig, Seq
from kvbridge.replay.trace import Request
from kvbridge.wire.hashing import hash_blocks
from kvbridge.engine.pool import KVCacheManager
from kvbridge.bus.publisher import KvEventPublisher
from kvbridge.routing.router import Router
from kvbridge.tools.server import NatsCluster, NatsServer
from kvbridge.wire.residency import Residency

VOCAB = 151_936
MODEL = "demo-model"
POLICIES = ("KV-aware", "round-robin", "random")
#: A burst's shared prefix, in tokens.
BURST_PREFIX = 512
#: Simulated ms between bursts (the first comes this long after the chats end).
BURST_GAP_MS = 200.0
#: After the last arrival, how long (simulated = wall) the run waits for every first token.
FIRST_TOKEN_WAIT_MS = 20_000.0


@dataclass
class _Chat:
    """One conversation: a shared system prompt, then turns that grow the history."""

    tokens: list[int]
    turns_left: int
    ready_ms: float = 0.0  # its user's next message comes no earlier than this


class _Workload:
    """Multi-turn chats over a few shared system prompts, as a chat service sees them. A user
    writes again 1-3 s after their last message, and the new prompt holds the history: every
    earlier message, and the model's replies as the engine's output tokens (so the reply's
    blocks the worker cached are a hit). The same stream goes to every fleet at the same
    times: nothing here depends on where a turn is routed or how fast it is served."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.system_prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(256, 1024))] for _ in range(4)]
        self.chats: list[_Chat] = []

    def next_turn(self, now_ms: float) -> tuple[list[int], int]:
        """The prompt of the turn arriving at ``now_ms`` (simulated) and its reply's length."""
        rng = self.rng
        ready = [c for c in self.chats if c.ready_ms <= now_ms]
        if len(self.chats) < 24 or not ready or rng.random() < 0.15:
            chat = _Chat(list(rng.choice(self.system_prompts)), rng.randrange(3, 10))
            self.chats.append(chat)
        else:
            chat = rng.choice(ready)
        chat.tokens += [rng.randrange(VOCAB) for _ in range(rng.randrange(64, 1024))]  # the user's message
        prompt = list(chat.tokens)
        reply = rng.randrange(32, 256)
        chat.tokens += [OUTPUT_TOKEN] * reply
        chat.turns_left -= 1
        chat.ready_ms = now_ms + rng.uniform(1000.0, 3000.0)
        if chat.turns_left <= 0 or len(chat.tokens) > 16_000:
            self.chats.remove(chat)
        return prompt, reply

    def burst(self, size: int) -> tuple[list[list[int]], int]:
        """``size`` prompts sharing a new prefix (one task fanned out to sub-agents), each with a
        question of its own, and the length of the reply each gets."""
        rng = self.rng
        prefix = [rng.randrange(VOCAB) for _ in range(BURST_PREFIX)]
        prompts = [prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(16, 64))] for _ in range(size)]
        return prompts, 32


@dataclass
class _Worker:
    name: str
    manager: KVCacheManager
    engine: Engine
    publisher: KvEventPublisher
    requests: int = 0


@dataclass
class _Burst:
    """One burst as a fleet served it; for the KV-aware fleet, how each later request was routed."""

    seqs: list[Seq] = field(default_factory=list)
    kept: list[Seq] = field(default_factory=list)  # later requests sent to a worker already given the prefix
    provisional: int = 0  # ... of which the index alone did not know held it yet
    spread: list[Seq] = field(default_factory=list)  # later requests sent to another worker
    predicted: list[tuple[float, float]] = field(default_factory=list)  # per spread one: ms there, on the best holder


class _Outage:
    """From the broker's kill until every subscriber has caught up again (wall clock, as batches
    are stamped)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.end: float | None = None

    def covers(self, ts: float) -> bool:
        return self.start is not None and self.start <= ts and (self.end is None or ts <= self.end)


class _StreamStats:
    """What one fleet's subscriber saw: events delivered, and each message's delay from
    publish() -- apart for messages that waited out the broker outage or came by replay."""

    def __init__(self, outage: _Outage) -> None:
        self.outage = outage
        self.events = 0
        self.live_latency: list[tuple[float, int]] = []  # (seconds, events in the message)
        self.delayed_messages = 0
        self.max_delay = 0.0
        self.resets_after_start = 0
        self.started = False

    def __call__(self, update: Update) -> None:
        if update.reset:
            if self.started:
                self.resets_after_start += 1
            return
        n = update.n_events
        if not self.started or not n:
            return
        self.events += n
        delay = time.time() - update.ts
        if update.source == "live" and not self.outage.covers(update.ts):
            self.live_latency.append((delay, n))
        else:
            self.delayed_messages += 1
            self.max_delay = max(self.max_delay, delay)

    def percentile(self, q: float) -> float:
        """The latency below which a share ``q`` of the live events arrived."""
        if not self.live_latency:
            return float("nan")
        ordered = sorted(self.live_latency)
        total = sum(n for _, n in ordered)
        seen = 0
        for delay, n in ordered:
            seen += n
            if seen >= q * total:
                return delay
        return ordered[-1][0]


class _Fleet:
    """One policy's workers, the subscriber that follows their stream, and the index it feeds.

    Time is simulated, in ms from the start of traffic, and moves forward only through
    :meth:`advance` (a pass ends: its tokens come out and its KV events are published) and
    :meth:`kick` (an idle worker with work starts a pass), in the order the replay's loop keeps
    (:func:`kvbridge.replay.fleet.simulate`): passes ending now first, then the requests arriving
    now, then every idle worker with work starts a pass."""

    def __init__(self, policy: str, args: argparse.Namespace, base: Config, outage: _Outage, config: EngineConfig) -> None:
        self.policy = policy
        self.model = f"{MODEL}-{policy.lower()}"
        self.block_size = args.block_size
        self.workers: list[_Worker] = []
        window = getattr(args, "sliding_window", 0)
        self.groups = [("full_attention", None), ("sliding_window", window)] if window else None
        for i in range(args.workers):
            manager = KVCacheManager(args.num_blocks, args.block_size, groups=self.groups)
            # The replay's engine, scheduling over this worker's own pool (hybrid groups and all),
            # whose events the publisher sends.
            engine = Engine(i, config, pool=manager)
            publisher = KvEventPublisher(base.replace(model=self.model, worker_id=f"worker-{i}"))
            publisher.attach(manager)
            self.workers.append(_Worker(f"worker-{i}", manager, engine, publisher))
        self.index = Index(args.block_size)
        self.stream = _StreamStats(outage)
        # The index is fed straight from the payload bytes; the views are kept to check it against.
        self.subscriber = KvEventSubscriber(
            base.replace(model=self.model), model=self.model, index=self.index, track_views=True, on_update=self.stream
        )
        self.now = 0.0  # simulated ms
        self.router = (
            Router(self.index, workers=[w.name for w in self.workers], engine=config.model(),
                   clock=lambda: self.now / 1000.0)
            if policy == "KV-aware" else None
        )  # fmt: skip
        self.rng = random.Random(args.seed + 1)
        self.ends: list[tuple[float, int]] = []  # (pass end ms, worker)
        self.chats: list[Seq] = []
        self.bursts: list[_Burst] = []
        self.awaiting_first = 0  # requests routed and not through their first token yet
        self.skipped = 0
        self.published_at_start = 0
        self.end_ms = 0.0  # when the run ended (simulated)
        self._requests = 0

    def next_end(self) -> float:
        return self.ends[0][0] if self.ends else math.inf

    def advance(self, now: float) -> None:
        """The passes ending at ``now``: their tokens come out (first tokens and completions go to
        the router), their KV events are published."""
        ends = self.ends
        self.now = now
        while ends and ends[0][0] <= now:
            _, i = heapq.heappop(ends)
            w = self.workers[i]
            with w.publisher.lock:
                first, finished = w.engine.end_pass(now)
            w.publisher.step()
            self.awaiting_first -= len(first)
            if self.router is not None:
                for seq in first:
                    self.router.first_token(w.name, seq.id)
                for seq in finished:
                    self.router.done(w.name, seq.id)

    def kick(self, now: float) -> None:
        """Every idle worker with work starts a pass."""
        for i, w in enumerate(self.workers):
            e = w.engine
            if e.busy or not e.has_work():
                continue
            with w.publisher.lock:
                duration, refused = e.start_next(now)
            if duration is not None:
                heapq.heappush(self.ends, (now + duration, i))
            for seq in refused:  # can never fit in this pool (kvbridge.replay.engine): not served
                self._refuse(w, seq, now)

    def serve(self, now: float, prompt: list[int], output: int, burst: _Burst | None = None) -> Seq:
        """Routes a request arriving at ``now``; it joins the chosen worker's waiting queue."""
        rid = self._requests
        self._requests += 1
        seq = Seq(Request(rid, now, len(prompt), output, prompt, runs=False))
        seq.routed_ms = now
        if self.router is not None:
            later = burst is not None and bool(burst.seqs)  # a burst's prefix already went somewhere
            costs = self.router.costs(prompt) if later else {}  # what choose() weighs, to report it
            name, overlap = self.router.choose(prompt, request_id=rid)
            w = next(w for w in self.workers if w.name == name)
            if later:
                assert burst is not None
                holders = {self.workers[s.worker].name for s in burst.seqs}
                if name in holders:
                    burst.kept.append(seq)
                    held = self.index.find_matches(prompt).get(name, 0)
                    burst.provisional += held < BURST_PREFIX // self.block_size
                else:
                    burst.spread.append(seq)
                    burst.predicted.append((costs[name], min(costs[h] for h in holders)))
            # The overlap the router acted on, capped as the engine caps a hit; checked at admission.
            seq.decision = min(overlap, (len(prompt) - 1) // self.block_size)
        elif self.policy == "round-robin":
            w = self.workers[rid % len(self.workers)]
        else:
            w = self.rng.choice(self.workers)
        seq.worker = w.engine.index
        w.requests += 1
        self.awaiting_first += 1
        (self.chats if burst is None else burst.seqs).append(seq)
        if not w.engine.enqueue(seq):  # more blocks than the whole pool
            self._refuse(w, seq, now)
        return seq

    def _refuse(self, w: _Worker, seq: Seq, now: float) -> None:
        """``seq`` can never fit in ``w``'s pool: it is not served."""
        self.skipped += 1
        if seq.first_token_ms < 0:  # else its first token was counted (it outgrew the pool since)
            self.awaiting_first -= 1
            w.requests -= 1  # the worker's column counts what it served
        seq.done_ms = now  # ended without being served: left out of the TTFT figures
        if self.router is not None:
            self.router.done(w.name, seq.id)

    def cut(self) -> None:
        """The run ends: what is still decoding stops, its blocks go back to the pool."""
        for w in self.workers:
            with w.publisher.lock:
                for seq in w.engine.running:
                    w.manager.free(seq.id)
                w.engine.running.clear()
            w.publisher.step()
        self.ends.clear()

    @property
    def published(self) -> int:
        return sum(w.publisher.stats["events"] for w in self.workers)

    def view_equals_pool(self, w: _Worker) -> bool:
        view = self.subscriber.views.get((self.model, w.name))
        if view is None:
            return False
        if self.groups is None:
            return view.blocks == set(w.manager.pool.cached_block_hashes())
        # Hybrid: every (medium, group)'s blocks and copies, as the pool's own snapshot lists them.
        pool = Residency()
        with w.publisher.lock:
            pool.apply(w.manager.snapshot())
        return view.held == pool.held

    def index_matches_pools(self, prompts: list[list[int]]) -> bool:
        """The index scores these prompts exactly as the pools would: brute force over the cached
        hashes, or, for a hybrid model, each pool's own hit (vLLM's coordinator rule)."""
        if self.groups is not None:
            return all(self.index.find_matches(p) == self._pool_hits(p) for p in prompts)
        pools = {w.name: set(w.manager.pool.cached_block_hashes()) for w in self.workers}
        for prompt in prompts:
            hashes = hash_blocks(prompt, self.block_size)
            expected = {}
            for name, held in pools.items():
                n = 0
                while n < len(hashes) and hashes[n] in held:
                    n += 1
                if n:
                    expected[name] = n
            if self.index.find_matches(prompt) != expected:
                return False
        return True


    def _pool_hits(self, prompt: list[int]) -> dict[str, int]:
        bs = self.block_size
        # The prompt's full blocks and one token more: the pool never counts a prompt's last
        # token as a hit (vLLM recomputes it), the index answers whole blocks held.
        probe = prompt[: len(prompt) // bs * bs] + [0]
        hits = {}
        for w in self.workers:
            with w.publisher.lock:
                n = w.manager.hit_blocks(probe)
            if n:
                hits[w.name] = n
        return hits


def _say(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:5.1f}s] {text}", flush=True)


async def run_demo(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    cluster = getattr(args, "cluster", 0)
    config = EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size)
    with _ClusterBroker(cluster, t0) if cluster else NatsServer() as server:
        _say(t0, f"nats-server started on {server.url} (watch it: kvbridge watch --servers {server.url})")
        base = Config(servers=server.url.split(","), encoding=args.encoding, reconnect_wait_s=0.2)
        outage = _Outage()
        fleets = [_Fleet(policy, args, base, outage, config) for policy in POLICIES]
        if isinstance(server, _ClusterBroker):  # it kills the node holding the KV-aware router's connection
            server.router = fleets[0].subscriber
        for f in fleets:
            await f.subscriber.start()
        try:
            for f in fleets:
                for w in f.workers:
                    await w.publisher.start()
            await _meet(fleets)
            _say(t0, f"{len(fleets)} fleets of {args.workers} simulated engines (vLLM's scheduler, Dynamo's pass "
                     f"times; simulated time = wall time), one per routing policy ({', '.join(POLICIES)}), serve "
                     f"the same chats, {args.turns_per_s:g} turns/s")  # fmt: skip
            workload = _Workload(rng)
            probes, elapsed, behind = await _drive(args, t0, server, fleets, workload, outage)
            _say(t0, "traffic stopped; waiting for every view to equal its pool and the indexes to score like the pools")
            converged = await _converge(fleets, probes, timeout=15.0)
        finally:
            for f in fleets:
                for w in f.workers:
                    await w.publisher.close()
            for f in fleets:
                await f.subscriber.close()
        _report(args, fleets, elapsed, behind, converged)
        if isinstance(server, _ClusterBroker):
            server.report([w for f in fleets for w in f.workers])
    return 0 if converged else 1


async def _meet(fleets: list[_Fleet], timeout: float = 15.0) -> None:
    """Every subscriber knows every worker before traffic starts (so no event is hidden inside a
    first-contact snapshot, and 'events lost' counts them all)."""
    deadline = time.monotonic() + timeout
    while not all(f.subscriber.stats["workers"] == len(f.workers) and f.subscriber.in_sync() for f in fleets):
        if time.monotonic() > deadline:
            raise RuntimeError("the subscribers did not see every worker within 15 s")
        await asyncio.sleep(0.05)
    for f in fleets:
        f.published_at_start = f.published
        f.stream.started = True


async def _drive(
    args: argparse.Namespace, t0: float, server: NatsServer | _ClusterBroker, fleets: list[_Fleet], workload: _Workload,
    outage: _Outage,
) -> tuple[list[list[int]], float, float]:
    """The chats at a steady rate for ``--duration`` s, then the bursts, until every request has
    its first token, in simulated time paced by the wall clock (an event at simulated ms ``t``
    happens ``t`` ms after traffic starts, or as soon as the machine gets to it). Returns the
    prompts to check the indexes with, the wall seconds it took and how many ms the simulation
    fell behind the wall clock at worst."""
    kill_at = None if args.no_kill else args.duration * 0.35
    restart_at = None if kill_at is None else kill_at + 2.0
    next_report = 2.0
    catching_up = False
    turns = 0
    chats_end = args.duration * 1000.0
    bursts = getattr(args, "bursts", 0)
    burst_at = [chats_end + BURST_GAP_MS * (b + 1) for b in range(bursts)]
    last_arrival = burst_at[-1] if burst_at else chats_end
    recent: list[list[int]] = []
    behind = 0.0
    start = yielded = time.monotonic()
    while True:
        wall = time.monotonic()
        elapsed = wall - start
        if kill_at is not None and elapsed >= kill_at:
            outage.start = time.time()
            server.kill()
            kill_at = None
            _say(t0, "broker SIGKILLed -- the workers keep serving; events wait in each publisher's ring buffer")
        if restart_at is not None and kill_at is None and elapsed >= restart_at:
            server.start()
            restart_at = None
            catching_up = True
            _say(t0, "broker restarted on the same port -- publishers re-send what they buffered; a hole left is "
                 "repaired by replay")  # fmt: skip
        if catching_up and _caught_up(fleets):
            outage.end = time.time()
            catching_up = False
            _say(t0, f"caught up: every subscriber in sync, {outage.end - (outage.start or outage.end):.1f} s after the kill")
        if elapsed >= next_report:
            next_report += 2.0
            published = sum(f.published for f in fleets)
            gaps = sum(f.subscriber.stats["gaps"] for f in fleets)
            replays = sum(f.subscriber.stats["replays"] for f in fleets)
            _say(t0, f"{turns} turns served by each fleet, {published:,} block events published, "
                     f"subscribers: gaps={gaps} replays={replays}")
        t_turn = turns * 1000.0 / args.turns_per_s
        if t_turn >= chats_end:
            t_turn = math.inf
        t_arrival = min(t_turn, burst_at[0] if burst_at else math.inf)
        t = min(t_arrival, *(f.next_end() for f in fleets))
        if t_arrival == math.inf and (
            t == math.inf or t > last_arrival + FIRST_TOKEN_WAIT_MS or not any(f.awaiting_first for f in fleets)
        ):
            break
        now = elapsed * 1000.0
        if t > now:
            await asyncio.sleep(min(t - now, 50.0) / 1000.0)
            continue
        behind = max(behind, now - t)
        for f in fleets:
            f.advance(t)
        if t == t_turn:
            prompt, output = workload.next_turn(t)
            turns += 1
            for f in fleets:
                f.serve(t, prompt, output)
            recent.append(prompt)
            del recent[:-32]
        elif t == t_arrival:
            if len(burst_at) == bursts:
                _say(t0, f"{bursts} bursts of {args.burst_size} requests sharing a new prefix, arriving together")
            burst_at.pop(0)
            prompts, output = workload.burst(args.burst_size)
            for f in fleets:
                f.bursts.append(burst := _Burst())
                for p in prompts:
                    f.serve(t, p, output, burst)
        for f in fleets:
            f.kick(t)
        if wall - yielded > 0.005:  # let the publishers and subscribers run
            await asyncio.sleep(0)
            yielded = time.monotonic()
    elapsed = time.monotonic() - start
    if restart_at is not None:  # a very short run: bring the broker back before converging
        server.start()
    if outage.start is not None and outage.end is None:
        outage.end = float("inf")  # the run ended before the catch-up: no latency sample after it counts
    for f in fleets:
        f.end_ms = f.now
        f.cut()
    # what to check the indexes with: the last prompts and every system prompt
    return recent + workload.system_prompts, elapsed, behind


def _caught_up(fleets: list[_Fleet]) -> bool:
    """Nothing waits in a publisher's ring and no subscriber is repairing a hole."""
    return all(
        f.subscriber.in_sync() and all(w.publisher.stats["unsent"] == 0 for w in f.workers) for f in fleets
    )


async def _converge(fleets: list[_Fleet], probes: list[list[int]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(all(f.view_equals_pool(w) for w in f.workers) and f.index_matches_pools(probes) for f in fleets):
            return True
        await asyncio.sleep(0.1)
    return False


def _served(seqs: list[Seq]) -> list[Seq]:
    """The requests a worker took (not those refused as never fitting its pool)."""
    return [s for s in seqs if s.done_ms < 0 or s.first_token_ms >= 0]


def _ttfts(seqs: list[Seq], end_ms: float) -> list[float]:
    """Each served request's time to first token, ms, sorted; one still waiting when the run ended
    counts the time it waited (a lower bound)."""
    return sorted((s.first_token_ms if s.first_token_ms >= 0 else end_ms) - s.routed_ms for s in _served(seqs))


def _mean_ms(values: list[float]) -> str:
    """A mean in ms, or "n/a" when nothing was served (a pool too small for every request)."""
    return f"{statistics.fmean(values):.1f} ms" if values else "n/a"


def _pct(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


def _report(args: argparse.Namespace, fleets: list[_Fleet], elapsed: float, behind: float, converged: bool) -> None:
    print()
    print(f"{'fleet':<12} {'worker':<10} {'requests':>8} {'computed':>10} {'events':>9} {'messages':>9} "
          f"{'cached blocks':>14} {'view == pool':>13}")  # fmt: skip
    for f in fleets:
        for w in f.workers:
            s = w.publisher.stats
            ok = "yes" if f.view_equals_pool(w) else "NO"
            print(f"{f.policy:<12} {w.name:<10} {w.requests:>8} {w.engine.prefill_tokens:>10,} {s['events']:>9,} "
                  f"{s['messages']:>9,} {w.manager.pool.num_cached_blocks:>14,} {ok:>13}")  # fmt: skip
    print("* requests: the turns and burst requests the worker served; computed: the prompt tokens it computed; "
          "events, messages: the block events it published and the NATS messages that carried them; cached blocks: "
          "its pool's at the end; view == pool: the fleet's subscriber sees exactly that pool.")  # fmt: skip
    print()
    print(f"{'routing':<12} {'turns':>6} {'hit rate':>9} {'TTFT ms: mean / p50 / p90 / p99':>32} {'computed':>10}")
    for f in fleets:
        chats = _served(f.chats)
        t = _ttfts(chats, f.end_ms)
        prompt = sum(s.req.input_length for s in chats)
        hit = 100.0 * sum(max(0, s.cached_first) for s in chats) / prompt if prompt else 0.0
        ttft = f"{statistics.fmean(t) if t else math.nan:.1f} / {_pct(t, 0.5):.1f} / {_pct(t, 0.9):.1f} / {_pct(t, 0.99):.1f}"
        computed = sum(w.engine.prefill_tokens for w in f.workers)
        print(f"{f.policy:<12} {len(chats):>6} {hit:>8.1f}% {ttft:>32} {computed:>10,}")
    print("* TTFT: from a turn's arrival to its first token, queueing included, on the simulated engines (the "
          "replay's engine model: vLLM's scheduler over the worker's pool, Dynamo 1.6.1's pass times). hit rate: "
          "prompt tokens found cached when the engine admitted the turn. computed: prompt tokens the fleet's "
          "engines computed, bursts included (per worker above).")  # fmt: skip
    print()
    print(f"{'stream':<12} {'events/s':>9} {'p50 / p99 latency':>18} {'events lost':>12}")
    for f in fleets:
        st = f.stream
        lost = (f.published - f.published_at_start) - st.events
        lat = f"{st.percentile(0.5) * 1e3:.1f} / {st.percentile(0.99) * 1e3:.1f} ms"
        print(f"{f.policy:<12} {st.events / elapsed:>9,.0f} {lat:>18} {lost:>12,}")
    print("* latency: from publish() to the subscriber's index, per event, outside the broker outage and the "
          "catch-up after it; events lost: published minus delivered.")
    kv = fleets[0]
    if kv.bursts:
        def prefilled(f: _Fleet) -> str:
            served = [len({s.worker for s in _served(b.seqs)}) for b in f.bursts]
            return f"{statistics.fmean(served):.1f}"

        def burst_ttft(f: _Fleet) -> str:
            return _mean_ms(_ttfts([s for b in f.bursts for s in b.seqs], f.end_ms))

        print(f"  bursts: {len(kv.bursts)} of {args.burst_size} requests sharing a new {BURST_PREFIX}-token prefix, "
              f"arriving together. Workers that prefilled each prefix, mean: "
              + ", ".join(f"{f.policy} {prefilled(f)}" for f in fleets) + "; TTFT mean: "
              + ", ".join(f"{f.policy} {burst_ttft(f)}" for f in fleets) + ".")  # fmt: skip
        kept = [s for b in kv.bursts for s in b.kept]
        spread = [s for b in kv.bursts for s in b.spread]
        text = (f"  KV-aware kept {len(kept)} of the {len(kept) + len(spread)} later requests of a burst on a worker "
                f"already given its prefix ({sum(b.provisional for b in kv.bursts)} on provisional residency alone: the "
                f"prefix's events had not reached the index yet; TTFT mean {_mean_ms(_ttfts(kept, kv.end_ms))})"
                if kept else "  KV-aware kept no later request of a burst on a worker already given its prefix")  # fmt: skip
        if spread:
            there, holder = (statistics.fmean(x) for x in zip(*(p for b in kv.bursts for p in b.predicted)))
            text += (f" and sent {len(spread)} to another worker, where it predicted their first token sooner than "
                     f"queued behind the burst ({there:.1f} ms against {holder:.1f} ms, mean; measured: "
                     f"{_mean_ms(_ttfts(spread, kv.end_ms))}): there, waiting would have cost more "
                     f"than prefilling the prefix again")  # fmt: skip
        print(text + ".")
    if kv_chats := _served(kv.chats):
        bs = kv.block_size
        right = sum(1 for s in kv_chats if s.cached_first >= 0 and s.cached_first // bs == s.decision)
        print(f"  KV-aware: the index's overlap equalled the hit the engine found at admission on {right}/{len(kv_chats)} "
              f"turns (the rest were routed while the latest events were still in flight or the broker was down, "
              f"or the pool changed while they queued).")  # fmt: skip
    delayed = sum(f.stream.delayed_messages for f in fleets)
    if delayed:
        worst = max(f.stream.max_delay for f in fleets)
        print(f"  {delayed:,} messages published during the outage and catch-up (or lost with the broker) arrived "
              f"re-sent or replayed, up to {worst:.1f} s late.")
    for f in fleets:
        if f.skipped:
            print(f"  {f.policy}: {f.skipped} requests could never fit in a worker's pool and were not served.")
        waiting = sum(1 for s in _served(f.chats + [s for b in f.bursts for s in b.seqs]) if s.first_token_ms < 0)
        if waiting:
            print(f"  {f.policy}: {waiting} requests had no first token when the run ended; their TTFT counts the "
                  f"time they waited.")  # fmt: skip
    if behind > 100.0:
        print(f"  the simulation fell up to {behind:,.0f} ms behind the wall clock (a busy machine): that much later "
              f"than simulated, events were published and the routers chose.")  # fmt: skip
    resets = sum(f.stream.resets_after_start for f in fleets)
    if resets:
        print(f"  {resets} views were rebuilt from a snapshot during the run.")
    subs = [f.subscriber.stats for f in fleets]
    print(f"\nsubscribers: {sum(x['messages'] for x in subs):,} messages, gaps={sum(x['gaps'] for x in subs)}, "
          f"replays={sum(x['replays'] for x in subs)}, snapshots={sum(x['snapshots'] for x in subs)}, "
          f"malformed={sum(x['malformed'] for x in subs)}")
    print("every view equals its pool and every index scores like the pools: "
          + ("yes -- nothing lost" if converged else "NO"))


class _ClusterBroker:
    """``--cluster N``: the demo's broker is an N-node cluster. ``kill()``/``start()`` take down and
    bring back one node -- the one the router is connected to -- the rest keep serving."""

    def __init__(self, n: int, t0: float) -> None:
        # A name of this process's own, so nothing can mistake its nodes for anyone else's.
        self.cluster = NatsCluster(n, name=f"kvbridge-demo-{os.getpid()}")
        self.t0 = t0
        self.router: KvEventSubscriber | None = None
        self.killed: int | None = None

    @property
    def url(self) -> str:
        return ",".join(self.cluster.urls)

    def __enter__(self) -> _ClusterBroker:
        self.cluster.__enter__()  # a start that fails leaves no node running
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.close()

    def kill(self) -> None:
        url = self.router.connected_url if self.router is not None else None
        port = urllib.parse.urlsplit(url).port if url else None
        nodes = self.cluster.nodes
        self.killed = next((i for i, node in enumerate(nodes) if node.port == port), 0)
        self.cluster.kill(self.killed)
        _say(self.t0, f"(cluster: node {self.killed} of {len(nodes)}, the router's, is the one down; every client "
                      f"fails over to another node)")  # fmt: skip

    def start(self) -> None:
        if self.killed is not None:
            self.cluster.restart(self.killed, wait=False)  # it rejoins the cluster by itself

    def report(self, workers: list[_Worker]) -> None:
        moves = [f"{w.name} {w.publisher.stats['reconnects']}" for w in workers]
        router = self.router.stats["reconnects"] if self.router is not None else 0
        print(f"failovers (reconnects to another node of the {len(self.cluster.nodes)}-node cluster): "
              f"{', '.join(moves)}, router {router}")  # fmt: skip
