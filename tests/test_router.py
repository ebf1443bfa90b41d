"""kvbridge.routing.router: costs, choices and in-flight counting, with expectations worked out by hand."""

import functools
import math
from collections import Counter

import pytest

from kvbridge import BlockStored, Index, KVEventBatch, hit_tokens
from kvbridge.routing.router import NoWorkersError, softmax_probabilities
from kvbridge.routing.router import Router as _Router

#: These tests hold the requests-and-blocks cost (cost="blocks"); tests/test_router_time.py the
#: time cost, the default.
Router = functools.partial(_Router, cost="blocks")

BS = 4
PROMPT = list(range(100, 116))  # 4 full blocks
LORA_PROMPT = list(range(200, 218))  # 4 full blocks + 2 tokens


def _store(index, worker, tokens, *, parent=None, first_hash=1, lora_name=None):
    n = len(tokens) // BS
    hashes = list(range(first_hash, first_hash + n))
    extra = [(lora_name,)] * n if lora_name else None
    ev = BlockStored(hashes, parent, tokens[: n * BS], BS, None, "GPU", lora_name, extra)
    index.apply(worker, KVEventBatch(0.0, [ev]))


@pytest.fixture
def index():
    # a holds 3 leading blocks of PROMPT, b holds 1; c holds an unrelated block.
    idx = Index(BS)
    _store(idx, "a", PROMPT[:12])
    _store(idx, "b", PROMPT[:4])
    _store(idx, "c", [9, 9, 9, 9])
    return idx


def test_lowest_cost_is_the_longest_prefix_when_idle(index):
    router = Router(index)
    # costs: a = 1*(4-3) + 0 = 1, b = 1*(4-1) = 3, c = 4
    assert router.costs(PROMPT) == {"a": 1.0, "b": 3.0, "c": 4.0}
    assert router.choose(PROMPT) == ("a", 3)
    assert router.in_flight == {"a": 1}


def test_load_outweighs_overlap(index):
    # a: 1 + 5 = 6, b: 3 + 0 = 3, c: 4 + 0 = 4 -> b
    router = Router(index, loads={"a": 5})
    assert router.costs(PROMPT) == {"a": 6.0, "b": 3.0, "c": 4.0}
    assert router.choose(PROMPT) == ("b", 1)


def test_overlap_weight_scales_the_prefill_term(index):
    # weight 3, loads a=5 b=4: a = 3*1 + 5 = 8, b = 3*3 + 4 = 13, c = 3*4 + 0 = 12 -> a
    router = Router(index, overlap_weight=3, loads={"a": 5, "b": 4})
    assert router.costs(PROMPT) == {"a": 8.0, "b": 13.0, "c": 12.0}
    assert router.choose(PROMPT)[0] == "a"
    # weight 0: pure load balancing; c has no load
    assert Router(index, overlap_weight=0, loads={"a": 5, "b": 4}).choose(PROMPT) == ("c", 0)


def test_callable_loads_fall_back_to_in_flight_counts(index):
    # A callable that knows only b's load; a and c are weighed by requests in flight.
    router = Router(index, loads=lambda w: 10 if w == "b" else None)
    picks = [router.choose(PROMPT)[0] for _ in range(4)]
    # a: 1+0, 1+1, 1+2, then 1+3 = 4 ties c (4+0): a seeded pick between a and c.
    assert picks[:3] == ["a", "a", "a"]
    assert picks[3] in ("a", "c")
    assert router.in_flight["a"] == 3 + (picks[3] == "a")
    assert router.costs(PROMPT)["b"] == 3 + 10


def test_in_flight_counts_spread_equal_work(index):
    # (provisional residency off: with it, the first pick would hold the prompt and draw the rest,
    # tests/test_router_provisional.py)
    router = Router(index, workers=["d"], provisional_ttl_s=0)
    other = [7] * 16  # nobody holds it: every worker costs 4 + in flight
    picks = [router.choose(other)[0] for _ in range(8)]
    assert Counter(picks) == {"a": 2, "b": 2, "c": 2, "d": 2}
    for w in picks:
        router.done(w)
    assert router.in_flight == {}


def test_done_and_route_decrement(index):
    router = Router(index)
    with router.route(PROMPT) as (worker, overlap):
        assert (worker, overlap) == ("a", 3)
        assert router.in_flight == {"a": 1}
    assert router.in_flight == {}
    with pytest.raises(RuntimeError):
        with router.route(PROMPT):
            raise RuntimeError("request failed")
    assert router.in_flight == {}
    with pytest.raises(ValueError, match="'a' has no request in flight"):
        router.done("a")


def test_ties_are_seeded_and_repeatable():
    idx = Index(BS)
    router_args = dict(workers=["w0", "w1", "w2", "w3"], seed=7, provisional_ttl_s=0)
    a = Router(idx, **router_args)
    b = Router(idx, **router_args)
    seq_a = [a.choose(PROMPT)[0] for _ in range(12)]
    seq_b = [b.choose(PROMPT)[0] for _ in range(12)]
    assert seq_a == seq_b
    # every 4 picks the in-flight counts are equal again: each round is a permutation
    for r in range(3):
        assert sorted(seq_a[4 * r : 4 * r + 4]) == ["w0", "w1", "w2", "w3"]


def test_explicit_candidates_restrict_the_choice(index):
    router = Router(index, provisional_ttl_s=0)
    assert router.choose(PROMPT, workers=["b", "c"]) == ("b", 1)
    # a candidate the index does not know holds nothing but still counts
    assert router.choose(PROMPT, workers=["new"]) == ("new", 0)
    # (b and new each have one request in flight now)
    assert router.costs(PROMPT, workers=["a", "new"]) == {"a": 1.0, "new": 5.0}


def test_lora_and_extra_keys_reach_the_index():
    idx = Index(BS)
    _store(idx, "plain", LORA_PROMPT)
    _store(idx, "adapted", LORA_PROMPT, lora_name="ad-1", first_hash=50)
    router = Router(idx)
    assert router.choose(LORA_PROMPT, lora_name="ad-1") == ("adapted", 4)
    # adapted now has one request in flight
    assert router.costs(LORA_PROMPT, lora_name="ad-1") == {"adapted": 1.0, "plain": 4.0}
    assert router.costs(LORA_PROMPT) == {"adapted": 5.0, "plain": 0.0}
    # a multimodal key on the first block: only a query with the same key matches it
    mm = [("img-7",), None, None, None]
    idx.apply("mm", KVEventBatch(0.0, [BlockStored([90, 91, 92, 93], None, LORA_PROMPT[:16], BS, None, "GPU", None, mm)]))
    assert router.scores(LORA_PROMPT, extra_keys=mm) == {"mm": 4}
    assert router.choose(LORA_PROMPT, extra_keys=mm) == ("mm", 4)
    assert "mm" not in router.scores(LORA_PROMPT)


def test_softmax_probabilities_by_hand():
    # costs 0, 5, 10 -> rescaled 0, 0.5, 1; temperature 0.5 -> weights e^0, e^-1, e^-2
    p = softmax_probabilities({"a": 0, "b": 5, "c": 10}, 0.5)
    z = 1 + math.exp(-1) + math.exp(-2)
    assert p == pytest.approx({"a": 1 / z, "b": math.exp(-1) / z, "c": math.exp(-2) / z})
    assert softmax_probabilities({"a": 3, "b": 3}, 1.0) == {"a": 0.5, "b": 0.5}


def test_temperature_samples_by_those_probabilities(index):
    # loads keep the costs fixed (no in-flight feedback): a = 1, b = 3, c = 4
    loads = {"a": 0, "b": 0, "c": 0}
    router = Router(index, loads=loads, temperature=0.5, seed=3, provisional_ttl_s=0)
    picks = Counter(router.choose(PROMPT)[0] for _ in range(6000))
    expected = softmax_probabilities({"a": 1, "b": 3, "c": 4}, 0.5)
    for w, p in expected.items():
        assert abs(picks[w] / 6000 - p) < 0.03, (w, picks, expected)
    again = Router(index, loads=loads, temperature=0.5, seed=3, provisional_ttl_s=0)
    first = [again.choose(PROMPT)[0] for _ in range(50)]
    third = Router(index, loads=loads, temperature=0.5, seed=3, provisional_ttl_s=0)
    assert [third.choose(PROMPT)[0] for _ in range(50)] == first


def test_choose_scores_from_a_remote_index():
    router = Router(block_size=16, workers=["x", "y"])
    assert router.choose_scores({"y": 2}, 5) == ("y", 2)
    assert router.choose_scores({"x": 9}, 5) == ("x", 5)  # an overlap beyond the request is capped
    with pytest.raises(ValueError, match="no index"):
        router.choose(PROMPT)


def test_clear_errors():
    with pytest.raises(NoWorkersError, match="no workers to route to"):
        Router(Index(BS)).choose(PROMPT)
    with pytest.raises(NoWorkersError, match="workers is empty"):
        Router(Index(BS), workers=["a"]).choose(PROMPT, workers=[])
    with pytest.raises(ValueError, match="block_size is required"):
        Router(object())
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        Router(block_size=0)
    with pytest.raises(ValueError, match="overlap_weight must be >= 0"):
        Router(Index(BS), overlap_weight=-1)
    with pytest.raises(TypeError, match="temperature must be a finite number"):
        Router(Index(BS), temperature="hot")
    with pytest.raises(TypeError, match="loads must be a mapping"):
        Router(Index(BS), loads=3)
    with pytest.raises(TypeError, match="workers: a worker is a non-empty str"):
        Router(Index(BS), workers=[1])
    with pytest.raises(ValueError, match=r"block_size 32 differs from the index's \(16\)"):
        Router(Index(16), block_size=32)  # its overlaps would be counted in the index's blocks
    with pytest.raises(TypeError, match="clock must be a callable"):
        Router(Index(BS), clock=5)
    from kvbridge.routing.router import ReportLoads

    with pytest.raises(TypeError, match="refresh_s must be a finite number, got 'x'"):
        ReportLoads(None, refresh_s="x")
    router = Router(Index(BS), workers=["a"], loads={"a": "busy"})
    with pytest.raises(TypeError, match="load of worker 'a' must be a finite number"):
        router.choose(PROMPT)


def test_loads_from_the_workers_load_reports(index):
    from kvbridge.wire.events import LoadReport
    from kvbridge.routing.router import report_loads

    class Reports:  # what KvEventSubscriber.loads holds: (model, worker) -> (latest report, age in s)
        loads = {
            ("m", "a"): (LoadReport(ts=0.0, running=3, waiting=4, kv_cache_usage=0.9), 0.5),
            ("m", "b"): (LoadReport(ts=0.0, running=1, waiting=0), 0.2),
            ("m", "c"): (LoadReport(ts=0.0, running=50, waiting=50), 60.0),  # stale: ignored
            ("other", "a"): (LoadReport(ts=0.0, running=99), 0.1),
        }

    router = Router(index, loads=report_loads(Reports(), model="m", max_age_s=5.0), provisional_ttl_s=0)
    # a: 1 + (3 + 4) = 8, b: 3 + 1 = 4, c: 4 + 0 in flight (its report is stale) -> b
    assert router.costs(PROMPT) == {"a": 8.0, "b": 4.0, "c": 4.0}
    # b's load is its report plus what was routed there after it (the reports are from ts 0);
    # c's is the router's in-flight count
    assert router.choose(PROMPT, workers=["b"]) == ("b", 1)
    assert router.choose(PROMPT, workers=["c"]) == ("c", 0)
    assert router.costs(PROMPT) == {"a": 8.0, "b": 5.0, "c": 5.0}
    with pytest.raises(ValueError, match="worker 'a' reports load for several models: pass model="):
        Router(index, loads=report_loads(Reports())).choose(PROMPT)


# -- storage tiers ------------------------------------------------------------------------------


def test_tiered_overlap_counts_each_block_at_the_best_tier_holding_it():
    from kvbridge.routing.router import DEFAULT_MEDIUM_WEIGHTS, tiered_overlap

    w = DEFAULT_MEDIUM_WEIGHTS
    assert tiered_overlap({}, w) == 0
    assert tiered_overlap({"GPU": 3}, w) == 3
    # GPU holds 2 leading blocks, the CPU 6: 2 at 1.0, then 4 at 0.75
    assert tiered_overlap({"GPU": 2, "CPU": 6}, w) == 2 + 4 * 0.75
    # a slower tier reaching less far adds nothing: those blocks are on the GPU too
    assert tiered_overlap({"GPU": 5, "DISK": 3}, w) == 5
    # three tiers: 1 GPU, 2 more from the CPU, 3 more from disk
    assert tiered_overlap({"GPU": 1, "CPU": 3, "DISK": 6}, w) == 1 + 2 * 0.75 + 3 * 0.25
    # an engine that names no medium is on the GPU; a medium nobody weighed counts the lowest
    assert tiered_overlap({None: 4}, w) == 4
    assert tiered_overlap({"NVME-OF": 4}, w) == 4 * 0.25
    assert tiered_overlap({"CPU": 4}, {"CPU": 1.0, "GPU": 1.0}) == 4


def test_router_weighs_tiers_when_choosing():
    router = Router(block_size=BS, workers=["gpu", "cpu"], medium_weights={"GPU": 1.0, "CPU": 0.5})
    # 8 blocks: gpu holds 4 on the GPU (cost 4), cpu holds 8 in CPU memory (cost 8 - 4 = 4): a tie
    # broken by load; with 7 held in CPU memory the GPU worker is cheaper.
    scores = {"gpu": {"GPU": 4}, "cpu": {"CPU": 7}}
    assert router.costs_from_scores(scores, 8) == {"gpu": 4.0, "cpu": 4.5}
    assert router.choose_scores(scores, 8) == ("gpu", 4)
    # the overlap a choice reports is the leading blocks held in any tier
    assert Router(block_size=BS, workers=["cpu"]).choose_scores({"cpu": {"GPU": 1, "CPU": 6}}, 8) == ("cpu", 6)
    import numpy as np

    assert Router(block_size=BS, workers=["cpu"]).choose_scores({"cpu": 6}, np.int64(8)) == ("cpu", 6)  # a numpy count
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        hit_tokens([1, 2, 3], 0)
    with pytest.raises(TypeError, match="medium_weights: a medium is a non-empty str"):
        Router(block_size=BS, medium_weights={1: 1.0})
    with pytest.raises(ValueError, match=r"medium_weights\['CPU'\] must be >= 0"):
        Router(block_size=BS, medium_weights={"CPU": -1})
    with pytest.raises(TypeError, match="medium_weights must be a non-empty mapping"):
        Router(block_size=BS, medium_weights={})
    with pytest.raises(TypeError, match="remote must be a bool"):
        Router(block_size=BS, remote="yes")


def test_a_route_block_ends_its_own_request_not_the_worker_s_oldest():
    """``with router.route(...)`` ends the request it chose, even when the worker has an older one
    in flight (``done(worker)`` without an id would end that one)."""
    router = Router(Index(16), workers=["a"], provisional_ttl_s=0)
    router.choose(list(range(40)), request_id="x")
    with router.route(list(range(100, 140))) as (worker, _):
        assert worker == "a" and router.in_flight["a"] == 2
    assert router.in_flight["a"] == 1
    router.done("a", "x")  # still in flight: the block did not end it
    assert router.in_flight.get("a", 0) == 0


def test_a_str_is_not_taken_for_a_list_of_workers():
    with pytest.raises(TypeError, match="workers must be a collection of worker names, not a str"):
        Router(Index(16), workers="gpu-0")
    router = Router(Index(16), workers=["gpu-0", "gpu-1"])
    with pytest.raises(TypeError, match="workers must be a collection of worker names, not a str"):
        router.choose(list(range(40)), workers="gpu-0")
    assert router.choose(list(range(40)), workers=["gpu-1"])[0] == "gpu-1"
