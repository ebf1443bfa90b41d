"""kvbridge replay: traces read as Dynamo reads them (and their errors, naming the line), the
fleet's determinism, the Dynamo port's cost on a hand-worked case, and the CLI on the shipped
sample (tests/traces: the first 200 requests of Mooncake's conversation trace)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.replay.engine import EngineConfig, Seq
from kvbridge.replay.fleet import Fleet, FleetConfig, simulate
from kvbridge.replay.policies import DynamoDefault, make_policy
from kvbridge.replay.report import percentile, summarize, weighted_percentile
from kvbridge.replay.trace import TraceError, load_trace, parse_trace
from replay_support import request

SAMPLE = Path(__file__).parent / "traces" / "mooncake_conversation_200.jsonl"


def _line(**obj):
    return json.dumps(obj)


# -- traces -----------------------------------------------------------------------------------------


def test_hash_ids_become_tokens_as_dynamo_makes_them():
    # Each distinct id gets a canonical number in order of first appearance; token p is the number
    # of hash_ids[p // 512]; the last chunk is partial (aisimulate-core trace.rs).
    lines = [
        _line(timestamp=5, input_length=1000, output_length=3, hash_ids=[70, 71]),
        _line(timestamp=9, input_length=600, output_length=1, hash_ids=[70, 99]),
    ]
    a, b = parse_trace(lines)
    assert (a.arrival_ms, b.arrival_ms) == (0.0, 4.0)
    ta, tb = a.tokens, b.tokens
    assert len(ta) == 1000 and len(tb) == 600
    assert set(ta[:512]) == {0} and set(ta[512:]) == {1} and set(tb[512:]) == {2}
    assert ta[:512] == tb[:512]


def test_a_trace_of_token_ids_is_read_as_given():
    (r,) = parse_trace([_line(timestamp=0, output_length=2, tokens=[5, 6, 7])])
    assert list(r.tokens) == [5, 6, 7] and r.input_length == 3 and r.output_length == 2


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        (_line(input_length=10, output_length=1, hash_ids=[1]), "missing key 'timestamp'"),
        (_line(timestamp=0, output_length=1, hash_ids=[1]), "missing key 'input_length'"),
        (_line(timestamp=0, input_length=10, hash_ids=[1]), "missing key 'output_length'"),
        (_line(timestamp=0, input_length=-5, output_length=1, hash_ids=[1]), "input_length must be >= 1, got -5"),
        (_line(timestamp=0, input_length=10, output_length=0, hash_ids=[1]), "output_length must be >= 1, got 0"),
        (_line(timestamp=-1, input_length=10, output_length=1, hash_ids=[1]), "timestamp must be >= 0"),
        ('{"timestamp": 1' + "0" * 400 + ', "input_length": 10, "output_length": 1, "hash_ids": [1]}',
         "timestamp must be a finite number of ms, got an integer of 401 digits"),
        (_line(timestamp=0, input_length=600, output_length=1, hash_ids=[1, 2, 3]),
         "3 hash_ids for input_length 600: 2 expected"),
        (_line(timestamp=0, input_length=600, output_length=1, hash_ids=[1]), "1 hash_ids for input_length 600: 2 expected"),
        (_line(timestamp=0, output_length=1, tokens=[1, -2]), r"tokens\[1\] must be a token id"),
        (_line(timestamp=0, output_length=1, tokens=[1, 2], input_length=3), "input_length 3 != 2 tokens"),
    ],
)
def test_a_bad_line_is_an_error_naming_the_file_and_line(line, message):
    good = _line(timestamp=0, input_length=10, output_length=1, hash_ids=[1])
    with pytest.raises(TraceError, match=message) as info:
        list(parse_trace(["", good, line], name="t.jsonl"))
    assert str(info.value).startswith("t.jsonl:3: ")


def test_timestamps_going_back_are_an_error():
    lines = [_line(timestamp=10, input_length=10, output_length=1, hash_ids=[1]),
             _line(timestamp=4, input_length=10, output_length=1, hash_ids=[1])]  # fmt: skip
    with pytest.raises(TraceError, match=r"t:2: timestamp goes back \(4 ms after 10 ms\)"):
        list(parse_trace(lines, name="t"))


# -- the fleet ---------------------------------------------------------------------------------------


def test_a_replay_repeats_for_a_seed():
    requests = load_trace(SAMPLE, limit=120)
    config = FleetConfig(workers=3, arrival_speedup=2.0)

    def once(policy: str, seed: int):
        seqs, fleet, wall = simulate(requests, make_policy(policy, seed=seed), config)
        d = summarize(policy, seqs, fleet, wall).as_dict()
        del d["wall_s"]
        return d, [s.worker for s in seqs]

    for policy in ("kv", "kv-reports", "dynamo", "random"):
        assert once(policy, 7) == once(policy, 7), policy
    assert once("random", 1)[1] != once("random", 2)[1]


def test_the_dynamo_port_costs_a_hand_worked_case():
    # dynamo-replay-model.md 5.2: a request of ISL 6760 sharing one 512-token block (8 blocks of
    # 64) with an active request of ISL 2290 on worker 0: (2290 + 6760) / 64 + 35 + 105 - 8 on
    # worker 0; 6760 / 64 + 105 on the idle worker 1. Dynamo's log: 273.40625 for the first.
    policy = DynamoDefault(seed=0)
    policy.attach(Fleet(FleetConfig(workers=2), events=True))
    first = request(0, [1] * 512 + [2] * (2290 - 512), 10)
    assert policy.costs(Seq(first))[0] == [2290 / 64 + 35, 2290 / 64 + 35]
    policy.route(seq := Seq(first))
    seq.worker = 0 if seq.decision is not None else 0
    second = Seq(request(1, [1] * 512 + [3] * (6760 - 512), 10))
    costs, _, _ = policy.costs(second)
    held = 0 if policy.blocks[0] else 1  # the worker that took the first request
    assert costs[held] == 273.40625
    assert costs[1 - held] == 6760 / 64 + 105


def test_kv_does_not_queue_a_short_prompt_behind_a_pass_in_progress_while_a_worker_idles():
    """Short prompts, nothing shared, arriving faster than one pass ends: a pass of a few hundred
    tokens takes its fixed cost too (16.5 ms of its ~26), so a worker sent one is busy well after
    its tokens would be done at the full passes' speed. kv must see it busy and take an idle
    worker, as round robin does, not queue behind the pass (its TTFT was 1.12x round robin's)."""
    import random

    rng = random.Random(1)
    requests = [request(i, [rng.randrange(1, 50_000) for _ in range(rng.randrange(500, 800))], 50, at_ms=20.0 * i)
                for i in range(200)]  # fmt: skip
    config = FleetConfig(workers=4)
    by = {}
    for policy in ("kv", "rr"):
        seqs, fleet, wall = simulate(requests, make_policy(policy, seed=0), config)
        by[policy] = summarize(policy, seqs, fleet, wall)
    assert by["kv"].reuse_first_admission == by["rr"].reuse_first_admission == 0.0
    assert by["kv"].ttft_mean <= by["rr"].ttft_mean and by["kv"].ttft_p99 <= by["rr"].ttft_p99


def test_nearest_rank_percentiles_as_dynamo_reports_them():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 3.0  # round((4 - 1) * 0.5) = 2 (half up)
    assert percentile([], 99) == 0.0
    assert weighted_percentile([(5.0, 3), (1.0, 1)], 50) == 5.0
    assert weighted_percentile([(5.0, 1), (1.0, 3)], 99) == 5.0


# -- the CLI -----------------------------------------------------------------------------------------


def _replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbridge", "replay", *args], capture_output=True, text=True, timeout=120)


def test_the_sample_replays_in_seconds_and_kv_routing_is_not_slower_than_round_robin(tmp_path):
    proc = _replay(str(SAMPLE), "--workers", "2", "--json", "--plot", str(tmp_path / "p.png"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    by = {p["policy"]: p for p in out["policies"]}
    assert set(by) == {"kv", "kv-reports", "dynamo", "rr", "random"}
    assert all(p["completed"] == 200 for p in by.values())
    assert by["rr"]["per_worker"] == [100, 100]
    # simulated time: the time-based router beats round robin and random on this trace
    assert by["kv"]["ttft_mean"] < by["rr"]["ttft_mean"] and by["kv"]["ttft_mean"] < by["random"]["ttft_mean"]
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_names_every_policy_and_the_fleet():
    proc = _replay(str(SAMPLE), "--first", "40", "--policy", "kv,rr", "--workers", "3", "--speedup", "2")
    assert proc.returncode == 0, proc.stderr
    assert "40 requests, 3 workers, arrivals x2" in proc.stdout
    assert "| kv |" in proc.stdout and "| rr |" in proc.stdout and "requests per worker, rr: 14 13 13" in proc.stdout


def test_the_table_says_when_a_worker_rejected_a_request(tmp_path):
    """200 prompt tokens + 500 output outgrow a 4 x 64-token pool while decoding: the worker
    refuses that request; its TTFT is in no figure, and the table says so."""
    path = tmp_path / "t.jsonl"
    path.write_text(_line(timestamp=0, input_length=200, output_length=500, hash_ids=[1]) + "\n"
                    + _line(timestamp=5, input_length=50, output_length=2, hash_ids=[2]) + "\n")  # fmt: skip
    proc = _replay(str(path), "--policy", "rr", "--workers", "1", "--num-blocks", "4")
    assert proc.returncode == 0, proc.stderr
    head, rule, row = proc.stdout[proc.stdout.index("| policy"):].splitlines()[:3]
    assert dict(zip(head.split("|"), row.split("|")))[" rejected "].strip() == "1"
    assert "rr: 1 of 2 requests not completed (1 rejected" in proc.stdout
    assert json.loads(_replay(str(path), "--policy", "rr", "--workers", "1", "--num-blocks", "4", "--json").stdout
                      )["policies"][0]["rejected"] == 1  # the same name in both forms


def test_cli_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_line(timestamp=0, input_length=10, output_length=1, hash_ids=[1]) + "\n{oops\n")
    proc = _replay(str(bad))
    assert proc.returncode == 2 and f"{bad}:2: not JSON" in proc.stderr
    proc = _replay(str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr
    proc = _replay(str(SAMPLE), "--policy", "kv,fastest")
    assert proc.returncode == 2 and "unknown fastest" in proc.stderr
    proc = _replay(str(SAMPLE), "--policy", "kv,rr,kv")
    assert proc.returncode == 2 and "--policy: kv given twice" in proc.stderr
    proc = _replay(str(SAMPLE), "--workers", "0")
    assert proc.returncode == 2 and "must be a positive integer" in proc.stderr
    proc = _replay(str(SAMPLE), "--num-blocks", "10")
    assert proc.returncode == 2 and "request 1 (6758 tokens) does not fit a worker's 10 blocks" in proc.stderr
    far = tmp_path / "far.jsonl"
    far.write_text(_line(timestamp=0, input_length=10, output_length=1, hash_ids=[1]) + "\n"
                   + _line(timestamp=1e308, input_length=10, output_length=1, hash_ids=[2]) + "\n")  # fmt: skip
    proc = _replay(str(far), "--speedup", "0.5", "--policy", "rr")
    assert proc.returncode == 2 and "request 2 arrives 1e+308 ms after the first: divided by --speedup 0.5" in proc.stderr
    proc = _replay(str(SAMPLE), "--max-num-seqs", "512", "--max-num-batched-tokens", "256")
    assert proc.returncode == 2 and "--max-num-batched-tokens (256) must be >= --max-num-seqs (512)" in proc.stderr
    proc = _replay(str(SAMPLE), "--workers", "abc")
    assert proc.returncode == 2 and "--workers: must be a positive integer, got 'abc'" in proc.stderr
    # a bad second trace (or plot target) fails before the first is replayed: nothing printed
    proc = _replay(str(SAMPLE), str(bad), "--policy", "rr")
    assert proc.returncode == 2 and f"{bad}:2: not JSON" in proc.stderr and proc.stdout == ""
    proc = _replay(str(SAMPLE), "--policy", "rr", "--plot", str(tmp_path / "no" / "such" / "p.png"))
    assert proc.returncode == 2 and "--plot" in proc.stderr and "cannot write in" in proc.stderr and proc.stdout == ""


def test_a_trace_is_read_as_bytes_and_no_further_than_first(tmp_path):
    """A line that is not UTF-8 is an error naming it; ``--first N`` does not read line N + 1."""
    good = _line(timestamp=0, input_length=10, output_length=1, hash_ids=[1]).encode()
    path = tmp_path / "t.jsonl"
    path.write_bytes(good + b"\n" + b'{"timestamp": "\xe9"}\n')
    with pytest.raises(TraceError, match=f"{path}:2: not JSON"):
        load_trace(path)
    (r,) = load_trace(path, limit=1)
    assert r.input_length == 10


def test_round_robin_reproduces_dynamo_s_own_replay_on_the_sample():
    # Figures Dynamo 1.6.1's replay produced for this sample (tests/traces/README.md), small
    # pools with preemptions included: the engine model, the timing and the metrics are its own.
    doc = json.loads((SAMPLE.parent / "dynamo_replay_rr.json").read_text())
    requests = load_trace(SAMPLE)
    for case in doc["cases"]:
        engine = EngineConfig(num_blocks=case["num_gpu_blocks"], block_size=case["block_size"])
        seqs, fleet, wall = simulate(requests, make_policy("rr"),
                                     FleetConfig(workers=case["workers"], arrival_speedup=case["arrival_speedup"], engine=engine))  # fmt: skip
        got = summarize("rr", seqs, fleet, wall).as_dict()
        for key, want in case["expected"].items():
            assert got[key] == pytest.approx(want, rel=1e-6), (case["workers"], case["num_gpu_blocks"], key)
    assert any(case["num_gpu_blocks"] == 2048 for case in doc["cases"])
