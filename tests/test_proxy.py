"""``kvbridge proxy`` with real HTTP and a real nats-server: the official openai client against the
gateway in front of three stand-in engines (kvbridge.tools.standin)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections import Counter
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, AsyncIterator

import aiohttp
import openai
import pytest
from bridge_support import wait_until

from kvbridge.bus.connection import ConnectError
from kvbridge.config import Config
from kvbridge.routing.proxy import KvProxy
from kvbridge.routing.upstreams import Target
from kvbridge.tools.standin import StandinEngine

pytestmark = pytest.mark.timeout(60)

BS = 16
SYSTEM = "You are a careful assistant who answers in exactly one short sentence. " * 4


class Fleet:
    def __init__(self, proxy: KvProxy, engines: list[StandinEngine], model: str) -> None:
        self.proxy, self.engines, self.model = proxy, engines, model
        self.by_worker = {e.worker_id: e for e in engines}
        self.client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=20)

    def engine_of(self, response_id: str) -> StandinEngine:
        """The stand-in that answered: its ids are ``<kind>-<worker>-<n>``."""
        return next(e for e in self.engines if response_id.split("-", 1)[1].startswith(e.worker_id + "-"))

    def metric(self, name: str, **labels: str) -> float:
        value = self.proxy.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def _config(server: Any, **kw: Any) -> Config:
    return Config(servers=server.url, reconnect_wait_s=0.2, heartbeat_s=0.5, **kw)


@asynccontextmanager
async def fleet(server: Any, n: int = 3, *, token_delay_s: float = 0.0, engine_tokenizer: Any = None,
                **proxy_options: Any) -> AsyncIterator[Fleet]:  # fmt: skip
    model = f"m-{uuid.uuid4().hex[:8]}"
    async with AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(StandinEngine(
                _config(server), model=model, worker_id=f"w{i}", dp_rank=i, block_size=BS, token_delay_s=token_delay_s,
                tokenizer=engine_tokenizer, load_interval_s=0.1,
            ))  # fmt: skip
            for i in range(n)
        ]
        proxy = await stack.enter_async_context(
            KvProxy(_config(server), model=model, port=0, block_size=BS, seed=0, **proxy_options)
        )
        f = Fleet(proxy, engines, model)
        stack.push_async_callback(f.client.close)

        def knows_all() -> bool:
            proxy._refresh(force=True)
            return len(proxy.upstreams.all) == n

        await wait_until(knows_all, 10, "the proxy to learn every worker's URL from its load reports")
        yield f


async def _raw_stream(response: Any) -> bytes:
    return b"".join([chunk async for chunk in response.iter_bytes()])


async def test_completions_and_chat_byte_identical(nats_server):
    async with fleet(nats_server) as f:
        c = f.client
        # non-streaming: the body the client got is the body the engine sent
        raw = await c.completions.with_raw_response.create(model=f.model, prompt=SYSTEM + "Say hi.", max_tokens=5)
        done = raw.parse()
        assert raw.http_response.content == f.engine_of(done.id).sent[done.id]
        assert done.choices[0].text == " w0 w1 w2 w3 w4"
        raw = await c.chat.completions.with_raw_response.create(
            model=f.model, messages=[{"role": "user", "content": "Hello"}], max_tokens=3
        )
        chat = raw.parse()
        assert raw.http_response.content == f.engine_of(chat.id).sent[chat.id]
        assert chat.choices[0].message.content == " w0 w1 w2"

        # streaming: every SSE byte, in order, as the engine wrote them
        for create, kw in ((c.completions, {"prompt": SYSTEM + "Count."}),
                           (c.chat.completions, {"messages": [{"role": "user", "content": "Count."}]})):  # fmt: skip
            async with create.with_streaming_response.create(model=f.model, stream=True, max_tokens=6, **kw) as resp:
                assert resp.headers["content-type"].startswith("text/event-stream")
                body = await _raw_stream(resp)
            first = json.loads(body.split(b"\n\n")[0][len(b"data: "):])
            assert body == f.engine_of(first["id"]).sent[first["id"]]
            assert body.endswith(b"data: [DONE]\n\n")

        # and parsed by the client as a stream
        stream = await c.chat.completions.create(model=f.model, messages=[{"role": "user", "content": "x"}],
                                                 stream=True, max_tokens=4)  # fmt: skip
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert text == " w0 w1 w2 w3"

        models = await c.models.list()
        assert [(m.id, m.owned_by) for m in models.data] == [(f.model, "kvbridge-standin")]  # the engine's own
        assert f.metric("kvbridge_proxy_requests_total", endpoint="chat", status="200") == 3


async def test_same_prefix_goes_where_it_is_cached(nats_server):
    async with fleet(nats_server) as f:
        prefixes = [f"[{i}] " + SYSTEM for i in range(3)]
        first: dict[int, str] = {}
        for i, prefix in enumerate(prefixes):
            r = await f.client.completions.create(model=f.model, prompt=prefix + "first question", max_tokens=1)
            first[i] = f.engine_of(r.id).worker_id
        # The index hears the blocks through NATS; then every follow-up lands where its prefix is.
        n_blocks = len(prefixes[0].encode()) // BS

        def indexed() -> bool:
            assert f.proxy.index is not None
            return all(f.proxy.index.find_matches(list(p.encode())).get(first[i], 0) >= n_blocks
                       for i, p in enumerate(prefixes))  # fmt: skip

        await wait_until(indexed, 10, "the index to hold every prefix's blocks")
        for round_ in range(3):
            for i, prefix in enumerate(prefixes):
                r = await f.client.completions.create(model=f.model, prompt=prefix + f"follow-up {round_}", max_tokens=1)
                assert f.engine_of(r.id).worker_id == first[i]
                assert r.usage is not None
                assert r.usage.prompt_tokens_details is not None
                assert r.usage.prompt_tokens_details.cached_tokens >= n_blocks * BS
        # chat: the template's rendering is what /tokenize answered, cached after the first call
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]
        r = await f.client.chat.completions.create(model=f.model, messages=msgs, max_tokens=1)
        home = f.engine_of(r.id).worker_id
        calls = sum(e.tokenize_calls for e in f.engines)
        await wait_until(lambda: f.proxy.index.find_matches(
            list(f"<|system|>\n{SYSTEM}\n".encode())).get(home, 0) > 0, 10, "the chat prefix to be indexed")  # fmt: skip
        msgs2 = msgs + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
        r = await f.client.chat.completions.create(model=f.model, messages=msgs2, max_tokens=1)
        assert f.engine_of(r.id).worker_id == home
        assert sum(e.tokenize_calls for e in f.engines) == calls + 1  # a new prompt: one /tokenize
        await f.client.chat.completions.create(model=f.model, messages=msgs2, max_tokens=1)
        assert sum(e.tokenize_calls for e in f.engines) == calls + 1  # the same again: from the LRU
        assert f.metric("kvbridge_proxy_overlap_blocks_sum") >= 9 * n_blocks


async def test_a_block_aligned_prompt_held_whole_is_credited_what_vllm_can_hit(nats_server):
    # vLLM computes a prompt's last token: of a block-aligned prompt held whole it reuses all
    # blocks but the last (KVCacheManager.get_computed_blocks), and the proxy asks the index of
    # that part only (routing/work.py hit_tokens), so its overlap is n - 1 blocks, not n.
    async with fleet(nats_server) as f:
        prompt = SYSTEM + "x" * (-len(SYSTEM.encode()) % BS)
        n = len(prompt.encode()) // BS
        r = await f.client.completions.create(model=f.model, prompt=prompt, max_tokens=1)
        home = f.engine_of(r.id).worker_id
        assert f.proxy.index is not None
        await wait_until(lambda: f.proxy.index.find_matches(list(prompt.encode())).get(home, 0) == n, 10,
                         "the prompt's every block indexed")  # fmt: skip
        before = f.metric("kvbridge_proxy_overlap_blocks_sum")
        r = await f.client.completions.create(model=f.model, prompt=prompt, max_tokens=1)
        assert f.engine_of(r.id).worker_id == home
        assert f.metric("kvbridge_proxy_overlap_blocks_sum") - before == n - 1


async def test_malformed_requests_get_4xx_json(nats_server):
    async with fleet(nats_server, n=1, max_body_bytes=4096) as f:
        url = f.proxy.url
        cases = [
            ("POST", "/v1/completions", b"{not json", 400),
            ("POST", "/v1/completions", b"[1, 2]", 400),
            ("POST", "/v1/completions", json.dumps({"prompt": "hi"}).encode(), 400),
            ("POST", "/v1/completions", json.dumps({"model": "nope", "prompt": "hi"}).encode(), 404),
            ("POST", "/v1/chat/completions", json.dumps({"model": f.model}).encode(), 400),
            ("POST", "/v1/chat/completions", json.dumps({"model": f.model, "messages": "x" * 5000}).encode(), 413),
            ("GET", "/v1/completions", b"", 405),
            ("POST", "/v1/models", b"", 405),
            ("GET", "/v2/nothing", b"", 404),
        ]
        async with aiohttp.ClientSession() as s:
            for method, path, data, status in cases:
                async with s.request(method, url + path, data=data, headers={"Content-Type": "application/json"}) as r:
                    body = await r.json(content_type=None)
                    assert r.status == status, (path, data[:40], body)
                    assert r.content_type == "application/json"
                    assert body["error"]["code"] == status and body["error"]["message"]
        assert sum(e.requests for e in f.engines) == 0  # none of them reached an engine
        with pytest.raises(openai.NotFoundError):
            await f.client.completions.create(model="other-model", prompt="hi")


async def _warm(f: Fleet, prefix: str) -> StandinEngine:
    """Send one request with ``prefix``; return the engine that caches it once the index knows."""
    r = await f.client.completions.create(model=f.model, prompt=prefix + "warm-up", max_tokens=1)
    home = f.engine_of(r.id)
    n_blocks = len(prefix.encode()) // BS
    await wait_until(lambda: f.proxy.index.find_matches(list(prefix.encode())).get(home.worker_id, 0) >= n_blocks,
                     10, "the index to hold the prefix")  # fmt: skip
    return home


async def test_dp_rank_header_pins_the_rank(nats_server):
    async with fleet(nats_server) as f:
        for i in range(6):
            await f.client.completions.create(model=f.model, prompt=f"{i} " + SYSTEM, max_tokens=1)
        seen = {e.worker_id: set(e.rank_headers) for e in f.engines if e.rank_headers}
        assert seen and all(ranks == {str(f.by_worker[w].dp_rank)} for w, ranks in seen.items())


async def test_5xx_before_streaming_is_retried_on_the_next_best_worker(nats_server):
    async with fleet(nats_server) as f:
        home = await _warm(f, SYSTEM)
        home.fail_next = 1
        r = await f.client.completions.create(model=f.model, prompt=SYSTEM + "again", max_tokens=1)
        assert home.fail_next == 0  # the fault happened: home answered 500
        assert f.engine_of(r.id) is not home
        assert f.metric("kvbridge_proxy_retries_total") == 1
        assert f.proxy.upstreams.is_down(home.worker_id)
        # every worker failing: the client gets the upstream's own 5xx, not a hang
        for e in f.engines:
            e.fail_next = 1
        f.proxy.upstreams._down_until.clear()
        with pytest.raises(openai.InternalServerError) as err:
            await f.client.completions.create(model=f.model, prompt=SYSTEM + "third", max_tokens=1)
        assert "stand-in failure" in str(err.value)
        assert sum(e.fail_next for e in f.engines) == 1  # retried once, not over every worker


async def test_killed_engine_mid_run(nats_server):
    # A prefix long enough that its hit outweighs the decode step of the stream running beside it
    # (the router's time cost: ~300 cached tokens save about one decode step, no more).
    prefix = SYSTEM * 4
    async with fleet(nats_server, token_delay_s=0.05) as f:
        home = await _warm(f, prefix)
        streaming = await f.client.completions.create(model=f.model, prompt=prefix + "stream", max_tokens=100,
                                                      stream=True)  # fmt: skip
        first = await anext(aiter(streaming))
        assert f.engine_of(first.id) is home
        # a request waiting for its (non-streamed) answer when the engine dies: not started to stream
        waiting = asyncio.create_task(
            f.client.completions.create(model=f.model, prompt=prefix + "waiting", max_tokens=100)
        )
        await wait_until(lambda: home.running == 2, 5, "the second request to reach the home engine")
        for e in f.engines:
            if e is not home:
                e.token_delay_s = 0  # the retried request need not take as long again
        await home.kill()
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientConnectorError):  # the crash happened: nothing listens there
                await s.get(home.url + "/health")
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            await asyncio.wait_for(_drain(streaming), 10)
        done = await asyncio.wait_for(waiting, 20)
        assert f.engine_of(done.id) is not home
        # after the crash: refused connections, every request still answered, by the others
        answers = await asyncio.gather(*(
            f.client.completions.create(model=f.model, prompt=SYSTEM + f"after {i}", max_tokens=1) for i in range(5)
        ))  # fmt: skip
        assert all(f.engine_of(a.id) is not home for a in answers)
        assert f.metric("kvbridge_proxy_retries_total") >= 1
        assert f.metric("kvbridge_proxy_errors_total", kind="upstream_midstream") == 1
        assert f.proxy.upstreams.is_down(home.worker_id)


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


async def test_client_disconnect_cancels_the_upstream_request(nats_server):
    async with fleet(nats_server, token_delay_s=0.05) as f:
        stream = await f.client.chat.completions.create(
            model=f.model, messages=[{"role": "user", "content": "long answer"}], max_tokens=200, stream=True
        )
        first = await anext(aiter(stream))
        engine = f.engine_of(first.id)
        assert engine.cancelled == 0
        await stream.close()
        await wait_until(lambda: engine.cancelled == 1, 10, "the engine to see its request cancelled")
        assert engine.running == 0
        await wait_until(lambda: f.metric("kvbridge_proxy_errors_total", kind="client_disconnect") == 1, 5,
                         "the proxy to count the disconnect")  # fmt: skip
        # before any byte: a client giving up on a (non-streamed) answer cancels it at the engine too
        waiting = asyncio.create_task(f.client.completions.create(model=f.model, prompt="slow", max_tokens=200))
        await wait_until(lambda: sum(e.running for e in f.engines) == 1, 5, "the request to reach an engine")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await wait_until(lambda: sum(e.cancelled for e in f.engines) == 2, 10, "the engine to see it cancelled")
        assert sum(e.running for e in f.engines) == 0


async def test_nats_down_keeps_serving(own_nats_server):
    server = own_nats_server
    async with fleet(server) as f:
        await _warm(f, SYSTEM)
        assert f.metric("kvbridge_proxy_nats_connected") == 1
        reports = f.proxy.router.reports  # the subscriber's reports, read in bulk by the router
        await wait_until(lambda: all(reports.report(e.worker_id) is not None for e in f.engines), 10,
                         "every worker's load report to reach the router")  # fmt: skip
        server.kill()
        assert not server.running  # kill -9: the broker is gone
        await wait_until(lambda: not f.proxy.nats_up, 10, "the proxy to notice NATS is down")
        # reports stop with the stream, young as the last ones are: the work sent alone decides
        assert [reports.report(e.worker_id) for e in f.engines] == [None] * 3
        for e in f.engines:
            e.token_delay_s = 2.0  # each request stays in flight while the others are routed
        async def streamed(i: int) -> str:
            # ~4,000 tokens: a prompt's prefill weighs more than the HTTP between two requests
            stream = await f.client.completions.create(model=f.model, prompt=SYSTEM * 14 + f"q{i}", max_tokens=4,
                                                       stream=True)  # fmt: skip
            return [chunk.id async for chunk in stream][0]

        sent = [asyncio.create_task(streamed(i)) for i in range(9)]
        # all nine in flight at once (waited on, not assumed of the delay), then let them finish
        await wait_until(lambda: sum(e.running for e in f.engines) == 9, 30, "the nine requests in flight")
        for e in f.engines:
            e.token_delay_s = 0.0
        answers = await asyncio.gather(*sent)
        # least loaded among the last known: 9 at once, 3 to each (the router's own accounting: the
        # prompts sent and not through their first token, then the decode steps of those streaming)
        assert sorted(Counter(f.engine_of(a).worker_id for a in answers).values()) == [3, 3, 3]
        async with aiohttp.ClientSession() as s:
            async with s.get(f.proxy.url + "/health") as r:
                health = await r.json()
            async with s.get(f.proxy.url + "/metrics") as r:
                text = await r.text()
        assert r.status == 200
        assert health["status"] == "degraded" and health["nats"] == "down" and len(health["workers"]) == 3
        assert "kvbridge_proxy_nats_connected 0.0" in text
        server.restart()  # the stand-ins' publishers close cleanly against a live broker


async def test_local_tokenizer(nats_server, tmp_path):
    """With --tokenizer the proxy asks no engine for completions' tokens, and routes the same."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(SYSTEM.replace(".", " ").split()) | {"first", "second", "question"})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", ".", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    engine_tok = Tokenizer.from_file(str(path))
    prefixes = [f"{w} {SYSTEM}" for w in ("first", "second", "question")]
    async with fleet(nats_server, engine_tokenizer=engine_tok, tokenizer=str(path)) as f:
        homes = []
        for p in prefixes:
            r = await f.client.completions.create(model=f.model, prompt=p + " first", max_tokens=1)
            homes.append(f.engine_of(r.id))
        for p, home in zip(prefixes, homes):
            ids = engine_tok.encode(p).ids
            await wait_until(lambda: f.proxy.index.find_matches(ids).get(home.worker_id, 0) >= len(ids) // BS, 10,
                             "the index to hold the prefix")  # fmt: skip
            r = await f.client.completions.create(model=f.model, prompt=p + " second question", max_tokens=1)
            assert f.engine_of(r.id) is home
        assert sum(e.tokenize_calls for e in f.engines) == 0
        assert f.metric("kvbridge_proxy_tokenize_seconds_count", source="local") == 6


async def test_cli_proxy_with_static_workers(nats_server):
    """`kvbridge proxy --worker ID=URL@RANK` in front of an engine that publishes nothing."""
    import os
    import signal
    import sys

    async with StandinEngine(model="cli-model", worker_id="static") as engine:
        exe = os.path.join(os.path.dirname(sys.executable), "kvbridge")
        proc = await asyncio.create_subprocess_exec(
            exe, "proxy", "--model", "cli-model", "--servers", nats_server.url, "--listen", "127.0.0.1:0",
            "--worker", f"static={engine.url}@3", stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert proc.stderr is not None
            line = await asyncio.wait_for(proc.stderr.readline(), 20)
            while not line.startswith(b"kvbridge proxy for"):
                assert line, "the proxy exited before serving"
                line = await asyncio.wait_for(proc.stderr.readline(), 20)
            url = line.split(b" on ")[1].split(b" ")[0].decode()
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/completions", json={"model": "cli-model", "prompt": "hi", "max_tokens": 2}) as r:
                    assert r.status == 200 and (await r.json())["choices"][0]["text"] == " w0 w1"
                async with s.get(url + "/health") as r:
                    health = await r.json()
            assert health["workers"] == {"static": {"url": engine.url, "dp_rank": 3, "down": False, "source": "static"}}
            assert engine.rank_headers == ["3"]
            proc.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(proc.wait(), 20) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def test_advertise_url():
    from kvbridge.engine.vllm import advertise_url

    assert advertise_url({"KVBRIDGE_ADVERTISE_URL": "http://gpu-7:9000/"}, ["vllm", "serve"]) == "http://gpu-7:9000"
    assert advertise_url({}, ["vllm", "serve", "m", "--host", "10.0.0.5", "--port=8001"]) == "http://10.0.0.5:8001"
    assert advertise_url({}, ["vllm", "serve", "m", "--host", "::1"]) == "http://[::1]:8000"
    assert advertise_url({}, ["python", "bench.py"]) is None


async def test_index_service_mode(nats_server):
    """--index-service: overlap scores from `kvbridge index` replicas over NATS, same routing."""
    from kvbridge.routing.service import IndexService

    async with fleet(nats_server, index_service=True) as f:
        assert f.proxy.index is None and f.proxy.index_client is not None
        async with IndexService(_config(nats_server), model=f.model, block_size=BS) as service:
            r = await f.client.completions.create(model=f.model, prompt=SYSTEM + "one", max_tokens=1)
            home = f.engine_of(r.id)
            ids = list(SYSTEM.encode())
            await wait_until(lambda: service.index.find_matches(ids).get(home.worker_id, 0) >= len(ids) // BS, 10,
                             "the index service to hold the prefix")  # fmt: skip
            for i in range(3):
                r = await f.client.completions.create(model=f.model, prompt=SYSTEM + f"again {i}", max_tokens=1)
                assert f.engine_of(r.id) is home
            assert service.stats["queries"] >= 3 and service.stats["errors"] == 0
            assert f.metric("kvbridge_proxy_errors_total", kind="index") == 0



async def test_vllm_plugin_reports_lead_the_proxy_to_each_dp_rank(nats_server, monkeypatch):
    """The stat-logger plugin's load reports carry KVBRIDGE_ADVERTISE_URL and the DP rank, from the
    start (an idle engine too); the proxy pins each rank with X-data-parallel-rank."""
    import socket
    from types import SimpleNamespace as NS

    from kvbridge.engine import vllm as kv_vllm
    from kvbridge.wire.subjects import sanitize_token

    model = f"m-{uuid.uuid4().hex[:8]}"
    cfg = NS(kv_events_config=NS(enable_kv_cache_events=True, publisher="null"),
             parallel_config=NS(data_parallel_size=2, data_parallel_size_local=2, data_parallel_index=0,
                                _api_process_rank=0),
             model_config=NS(served_model_name=model))  # fmt: skip
    async with StandinEngine(model=model) as api_server:  # one API server, two DP ranks behind it
        monkeypatch.setenv("KVBRIDGE_ADVERTISE_URL", api_server.url)
        factory = kv_vllm.logger_factory(servers=[nats_server.url], load_interval_s=0.1)
        logger = factory(vllm_config=cfg, engine_indexes=[0, 1])
        try:
            assert logger.plan.url == api_server.url
            async with KvProxy(_config(nats_server), model=model, port=0, block_size=BS, seed=0) as proxy:
                host = sanitize_token(socket.gethostname())

                def learned() -> bool:
                    proxy._refresh(force=True)
                    return len(proxy.upstreams.all) == 2

                await wait_until(learned, 10, "the proxy to learn both ranks from the plugin's reports")
                assert proxy.upstreams.all == {f"{host}-dp0": Target(api_server.url, 0),
                                               f"{host}-dp1": Target(api_server.url, 1)}  # fmt: skip
                async with aiohttp.ClientSession() as s:
                    for i in range(12):
                        async with s.post(proxy.url + "/v1/completions",
                                          json={"model": model, "prompt": f"{i}", "max_tokens": 1}) as r:  # fmt: skip
                            assert r.status == 200
                # equal loads: a seeded pick between the two; each request pinned to the chosen rank
                for rank in ("0", "1"):
                    chosen = proxy.metrics.registry.get_sample_value(
                        "kvbridge_proxy_worker_choices_total", {"worker": f"{host}-dp{rank}"})  # fmt: skip
                    assert chosen and api_server.rank_headers.count(rank) == chosen
        finally:
            kv_vllm.shutdown()


def test_demo_http_prints_a_table_per_policy(capsys):
    from kvbridge.tools.cli import main

    assert main(["demo", "--http", "--http-turns", "12", "--workers", "2", "--prefill-ms-per-block", "0.5"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["KV-aware"], ["round-robin"], ["random"])}
    assert set(rows) == {"KV-aware", "round-robin", "random"} and all(r[1] == "12" for r in rows.values())
    assert "TTFT" in out


async def test_a_stalled_stream_ends_with_an_error_not_a_hang(nats_server):
    async with fleet(nats_server, n=1, token_delay_s=30.0, read_timeout_s=0.3) as f:
        stream = await f.client.completions.create(model=f.model, prompt="stall", max_tokens=5, stream=True)
        first = await anext(aiter(stream))  # the engine sent its first chunk, then goes silent for 30 s
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            await asyncio.wait_for(_drain(stream), 10)
        engine = f.engine_of(first.id)
        await wait_until(lambda: engine.cancelled == 1, 10, "the stalled request to be cancelled at the engine")


async def test_nats_unreachable_at_start_with_workers_given():
    """Given --worker, the proxy starts without NATS, serves by load, and connects when NATS comes."""
    import socket

    from kvbridge.tools.server import NatsServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = Config(servers=[f"nats://127.0.0.1:{port}"], connect_timeout_s=0.5, reconnect_wait_s=0.2)
    async with StandinEngine(model="early") as engine:
        async with KvProxy(config, model="early", port=0, workers={"only": engine.url}) as proxy:
            assert not proxy.nats_up
            async with aiohttp.ClientSession() as session:
                async with session.post(proxy.url + "/v1/completions", json={"model": "early", "prompt": "hi"}) as r:
                    assert r.status == 200
                async with session.get(proxy.url + "/health") as r:
                    assert (await r.json())["nats"] == "down"
            with NatsServer(port=port):
                await wait_until(lambda: proxy.nats_up, 10, "the proxy to connect once NATS is there")
    with pytest.raises(ConnectError):  # and without workers, nothing to serve: a clear error at start
        async with KvProxy(config, model="early", port=0):
            pass


async def test_a_metrics_port_taken_when_nats_comes_is_said_not_swallowed(caplog):
    """The proxy connects in the background when NATS was down at start; a configuration error
    then (its metrics port taken meanwhile) ended that task without a word."""
    import logging
    import socket

    from kvbridge.tools.server import NatsServer

    caplog.set_level(logging.INFO)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with socket.create_server(("127.0.0.1", 0)) as taken:
        config = Config(servers=[f"nats://127.0.0.1:{port}"], connect_timeout_s=0.5, reconnect_wait_s=0.2,
                        metrics_port=taken.getsockname()[1])  # fmt: skip
        async with StandinEngine(model="early") as engine:
            async with KvProxy(config, model="early", port=0, workers={"only": engine.url}) as proxy:
                with NatsServer(port=port):
                    await wait_until(lambda: any("not connecting to NATS: metrics_port" in r.getMessage()
                                                 for r in caplog.records), 10, "the error said")  # fmt: skip
                assert not proxy.nats_up


def test_worker_specs_and_token_lru():
    from kvbridge.routing.upstreams import TokenCache, parse_worker

    assert parse_worker("gpu-0=http://10.0.0.5:8000/") == ("gpu-0", Target("http://10.0.0.5:8000"))
    assert parse_worker("gpu-1=http://10.0.0.5:8000@1") == ("gpu-1", Target("http://10.0.0.5:8000", 1))
    assert parse_worker("g=https://u@host:8000") == ("g", Target("https://u@host:8000"))  # user info is no rank
    for bad in ("gpu-0", "=http://x", "gpu-0=", "gpu-0=10.0.0.5:8000"):
        with pytest.raises(ValueError, match="--worker"):
            parse_worker(bad)
    lru = TokenCache(2)
    lru.put("a", [1])
    lru.put("b", [2])
    assert lru.get("a") == [1]  # now the most recent: "b" goes first
    lru.put("c", [3])
    assert (lru.get("a"), lru.get("b"), lru.get("c"), len(lru)) == ([1], None, [3], 2)


async def test_record_writes_a_replayable_trace(nats_server, tmp_path):
    """--record: one Mooncake line per routed request; the replay's loader reads it, lengths are the
    engines' own, and prompts sharing a prefix share exactly its leading blocks' ids, at the
    engines' block size by default (the line says so: ``hash_block_size``)."""
    from kvbridge.replay.trace import load_trace
    from kvbridge.tools.standin import render_chat

    TRACE_BLOCK = BS  # the proxy's --block-size

    path = tmp_path / "trace.jsonl"
    system = "Answer as a pirate would, in one sentence, about the sea and ships. " * 30  # ~2,000 tokens
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": "What is a brig?"}],
        [{"role": "system", "content": system}, {"role": "user", "content": "And a sloop, how does it sail?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "system", "content": system}, {"role": "user", "content": "What is a brig?"},
         {"role": "assistant", "content": " w0 w1 w2"}, {"role": "user", "content": "Go on."}],
    ]  # fmt: skip
    max_tokens = [3, 7, 1, 5]
    async with fleet(nats_server, record=str(path)) as f:
        for i, (messages, n) in enumerate(zip(chats, max_tokens)):
            if i % 2:  # streamed: the output length from the stream's usage chunk
                stream = await f.client.chat.completions.create(model=f.model, messages=messages, max_tokens=n,
                                                                stream=True)  # fmt: skip
                async for _ in stream:
                    pass
            else:
                await f.client.chat.completions.create(model=f.model, messages=messages, max_tokens=n)
        # a request that is refused before routing is not recorded
        with pytest.raises(openai.BadRequestError):
            await f.client.chat.completions.create(model=f.model, messages=[])
    text = path.read_text()
    assert "pirate" not in text and "brig" not in text  # no prompt text
    lines = [json.loads(line) for line in text.splitlines()]
    assert [set(line) for line in lines] == [{"timestamp", "input_length", "output_length", "hash_ids",
                                              "hash_block_size"}] * 4  # fmt: skip
    assert {line["hash_block_size"] for line in lines} == {BS}
    assert lines[0]["timestamp"] == 0 and all(a["timestamp"] <= b["timestamp"] for a, b in zip(lines, lines[1:]))
    prompts = [render_chat(m).encode() for m in chats]
    assert [line["input_length"] for line in lines] == [len(p) for p in prompts]
    assert [line["output_length"] for line in lines] == max_tokens
    assert [len(line["hash_ids"]) for line in lines] == [-(-len(p) // TRACE_BLOCK) for p in prompts]

    def common(a: bytes, b: bytes) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    ids = [line["hash_ids"] for line in lines]
    for i in range(4):
        for j in range(4):
            if i != j:
                shared = common(prompts[i], prompts[j]) // TRACE_BLOCK
                assert ids[i][:shared] == ids[j][:shared]
                assert len(ids[i]) == shared or len(ids[j]) == shared or ids[i][shared] != ids[j][shared]
    assert common(prompts[0], prompts[1]) // TRACE_BLOCK >= 100  # the system prompt's blocks are shared

    requests = load_trace(path)
    assert [(r.input_length, r.output_length) for r in requests] == [(len(p), n) for p, n in zip(prompts, max_tokens)]
    # the replay's prompts share exactly the recorded blocks
    tokens = [r.tokens for r in requests]
    for i in range(4):
        for j in range(i + 1, 4):
            shared = common(prompts[i], prompts[j]) // TRACE_BLOCK * TRACE_BLOCK
            k = next((t for t, (x, y) in enumerate(zip(tokens[i], tokens[j])) if x != y), None)
            assert k == shared or (k is None and shared == min(len(tokens[i]), len(tokens[j])))
    # and `kvbridge replay` takes the file as it is (the README's promise)
    proc = subprocess.run([sys.executable, "-m", "kvbridge", "replay", str(path), "--workers", "2", "--block-size", "16",
                           "--policy", "kv,rr", "--json"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [p["completed"] for p in json.loads(proc.stdout)["policies"]] == [4, 4]


async def test_record_keeps_what_an_engine_served_one_prompt_a_line(tmp_path):
    """An engine's refusal (a 4xx it answered: a prompt over its context, say) and a batch of
    prompts (a line carries one) are not recorded; the answered single prompt is. A 448-token
    prefix shared below Mooncake's 512-token block survives at the engines' block size."""
    from aiohttp import web

    from kvbridge.replay.trace import load_trace
    from kvbridge.routing.record import TraceRecorder

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        if len(body["prompt"]) > 1000:
            return web.json_response({"error": {"message": "over the context", "code": 400}}, status=400)
        return web.json_response({"choices": [{"text": "x"}], "usage": {"completion_tokens": 3}})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    path = tmp_path / "t.jsonl"
    shared = list(range(448))
    try:
        async with KvProxy(None, model="m", port=0, workers={"a": url}, block_size=BS, record=path) as proxy:
            client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="-", max_retries=0)
            await client.completions.create(model="m", prompt=shared + [1, 2], max_tokens=3)
            with pytest.raises(openai.BadRequestError):
                await client.completions.create(model="m", prompt=list(range(2000)), max_tokens=3)
            await client.completions.create(model="m", prompt=[shared + [5], shared + [6]], max_tokens=3)
            await client.completions.create(model="m", prompt=shared + [3, 4, 5], max_tokens=3)
            await client.close()
            skipped = {s.labels["kind"]: s.value for m in proxy.metrics.errors.collect() for s in m.samples
                       if s.name.endswith("_total")}  # fmt: skip
    finally:
        await runner.cleanup()
    assert skipped.get("record_not_answered") == 1 and skipped.get("record_batch") == 1, skipped
    a, b = load_trace(path)
    assert (a.input_length, b.input_length, a.output_length) == (450, 451, 3)
    common = next(i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y)
    assert common == 448  # 28 blocks of 16: all of the shared prefix
    # Mooncake's 512-token blocks would have kept none of it
    rec = TraceRecorder(tmp_path / "m.jsonl", block=512)
    for tokens in (shared + [1, 2], shared + [3, 4, 5]):
        rec.finish(rec.arrive(), tokens, 3)
    rec.close()
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert "hash_block_size" not in lines[0] and lines[0]["hash_ids"] != lines[1]["hash_ids"]


def test_record_appends_on_its_timeline_and_refuses_a_bad_path(tmp_path, capsys):
    from kvbridge.config import ConfigError
    from kvbridge.replay.trace import load_trace
    from kvbridge.routing.record import TraceRecorder, prompt_hash_ids
    from kvbridge.tools.cli import main

    now = [100.0]
    path = tmp_path / "t.jsonl"
    for run in range(2):  # a proxy restarted on the same file continues its timeline
        rec = TraceRecorder(path, clock=lambda: now[0])
        a = rec.arrive()
        now[0] += 0.25
        b = rec.arrive()
        rec.finish(b, list(range(600)), 2)  # ends first: held back until a is written
        assert rec.written == 0
        rec.finish(a, list(range(1100)), 0)
        assert rec.written == 2
        c = rec.arrive()  # still in flight at close: left out
        rec.close()
        assert c == 2
    requests = load_trace(path)
    assert [r.arrival_ms for r in requests] == [0, 250, 250, 500]
    assert [(r.input_length, r.output_length) for r in requests] == [(1100, 1), (600, 2)] * 2
    # 600 tokens: one full block and a partial one; 1100: two full blocks and a partial one
    assert prompt_hash_ids(list(range(600)))[0] == prompt_hash_ids(list(range(1100)))[0]
    assert prompt_hash_ids(list(range(600)))[1] != prompt_hash_ids(list(range(1100)))[1]
    assert prompt_hash_ids([5] * 100) != prompt_hash_ids([5] * 101)

    bad = tmp_path / "no-such-dir" / "trace.jsonl"
    with pytest.raises(ConfigError, match="--record .*no-such-dir.*cannot open it for appending"):
        KvProxy(None, model="m", port=0, workers={"a": "http://127.0.0.1:1"}, record=bad)
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(ConfigError, match="not a trace line"):
        TraceRecorder(tmp_path / "notes.txt")
    assert main(["proxy", "--model", "m", "--worker", "a=http://127.0.0.1:1", "--listen", "127.0.0.1:0",
                 "--record", str(bad)]) == 2  # fmt: skip
    assert "--record" in capsys.readouterr().err


def test_answer_counts_output_tokens():
    from kvbridge.routing.proxy import _Answer

    a = _Answer()  # a stream without usage: the chunks that carried text
    a.read_events(b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
                  b'data: {"choices": [{"delta": {"content": " a"}}]}\n\ndata: {"choices": [{"text": " b"}]}\n\n'
                  b'data: [DONE]\n\n')  # fmt: skip
    assert a.output_tokens == 2
    a.read_events(b'data: {"choices": [], "usage": {"completion_tokens": 9}}\n\n')
    assert a.output_tokens == 9
    b = _Answer()
    b.read_body(b'{"choices": [{"text": "x"}], "usage": {"completion_tokens": 4}}')
    assert b.output_tokens == 4
    c = _Answer()
    c.read_body(b"not json")
    assert c.output_tokens == 0  # recorded as 1


def test_cli_policy_seed_and_engine_model_flags():
    from kvbridge.routing.work import EngineModel
    from kvbridge.tools.cli import _engine_model, build_parser

    parse = build_parser().parse_args
    args = parse(["proxy", "--model", "m"])
    assert (args.policy, args.seed, args.record, _engine_model(args)) == ("kv", None, None, None)
    args = parse(["proxy", "--model", "m", "--policy", "rr", "--seed", "7", "--engine-prefill", "1,0.5,0",
                  "--engine-decode", "2,0,0", "--engine-max-batched-tokens", "2048", "--engine-kv-tokens", "0"])  # fmt: skip
    assert (args.policy, args.seed) == ("rr", 7)
    assert _engine_model(args) == EngineModel(prefill=(1, 0.5, 0), decode=(2, 0, 0), max_num_batched_tokens=2048,
                                              kv_capacity_tokens=None)  # fmt: skip
    for bad in (["--engine-prefill", "1,2"], ["--policy", "dynamo"]):
        with pytest.raises(SystemExit):
            parse(["proxy", "--model", "m", *bad])
    with pytest.raises(ValueError, match="policy"):
        KvProxy(None, model="m", port=0, policy="fastest")  # type: ignore[arg-type]


def test_upstreams_forget_a_worker_the_subscriber_dropped():
    """A learned worker whose reports stop is forgotten ``forget_s`` after its last one while NATS
    is up, also once the subscriber has dropped it from ``loads`` (it expires silent workers);
    kept while NATS is down, and given ``forget_s`` to report again once NATS is back."""
    from kvbridge import LoadReport
    from kvbridge.routing.upstreams import Upstreams

    now = [100.0]
    ups = Upstreams(forget_s=30.0, clock=lambda: now[0])
    report = LoadReport(ts=0.0, kv_cache_usage=0.0, running=0, url="http://127.0.0.1:9/")
    ups.learn({("m", "w1"): (report, 1.0), ("m", "w2"): (report, 1.0), ("other", "w3"): (report, 1.0)}, "m", True)
    assert sorted(ups.all) == ["w1", "w2"]
    now[0] += 20.0
    ups.learn({("m", "w2"): (report, 0.5)}, "m", True)  # w1 dropped by the subscriber (expired)
    assert sorted(ups.all) == ["w1", "w2"]  # 21 s since w1's last report
    now[0] += 15.0
    ups.learn({("m", "w2"): (report, 0.5)}, "m", True)
    assert sorted(ups.all) == ["w2"]  # 36 s: forgotten
    now[0] += 100.0
    ups.learn({}, "m", False)  # NATS down: the last known fleet keeps serving
    assert sorted(ups.all) == ["w2"]
    ups.learn({}, "m", True)  # back: w2 has forget_s to report again
    assert sorted(ups.all) == ["w2"]
    now[0] += 31.0
    ups.learn({}, "m", True)
    assert ups.all == {}
