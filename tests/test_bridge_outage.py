"""A 30 s broker outage while the engine keeps publishing: the engine never waits, memory stays
within the configured ring bound, what could not be kept is counted, and the subscriber converges
(by snapshot) once the broker is back."""

from __future__ import annotations

import asyncio
import resource
import time

import pytest

from bridge_support import Engine, views_match, wait_until
from kvbridge import BackgroundPublisher, Config, KvEventSubscriber

OUTAGE_S = 30.0
RING = 2 * 1024 * 1024


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


@pytest.mark.timeout(150)
async def test_30s_broker_outage(own_nats_server):
    server = own_nats_server
    config = Config(
        servers=server.url, model="m", worker_id="w0", ring_buffer_bytes=RING, queue_max_batches=256,
        reconnect_wait_s=0.5, heartbeat_s=0.5,
    )  # fmt: skip
    sub = await KvEventSubscriber(config).start()
    pub = BackgroundPublisher(config).start()
    engine = Engine(pub, 10**12, seed=50, step_sleep=0.0005)
    engine.start()
    try:
        await _outage(server, sub, pub, engine)
    finally:
        engine.stop_flag.set()
        await asyncio.to_thread(engine.join, 30)
        await asyncio.to_thread(pub.close)
        await sub.close()


async def _outage(server, sub, pub, engine):
    await wait_until(lambda: engine.published > 5000, 30, "some events before the outage")
    assert sub.connected_url == server.url and sub.stats["reconnects"] == 0

    samples = []

    async def sample():
        while True:
            s = pub.stats
            samples.append((s["ring_bytes"], s["queue_depth"], _rss_mb()))
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    rss_before = _rss_mb()
    published_before = engine.published
    await asyncio.to_thread(server.kill)
    assert not server.running  # kill -9: the broker is gone
    killed = time.monotonic()
    # The ring overflows while the broker is down (waited on, not assumed of OUTAGE_S); the outage
    # then lasts OUTAGE_S in all, the engine publishing throughout.
    await wait_until(lambda: pub.stats["evicted_unsent"] > 0, 4 * OUTAGE_S, "the ring to overflow during the outage")
    await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed)))
    published_during = engine.published - published_before
    await asyncio.to_thread(server.start)
    await asyncio.sleep(3.0)
    engine.stop_flag.set()
    await asyncio.to_thread(engine.finish)
    sampler.cancel()
    waited = await wait_until(lambda: views_match(sub, {("m", "w0"): engine}), 60, "convergence after the outage")

    stats = pub.stats
    max_ring = max(s[0] for s in samples)
    max_queue = max(s[1] for s in samples)
    max_rss = max(s[2] for s in samples)
    print(
        f"\noutage {OUTAGE_S:.0f}s: engine published {published_during} events during it, "
        f"{engine.publish_summary()}\n"
        f"ring max {max_ring} B (bound {RING}), hand-off queue max {max_queue}, "
        f"RSS {rss_before:.1f} -> max {max_rss:.1f} MB\n"
        f"publisher: evicted unsent {stats['evicted_unsent']}, dropped hand-offs {stats['dropped_batches']}, "
        f"reconnects {stats['reconnects']}\nsubscriber converged {waited:.2f}s after the engine stopped: {sub.stats}"
    )
    assert max_ring <= RING
    # Loose: the ring bound plus allocator slack, nowhere near 30 s of unbounded buffering.
    assert max_rss - rss_before < 64
    assert stats["evicted_unsent"] > 0  # the outage outlasted the ring, and that was counted
    assert sub.stats["snapshots"] >= 2  # first contact + recovery after the range was gone
    assert sub.stats["reconnects"] >= 1 and sub.connected_url == server.url
