"""A stand-in for a vLLM API server: the OpenAI-compatible HTTP surface ``kvbridge proxy`` talks
to, over a :class:`KVCacheManager` whose block events go to NATS as a real engine's would.

It serves ``POST /tokenize``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` (with
``"stream": true`` as server-sent events, vLLM's chunk shapes), ``GET /v1/models`` and
``GET /health``, and publishes a :class:`LoadReport` carrying its URL and DP rank, as the vLLM
plugin does. The demo (``kvbridge demo --http``), the proxy's tests and its bench use it.

What is simulated, and how:

* tokens: the prompt's UTF-8 bytes, one id per byte (or ``tokenizer``'s ids, a
  ``tokenizers.Tokenizer``, when given) -- deterministic, so a gateway can predict them;
* chat template: per message ``<|ROLE|>\\nCONTENT\\n``, then ``<|assistant|>\\n`` when
  ``add_generation_prompt`` (the default), e.g. ``<|system|>\\nBe brief.\\n<|user|>\\nHi\\n<|assistant|>\\n``;
  a content given as parts is its text parts joined;
* prefill: ``prefill_s_per_block`` seconds per prompt block not found cached, before the first
  token; decode: ``token_delay_s`` per generated token (``max_tokens``, default 16, words
  ``" w0" " w1"``...). ``usage.prompt_tokens_details.cached_tokens`` says what was cached;
* or, with ``engine=EngineConfig(...)``, the engine model ``kvbridge replay`` simulates
  (:class:`kvbridge.replay.engine.Engine`: vLLM's scheduler, a first-come-first-served queue,
  passes of at most ``max_num_batched_tokens`` prompt tokens, admission only when the whole prompt
  fits in the pool, Dynamo's polynomial pass time divided by ``speedup``), run in real time: a
  pass is scheduled, slept, ended; a prompt's first token streams at the end of the pass that
  completes it, and each later pass streams one more token of each decoding request. Its pool is
  the engine's own, and its KV events are published at the end of each pass. A request the
  client abandons runs on (the model has no abort).

For tests, each response's bytes as sent are kept in ``sent`` (by response id), handlers the
client abandoned are counted in ``cancelled``, ``fail_next`` answers that many requests with a 500,
and :meth:`kill` drops the server as a crash would (listener closed, connections reset).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from typing import TYPE_CHECKING, Any, Sequence

import msgspec
from aiohttp import web

from kvbridge.bus.connection import connect
from kvbridge.bus.publisher import KvEventPublisher
from kvbridge.config import Config
from kvbridge.engine.pool import KVCacheManager
from kvbridge.wire.events import LoadReport, encode_load_report
from kvbridge.wire.subjects import CONTENT_TYPES, HDR_CONTENT_TYPE, load_subject

__all__ = ["StandinEngine", "render_chat"]

if TYPE_CHECKING:
    from kvbridge.replay.engine import EngineConfig

_json = msgspec.json.Encoder()
_KEEP_SENT = 4096


def render_chat(messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
    """The stand-in's chat template (module doc). Raises ValueError for a malformed message."""
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("each message must be an object with a string 'role'")
        content = m.get("content") or ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise ValueError("a message's content must be a string or a list of parts")
        out.append(f"<|{m['role']}|>\n{content}\n")
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    return "".join(out)


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError" if status < 500 else "InternalServerError",
                      "param": None, "code": status}}  # fmt: skip
    return web.Response(status=status, body=_json.encode(body), content_type="application/json")


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_LOCK = _NoLock()


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


class StandinEngine:
    """One stand-in engine (module doc) listening on ``host:port`` (0: any free port).

    ``config``: where to publish block events and load reports (its ``model`` and ``worker_id``
    are replaced by these); None: no NATS at all, an HTTP server only."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        model: str = "standin-model",
        worker_id: str = "standin-0",
        dp_rank: int | None = None,
        block_size: int = 16,
        num_blocks: int = 4096,
        prefill_s_per_block: float = 0.0,
        token_delay_s: float = 0.0,
        tokenizer: Any = None,
        host: str = "127.0.0.1",
        port: int = 0,
        load_interval_s: float = 0.2,
        engine: EngineConfig | None = None,
    ) -> None:
        self.model, self.worker_id, self.dp_rank = model, worker_id, dp_rank
        self.sim: Any = None
        if engine is None:
            self.block_size = block_size
            self.manager: Any = KVCacheManager(num_blocks, block_size)
        else:
            from kvbridge.replay.engine import Engine

            self.block_size = engine.block_size
            self.sim = Engine(0, engine, events=config is not None)
            self.manager = self.sim.pool
        self.prefill_s_per_block, self.token_delay_s = prefill_s_per_block, token_delay_s
        self.tokenizer = tokenizer
        self.load_interval_s = load_interval_s
        self.config = None if config is None else config.replace(model=model, worker_id=worker_id, dp_rank=dp_rank)
        self.publisher = None if self.config is None else KvEventPublisher(self.config)
        if self.publisher is not None:
            self.publisher.attach(self.manager)
        self._sock = socket.create_server((host, port))
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        #: response id -> the exact bytes sent (every SSE chunk, joined), the latest _KEEP_SENT responses
        self.sent: dict[str, bytes] = {}
        self.cancelled = 0
        self.tokenize_calls = 0
        self.requests = 0
        #: prompt tokens of the generation requests, and of those the ones found cached
        self.prompt_tokens = self.cached_tokens = 0
        #: the X-data-parallel-rank header of each generation request (None: absent)
        self.rank_headers: list[str | None] = []
        #: answer this many of the next generation requests with a 500, before any byte of a stream
        self.fail_next = 0
        #: engine= mode: each request's time to first token in the model's time (ms from its
        #: arrival to the end of the pass that made its first token, passes kept on the model's
        #: schedule), free of the HTTP and event-loop delays a client's clock adds
        self.model_ttft_ms: list[float] = []
        self.running = 0
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self._nc: Any = None
        self._reporter: asyncio.Task | None = None
        # engine= mode: the pass loop, woken by new requests; per request (by Seq id) its
        # first-token and finished events; one event per pass for the decoding streams.
        self._looper: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._first: dict[int, asyncio.Event] = {}
        self._finished: dict[int, asyncio.Event] = {}
        self._pass_done = asyncio.Event()
        self._seq_ids = itertools.count()

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> StandinEngine:
        app = web.Application()
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        # handler_cancellation: a client that goes away cancels its handler, as in vLLM (which
        # aborts the request) -- what `cancelled` counts.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        assert self._runner.server is not None
        self._server = await asyncio.get_running_loop().create_server(self._runner.server, sock=self._sock)
        if self.sim is not None:
            self._looper = asyncio.create_task(self._engine_loop(), name=f"kvbridge-standin-engine-{self.worker_id}")
        if self.config is not None:
            assert self.publisher is not None
            await self.publisher.start()
            self._nc = await connect(self.config)
            await self._report()  # known to a gateway from the start, not one interval later
            self._reporter = asyncio.create_task(self._report_loop(), name=f"kvbridge-standin-{self.worker_id}")
        return self

    async def close(self) -> None:
        """Stop serving and publishing (the engine went away cleanly)."""
        await self._stop_background()
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._sock.close()

    async def kill(self) -> None:
        """Go away as a crashed engine does: new connections refused, open ones reset, nothing
        more published (its blocks stay in indexes until the worker times out)."""
        if self._server is not None:
            self._server.close()
        if self._runner is not None and self._runner.server is not None:
            for handler in self._runner.server.connections:
                if handler.transport is not None:
                    handler.transport.abort()
        await self._stop_background()

    async def _stop_background(self) -> None:
        if self._looper is not None:
            self._looper.cancel()
            await asyncio.gather(self._looper, return_exceptions=True)
            self._looper = None
        if self._reporter is not None:
            self._reporter.cancel()
            await asyncio.gather(self._reporter, return_exceptions=True)
            self._reporter = None
        if self._nc is not None:
            await self._nc.close()
            self._nc = None
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None

    async def __aenter__(self) -> StandinEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _report(self) -> None:
        assert self.config is not None
        if self.sim is None:
            running, waiting, usage = self.running, 0, self.manager.pool.usage
        else:  # what vLLM's scheduler stats say
            sim = self.sim
            running, waiting = len(sim.running), len(sim.waiting)
            usage = 1.0 - sim.pool.num_free_blocks / sim.config.num_blocks
        report = LoadReport(ts=time.time(), running=running, waiting=waiting, kv_cache_usage=usage,
                            dp_rank=self.dp_rank, url=self.url)  # fmt: skip
        subject = load_subject(self.config.subject_prefix, self.model, self.worker_id)
        fmt = self.config.encoding
        await self._nc.publish(subject, encode_load_report(report, fmt), headers={HDR_CONTENT_TYPE: CONTENT_TYPES[fmt]})

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.load_interval_s)
            if self._nc.is_connected:
                await self._report()

    # -- HTTP -----------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return list(self.tokenizer.encode(text).ids)
        return list(text.encode())

    def _prompt(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            return self.encode(render_chat(body["messages"], body.get("add_generation_prompt", True)))
        prompt = body["prompt"]
        if isinstance(prompt, list):  # a batch, or token ids: the first prompt stands for the batch
            prompt = prompt[0] if prompt and not isinstance(prompt[0], int) else prompt
        return list(prompt) if isinstance(prompt, list) else self.encode(prompt)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The JSON object sent; anything else is a ValueError (answered 400 by the callers)."""
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:
            raise ValueError(f"invalid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        return body

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.tokenize_calls += 1
        try:
            body = await self._body(request)
            tokens = self._prompt(body, "messages" in body)
        except (KeyError, ValueError, TypeError) as exc:
            return _error(400, f"cannot tokenize: {exc!r}")
        return web.Response(body=_json.encode({"count": len(tokens), "max_model_len": 1 << 20, "tokens": tokens}),
                            content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "kvbridge-standin"}
        return web.json_response({"object": "list", "data": [model]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        self.rank_headers.append(request.headers.get("X-data-parallel-rank"))
        if self.fail_next > 0:
            self.fail_next -= 1
            return _error(500, "stand-in failure (fail_next)")
        chat = request.path.endswith("/chat/completions")
        try:
            body = await self._body(request)
            tokens = self._prompt(body, chat)
        except (KeyError, ValueError, TypeError) as exc:
            return _error(400, f"malformed request: {exc!r}")
        if body.get("model") != self.model:
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self.worker_id}-{next(self._ids)}"
        if self.sim is not None:
            return await self._generate_modelled(request, body, rid, chat, tokens)
        lock = self.publisher.lock if self.publisher is not None else None
        cached = self._allocate(rid, tokens, lock)
        if cached is None:
            return _error(503, "the stand-in's KV cache is full")
        self.prompt_tokens += len(tokens)
        self.cached_tokens += cached
        self.running += 1
        try:
            uncached = -(-len(tokens) // self.block_size) - cached // self.block_size
            if self.prefill_s_per_block:
                await asyncio.sleep(uncached * self.prefill_s_per_block)
            return await self._respond(request, body, rid, chat, len(tokens), cached)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
            self._free(rid, lock)

    # -- engine= mode ---------------------------------------------------------------------------------

    async def _engine_loop(self) -> None:
        """Passes back to back while there is work, each lasting the model's time: its end is
        kept on the ideal schedule (the previous end + its duration), so event-loop delays do not
        add up."""
        sim = self.sim
        lock = self.publisher.lock if self.publisher is not None else None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            end = loop.time()
            while sim.has_work():
                start = max(end, loop.time())
                with lock if lock is not None else _NO_LOCK:
                    end = start + sim.start_pass() / 1000.0
                await asyncio.sleep(max(0.0, end - loop.time()))
                with lock if lock is not None else _NO_LOCK:
                    first, finished = sim.end_pass(end * 1000.0)
                    if self.publisher is not None:
                        self.publisher.step()
                for seq in first:
                    if (ev := self._first.get(seq.id)) is not None:
                        ev.set()
                for seq in finished:
                    if (ev := self._finished.get(seq.id)) is not None:
                        ev.set()
                self._pass_done.set()
                self._pass_done = asyncio.Event()

    async def _generate_modelled(self, request: web.Request, body: dict[str, Any], rid: str, chat: bool,
                                 tokens: list[int]) -> web.StreamResponse:  # fmt: skip
        from kvbridge.replay.engine import Seq
        from kvbridge.replay.trace import Request

        sim = self.sim
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if not tokens or -(-(len(tokens) + n) // self.block_size) > sim.config.num_blocks:
            return _error(400, f"the prompt ({len(tokens)} tokens) and its {n} output tokens do not fit the KV cache")
        seq = Seq(Request(next(self._seq_ids), 0.0, len(tokens), n, tokens, runs=False))
        first, finished = self._first[seq.id], self._finished[seq.id] = asyncio.Event(), asyncio.Event()
        seq.routed_ms = asyncio.get_running_loop().time() * 1000.0  # the engine loop's clock
        sim.enqueue(seq)
        self._wake.set()
        self.running += 1
        try:
            words = [f" w{i}" for i in range(n)]
            head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                    "model": self.model}  # fmt: skip
            if not body.get("stream"):
                await finished.wait()
                self.model_ttft_ms.append(seq.first_token_ms - seq.routed_ms)
                cached = max(seq.cached_first, 0)
                self._count(len(tokens), cached)
                text = "".join(words)
                choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
                data = _json.encode({**head, "choices": [{**choice, "finish_reason": "length"}],
                                     "usage": _usage(len(tokens), n, cached)})  # fmt: skip
                self._record(rid, data)
                return web.Response(body=data, content_type="application/json")
            # vLLM's headers go out at once; its first chunk with the first token.
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            await first.wait()
            self.model_ttft_ms.append(seq.first_token_ms - seq.routed_ms)
            cached = max(seq.cached_first, 0)
            self._count(len(tokens), cached)
            head["object"] = "chat.completion.chunk" if chat else "text_completion"
            sent = 0  # words sent; the first token is word 0
            chunks: list[bytes] = []
            while True:
                pass_done = self._pass_done  # before reading the state: a pass ending meanwhile wakes us
                done = finished.is_set()
                if done:
                    upto = n
                else:  # a decoding request gets a token per pass (seq.base: see Engine)
                    decoding = seq.target > 0 and seq.computed >= seq.target
                    upto = max(sent, 1, min(n - 1, sim.tick - seq.base if decoding else seq.generated))
                while sent < upto:
                    chunks.append(self._chunk(head, chat, words, sent, n))
                    await resp.write(chunks[-1])
                    sent += 1
                self._record(rid, b"".join(chunks))
                if done:
                    break
                await pass_done.wait()
            chunks.append(b"data: " + _json.encode({**head, "choices": [], "usage": _usage(len(tokens), n, cached)})
                          + b"\n\ndata: [DONE]\n\n")  # fmt: skip
            self._record(rid, b"".join(chunks))
            await resp.write(chunks[-1])
            await resp.write_eof()
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
            self._first.pop(seq.id, None)
            self._finished.pop(seq.id, None)

    def _chunk(self, head: dict[str, Any], chat: bool, words: list[str], i: int, n: int) -> bytes:
        """Stream chunk ``i`` (word ``i``; chat's first chunk also names the role)."""
        finish = "length" if i == n - 1 else None
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": words[i]} if i == 0 else {"content": words[i]}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": words[i], "finish_reason": finish}
        return b"data: " + _json.encode({**head, "choices": [choice]}) + b"\n\n"

    def _count(self, prompt: int, cached: int) -> None:
        self.prompt_tokens += prompt
        self.cached_tokens += cached

    def _allocate(self, rid: str, tokens: list[int], lock: Any) -> int | None:
        if lock is None:
            return self.manager.allocate(rid, tokens)
        with lock:
            cached = self.manager.allocate(rid, tokens)
            assert self.publisher is not None
            self.publisher.step()
        return cached

    def _free(self, rid: str, lock: Any) -> None:
        if lock is None:
            self.manager.free(rid)
            return
        with lock:
            self.manager.free(rid)
            if self.publisher is not None:
                self.publisher.step()

    def _record(self, rid: str, data: bytes) -> None:
        self.sent[rid] = data
        if len(self.sent) > _KEEP_SENT:  # a bench sends hundreds of thousands
            del self.sent[next(iter(self.sent))]

    async def _respond(self, request: web.Request, body: dict[str, Any], rid: str, chat: bool, n_prompt: int,
                       cached: int) -> web.StreamResponse:  # fmt: skip
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        words = [f" w{i}" for i in range(n)]
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n,
                 "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model}  # fmt: skip
        if not body.get("stream"):
            if self.token_delay_s:
                await asyncio.sleep(n * self.token_delay_s)
            text = "".join(words)
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            data = _json.encode({**head, "choices": [{**choice, "finish_reason": "length"}], "usage": usage})
            self._record(rid, data)
            return web.Response(body=data, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent: list[bytes] = []
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        for i, word in enumerate(["", *words]):
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if i == 0 else {"content": word}
                choice = {"index": 0, "delta": delta, "finish_reason": "length" if i == n else None}
            else:
                choice = {"index": 0, "text": word, "finish_reason": "length" if i == n else None}
            chunk = b"data: " + _json.encode({**head, "choices": [choice]}) + b"\n\n"
            if i and self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            sent.append(chunk)
            self._record(rid, b"".join(sent))
            await resp.write(chunk)
        last = b"data: " + _json.encode({**head, "choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n"
        sent.append(last)
        self._record(rid, b"".join(sent))
        await resp.write(last)
        await resp.write_eof()
        return resp
