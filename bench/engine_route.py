"""The own-engine route: CPU in the engine process to publish its KV events, kvbridge against vLLM.

    python bench/engine_route.py [--steps 2000] [--rate 100000] [--runs 3] [--only ROUTE]

The batches: a ``KVCacheManager`` serving a chat-like workload (shared system prompts, prompts of
200-2000 tokens, decodes completing blocks, requests freed, a pool smaller than the working set so
blocks are evicted), ``take_events()`` after every engine step. Both routes then publish exactly
those batches, in an engine process of their own, at ``--rate`` block events/s (a deadline
schedule; 0: as fast as the publisher takes them):

* **kvbridge**: ``KvEventPublisher`` (``BackgroundPublisher``, default Config) -> nats-server,
  handed each step's events as ``take_events()`` made them (Python objects);
* **kvbridge, the pool's records**: the same publisher handed each step's ``take_record()`` (the
  pool's events kept native, written as msgpack from the record: what ``publisher.step()`` does
  with a native pool). The records are taken in the engine process before the clock, as the
  events are, from the same workload;
* **vLLM 0.33**: its ``ZmqEventPublisher`` loop (rewritten in bench/vllm_zmq.py: a queue, a
  thread encoding with msgspec and sending on a PUB, the replay buffer) -> a SUB draining it.

The events are built before the clock starts (vLLM's classes for vLLM, kvbridge's for kvbridge),
so the pools' own costs are left out; each step's batch object is made in the loop, as each
engine does. Measured: the engine process's CPU (every thread: resource.getrusage) from the first
batch until the publisher has sent the last, over the block events published. Goal: kvbridge <=
0.5x vLLM's. The routes alternate, each ratio from one round.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import random
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_zmq  # noqa: E402

from kvbridge.tools.server import NatsServer  # noqa: E402

BLOCK_SIZE = 16
ROUTES = ("null", "vllm", "kvbridge", "records")


def record_steps(n_steps: int, seed: int = 3, records: bool = False) -> list:
    """kvbridge events of ``n_steps`` engine steps of a KVCacheManager (steps without events left
    out); ``records``: each step's ``take_record()`` instead of its ``take_events()``."""
    from kvbridge._native import KVCacheManager

    rnd = random.Random(seed)
    mgr = KVCacheManager(num_blocks=8192, block_size=BLOCK_SIZE)
    systems = [[rnd.randrange(150_000) for _ in range(512)] for _ in range(4)]
    running: list[tuple[int, int]] = []  # (request id, steps left)
    steps, rid = [], 0
    while len(steps) < n_steps:
        for _ in range(rnd.randint(0, 3)):
            prompt = rnd.choice(systems) + [rnd.randrange(150_000) for _ in range(rnd.randint(200, 2000))]
            if mgr.allocate(rid, prompt) is not None:
                running.append((rid, rnd.randint(4, 40)))
            rid += 1
        still = []
        for r, left in running:
            if left == 0 or not mgr.append(r, [rnd.randrange(150_000) for _ in range(BLOCK_SIZE)]):
                mgr.free(r)
            else:
                still.append((r, left - 1))
        running = still
        events = mgr.take_record() if records else mgr.take_events()
        if len(events):
            steps.append(events)
    return steps


def _blocks(events) -> int:
    n = getattr(events, "n_blocks", None)  # an EventRecord
    return n if n is not None else sum(len(getattr(ev, "block_hashes", ())) for ev in events)


def _paced(steps: list, rate: float, publish) -> None:
    start = time.perf_counter()
    sent = 0
    for events in steps:
        if rate:
            due = start + sent / rate
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
        publish(events)
        sent += _blocks(events)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process (Linux), by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _report_threads(before: dict[str, float], n_steps: int) -> None:
    """KVB_BENCH_THREADS=1 (diagnostic): CPU per step of each thread over the measured window."""
    after = _thread_cpu()
    for tid, cpu in sorted(after.items()):
        name = "main" if tid == str(os.getpid()) else tid
        print(f"  thread {name}: {(cpu - before.get(tid, 0.0)) * 1e6 / n_steps:.0f} µs/step", file=sys.stderr)


def _kvbridge_main(url: str, steps: list, rate: float, out, records: bool = False) -> None:
    from kvbridge.bus.publisher import BackgroundPublisher
    from kvbridge.config import Config
    from kvbridge.wire.events import KVEventBatch

    if records:  # the same workload, its records taken here (they stay in this process)
        recs = record_steps(len(steps), records=True)
        assert [len(r) for r in recs] == [len(e) for e in steps], "the workload is not the same"
    pub = BackgroundPublisher(Config(servers=url, model="bench", worker_id="engine")).start()
    publish = pub.publish
    threads0 = _thread_cpu() if os.environ.get("KVB_BENCH_THREADS") else {}
    c0, t0 = _cpu(), time.perf_counter()
    if records:
        _paced(recs, rate, publish)
    else:
        _paced(steps, rate, lambda events: publish(KVEventBatch(time.time(), events)))
    if threads0:  # before close() ends the loop's thread
        _report_threads(threads0, len(steps))
    pub.close()  # returns once every handed-over batch is sent
    out.put((_cpu() - c0, time.perf_counter() - t0, pub.stats["events"]))


def _null_main(steps: list, rate: float, out) -> None:
    from kvbridge.wire.events import KVEventBatch

    kept: list = []
    c0, t0 = _cpu(), time.perf_counter()
    _paced(steps, rate, lambda events: kept.append(KVEventBatch(time.time(), events)))
    out.put((_cpu() - c0, time.perf_counter() - t0, sum(len(e) for e in steps)))


def _vllm_main(steps: list, rate: float, sub_ready, endpoint_q, out) -> None:
    pub = vllm_zmq.ZmqEventPublisher(0, "tcp://127.0.0.1:*", topic="kv")
    endpoint_q.put(pub.endpoint)
    sub_ready.wait(30)
    vsteps = [[vllm_zmq.from_kvbridge(ev) for ev in events] for events in steps]
    c0, t0 = _cpu(), time.perf_counter()
    _paced(vsteps, rate, lambda events: pub.publish(vllm_zmq.KVEventBatch(time.time(), events)))
    pub.shutdown()  # the thread sends what is queued, then stops (closing with linger 0, as vLLM does)
    out.put((_cpu() - c0, time.perf_counter() - t0, sum(len(e) for e in vsteps)))


def _zmq_sink_main(endpoint_q, sub_ready, expected: int, done) -> None:
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint_q.get(timeout=30))
    # A PUB drops for subscribers not connected yet: go once this socket is surely subscribed.
    mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    mon.poll(30_000)
    sub_ready.set()
    n = 0
    while n < expected and sub.poll(10_000):
        sub.recv_multipart()
        n += 1
    done.put(n)
    sub.close(0)
    mon.close(0)
    ctx.term()


def run_route(route: str, url: str, steps: list, rate: float) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    blocks = sum(_blocks(e) for e in steps)
    if route == "null":
        proc = ctx.Process(target=_null_main, args=(steps, rate, out))
        proc.start()
        cpu, wall, events = out.get(timeout=600)
        proc.join(30)
        delivered = True
    elif route in ("kvbridge", "records"):
        proc = ctx.Process(target=_kvbridge_main, args=(url, steps, rate, out, route == "records"))
        proc.start()
        cpu, wall, events = out.get(timeout=600)
        proc.join(30)
        delivered = events == sum(len(e) for e in steps)
    else:
        sub_ready, endpoint_q, done = ctx.Event(), ctx.Queue(), ctx.Queue()
        sink = ctx.Process(target=_zmq_sink_main, args=(endpoint_q, sub_ready, len(steps), done))
        proc = ctx.Process(target=_vllm_main, args=(steps, rate, sub_ready, endpoint_q, out))
        sink.start()
        proc.start()
        cpu, wall, events = out.get(timeout=600)
        delivered = done.get(timeout=60) == len(steps)
        proc.join(30)
        sink.join(30)
    return {"cpu_us": cpu * 1e6 / blocks, "wall_s": wall, "blocks_s": blocks / wall, "delivered": delivered}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=100_000, help="block events/s; 0: full speed")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", choices=ROUTES, help="run this route alone (to profile its process), no table")
    args = ap.parse_args()
    steps = record_steps(args.steps)
    blocks = sum(_blocks(e) for e in steps)
    print(f"# engine route bench: {len(steps)} KVCacheManager steps, {blocks / len(steps):.0f} block events "
          f"each, {'full speed' if not args.rate else f'{args.rate / 1e3:g}k block events/s'}, "
          f"{platform.python_version()}, {os.cpu_count()} CPUs")  # fmt: skip
    lines = ["| round | route | engine CPU µs / block event | publishing alone (minus the loop) | kvbridge / vLLM "
             "(publishing alone) | block events/s | all delivered |", "|---|---|---:|---:|---:|---:|:---:|"]  # fmt: skip
    with NatsServer() as server:
        if args.only:
            for i in range(args.runs):
                x = run_route(args.only, server.url, steps, args.rate)
                print(f"{args.only}: {x['cpu_us']:.3f} µs/ev, {x['blocks_s'] / 1e6:.2f} M/s, "
                      f"delivered {x['delivered']}")  # fmt: skip
            return
        for i in range(args.runs):
            r = {}
            for route in (ROUTES if i % 2 == 0 else ROUTES[::-1]):
                r[route] = run_route(route, server.url, steps, args.rate)
            null = r["null"]["cpu_us"]
            lines.append(f"| {i + 1} | the engine loop alone (batches made, not published) | {null:.3f} | — | — | "
                         f"{r['null']['blocks_s'] / 1e6:.2f} M | — |")  # fmt: skip
            for route, name in (("vllm", "vLLM 0.33 ZmqEventPublisher (copy)"), ("kvbridge", "kvbridge KvEventPublisher"),
                                ("records", "kvbridge KvEventPublisher, the pool's records")):  # fmt: skip
                x = r[route]
                ratio = (x["cpu_us"] - null) / (r["vllm"]["cpu_us"] - null)
                lines.append(f"| {i + 1} | {name} | {x['cpu_us']:.3f} | {x['cpu_us'] - null:.3f} | {ratio:.2f}x | "
                             f"{x['blocks_s'] / 1e6:.2f} M | {'yes' if x['delivered'] else '**no**'} |")  # fmt: skip
            print(f"round {i + 1}: vllm {r['vllm']['cpu_us']:.3f}, kvbridge {r['kvbridge']['cpu_us']:.3f}, records "
                  f"{r['records']['cpu_us']:.3f} µs/ev", file=sys.stderr)  # fmt: skip
    print("\n".join(lines))


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
