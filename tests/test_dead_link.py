"""Half-open connections: a network path that dies without a FIN or RST (tests/freezing_proxy.py
plays one) between a kvbridge client and its NATS server. The client notices within its keepalive
budget (ping_interval_s, max_outstanding_pings), reconnects, and nothing is lost: a publisher's
swallowed messages are replayed from its ring, a subscriber resyncs, and a subscriber whose own
link died never expires the workers it could not hear."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import struct
import termios
import time
from typing import Any

import pytest

from bridge_support import Engine, Recorder, views_match, wait_until
from freezing_proxy import FreezingProxy
from kvbridge import BackgroundPublisher, Config, ConfigError, KvEventPublisher, KvEventSubscriber
from kvbridge.tools.server import NatsCluster
from test_jetstream import seqs_by_incarnation, stream_messages

pytestmark = pytest.mark.timeout(120)
MODEL = "m"
# Reconnecting, and a loaded 2-core machine, on top of the keepalive's own detection time.
SLACK_S = 5.0


def cfg(servers, prefix: str, worker: str = "w0", **kw) -> Config:
    base = dict(servers=servers, model=MODEL, worker_id=worker, subject_prefix=prefix, heartbeat_s=0.5,
                reconnect_wait_s=0.2, connect_timeout_s=1.0, request_timeout_s=1.0)  # fmt: skip
    base.update(kw)
    return Config(**base)


def connected_to(client: KvEventPublisher | KvEventSubscriber) -> str | None:
    nc = client._nc
    return nc.connected_url.geturl() if nc.is_connected else None


def write_buffered(client: KvEventPublisher | KvEventSubscriber) -> int:
    """Bytes the client's socket has queued in user space: a path that acknowledges nothing
    fills the kernel's buffers first."""
    writer = getattr(client._nc._transport, "_io_writer", None)
    return writer.transport.get_write_buffer_size() if writer is not None and not writer.is_closing() else 0


def keepalive_bound(config: Config) -> float:
    """Seconds from a freeze to a new connection: the keepalive notices within
    ping_interval_s * (max_outstanding_pings + 1); then it reconnects."""
    return config.ping_interval_s * (config.max_outstanding_pings + 1) + SLACK_S


class Fleet:
    """Publishers with an engine thread each, one subscriber recording every update, and the
    proxies between some of them and NATS (closed with the fleet)."""

    def __init__(self, pubs: list[KvEventPublisher], sub: KvEventSubscriber, rec: Recorder, seed: int,
                 proxies: list[FreezingProxy], step_sleep: float) -> None:  # fmt: skip
        self.pubs, self.sub, self.rec, self.proxies = pubs, sub, rec, proxies
        self.engines = {
            (MODEL, p.config.worker_id): Engine(p, 10**9, seed=seed + i, step_sleep=step_sleep)
            for i, p in enumerate(pubs)
        }

    @classmethod
    async def start(cls, pub_configs: list[Config], sub_config: Config, seed: int, proxies: list[FreezingProxy],
                    step_sleep: float = 0.005) -> Fleet:  # fmt: skip
        rec = Recorder()
        clients: list[Any] = []
        try:  # a start that fails partway leaves no client, proxy or engine thread behind
            clients.append(await KvEventSubscriber(sub_config, on_update=rec).start())
            for c in pub_configs:
                clients.append(await KvEventPublisher(c).start())
        except BaseException:
            await close_each(clients, proxies)
            raise
        fleet = cls(clients[1:], clients[0], rec, seed, proxies, step_sleep)
        try:
            for e in fleet.engines.values():
                e.start()
            await fleet.wait_events(300, "events before the freeze")
        except BaseException:
            await fleet.close()
            raise
        return fleet

    async def wait_events(self, n: int, what: str) -> None:
        start = {key: e.published for key, e in self.engines.items()}
        await wait_until(lambda: all(e.published > start[key] + n for key, e in self.engines.items()), 30, what)

    async def kill_path(self, dead: FreezingProxy, clients: list[Any], bound: float, *, new_connections: bool = True,
                        hold: bool = False) -> tuple[float, dict[str, int], float]:  # fmt: skip
        """Freezes ``dead`` and waits up to ``bound`` s for each of ``clients`` (the ones behind it)
        to find its link dead and connect again (elsewhere, unless ``new_connections``), then for
        traffic, then ``finish``. Returns the seconds to reconnect; what the dead path did (bytes
        it dropped ``to_server`` / ``to_client``, the most it ``held`` unread, the most the clients
        had ``buffered`` unsent meanwhile); the seconds the views took."""
        before = [c.stats["link_failures"] for c in clients]
        barred = None if new_connections else dead.url
        fault = {"held": 0, "buffered": 0}

        def recovered() -> bool:
            fault["held"] = max(fault["held"], dead.held_bytes())
            fault["buffered"] = max(fault["buffered"], sum(map(write_buffered, clients)))
            return all(c.stats["link_failures"] > n and connected_to(c) not in (None, barred)
                       for c, n in zip(clients, before))  # fmt: skip

        dead.freeze(new_connections=new_connections, hold=hold)
        took = await wait_until(recovered, bound, f"{len(clients)} client(s) behind the dead path connected again")
        fault.update(dead.dropped)
        await self.wait_events(300, "events after the reconnect")
        return took, fault, await self.finish()

    async def finish(self) -> float:
        """Stops the engines; once every view equals its pool, checks that every worker's updates
        came in order, exactly once, from a single snapshot (nothing lost: no resync was needed
        beyond first contact) and that nobody was expired. Seconds the views took."""
        for e in self.engines.values():
            e.stop_flag.set()
        for e in self.engines.values():
            await asyncio.to_thread(e.finish)
        waited = await wait_until(lambda: views_match(self.sub, self.engines), 60, "views == pools after the freeze")
        for key in self.engines:
            counts = self.rec.check(key)
            # First contact only: replays filled every hole.
            assert counts["resets"] == 1, (key, counts, self.engines[key].publisher.stats, self.sub.stats)
        stats = self.sub.stats
        assert stats["expired"] == 0 and stats["epoch_changes"] == 0 and stats["malformed"] == 0, stats
        return waited

    async def close(self) -> None:
        for e in self.engines.values():
            e.stop_flag.set()
        for e in self.engines.values():
            if e.ident is not None:  # started (a failed start may not have started them all)
                await asyncio.to_thread(e.join, 30)
        await close_each(self.pubs, [self.sub], self.proxies)


async def close_each(*groups: Any) -> None:
    """Close every client and proxy, the rest too if one raises (the first error is raised)."""
    error: BaseException | None = None
    for group in groups:
        for c in group:
            try:
                await c.close()
            except BaseException as exc:
                error = error or exc
    if error is not None:
        raise error


async def test_publisher_behind_a_dead_path_reconnects_and_resends(nats_server, caplog):
    caplog.set_level(logging.WARNING, logger="kvbridge")
    proxy = await FreezingProxy(nats_server.port).start()
    pub_cfg = cfg(proxy.url, "dlp")  # default keepalive: ping_interval_s 1.0, max_outstanding_pings 2
    fleet = await Fleet.start([pub_cfg], cfg(nats_server.url, "dlp", "sub"), 300, [proxy])
    pub = fleet.pubs[0]
    try:
        took, dropped, waited = await fleet.kill_path(proxy, [pub], keepalive_bound(pub_cfg))
    finally:
        await fleet.close()
    print(f"\npublisher reconnected {took:.2f}s after the freeze; {dropped} bytes dropped by the dead path; views "
          f"converged {waited:.2f}s after the engine stopped; publisher {pub.stats}; subscriber {fleet.sub.stats}")  # fmt: skip
    assert dropped["to_server"] > 0  # the freeze swallowed events (and PINGs)
    assert fleet.sub.stats["replays"] >= 1  # ...which came back from the ring
    assert pub.stats["link_failures"] == 1 and pub.stats["reconnects"] == 1
    assert took > pub_cfg.ping_interval_s * pub_cfg.max_outstanding_pings  # not before its budget
    # The log says who went silent and how it was noticed.
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"nats://127.0.0.1:{proxy.port}: no PONG, nothing received for " in m
               and "(2 PINGs unanswered): dead link" in m
               for m in messages), messages  # fmt: skip


async def test_busy_publisher_behind_a_path_that_holds_its_bytes(nats_server):
    """Nothing acknowledged: the publisher's buffers fill and its socket cannot close cleanly (a
    close waits for them to drain). The dead link is aborted, and the ring re-sends."""
    proxy = await FreezingProxy(nats_server.port).start()
    pub_cfg = cfg(proxy.url, "dlh")
    # Fast enough to fill the buffers within the freeze, not so fast that hand-offs overflow the
    # publisher's queue while its sends wait (that is a loss, counted, and resynced by snapshot).
    fleet = await Fleet.start([pub_cfg], cfg(nats_server.url, "dlh", "sub"), 350, [proxy], step_sleep=0.0001)
    pub = fleet.pubs[0]
    try:
        took, fault, waited = await fleet.kill_path(proxy, [pub], keepalive_bound(pub_cfg), hold=True)
    finally:
        await fleet.close()
    print(f"\nbusy publisher reconnected {took:.2f}s after the freeze (held); {fault}; views converged "
          f"{waited:.2f}s after the engine stopped; publisher {pub.stats}; subscriber {fleet.sub.stats}")  # fmt: skip
    assert fault["held"] > 0 and fault["buffered"] > 0, fault
    assert pub.stats["link_failures"] == 1 and fleet.sub.stats["replays"] >= 1


@pytest.mark.parametrize("found_by", ["keepalive", "probe"])
async def test_subscriber_behind_a_dead_path_expires_nobody(nats_server, caplog, found_by):
    """keepalive: the default keepalive notices first. probe: a keepalive too slow to notice
    (60 s), so the workers look silent past worker_timeout_s, and the subscriber's PING before
    expiring them finds its own link dead instead."""
    caplog.set_level(logging.WARNING, logger="kvbridge")
    proxy = await FreezingProxy(nats_server.port).start()
    prefix = f"dls{found_by}"
    if found_by == "keepalive":
        sub_cfg = cfg(proxy.url, prefix, "sub")
        bound = keepalive_bound(sub_cfg)
    else:
        sub_cfg = cfg(proxy.url, prefix, "sub", ping_interval_s=60.0, worker_timeout_s=1.5)
        bound = sub_cfg.worker_timeout_s + 1.0 + sub_cfg.request_timeout_s + SLACK_S  # + one expiry sweep
    fleet = await Fleet.start([cfg(nats_server.url, prefix, f"w{i}") for i in range(2)], sub_cfg, 310, [proxy])
    sub = fleet.sub
    try:
        took, dropped, waited = await fleet.kill_path(proxy, [sub], bound)
    finally:
        await fleet.close()
    print(f"\nsubscriber ({found_by}) reconnected {took:.2f}s after the freeze; {dropped} bytes dropped; views "
          f"converged {waited:.2f}s after the engines stopped; {sub.stats}")  # fmt: skip
    assert dropped["to_client"] > 0  # events swallowed on their way in
    assert sub.stats["replays"] >= 1 and sub.stats["link_failures"] == 1
    messages = [r.getMessage() for r in caplog.records]
    if found_by == "probe":
        assert took > sub_cfg.worker_timeout_s  # the probe, not the keepalive
        assert any("after a probe PING (2 worker(s) silent past their timeout)" in m for m in messages), messages
    else:
        assert dropped["to_server"] > 0  # the keepalive's PINGs swallowed on their way out
        assert any("2 PINGs unanswered" in m for m in messages), messages


async def test_jetstream_publisher_and_subscriber_behind_one_dead_path(nats_server):
    """JetStream: the publisher re-sends what the stream did not acknowledge, the subscriber's
    stream consumer picks up where it was; the stream ends holding every message exactly once."""
    proxy = await FreezingProxy(nats_server.port).start()
    js = dict(jetstream=True, stream_name="DLJ")
    fleet = await Fleet.start([cfg(proxy.url, "dlj", **js)], cfg(proxy.url, "dlj", "sub", **js), 340, [proxy])
    pub, sub = fleet.pubs[0], fleet.sub
    try:
        took, dropped, waited = await fleet.kill_path(proxy, [pub, sub], keepalive_bound(sub.config))
        await pub.close(timeout=30)  # JetStream: closed means stored
    finally:
        await fleet.close()
    stats = pub.stats
    print(f"\nJetStream publisher and subscriber reconnected {took:.2f}s after the freeze; {dropped} bytes dropped; "
          f"converged {waited:.2f}s after the engine stopped; publisher {stats}; subscriber {sub.stats}")  # fmt: skip
    assert dropped["to_server"] > 0 and dropped["to_client"] > 0
    assert stats["js_unacked"] == 0, stats
    by = seqs_by_incarnation(await stream_messages(nats_server.url, "DLJ", "dlj.events.>"))
    assert sorted(by[("w0", pub.epoch)]) == list(range(stats["last_seq"] + 1))


async def test_cluster_node_behind_a_dead_path_its_peers_take_over():
    """Every node behind a proxy; the subscriber's node's path dies, new connections to it too (a
    dead node): the subscriber and any publisher there move to the other nodes."""
    with NatsCluster(3, extra_args=["--no_advertise"]) as cluster:  # clients know the proxies only
        proxies = [await FreezingProxy(node.port).start() for node in cluster.nodes]
        urls = [p.url for p in proxies]
        fleet = await Fleet.start([cfg(urls, "dlc", f"w{i}") for i in range(3)], cfg(urls, "dlc", "sub"), 330, proxies)
        sub = fleet.sub
        try:
            dead = proxies[urls.index(sub.connected_url)]
            on_dead = [p for p in fleet.pubs if connected_to(p) == dead.url]
            bound = keepalive_bound(sub.config) + 2 * sub.config.connect_timeout_s  # may retry the dead node
            took, dropped, waited = await fleet.kill_path(dead, [sub, *on_dead], bound, new_connections=False)
        finally:
            await fleet.close()
    print(f"\nnode {urls.index(dead.url)} frozen: subscriber and {len(on_dead)} publisher(s) moved in {took:.2f}s; "
          f"{dropped} bytes dropped; converged {waited:.2f}s after the engines stopped; {sub.stats}")  # fmt: skip
    assert dropped["to_client"] > 0


async def test_a_closed_connection_is_no_dead_link(own_nats_server, caplog):
    """A server that goes away closes its sockets: an ordinary reconnect, not counted or logged as
    a dead link (nats-py files the EOF under "stale connection")."""
    caplog.set_level(logging.WARNING, logger="kvbridge")
    pub = await KvEventPublisher(cfg(own_nats_server.url, "dle")).start()
    try:
        await asyncio.to_thread(own_nats_server.kill)
        await asyncio.to_thread(own_nats_server.start)
        await wait_until(lambda: pub.stats["reconnects"] == 1, 30, "the publisher reconnecting")
    finally:
        await pub.close()
    assert pub.stats["link_failures"] == 0
    assert not any("dead link" in r.getMessage() for r in caplog.records)


async def test_a_subscriber_far_behind_is_no_dead_link(nats_server):
    """A subscriber whose loop is starved reads its PONG only after seconds of queued events: the
    link works, so it stays (any byte received counts as an answer), and nothing is lost."""
    sub_cfg = cfg(nats_server.url, "dlb", "sub", ping_interval_s=0.25)  # notices a dead path in 0.75 s
    sub = await KvEventSubscriber(sub_cfg).start()
    pub = BackgroundPublisher(cfg(nats_server.url, "dlb", "w0")).start()
    engine = Engine(pub, 10**9, seed=360)  # full speed: far more than the starved loop reads
    engine.start()
    backlog = 0
    try:
        await wait_until(lambda: sub.stats["workers"] == 1 and sub.in_sync(), 30, "the worker in sync before the starving")
        sock = sub._nc._transport._io_writer.transport.get_extra_info("socket")
        # The fault: the loop starved (blocked 300 ms at a time, free a moment in between) for at
        # least the 0.75 s the keepalive takes to call a link dead, and until the socket holds
        # 256 KiB unread (its PONGs that far behind); at most 4.5 s, well within what the server
        # allows a slow consumer.
        for starved in range(15):
            time.sleep(0.3)
            backlog = max(backlog, struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0])
            await asyncio.sleep(0)
            if starved >= 5 and backlog > 256 * 1024:
                break
        engine.stop_flag.set()
        await asyncio.to_thread(engine.finish)
        waited = await wait_until(lambda: views_match(sub, {(MODEL, "w0"): engine}), 60, "views == pools")
    finally:
        engine.stop_flag.set()
        await asyncio.to_thread(engine.join, 30)
        await asyncio.to_thread(pub.close)
        await sub.close()
    print(f"\nstarved subscriber: up to {backlog} bytes queued unread; converged {waited:.2f}s after the engine "
          f"stopped; {sub.stats}")  # fmt: skip
    assert backlog > 256 * 1024  # its PONGs were that far behind
    assert sub.stats["link_failures"] == 0 and sub.stats["reconnects"] == 0, sub.stats


def test_keepalive_options_checked():
    for bad in (0, -1.0, float("inf"), "1"):
        with pytest.raises(ConfigError, match=r"ping_interval_s \(KVBRIDGE_PING_INTERVAL_S\)"):
            Config(ping_interval_s=bad)
    for bad in (0, 1.5, True, None):
        with pytest.raises(ConfigError, match=r"max_outstanding_pings \(KVBRIDGE_MAX_OUTSTANDING_PINGS\): must be"):
            Config(max_outstanding_pings=bad)
    config = Config.from_env({"KVBRIDGE_PING_INTERVAL_S": "0.25", "KVBRIDGE_MAX_OUTSTANDING_PINGS": "4"})
    opts = config.connect_options()
    assert (opts["ping_interval"], opts["max_outstanding_pings"]) == (0.25, 4)
    assert (Config().ping_interval_s, Config().max_outstanding_pings) == (1.0, 2)
