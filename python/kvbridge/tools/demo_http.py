"""``kvbridge demo --http``: the KV-aware gateway over real HTTP, against two blind policies.

A real nats-server, and per routing policy a fleet of stand-in engines
(:class:`kvbridge.tools.standin.StandinEngine`: OpenAI-compatible HTTP over a KV cache that
publishes its block events, each prompt block not found cached costing ``--prefill-ms-per-block``
before the first token). The same multi-turn chats over a few shared system prompts go, through
the official ``openai`` client, streaming:

* KV-aware: to ``kvbridge proxy`` (:class:`kvbridge.routing.proxy.KvProxy`) in front of its fleet;
* round-robin, and uniformly random: straight to the engines, chosen by the client.

The table gives, per policy, the share of prompt tokens the engines found cached and the time to
first token the client measured (prefill waits, HTTP, and for KV-aware the proxy's own work).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import string
import time
from contextlib import AsyncExitStack
from typing import Any, Callable

from kvbridge.config import Config
from kvbridge.routing.proxy import KvProxy
from kvbridge.tools.server import NatsServer
from kvbridge.tools.standin import StandinEngine

__all__ = ["run_http_demo"]

MODEL = "demo-http"
POLICIES = ("KV-aware", "round-robin", "random")
_CONCURRENCY = 4


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(map(len, words)) < chars:
        words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randrange(2, 9))))
    return " ".join(words)


def _workload(seed: int, turns: int) -> list[list[list[dict[str, str]]]]:
    """The conversations' requests in waves of ``_CONCURRENCY`` (distinct chats per wave): the
    same for every policy, since the stand-ins' replies do not depend on where a turn ran."""
    rng = random.Random(seed)
    systems = [_text(rng, rng.randrange(1000, 3000)) for _ in range(8)]
    chats: list[list[dict[str, str]]] = []
    waves = []
    for _ in range(-(-turns // _CONCURRENCY)):
        wave = []
        taken: set[int] = set()
        for _ in range(_CONCURRENCY):
            if len(chats) < 12 or rng.random() < 0.2:
                chats.append([{"role": "system", "content": rng.choice(systems)}])
            i = rng.choice([j for j in range(len(chats)) if j not in taken] or [len(chats) - 1])
            taken.add(i)
            chats[i].append({"role": "user", "content": _text(rng, rng.randrange(40, 300))})
            wave.append(list(chats[i]))
            chats[i].append({"role": "assistant", "content": " w0 w1 w2 w3 w4 w5 w6 w7"})  # what max_tokens=8 gives
        waves.append(wave)
    return waves


async def _run_policy(policy: str, args: argparse.Namespace, base: Config, waves: list[Any]) -> dict[str, Any]:
    import openai

    model = f"{MODEL}-{policy.lower()}"
    async with AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(StandinEngine(
                base, model=model, worker_id=f"worker-{i}", block_size=args.block_size, num_blocks=args.num_blocks,
                prefill_s_per_block=args.prefill_ms_per_block / 1000,
            ))  # fmt: skip
            for i in range(args.workers)
        ]
        proxy = None
        if policy == "KV-aware":
            proxy = await stack.enter_async_context(
                KvProxy(base, model=model, port=0, block_size=args.block_size, seed=args.seed)
            )
            deadline = time.monotonic() + 10
            while len(proxy.upstreams.all) < len(engines):  # the load reports name every engine's URL
                if time.monotonic() > deadline:
                    raise RuntimeError("the proxy did not hear every engine's load report within 10 s")
                await asyncio.sleep(0.05)
                proxy._refresh(force=True)
            urls = [proxy.url]
        else:
            urls = [e.url for e in engines]
        clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="unused", max_retries=0) for u in urls]
        for c in clients:
            stack.push_async_callback(c.close)
        rng = random.Random(args.seed + 1)
        rr = itertools.count()
        pick: Callable[[], Any] = {
            "KV-aware": lambda: clients[0],
            "round-robin": lambda: clients[next(rr) % len(clients)],
            "random": lambda: rng.choice(clients),
        }[policy]

        async def turn(messages: list[dict[str, str]]) -> float:
            start = time.perf_counter()
            stream = await pick().chat.completions.create(model=model, messages=messages, stream=True, max_tokens=8)
            ttft = None
            async for _ in stream:
                if ttft is None:
                    ttft = time.perf_counter() - start
            return ttft if ttft is not None else float("nan")

        started = time.perf_counter()
        ttfts: list[float] = []
        for wave in waves:
            ttfts += await asyncio.gather(*(turn(m) for m in wave))
        elapsed = time.perf_counter() - started
        prompt = sum(e.prompt_tokens for e in engines)
        cached = sum(e.cached_tokens for e in engines)
        return {"policy": policy, "turns": len(ttfts), "hit": 100.0 * cached / prompt if prompt else 0.0,
                "ttft": sorted(ttfts), "rps": len(ttfts) / elapsed,
                "tokenize": sum(e.tokenize_calls for e in engines)}  # fmt: skip


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3


async def run_http_demo(args: argparse.Namespace) -> int:
    waves = _workload(args.seed, args.http_turns)
    with NatsServer() as server:
        print(f"nats-server on {server.url}; per policy {args.workers} stand-in engines (OpenAI-compatible HTTP, "
              f"{args.prefill_ms_per_block:g} ms per uncached {args.block_size}-token block), "
              f"{sum(map(len, waves))} streamed chat turns through the openai client", flush=True)  # fmt: skip
        base = Config(servers=[server.url], reconnect_wait_s=0.2, load_interval_s=0.2)
        rows = [await _run_policy(policy, args, base, waves) for policy in POLICIES]
    print()
    print(f"{'routing':<12} {'turns':>6} {'cached':>7} {'TTFT p50':>9} {'p90':>8} {'mean':>8} {'turns/s':>8}")
    for r in rows:
        t = r["ttft"]
        print(f"{r['policy']:<12} {r['turns']:>6} {r['hit']:>6.1f}% {_pct(t, 0.5):>6.1f} ms {_pct(t, 0.9):>5.1f} ms "
              f"{statistics.fmean(t) * 1e3:>5.1f} ms {r['rps']:>8.1f}")  # fmt: skip
    print(f"cached: prompt tokens the chosen engine already held (the engines' own count). TTFT: measured by the "
          f"client, from the request to the first streamed chunk. KV-aware goes through kvbridge proxy (its "
          f"/tokenize calls: {rows[0]['tokenize']}, one per new prompt); the others go straight to the engines.")
    return 0
