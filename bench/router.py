"""Routing decisions per second: provisional residency and replica sync on and off, in one run.

    python bench/router.py [--workers 16] [--decisions 20000] [--blocks 128] [--runs 3]

An Index holding ``--workers`` workers' caches (shared 96-block system prompts, each worker a few
of them) answers ``Router.choose`` for prompts of ``--blocks`` 16-token blocks: a system prompt
and a unique tail, so every decision both hits the index and adds provisional entries. Each
decision is followed by ``done`` (a request finishing), as a gateway does. Rows, best of
``--runs``:

* find_matches: the index's query alone for the same prompts (the floor a decision is held to:
  at most 2x, issue 30);
* off: ``provisional_ttl_s=0``: the index query, hashing and the cost formula only;
* provisional: the default (2 s TTL): plus the prompt's block keys recorded and read back;
* provisional + reports: plus every worker's LoadReport weighed (``reports=`` a
  :class:`kvbridge.routing.router.ReportLoads` over a subscriber's reports, read in bulk when they
  refresh, as a router fed by a ``KvEventSubscriber`` runs);
* provisional + sync: plus :class:`kvbridge.routing.sync.RouteSync` publishing every decision
  and its end to a real nats-server on loopback, and a second replica applying them.

Each row's figure is the time per decision (choose + done) measured around the whole loop, and
decisions/s; the ratio columns are against the "off" and the "find_matches" rows of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from kvbridge import BlockStored, Index, KVEventBatch
from kvbridge.routing.router import ReportLoads, Router
from kvbridge.routing.sync import RouteSync
from kvbridge.tools.server import NatsServer
from kvbridge.wire.events import LoadReport

BS = 16
SYSTEM_BLOCKS = 96


class _Reports:
    """What ``KvEventSubscriber.loads`` holds: (model, worker) -> (latest report, age in s), here
    a report per worker that keeps being fresh."""

    def __init__(self, workers: list[str]) -> None:
        self.workers = workers

    @property
    def loads(self) -> dict[tuple[str, str], tuple[LoadReport, float]]:
        report = LoadReport(ts=time.time(), kv_cache_usage=0.3, running=4, waiting=1)
        return {("bench", w): (report, 0.01) for w in self.workers}


def build_index(n_workers: int, rnd: random.Random) -> tuple[Index, list[list[int]]]:
    index = Index(BS)
    systems = [[rnd.randrange(150_000) for _ in range(SYSTEM_BLOCKS * BS)] for _ in range(8)]
    for w in range(n_workers):
        for s in rnd.sample(range(len(systems)), 3):
            hashes = [rnd.getrandbits(63) for _ in range(SYSTEM_BLOCKS)]
            ev = BlockStored(hashes, None, systems[s], BS, None, "GPU", None)
            index.apply(f"w{w}", KVEventBatch(0.0, [ev]))
    return index, systems


def prompts(systems: list[list[int]], n: int, blocks: int, rnd: random.Random) -> list[list[int]]:
    tail = (blocks - SYSTEM_BLOCKS) * BS + 7
    return [rnd.choice(systems) + [rnd.randrange(150_000) for _ in range(tail)] for _ in range(n)]


async def run_row(router: Router, batch: list[list[int]], sync_pair: tuple[RouteSync, RouteSync] | None) -> float:
    """Seconds per decision (choose + done) over the whole batch."""
    start = time.perf_counter()
    for i, p in enumerate(batch):
        worker, _ = router.choose(p)
        router.done(worker)
        if sync_pair is not None and i % 64 == 63:
            await asyncio.sleep(0)  # the sender publishes on this loop: let it run, as a server would
    if sync_pair is not None:
        sender, peer = sync_pair
        want = 2 * len(batch)
        while sender.stats["published"] < want or peer.stats["applied"] < want:
            await asyncio.sleep(0.001)  # everything published and applied by the peer is in the time
    return (time.perf_counter() - start) / len(batch)


async def main_async(args: argparse.Namespace) -> None:
    rnd = random.Random(7)
    index, systems = build_index(args.workers, rnd)
    rows = ("find_matches", "off", "provisional", "provisional + reports", "provisional + sync")
    best = dict.fromkeys(rows, float("inf"))
    reports = ReportLoads(_Reports(index.workers))
    with NatsServer() as server:
        for _ in range(args.runs):
            batch = prompts(systems, args.decisions, args.blocks, rnd)
            for row in rows:
                if row == "find_matches":
                    start = time.perf_counter()
                    for p in batch:
                        index.find_matches(p)
                    best[row] = min(best[row], (time.perf_counter() - start) / len(batch))
                    continue
                router = Router(index, provisional_ttl_s=0 if row == "off" else 2.0,
                                reports=reports if row.endswith("reports") else None)  # fmt: skip
                if row.endswith("sync"):
                    peer_router = Router(index)
                    async with RouteSync(router, servers=[server.url], model="bench") as sender, \
                            RouteSync(peer_router, servers=[server.url], model="bench") as peer:  # fmt: skip
                        t = await run_row(router, batch, (sender, peer))
                else:
                    t = await run_row(router, batch, None)
                best[row] = min(best[row], t)
    print(f"Router.choose + done, {args.workers} workers, {args.blocks}-block prompts, best of {args.runs} "
          f"runs of {args.decisions:,} decisions")  # fmt: skip
    print(f"{'row':<22} {'us/decision':>12} {'decisions/s':>12} {'x off':>7} {'x find_matches':>15}")
    for row in rows:
        t = best[row]
        print(f"{row:<22} {t * 1e6:>12.1f} {1 / t:>12,.0f} {t / best['off']:>7.2f} {t / best['find_matches']:>15.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--decisions", type=int, default=20_000)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
