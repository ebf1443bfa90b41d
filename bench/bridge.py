"""Engine -> NATS -> subscriber, through a real local nats-server.

    python bench/bridge.py [--seconds 5] [--write]

The engine (this process) hands batches of block events to a BackgroundPublisher; a subscriber in
another process (a KvEventSubscriber keeping a per-worker view, as a router would) records
receive time minus the batch's engine timestamp. Events are vLLM-shaped, one block per event
(16 tokens), 80% BlockStored / 20% BlockRemoved -- the decode-phase case, where a request
completes at most one block per step. Beside it: raw nats-py publishing the same payload bytes
(with and without the same headers) to a raw nats-py subscriber, as the anchor.

``--write`` replaces the "Bridge" section of bench/RESULTS.md with the table.
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
from pathlib import Path

from kvbridge import BackgroundPublisher, BlockRemoved, BlockStored, Config, KVEventBatch, encode_batch
from kvbridge.server import NatsServer

BLOCK_SIZE = 16


def make_events(n: int) -> list:
    out = []
    for i in range(n):
        if i % 5 == 4:
            out.append(BlockRemoved([i - 2], "GPU"))
        else:
            out.append(BlockStored([i], i - 1 if i else None, list(range(i, i + BLOCK_SIZE)), BLOCK_SIZE, None, "GPU", None))
    return out


# -- subscriber process ----------------------------------------------------------------------------


def _subscriber_main(url: str, mode: str, subject: str, conn) -> None:
    asyncio.run(_subscriber(url, mode, subject, conn))


async def _subscriber(url: str, mode: str, subject: str, conn) -> None:
    lat: list[float] = []
    received = [0, 0.0, 0.0]  # events, first receive, last receive

    def record(ts: float, n: int) -> None:
        now = time.time()
        if not received[0]:
            received[1] = now
        received[0] += n
        received[2] = now
        lat.append(now - ts)

    if mode == "bridge":
        from kvbridge import KvEventSubscriber

        def on_update(u):
            if u.batch.events and not u.reset:
                record(u.batch.ts, len(u.batch.events))

        sub = await KvEventSubscriber(Config(servers=url), subject=subject, on_update=on_update).start()
        closer = sub.close
        stats = lambda: sub.stats  # noqa: E731
    else:
        import msgspec
        import nats

        nc = await nats.connect(url)
        decoder = msgspec.msgpack.Decoder()

        async def on_msg(m):
            # Only the timestamp: the anchor measures transport, not decoding.
            ts = float(m.headers["Ts"]) if m.headers and "Ts" in m.headers else time.time()
            record(ts, int(m.headers["N"]) if m.headers else 1)

        await nc.subscribe(subject, cb=on_msg, pending_msgs_limit=1 << 20, pending_bytes_limit=1 << 30)
        await nc.flush()
        closer = nc.close
        stats = dict
        del decoder
    conn.send("ready")
    expected = await asyncio.to_thread(conn.recv)
    deadline = time.monotonic() + 30
    while received[0] < expected and time.monotonic() < deadline:
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
        assert self.conn.poll(60)
        out = self.conn.recv()
        self.proc.join(10)
        return out


# -- engine side -------------------------------------------------------------------------------------


def run_bridge(url: str, worker: str, rate: int | None, seconds: float, events: list) -> dict:
    sub = SubscriberProcess(url, "bridge", f"kv.events.bench.{worker}")
    # A bigger batch lets the loop amortise per-message cost at full speed.
    pub = BackgroundPublisher(Config(servers=url, model="bench", worker_id=worker, max_batch_events=2048)).start()
    per_call = 1000 if rate is None else max(1, rate // 1000)
    tick = None if rate is None else per_call / rate
    calls: list[float] = []
    sent = 0
    n = len(events)
    start = time.perf_counter()
    next_t = start
    i = 0
    publisher = pub.publisher
    while time.perf_counter() - start < seconds:
        batch = events[i : i + per_call] if i + per_call <= n else events[:per_call]
        i = (i + per_call) % (n - per_call)
        t0 = time.perf_counter()
        pub.publish(KVEventBatch(time.time(), batch))
        calls.append(time.perf_counter() - t0)
        sent += len(batch)
        if tick is None:
            # Full speed, but not faster than the loop drains: the hand-off would drop the oldest.
            while publisher.stats["queue_depth"] > 32:
                time.sleep(0.0002)
        else:
            next_t += tick
            delay = next_t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
    engine_s = time.perf_counter() - start
    pub.close()
    received, first, last, lat, sub_stats = sub.result(sent)
    if received < sent:
        print(f"  {worker}: subscriber {sub_stats}, publisher {publisher.stats}", file=sys.stderr)
    stats = publisher.stats
    return {
        "path": "kvbridge" if rate is None else f"kvbridge @ {rate / 1000:.0f}k ev/s offered",
        "sent": sent,
        "received": received,
        "events_s": received / max(last - first, engine_s) if rate is None else received / engine_s,
        "lat": lat,
        "call_mean_us": statistics.fmean(calls) * 1e6,
        "call_max_us": max(calls) * 1e6,
        "dropped": stats["dropped_events"],
        "messages": stats["messages"],
    }


async def _raw_publish(url: str, payload: bytes, n_events: int, seconds: float, headers: bool) -> tuple[int, int]:
    import nats

    nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
    msgs = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(64):
            hdrs = {"Ts": repr(time.time()), "N": str(n_events)}
            if headers:
                hdrs.update({"Kv-Seq": str(msgs), "Kv-Epoch": "0123456789abcdef", "Nats-Msg-Id": f"w:0123456789abcdef:{msgs}",
                             "Content-Type": "application/msgpack"})  # fmt: skip
            await nc.publish("raw.events", payload, headers=hdrs)
            msgs += 1
        await asyncio.sleep(0)
    await nc.flush()
    await nc.close()
    return msgs, msgs * n_events


def run_raw(url: str, events: list, per_msg: int, seconds: float, headers: bool) -> dict:
    payload = encode_batch(KVEventBatch(time.time(), events[:per_msg]))
    sub = SubscriberProcess(url, "raw", "raw.events")
    start = time.perf_counter()
    msgs, sent = asyncio.run(_raw_publish(url, payload, per_msg, seconds, headers))
    engine_s = time.perf_counter() - start
    received, first, last, lat, _ = sub.result(sent)
    return {
        "path": f"raw nats-py, same bytes{' + same headers' if headers else ''}",
        "sent": sent,
        "received": received,
        "events_s": received / max(last - first, engine_s),
        "lat": lat,
        "messages": msgs,
    }


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


def table(rows: list[dict]) -> str:
    out = [
        "| path | events/s received | sent / received | msgs | p50 latency | p99 latency | publish() mean / max |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        call = f"{r['call_mean_us']:.2f} / {r['call_max_us']:.0f} µs" if "call_mean_us" in r else "—"
        out.append(
            f"| {r['path']} | {r['events_s'] / 1e6:.2f} M | {r['sent']} / {r['received']} | {r['messages']} | "
            f"{pct(r['lat'], 50) * 1e3:.2f} ms | {pct(r['lat'], 99) * 1e3:.2f} ms | {call} |"
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
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--write", action="store_true", help="update the Bridge section of bench/RESULTS.md")
    args = ap.parse_args()
    events = make_events(100_000)
    rows = []
    with NatsServer() as server:
        rows.append(run_bridge(server.url, "max", None, args.seconds, events))
        for rate in (100_000, 500_000, 1_000_000):
            rows.append(run_bridge(server.url, f"r{rate}", rate, args.seconds, events))
        rows.append(run_raw(server.url, events, 1000, args.seconds, headers=False))
        rows.append(run_raw(server.url, events, 1000, args.seconds, headers=True))
    text = (
        "## Bridge\n\n"
        f"`python bench/bridge.py --seconds {args.seconds:g}` — {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {sys.version.split()[0]}, engine + publisher in one process, subscriber in another, "
        "local nats-server. Events: one 16-token block each, 80% BlockStored / 20% BlockRemoved. "
        "Latency: subscriber receive time minus the engine's hand-off time (one sample per NATS message). "
        "Full-speed rows: 1000 events per publish() call; fixed-rate rows: one publish() per ms.\n\n"
        + table(rows)
        + "\n\nTargets: ≥ 1M block events/s sustained; p99 ≤ 2 ms at 100k events/s; publish() ≤ 2 µs.\n"
    )
    print(text)
    if args.write:
        write_results(text)


if __name__ == "__main__":
    main()
