"""bench/consumer.py's comparison in instructions (callgrind), which do not move with the load
that other processes put on the cores, as CPU time does.

    python bench/consumer_instr.py [--modes batch lazy]

Each figure is the difference of two callgrind runs of the same program, one doing more work than
the other (imports, connection and first contact cancel out), over the block events between them:

* the floor: msgspec decoding the payloads into vLLM's ``KVEventBatch`` in a loop (as
  bench/consumer.py's floor), and kvbridge's ``decode_batch`` in the same loop;
* a ``KvEventSubscriber`` read with ``async for`` from a real nats-server, per mode (as in
  bench/consumer.py), fed one message at a time (each message pays its own wake-up of the loop,
  which a saturated consumer shares between several: an upper bound on the per-message part).

Needs valgrind. Slow: a few minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

_DECODE_LOOP = """
import sys
sys.path.insert(0, {here!r})
import msgspec, vllm_zmq
from relay import make_frames
from kvbridge.wire.events import decode_batch
payloads = [p for p, _ in make_frames(40, 600, 50_000)]
f = msgspec.msgpack.Decoder(vllm_zmq.KVEventBatch).decode if sys.argv[1] == "floor" else decode_batch
for _ in range(1 + int(sys.argv[2])):  # the first pass warms what the others reuse
    for p in payloads:
        f(p)
"""

_CONSUMER = """
import asyncio, sys
from kvbridge.bus.subscriber import KvEventSubscriber
from kvbridge.config import Config

async def main(url, mode, k):
    sub = await KvEventSubscriber(Config(servers=url), subject="kv.events.bench.w0",
                                  track_views=mode != "lazy-noview").start()
    print("ready", flush=True)
    n = 0
    async for u in sub:
        if mode == "batch":
            u.batch
        n += u.n_blocks
        if sub.stats["messages"] >= k:
            break
    print("blocks", n, flush=True)
    await sub.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def _instructions(stderr: bytes) -> int:
    return int(re.search(rb"Collected : (\d+)", stderr).group(1))


def _valgrind(*args: str) -> list[str]:
    return ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, *args]


def decode_loop(which: str) -> float:
    from relay import make_frames

    blocks = sum(b for _, b in make_frames(40, 600, 50_000))
    code = _DECODE_LOOP.format(here=HERE)
    runs = [subprocess.run(_valgrind("-c", code, which, str(n)), capture_output=True, check=True) for n in (0, 3)]
    return (_instructions(runs[1].stderr) - _instructions(runs[0].stderr)) / (3 * blocks)


async def _consumer(url: str, mode: str, k: int, frames: list[tuple[bytes, int]]) -> tuple[int, int]:
    from kvbridge.bus.publisher import KvEventPublisher
    from kvbridge.config import Config

    proc = await asyncio.create_subprocess_exec(*_valgrind("-c", _CONSUMER, url, mode, str(k)),
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    if not (await proc.stdout.readline()).startswith(b"ready"):
        raise RuntimeError("consumer did not start")
    pub = await KvEventPublisher(Config(servers=url, model="bench", worker_id="w0", heartbeat_s=0)).start()
    try:
        for i in range(k + 5):
            if proc.returncode is not None:
                break
            pub.publish_payload(frames[i % len(frames)][0], 0)
            await asyncio.sleep(0.06)  # the consumer, under valgrind, takes each message before the next
        out, err = await proc.communicate()
    finally:
        await pub.close()
    return _instructions(err), int(re.search(rb"blocks (\d+)", out).group(1))


async def consumer(mode: str) -> float:
    from relay import make_frames

    from kvbridge.tools.server import NatsServer

    frames = make_frames(200, 600, 50_000)
    with NatsServer() as server:
        a = await _consumer(server.url, mode, 40, frames)
        b = await _consumer(server.url, mode, 240, frames)
    return (b[0] - a[0]) / (b[1] - a[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="*", default=["batch", "lazy"], choices=["batch", "lazy", "lazy-noview"])
    args = ap.parse_args()
    floor = decode_loop("floor")
    rows = [("floor: msgspec into vLLM's KVEventBatch, in a loop", floor),
            ("kvbridge `decode_batch`, in a loop", decode_loop("kvbridge"))]  # fmt: skip
    names = {"batch": "`async for`, every `update.batch` decoded", "lazy": "`async for`, `update.n_blocks` only",
             "lazy-noview": "`async for`, `track_views=False`, `update.n_blocks` only"}  # fmt: skip
    for mode in args.modes:
        rows.append((names[mode] + " (one message at a time)", asyncio.run(consumer(mode))))
    print("| path | instructions / block event | floor / path |\n|---|---:|---:|")
    for name, ir in rows:
        print(f"| {name} | {ir:,.0f} | {floor / ir:.2f}x |")


if __name__ == "__main__":
    main()
