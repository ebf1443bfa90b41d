"""The replay's engine model, rule by rule (kvbridge.replay.engine): the timing formulas at known
points, the token budget and chunking, admission and head-of-line blocking on blocks, lifo
preemption and recompute, the hit cap, tail-first eviction. The rules are Dynamo 1.6.1's replay's
(shared/routing/dynamo-replay-model.md, aisimulate-core's vLLM scheduler), itself vLLM's
(vllm/v1/core/sched/scheduler.py ``schedule``; kv_cache_manager.py ``get_computed_blocks``)."""

from __future__ import annotations

import pytest

from kvbridge.replay.engine import EngineConfig, decode_ms, prefill_ms
from replay_support import request, run

CAP = 16384 * 64


def test_the_polynomials_at_known_points():
    # dynamo-replay-model.md section 4: 512 tokens 24.4 ms, 2048 49.4, 4096 85.8, 8192 169.1
    assert [round(prefill_ms(t), 1) for t in (512, 2048, 4096, 8192)] == [24.4, 49.4, 85.8, 169.1]
    assert prefill_ms(0) == 0.0
    # decode: 5.74 ms at u=0, 17.6 at 0.25, 26.3 at 0.5, 34.0 at 1 (and no more past 1)
    assert [round(decode_ms(u * CAP, CAP), 1) for u in (0, 0.25, 0.5, 1, 2)] == [5.7, 17.6, 26.3, 34.0, 34.0]
    assert prefill_ms(8192, speedup=2) == pytest.approx(prefill_ms(8192) / 2)


def test_a_lone_prompt_is_prefilled_in_budget_sized_chunks():
    # 20,000 tokens: 8192 + 8192 + 3616, the first token at the end of the third pass (Dynamo's
    # own replay gives 415.18 ms for the same request).
    (seq,), _ = run([request(0, range(20000), 1)])
    assert seq.first_token_ms == pytest.approx(2 * prefill_ms(8192) + prefill_ms(3616))
    assert round(seq.first_token_ms, 2) == 415.18
    assert seq.done_ms == seq.first_token_ms  # output_length 1: done in its prefill pass


def test_two_prompts_share_a_pass_budget_and_decoding_slows_the_next():
    # A (6000) and B (6000) arrive together: pass 1 runs A whole and 2192 of B (8192 tokens);
    # pass 2 the rest of B (3808) while A decodes its second token.
    a, b = request(0, range(6000), 5), request(1, range(10**6, 10**6 + 6000), 5)
    (sa, sb), _ = run([a, b])
    first = prefill_ms(8192)
    assert sa.first_token_ms == pytest.approx(first)
    assert sb.first_token_ms == pytest.approx(first + prefill_ms(3808) + decode_ms(6001, CAP))


def test_admission_needs_the_whole_prompt_and_blocks_everyone_behind():
    # 10 blocks of 16: A (100 tokens, 7 blocks) decodes for a while; B (7 blocks) cannot be
    # admitted beside it; C (2 blocks) would fit but waits behind B (head-of-line blocking).
    a = request(0, range(100), 40)
    b = request(1, range(1000, 1100), 2, at_ms=1.0)
    c = request(2, range(2000, 2020), 2, at_ms=2.0)
    (sa, sb, sc), _ = run([a, b, c], num_blocks=10, block_size=16)
    assert sb.first_token_ms > sa.done_ms
    assert sc.first_token_ms > sa.done_ms and sc.first_token_ms >= sb.first_token_ms


def test_out_of_blocks_the_newest_running_request_is_preempted_and_recomputed():
    # 8 blocks of 4 tokens; A and B (8 tokens each) decode 20 tokens: growing, they run out of
    # blocks and B, the newest, gives way (lifo); it recomputes later, its first token kept.
    a = request(0, range(8), 20)
    b = request(1, range(100, 108), 20)
    (sa, sb), fleet = run([a, b], num_blocks=8, block_size=4)
    engine = fleet.engines[0]
    assert engine.preemptions >= 1
    assert sb.admissions >= 2 and sa.admissions == 1
    assert sa.done_ms < sb.done_ms
    assert sb.first_token_ms < sa.done_ms  # its TTFT is the first admission's
    assert sb.generated == 20 and sa.generated == 20
    # the recompute found B's own blocks still cached
    assert sb.cached_best > 0


def test_a_hit_stops_one_token_short_of_the_prompt():
    # vLLM computes the last token for its logits: a block-aligned prompt held whole recomputes
    # its last block; one token more and the whole cached prefix counts.
    first = request(0, range(64), 1)
    same = request(1, range(64), 1, at_ms=1000)
    longer = request(2, [*range(64), 7], 1, at_ms=2000)
    (_, s_same, s_longer), _ = run([first, same, longer], block_size=16)
    assert s_same.cached_first == 48
    assert s_longer.cached_first == 64


def test_a_finished_request_is_evicted_tail_first():
    # 6 blocks of 4: A (16 tokens) finishes, its 4 blocks cached; B takes the 2 never used; C
    # needs one more: A's *last* block goes. A's prompt + 4 tokens then hits 3 blocks, not 4.
    a = request(0, range(16), 1)
    b = request(1, range(100, 108), 1, at_ms=1000)
    c = request(2, range(200, 204), 1, at_ms=2000)
    d = request(3, [*range(16), 9, 9, 9, 9], 1, at_ms=3000)
    (*_, sd), _ = run([a, b, c, d], num_blocks=6, block_size=4)
    assert sd.cached_first == 12


def test_a_prompt_larger_than_the_pool_is_refused_not_waited_for():
    big = request(0, range(100), 3)
    small = request(1, range(500, 520), 3, at_ms=1)
    (s_big, s_small), fleet = run([big, small], num_blocks=4, block_size=16)
    assert fleet.engines[0].rejected == 1 and s_big.done_ms < 0 and s_big.first_token_ms < 0
    assert s_small.generated == 3


def test_a_request_that_outgrows_the_pool_while_decoding_is_refused_not_retried_forever():
    """20 prompt tokens + 14 output need 33 slots of a 32-token pool: the request decodes until
    its next block cannot be had, gives way to itself, and can never be admitted again. The
    engine refuses it (as with a prompt too large), the request behind it is served, the replay
    ends, and the router hears the refused request's end."""
    from kvbridge.replay.fleet import FleetConfig, simulate
    from kvbridge.replay.policies import make_policy

    grows = request(0, range(20), 14)
    small = request(1, range(500, 508), 2, at_ms=1)
    policy = make_policy("kv")
    (s_grows, s_small), fleet, _ = simulate([grows, small], policy, FleetConfig(workers=1, engine=EngineConfig(
        num_blocks=2, block_size=16)))  # fmt: skip
    e = fleet.engines[0]
    assert e.rejected == 1 and e.preemptions >= 1
    assert s_grows.first_token_ms >= 0 and s_grows.done_ms < 0 and s_grows.generated < 14
    assert s_small.generated == 2 and s_small.done_ms >= 0
    assert policy.router.in_flight.get(fleet.names[0], 0) == 0


def test_engine_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        EngineConfig(num_blocks=0)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(128\) must be >= max_num_seqs \(256\)"):
        EngineConfig(max_num_batched_tokens=128)
    with pytest.raises(ValueError, match="speedup must be a finite number > 0"):
        EngineConfig(speedup=0)
