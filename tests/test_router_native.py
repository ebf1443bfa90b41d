"""The router's native core (rust/route.rs) against a plain model of the time cost written from
routing/work.py's module doc with :class:`EngineModel`'s formulas: every worker's requests in
flight, its queued prompt work (drained as the engine computes it, reset by first tokens), its decode
step, the hit capped as vLLM caps it; and provisional residency read from where a worker's own
hit ends."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings, strategies as st

from kvbridge import Index
from kvbridge.routing.router import Router
from kvbridge.routing.work import EngineModel
from kvbridge.wire.events import LoadReport

from router_support import BS, Clock, store

ENGINE = EngineModel()
WORKERS = ["a", "b", "c"]




@dataclass
class Sent:
    prompt: int
    uncached: float
    first: bool = False


@dataclass
class Worker:
    """What the model keeps per worker: its requests in flight, oldest first."""

    flights: dict[int, Sent] = field(default_factory=dict)
    queued: float = 0.0
    anchor: float = 0.0

    def drained(self, now: float, step: float) -> float:
        """Past a pass's worth at the full passes' speed; within one pass, over its whole time."""
        q = self.queued
        if q > 0 and now > self.anchor:
            if q > ENGINE.max_num_batched_tokens:
                q = max(0.0, q - (now - self.anchor) * (ENGINE.tokens_per_ms(step) * 1000.0))
            else:
                pass_ms = ENGINE.prompt_ms(q, step)
                q = max(0.0, q * (1.0 - (now - self.anchor) * 1000.0 / pass_ms)) if pass_ms > 0 else 0.0
        return q

    def requeue(self, now: float) -> None:
        self.queued = sum(f.uncached for f in self.flights.values() if not f.first)
        self.anchor = now

    @property
    def decoding(self) -> int:
        return sum(f.prompt for f in self.flights.values() if f.first)


def model_costs(
    held: dict[str, int], fleet: dict[str, Worker], reports: dict[str, LoadReport], n: int, now: float
) -> dict[str, tuple[float, float]]:
    """Per worker (predicted ms, uncached tokens) for a prompt of ``n`` tokens."""
    cap = (n - 1) // BS
    rows, idle = {}, []
    for w in WORKERS:
        h, work, rep = held.get(w, 0), fleet[w], reports.get(w)
        if not h and not work.flights and (rep is None or not rep.running):
            idle.append(w)
            continue
        todo = n - min(h, cap) * BS
        decoding = float(work.decoding)
        if rep is not None and rep.running:
            decoding = max(decoding, rep.kv_cache_usage * ENGINE.kv_capacity_tokens)
        step = ENGINE.decode_ms(decoding) if decoding else 0.0
        queued = work.drained(now, step) if work.flights else 0.0
        rows[w] = (todo, queued, step)
    weight = 1.0
    if not idle:
        weight *= 1.0 + 2.0 * min(r[1] for r in rows.values()) / ENGINE.max_num_batched_tokens
    out = {w: (ENGINE.prompt_ms(q + weight * todo, step), float(todo)) for w, (todo, q, step) in rows.items()}
    out.update({w: (ENGINE.prompt_ms(weight * n, 0.0), float(n)) for w in idle})
    return out


op = st.one_of(
    st.tuples(st.just("choose"), st.integers(0, 3), st.integers(1, 900)),  # prefix id, tail tokens
    st.tuples(st.just("first"), st.integers(0, 40), st.just(0)),
    st.tuples(st.just("done"), st.integers(0, 40), st.just(0)),
    st.tuples(st.just("wait"), st.integers(1, 400), st.just(0)),  # ms
    st.tuples(st.just("report"), st.integers(0, 2), st.integers(0, 100)),  # worker, kv use %
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op, max_size=40), stored=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), max_size=4))
def test_the_core_weighs_and_keeps_what_the_model_does(ops, stored):
    prefixes = [[p * 10_000 + i for i in range(40 * BS)] for p in range(4)]
    index = Index(BS)
    for w, p in stored:
        store(index, WORKERS[w], prefixes[p][: (10 + 10 * p) * BS])
    reports: dict[str, LoadReport] = {}
    clock = Clock()
    router = Router(index, block_size=BS, workers=WORKERS, clock=clock, provisional_ttl_s=0, reports=reports.get)
    fleet = {w: Worker() for w in WORKERS}
    where: dict[int, str] = {}
    for rid, (kind, x, y) in enumerate(ops):
        if kind == "choose":
            prompt = prefixes[x] + [7] * y
            held = {w: n for w, n in index.find_matches(prompt).items()}
            expected = model_costs(held, fleet, reports, len(prompt), clock.t)
            costs = router.costs(prompt)
            assert costs == pytest.approx({w: c for w, (c, _) in expected.items()}, rel=1e-12)
            worker, hit = router.choose(prompt, request_id=rid)
            assert costs[worker] == min(costs.values()) and hit == held.get(worker, 0)
            work = fleet[worker]
            work.queued, work.anchor = work.drained(clock.t, ENGINE.decode_ms(0.0)) + expected[worker][1], clock.t
            work.flights[rid] = Sent(len(prompt), expected[worker][1])
            where[rid] = worker
        elif kind in ("first", "done") and where:
            x = sorted(where)[x % len(where)]  # one of the requests in flight
            worker = where[x]
            work = fleet[worker]
            if kind == "first":
                router.first_token(worker, x)
                if not work.flights[x].first:
                    work.flights[x].first = True
                    work.requeue(clock.t)
            else:
                router.done(worker, x)
                sent = work.flights.pop(x)
                del where[x]
                if not sent.first:
                    work.requeue(clock.t)
                if not work.flights:
                    fleet[worker] = Worker()
        elif kind == "wait":
            clock.t += x / 1000.0
        elif kind == "report":
            reports[WORKERS[x]] = LoadReport(ts=clock.t, kv_cache_usage=y / 100, running=1 if y else 0)
    assert router.in_flight == {w: len(f.flights) for w, f in fleet.items() if f.flights}


def test_provisional_residency_adds_only_what_the_worker_does_not_hold():
    """A worker holding a long prefix by its own events is sent only the prompt's blocks past
    it; its score is its hit extended by them; once its events hold them too, they are confirmed."""
    clock = Clock()
    index = Index(BS)
    prefix = list(range(20 * BS))
    store(index, "a", prefix)
    router = Router(index, block_size=BS, workers=["a", "b"], clock=clock)
    first = prefix + list(range(50_000, 50_000 + 10 * BS)) + [1]
    assert router.choose(first, request_id=1) == ("a", 20)
    assert len(router.provisional) == 10  # the 10 blocks past the hit, not all 30
    # The same conversation's next turn: "a" scores 30 blocks (20 held, 10 just sent).
    nxt = first[:-1] + list(range(60_000, 60_000 + 5 * BS)) + [2]
    router.done("a", 1)
    assert router.costs(nxt)["a"] == pytest.approx(ENGINE.prefill_ms(len(nxt) - 30 * BS), rel=1e-12)
    # Its events now hold all 30 blocks: what was sent is confirmed, nothing provisional stays.
    store(index, "a", first)
    router.costs(nxt)
    assert len(router.provisional) == 0 and router.provisional.stats["confirmed"] == 1
    # A worker without a hit is sent the chain from the first block.
    other = list(range(90_000, 90_000 + 8 * BS)) + [3]
    worker, hit = router.choose(other)
    assert hit == 0 and router.provisional.scores(router.block_keys(other)) == {worker: 8}


class Subscriber:
    """What ``KvEventSubscriber.loads`` holds: (model, worker) -> (latest report, age in s)."""

    def __init__(self) -> None:
        self.loads: dict[tuple[str, str], tuple[LoadReport, float]] = {}

    def report(self, worker: str, kv: float) -> None:
        self.loads[("m", worker)] = (LoadReport(ts=0.0, kv_cache_usage=kv, running=3), 0.1)


def test_a_report_loads_is_read_in_bulk_each_time_its_reports_refresh():
    """``reports=ReportLoads`` (the subscriber's reports): the core gets them when they refresh,
    and weighs each worker's KV-cache use as a callable's reports would be weighed."""
    from kvbridge.routing.router import ReportLoads

    sub = Subscriber()
    sub.report("a", 0.9)
    sub.report("b", 0.0)
    clock = Clock()
    loads = ReportLoads(sub, model="m", refresh_s=0.0)
    kw = dict(block_size=BS, workers=["a", "b"], clock=clock, provisional_ttl_s=0)
    router = Router(Index(BS), reports=loads, **kw)
    same = Router(Index(BS), reports=loads.report, **kw)
    prompt = list(range(100))
    costs = router.costs(prompt)
    assert costs == same.costs(prompt)
    assert costs["a"] == pytest.approx(ENGINE.prompt_ms(100, ENGINE.decode_ms(0.9 * ENGINE.kv_capacity_tokens)))
    assert router.choose(prompt)[0] == "b"
    sub.report("b", 0.95)  # b's cache fills: the next decision reads it
    clock.t += 1.0  # b's prompt went through
    assert router.costs(prompt)["b"] == pytest.approx(ENGINE.prompt_ms(100, ENGINE.decode_ms(0.95 * ENGINE.kv_capacity_tokens)))


def test_a_report_loads_gives_no_reports_while_its_stream_is_down():
    """``ReportLoads(live=...)``: while ``live()`` is False the router is told no reports (as a
    router without them: its own accounting decides), and reads them afresh once it is True."""
    from kvbridge.routing.router import ReportLoads

    sub = Subscriber()
    sub.report("a", 0.9)
    sub.report("b", 0.0)
    up = [True]
    clock = Clock()
    loads = ReportLoads(sub, model="m", refresh_s=0.0, live=lambda: up[0])
    kw = dict(block_size=BS, workers=["a", "b"], clock=clock, provisional_ttl_s=0)
    router = Router(Index(BS), reports=loads, **kw)
    blind = Router(Index(BS), **kw)
    prompt = list(range(100))
    told = router.costs(prompt)
    assert told != blind.costs(prompt)  # a's cache is 90% full: its decode steps weigh
    up[0] = False
    clock.t += 1.0
    assert loads.report("a") is None and loads("a") is None
    assert router.costs(prompt) == blind.costs(prompt)
    sub.report("a", 0.5)  # a report taken while down is read once the stream is back
    up[0] = True
    clock.t += 1.0
    assert loads.report("a").kv_cache_usage == 0.5
    assert router.costs(prompt)["a"] == pytest.approx(ENGINE.prompt_ms(100, ENGINE.decode_ms(0.5 * ENGINE.kv_capacity_tokens)))
    with pytest.raises(TypeError, match="live must be a callable"):
        ReportLoads(sub, live=True)


@settings(max_examples=200, deadline=None)
@given(
    scores=st.dictionaries(
        st.sampled_from(WORKERS),
        st.one_of(
            st.integers(0, 40),
            st.dictionaries(st.sampled_from([None, "GPU", "CPU", "DISK", "NVME"]), st.integers(0, 40), max_size=4),
        ),
        min_size=1,
    ),
    blocks=st.integers(0, 48),
)
def test_the_core_counts_each_block_at_the_best_tier_as_tiered_overlap_does(scores, blocks):
    from kvbridge.routing.router import DEFAULT_MEDIUM_WEIGHTS, tiered_overlap

    router = Router(block_size=BS, workers=WORKERS, cost="blocks")  # costs: blocks - overlap + requests
    held = {w: tiered_overlap(s, DEFAULT_MEDIUM_WEIGHTS) if isinstance(s, dict) else s for w, s in scores.items()}
    costs = router.costs_from_scores(scores, blocks)
    assert costs == {w: float(blocks - min(held.get(w, 0), blocks)) for w in WORKERS}


def test_reads_from_another_thread_wait_for_a_decision_that_released_the_gil():
    """A prompt of 4,096 blocks or more is read from the index with the GIL released while the
    core is held: another thread reading the router meanwhile waits for the decision (the
    router's lock), where the core would refuse it ("already borrowed")."""
    import threading

    index = Index(BS)
    long = list(range(70_000))  # 4,375 blocks
    store(index, "a", long[: 4096 * BS])
    router = Router(index, block_size=BS, workers=["a", "b"], cost="blocks", loads={"a": 0.0})
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                router.in_flight, router.load("a"), router.routed_since("a", 0.0), router.stats
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(30):
            router.choose(long + [i], request_id=i)
    finally:
        done.set()
        reader.join()
    assert errors == []
    assert sum(router.in_flight.values()) == 30


def test_settings_the_core_holds_cannot_be_changed_after_construction():
    router = Router(Index(BS), workers=["a"], overlap_weight=1.0)
    with pytest.raises(AttributeError, match="Router.overlap_weight is fixed at construction"):
        router.overlap_weight = 2.0
    with pytest.raises(AttributeError, match="Router.workers is fixed"):
        router.workers = ("a", "b")
    assert router.workers == ("a",) and router.overlap_weight == 1.0
    router.listeners.append(print)  # what may change: who hears of decisions
    assert router.listeners == [print]
