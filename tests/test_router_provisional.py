"""A router that learns from its own decisions: provisional residency, load since the last
report, replicas sharing decisions over a real nats-server (issue 17)."""

from __future__ import annotations

import functools
from collections import Counter

import pytest

from kvbridge import BlockStored, Index, KVEventBatch
from kvbridge.routing.provisional import ProvisionalResidency
from kvbridge.routing.router import Decision, report_loads
from kvbridge.routing.router import Router as _Router

#: Worked out in the requests-and-blocks cost (cost="blocks"); the time cost has its own tests
#: (tests/test_router_time.py).
Router = functools.partial(_Router, cost="blocks")
from kvbridge.routing.sync import RouteSync, decode_decision, encode_decision
from kvbridge.wire.events import LoadReport

from bridge_support import nats_connect, wait_until

BS = 4
PREFIX = list(range(1000, 1064))  # 16 full blocks nobody holds yet
#: A prompt of those 16 blocks and one more token: vLLM can hit all 16 (of PREFIX alone, whose
#: last token is computed for its logits, 15).
PROMPT = PREFIX + [7]
WORKERS = ["w0", "w1", "w2", "w3"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Reports:
    """What ``KvEventSubscriber.loads`` holds: (model, worker) -> (latest report, age in s)."""

    def __init__(self, loads: dict[str, int], ts: float) -> None:
        self.loads = {("m", w): (LoadReport(ts=ts, running=n), 0.1) for w, n in loads.items()}


def test_requests_routed_after_the_gauges_were_read_count_on_top_of_them():
    # The freshest gauges may be older than their report (another API server got the steps):
    # what was routed since they were read is not in them.
    import time

    now = time.time()
    reports = Reports({"w0": 1}, ts=now + 100)  # reported "later" than any routing here...
    for key, (r, age) in list(reports.loads.items()):
        reports.loads[key] = (LoadReport(ts=r.ts, running=r.running, gauges_ts=now - 10), age)  # ...read before
    router = Router(Index(BS), workers=WORKERS, loads=report_loads(reports, model="m"))
    router.choose(PROMPT, workers=["w0"])
    assert router.load("w0") == 1 + 1


def _burst(router: Router, n: int) -> list[str]:
    return [router.choose(PREFIX + [i])[0] for i in range(n)]  # the same 16 blocks, another last token


def test_a_burst_concentrates_where_the_first_request_went_until_its_load_spills():
    # The case: reports say {w0: 3, w1: 4, w2: 4, w3: 5}, taken before the burst.
    reports = report_loads(Reports({"w0": 3, "w1": 4, "w2": 4, "w3": 5}, ts=0.0), model="m")
    router = Router(Index(BS), workers=WORKERS, loads=reports)
    picks = _burst(router, 20)
    # w0 costs 16 + 3 first; then it holds the 16 blocks provisionally and costs 0 + 3 + k (its
    # report plus the k requests routed there since), against 16 + 4 for w1: w0 takes k = 0..16,
    # and at k = 17 (cost 20) it ties w1 and w2, so the rest spread by the cost formula.
    assert picks[:17] == ["w0"] * 17
    assert router.load("w0") == 3 + 17
    assert set(picks[17:]) <= {"w0", "w1", "w2"}
    assert router.stats["provisional_entries"] >= 16


def test_without_provisional_residency_the_burst_prefills_the_prefix_on_every_worker():
    reports = report_loads(Reports({"w0": 3, "w1": 4, "w2": 4, "w3": 5}, ts=0.0), model="m")
    router = Router(Index(BS), workers=WORKERS, loads=reports, provisional_ttl_s=0)
    picks = Counter(_burst(router, 20))
    # Load since the report still moves the choice (the report alone sent all 20 to w0), but
    # nothing tells the router that w0 is about to hold the prefix: all four prefill it.
    assert set(picks) == set(WORKERS)
    # Loads equalise: 3 + a = 4 + b = 4 + c = 5 + d with a + b + c + d = 20.
    assert picks == {"w0": 6, "w1": 5, "w2": 5, "w3": 4}


def test_load_is_the_report_plus_what_was_routed_after_it():
    clock_ts = 1_000.0
    reports = report_loads(Reports({"w0": 2}, ts=clock_ts), model="m")
    clock = FakeClock()
    router = Router(Index(BS), workers=["w0"], loads=reports, provisional_ttl_s=0, clock=clock)
    for clock.now in (clock_ts - 5, clock_ts + 5):
        router.choose(PROMPT)
    assert router.in_flight == {"w0": 2}
    # one request was sent before the report (the report counts it), one after
    assert router.routed_since("w0", clock_ts) == 1
    assert router.load("w0") == 2 + 1


def test_a_confirming_block_stored_ends_the_provisional_entry():
    index = Index(BS)
    router = Router(index, workers=WORKERS)
    worker, overlap = router.choose(PROMPT)
    assert overlap == 0
    assert router.stats["provisional_entries"] == 16
    # the worker ran the prefill: its events reach the index
    index.apply(worker, KVEventBatch(0.0, [BlockStored(list(range(1, 17)), None, PREFIX, BS, None, "GPU", None)]))
    assert router.costs(PROMPT)[worker] == 0 + 1  # all 16 held; one request in flight
    assert router.stats["provisional_confirmed"] == 1
    assert router.stats["provisional_entries"] == 0


def test_an_unconfirmed_entry_expires_after_its_ttl():
    router = Router(Index(BS), workers=WORKERS, provisional_ttl_s=2.0)
    clock = router.provisional.clock = FakeClock()
    worker, _ = router.choose(PROMPT)
    router.done(worker)
    clock.now += 1.9
    assert router.costs(PROMPT)[worker] == 0  # still provisionally held
    clock.now += 0.2
    assert router.costs(PROMPT)[worker] == 16  # expired: it must prefill like anyone
    assert router.stats["provisional_expired"] == 16
    assert router.stats["provisional_entries"] == 0


def test_the_cap_drops_the_oldest_entries_and_counts_them():
    p = ProvisionalResidency(2.0, max_entries=20)
    p.add("a", list(range(16)))
    p.add("b", list(range(100, 116)))
    assert len(p) == 16  # a's decision, the oldest, went whole
    assert p.stats["dropped"] == 16
    assert p.scores(list(range(16))) == {}
    assert p.scores(list(range(100, 116))) == {"b": 16}
    p.add("b", list(range(100, 108)) + [7])  # a renewed prefix and one more block: within the cap
    assert len(p) == 17 and p.scores(list(range(100, 108)) + [7]) == {"b": 9}
    with pytest.raises(ValueError, match=r"ttl_s \(Router: provisional_ttl_s\) must be a number of seconds >= 0"):
        ProvisionalResidency(-1)
    with pytest.raises(ValueError, match=r"max_entries \(Router: max_provisional\) must be an int >= 1"):
        Router(Index(BS), max_provisional=0)


class States:
    """What ``KvEventSubscriber.worker_states()`` answers: (model, worker) -> (state, epoch)."""

    def __init__(self) -> None:
        self.states: dict[tuple[str, str], tuple[str, str | None]] = {}

    def worker_states(self) -> dict[tuple[str, str], tuple[str, str | None]]:
        return dict(self.states)


def test_a_restarted_worker_loses_its_provisional_entries():
    sub = States()
    sub.states = {("m", w): ("exact", "epoch-1") for w in WORKERS}
    router = Router(Index(BS), workers=WORKERS, subscriber=sub, model="m")
    worker, _ = router.choose(PROMPT)
    assert router.stats["provisional_entries"] == 16
    sub.states[("m", worker)] = ("exact", "epoch-2")  # a new incarnation: its cache is empty
    assert router.costs(PROMPT)[worker] == 16 + 1
    assert router.stats["restarts_seen"] == 1
    assert router.stats["provisional_reset"] == 1
    # a worker that expired (gone from the subscriber) loses them too; so does one the caller
    # says restarted
    router.forget_worker(router.choose(PREFIX + [2])[0])
    assert router.stats["provisional_reset"] == 2
    other, _ = router.choose(PREFIX + [1])
    del sub.states[("m", other)]
    router.costs(PROMPT)
    assert router.stats["provisional_entries"] == 0


def test_a_resyncing_worker_is_scored_by_what_it_was_sent_only_and_still_routable():
    index = Index(BS)
    # w0 held the prefix before its stream broke; w1 holds it too, in order
    for w, first in (("w0", 1), ("w1", 101)):
        index.apply(w, KVEventBatch(0.0, [BlockStored(list(range(first, first + 16)), None, PREFIX, BS, None, "GPU", None)]))
    sub = States()
    sub.states = {("m", "w0"): ("resyncing", "e"), ("m", "w1"): ("exact", "e")}
    router = Router(index, workers=["w0", "w1", "w2"], subscriber=sub, model="m", loads={"w0": 0, "w1": 5, "w2": 0})
    # w0's index score is not trusted while it resyncs: it costs a full prefill
    assert router.costs(PROMPT) == {"w0": 16.0, "w1": 5.0, "w2": 16.0}
    assert router.stats["workers"] == {"w0": "resyncing", "w1": "exact", "w2": "provisional-only"}
    # sent there anyway (w1 too busy), it is then scored by provisional residency
    router.loads = {"w0": 0, "w1": 50, "w2": 1}
    assert router.choose(PROMPT)[0] == "w0"
    assert router.costs(PROMPT)["w0"] == 0.0


# -- replicas over NATS ---------------------------------------------------------------------------


def test_decisions_round_trip_and_malformed_ones_are_refused():
    d = Decision("route", "r1", 7, "w0", 123.5, [1, 2**64 - 1])
    assert decode_decision(encode_decision(d)) == d
    for bad, why in ((b"\x93\x01\x02\x03", "not a routing decision"),
                     (encode_decision(d._replace(op="nope")), "op must be"),  # type: ignore[arg-type]
                     (encode_decision(d._replace(worker="")), "non-empty")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            decode_decision(bad)


async def _synced(url: str, index: Index, **kw) -> tuple[Router, RouteSync]:
    router = Router(index, workers=WORKERS, **kw)
    sync = await RouteSync(router, servers=[url], model="m").start()
    return router, sync


async def test_two_replicas_route_a_burst_as_one_router(nats_server):
    index = Index(BS)  # both replicas read the same (empty) view of the fleet
    r1, s1 = await _synced(nats_server.url, index, seed=1)
    r2, s2 = await _synced(nats_server.url, index, seed=2)
    try:
        first, _ = r1.choose(PROMPT)
        await wait_until(lambda: s2.stats["applied"] == 1, 10.0, "replica 2 to hear replica 1's decision")
        # the second replica sends the same new prefix where the first did, and counts that request's load
        assert r2.choose(PREFIX + [5])[0] == first
        await wait_until(lambda: s1.stats["applied"] == 1, 10.0, "replica 1 to hear replica 2's decision")
        assert r1.load(first) == r2.load(first) == 2
        r1.done(first)
        await wait_until(lambda: r2.load(first) == 1, 10.0, "replica 2 to hear that the request ended")
        # each heard its own messages back and skipped them (replica 1: its choice and its done)
        await wait_until(lambda: s1.stats["own"] == 2 and s2.stats["own"] == 1, 10.0, "each replica's own messages")
    finally:
        await s1.close()
        await s2.close()


async def test_a_restarted_replica_converges_and_malformed_messages_are_ignored(nats_server):
    index = Index(BS)
    r1, s1 = await _synced(nats_server.url, index, seed=1)
    r2, s2 = await _synced(nats_server.url, index, seed=2)
    try:
        first, _ = r1.choose(PROMPT)
        await s2.close()  # replica 2 dies mid-burst ...
        r1.choose(PREFIX + [1])
        # that decision is routed by the server before the fresh replica subscribes: it is not one
        # the new replica hears (else it may hear two, and 'applied == 1' below never holds)
        await wait_until(lambda: s1.stats["published"] == 2, 10.0, "replica 1 to publish its second decision")
        await s1._nc.flush()
        r2, s2 = await _synced(nats_server.url, index, seed=3)  # ... and a fresh one takes its place
        assert r2.stats["provisional_entries"] == 0
        r1.choose(PREFIX + [2])  # the burst goes on: the new replica hears the next decision
        await wait_until(lambda: s2.stats["applied"] == 1, 10.0, "the new replica to hear a decision")
        assert r2.choose(PREFIX + [3])[0] == first
        nc = await nats_connect(nats_server.url)
        try:
            await nc.publish("kv.route.m", b"not msgpack at all")
            await nc.flush()
        finally:
            await nc.close()
        await wait_until(lambda: s2.stats["malformed"] == 1 and s1.stats["malformed"] == 1, 10.0, "the junk to be counted")
        assert r2.choose(PREFIX + [4])[0] == first  # and nothing else changed
    finally:
        await s1.close()
        await s2.close()


async def test_a_worker_restart_seen_by_a_real_subscriber_drops_what_it_was_sent(nats_server):
    """Through a real subscriber: the worker's publisher restarts (a new epoch, its cache empty),
    and the router forgets the blocks it provisionally sent there."""
    from kvbridge import Config, KvEventPublisher, KvEventSubscriber

    cfg = Config(servers=nats_server.url, model="prov-restart", heartbeat_s=0.2, reconnect_wait_s=0.2)
    index = Index(BS)
    async with KvEventSubscriber(cfg, model="prov-restart", index=index) as sub:
        pub = await KvEventPublisher(cfg.replace(worker_id="w0")).start()
        await wait_until(lambda: ("prov-restart", "w0") in sub.worker_states(), 10, "the worker to be heard")
        epoch = sub.worker_states()[("prov-restart", "w0")][1]
        router = Router(index, workers=["w0"], subscriber=sub, model="prov-restart")
        assert router.choose(PROMPT)[0] == "w0"
        assert router.stats["provisional_entries"] == 16
        await pub.close()
        pub = await KvEventPublisher(cfg.replace(worker_id="w0")).start()
        try:
            await wait_until(lambda: sub.worker_states().get(("prov-restart", "w0"), (None, epoch))[1] != epoch,
                             10, "the restarted worker's new epoch")  # fmt: skip
            router.costs(PROMPT)
            assert router.stats["restarts_seen"] == 1
            assert router.stats["provisional_entries"] == 0
        finally:
            await pub.close()


def test_an_all_blocks_cleared_drops_the_provisional_entries():
    from kvbridge import AllBlocksCleared

    index = Index(BS)
    index.apply("w0", KVEventBatch(0.0, [BlockStored([77], None, [9, 9, 9, 9], BS, None, "GPU", None)]))
    router = Router(index, workers=["w0"])
    router.choose(PROMPT)
    assert router.stats["provisional_entries"] == 16
    router.costs(PROMPT)  # nothing cleared: the entries stay
    assert router.stats["provisional_entries"] == 16
    index.apply("w0", KVEventBatch(0.0, [AllBlocksCleared()]))  # the worker's cache was reset
    assert index.clears("w0") == 1 and index.clears("nobody") is None
    assert router.costs(PROMPT)["w0"] == 16 + 1
    assert router.stats["provisional_reset"] == 1 and router.stats["provisional_entries"] == 0
    # a worker the index first hears of after the choice is not "cleared" by that
    router.choose(PROMPT, workers=["new"])
    index.apply("new", KVEventBatch(0.0, [BlockStored([78], None, [8, 8, 8, 8], BS, None, "GPU", None)]))
    assert router.costs(PROMPT, workers=["new"])["new"] == 0 + 1
