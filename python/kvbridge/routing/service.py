"""The index service (``kvbridge index``) and its client.

:class:`IndexService` subscribes to one model's event stream, keeps a :class:`kvbridge.Index` of
every worker's cached blocks, and answers overlap queries on ``<prefix>.query.<model>`` in a NATS
queue group, so any number of replicas share the queries and a router anywhere can ask:

    request  {"tokens": [...]}  or  {"block_hashes": [...]}
             (+ "lora_name", "extra_keys", "medium", "remote", "by_medium")
    reply    {"scores": {worker: leading blocks held}, "workers": N}   or   {"error": "..."}
             with "by_medium": true also "media": {worker: {medium: leading blocks held there}}
             (a medium the engine did not name is ""; IndexClient gives it back as None)

JSON or msgpack, chosen by the request's ``Content-Type`` (JSON when absent, so ``nats req
kv.query.m '{"tokens": [1, 2, 3]}'`` works); the reply uses the request's encoding. A malformed
query gets an error reply naming what was wrong; the service carries on.

:class:`IndexClient` asks from asyncio code, msgpack on the wire, retrying once when no reply comes
in time (a replica that dies with the query in hand costs one timeout, not the answer).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import operator
import time
from typing import Annotated, Any, Literal, Sequence

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from kvbridge._native import Index, unpack_query_ints
from kvbridge.metrics import register, start_exporter
from kvbridge.config import Config, ConfigError
from kvbridge.errors import Error
from kvbridge.bus.connection import connect
from kvbridge.bus.subscriber import KvEventSubscriber
from kvbridge.wire.subjects import CONTENT_TYPES, FORMATS, HDR_CONTENT_TYPE, QUERY_QUEUE_GROUP, query_subject

__all__ = ["IndexClient", "IndexQuery", "IndexQueryError", "IndexService", "IndexUnavailableError"]

log = logging.getLogger("kvbridge.service")

DEFAULT_QUEUE_GROUP = QUERY_QUEUE_GROUP

_U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
# msgspec reads ints up to 2**64-1 and refuses bigger ones itself (no bound above int64 allowed here)
_U64 = Annotated[int, msgspec.Meta(ge=0)]


class IndexQuery(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One overlap query: exactly one of ``tokens`` (token ids, hashed by the index) and
    ``block_hashes`` (the index's keys: engine hashes for ``key="engine"`` indexes)."""

    tokens: list[_U32] | None = None
    block_hashes: list[_U64] | None = None
    lora_name: str | None = None
    #: One entry per block: None or that block's extra keys (multimodal hashes, cache salt).
    extra_keys: list[list[Any] | None] | None = None
    medium: str | None = None
    #: Credit blocks whose events said ``locality="REMOTE"``.
    remote: bool = False
    #: Also answer per storage tier ("media"), for a router that weighs tiers.
    by_medium: bool = False


class IndexQueryError(Error, ValueError):
    """The index service answered a query with an error (the message is the service's)."""


class IndexUnavailableError(Error, TimeoutError):
    """No index service answered, even after the retry."""


# A msgpack query's ints stay msgpack (msgspec.Raw) until unpack_query_ints packs them for the
# index: a 128-block query is then one object, not 128 Python ints (or 2048 for tokens).
_INT_FIELDS = ("tokens", "block_hashes")
_RawIndexQuery = msgspec.defstruct(
    "_RawIndexQuery",
    [
        (f.name, msgspec.Raw, msgspec.Raw()) if f.name in _INT_FIELDS else (f.name, f.type, f.default)
        for f in msgspec.structs.fields(IndexQuery)
    ],
    forbid_unknown_fields=True,
    omit_defaults=True,
)
_decoders: dict[str, Any] = {"json": msgspec.json.Decoder(IndexQuery), "msgpack": msgspec.msgpack.Decoder(_RawIndexQuery)}
_encoders: dict[str, Any] = {"json": msgspec.json.Encoder(), "msgpack": msgspec.msgpack.Encoder()}
_headers = {fmt: {HDR_CONTENT_TYPE: ctype} for fmt, ctype in CONTENT_TYPES.items()}


def _tuples(value: Any) -> Any:
    # JSON and msgpack carry tuples as arrays; the index hashes extra keys as vLLM's tuples.
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def parse_query(payload: bytes, fmt: str) -> IndexQuery:
    """Decode and check a query; ValueError naming what is wrong. From msgpack, ``tokens`` and
    ``block_hashes`` come as memoryviews of packed ints (what ``Index.find_matches`` reads
    without a Python int per item), from JSON as lists."""
    try:
        query = _decoders[fmt].decode(payload)
        if fmt == "msgpack":
            fields = msgspec.structs.asdict(query)
            for name in _INT_FIELDS:
                fields[name] = unpack_query_ints(fields[name], name)
            query = IndexQuery(**fields)
    except msgspec.ValidationError as exc:
        raise ValueError(f"malformed query: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed query: not {fmt}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"malformed query: {exc}") from None
    if (query.tokens is None) == (query.block_hashes is None):
        raise ValueError("malformed query: give exactly one of 'tokens' and 'block_hashes'")
    return query


# Latency histogram bucket bounds (seconds); the last bucket is +Inf.
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _Latency:
    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(_BUCKETS, seconds)] += 1
        self.total += seconds

    def prometheus(self) -> tuple[list[tuple[str, int]], float]:
        cumulative, n = [], 0
        for bound, count in zip((*map(str, _BUCKETS), "+Inf"), self.counts):
            n += count
            cumulative.append((bound, n))
        return cumulative, self.total


def _config(config: Config | None, model: str | None, options: dict[str, Any]) -> Config:
    """``config`` (or one from ``KVBRIDGE_*``), with ``options`` and ``model`` applied."""
    config = Config.resolve(config, **options)
    return config if model is None else config.replace(model=model)


class IndexService:
    """Keeps an index of ``model``'s workers from the event stream and answers overlap queries on
    ``<prefix>.query.<model>`` in queue group ``queue_group``. An async context manager.

    ``index``: the index to keep (default ``kvbridge.Index(block_size, key)``). Connection options
    as for :class:`kvbridge.Config` (``config``, keywords, or ``KVBRIDGE_*``); ``config.model``
    when ``model`` is None. ``stats`` (and Prometheus, role ``index``): queries, errors, latency,
    the index's blocks, workers and memory.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        model: str | None = None,
        index: Any = None,
        block_size: int = 16,
        key: Literal["tokens", "engine"] = "tokens",
        queue_group: str = DEFAULT_QUEUE_GROUP,
        **options: Any,
    ) -> None:
        if not isinstance(queue_group, str) or not queue_group or any(c in queue_group for c in " \t\r\n*>"):
            raise ConfigError(f"queue_group must be a NATS queue name (no spaces or wildcards), got {queue_group!r}")
        config = _config(config, model, options)
        if index is None:
            index = Index(block_size, key)
        self.config = config
        self.model = config.model
        self.index = index
        self.queue_group = queue_group
        self.subject = query_subject(config.subject_prefix, config.model)
        self.subscriber = KvEventSubscriber(config, model=config.model, index=index)
        self.metric_labels = {"subject": self.subject}
        self._nc: Any = None
        self._closed = False
        self._queries = 0
        self._errors = 0
        self._latency = _Latency()
        self._last_warning = 0.0
        self._unlogged = 0
        register("index", self)

    @property
    def stats(self) -> dict[str, Any]:
        index = self.index
        return {
            "queries": self._queries,
            "errors": self._errors,
            "latency": self._latency.prometheus(),
            "blocks": len(index),
            "workers": len(index.workers),
            "memory_bytes": index.memory_bytes,
        }

    async def start(self) -> IndexService:
        if self._closed:
            raise RuntimeError("a closed IndexService cannot be started again: make a new one")
        if self._nc is not None:
            return self
        await self.subscriber.start()
        nc = None
        try:
            nc = await connect(self.config)
            await nc.subscribe(self.subject, queue=self.queue_group, cb=self._on_query)
            await nc.flush()
            if self.config.metrics_port is not None:
                start_exporter(self.config.metrics_port, self.config.metrics_addr)
        except BaseException:  # nothing kept: a second start() tries again
            if nc is not None:
                await nc.close()
            await self.subscriber.close()
            raise
        self._nc = nc
        return self

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._nc is not None:
            await self._nc.close()
        await self.subscriber.close()

    async def __aenter__(self) -> IndexService:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def answer(self, payload: bytes, fmt: str) -> bytes:
        """The reply to one query payload (``fmt`` 'json' or 'msgpack'), errors included."""
        try:
            query = parse_query(payload, fmt)
            extra = None if query.extra_keys is None else [_tuples(k) for k in query.extra_keys]
            args = dict(
                block_hashes=query.block_hashes, lora_name=query.lora_name, extra_keys=extra, remote=query.remote
            )
            scores = self.index.find_matches(query.tokens, medium=query.medium, **args)
            reply: dict[str, Any] = {"scores": scores, "workers": len(self.index.workers)}
            if query.by_medium:
                media = self.index.find_matches(query.tokens, by_medium=True, **args)
                reply["media"] = {w: {m or "": n for m, n in held.items()} for w, held in media.items()}
        except (ValueError, TypeError, OverflowError) as exc:
            self._errors += 1
            self._warn(exc)
            reply = {"error": str(exc)}
        return _encoders[fmt].encode(reply)

    async def _on_query(self, msg: Any) -> None:
        start = time.perf_counter()
        self._queries += 1
        content_type = (msg.headers or {}).get(HDR_CONTENT_TYPE)
        fmt = "json" if content_type is None else FORMATS.get(content_type)
        if fmt is None:
            self._errors += 1
            body = _encoders["json"].encode(
                {"error": f"unknown Content-Type {content_type!r}: use {' or '.join(FORMATS)}"}
            )
            fmt = "json"
        else:
            body = self.answer(msg.data, fmt)
        if not msg.reply:
            self._errors += 1
            self._warn("a query without a reply subject (use request, not publish)")
            return
        try:
            await self._nc.publish(msg.reply, body, headers=_headers[fmt])
        except Exception as exc:  # the connection is closing or down: the client retries
            log.debug("kvbridge index reply on %s failed: %r", msg.reply, exc)
        self._latency.observe(time.perf_counter() - start)

    def _warn(self, what: Any) -> None:
        # Bad queries are the caller's problem: counted always, logged at most every 10 s.
        now = time.monotonic()
        if now - self._last_warning < 10.0:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since the last report)" if self._unlogged else ""
        log.warning("kvbridge index service %s: %s%s", self.subject, what, more)
        self._last_warning, self._unlogged = now, 0


def _check_timeout(timeout: Any) -> None:
    """A timeout given (None: the default) is a number of seconds > 0."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")


def _ints(name: str, values: Any, allow_bytes: bool = False) -> list[Any]:
    """``values`` as a list of Python ints (and bytes digests, where allowed); a clear error naming
    ``name`` and the position of anything else."""
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}") from None
    out: list[Any] = []
    for i, v in enumerate(items):
        if allow_bytes and isinstance(v, (bytes, bytearray)):
            out.append(bytes(v))
            continue
        try:
            out.append(operator.index(v))  # ints and numpy integers; not floats, strs or bools' kin
        except TypeError:
            raise TypeError(f"{name}[{i}] must be an int, got {v!r}") from None
    return out


class IndexClient:
    """Asks an index service for overlap scores. An async context manager.

        async with IndexClient(servers=[...], model="llama-3-8b") as client:
            scores = await client.find_matches(prompt_ids)     # {worker: leading blocks held}

    For routing, ask of ``kvbridge.hit_tokens(prompt_ids, block_size)``, the part of the prompt
    vLLM can hit, as :meth:`kvbridge.Router.choose` does. A query that gets no reply within
    ``timeout`` (default ``config.request_timeout_s``) is sent once more (another replica answers
    it); then :class:`IndexUnavailableError`. An error reply raises :class:`IndexQueryError`.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        model: str | None = None,
        timeout: float | None = None,
        **options: Any,
    ) -> None:
        config = _config(config, model, options)
        _check_timeout(timeout)
        self.config = config
        self.subject = query_subject(config.subject_prefix, config.model)
        self.timeout = float(timeout) if timeout is not None else config.request_timeout_s
        #: retries: queries sent a second time; workers: the service's worker count in the last reply
        self.stats = {"queries": 0, "retries": 0, "failures": 0}
        self.workers: int | None = None
        self._nc: Any = None

    async def start(self) -> IndexClient:
        if self._nc is None:
            self._nc = await connect(self.config)
        return self

    async def close(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None:
            try:
                await nc.close()
            except Exception as exc:  # the broker gone mid-close: the connection is let go anyway
                log.debug("kvbridge: IndexClient close: %r", exc)

    async def __aenter__(self) -> IndexClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def find_matches(
        self,
        tokens: Sequence[int] | None = None,
        *,
        block_hashes: Sequence[int] | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        medium: str | None = None,
        remote: bool = False,
        by_medium: bool = False,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """``{worker: leading blocks of the prompt it holds}`` (workers holding none are absent);
        with ``by_medium=True`` ``{worker: {medium: leading blocks held there}}``, what
        ``Router.choose_scores`` weighs by tier."""
        if self._nc is None:
            raise RuntimeError("IndexClient is not started: use 'async with IndexClient(...)' or await start()")
        if (tokens is None) == (block_hashes is None):
            raise ValueError("give exactly one of tokens and block_hashes")
        _check_timeout(timeout)
        query: dict[str, Any] = {}
        # Plain ints on the wire, whatever the caller holds them in (numpy arrays and scalars too).
        if tokens is not None:
            query["tokens"] = _ints("tokens", tokens)
        else:
            query["block_hashes"] = _ints("block_hashes", block_hashes, allow_bytes=True)
        for name, value in (("lora_name", lora_name), ("extra_keys", extra_keys), ("medium", medium)):
            if value is not None:
                query[name] = value
        if remote:
            query["remote"] = True
        if by_medium:
            query["by_medium"] = True
        payload = _encoders["msgpack"].encode(query)
        reply = await self._request(payload, self.timeout if timeout is None else timeout)
        if "error" in reply:
            raise IndexQueryError(f"index service on {self.subject}: {reply['error']}")
        self.workers = reply.get("workers")
        if by_medium:
            if not isinstance(reply.get("media"), dict):
                raise IndexQueryError(f"index service on {self.subject}: no per-medium answer (an older service?)")
            # the wire's "" for a block without a medium is None again, as Index answers it
            return {w: {m or None: n for m, n in held.items()} for w, held in reply["media"].items()}
        return reply["scores"]

    async def _request(self, payload: bytes, timeout: float) -> dict[str, Any]:
        self.stats["queries"] += 1
        last: Exception | None = None
        for attempt in range(2):
            if attempt:
                self.stats["retries"] += 1
            try:
                msg = await self._nc.request(self.subject, payload, timeout=timeout, headers=_headers["msgpack"])
            except (NatsTimeoutError, asyncio.TimeoutError) as exc:
                last = exc
                continue
            except NoRespondersError as exc:
                # No replica subscribed (e.g. the only one just died): give a restart a moment.
                last = exc
                await asyncio.sleep(min(timeout, 0.25))
                continue
            fmt = FORMATS.get((msg.headers or {}).get(HDR_CONTENT_TYPE, ""), "msgpack")
            try:
                reply = _decoders_any[fmt].decode(msg.data)
            except msgspec.DecodeError as exc:
                raise IndexQueryError(f"index service on {self.subject}: unreadable reply: {exc}") from None
            if not isinstance(reply, dict) or not ("error" in reply or "scores" in reply):
                raise IndexQueryError(f"index service on {self.subject}: unexpected reply {reply!r}")
            return reply
        self.stats["failures"] += 1
        why = "no index service is subscribed" if isinstance(last, NoRespondersError) else f"no reply within {timeout}s"
        raise IndexUnavailableError(f"{why} on {self.subject} (asked twice)")


_decoders_any: dict[str, Any] = {"json": msgspec.json.Decoder(), "msgpack": msgspec.msgpack.Decoder()}
