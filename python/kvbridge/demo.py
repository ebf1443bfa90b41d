"""The end-to-end demo behind ``kvbridge demo``: everything real, on loopback.

A real nats-server, simulated engine workers (each a :class:`KVCacheManager` publishing through a
:class:`KvEventPublisher`), and a KV-aware router that routes every chat turn to the worker whose
view -- built only from the NATS stream by a :class:`KvEventSubscriber` -- holds the longest cached
prefix of the prompt. Mid-run the broker is SIGKILLed and restarted; at the end every view must
equal its worker's pool, block for block. ``--cluster N`` runs it on an N-node NATS cluster instead:
every client gets every URL, and the node holding the router's connection is the one killed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from dataclasses import dataclass, field

from kvbridge.config import Config
from kvbridge.consumer import KvEventSubscriber, WorkerView
from kvbridge.hashing import hash_blocks
from kvbridge.pool import KVCacheManager
from kvbridge.publisher import KvEventPublisher
from kvbridge.server import NatsCluster, NatsServer

VOCAB = 151_936
MODEL = "demo-model"


@dataclass
class _Chat:
    """One conversation: a shared system prompt, then turns that grow the history."""

    tokens: list[int]
    turns_left: int


@dataclass
class _Worker:
    name: str
    manager: KVCacheManager
    publisher: KvEventPublisher
    active: list[str] = field(default_factory=list)


@dataclass
class _Routing:
    turns: int = 0
    prompt_blocks: int = 0
    routed_hits: int = 0  # leading blocks the chosen worker's view held
    random_hits: float = 0.0  # what a uniformly random choice would have held, on average


def _cached_prefix(view: WorkerView | None, hashes: list[int]) -> int:
    if view is None:
        return 0
    n = 0
    for h in hashes:
        if h not in view.blocks:
            break
        n += 1
    return n


class _Workload:
    """Multi-turn chats over a few shared system prompts, as a chat service sees them."""

    def __init__(self, rng: random.Random, block_size: int) -> None:
        self.rng = rng
        self.block_size = block_size
        self.system_prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(256, 1024))] for _ in range(4)]
        self.chats: list[_Chat] = []

    def next_turn(self) -> tuple[_Chat, list[int]]:
        rng = self.rng
        if len(self.chats) < 24 or rng.random() < 0.15:
            chat = _Chat(list(rng.choice(self.system_prompts)), rng.randrange(2, 8))
            self.chats.append(chat)
        else:
            chat = rng.choice(self.chats)
        chat.tokens += [rng.randrange(VOCAB) for _ in range(rng.randrange(16, 160))]  # the user's message
        return chat, chat.tokens

    def finish_turn(self, chat: _Chat, reply: list[int]) -> None:
        chat.tokens += reply
        chat.turns_left -= 1
        if chat.turns_left <= 0 or len(chat.tokens) > 6000:
            self.chats.remove(chat)


def _say(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:5.1f}s] {text}", flush=True)


async def run_demo(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    bs = args.block_size
    t0 = time.monotonic()
    with _ClusterBroker(args.cluster, t0) if getattr(args, "cluster", 0) else NatsServer() as server:
        _say(t0, f"nats-server started on {server.url} (watch it: kvbridge watch --servers {server.url})")
        base = Config(servers=server.url, model=MODEL, encoding=args.encoding, reconnect_wait_s=0.2)
        workers = []
        for i in range(args.workers):
            manager = KVCacheManager(args.num_blocks, bs)
            publisher = KvEventPublisher(base.replace(worker_id=f"worker-{i}"))
            publisher.attach(manager)
            workers.append(_Worker(f"worker-{i}", manager, publisher))
        subscriber = KvEventSubscriber(base, model=MODEL)
        server.router = subscriber  # a cluster kills the node holding the router's connection
        async with subscriber:
            for w in workers:
                await w.publisher.start()
            routing = await _drive(args, rng, t0, server, workers, subscriber)
            _say(t0, "traffic stopped; waiting for every view to equal its pool")
            converged = await _converge(workers, subscriber, timeout=15.0)
            for w in workers:
                await w.publisher.close()
        _report(workers, subscriber, routing, converged)
        if isinstance(server, _ClusterBroker):
            server.report(workers)
    return 0 if converged else 1


async def _drive(args, rng, t0, server, workers, subscriber) -> _Routing:
    workload = _Workload(rng, args.block_size)
    routing = _Routing()
    kill_at = None if args.no_kill else args.duration * 0.35
    restart_at = None if kill_at is None else kill_at + 2.0
    next_report = 2.0
    req_id = 0
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < args.duration:
        if kill_at is not None and elapsed >= kill_at:
            server.kill()
            kill_at = None
            _say(t0, "broker SIGKILLed -- the workers keep serving; events wait in each publisher's ring buffer")
        if restart_at is not None and kill_at is None and elapsed >= restart_at:
            server.start()
            restart_at = None
            _say(t0, "broker restarted on the same port -- subscribers repair the hole by replay")
        if elapsed >= next_report:
            next_report += 2.0
            published = sum(w.publisher.stats["events"] for w in workers)
            _say(t0, f"{routing.turns} turns routed, {published:,} block events published, "
                     f"subscriber stats: gaps={subscriber.stats['gaps']} replays={subscriber.stats['replays']}")

        chat, prompt = workload.next_turn()
        hashes = hash_blocks(prompt, args.block_size)
        views = subscriber.views
        hits = [_cached_prefix(views.get((MODEL, w.name)), hashes) for w in workers]
        best = max(range(len(workers)), key=lambda i: (hits[i], -len(workers[i].active), rng.random()))
        w = workers[best]
        routing.turns += 1
        routing.prompt_blocks += len(hashes)
        routing.routed_hits += hits[best]
        routing.random_hits += sum(hits) / len(hits)

        req_id += 1
        rid = f"req-{req_id}"
        with w.publisher.lock:
            if w.manager.allocate(rid, prompt) is None:  # pool full of in-use blocks: finish one first
                _finish_oldest(w)
                if w.manager.allocate(rid, prompt) is None:
                    continue
            reply = [rng.randrange(VOCAB) for _ in range(rng.randrange(32, 256))]
            for i in range(0, len(reply), 16):  # decode steps
                if not w.manager.append(rid, reply[i : i + 16]):
                    break
            w.active.append(rid)
            if len(w.active) > 8:
                _finish_oldest(w)
        w.publisher.step()
        workload.finish_turn(chat, reply)
        await asyncio.sleep(0)
    if restart_at is not None:  # a very short run: bring the broker back before converging
        server.start()
    for w in workers:
        with w.publisher.lock:
            while w.active:
                _finish_oldest(w)
        w.publisher.step()
    return routing


def _finish_oldest(w: _Worker) -> None:
    w.manager.free(w.active.pop(0))


async def _converge(workers, subscriber, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_view_equals_pool(w, subscriber) for w in workers):
            return True
        await asyncio.sleep(0.1)
    return False


def _view_equals_pool(w: _Worker, subscriber: KvEventSubscriber) -> bool:
    view = subscriber.views.get((MODEL, w.name))
    return view is not None and view.blocks == set(w.manager.pool.cached_block_hashes())


def _report(workers, subscriber, routing: _Routing, converged: bool) -> None:
    print()
    print(f"{'worker':<10} {'events':>9} {'messages':>9} {'cached blocks':>14} {'view == pool':>13}")
    for w in workers:
        s = w.publisher.stats
        ok = "yes" if _view_equals_pool(w, subscriber) else "NO"
        print(f"{w.name:<10} {s['events']:>9,} {s['messages']:>9,} {w.manager.pool.num_cached_blocks:>14,} {ok:>13}")
    s = subscriber.stats
    print(f"\nsubscriber: {s['messages']:,} messages, gaps={s['gaps']}, replays={s['replays']}, "
          f"snapshots={s['snapshots']}, malformed={s['malformed']}")
    if routing.prompt_blocks:
        routed = 100.0 * routing.routed_hits / routing.prompt_blocks
        rand = 100.0 * routing.random_hits / routing.prompt_blocks
        print(f"KV-aware routing: {routing.turns} turns, {routed:.1f}% of prompt blocks already cached on the "
              f"chosen worker (random routing: {rand:.1f}%)")
    print("every view equals its pool: " + ("yes -- nothing lost" if converged else "NO"))


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
        port = self.router._nc.connected_url.port if self.router is not None and self.router._nc else None
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
        router = self.router._nc.stats["reconnects"] if self.router is not None and self.router._nc else 0
        print(f"failovers (reconnects to another node of the {len(self.cluster.nodes)}-node cluster): "
              f"{', '.join(moves)}, router {router}")  # fmt: skip
