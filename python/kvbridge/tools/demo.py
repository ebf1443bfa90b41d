"""The end-to-end demo behind ``kvbridge demo``: everything real, on loopback.

A real nats-server and three fleets of simulated engine workers (each worker a
:class:`KVCacheManager` publishing through a :class:`KvEventPublisher`) serve the same stream of
multi-turn chats over a few shared system prompts. Each fleet routes by its own policy:

* KV-aware: :class:`kvbridge.routing.router.Router` over a :class:`kvbridge.Index` built only from the
  fleet's NATS event stream (cost = blocks still to prefill + requests in flight);
* round-robin, and uniformly random.

Mid-run the broker is SIGKILLed and restarted. Then come bursts of requests sharing a new prefix,
arriving together (agentic fan-out): the KV-aware router holds each burst's first choice as
provisionally caching the prefix until the worker's events confirm it, so the burst lands on one
worker instead of every worker prefilling the same prefix. At the end the demo prints, per policy, the
prefix-cache hit rate the workers' pools actually had, a time-to-first-token estimate, and how the
stream fared (events/s, latency, events lost); every subscriber's view must equal its worker's
pool, block for block, and the index must score like the pools (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import time
import urllib.parse
from dataclasses import dataclass, field

from kvbridge._native import Index
from kvbridge.config import Config
from kvbridge.bus.subscriber import KvEventSubscriber
from kvbridge.bus.update import Update
from kvbridge.wire.hashing import hash_blocks
from kvbridge.engine.pool import KVCacheManager
from kvbridge.bus.publisher import KvEventPublisher
from kvbridge.routing.router import Router
from kvbridge.tools.server import NatsCluster, NatsServer
from kvbridge.wire.residency import Residency

VOCAB = 151_936
MODEL = "demo-model"
POLICIES = ("KV-aware", "round-robin", "random")


@dataclass
class _Chat:
    """One conversation: a shared system prompt, then turns that grow the history."""

    tokens: list[int]
    turns_left: int


class _Workload:
    """Multi-turn chats over a few shared system prompts, as a chat service sees them. The same
    stream goes to every fleet: nothing here depends on where a turn is routed."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.system_prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(256, 1024))] for _ in range(4)]
        self.chats: list[_Chat] = []

    def next_turn(self) -> tuple[_Chat, list[int], list[int]]:
        """A chat, its prompt for this turn, and the reply the model will give."""
        rng = self.rng
        if len(self.chats) < 24 or rng.random() < 0.15:
            chat = _Chat(list(rng.choice(self.system_prompts)), rng.randrange(2, 8))
            self.chats.append(chat)
        else:
            chat = rng.choice(self.chats)
        chat.tokens += [rng.randrange(VOCAB) for _ in range(rng.randrange(16, 160))]  # the user's message
        reply = [rng.randrange(VOCAB) for _ in range(rng.randrange(32, 256))]
        return chat, list(chat.tokens), reply

    def burst(self, size: int) -> tuple[list[list[int]], list[int]]:
        """``size`` prompts sharing a new 512-token prefix (one task fanned out to sub-agents),
        each with a question of its own, and the reply each gets."""
        rng = self.rng
        prefix = [rng.randrange(VOCAB) for _ in range(512)]
        prompts = [prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(16, 64))] for _ in range(size)]
        return prompts, [rng.randrange(VOCAB) for _ in range(32)]

    def finish_turn(self, chat: _Chat, reply: list[int]) -> None:
        chat.tokens += reply
        chat.turns_left -= 1
        if chat.turns_left <= 0 or len(chat.tokens) > 6000:
            self.chats.remove(chat)


@dataclass
class _Worker:
    name: str
    manager: KVCacheManager
    publisher: KvEventPublisher
    active: list[str] = field(default_factory=list)
    turns: int = 0


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
    """One policy's workers, the subscriber that follows their stream, and the index it feeds."""

    def __init__(self, policy: str, args: argparse.Namespace, base: Config, outage: _Outage) -> None:
        self.policy = policy
        self.model = f"{MODEL}-{policy.lower()}"
        self.block_size = args.block_size
        self.workers: list[_Worker] = []
        window = getattr(args, "sliding_window", 0)
        self.groups = [("full_attention", None), ("sliding_window", window)] if window else None
        for i in range(args.workers):
            manager = KVCacheManager(args.num_blocks, args.block_size, groups=self.groups)
            publisher = KvEventPublisher(base.replace(model=self.model, worker_id=f"worker-{i}"))
            publisher.attach(manager)
            self.workers.append(_Worker(f"worker-{i}", manager, publisher))
        self.by_name = {w.name: w for w in self.workers}
        self.running: collections.deque[_Worker] = collections.deque()  # one entry per running request
        self.index = Index(args.block_size)
        self.stream = _StreamStats(outage)
        # The index is fed straight from the payload bytes; the views are kept to check it against.
        self.subscriber = KvEventSubscriber(
            base.replace(model=self.model), model=self.model, index=self.index, track_views=True, on_update=self.stream
        )
        # load: the router's own count of requests in flight (choose() ... done())
        self.router = Router(self.index, workers=list(self.by_name)) if policy == "KV-aware" else None
        self.rng = random.Random(args.seed + 1)
        self.turns = self.prompt_blocks = self.hit_blocks = self.prefill_blocks = self.skipped = 0
        self.predicted_right = 0
        self.published_at_start = 0
        # Per burst, the workers that prefilled its new prefix; for the KV-aware fleet also what a
        # router without provisional residency would have chosen (a shadow: it serves nothing).
        self.burst_prefills: list[int] = []
        self.shadow_prefills: list[int] = []

    def choose(self, turn: int, prompt: list[int]) -> tuple[_Worker, int | None]:
        if self.router is not None:
            name, overlap = self.router.choose(prompt)
            return self.by_name[name], overlap
        if self.policy == "round-robin":
            return self.workers[turn % len(self.workers)], None
        return self.rng.choice(self.workers), None

    def serve(self, turn: int, rid: str, prompt: list[int], reply: list[int]) -> str:
        """Routes and runs one request; returns the worker's name."""
        w, predicted = self.choose(turn, prompt)
        with w.publisher.lock:
            cached = w.manager.allocate(rid, prompt)
            if cached is None and w.active:  # pool full of in-use blocks: finish one first
                self._finish_oldest(w)
                self.running.remove(w)
                cached = w.manager.allocate(rid, prompt)
            if cached is not None:
                for i in range(0, len(reply), 16):  # decode steps
                    if not w.manager.append(rid, reply[i : i + 16]):
                        break
                w.active.append(rid)
                self.running.append(w)
        # Requests finish in the order they came, whichever worker runs them: the fleet keeps
        # about 8 per worker running.
        while len(self.running) > 8 * len(self.workers):
            done = self.running.popleft()
            with done.publisher.lock:
                self._finish_oldest(done)
            if done is not w:
                done.publisher.step()
        w.publisher.step()
        if cached is None:
            self.skipped += 1
            if self.router is not None:
                self.router.done(w.name)
            return w.name
        bs = self.block_size
        full, hit = len(prompt) // bs, cached // bs
        self.turns += 1
        w.turns += 1
        self.prompt_blocks += full
        self.hit_blocks += hit
        self.prefill_blocks += -(-len(prompt) // bs) - hit
        if predicted == hit:
            self.predicted_right += 1
        return w.name

    def burst(self, turn: int, prompts: list[list[int]], reply: list[int]) -> None:
        """Requests sharing a new prefix, served back to back: no event of the first reaches the
        index before the last is routed."""
        shadow = Router(self.index, workers=list(self.by_name), provisional_ttl_s=0) if self.router else None
        chosen = set()
        for i, prompt in enumerate(prompts):
            if shadow is not None:
                shadow.choose(prompt)  # never done: its in-flight counts are its own, as the real router's
            chosen.add(self.serve(turn + i, f"burst-{turn}-{i}", prompt, reply))
        self.burst_prefills.append(len(chosen))
        if shadow is not None:
            self.shadow_prefills.append(len(shadow.in_flight))

    def _finish_oldest(self, w: _Worker) -> None:
        w.manager.free(w.active.pop(0))
        if self.router is not None:
            self.router.done(w.name)

    def drain(self) -> None:
        for w in self.workers:
            with w.publisher.lock:
                while w.active:
                    self._finish_oldest(w)
            w.publisher.step()
        self.running.clear()

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
    with _ClusterBroker(cluster, t0) if cluster else NatsServer() as server:
        _say(t0, f"nats-server started on {server.url} (watch it: kvbridge watch --servers {server.url})")
        base = Config(servers=server.url.split(","), encoding=args.encoding, reconnect_wait_s=0.2)
        outage = _Outage()
        fleets = [_Fleet(policy, args, base, outage) for policy in POLICIES]
        if isinstance(server, _ClusterBroker):  # it kills the node holding the KV-aware router's connection
            server.router = fleets[0].subscriber
        for f in fleets:
            await f.subscriber.start()
        try:
            for f in fleets:
                for w in f.workers:
                    await w.publisher.start()
            await _meet(fleets)
            _say(t0, f"{len(fleets)} fleets of {args.workers} workers, one per routing policy "
                     f"({', '.join(POLICIES)}), serve the same chats")
            workload = _Workload(rng)
            probes, elapsed = await _drive(args, t0, server, fleets, workload, outage)
            _say(t0, "traffic stopped; waiting for every view to equal its pool and the indexes to score like the pools")
            converged = await _converge(fleets, probes, timeout=15.0)
        finally:
            for f in fleets:
                for w in f.workers:
                    await w.publisher.close()
            for f in fleets:
                await f.subscriber.close()
        _report(args, fleets, elapsed, converged)
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
) -> tuple[list[list[int]], float]:
    kill_at = None if args.no_kill else args.duration * 0.35
    restart_at = None if kill_at is None else kill_at + 2.0
    next_report = 2.0
    catching_up = False
    turn = 0
    recent: list[list[int]] = []
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < args.duration:
        if kill_at is not None and elapsed >= kill_at:
            outage.start = time.time()
            server.kill()
            kill_at = None
            _say(t0, "broker SIGKILLed -- the workers keep serving; events wait in each publisher's ring buffer")
        if restart_at is not None and kill_at is None and elapsed >= restart_at:
            server.start()
            restart_at = None
            catching_up = True
            _say(t0, "broker restarted on the same port -- subscribers repair the hole by replay")
        if catching_up and _caught_up(fleets):
            outage.end = time.time()
            catching_up = False
            _say(t0, f"caught up: every subscriber in sync, {outage.end - (outage.start or outage.end):.1f} s after the kill")
        if elapsed >= next_report:
            next_report += 2.0
            published = sum(f.published for f in fleets)
            gaps = sum(f.subscriber.stats["gaps"] for f in fleets)
            replays = sum(f.subscriber.stats["replays"] for f in fleets)
            _say(t0, f"{turn} turns served by each fleet, {published:,} block events published, "
                     f"subscribers: gaps={gaps} replays={replays}")
        chat, prompt, reply = workload.next_turn()
        turn += 1
        for f in fleets:
            f.serve(turn, f"req-{turn}", prompt, reply)
        workload.finish_turn(chat, reply)
        recent.append(prompt)
        del recent[:-32]
        # A steady request rate, as a service sees it (and headroom to catch up after the outage).
        await asyncio.sleep(max(0.0, start + turn / args.turns_per_s - time.monotonic()))
    elapsed = time.monotonic() - start
    if restart_at is not None:  # a very short run: bring the broker back before converging
        server.start()
    bursts = getattr(args, "bursts", 0)
    if bursts:
        _say(t0, f"{bursts} bursts of {args.burst_size} requests sharing a new prefix, arriving together")
    for b in range(bursts):
        await asyncio.sleep(0.2)  # the last burst's events reach the indexes first
        prompts, reply = workload.burst(args.burst_size)
        for f in fleets:
            f.burst(turn + 1, prompts, reply)
        turn += len(prompts)
    if outage.start is not None and outage.end is None:
        outage.end = float("inf")  # the run ended before the catch-up: no latency sample after it counts
    for f in fleets:
        f.drain()
    # what to check the indexes with: the last prompts and every system prompt
    return recent + workload.system_prompts, elapsed


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


def _report(args: argparse.Namespace, fleets: list[_Fleet], elapsed: float, converged: bool) -> None:
    print()
    print(f"{'fleet':<12} {'worker':<10} {'turns':>6} {'events':>9} {'messages':>9} {'cached blocks':>14} {'view == pool':>13}")
    for f in fleets:
        for w in f.workers:
            s = w.publisher.stats
            ok = "yes" if f.view_equals_pool(w) else "NO"
            print(f"{f.policy:<12} {w.name:<10} {w.turns:>6} {s['events']:>9,} {s['messages']:>9,} "
                  f"{w.manager.pool.num_cached_blocks:>14,} {ok:>13}")
    ms = args.prefill_ms_per_block
    print()
    print(f"{'routing':<12} {'turns':>6} {'hit rate':>9} {'mean TTFT*':>11} {'events/s':>9} "
          f"{'p50 / p99 latency':>18} {'events lost':>12}")
    for f in fleets:
        st = f.stream
        hit = 100.0 * f.hit_blocks / f.prompt_blocks if f.prompt_blocks else 0.0
        ttft = ms * f.prefill_blocks / f.turns if f.turns else 0.0
        lost = (f.published - f.published_at_start) - st.events
        lat = f"{st.percentile(0.5) * 1e3:.1f} / {st.percentile(0.99) * 1e3:.1f} ms"
        print(f"{f.policy:<12} {f.turns:>6} {hit:>8.1f}% {ttft:>8.1f} ms {st.events / elapsed:>9,.0f} "
              f"{lat:>18} {lost:>12,}")
    print(f"* hit rate: prompt blocks the chosen worker's pool already held. TTFT estimate: prefill only, "
          f"{ms:g} ms per {args.block_size}-token block not found cached (the partial last block counts), "
          f"queueing ignored (--prefill-ms-per-block).")
    print("  latency: from publish() to the subscriber's index, per event, outside the broker outage and the "
          "catch-up after it; events lost: published minus delivered.")
    kv = fleets[0]
    if kv.burst_prefills:
        def mean(xs: list[int]) -> str:
            return f"{sum(xs) / len(xs):.1f}"

        others = ", ".join(f"{f.policy} {mean(f.burst_prefills)}" for f in fleets[1:])
        print(f"  bursts: workers that prefilled each burst's new prefix, mean of {len(kv.burst_prefills)} bursts of "
              f"{args.burst_size} requests: KV-aware {mean(kv.burst_prefills)} (a router without provisional "
              f"residency would have used {mean(kv.shadow_prefills)}), {others}.")  # fmt: skip
    if kv.turns:
        print(f"  KV-aware: the index's overlap equalled the pool's actual hit on {kv.predicted_right}/{kv.turns} "
              f"turns (the rest were routed while the latest events were still in flight, or the broker was down).")
    delayed = sum(f.stream.delayed_messages for f in fleets)
    if delayed:
        worst = max(f.stream.max_delay for f in fleets)
        print(f"  {delayed:,} messages published during the outage and catch-up (or lost with the broker) arrived "
              f"re-sent or replayed, up to {worst:.1f} s late.")
    for f in fleets:
        if f.skipped:
            print(f"  {f.policy}: {f.skipped} turns found no room in the chosen worker's pool and were not served.")
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
        self.cluster.start()
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
