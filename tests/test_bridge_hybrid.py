"""Hybrid-attention workers (several KV-cache groups, two media, copies) across a real nats-server:
every subscriber's view ends equal to the published residency per (medium, group) -- a
subscriber that joins late (by the worker's snapshot), one that lives through a broker kill -9, and
an iterator that fell behind and rebuilds from its catch-up updates."""

from __future__ import annotations

import asyncio

import pytest

from bridge_support import wait_until
from hybrid_support import HybridEngine
from kvbridge import Config, KvEventPublisher, KvEventSubscriber, WorkerView

MODEL = "hybrid"
WAIT = 60.0  # an upper bound; no wait decides an assertion by its length


def cfg(server, worker: str, **kw) -> Config:
    return Config(servers=server.url, model=MODEL, worker_id=worker, subject_prefix="hy", reconnect_wait_s=0.2,
                  heartbeat_s=0.5, **kw)  # fmt: skip


async def start_engines(server, n: int, seed: int) -> list[HybridEngine]:
    pubs = [await KvEventPublisher(cfg(server, f"w{i}")).start() for i in range(n)]
    return [HybridEngine(p, seed=seed + i, n_groups=2 + i % 2) for i, p in enumerate(pubs)]


async def run(engines: list[HybridEngine], steps: int) -> None:
    for _ in range(steps):
        for e in engines:
            e.step()
        await asyncio.sleep(0.002)  # lets the publishers send as the engines go


def held_as_published(views: dict, engines: list[HybridEngine]) -> bool:
    """Every engine's view in ``views`` holds what it published, per (medium, group), with its kinds."""
    for e in engines:
        view = views.get((MODEL, e.publisher.config.worker_id))
        if view is None or (view.held, view.residency.kinds) != e.expected():
            return False
    return True


def views_equal(sub: KvEventSubscriber, engines: list[HybridEngine]) -> bool:
    views = sub.views
    return (sub.in_sync() and held_as_published(views, engines)
            and all(views[(MODEL, e.publisher.config.worker_id)].epoch == e.publisher.epoch for e in engines))  # fmt: skip


def assert_hybrid(engines: list[HybridEngine]) -> None:
    """The streams were what this file is about: several groups, two media, copies."""
    for e in engines:
        held, _ = e.expected()
        assert len({g for _, g in held}) >= 2 and len({m for m, _ in held}) == 2, held
    assert any(c > 1 for e in engines for blocks in e.expected()[0].values() for c in blocks.values())


@pytest.mark.timeout(180)
async def test_a_late_subscriber_rebuilds_every_group_from_the_snapshot(nats_server):
    engines = await start_engines(nats_server, 3, seed=100)
    await run(engines, 300)
    # A request timeout far above any load-induced delay: a retried snapshot would be a second one.
    late = await KvEventSubscriber(cfg(nats_server, "late", request_timeout_s=WAIT)).start()
    await run(engines, 50)  # live traffic behind the snapshot
    await wait_until(lambda: views_equal(late, engines), WAIT, "the late subscriber's views == the residency")
    assert late.stats["snapshots"] == 3  # one per worker: what it holds came through the snapshot
    assert_hybrid(engines)
    for c in (late, *(e.publisher for e in engines)):
        await c.close()


@pytest.mark.timeout(180)
async def test_a_subscriber_lives_through_a_broker_kill(own_nats_server):
    server = own_nats_server
    sub = await KvEventSubscriber(cfg(server, "router")).start()
    engines = await start_engines(server, 2, seed=200)
    await run(engines, 150)
    await wait_until(lambda: views_equal(sub, engines), WAIT, "the views before the kill")
    await asyncio.to_thread(server.kill)
    assert not server.running
    await run(engines, 150)  # handed over while the broker is dead
    await asyncio.to_thread(server.start)  # same port
    await run(engines, 50)
    await wait_until(lambda: views_equal(sub, engines), WAIT, "the views after the broker came back")
    assert all(e.publisher.stats["reconnects"] >= 1 for e in engines)  # the kill reached them
    assert sub.stats["reconnects"] >= 1
    assert_hybrid(engines)
    for c in (sub, *(e.publisher for e in engines)):
        await c.close()


@pytest.mark.timeout(180)
async def test_a_stalled_iterator_catches_up_with_every_group_and_copy(nats_server):
    sub = await KvEventSubscriber(cfg(nats_server, "stalled"), queue_size=32).start()
    it = sub.__aiter__()
    engines = await start_engines(nats_server, 2, seed=300)
    rebuilt: dict[tuple[str, str], WorkerView] = {}  # a consumer that rebuilds views from the updates alone

    def apply(u) -> None:
        rebuilt.setdefault((u.model, u.worker), WorkerView()).apply(u)

    await run(engines, 20)
    apply(await it.__anext__())  # reads one, then stalls while the workers keep going
    await run(engines, 300)
    await wait_until(lambda: views_equal(sub, engines), WAIT, "the subscriber's own views")
    assert sub.stats["iterator_behind"] >= 1
    first = await it.__anext__()
    assert first.reset and first.source == "behind"  # the catch-up: each worker's view as events
    apply(first)
    while not held_as_published(rebuilt, engines):
        apply(await asyncio.wait_for(it.__anext__(), WAIT))
    assert_hybrid(engines)
    for c in (sub, *(e.publisher for e in engines)):
        await c.close()
