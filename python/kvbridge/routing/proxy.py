"""``kvbridge proxy``: an OpenAI-compatible gateway that sends each request to the vLLM API server
whose KV cache already holds most of its prompt.

Per request (``POST /v1/completions``, ``POST /v1/chat/completions``):

1. the body is checked (size, JSON, ``model``, ``prompt`` / ``messages``): a 4xx with an
   OpenAI-style error JSON otherwise;
2. the prompt's token ids -- the ones the engine will hash -- come from a local ``tokenizers``
   tokenizer (completions, when one is given) or from an engine's ``POST /tokenize`` (chat: with
   its chat template applied), remembered per prompt in a bounded LRU;
3. :class:`kvbridge.Router` predicts each worker's time to first token: the prompt's tokens it
   does not hold (its cached leading blocks, per storage tier, from an in-process
   :class:`kvbridge.Index` fed from NATS or from an index service) behind the prompt work already
   sent there, from the signals a router has in production: its own decisions, each request's
   first streamed chunk and end, and the workers' load reports (``policy="rr"`` / ``"random"``:
   round robin or a seeded random pick instead, for comparison);
4. the body goes unchanged to the chosen worker's URL (with ``X-data-parallel-rank`` for a DP
   rank), and the answer comes back with the upstream's status and bytes; a stream is passed on
   event by event as it arrives.

Faults: a worker that refuses the connection or answers 5xx before streaming is marked down for
``down_s`` and the request goes once more, to the next-best worker; a stream that breaks ends with
an error event (``data: {"error": ...}``); a client that goes away cancels the upstream request.
While NATS is unreachable the last known workers keep serving, least loaded first (``/health``
and ``kvbridge_proxy_nats_connected`` say so); unreachable at start, the proxy starts all the same
when it was given workers, and connects in the background.

Workers and their URLs come from the load reports of the vLLM plugin (``LoadReport.url`` and
``dp_rank``) and from ``workers=`` (``--worker ID=URL[@RANK]``), which win.

``record=FILE`` appends each routed request to a trace ``kvbridge replay`` reads
(:mod:`kvbridge.routing.record`: arrival, lengths, the prompt's block hashes; no text).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import socket
import time
from os import PathLike
from typing import Any, Literal, Mapping

import aiohttp
import msgspec
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from kvbridge.bus.connection import AuthenticationError, ConnectError
from kvbridge.bus.subscriber import KvEventSubscriber
from kvbridge.config import Config, ConfigError
from kvbridge.routing.record import TraceRecorder
from kvbridge.routing.router import Router, report_loads
from kvbridge.routing.upstreams import ProxyMetrics, Target, TokenCache, Upstreams, parse_worker
from kvbridge.routing.work import EngineModel, hit_tokens

__all__ = ["KvProxy"]

log = logging.getLogger("kvbridge.proxy")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_ROUTES = {COMPLETIONS: "POST", CHAT: "POST", "/v1/models": "GET", "/health": "GET", "/metrics": "GET"}
# Per hop, never forwarded (RFC 9110 7.6.1); Host, lengths and Date/Server are the hop's own too.
_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                  "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length", "date", "server"))  # fmt: skip
# What changes how a chat prompt renders, so belongs to /tokenize's request and the cache key.
_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                    "tools", "documents", "mm_processor_kwargs")  # fmt: skip
_REFRESH_S = 0.25  # how stale the worker table and gauges may be

_json = msgspec.json.Encoder()
#: Routing policies: the time-cost Router, and two blind ones to compare it with.
POLICIES = ("kv", "rr", "random")
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def error_body(status: int, message: str, kind: str | None = None, param: str | None = None) -> bytes:
    """An error as vLLM and OpenAI write it."""
    kind = kind or ("NotFoundError" if status == 404 else "BadRequestError" if status < 500 else "ServiceUnavailableError")
    return _json.encode({"error": {"message": message, "type": kind, "param": param, "code": status}})


def _error(status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(status, message, param=param), headers=headers,
                        content_type="application/json")  # fmt: skip


def _copy_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP}


class _Failed(Exception):
    """The upstream failed before a byte went to the client: the request may go elsewhere.
    ``response``: the upstream's own 5xx answer, returned as it is if no other worker does better."""

    def __init__(self, why: str, response: web.Response | None = None) -> None:
        super().__init__(why)
        self.response = response


class _Answer:
    """What the client got from the chosen worker: whether it was an answer (a 2xx) and the
    completion's tokens (``usage``, else the streamed chunks that carried text), for ``record=``."""

    __slots__ = ("chunks", "ok", "usage")

    def __init__(self) -> None:
        self.chunks = 0
        self.ok = False
        self.usage: int | None = None

    @property
    def output_tokens(self) -> int:
        return self.usage if self.usage is not None else self.chunks

    def read_body(self, data: bytes) -> None:
        """A whole (non-streamed) answer."""
        try:
            body = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return
        self._read(body)
        if self.usage is None and isinstance(body, dict) and body.get("choices"):
            self.chunks = 1

    def read_events(self, data: bytes) -> None:
        """Whole server-sent events of a stream."""
        for event in data.split(b"\n\n"):
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if not payload or payload == b"[DONE]":
                    continue
                try:
                    body = msgspec.json.decode(payload)
                except msgspec.DecodeError:
                    continue
                if self._read(body):
                    self.chunks += 1

    def _read(self, body: Any) -> bool:
        """Takes ``usage``; whether a choice carries generated text."""
        if not isinstance(body, dict):
            return False
        usage = body.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage = usage["completion_tokens"]
        for choice in body.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if choice.get("text") or (isinstance(delta, dict) and any(
                    delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls"))):  # fmt: skip
                return True
        return False


class KvProxy:
    """The gateway (module doc). An async context manager; ``url`` once started.

    ``config``: NATS connection options (``kvbridge.Config``, keywords or ``KVBRIDGE_*``); None runs
    without NATS, on ``workers`` by load alone. ``workers``: ``{id: Target | "URL[@RANK]"}``.
    ``tokenizer``: a ``tokenizers.Tokenizer`` or the path of its JSON file, for completions'
    prompts. ``index_service``: ask ``kvbridge index`` replicas instead of keeping an index here.
    Timeouts: ``connect_timeout_s`` to an upstream, ``read_timeout_s`` between its bytes (a long
    prefill included), ``tokenize_timeout_s`` for ``/tokenize`` and index-service queries.

    ``policy``: ``"kv"`` (the :class:`kvbridge.Router`'s time cost), ``"rr"`` (round robin over
    the live workers) or ``"random"`` (seeded by ``seed``). ``engine``: the engines'
    :class:`kvbridge.routing.work.EngineModel` the router predicts with (default: Dynamo 1.6.1's
    replay model of a vLLM engine). ``overlap_weight``: the weight of the prompt's own uncached
    tokens against the work queued ahead of it. ``record``: a file to append the routed requests
    to, as a trace (:mod:`kvbridge.routing.record`), their prompts' hash ids one per
    ``record_block_size`` tokens (default ``block_size``: the grain the engines can share at)."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        model: str,
        host: str = "127.0.0.1",
        port: int = 8080,
        workers: Mapping[str, Target | str] | None = None,
        block_size: int = 16,
        tokenizer: Any = None,
        index_service: bool = False,
        overlap_weight: float = 1.0,
        max_body_bytes: int = 16 << 20,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        tokenize_timeout_s: float = 5.0,
        down_s: float = 5.0,
        tokenize_cache: int = 4096,
        seed: int | None = None,
        policy: Literal["kv", "rr", "random"] = "kv",
        engine: EngineModel | None = None,
        record: str | PathLike[str] | None = None,
        record_block_size: int | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        static = {w: t if isinstance(t, Target) else parse_worker(f"{w}={t}")[1] for w, t in (workers or {}).items()}
        self.model, self.block_size, self.max_body_bytes = model, block_size, max_body_bytes
        self.config = None if config is None else config.replace(model=model)
        self.upstreams = Upstreams(static, down_s=down_s)
        self.tokens = TokenCache(tokenize_cache)
        self.metrics = ProxyMetrics()
        self.tokenizer = _load_tokenizer(tokenizer)
        self.index: Any = None
        self.index_client: Any = None
        self.subscriber: KvEventSubscriber | None = None
        if self.config is not None:
            if index_service:
                from kvbridge.routing.service import IndexClient

                self.index_client = IndexClient(self.config, timeout=tokenize_timeout_s)
            else:
                from kvbridge._native import Index

                self.index = Index(block_size)
            self.subscriber = KvEventSubscriber(self.config, model=model, index=self.index, track_views=False)
        # Reports stop with NATS: then the router's own accounting of what it sent decides.
        reported = None
        if self.subscriber is not None:
            reported = report_loads(self.subscriber, model=model, live=lambda: self.nats_up)
        self.policy = policy
        self.router = Router(None, block_size=block_size, overlap_weight=overlap_weight, seed=seed, engine=engine,
                             reports=reported)  # fmt: skip
        self._rng = random.Random(seed)  # policy="random"
        self._turn = itertools.count()  # policy="rr"
        self._request_ids = itertools.count()
        self.recorder = None
        if record is not None:
            self.recorder = TraceRecorder(record, block=block_size if record_block_size is None else record_block_size)
        self._timeouts = (connect_timeout_s, read_timeout_s, tokenize_timeout_s)
        # Bound now, so that ``url`` is known (port 0: any free port) before start().
        try:
            self._sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except BaseException:
            if self.recorder is not None:
                self.recorder.close()
            raise
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self._sock.getsockname()[1]}"
        self._session: aiohttp.ClientSession | None = None
        self._connecting: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self._refreshed = -1.0
        self._index_warned = -math.inf
        self._rr = itertools.count()

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> KvProxy:
        connect_s, read_s, _ = self._timeouts
        try:
            if self.subscriber is not None:
                try:
                    await self._connect()
                except ConnectError as exc:
                    # With workers given, NATS down at start is the outage the proxy serves
                    # through anyway; without, or with credentials refused, there is nothing to do.
                    if not self.upstreams.static or isinstance(exc, AuthenticationError):
                        raise
                    log.warning("kvbridge proxy: NATS unreachable (%s): serving the given workers by load alone, "
                                "connecting in the background", exc)  # fmt: skip
                    self._connecting = asyncio.create_task(self._connect_later(), name="kvbridge-proxy-connect")
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                timeout=aiohttp.ClientTimeout(total=None, connect=connect_s, sock_read=read_s),
                auto_decompress=False,  # bytes pass through as the upstream wrote them
                cookie_jar=aiohttp.DummyCookieJar(),  # one client's cookies are not another's
                skip_auto_headers=("Accept-Encoding", "User-Agent"),  # the client's own go through
            )
            app = web.Application(client_max_size=self.max_body_bytes)
            app.router.add_post(COMPLETIONS, self._generate)
            app.router.add_post(CHAT, self._generate)
            app.router.add_get("/v1/models", self._models)
            app.router.add_get("/health", self._health)
            app.router.add_get("/metrics", self._metrics)
            app.router.add_route("*", "/{tail:.*}", self._not_found)
            # handler_cancellation: a client that disconnects cancels its handler, and with it the
            # upstream request (the engine then aborts it, as vLLM does on a disconnect).
            # shutdown_timeout: at close, streams in flight get a few seconds to finish, not 60.
            self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
            await self._runner.setup()
            await web.SockSite(self._runner, self._sock).start()
        except BaseException:
            await self.close()
            raise
        self._refresh(force=True)
        return self

    async def _connect(self) -> None:
        assert self.subscriber is not None
        await self.subscriber.start()  # a no-op once started: a retry redoes only what failed
        if self.index_client is not None:
            await self.index_client.start()

    async def _connect_later(self) -> None:
        assert self.config is not None
        while True:
            await asyncio.sleep(max(self.config.reconnect_wait_s, 0.1))
            try:
                await self._connect()
            except ConnectError as exc:
                log.debug("kvbridge proxy: NATS still unreachable: %s", exc)
                continue
            except ConfigError as exc:  # e.g. a metrics port taken since: retrying will not mend it
                log.error("kvbridge proxy: not connecting to NATS: %s; routing by load alone", exc)
                return
            log.warning("kvbridge proxy: connected to NATS: routing by KV overlap")
            return

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            await asyncio.gather(self._connecting, return_exceptions=True)
            self._connecting = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._sock.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.index_client is not None:
            await self.index_client.close()
        if self.subscriber is not None:
            await self.subscriber.close()
        if self.recorder is not None:
            self.recorder.close()

    async def __aenter__(self) -> KvProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def nats_up(self) -> bool:
        return self.subscriber is not None and self.subscriber.connected_url is not None

    def _refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._refreshed < _REFRESH_S:
            return
        self._refreshed = now
        up = self.nats_up
        if self.subscriber is not None:
            self.upstreams.learn(self.subscriber.loads, self.model, up)
        self.metrics.nats.set(1 if up else 0)
        known = self.upstreams.all
        down = sum(self.upstreams.is_down(w) for w in known)
        self.metrics.workers.labels("up").set(len(known) - down)
        self.metrics.workers.labels("down").set(down)

    # -- the generation endpoints -------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        kind = "chat" if request.path == CHAT else "completions"
        status = "disconnected"
        try:
            response = await self._handle(request, kind)
            status = str(response.status)
            return response
        finally:
            self.metrics.requests.labels(kind, status).inc()

    async def _handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the request body is over {self.max_body_bytes} bytes")
        body, problem = self._check(raw, kind)
        if problem is not None:
            self.metrics.errors.labels("bad_request").inc()
            return problem
        self._refresh()
        recorder = self.recorder
        if recorder is None:
            # Blind policies need no token ids (unless recording).
            tokens = await self._tokens(kind, body) if self.policy == "kv" else None
            return await self._route(request, raw, tokens, _Answer())
        slot = recorder.arrive()
        tokens = None
        answer = _Answer()
        try:
            tokens = await self._tokens(kind, body)
            return await self._route(request, raw, tokens, answer)
        finally:
            # What an engine served, one prompt a line: not an engine's refusal (a prompt over its
            # context, say) nor a batch, whose other prompts the line could not carry.
            why = "record_no_tokens" if not tokens else "record_not_answered" if not answer.ok else (
                "record_batch" if _batch(kind, body) else None)  # fmt: skip
            if tokens and why is None:
                recorder.finish(slot, tokens, answer.output_tokens)
            else:
                recorder.skip(slot)
                self.metrics.errors.labels(why).inc()

    def _check(self, raw: bytes, kind: str) -> tuple[Any, web.Response | None]:
        """The request's JSON body, or the 4xx that answers it."""
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            return None, _error(400, f"the request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return None, _error(400, "the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return None, _error(400, "'model' is required: a string naming the model", "model")
        if model != self.model:
            return None, _error(404, f"The model `{model}` does not exist.", "model")
        field = "messages" if kind == "chat" else "prompt"
        value = body.get(field)
        if not value or not isinstance(value, list if field == "messages" else (list, str)):
            what = "a non-empty list of messages" if field == "messages" else "a string, or a list of them or of token ids"
            return None, _error(400, f"'{field}' is required: {what}", field)
        return body, None

    async def _route(self, request: web.Request, raw: bytes, tokens: list[int] | None,
                     answer: _Answer) -> web.StreamResponse:  # fmt: skip
        candidates = self.upstreams.up()
        if not candidates:
            return _error(503, f"no worker serves {self.model!r} yet: none has sent a load report with its URL "
                          "(vLLM plugin) and none was given (--worker ID=URL)")  # fmt: skip
        kv = self.policy == "kv"
        n_tokens = len(tokens) if tokens else 0
        n_blocks = n_tokens // self.block_size
        # The part of the prompt vLLM can hit (its last token is computed; a hybrid worker's
        # window must hold at that length) is what the index is asked about and what is recorded.
        part = hit_tokens(tokens, self.block_size) if kv and n_blocks else ()
        scores = await self._scores(part) if len(part) else {}
        # Provisional residency (the chosen worker holds the prompt's blocks until its own events
        # say so) while the index is live; with NATS down, the work sent alone decides.
        keys = None
        if len(part) and self.nats_up and self.router.provisional.enabled:
            keys = self.router.block_keys(part)
        failed: list[str] = []
        last: _Failed | None = None
        for attempt in range(2):
            names = [w for w in candidates if w not in failed]
            if not names:
                break
            rid = next(self._request_ids)
            if kv:
                worker, overlap = self.router.choose_scores(scores, n_blocks, workers=names, keys=keys,
                                                            num_tokens=n_tokens, request_id=rid)  # fmt: skip
            else:
                worker, overlap = self._blind_choice(names), 0
            self.metrics.choices.labels(worker).inc()
            if attempt:
                self.metrics.retries.inc()
            elif kv:
                self.metrics.overlap.observe(overlap)
            try:
                return await self._forward(request, raw, worker, candidates[worker], rid if kv else None, answer)
            except _Failed as exc:
                last = exc
                failed.append(worker)
                self.upstreams.mark_down(worker)
                self.metrics.errors.labels("upstream").inc()
                log.warning("kvbridge proxy: worker %s failed before streaming (%s): down for %gs", worker, exc,
                            self.upstreams.down_s)  # fmt: skip
            finally:
                if kv:
                    self.router.done(worker, rid)
        assert last is not None
        if last.response is not None:
            return last.response
        return _error(502, f"no worker could take the request: {last}")

    def _blind_choice(self, names: list[str]) -> str:
        """``policy="rr"``: the next worker in turn; ``"random"``: a seeded uniform pick."""
        names = sorted(names)
        if self.policy == "rr":
            return names[next(self._turn) % len(names)]
        return self._rng.choice(names)

    async def _scores(self, tokens: Any) -> Mapping[str, Any]:
        """Each worker's cached leading blocks of the prompt; nothing while NATS is down (the
        index is going stale) or the index service does not answer: then load decides."""
        if not self.nats_up:
            return {}
        try:
            # Per storage tier: the router weighs a block held in CPU memory or on disk below one
            # on the GPU (Router.medium_weights).
            if self.index_client is not None:
                return await self.index_client.find_matches(tokens, by_medium=True, remote=self.router.remote)
            return self.index.find_matches(tokens, by_medium=True, remote=self.router.remote)
        except Exception as exc:  # IndexUnavailableError, a refused query: route by load alone
            self.metrics.errors.labels("index").inc()
            now = time.monotonic()
            if now - self._index_warned >= 10.0:  # visible, but never a line per request
                self._index_warned = now
                log.warning("kvbridge proxy: no overlap scores, routing by load alone: %r", exc)
            return {}

    async def _forward(self, request: web.Request, raw: bytes, worker: str, target: Target, rid: int | None,
                       answer: _Answer) -> web.StreamResponse:  # fmt: skip
        """Sends the request to ``worker``; tells the router (request ``rid``; None: not routed
        by it) when the first token is out: the first streamed chunk, or the whole answer."""
        assert self._session is not None
        headers = CIMultiDict(_copy_headers(request.headers))  # the rank below replaces a client's, in any case
        if target.dp_rank is not None:
            headers["X-data-parallel-rank"] = str(target.dp_rank)
        start = time.perf_counter()
        try:
            resp = await self._session.post(target.url + request.path, data=raw, headers=headers)
        except _UPSTREAM_ERRORS as exc:
            raise _Failed(f"{target.url}: {exc!r}") from None
        try:
            if resp.content_type == "text/event-stream" and resp.status < 500:
                return await self._stream(request, resp, start, worker, rid, answer)
            data = await resp.read()
        except _UPSTREAM_ERRORS as exc:
            resp.close()
            raise _Failed(f"{target.url}: {exc!r}") from None
        except BaseException:
            resp.close()  # a cancelled client: the upstream connection goes too
            raise
        resp.release()
        self.metrics.ttfb.observe(time.perf_counter() - start)
        if rid is not None:
            self.router.first_token(worker, rid)
        out = web.Response(status=resp.status, body=data, headers=_copy_headers(resp.headers))
        if resp.status >= 500:
            raise _Failed(f"{target.url} answered {resp.status}", out)
        if self.recorder is not None and resp.status < 300:
            answer.ok = True
            answer.read_body(data)
        return out

    async def _stream(self, request: web.Request, resp: aiohttp.ClientResponse, start: float, worker: str,
                      rid: int | None, answer: _Answer) -> web.StreamResponse:  # fmt: skip
        """Pass server-sent events on as they come, whole events only: if the upstream breaks, the
        client's stream ends with an error event rather than half of one."""
        out = web.StreamResponse(status=resp.status, headers=_copy_headers(resp.headers))
        completed = False
        count = self.recorder is not None
        answer.ok = resp.status < 300
        try:
            await out.prepare(request)
            tail = b""
            first = True
            while True:
                try:
                    chunk = await resp.content.readany()
                except _UPSTREAM_ERRORS as exc:
                    self.metrics.errors.labels("upstream_midstream").inc()
                    log.warning("kvbridge proxy: %s broke off a stream: %r", resp.url, exc)
                    await out.write(b"data: " + error_body(502, f"the upstream engine failed mid-stream: {exc!r}",
                                                           "UpstreamError") + b"\n\n")  # fmt: skip
                    break
                if first:
                    self.metrics.ttfb.observe(time.perf_counter() - start)
                    first = False
                    if rid is not None and chunk:
                        self.router.first_token(worker, rid)
                if not chunk:
                    if tail:
                        await out.write(tail)
                    completed = True
                    break
                data = tail + chunk
                cut = data.rfind(b"\n\n") + 2
                if cut == 1:  # no event ends in it yet
                    tail = data
                    continue
                tail = data[cut:]
                if count:
                    answer.read_events(data[:cut])
                await out.write(data[:cut])
            await out.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.errors.labels("client_disconnect").inc()
            raise
        finally:
            if completed:
                resp.release()
            else:
                resp.close()  # the upstream sees the disconnect and aborts the request
        return out

    # -- tokens --------------------------------------------------------------------------------------

    async def _tokens(self, kind: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engine will see them, or None (then load alone decides)."""
        start = time.perf_counter()
        if kind == "chat":
            query = {"model": self.model, "messages": body["messages"]}
            query.update((k, body[k]) for k in _TEMPLATE_FIELDS if k in body)
            key: Any = _json.encode(query)
        else:
            prompt = body["prompt"]
            if isinstance(prompt, list):  # a batch goes where its first prompt is cached
                if all(isinstance(t, int) for t in prompt):
                    return prompt
                prompt = prompt[0]
                if isinstance(prompt, list):
                    return prompt
            if not isinstance(prompt, str):
                return None
            if self.tokenizer is not None:
                tokens = list(self.tokenizer.encode(prompt).ids)
                self.metrics.tokenize.labels("local").observe(time.perf_counter() - start)
                return tokens
            key, query = prompt, {"model": self.model, "prompt": prompt}
        cached = self.tokens.get(key)
        if cached is not None:
            self.metrics.tokenize.labels("cache").observe(time.perf_counter() - start)
            return cached
        fetched = await self._tokenize(query)
        if fetched is not None:
            self.tokens.put(key, fetched)
            self.metrics.tokenize.labels("engine").observe(time.perf_counter() - start)
        return fetched

    async def _tokenize(self, query: dict[str, Any]) -> list[int] | None:
        """Ask an engine's ``/tokenize`` (round-robin over the live API servers; a second one if
        the first fails)."""
        assert self._session is not None
        urls = list(dict.fromkeys(t.url for t in self.upstreams.up().values()))
        if not urls:
            return None
        first = next(self._rr) % len(urls)
        timeout = aiohttp.ClientTimeout(total=self._timeouts[2])
        payload = _json.encode(query)
        for url in (urls[first:] + urls[:first])[:2]:
            try:
                async with self._session.post(url + "/tokenize", data=payload, timeout=timeout,
                                              headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
                    data = await resp.read()
                    if resp.status >= 500:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                if resp.status == 200:
                    tokens = msgspec.json.decode(data).get("tokens")
                    if isinstance(tokens, list):
                        return tokens
                # The engine refused the prompt: the request will get its own answer to that.
                self.metrics.errors.labels("tokenize_refused").inc()
                return None
            except (*_UPSTREAM_ERRORS, msgspec.DecodeError, AttributeError) as exc:
                self.metrics.errors.labels("tokenize").inc()
                log.debug("kvbridge proxy: %s/tokenize failed: %r", url, exc)
        return None

    # -- the other endpoints ------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        """An engine's own model list (vLLM's cards say max_model_len, root...), else one card."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self._timeouts[2])
        for url in list(dict.fromkeys(t.url for t in self.upstreams.up().values()))[:2]:
            try:
                async with self._session.get(url + "/v1/models", timeout=timeout) as resp:
                    if resp.status == 200:
                        return web.Response(body=await resp.read(), content_type="application/json")
            except _UPSTREAM_ERRORS:
                continue
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "kvbridge-proxy", "root": self.model}
        return web.Response(body=_json.encode({"object": "list", "data": [card]}), content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        self._refresh(force=True)
        nats = self.nats_up
        workers = {
            w: {"url": t.url, "dp_rank": t.dp_rank, "down": self.upstreams.is_down(w),
                "source": "static" if w in self.upstreams.static else "load report"}
            for w, t in sorted(self.upstreams.all.items())
        }  # fmt: skip
        if self.subscriber is None:  # run without NATS: a least-loaded balancer by design
            status, state, routing = "ok", "off", "least-loaded"
        elif nats:
            status, state, routing = "ok", "connected", "kv-aware"
        else:
            status, state, routing = "degraded", "down", "least-loaded among the last known workers"
        if self.policy != "kv":
            routing = "round-robin" if self.policy == "rr" else "random"
        body = {"status": "unavailable" if not workers else status, "model": self.model, "nats": state,
                "routing": routing, "workers": workers}  # fmt: skip
        return web.Response(status=503 if not workers else 200, body=_json.encode(body), content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        self._refresh(force=True)
        data = generate_latest(self.metrics.registry) + generate_latest(REGISTRY)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _not_found(self, request: web.Request) -> web.Response:
        allowed = _ROUTES.get(request.path)
        if allowed is not None:
            return _error(405, f"{request.method} is not allowed on {request.path}: use {allowed}", headers={"Allow": allowed})
        return _error(404, f"no such endpoint: {request.method} {request.path} (this gateway serves "
                      f"{', '.join(f'{m} {p}' for p, m in _ROUTES.items())})")  # fmt: skip


def _batch(kind: str, body: Any) -> bool:
    """Whether a completions request carries several prompts (strings, or lists of token ids)."""
    prompt = body.get("prompt") if kind == "completions" and isinstance(body, dict) else None
    return isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt)


def _load_tokenizer(tokenizer: Any) -> Any:
    if tokenizer is None or not isinstance(tokenizer, (str, PathLike)):
        return tokenizer
    tokenizer = str(tokenizer)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError("a local tokenizer needs the 'tokenizers' package: pip install tokenizers") from None
    try:
        return Tokenizer.from_file(tokenizer)
    except Exception as exc:  # tokenizers raises a bare Exception, for a missing file too
        raise ConfigError(f"tokenizer {tokenizer!r}: not a tokenizer.json that tokenizers can load ({exc})") from None
