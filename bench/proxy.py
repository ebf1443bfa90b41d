"""What ``kvbridge proxy`` adds to a request, beside a plain reverse proxy on the same HTTP stack.

    python bench/proxy.py [--requests 4000] [--concurrency 16] [--seconds 6] [--rounds 20] [--write]

One stand-in engine (kvbridge.tools.standin, no NATS, no prefill or decode wait: it answers at
once) in its own process; in front of it, each in its own process:

* ``direct``: nothing, the client talks to the engine;
* ``plain proxy``: a minimal aiohttp reverse proxy (server + pooled ClientSession, body forwarded,
  a whole answer sent back whole and a stream chunk by chunk, as kvbridge proxy does) -- the floor
  for any proxy written with aiohttp;
* ``kvbridge proxy``: :class:`kvbridge.routing.proxy.KvProxy` with a nats-server, an in-process
  index and the engine as ``--worker``. "cached prompt": the same prompt every time, its token
  ids from the proxy's LRU; "new prompt": a different prompt each request, so one ``/tokenize``
  round trip to the engine first.

The client (this process, aiohttp) sends non-streaming ``/v1/completions`` one at a time for
latency (p50, p99), then ``--concurrency`` at a time for requests/s (the best of the rounds);
the paths take turns over ``--rounds`` rounds. Added latency = the path's percentile minus
direct's. All on loopback, so it is CPU, not network.

``--write`` replaces the "Proxy" section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-model"
PROMPT = "You are a helpful assistant. Answer briefly and precisely. " * 4


# --- the servers, each run as `python bench/proxy.py --serve ROLE ...` ------------------------------


async def _serve_plain(upstream: str) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with session.post(upstream + request.path, data=body,
                                headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
            ctype = resp.headers["Content-Type"]
            if not ctype.startswith("text/event-stream"):  # as kvbridge proxy: a whole answer is sent whole
                return web.Response(status=resp.status, body=await resp.read(), headers={"Content-Type": ctype})
            out = web.StreamResponse(status=resp.status, headers={"Content-Type": ctype})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_post("/v1/completions", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    await _until_stopped(f"http://127.0.0.1:{port}")
    await runner.cleanup()
    await session.close()


async def _serve(role: str, arg: str) -> None:
    if role == "plain":
        return await _serve_plain(arg)
    if role == "engine":
        from kvbridge.tools.standin import StandinEngine

        async with StandinEngine(model=MODEL, worker_id="engine") as engine:
            await _until_stopped(engine.url)
        return
    from kvbridge.config import Config
    from kvbridge.routing.proxy import KvProxy

    nats, upstream = arg.split(" ")
    async with KvProxy(Config(servers=[nats]), model=MODEL, port=0, workers={"engine": upstream}) as proxy:
        await _until_stopped(proxy.url)


async def _until_stopped(url: str) -> None:
    print(url, flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


def _spawn(role: str, arg: str = "") -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", role, arg], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http://"):
        proc.kill()
        raise RuntimeError(f"the {role} server did not start")
    return proc, url


# --- the client ------------------------------------------------------------------------------------


_ids = itertools.count()  # a new prompt is new across rounds too


async def _latency(session: aiohttp.ClientSession, url: str, n: int, new_prompts: bool) -> list[float]:
    ids = _ids
    samples = []
    for i in range(n + n // 10):  # the first tenth warms connections and caches up
        prompt = f"{PROMPT}{next(ids)}" if new_prompts else PROMPT
        start = time.perf_counter()
        async with session.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as r:
            await r.read()
            assert r.status == 200, r.status
        if i >= n // 10:
            samples.append(time.perf_counter() - start)
    return sorted(samples)


async def _throughput(session: aiohttp.ClientSession, url: str, concurrency: int, seconds: float, new_prompts: bool) -> float:
    ids = _ids
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            prompt = f"{PROMPT}{next(ids)}-t" if new_prompts else PROMPT
            async with session.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as r:
                await r.read()
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


def _pct(samples: list[float], q: float) -> float:
    return samples[min(len(samples) - 1, int(q * len(samples)))] * 1e6


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(args: argparse.Namespace, paths: list[tuple[str, str, bool, list[int]]]) -> list[dict[str, Any]]:
    # The paths take turns, round after round, so that a busy spell on a shared machine lands on
    # all of them rather than on one. CPU per request (of the servers on the path) is the figure a
    # busy machine disturbs least: waiting for a core costs latency, not CPU.
    lat: dict[str, list[float]] = {p[0]: [] for p in paths}
    rps: dict[str, list[float]] = {p[0]: [] for p in paths}
    cpu = dict.fromkeys(lat, 0.0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(args.rounds):
            for name, url, new_prompts, pids in paths:
                before = sum(map(_cpu_s, pids))
                lat[name] += await _latency(session, url, args.requests // args.rounds, new_prompts)
                cpu[name] += sum(map(_cpu_s, pids)) - before
                rps[name].append(await _throughput(session, url, args.concurrency, args.seconds / args.rounds, new_prompts))
    rows = []
    for name, samples in lat.items():
        samples.sort()
        per_request = cpu[name] / (len(samples) * 1.1) * 1e6  # the warm-up tenth ran too
        rows.append({"path": name, "p50": _pct(samples, 0.5), "p99": _pct(samples, 0.99), "rps": max(rps[name]),
                     "cpu": per_request})  # fmt: skip
    return rows


async def _own_work(n: int) -> float:
    """CPU microseconds per request of what kvbridge proxy does beyond forwarding, without HTTP:
    the body check, the prompt's tokens from the LRU, the index lookup, the choice (the time
    cost, with provisional residency), its first token and end, the header copy and the metrics."""
    from kvbridge import Index
    from kvbridge.routing.proxy import KvProxy, _copy_headers

    proxy = KvProxy(None, model=MODEL, port=0, workers={f"w{i}": f"http://127.0.0.1:{9000 + i}" for i in range(3)})
    index = Index(16)
    raw = msgspec.json.encode({"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    proxy.tokens.put(PROMPT, list(PROMPT.encode()))
    headers = {"Host": "127.0.0.1:8000", "Content-Type": "application/json", "Accept": "application/json",
               "User-Agent": "AsyncOpenAI/Python 1.0", "Authorization": "Bearer x", "Content-Length": str(len(raw))}
    start = time.process_time()
    for _ in range(n):
        body, _ = proxy._check(raw, "completions")
        tokens = await proxy._tokens("completions", body)
        assert tokens is not None
        blocks = len(tokens) // 16
        scores = index.find_matches(tokens, by_medium=True)
        keys = proxy.router.block_keys(tokens)  # provisional residency, as with NATS up
        rid = next(proxy._request_ids)
        worker, overlap = proxy.router.choose_scores(scores, blocks, workers=list(proxy.upstreams.up()), keys=keys,
                                                     num_tokens=len(tokens), request_id=rid)  # fmt: skip
        proxy.metrics.choices.labels(worker).inc()
        proxy.metrics.overlap.observe(overlap)
        _copy_headers(headers)
        proxy.router.first_token(worker, rid)
        proxy.router.done(worker, rid)
        proxy.metrics.ttfb.observe(0.001)
        proxy.metrics.requests.labels("completions", "200").inc()
    elapsed = time.process_time() - start
    await proxy.close()
    return elapsed / n * 1e6


def _table(rows: list[dict[str, Any]]) -> str:
    direct = rows[0]
    lines = ["| path | p50 | p99 | added p50 | added p99 | server CPU / request | requests/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        added = "" if r is direct else f"{r['p50'] - direct['p50']:,.0f} us"
        added99 = "" if r is direct else f"{r['p99'] - direct['p99']:,.0f} us"
        lines.append(f"| {r['path']} | {r['p50']:,.0f} us | {r['p99']:,.0f} us | {added} | {added99} | "
                     f"{r['cpu']:,.0f} us | {r['rps']:,.0f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=4000, help="sequential requests per path (default 4000)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight for requests/s (default 16)")
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds of the requests/s runs, summed (default 6)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds the paths take turns in (default 20)")
    parser.add_argument("--write", action="store_true", help="replace the Proxy section of bench/RESULTS.md")
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(*args.serve))
        return 0

    from kvbridge.tools.server import NatsServer

    procs = []
    try:
        with NatsServer() as nats:
            engine, engine_url = _spawn("engine")
            procs.append(engine)
            plain, plain_url = _spawn("plain", engine_url)
            procs.append(plain)
            kv, kv_url = _spawn("kvproxy", f"{nats.url} {engine_url}")
            procs.append(kv)
            e, pl, k = engine.pid, plain.pid, kv.pid
            paths = [("direct", engine_url, False, [e]), ("plain proxy (aiohttp)", plain_url, False, [pl, e]),
                     ("kvbridge proxy, cached prompt", kv_url, False, [k, e]),
                     ("kvbridge proxy, new prompt", kv_url, True, [k, e])]  # fmt: skip
            rows = asyncio.run(_measure(args, paths))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    own = asyncio.run(_own_work(20_000))
    load = os.getloadavg()[0]
    table = _table(rows) + f"\n\nkvbridge proxy's own work per request, without HTTP (CPU, cached prompt, 3 workers): {own:.0f} us"
    cmd = (f"python bench/proxy.py --requests {args.requests} --concurrency {args.concurrency} "
           f"--seconds {args.seconds:g} --rounds {args.rounds}")
    host = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, load {load:.1f} at the end"
    print(table)
    print(host)
    if args.write:
        _write(table, cmd, host)
    return 0


def _write(table: str, cmd: str, host: str) -> None:
    path = ROOT / "bench" / "RESULTS.md"
    text = path.read_text()
    section = (
        "## Proxy\n\n"
        f"`{cmd}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {host}). One stand-in engine that "
        "answers at once, each server in its own process, the client sending non-streaming `/v1/completions` "
        "one at a time (p50, p99) and then concurrently (requests/s); added = the path's figure minus direct's.\n\n"
        f"{table}\n\n"
        "How to read it: on loopback the cost is CPU. On a shared 2-CPU machine whose load is above 2, the "
        "latency columns move between runs by more than the proxy costs (a hop that waits for a core waits "
        "for the other processes' whole slices): compare runs by the CPU column and the last line, which "
        "contention disturbs least. Of kvbridge proxy's extra CPU over the plain aiohttp proxy, its own work "
        "is the last line; the rest is not broken down here (it forwards every client and upstream header "
        "where the plain proxy passes one, and counts metrics). A new prompt adds one `/tokenize` round trip "
        "to the engine (the engine's CPU for it included).\n"
    )
    text, n = re.subn(r"## Proxy\n.*?(?=\n## |\Z)", section.rstrip("\n") + "\n", text, flags=re.S)
    if not n:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
