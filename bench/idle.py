"""CPU of idle publishers: N KvEventPublishers in one process, default options, no traffic.

    python bench/idle.py [--publishers 200] [--seconds 10]

Each publisher sends its heartbeat (an empty batch every heartbeat_s) and its connection's
keepalive PING (every ping_interval_s, answered by a PONG) and otherwise sleeps. The
process's CPU time (user + system) over the measured window, as a share of one core, is printed
beside the anchor measured in the same run: the same number of raw nats-py connections that
publish the same heartbeat message (same subject, headers, payload) from one asyncio timer task
per connection (nats-py's default keepalive: a PING every 120 s) -- the least any heartbeating
client can cost. Goal: under 5% of a core for 200.
The measurement starts after the publishers have had traffic and gone idle again (the case that
used to keep the send loop polling).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time

import nats

from kvbridge import BlockStored, Config, KvEventPublisher, encode_batch
from kvbridge.wire.events import KVEventBatch
from kvbridge.tools.server import NatsServer


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def measure(seconds: float) -> float:
    t0, c0 = time.monotonic(), cpu_s()
    await asyncio.sleep(seconds)
    return (cpu_s() - c0) / (time.monotonic() - t0)


async def kvbridge_idle(url: str, n: int, seconds: float) -> float:
    base = Config(servers=url, subject_prefix="idlebench", model="m")
    pubs = await asyncio.gather(*(KvEventPublisher(base.replace(worker_id=f"w{i}")).start() for i in range(n)))
    for p in pubs:  # traffic first, then idle
        for j in range(20):
            p.publish([BlockStored([j], None, list(range(16)), 16, None, "GPU", None)])
    await asyncio.sleep(1.0)
    share = await measure(seconds)
    beats = sum(p.stats["heartbeats"] for p in pubs)
    await asyncio.gather(*(p.close() for p in pubs))
    print(f"  kvbridge: {beats} heartbeats sent in all")
    return share


async def raw_idle(url: str, n: int, seconds: float, heartbeat_s: float) -> float:
    payload = encode_batch(KVEventBatch(time.time(), []))
    conns = await asyncio.gather(*(nats.connect(url) for _ in range(n)))

    async def beat(nc, i: int) -> None:
        seq = 0
        while True:
            hdr = {"Kv-Seq": str(seq), "Kv-Epoch": "e", "Nats-Msg-Id": f"w{i}:e:{seq}",
                   "Content-Type": "application/msgpack", "Kv-Heartbeat": "1"}  # fmt: skip
            await nc.publish(f"idleraw.events.m.w{i}", payload, headers=hdr)
            seq += 1
            await asyncio.sleep(heartbeat_s)

    tasks = [asyncio.create_task(beat(nc, i)) for i, nc in enumerate(conns)]
    await asyncio.sleep(1.0)
    share = await measure(seconds)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(nc.close() for nc in conns))
    return share


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--publishers", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    with NatsServer() as server:
        raw = await raw_idle(server.url, args.publishers, args.seconds, Config().heartbeat_s)
        ours = await kvbridge_idle(server.url, args.publishers, args.seconds)
    d = Config()
    print(f"\n{args.publishers} idle publishers in one process, {args.seconds:g} s, default options "
          f"(heartbeat_s {d.heartbeat_s:g}, ping_interval_s {d.ping_interval_s:g})")
    print(f"| {'':28} | CPU, share of one core |")
    print(f"|{'-' * 30}|{'-' * 24}|")
    print(f"| {'raw nats-py heartbeat loop':28} | {raw * 100:21.2f}% |")
    print(f"| {'kvbridge KvEventPublisher':28} | {ours * 100:21.2f}% |")
    print(f"| {'ratio (kvbridge / raw)':28} | {ours / raw if raw else float('nan'):21.2f}x |")
    print(f"goal: under 5% of a core -> {'met' if ours < 0.05 else 'NOT met'}")


if __name__ == "__main__":
    asyncio.run(main())
