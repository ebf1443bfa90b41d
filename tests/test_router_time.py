"""kvbridge.Router's default cost: a predicted time to first token (routing/work.py), with
expectations computed from the engine model by hand: the hit as vLLM counts it, the queued
prompt work of each worker (drained by time, reset by first tokens), decode and memory pressure
from the router's own requests and from LoadReports."""

from __future__ import annotations

import pytest

from kvbridge import BlockRemoved, BlockStored, Index, KVEventBatch
from kvbridge.wire.events import LoadReport
from kvbridge.routing.router import Router
from kvbridge.routing.work import EngineModel, hit_tokens

from router_support import BS, Clock, store

ENGINE = EngineModel()




def _router(index: Index | None = None, **kw) -> tuple[Router, Clock]:
    clock = Clock()
    r = Router(index if index is not None else Index(BS), block_size=BS, workers=["a", "b"], clock=clock,
               provisional_ttl_s=0, **kw)  # fmt: skip
    return r, clock


def test_idle_workers_cost_the_time_of_their_uncached_tokens():
    prompt = list(range(1000))
    index = Index(BS)
    store(index, "a", prompt[:320])  # 20 blocks
    router, _ = _router(index)
    costs = router.costs(prompt)
    assert costs["a"] == pytest.approx(ENGINE.prefill_ms(1000 - 320))
    assert costs["b"] == pytest.approx(ENGINE.prefill_ms(1000))
    assert router.choose(prompt) == ("a", 20)


def test_a_hit_stops_one_token_short_as_vllm_counts_it():
    # A block-aligned prompt held whole: vLLM recomputes its last block (the last token's logits).
    prompt = list(range(64))
    index = Index(BS)
    store(index, "a", prompt)
    router, _ = _router(index)
    assert router.costs(prompt)["a"] == pytest.approx(ENGINE.prefill_ms(BS))
    assert router.costs(prompt + [7])["a"] == pytest.approx(ENGINE.prefill_ms(1))


def _hybrid(worker: str, window_blocks_held: list[int], n: int) -> KVEventBatch:
    """``worker`` stores an ``n``-block prompt in a full-attention group 0 and a sliding-window
    group 1 (a window of one block), then drops group 1's blocks but ``window_blocks_held``."""
    tokens, hashes = list(range(n * BS)), list(range(1, n + 1))
    events: list = [
        BlockStored(hashes, None, tokens, BS, None, "GPU", None, group_idx=g, kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=BS if g else None)  # fmt: skip
        for g, kind in ((0, "full_attention"), (1, "sliding_window"))
    ]
    events.append(BlockRemoved([h for i, h in enumerate(hashes) if i not in window_blocks_held], "GPU", group_idx=1))
    return KVEventBatch(0.0, events)


@pytest.mark.parametrize("native", [True, False])
def test_on_a_hybrid_worker_the_window_rule_holds_at_the_cap(native):
    # vLLM: KVCacheManager.get_computed_blocks asks find_longest_cache_hit for at most
    # num_tokens - 1 tokens; SlidingWindowManager.find_longest_cache_hit then needs the window's
    # block before *that* length. "a" holds window blocks 0 and 3 of a 4-block prompt, "b" only 0.
    index = Index(BS)
    index.apply("a", _hybrid("a", [0, 3], 4))
    index.apply("b", _hybrid("b", [0], 4))
    prompt = list(range(4 * BS))
    assert index.find_matches(prompt) == {"a": 4, "b": 1}  # the whole prompt: block 3 covers a's window
    router, _ = _router(index if native else _DuckIndex(index))
    # Block-aligned: a hit of at most 3 blocks, and at 3 "a"'s window needs block 2: both hit 1.
    costs = router.costs(prompt)
    assert costs["a"] == costs["b"] == pytest.approx(ENGINE.prefill_ms(3 * BS))
    # One token more: at most 4 blocks, and "a"'s window holds at 4.
    costs = router.costs(prompt + [7])
    assert costs["a"] == pytest.approx(ENGINE.prefill_ms(1)) and costs["b"] == pytest.approx(ENGINE.prefill_ms(3 * BS + 1))


@pytest.mark.parametrize("native", [True, False])
def test_choose_reports_the_blocks_vllm_can_use_on_either_path(native):
    prompt = list(range(4 * BS))
    index = Index(BS)
    store(index, "a", prompt)
    router, _ = _router(index if native else _DuckIndex(index))
    assert router.choose(prompt) == ("a", 3)  # block-aligned: the last block is recomputed
    assert router.choose(prompt + [7]) == ("a", 4)


def test_the_part_of_a_prompt_vllm_can_hit():
    assert hit_tokens(list(range(64)), 16) == list(range(48))  # aligned: the last block is computed
    assert hit_tokens(list(range(65)), 16) == list(range(64))
    assert hit_tokens(list(range(15)), 16) == [] and hit_tokens([], 16) == []


class _DuckIndex:
    """An index that is not a kvbridge.Index (the router's Python path)."""

    def __init__(self, index: Index) -> None:
        self._index = index

    def find_matches(self, tokens, **kw):
        return self._index.find_matches(tokens, **kw)


def test_queued_prompt_work_is_waited_for_drains_with_time_and_ends_at_the_first_token():
    router, clock = _router()
    long = list(range(20_000))
    assert router.choose(long, workers=["a"], request_id="r1") == ("a", 0)
    short = list(range(50_000, 50_100))
    costs = router.costs(short)
    assert costs["a"] == pytest.approx(ENGINE.prompt_ms(20_000 + 100, 0.0))
    assert costs["b"] == pytest.approx(ENGINE.prefill_ms(100))
    assert router.choose(short) == ("b", 0)
    # 200 ms later the engine has computed ~ tokens_per_ms * 200 of the long prompt (a's
    # backlog, the only candidate's, weighs the short prompt's own tokens: 1 + 2 * passes)
    clock.t += 0.2
    drained = 20_000 - ENGINE.tokens_per_ms(0.0) * 200
    weight = 1 + 2 * drained / 8192
    assert router.costs(short, workers=["a"])["a"] == pytest.approx(ENGINE.prompt_ms(drained + weight * 100, 0.0))
    # its first token: nothing queued there any more, a decode step per pass instead
    router.first_token("a", "r1")
    step = ENGINE.decode_ms(20_000)
    assert router.costs(short, workers=["a"])["a"] == pytest.approx(ENGINE.prefill_ms(100) + step)
    router.done("a", "r1")
    assert router.costs(short, workers=["a"])["a"] == pytest.approx(ENGINE.prefill_ms(100))
    assert router.in_flight == {"b": 1}


def test_long_prefills_spread_instead_of_piling_onto_the_prefix_holder():
    # Four 12k-token prompts sharing a 1,024-token prefix that only a holds arrive together.
    # The blocks cost sends them all to a (1 request of load against 64 blocks of overlap); in
    # time the third already waits longer on a than it takes to prefill elsewhere.
    prefix = list(range(1024))
    index = Index(BS)
    store(index, "a", prefix)
    prompts = [prefix + list(range(10**6 * (i + 1), 10**6 * (i + 1) + 11_000)) for i in range(4)]
    timed, _ = _router(index)
    chosen = [timed.choose(p)[0] for p in prompts]
    assert chosen.count("a") == 2 and chosen.count("b") == 2
    blocks = Router(index, block_size=BS, workers=["a", "b"], provisional_ttl_s=0, cost="blocks")
    assert [blocks.choose(p)[0] for p in prompts] == ["a"] * 4


def test_a_load_report_s_kv_cache_use_slows_the_decode_steps_a_prompt_shares():
    # a reports a full KV cache with requests running: each pass of a prompt sent there also
    # runs their decode step (34 ms at full use, against none on the idle b).
    reports = {"a": LoadReport(ts=1000.0, kv_cache_usage=1.0, running=40), "b": LoadReport(ts=1000.0)}
    router, _ = _router(reports=reports.get)
    prompt = list(range(5000))
    costs = router.costs(prompt)
    assert costs["b"] == pytest.approx(ENGINE.prefill_ms(5000))
    assert costs["a"] == pytest.approx(ENGINE.prefill_ms(5000) + ENGINE.decode_ms(ENGINE.kv_capacity_tokens))
    assert round(costs["a"] - costs["b"], 1) == 34.0
    assert router.choose(prompt)[0] == "b"


def test_with_every_worker_backlogged_the_prompt_s_own_work_weighs_more():
    # Both workers have queued work; the lighter backlog (b: 8192 tokens, one pass) scales the
    # prompt's uncached tokens by 1 + backlog_weight * 1.
    router, _ = _router()
    router.choose(list(range(10**6, 10**6 + 16_384)), workers=["a"])
    router.choose(list(range(2 * 10**6, 2 * 10**6 + 8192)), workers=["b"])
    prompt = list(range(3 * 10**6, 3 * 10**6 + 1000))
    costs = router.costs(prompt)
    assert costs["b"] == pytest.approx(ENGINE.prompt_ms(8192 + 3 * 1000, 0.0))
    assert costs["a"] == pytest.approx(ENGINE.prompt_ms(16_384 + 3 * 1000, 0.0))
    flat = Router(Index(BS), block_size=BS, workers=["a", "b"], clock=lambda: 1000.0, backlog_weight=0)
    flat.choose(list(range(10**6, 10**6 + 8192)), workers=["a"])
    flat.choose(list(range(2 * 10**6, 2 * 10**6 + 8192)), workers=["b"])
    assert flat.costs(prompt)["b"] == pytest.approx(ENGINE.prompt_ms(8192 + 1000, 0.0))


def test_clear_errors():
    with pytest.raises(ValueError, match="loads= .* weighs the 'blocks' cost"):
        Router(Index(BS), loads={"a": 1})
    with pytest.raises(ValueError, match="cost must be 'time' or 'blocks'"):
        Router(Index(BS), cost="tokens")
    with pytest.raises(TypeError, match="engine must be an EngineModel"):
        Router(Index(BS), engine={"prefill": 1})
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive int"):
        EngineModel(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="prefill must be three finite coefficients"):
        EngineModel(prefill=(1.0, 2.0))
    router, _ = _router()
    router.choose([1] * 40, request_id="x")
    with pytest.raises(ValueError, match="request 'x' is already in flight"):
        router.choose([1] * 40, request_id="x")
    with pytest.raises(ValueError, match="request 'y' is not in flight on worker"):
        router.done(router.choose([2] * 40, request_id="z")[0], "y")
    with pytest.raises(ValueError, match="num_tokens must be an int >= num_blocks"):
        router.costs_from_scores({}, 3, num_tokens=10)
