"""kvbridge on a real 3-node NATS cluster (kvbridge.tools.server.NatsCluster: three nats-server processes
routed on loopback), every client given every URL.

Core NATS: the node holding the subscriber's connection is SIGKILLed, later a second node; views
end equal to the pools and no batch is delivered twice. JetStream with stream_replicas=3: the node
leading the stream is SIGKILLed while workers publish; a subscriber reading the stream loses and
repeats nothing and moves on within seconds, and one started afterwards rebuilds every view from
the stream alone. Plus the replica setting: refused where it cannot be placed, never changed on an
existing stream."""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import nats.js.errors
import pytest

from bridge_support import Engine, Recorder, nats_connect, views_match, wait_until
from kvbridge import Config, KvEventPublisher, KvEventSubscriber
from kvbridge.bus.jetstream import JetStreamError
from kvbridge.tools.server import NatsCluster
from test_jetstream import seqs_by_incarnation, stream_messages

pytestmark = pytest.mark.timeout(120)
MODEL = "m"


def cfg(cluster: NatsCluster, prefix: str, worker: str = "w0", **kw) -> Config:
    base = dict(servers=cluster.urls, model=MODEL, worker_id=worker, subject_prefix=prefix, heartbeat_s=0.5,
                reconnect_wait_s=0.2, connect_timeout_s=1.0, request_timeout_s=1.0)  # fmt: skip
    base.update(kw)
    return Config(**base)


def node_of(cluster: NatsCluster, client) -> int:
    """The index of the node a kvbridge client (publisher/subscriber) is connected to now."""
    port = client._nc.connected_url.port
    return next(i for i, node in enumerate(cluster.nodes) if node.port == port)


async def wait_moved(cluster: NatsCluster, client, dead: int, what: str) -> float:
    return await wait_until(
        lambda: client._nc.is_connected and node_of(cluster, client) != dead, 30, f"{what} on another node"
    )


async def kill_and_wait_reader(cluster: NatsCluster, node: int, sub: KvEventSubscriber) -> float:
    """SIGKILL ``node`` while workers publish; seconds until ``sub`` reads new stream messages."""
    delivered = sub.stats["messages"]
    t_kill = time.monotonic()
    await asyncio.to_thread(cluster.kill, node)
    await wait_until(lambda: sub.stats["messages"] > delivered + 50, 30, f"the stream reader moving on (node {node})")
    return time.monotonic() - t_kill


async def patiently(call, timeout: float = 30.0):
    """A JetStream API call from the test itself, tried again while the cluster elects leaders."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except (asyncio.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def stop_engines(engines: dict) -> None:
    for e in engines.values():
        e.stop_flag.set()
    for e in engines.values():
        await asyncio.to_thread(e.finish)


@pytest.fixture
def cluster():
    with NatsCluster(3) as c:
        yield c


@pytest.fixture
def js_cluster():
    with NatsCluster(3, jetstream=True) as c:
        yield c


async def test_core_cluster_loses_the_subscribers_node_then_another(cluster):
    rec = Recorder()
    sub = await KvEventSubscriber(cfg(cluster, "cl1"), on_update=rec).start()
    pubs = [await KvEventPublisher(cfg(cluster, "cl1", f"w{i}")).start() for i in range(3)]
    engines = {(MODEL, p.config.worker_id): Engine(p, 10**9, seed=70 + i, step_sleep=0.01) for i, p in enumerate(pubs)}
    for e in engines.values():
        e.start()
    try:
        await wait_until(lambda: all(e.published > 300 for e in engines.values()), 30, "events before the first kill")
        first = node_of(cluster, sub)
        await asyncio.to_thread(cluster.kill, first)
        moved = await wait_moved(cluster, sub, first, "subscriber")
        await asyncio.sleep(1.0)
        await asyncio.to_thread(cluster.restart, first)
        # The second node: the one holding the subscriber now, and with it any publishers there.
        second = node_of(cluster, sub)
        on_second = [p.config.worker_id for p in pubs if node_of(cluster, p) == second]
        await asyncio.to_thread(cluster.kill, second)
        moved2 = await wait_moved(cluster, sub, second, "subscriber")
        await asyncio.sleep(1.0)
    finally:
        await stop_engines(engines)
    waited = await wait_until(lambda: views_match(sub, engines), 60, "views == pools after two node losses")
    stats = sub.stats
    print(f"\nkilled node {first} (subscriber moved in {moved:.2f}s), then node {second} with publishers "
          f"{on_second} (moved in {moved2:.2f}s); converged {waited:.2f}s after the engines stopped; {stats}; "
          f"publisher reconnects {[p.stats['reconnects'] for p in pubs]}")  # fmt: skip
    for key, e in engines.items():
        counts = rec.check(key)  # in order, no (epoch, seq) twice
        assert counts["deliveries"] > 0 and e.published > 300
    assert sub._nc.stats["reconnects"] >= 2
    assert sum(p.stats["reconnects"] for p in pubs) >= len(on_second)
    assert stats["epoch_changes"] == 0 and stats["malformed"] == 0
    for c in (*pubs, sub):
        await c.close()


async def test_replicated_stream_survives_losing_its_leader(js_cluster, caplog):
    cluster = js_cluster
    caplog.set_level(logging.INFO, logger="kvbridge")
    config = cfg(cluster, "clj", jetstream=True, stream_name="CLJ", stream_replicas=3)
    rec = Recorder()
    sub = await KvEventSubscriber(config, on_update=rec).start()  # creates the stream, R3
    nc = await nats_connect(servers=cluster.urls)
    js = nc.jetstream(timeout=2)
    info = await js.stream_info("CLJ")
    assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2
    pubs = [await KvEventPublisher(config.replace(worker_id=f"w{i}")).start() for i in range(2)]
    engines = {(MODEL, p.config.worker_id): Engine(p, 10**9, seed=80 + i, step_sleep=0.01) for i, p in enumerate(pubs)}
    for e in engines.values():
        e.start()
    try:
        await wait_until(lambda: all(e.published > 300 for e in engines.values()), 30, "events before the kill")
        leader = cluster.index_of((await patiently(lambda: js.stream_info("CLJ"))).cluster.leader)
        resumed = await kill_and_wait_reader(cluster, leader, sub)  # the stream elects a new leader
        new_leader = (await patiently(lambda: js.stream_info("CLJ"))).cluster.leader
        # The reader's consumer (one replica, on one node) may have lived elsewhere: lose that node too.
        await asyncio.to_thread(cluster.restart, leader)
        home = cluster.index_of(
            (await patiently(lambda: js.consumer_info("CLJ", sub._stream_reader._consumer))).cluster.leader
        )
        resumed2 = await kill_and_wait_reader(cluster, home, sub)
        await asyncio.sleep(1.0)
    finally:
        await stop_engines(engines)
    for p in pubs:
        await p.close(timeout=30)  # JetStream: closed means stored
    pstats = [p.stats for p in pubs]
    print(f"\nkilled stream leader node {leader}; new leader {new_leader}; reader moved on {resumed:.2f}s after the "
          f"kill; killed the consumer's node {home}: reader moved on after {resumed2:.2f}s; publishers {pstats}")  # fmt: skip
    assert all(s["js_unacked"] == 0 for s in pstats), pstats
    assert new_leader != cluster.node_names[leader]
    # A publisher may or may not see the election as an outage (a fast one passes between two acks):
    # whichever it saw is reported as what it is, and every one it saw ended.
    messages = [r.getMessage() for r in caplog.records]
    for p, s in zip(pubs, pstats):
        mine = [m for m in messages if f"publisher {MODEL}/{p.config.worker_id}:" in m]
        assert any("is not storing our messages" in m for m in mine) == (s["js_outages"] >= 1), (mine, s)
        assert sum("stores again after" in m for m in mine) == s["js_outages"], (mine, s)
    assert not any("-js?" in m for m in messages)

    waited = await wait_until(lambda: views_match(sub, engines), 30, "views == pools, read from the stream")
    stats = sub.stats
    print(f"reader converged {waited:.2f}s after the publishers closed: {stats}")
    for key in engines:
        assert rec.check(key)["resets"] == 1  # the stream from seq 0: every event once, in order
    assert stats["snapshots"] == 0 and stats["epoch_changes"] == 0, stats
    assert stats["stream_consumer_resets"] >= 1, stats  # the consumer died with its node at least once

    # The stream holds every message of every worker exactly once.
    # One node is down: a JetStream API call may land in a meta-leader election, so try again.
    by = seqs_by_incarnation(await patiently(lambda: stream_messages(cluster.urls, "CLJ", "clj.events.>")))
    for p, s in zip(pubs, pstats):
        assert sorted(by[(p.config.worker_id, p.epoch)]) == list(range(s["last_seq"] + 1))

    # Every worker gone, one node still down: a new subscriber rebuilds every view from the stream.
    late = await KvEventSubscriber(config).start()
    await wait_until(lambda: views_match(late, engines), 30, "late views == pools from the stream alone")
    lstats = late.stats
    assert lstats["snapshots"] == lstats["request_timeouts"] == lstats["duplicates"] == 0, lstats
    await late.close()
    await sub.close()
    await nc.close()


async def test_stream_replicas_refused_where_impossible_and_never_changed(js_cluster, nats_server, caplog):
    # More replicas than the cluster has JetStream servers, or R>1 on a single server: said plainly.
    with pytest.raises(JetStreamError, match=r"stream_replicas=5 .*more replicas than the cluster"):
        await KvEventPublisher(cfg(js_cluster, "clr", jetstream=True, stream_name="CLR5", stream_replicas=5)).start()
    single = Config(servers=nats_server.url, model=MODEL, subject_prefix="clr1", jetstream=True, stream_name="CLR1",
                    stream_replicas=3)  # fmt: skip
    with pytest.raises(JetStreamError, match=r"stream_replicas=3 .*single server"):
        await KvEventPublisher(single).start()
    with pytest.raises(JetStreamError, match=r"stream_replicas=3"):
        await KvEventSubscriber(single).start()

    # Whoever creates the stream sets its replicas; others adopt it and warn.
    first = await KvEventPublisher(cfg(js_cluster, "clr", "w0", jetstream=True, stream_name="CLR",
                                       stream_replicas=3)).start()  # fmt: skip
    caplog.set_level(logging.WARNING, logger="kvbridge")
    other = await KvEventPublisher(cfg(js_cluster, "clr", "w1", jetstream=True, stream_name="CLR",
                                       stream_replicas=1, stream_max_age_s=1800)).start()  # fmt: skip
    nc = await nats_connect(servers=js_cluster.urls)
    info = await nc.jetstream().stream_info("CLR")
    assert info.config.num_replicas == 3  # not scaled down ...
    assert info.config.max_age == pytest.approx(1800)  # ... while the other limits are updated in place
    assert any("3 replica(s)" in r.getMessage() and "stream_replicas=1" in r.getMessage() for r in caplog.records)
    await nc.close()
    for p in (first, other):
        await p.close()
