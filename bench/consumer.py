"""The decode floor for Python consumers: ``async for update in sub`` against msgspec alone.

    python bench/consumer.py [--seconds 3] [--runs 3]

The floor: msgspec decoding the payloads into vLLM 0.33's own ``KVEventBatch`` shape
(bench/vllm_zmq.py) in a loop, on one core, nothing else -- the least any consumer that hands
Python event objects out can spend. Against it, in a process of its own, a ``KvEventSubscriber``
read with ``async for`` from a real nats-server:

* ``async for``, ``update.batch`` (every batch decoded into kvbridge's KVEventBatch, as a consumer
  that reads events does);
* ``async for``, ``update.n_blocks`` only: the documented lazy form (the batch is scanned natively
  on arrival -- validated, block hashes read for the per-worker view -- and decoded only if
  ``update.batch`` is touched);
* ``async for`` with ``track_views=False``, ``update.n_blocks`` only: no per-worker view either.

A KvEventPublisher in this process sends the payloads unchanged (``publish_payload``), keeping at
most ``--window`` messages beyond what the consumer has taken, so nothing is dropped for being
slow. CPU per block event: the consumer process's user+system time over the measured window
(after ``--warmup``) over the block events it took; the ratio is the floor's CPU per block event
over the consumer's (>= 0.8x is the goal), from the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

import msgspec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_zmq  # noqa: E402  (bench/: vLLM 0.33's shapes, rewritten)
from relay import cpu_s, make_frames  # noqa: E402  (the same vLLM 0.33 steps as the relay bench)

from kvbridge.tools.server import NatsServer  # noqa: E402

MODES = {
    "batch": "`async for`, every `update.batch` decoded",
    "lazy": "`async for`, `update.n_blocks` only (lazy form)",
    "lazy-noview": "`async for`, `track_views=False`, `update.n_blocks` only",
}


def floor_us(payloads: list[bytes], blocks: int, runs: int = 5) -> float:
    """µs of CPU per block event for msgspec alone (best of ``runs``)."""
    decode = msgspec.msgpack.Decoder(vllm_zmq.KVEventBatch).decode
    best = float("inf")
    for _ in range(runs):
        t0 = time.process_time()
        for p in payloads:
            decode(p)
        best = min(best, time.process_time() - t0)
    return best * 1e6 / blocks


def _consumer_main(url: str, mode: str, taken, ready) -> None:
    from kvbridge.bus.subscriber import KvEventSubscriber
    from kvbridge.config import Config

    async def run() -> None:
        sub = await KvEventSubscriber(Config(servers=url), subject="kv.events.bench.w0",
                                      track_views=mode != "lazy-noview").start()  # fmt: skip
        ready.set()
        n = 0
        if mode == "batch":
            async for u in sub:
                u.batch
                n += u.n_blocks
                taken.value = n
        else:
            async for u in sub:
                n += u.n_blocks
                taken.value = n

    asyncio.run(run())


async def _produce(url: str, frames: list[tuple[bytes, int]], taken, seconds: float, warmup: float, window: int,
                   pid: int) -> dict:  # fmt: skip
    from kvbridge.bus.publisher import KvEventPublisher
    from kvbridge.config import Config

    pub = await KvEventPublisher(Config(servers=url, model="bench", worker_id="w0", heartbeat_s=0)).start()
    per_frame = statistics.fmean(b for _, b in frames)
    n = len(frames)
    sent = sent_blocks = 0
    start = time.perf_counter()
    mark = None
    try:
        while True:
            now = time.perf_counter()
            if mark is None and now - start >= warmup:
                mark = (now, taken.value, cpu_s(pid))
            if now - start >= warmup + seconds:
                break
            if sent_blocks - taken.value >= window * per_frame:
                await asyncio.sleep(0.0002)
                continue
            payload, blocks = frames[sent % n]
            pub.publish_payload(payload, 0)  # the event count only feeds the publisher's stats
            sent += 1
            sent_blocks += blocks
            if sent % 8 == 0:
                await asyncio.sleep(0)  # the publisher sends from this loop
        end = (time.perf_counter(), taken.value, cpu_s(pid))
    finally:
        await pub.close()
    got = end[1] - mark[1]
    return {"blocks_s": got / (end[0] - mark[0]), "cpu_us": (end[2] - mark[2]) * 1e6 / max(got, 1)}


def run_consumer(url: str, mode: str, frames: list[tuple[bytes, int]], seconds: float, warmup: float,
                 window: int) -> dict:  # fmt: skip
    ctx = mp.get_context("spawn")
    taken, ready = ctx.Value("q", 0, lock=False), ctx.Event()
    proc = ctx.Process(target=_consumer_main, args=(url, mode, taken, ready), daemon=True)
    proc.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("consumer did not start")
        return asyncio.run(_produce(url, frames, taken, seconds, warmup, window, proc.pid))
    finally:
        proc.terminate()
        proc.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--blocks-per-step", type=int, default=600)
    ap.add_argument("--window", type=int, default=64)
    args = ap.parse_args()

    frames = make_frames(args.frames, args.blocks_per_step, 50_000)
    payloads = [p for p, _ in frames]
    blocks = sum(b for _, b in frames)
    print(f"# consumer bench: {len(frames)} vLLM 0.33 steps, {blocks / len(frames):.0f} block events each, "
          f"{platform.python_version()}, {os.cpu_count()} CPUs")  # fmt: skip
    lines = ["| round | path | block events/s | CPU µs / block event | floor / path (CPU) |", "|---|---|---:|---:|---:|"]
    with NatsServer() as server:
        for i in range(args.runs):
            floor = floor_us(payloads, blocks)
            lines.append(f"| {i + 1} | floor: msgspec into vLLM's KVEventBatch, one core | {1 / floor:.2f} M | "
                         f"{floor:.3f} | 1.00x |")  # fmt: skip
            for mode, name in MODES.items():
                r = run_consumer(server.url, mode, frames, args.seconds, args.warmup, args.window)
                lines.append(f"| {i + 1} | {name} | {r['blocks_s'] / 1e6:.2f} M | {r['cpu_us']:.3f} | "
                             f"{floor / r['cpu_us']:.2f}x |")  # fmt: skip
                print(f"round {i + 1} {mode}: {r['blocks_s'] / 1e6:.2f} M/s", file=sys.stderr)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
