"""vLLM's route: engine ZMQ PUB -> ``kvbridge relay`` -> nats-server, beside a raw forwarder.

    python bench/relay.py [--seconds 3] [--runs 3] [--frames 300] [--blocks-per-step 600]

An engine stand-in (this process) publishes vLLM 0.33-encoded steps on a pyzmq PUB exactly as
vLLM's ``ZmqEventPublisher`` frames them (``[topic, seq u64 big-endian, payload]``) and answers its
replay ROUTER as vLLM does. Between it and a real nats-server runs, in a process of its own, either

* **raw**: pyzmq SUB -> nats-py ``publish`` of the same bytes, nothing else (the anchor), or
* **relay**: ``kvbridge.engine.relay.Relay`` with its view, seq tracking, replay endpoint and
  idle probe on -- what ``kvbridge relay`` and the vLLM plugin run.

A sink process subscribes and checks every payload against the frame it came from (byte-identical,
in order: ``identical``). At saturation: the engine keeps at most ``--window`` frames beyond what
the sink has received in flight, so ZMQ's high-water mark never drops (a drop would measure
recovery, not throughput). CPU per block event: each process's user+system time (/proc/PID/stat)
over the measured window divided by the block events the sink received in it. Both forwarders run
in each round, alternately, on the same cores; the ratios are from the same round.

``--plugin``: vLLM's API server with the kvbridge plugin, stood in for by a process whose main
thread runs pure-Python "frontend" work (a counting loop) while one daemon thread runs a relay per
data-parallel rank on its own event loop, as the plugin does; two engine stand-ins publish 50k
block events/s each (paced). Printed: the relays' thread's share of a core, and the share of the
GIL they take from the frontend (its loop rate with the relays running against the same process
with the engines silent, alternated).

A step: what vLLM's BlockPool emits for a full prefix cache (4-14 prefill chunks of 1-64 blocks,
6-10 decode blocks, one BlockStored each, group 0, full attention, 16 tokens per block; as many
single-block BlockRemoved as blocks stored, oldest first). The steps form a ring: the first steps
evict the last steps' blocks, so cycling them keeps the view at a steady size.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time

import zmq

from kvbridge.tools.server import NatsServer
from kvbridge.wire.events import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch

BLOCK_SIZE = 16
TOPIC = b"kv"
_CLK = os.sysconf("SC_CLK_TCK")


def make_frames(n_frames: int, blocks_per_step: int, pool_blocks: int, seed: int = 7) -> list[tuple[bytes, int]]:
    """``(payload, block events)`` per step, vLLM 0.33's msgpack (kvbridge's encoder is
    byte-identical to vLLM's, tests/test_vllm.py)."""
    rnd = random.Random(seed)
    tokens = [rnd.randrange(150_000) for _ in range(64 * BLOCK_SIZE * 4)]
    target = blocks_per_step // 2
    stores: list[list[BlockStored]] = []
    order: list[int] = []  # every stored hash, in storing order
    for _ in range(n_frames):
        events: list[BlockStored] = []
        stored = 0
        while stored < target - 8:
            n = min(rnd.randint(1, 64), target - stored)
            hashes = [rnd.getrandbits(63) for _ in range(n)]
            t0 = rnd.randrange(len(tokens) - n * BLOCK_SIZE)
            events.append(BlockStored(hashes, rnd.getrandbits(63), tokens[t0 : t0 + n * BLOCK_SIZE], BLOCK_SIZE,
                                      None, "GPU", None, group_idx=0, kv_cache_spec_kind="full_attention"))  # fmt: skip
            order.extend(hashes)
            stored += n
        for _ in range(rnd.randint(6, 10)):
            h = rnd.getrandbits(63)
            t0 = rnd.randrange(len(tokens) - BLOCK_SIZE)
            events.append(BlockStored([h], rnd.getrandbits(63), tokens[t0 : t0 + BLOCK_SIZE], BLOCK_SIZE, None,
                                      "GPU", None, group_idx=0, kv_cache_spec_kind="full_attention"))  # fmt: skip
            order.append(h)
        stores.append(events)
    total = len(order)
    pool_blocks = min(pool_blocks, total // 2)
    frames = []
    pos = 0
    for events in stores:
        k = sum(len(ev.block_hashes) for ev in events)
        # Evict the blocks stored pool_blocks earlier, on the ring: steady state when cycled.
        evicted = [order[(pos + i - pool_blocks) % total] for i in range(k)]
        pos += k
        batch = events + [BlockRemoved([h], "GPU", group_idx=0) for h in evicted]
        frames.append((encode_batch(KVEventBatch(time.time(), batch, 0)), 2 * k))
    return frames


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _CLK  # utime, stime


# -- the processes -----------------------------------------------------------------------------------


def _sink_main(url: str, subject: str, frames: list[bytes], received, bad, ready) -> None:
    async def run() -> None:
        import nats

        nc = await nats.connect(url, pending_size=256 * 1024 * 1024)
        n = len(frames)
        count = 0

        last_seq = -1

        async def on_msg(msg) -> None:
            nonlocal count, last_seq
            hdr = msg.headers
            if hdr is not None:  # the relay's: Kv-Seq counts every message, heartbeats too
                seq = int(hdr["Kv-Seq"])
                if seq != last_seq + 1:
                    bad.value += 1
                last_seq = seq
                if len(msg.data) < 32 and not decode_batch(msg.data).events:
                    return  # a heartbeat: an empty batch
            if msg.data != frames[count % n]:
                bad.value += 1
            count += 1
            received.value = count

        await nc.subscribe(subject, cb=on_msg, pending_msgs_limit=1_000_000, pending_bytes_limit=-1)
        await nc.flush()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(run())


def _raw_main(url: str, endpoint: str, subject: str, ready) -> None:
    async def run() -> None:
        import nats
        import zmq.asyncio

        nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(endpoint)
        ready.set()
        while True:
            frames = await sub.recv_multipart(copy=True)
            await nc.publish(subject, frames[2])

    asyncio.run(run())


def _relay_main(url: str, endpoint: str, replay: str, ready) -> None:
    from kvbridge.config import Config
    from kvbridge.engine.relay import Relay

    async def run() -> None:
        relay = Relay(Config(servers=url, model="bench", worker_id="w0"), endpoint=endpoint, replay_endpoint=replay,
                      topic=TOPIC.decode())  # fmt: skip
        async with relay:
            ready.set()
            await relay.wait()

    asyncio.run(run())


class Engine:
    """vLLM's ZmqEventPublisher as the relay sees it: PUB frames, a ROUTER answering replays from
    the frames it keeps."""

    def __init__(self, frames: list[tuple[bytes, int]]) -> None:
        self.frames = frames
        self.ctx = zmq.Context()
        # XPUB: a PUB that also hands over subscriptions, so the run starts once the forwarder's
        # SUB is connected and subscribed (a PUB drops frames for subscribers not there yet).
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.seq = 0
        self.kept = 10_000  # vLLM's default replay buffer

    def wait_subscribed(self, timeout: float) -> bool:
        if not self.pub.poll(int(timeout * 1000)):
            return False
        return self.pub.recv().startswith(b"\x01")

    def answer_replays(self) -> None:
        while self.router.poll(0):
            ident, _, start = self.router.recv_multipart()
            first = max(int.from_bytes(start, "big"), self.seq - self.kept)
            for seq in range(first, self.seq):
                self.router.send_multipart([ident, b"", TOPIC, seq.to_bytes(8, "big"),
                                            self.frames[seq % len(self.frames)][0]])  # fmt: skip
            self.router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])  # vLLM's end marker

    def run(self, received, seconds: float, warmup: float, window: int, pids: dict[str, int]) -> dict:
        """Publish at saturation for warmup + seconds; measure the last ``seconds``."""
        frames, n = self.frames, len(self.frames)
        blocks_at = [0]  # block events in frames [0, i) of the endless cycle, by i mod n
        for _, b in frames:
            blocks_at.append(blocks_at[-1] + b)

        def blocks(count: int) -> int:
            q, r = divmod(count, n)
            return q * blocks_at[n] + blocks_at[r]

        send = self.pub.send_multipart
        start = time.perf_counter()
        mark = None
        while True:
            now = time.perf_counter()
            if mark is None and now - start >= warmup:
                mark = (now, received.value, {k: cpu_s(p) for k, p in pids.items()})
            if now - start >= warmup + seconds:
                break
            if self.seq - received.value >= window:
                self.answer_replays()
                time.sleep(0.0002)
                continue
            send([TOPIC, self.seq.to_bytes(8, "big"), frames[self.seq % n][0]])
            self.seq += 1
        end = (time.perf_counter(), received.value, {k: cpu_s(p) for k, p in pids.items()})
        got = blocks(end[1]) - blocks(mark[1])
        wall = end[0] - mark[0]
        return {
            "batches_s": (end[1] - mark[1]) / wall,
            "blocks_s": got / wall,
            "cpu_us": {k: (end[2][k] - mark[2][k]) * 1e6 / max(got, 1) for k in pids},
            "sent": self.seq,
        }

    def finish(self, received, timeout: float = 30.0) -> bool:
        """Wait until the sink has everything sent (answering replays meanwhile)."""
        deadline = time.monotonic() + timeout
        while received.value < self.seq and time.monotonic() < deadline:
            self.answer_replays()
            time.sleep(0.001)
        return received.value >= self.seq

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def run_one(kind: str, url: str, frames: list[tuple[bytes, int]], seconds: float, warmup: float, window: int) -> dict:
    ctx = mp.get_context("spawn")
    subject = "raw.events" if kind == "raw" else "kv.events.bench.w0"
    received, bad = ctx.Value("q", 0, lock=False), ctx.Value("q", 0, lock=False)
    sink_ready, fwd_ready = ctx.Event(), ctx.Event()
    sink = ctx.Process(target=_sink_main, args=(url, subject, [p for p, _ in frames], received, bad, sink_ready),
                       daemon=True)  # fmt: skip
    sink.start()
    engine = Engine(frames)
    if kind == "raw":
        fwd = ctx.Process(target=_raw_main, args=(url, engine.endpoint, subject, fwd_ready), daemon=True)
    else:
        fwd = ctx.Process(target=_relay_main, args=(url, engine.endpoint, engine.replay_endpoint, fwd_ready),
                          daemon=True)  # fmt: skip
    fwd.start()
    try:
        if not (sink_ready.wait(30) and fwd_ready.wait(30)):
            raise RuntimeError(f"{kind}: processes did not start")
        if not engine.wait_subscribed(30):
            raise RuntimeError(f"{kind}: the forwarder did not subscribe")
        pids = {"forwarder": fwd.pid, "engine": os.getpid(), "sink": sink.pid}
        res = engine.run(received, seconds, warmup, window, pids)
        complete = engine.finish(received)
        res["identical"] = complete and bad.value == 0
        res["kind"] = kind
        return res
    finally:
        for p in (fwd, sink):
            p.terminate()
            p.join(10)
        engine.close()


def _api_server_main(url: str, endpoints: list[tuple[str, str]], seconds: float, ready, go, out) -> None:
    """The stand-in API server: relays on a daemon thread's loop, frontend work on the main thread."""
    import threading

    from kvbridge.config import Config
    from kvbridge.engine.relay import Relay

    loop = asyncio.new_event_loop()
    relays: list[Relay] = []
    tid: list[int] = []

    def run_loop() -> None:
        tid.append(threading.get_native_id())
        asyncio.set_event_loop(loop)
        loop.run_forever()

    thread = threading.Thread(target=run_loop, name="kvbridge-vllm", daemon=True)
    thread.start()

    async def start() -> None:
        for rank, (endpoint, replay) in enumerate(endpoints):
            relay = Relay(Config(servers=url, model="bench", worker_id=f"dp{rank}"), endpoint=endpoint,
                          replay_endpoint=replay, topic=TOPIC.decode(), dp_rank=None)  # fmt: skip
            relays.append(await relay.start())

    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    ready.set()
    try:
        while True:
            phase = go.get()
            if phase is None:
                break
            c0 = cpu_s_task(tid[0])
            n = 0
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:  # the frontend: pure Python, needs the GIL throughout
                for _ in range(1000):
                    n += 1
            out.put((phase, n / seconds, (cpu_s_task(tid[0]) - c0) / seconds))
    finally:
        async def stop() -> None:
            for relay in relays:
                await relay.close()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def cpu_s_task(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _CLK


def run_plugin(url: str, frames: list[tuple[bytes, int]], rate: float, seconds: float, rounds: int) -> list[dict]:
    """2 engines at ``rate`` block events/s each into the stand-in API server; per round, the
    frontend's rate with the engines publishing and with them silent."""
    ctx = mp.get_context("spawn")
    engines = [Engine(frames), Engine(frames)]
    ready, go, out = ctx.Event(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_api_server_main, daemon=True,
                       args=(url, [(e.endpoint, e.replay_endpoint) for e in engines], seconds, ready, go, out))  # fmt: skip
    proc.start()
    try:
        if not ready.wait(60) or not all(e.wait_subscribed(30) for e in engines):
            raise RuntimeError("the API server stand-in did not start")
        per_frame = statistics.fmean(b for _, b in frames)
        period = per_frame / rate
        results = []
        for i in range(rounds):
            row = {}
            for phase in (("busy", "idle") if i % 2 == 0 else ("idle", "busy")):
                go.put(phase)
                if phase == "busy":
                    start = time.perf_counter()
                    sent = 0
                    while out.empty():  # deadline schedule, both engines in step
                        due = start + sent * period
                        now = time.perf_counter()
                        if due > now:
                            time.sleep(min(due - now, 0.01))
                            continue
                        for e in engines:
                            e.pub.send_multipart([TOPIC, e.seq.to_bytes(8, "big"), frames[e.seq % len(frames)][0]])
                            e.seq += 1
                            e.answer_replays()
                        sent += 1
                    row["block_events_s"] = 2 * sent * per_frame / (time.perf_counter() - start)
                else:
                    while out.empty():  # silent engines still answer the relays' idle probes
                        for e in engines:
                            e.answer_replays()
                        time.sleep(0.005)
                _, loops, relay_cpu = out.get(timeout=seconds + 30)
                row[phase] = (loops, relay_cpu)
            results.append(row)
        go.put(None)
        proc.join(60)
        return results
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
        for e in engines:
            e.close()


def plugin_table(rows: list[dict]) -> str:
    lines = [
        "| round | block events/s (2 ranks) | relays' thread: share of a core (bounds its GIL share) | frontend loop rate, engines silent | with the relays busy | frontend rate lost |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rows, 1):
        idle, busy = r["idle"][0], r["busy"][0]
        lines.append(f"| {i} | {r['block_events_s'] / 1e3:.0f} k | {r['busy'][1] * 100:.1f}% | {idle / 1e6:.2f} M/s "
                     f"| {busy / 1e6:.2f} M/s | {max(0.0, 1 - busy / idle) * 100:.1f}% |")  # fmt: skip
    return "\n".join(lines)


def table(rounds: list[dict]) -> str:
    lines = [
        "| round | path | batches/s | block events/s | vs raw | forwarder CPU µs / block event | vs raw | engine µs/ev | sink µs/ev | identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for i, r in enumerate(rounds, 1):
        raw, rel = r["raw"], r["relay"]
        for row in (raw, rel):
            is_raw = row is raw
            name = "raw pyzmq SUB -> nats-py" if is_raw else "kvbridge relay (view + replay on)"
            speed = 1.0 if is_raw else rel["blocks_s"] / raw["blocks_s"]
            cpu = 1.0 if is_raw else rel["cpu_us"]["forwarder"] / raw["cpu_us"]["forwarder"]
            lines.append(
                f"| {i} | {name} | {row['batches_s']:,.0f} | {row['blocks_s'] / 1e6:.2f} M | {speed:.2f}x "
                f"| {row['cpu_us']['forwarder']:.3f} | {cpu:.2f}x | {row['cpu_us']['engine']:.3f} "
                f"| {row['cpu_us']['sink']:.3f} | {'yes' if row['identical'] else '**no**'} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--frames", type=int, default=300, help="distinct steps in the ring")
    ap.add_argument("--blocks-per-step", type=int, default=600)
    ap.add_argument("--pool-blocks", type=int, default=50_000)
    ap.add_argument("--window", type=int, default=64, help="frames in flight beyond what the sink has")
    ap.add_argument("--plugin", action="store_true", help="the API-server stand-in instead (module doc)")
    ap.add_argument("--rate", type=float, default=50_000, help="--plugin: block events/s per rank")
    args = ap.parse_args()

    frames = make_frames(args.frames, args.blocks_per_step, args.pool_blocks)
    per = statistics.fmean(b for _, b in frames)
    size = statistics.fmean(len(p) for p, _ in frames)
    print(f"# relay bench: {len(frames)} vLLM 0.33 steps, {per:.0f} block events / {size / 1024:.1f} KiB each, "
          f"{platform.python_version()}, {os.cpu_count()} CPUs")  # fmt: skip
    if args.plugin:
        with NatsServer() as server:
            rows = run_plugin(server.url, frames, args.rate, args.seconds, args.runs)
        print(plugin_table(rows))
        return
    rounds = []
    with NatsServer() as server:
        for i in range(args.runs):
            r = {}
            for kind in (("raw", "relay") if i % 2 == 0 else ("relay", "raw")):
                r[kind] = run_one(kind, server.url, frames, args.seconds, args.warmup, args.window)
            rounds.append(r)
            print(f"round {i + 1}: raw {r['raw']['blocks_s'] / 1e6:.2f} M/s, relay {r['relay']['blocks_s'] / 1e6:.2f} M/s",
                  file=sys.stderr)  # fmt: skip
    print(table(rounds))
    ok = all(r[k]["identical"] for r in rounds for k in r)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
