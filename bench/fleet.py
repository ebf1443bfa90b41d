"""A fleet of simulated workers on one nats-server and on a 3-node cluster.

    python bench/fleet.py [--processes 4] [--per-process 64] [--rate 5] [--linger-ms 5] [--seconds 25]
                          [--configs single,cluster]

256 workers (4 processes x 64 KvEventPublishers, each in front of its own KVCacheManager whose
engine steps ``--rate`` times a second: chats over shared system prompts, decode, frees and
evictions) publish to one router process: a KvEventSubscriber -- feeding a ``kvbridge.Index``
when the package has one -- plus, with the index, a thread asking ``find_matches`` for real
prompts 200 times a second while everything ingests. Every client gets every URL of its
configuration. Per configuration, after a warm-up, over ``--seconds``:

- block events/s offered by the engines, published, and delivered to the router;
- the router's lag: delivery time minus the batch's timestamp (p50 / p99 / max);
- CPU as a share of one core: each worker process, the router process, each nats-server;
- memory: worker-process RSS per simulated worker; the index's bytes per worker and per
  (block, worker) entry (``memory_bytes``), or "n/a (index not built)";
- find_matches p50 / p99 under that ingest (index only).

Publishers run with ``linger_ms=5`` here: the default (0) polls its hand-off queue on a 250 us
timer for 50 ms after each message, which is right for one engine per process but multiplies
with 64 publishers in one process (measured: 8 publishers at 10 messages/s each cost 29% of a
core at the default, 5% at linger_ms=5). ``--linger-ms 0`` measures the default.

A 3-node cluster on one machine measures the cost of routes (every message crosses one more hop
to reach the router when its publisher sits on another node), not scaling: all the processes
share the same two cores, and one router still receives every message through one connection.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import resource
import sys
import threading
import time
from pathlib import Path

import kvbridge
from kvbridge import Config, KvEventPublisher, KvEventSubscriber
from kvbridge.engine.pool import KVCacheManager
from kvbridge.tools.server import NatsCluster, NatsServer

MODEL = "fleet"
BLOCK_SIZE = 16
VOCAB = 151_936
N_SYSTEM_PROMPTS = 8
TICK = os.sysconf("SC_CLK_TCK")
NA_INDEX = "n/a (index not built)"


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mb(pid: int | None = None) -> float:
    for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def system_prompts(seed: int = 7) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(VOCAB) for _ in range(BLOCK_SIZE * rnd.randrange(8, 48))] for _ in range(N_SYSTEM_PROMPTS)]


class SimEngine:
    """One worker's engine: each step admits a chat turn (a shared system prompt and its own
    history), decodes a few tokens for the running ones, and finishes the oldest beyond 4."""

    def __init__(self, pub: KvEventPublisher, seed: int, num_blocks: int, prompts: list[list[int]]) -> None:
        self.pub = pub
        self.manager = KVCacheManager(num_blocks, BLOCK_SIZE)
        pub.attach(self.manager)
        self.rnd = random.Random(seed)
        self.prompts = prompts
        self.running: list[str] = []
        self.next_id = 0
        self.offered = 0  # events handed to the publisher

    def step(self) -> None:
        m, rnd = self.manager, self.rnd
        with self.pub.lock:
            rid = f"r{self.next_id}"
            self.next_id += 1
            prompt = rnd.choice(self.prompts) + [rnd.randrange(VOCAB) for _ in range(rnd.randrange(16, 256))]
            if m.allocate(rid, prompt) is not None:
                self.running.append(rid)
            for r in self.running:
                m.append(r, [rnd.randrange(VOCAB) for _ in range(16)])
            while len(self.running) > 4:
                m.free(self.running.pop(0))
        self.offered += self.pub.step()


# -- a worker process ------------------------------------------------------------------------------------


def worker_process(urls: list[str], index: int, n: int, rate: float, num_blocks: int, linger_ms: float, warmup: float,
                   seconds: float, ready, go, results) -> None:  # fmt: skip
    asyncio.run(_worker_main(urls, index, n, rate, num_blocks, linger_ms, warmup, seconds, ready, go, results))


async def _worker_main(urls, index, n, rate, num_blocks, linger_ms, warmup, seconds, ready, go, results) -> None:
    base = Config(servers=urls, model=MODEL, subject_prefix="fleet", reconnect_wait_s=0.2, connect_timeout_s=5.0,
                  linger_ms=linger_ms)  # fmt: skip
    prompts = system_prompts()
    pubs = [await KvEventPublisher(base.replace(worker_id=f"p{index}-w{i}")).start() for i in range(n)]
    engines = [SimEngine(p, seed=index * 1000 + i, num_blocks=num_blocks, prompts=prompts) for i, p in enumerate(pubs)]
    ready.put(index)
    await asyncio.to_thread(go.wait)
    period = 1.0 / rate
    t0 = time.monotonic()
    marks: dict[str, tuple[float, float, int, int]] = {}
    late_ticks = ticks = 0
    tick_at = t0
    while True:
        now = time.monotonic()
        if "start" not in marks and now - t0 >= warmup:
            marks["start"] = (now, proc_cpu_s(os.getpid()), sum(p.stats["events"] for p in pubs), _offered(engines))
        if now - t0 >= warmup + seconds:
            marks["end"] = (now, proc_cpu_s(os.getpid()), sum(p.stats["events"] for p in pubs), _offered(engines))
            break
        # Each engine's step, then the loop runs: its publisher sends before the next engine steps
        # (64 engines sharing one thread would otherwise add their whole burst to every lag).
        for e in engines:
            e.step()
            await asyncio.sleep(0)
        ticks += 1
        tick_at += period
        delay = tick_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            late_ticks += 1
            tick_at = time.monotonic()  # behind: do not try to catch up in a burst
            await asyncio.sleep(0)
    (ts, cs, es, os_), (te, ce, ee, oe) = marks["start"], marks["end"]
    stats = [p.stats for p in pubs]
    results.put({
        "index": index, "wall": te - ts, "cpu": (ce - cs) / (te - ts), "events": ee - es, "offered": oe - os_,
        "rss_mb": rss_mb(), "late_ticks": late_ticks, "ticks": ticks,
        "dropped": sum(s["dropped_events"] for s in stats), "publish_errors": sum(s["publish_errors"] for s in stats),
        "reconnects": sum(s["reconnects"] for s in stats),
        "cached_blocks": sum(e.manager.pool.num_cached_blocks for e in engines),
    })  # fmt: skip
    for p in pubs:
        await p.close()


def _offered(engines: list[SimEngine]) -> int:
    return sum(e.offered for e in engines)


# -- the router ----------------------------------------------------------------------------------------


class Router:
    """A KvEventSubscriber for the model (with a kvbridge.Index when there is one), recording
    delivery lag, and a query thread timing find_matches while everything ingests."""

    def __init__(self, urls: list[str]) -> None:
        self.has_index = hasattr(kvbridge, "Index")
        self.index = kvbridge.Index(BLOCK_SIZE) if self.has_index else None
        cfg = Config(servers=urls, model=MODEL, subject_prefix="fleet", reconnect_wait_s=0.2, request_timeout_s=5.0,
                     connect_timeout_s=5.0)  # fmt: skip
        kw = {"index": self.index, "track_views": False} if self.has_index else {}
        self.sub = KvEventSubscriber(cfg, model=MODEL, on_update=self._on_update, **kw)
        self.events = 0
        self.lags: list[float] = []
        self.recording = False
        self.query_lat: list[float] = []
        self._stop = threading.Event()
        self._querier: threading.Thread | None = None

    def _on_update(self, u) -> None:
        self.events += u.n_events
        if self.recording and not u.reset:
            self.lags.append(time.time() - u.ts)

    def start_queries(self, per_s: float = 200.0) -> None:
        if not self.has_index:
            return
        prompts = system_prompts()
        rnd = random.Random(3)

        def run() -> None:
            while not self._stop.is_set():
                tokens = rnd.choice(prompts) + [rnd.randrange(VOCAB) for _ in range(64)]
                t = time.perf_counter()
                self.index.find_matches(tokens)
                if self.recording:
                    self.query_lat.append(time.perf_counter() - t)
                self._stop.wait(1.0 / per_s)

        self._querier = threading.Thread(target=run, name="kvbridge-bench-queries", daemon=True)
        self._querier.start()

    def stop_queries(self) -> None:
        self._stop.set()
        if self._querier is not None:
            self._querier.join(10)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))]


async def run_config(name: str, urls: list[str], server_pids: list[int], args) -> dict:
    n_workers = args.processes * args.per_process
    router = Router(urls)
    await router.sub.start()
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=worker_process, name=f"kvbridge-fleet-{i}",
                         args=(urls, i, args.per_process, args.rate, args.num_blocks, args.linger_ms, args.warmup,
                               args.seconds, ready, go, results)) for i in range(args.processes)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        for _ in procs:
            await asyncio.to_thread(ready.get, True, 120)
        rss_router0 = rss_mb()
        router.start_queries()
        go.set()
        await asyncio.sleep(args.warmup)
        t0, ev0, cpu0 = time.monotonic(), router.events, proc_cpu_s(os.getpid())
        srv0 = [proc_cpu_s(pid) for pid in server_pids]
        router.recording = True
        await asyncio.sleep(args.seconds)
        router.recording = False
        t1, ev1, cpu1 = time.monotonic(), router.events, proc_cpu_s(os.getpid())
        srv1 = [proc_cpu_s(pid) for pid in server_pids]
        outs = [await asyncio.to_thread(results.get, True, 120) for _ in procs]
    finally:
        router.stop_queries()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()
    wall = t1 - t0
    outs.sort(key=lambda o: o["index"])
    row = {
        "config": name, "workers": n_workers,
        "offered": sum(o["offered"] / o["wall"] for o in outs),
        "published": sum(o["events"] / o["wall"] for o in outs),
        "delivered": (ev1 - ev0) / wall,
        "lag_p50": pct(router.lags, 0.5) * 1e3, "lag_p99": pct(router.lags, 0.99) * 1e3,
        "lag_max": max(router.lags, default=float("nan")) * 1e3,
        "cpu_workers": [o["cpu"] for o in outs], "cpu_router": (cpu1 - cpu0) / wall,
        "cpu_servers": [(b - a) / wall for a, b in zip(srv0, srv1)],
        "rss_per_worker_kb": sum(o["rss_mb"] for o in outs) * 1024 / n_workers,
        "late_ticks": sum(o["late_ticks"] for o in outs), "ticks": sum(o["ticks"] for o in outs),
        "dropped": sum(o["dropped"] for o in outs), "reconnects": sum(o["reconnects"] for o in outs),
        "router_rss_delta_mb": rss_mb() - rss_router0, "sub": router.sub.stats,
    }  # fmt: skip
    if router.has_index:
        idx = router.index
        # (block, worker) entries: every worker's cached blocks (the index agrees once it caught up).
        entries = sum(o["cached_blocks"] for o in outs)
        row["index_distinct_blocks"] = idx.stats.get("blocks", 0)
        row["index_bytes_per_worker"] = idx.memory_bytes / n_workers
        row["index_bytes_per_entry"] = idx.memory_bytes / entries if entries else float("nan")
        row["index_entries"] = entries
        row["query_p50_us"] = pct(router.query_lat, 0.5) * 1e6
        row["query_p99_us"] = pct(router.query_lat, 0.99) * 1e6
        row["queries"] = len(router.query_lat)
    await router.sub.close()
    return row


def show(rows: list[dict], args) -> None:
    n = rows[0]["workers"]
    print(f"\n{n} workers ({args.processes} processes x {args.per_process}), engine steps {args.rate:g}/s per worker, "
          f"linger_ms {args.linger_ms:g}, "
          f"{args.num_blocks} blocks x {BLOCK_SIZE} tokens per worker, {args.seconds:g} s measured after "
          f"{args.warmup:g} s warm-up; {os.cpu_count()} cores\n")  # fmt: skip
    cols = ["", *[r["config"] for r in rows]]
    lines = [
        ("block events/s offered by the engines", lambda r: f"{r['offered']:,.0f}"),
        ("block events/s published", lambda r: f"{r['published']:,.0f}"),
        ("block events/s delivered to the router", lambda r: f"{r['delivered']:,.0f}"),
        ("engine ticks late (of all ticks)", lambda r: f"{r['late_ticks']:,} of {r['ticks']:,}"),
        ("router lag p50 / p99 / max (ms)", lambda r: f"{r['lag_p50']:.1f} / {r['lag_p99']:.1f} / {r['lag_max']:.0f}"),
        ("CPU, each worker process (% of a core)", lambda r: " ".join(f"{c * 100:.0f}" for c in r["cpu_workers"])),
        ("CPU, router process (% of a core)", lambda r: f"{r['cpu_router'] * 100:.0f}"),
        ("CPU, each nats-server (% of a core)", lambda r: " ".join(f"{c * 100:.0f}" for c in r["cpu_servers"])),
        ("worker-process RSS per worker (KiB)", lambda r: f"{r['rss_per_worker_kb']:,.0f}"),
        ("index bytes per worker", lambda r: f"{r['index_bytes_per_worker']:,.0f}" if "index_entries" in r else NA_INDEX),
        ("index bytes per (block, worker) entry",
         lambda r: f"{r['index_bytes_per_entry']:.1f} ({r['index_entries']:,} entries, {r['index_distinct_blocks']:,} "
         "distinct blocks)" if "index_entries" in r else NA_INDEX),
        ("find_matches p50 / p99 under ingest (us)",
         lambda r: f"{r['query_p50_us']:.1f} / {r['query_p99_us']:.1f} ({r['queries']:,} queries)"
         if "index_entries" in r else NA_INDEX),
        ("publisher drops / reconnects", lambda r: f"{r['dropped']} / {r['reconnects']}"),
        ("router gaps / replays / snapshots",
         lambda r: f"{r['sub']['gaps']} / {r['sub']['replays']} / {r['sub']['snapshots']}"),
    ]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|---" + "|---:" * len(rows) + "|")
    for label, fmt in lines:
        print(f"| {label} | " + " | ".join(fmt(r) for r in rows) + " |")
    # Engines that fall behind their pace (late ticks) offer less: compare what reached the router
    # with what was offered in the same configuration, not configurations with each other.
    print("\ndelivered to the router / offered: " + ", ".join(
        f"{r['config']} {r['delivered'] / r['offered']:.3f}" for r in rows if r["offered"]))  # fmt: skip


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--per-process", type=int, default=64)
    ap.add_argument("--rate", type=float, default=5.0, help="engine steps per second per worker (default 5)")
    ap.add_argument("--linger-ms", type=float, default=5.0,
                    help="publisher linger_ms (default 5; 0 is the library default, see the module doc)")
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per worker (default 1024)")
    ap.add_argument("--seconds", type=float, default=25.0, help="measured seconds per configuration (default 25)")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--configs", default="single,cluster", help="single, cluster or both (default)")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}; index: {'kvbridge.Index' if hasattr(kvbridge, 'Index') else NA_INDEX}",
          flush=True)  # fmt: skip
    rows = []
    for name in args.configs.split(","):
        if name == "single":
            with NatsServer() as server:
                rows.append(await run_config("1 server", [server.url], [server.proc.pid], args))
        elif name == "cluster":
            with NatsCluster(3, name="kvbridge-fleet") as cluster:
                pids = [node.proc.pid for node in cluster.nodes]
                rows.append(await run_config("3-node cluster", cluster.urls, pids, args))
        else:
            print(f"--configs: unknown configuration {name!r} (expected single, cluster)", file=sys.stderr)
            return 2
        print(f"{rows[-1]['config']}: done", flush=True)
    show(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
