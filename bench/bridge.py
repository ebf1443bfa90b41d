"""Engine -> NATS -> subscriber, through a real local nats-server, beside raw nats-py.

    python bench/bridge.py [--seconds 4] [--runs 3] [--write]

The engine (this process) hands one engine step at a time to a BackgroundPublisher (default
Config); a KvEventSubscriber in another process keeps a per-worker view (set of block hashes), as
a router would, and records receive time minus the step's hand-off time (one sample per NATS
message: the oldest hand-off in it). Two workloads:

* ``vllm-steps``: what vLLM's BlockPool emits for a full prefix cache. Per step: 0-2 prefills
  (one BlockStored of 1-64 blocks each, chunked prefill caps a chunk at 64 blocks), about 8
  decode requests completing a block (BlockStored of 1 block each), and as many evictions as
  blocks stored, one BlockRemoved per evicted block (as vLLM's ``_maybe_evict_cached_block``
  does). 16 tokens per block.
* ``1-block``: every event carries one block (80% BlockStored / 20% BlockRemoved): the worst case
  for per-event cost; 1 ms of events per step (1000 events per step at full speed).

"Block events" = block hashes stored + removed (a BlockStored of 64 blocks counts 64). Each
workload is run at full speed (the engine hands over as fast as the publisher drains), and
paced at 100k and 1M block events/s on a deadline schedule. publish() is timed alone
(perf_counter_ns around the call, batch built before), so sleeps never enter it.
Anchor: raw nats-py publishing the very payloads kvbridge sends for that workload, with the same
headers, to a raw nats-py subscriber that only counts (no decoding): transport alone.
The vllm-steps workload also runs a subscriber that reads every batch with ``async for`` (each
fully decoded into KVEventBatch objects), and, as its ceiling, ``decode_batch`` alone on the
anchor's payloads in this process (no NATS, one core).

``--write`` replaces the "Bridge" section of bench/RESULTS.md.
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
from pathlib import Path

from kvbridge import BackgroundPublisher, BlockRemoved, BlockStored, Config, KVEventBatch, encode_batch
from kvbridge.tools.server import NatsServer

BLOCK_SIZE = 16
# Full speed: the engine keeps up to about this many events handed over and not yet drained (in
# whole steps). This loop is pure Python and holds the GIL while it runs; kept to 64 vllm-steps
# steps (~3k events) it woke so often that the publisher's loop thread, waiting for the GIL, sent
# ~1/3 less (0.97-1.15 M vs 1.53-1.78 M block events/s, same box, same minute). 1-block steps
# hold 1000 events each: 64 of them, as before.
FULL_SPEED_QUEUED_EVENTS = 65536


# -- workloads: lists of engine steps, each (events, block events) ---------------------------------


def vllm_steps(n_steps: int, seed: int = 1) -> list[tuple[list, int]]:
    rnd = random.Random(seed)
    cached: list[int] = []  # oldest first: the eviction order of a full pool
    steps = []
    for _ in range(n_steps):
        events: list = []
        stored = 0
        for _ in range(rnd.choice((0, 1, 1, 2))):
            n = rnd.randint(1, 64)
            hashes = [rnd.getrandbits(64) for _ in range(n)]
            tokens = [rnd.randrange(150_000) for _ in range(n * BLOCK_SIZE)]
            events.append(BlockStored(hashes, rnd.getrandbits(64), tokens, BLOCK_SIZE, None, "GPU", None))
            cached.extend(hashes)
            stored += n
        for _ in range(rnd.randint(6, 10)):
            h = rnd.getrandbits(64)
            tokens = [rnd.randrange(150_000) for _ in range(BLOCK_SIZE)]
            events.append(BlockStored([h], rnd.getrandbits(64), tokens, BLOCK_SIZE, None, "GPU", None))
            cached.append(h)
            stored += 1
        evicted = cached[:stored]
        del cached[:stored]
        # vLLM evicts while allocating, before the step's blocks are cached: removals come first.
        events[:0] = [BlockRemoved([h], "GPU") for h in evicted]
        steps.append((events, 2 * stored))
    return steps


def one_block_events(n: int) -> list:
    out = []
    for i in range(n):
        if i % 5 == 4:
            out.append(BlockRemoved([i - 2], "GPU"))
        else:
            out.append(BlockStored([i], i - 1 if i else None, list(range(i, i + BLOCK_SIZE)), BLOCK_SIZE, None, "GPU", None))
    return out


def one_block_steps(events: list, per_step: int) -> list[tuple[list, int]]:
    return [(events[i : i + per_step], per_step) for i in range(0, len(events) - per_step + 1, per_step)]


# -- subscriber process ----------------------------------------------------------------------------


def _subscriber_main(url: str, mode: str, subject: str, conn) -> None:
    import gc

    gc.freeze()
    asyncio.run(_subscriber(url, mode, subject, conn))


async def _subscriber(url: str, mode: str, subject: str, conn) -> None:
    lat: list[float] = []
    received = [0, 0.0, 0.0]  # block events, first receive, last receive

    def record(ts: float, n: int) -> None:
        now = time.time()
        if not received[0]:
            received[1] = now
        received[0] += n
        received[2] = now
        lat.append(now - ts)

    if mode == "bridge-decode":
        # A consumer that reads every event with ``async for``: each batch fully decoded.
        from kvbridge import KvEventSubscriber

        sub = await KvEventSubscriber(Config(servers=url), subject=subject).start()

        async def consume() -> None:
            async for u in sub:
                if not u.reset:
                    batch = u.batch
                    record(batch.ts, sum(len(getattr(ev, "block_hashes", ())) for ev in batch.events))

        consumer = asyncio.create_task(consume())

        async def closer() -> None:
            await sub.close()
            await consumer

        stats = lambda: sub.stats  # noqa: E731
    elif mode == "bridge":
        from kvbridge import KvEventSubscriber

        def on_update(u):
            if not u.reset and u.n_events:
                record(u.ts, u.n_blocks)

        sub = await KvEventSubscriber(Config(servers=url), subject=subject, on_update=on_update).start()
        closer = sub.close
        stats = lambda: sub.stats  # noqa: E731
    else:
        import nats

        nc = await nats.connect(url)

        async def on_msg(m):
            record(float(m.headers["Ts"]), int(m.headers["N"]))

        await nc.subscribe(subject, cb=on_msg, pending_msgs_limit=1 << 20, pending_bytes_limit=1 << 30)
        await nc.flush()
        closer = nc.close
        stats = dict
    conn.send("ready")
    expected = await asyncio.to_thread(conn.recv)
    last_progress, seen = time.monotonic(), -1
    while received[0] < expected and time.monotonic() - last_progress < 5:
        if received[0] != seen:
            seen, last_progress = received[0], time.monotonic()
        await asyncio.sleep(0.01)
    await closer()
    conn.send((received[0], received[1], received[2], lat, stats()))


class SubscriberProcess:
    def __init__(self, url: str, mode: str, subject: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_subscriber_main, args=(url, mode, subject, child), daemon=True)
        self.proc.start()
        assert self.conn.poll(30) and self.conn.recv() == "ready"

    def result(self, expected: int):
        self.conn.send(expected)
        assert self.conn.poll(120)
        out = self.conn.recv()
        self.proc.join(10)
        return out


# -- engine side -------------------------------------------------------------------------------------


def run_bridge(url: str, worker: str, workload: str, steps: list, rate: int | None, seconds: float, sub_mode: str = "bridge") -> dict:
    sub = SubscriberProcess(url, sub_mode, f"kv.events.bench.{worker}")
    pub = BackgroundPublisher(Config(servers=url, model="bench", worker_id=worker)).start()
    publisher = pub.publisher
    publish = pub.publish
    calls: list[int] = []
    sent = 0
    n = len(steps)
    max_queued = max(1, FULL_SPEED_QUEUED_EVENTS * n // sum(len(events) for events, _ in steps))
    perf_ns = time.perf_counter_ns
    start = time.perf_counter()
    end = start + seconds
    i = 0
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        if rate is not None:
            due = start + sent / rate  # deadline schedule: lateness is caught up, never accumulated
            if due > now:
                time.sleep(due - now)
        elif len(publisher._queue) > max_queued:
            # Full speed, but no faster than the loop drains: beyond its bound the hand-off
            # queue drops the oldest (by design), which would measure drops, not throughput.
            time.sleep(0.0002)
            continue
        events, blocks = steps[i]
        i = i + 1 if i + 1 < n else 0
        batch = KVEventBatch(time.time(), events)
        t0 = perf_ns()
        publish(batch)
        calls.append(perf_ns() - t0)
        sent += blocks
    engine_s = time.perf_counter() - start
    pub.close()
    received, first, last, lat, sub_stats = sub.result(sent)
    stats = publisher.stats
    calls.sort()
    return {
        "workload": workload,
        "path": ("kvbridge" if sub_mode == "bridge" else "kvbridge, `async for` decoding every batch")
        + ("" if rate is None else f" @ {rate / 1000:g}k/s"),
        "rate": rate,
        "sent": sent,
        "received": received,
        "events_s": received / max(last - first, 1e-9) if rate is None else received / engine_s,
        "lat": lat,
        "call_mean_us": statistics.fmean(calls) / 1e3,
        "call_p99_us": calls[int(0.99 * len(calls))] / 1e3,
        "call_max_us": calls[-1] / 1e3,
        "dropped": stats["dropped_events"] + stats["evicted_unsent"],
        "messages": stats["messages"],
        "resyncs": sub_stats.get("gaps", 0) + sub_stats.get("epoch_changes", 0),
        "floor_us": None if rate is None else call_floor(rate, steps),
    }


def bridge_payloads(steps: list, max_bytes: int, max_events: int) -> list[tuple[bytes, int]]:
    """The messages kvbridge's publisher makes of these steps when it coalesces under load."""
    out = []
    events: list = []
    size = 0
    for evs, _ in steps:
        for ev in evs:
            events.append(ev)
            size += 24 + BLOCK_SIZE * 3 * len(getattr(ev, "token_ids", ())) // BLOCK_SIZE
            if len(events) >= max_events or size >= max_bytes * 0.8:
                payload = encode_batch(KVEventBatch(time.time(), events))
                out.append((payload, sum(len(e.block_hashes) for e in events)))
                events, size = [], 0
    return out


async def _raw_publish(url: str, payloads: list, seconds: float) -> tuple[int, int]:
    import nats

    nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
    msgs = sent = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(16):
            payload, blocks = payloads[msgs % len(payloads)]
            s = str(msgs)
            hdrs = {"Kv-Seq": s, "Kv-Epoch": "0123456789abcdef", "Nats-Msg-Id": "w:0123456789abcdef:" + s,
                    "Content-Type": "application/msgpack", "Ts": repr(time.time()), "N": str(blocks)}  # fmt: skip
            await nc.publish("raw.events", payload, headers=hdrs)
            msgs += 1
            sent += blocks
        await asyncio.sleep(0)
    await nc.flush()
    await nc.close()
    return msgs, sent


def run_raw(url: str, workload: str, payloads: list, seconds: float) -> dict:
    sub = SubscriberProcess(url, "raw", "raw.events")
    msgs, sent = asyncio.run(_raw_publish(url, payloads, seconds))
    received, first, last, lat, _ = sub.result(sent)
    return {
        "workload": workload,
        "path": "anchor: raw nats-py, same payloads + headers",
        "rate": None,
        "sent": sent,
        "received": received,
        "events_s": received / max(last - first, 1e-9),
        "lat": lat,
        "messages": msgs,
    }


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


_ONE_BLOCK = one_block_events(200_000)


def call_floor(rate: int, steps: list, seconds: float = 1.0) -> float:
    """Mean cost of a 3-line Python method timed exactly like publish(), in the same paced loop:
    what any call costs here after a sleep (cold caches), before kvbridge does anything."""
    from collections import deque

    class Noop:
        def __init__(self) -> None:
            self.q: deque = deque()
            self.sleeping = False

        def publish(self, batch) -> None:
            self.q.append((batch.ts, batch.events))
            if self.sleeping:
                pass

    noop = Noop()
    calls = []
    sent = i = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        due = start + sent / rate
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        events, blocks = steps[i % len(steps)]
        i += 1
        batch = KVEventBatch(time.time(), events)
        t0 = time.perf_counter_ns()
        noop.publish(batch)
        calls.append(time.perf_counter_ns() - t0)
        noop.q.clear()
        sent += blocks
    return statistics.fmean(calls) / 1e3


def decode_ceiling(payloads: list, runs: int = 3) -> float:
    """Block events/s ``decode_batch`` alone turns into KVEventBatch objects, on one core: what
    any subscriber that decodes every batch is bounded by, before receiving anything."""
    from kvbridge import decode_batch

    blocks = sum(b for _, b in payloads)
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for payload, _ in payloads:
            decode_batch(payload)
        best = min(best, time.perf_counter() - t0)
    return blocks / best


def run_once(url: str, seconds: float, workloads: dict) -> list[dict]:
    rows = []
    for name, (steps, payloads) in workloads.items():
        rows.append(run_raw(url, name, payloads, seconds))
        rows.append(run_bridge(url, f"{name}-max", name, steps, None, seconds))
        if name == "vllm-steps":
            rows.append(run_bridge(url, f"{name}-dec", name, steps, None, seconds, "bridge-decode"))
        for rate in (100_000, 1_000_000):
            paced = steps if name != "1-block" else one_block_steps(_ONE_BLOCK, rate // 1000)
            rows.append(run_bridge(url, f"{name}-{rate}", name, paced, rate, seconds))
    return rows


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Per row, the median run (its latencies and call times as measured): by events/s at full
    speed, by p99 latency in paced rows (where events/s is the offered rate)."""
    out = []
    for group in zip(*runs):
        paced = group[0]["rate"] is not None
        ranked = sorted(group, key=(lambda r: pct(r["lat"], 99)) if paced else (lambda r: r["events_s"]))
        med = dict(ranked[len(ranked) // 2])
        med["all_events_s"] = [r["events_s"] for r in group]
        med["all_p99"] = [pct(r["lat"], 99) for r in group]
        out.append(med)
    return out


def table(rows: list[dict]) -> str:
    out = [
        "| workload | path | block events/s received (runs) | vs anchor | sent / received | msgs | resyncs / dropped "
        "| p50 latency | p99 latency (runs) | publish() mean / p99 / max | no-op call mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    anchors = {r["workload"]: r["events_s"] for r in rows if r["path"].startswith("anchor")}
    for r in rows:
        runs = ", ".join(f"{v / 1e6:.2f}" for v in r.get("all_events_s", [r["events_s"]]))
        p99s = ", ".join(f"{v * 1e3:.2f}" for v in r.get("all_p99", [pct(r["lat"], 99)]))
        call = (
            f"{r['call_mean_us']:.2f} / {r['call_p99_us']:.1f} / {r['call_max_us']:.0f} µs" if "call_mean_us" in r else "—"
        )
        ratio = "1.00x" if r["path"].startswith("anchor") else (
            f"{r['events_s'] / anchors[r['workload']]:.2f}x" if r["rate"] is None else "paced")  # fmt: skip
        out.append(
            f"| {r['workload']} | {r['path']} | **{r['events_s'] / 1e6:.2f} M** ({runs}) | {ratio} | "
            f"{r['sent']} / {r['received']} | {r['messages']} | {r.get('resyncs', '—')} / {r.get('dropped', '—')} | "
            f"{pct(r['lat'], 50) * 1e3:.2f} ms | **{pct(r['lat'], 99) * 1e3:.2f} ms** ({p99s}) | {call} | "
            f"{'—' if r.get('floor_us') is None else format(r['floor_us'], '.2f') + ' µs'} |"
        )
    return "\n".join(out)


def write_results(text: str) -> None:
    path = Path(__file__).with_name("RESULTS.md")
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    head = "## Bridge"
    if head in old:
        before, rest = old.split(head, 1)
        nxt = rest.find("\n## ")
        after = rest[nxt:] if nxt >= 0 else "\n"
        new = before + text.rstrip() + "\n" + after
    else:
        new = old.rstrip() + "\n\n" + text.rstrip() + "\n"
    path.write_text(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workload", choices=("all", "vllm-steps", "1-block"), default="all")
    ap.add_argument("--write", action="store_true",
                    help="replace the Bridge section of bench/RESULTS.md (not its hand-written 'reading the figures')")
    args = ap.parse_args()
    cfg = Config()
    workloads = {}
    if args.workload in ("all", "vllm-steps"):
        steps = vllm_steps(3000)
        workloads["vllm-steps"] = (steps, bridge_payloads(steps, cfg.max_batch_bytes, cfg.max_batch_events))
    if args.workload in ("all", "1-block"):
        steps = one_block_steps(_ONE_BLOCK, 1000)
        workloads["1-block"] = (steps, bridge_payloads(steps, cfg.max_batch_bytes, cfg.max_batch_events))
    for name, (steps, payloads) in workloads.items():
        n_ev = sum(len(e) for e, _ in steps)
        n_bl = sum(b for _, b in steps)
        print(f"{name}: {len(steps)} steps, {n_ev / len(steps):.1f} events and {n_bl / len(steps):.1f} block events "
              f"per step, {n_bl / n_ev:.2f} blocks per event; anchor messages of {statistics.fmean(len(p) for p, _ in payloads) / 1024:.0f} KiB",
              file=sys.stderr)  # fmt: skip
    load = os.getloadavg()
    runs = []
    with NatsServer() as server:
        for k in range(args.runs):
            print(f"run {k + 1}/{args.runs} ...", file=sys.stderr)
            runs.append(run_once(server.url, args.seconds, workloads))
    rows = median_rows(runs)
    ceiling = decode_ceiling(workloads["vllm-steps"][1]) if "vllm-steps" in workloads else None
    cmd = "python bench/bridge.py" + "".join(
        f" --{k} {v:g}" if isinstance(v, float) else f" --{k} {v}" for k, v in (("seconds", args.seconds), ("runs", args.runs))
    ) + (f" --workload {args.workload}" if args.workload != "all" else "")
    text = (
        "## Bridge\n\n"
        f"`{cmd}` — {platform.machine()}, {os.cpu_count()} cores shared by engine + publisher loop "
        f"(one process), subscriber (another), nats-server, and other users (load average "
        f"{load[0]:.1f} at start). Median of {args.runs} runs (by events/s at full speed, by p99 when paced; "
        "all runs in brackets). "
        "Default Config (linger_ms 0, max_batch_events 1024, max_batch_bytes 512 KiB).\n\n"
        + table(rows)
        + "\n"
        + (
            ""
            if ceiling is None
            else f"\nCeiling of a subscriber that decodes every batch: `decode_batch` alone on the anchor's vllm-steps "
            f"payloads, in one process without NATS, **{ceiling / 1e6:.2f} M** block events/s (one core, best of 3).\n"
        )
    )
    print(text)
    if args.write:
        write_results(text)


if __name__ == "__main__":
    main()
