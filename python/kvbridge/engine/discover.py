"""Relays for many engine ranks: a set kept running in the background, and discovery of the ranks
from a vLLM API server's ``GET /kv_event_sources``.

:class:`RelaySet` runs one :class:`kvbridge.engine.relay.Relay` per engine PUB endpoint on the caller's
asyncio loop. A relay that cannot start (NATS down, the broker refusing) is retried in the
background with a growing pause, so whoever hosts the set -- the vLLM stat logger in
:mod:`kvbridge.vllm`, or ``kvbridge relay --discover`` -- never waits for NATS; failures are
logged (rate-limited) and counted in ``stats``.

:class:`Discovery` polls ``/kv_event_sources`` (vLLM >= 0.33: ``{"<rank>": {KVEventsConfig
fields}}``, each rank's resolved publisher config) and keeps the set equal to what it lists:
ranks that appear get a relay, ranks that go away (or whose endpoint changed, e.g. a restarted
engine on a ``tcp://*:0`` port) lose theirs. vLLM resolves only ``tcp://*:0`` to the node's
address; a fixed ``tcp://*:P`` is listed as is (already offset per rank), so ``*`` is replaced by
the API server's host. Each API server lists only the ranks it manages.
"""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

from kvbridge.config import ENV_PREFIX, Config, ConfigError
from kvbridge.bus.connection import ConnectError
from kvbridge.errors import DiscoveryError
from kvbridge.engine.relay import Relay

__all__ = [
    "Discovery",
    "DiscoveryError",
    "RateLimitedLog",
    "RelaySet",
    "RelaySpec",
    "close_quietly",
    "fetch_json",
    "specs_from_sources",
    "start_retrying",
    "worker_name",
    "worker_template",
]

log = logging.getLogger("kvbridge.discover")

_RETRY_FIRST_S, _RETRY_MAX_S = 0.5, 10.0


def worker_name(template: str, dp_rank: int, ranks: int = 1) -> str:
    """``template`` with ``{dp_rank}`` replaced; without the placeholder, several ranks get a
    ``-dp<rank>`` suffix so that their workers stay distinct."""
    if "{dp_rank}" in template:
        return template.replace("{dp_rank}", str(dp_rank))
    return f"{template}-dp{dp_rank}" if ranks > 1 else template


def worker_template(given: str | None, host: str, env: Any = os.environ) -> str:
    """The template the ranks' worker ids are made from: ``given``, else ``KVBRIDGE_WORKER_ID``,
    else ``<host>-dp{dp_rank}`` (one name per rank, stable across restarts)."""
    return given or env.get(ENV_PREFIX + "WORKER_ID") or f"{host}-dp{{dp_rank}}"


@dataclass(frozen=True)
class RelaySpec:
    """One engine rank to relay: where to connect (already offset for the rank, no ``*``), its
    replay endpoint and topic, and the config (model, worker id, dp rank) to publish with."""

    rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str
    config: Config

    def same_as(self, other: RelaySpec) -> bool:
        return (self.endpoint, self.replay_endpoint, self.topic, self.config) == (
            other.endpoint, other.replay_endpoint, other.topic, other.config,
        )  # fmt: skip


class _Entry:
    __slots__ = ("spec", "relay", "task")

    def __init__(self, spec: RelaySpec) -> None:
        self.spec = spec
        self.relay: Relay | None = None
        self.task: asyncio.Task | None = None


class RelaySet:
    """Relays keyed by engine endpoint (one per rank, never two), on the running loop.

    ``add(spec)`` starts one in the background (False if that endpoint already has one),
    ``sync(specs)`` makes the set equal to ``specs``, ``await remove(endpoint)`` stops one,
    ``await close()`` stops all: each forwards what its engine already sent, then closes.
    ``on_start(endpoint)`` is called on the loop each time a relay has (re)started.
    """

    def __init__(self, logger: logging.Logger | None = None, *, on_start: Callable[[str], None] | None = None) -> None:
        self.log = logger or log
        self.on_start = on_start
        self._entries: dict[str, _Entry] = {}
        self._closed = False
        self.stats = {"started": 0, "start_failures": 0, "stopped": 0, "crashed": 0}

    def __contains__(self, endpoint: str) -> bool:
        return endpoint in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def specs(self) -> dict[str, RelaySpec]:
        return {ep: e.spec for ep, e in self._entries.items()}

    def relay(self, endpoint: str) -> Relay | None:
        """The running relay for ``endpoint`` (None while it is starting or retrying)."""
        entry = self._entries.get(endpoint)
        return entry.relay if entry is not None else None

    def add(self, spec: RelaySpec) -> bool:
        if self._closed or spec.endpoint in self._entries:
            return False
        entry = self._entries[spec.endpoint] = _Entry(spec)
        entry.task = asyncio.get_running_loop().create_task(
            self._keep(entry), name=f"kvbridge-relayset-{spec.config.worker_id}"
        )
        return True

    async def sync(self, specs: list[RelaySpec]) -> None:
        wanted = {s.endpoint: s for s in specs}
        for endpoint, entry in list(self._entries.items()):
            spec = wanted.get(endpoint)
            if spec is None or not spec.same_as(entry.spec):
                await self.remove(endpoint)
        for spec in specs:
            self.add(spec)

    async def remove(self, endpoint: str, quiet_s: float = 0.0) -> None:
        entry = self._entries.pop(endpoint, None)
        if entry is None:
            return
        if quiet_s > 0:
            # A relay still connecting to NATS (the engine may already have sent to its socket)
            # gets the time of one connect attempt to come up, then forwards what it has.
            deadline = time.monotonic() + 2 * entry.spec.config.connect_timeout_s + 1
            while entry.relay is None and not entry.task.done() and time.monotonic() < deadline:  # type: ignore[union-attr]
                await asyncio.sleep(0.02)
            if entry.relay is not None:
                await _until_quiet(entry.relay, quiet_s)
        assert entry.task is not None
        entry.task.cancel()
        await asyncio.gather(entry.task, return_exceptions=True)
        self.stats["stopped"] += 1

    async def close(self, quiet_s: float = 0.0) -> None:
        """Stop every relay. ``quiet_s`` > 0: first let each read until its engine has been quiet
        that long (bounded), so that frames already on their way are forwarded too."""
        self._closed = True
        await asyncio.gather(*(self.remove(ep, quiet_s) for ep in list(self._entries)))

    async def _keep(self, entry: _Entry) -> None:
        """Start the relay, retrying while it cannot; restart it if it crashes; close it when cancelled."""
        spec = entry.spec
        what = f"relay for DP rank {spec.rank} ({spec.endpoint})"
        crashes = RateLimitedLog(self.log)
        pause = _RETRY_FIRST_S
        try:
            while True:
                relay = await start_retrying(
                    lambda: Relay(spec.config, endpoint=spec.endpoint, replay_endpoint=spec.replay_endpoint,
                                  topic=spec.topic),
                    what, self.log, self.stats,
                )  # fmt: skip
                if relay is None:
                    return
                entry.relay = relay
                self.stats["started"] += 1
                if self.on_start is not None:
                    try:
                        self.on_start(spec.endpoint)
                    except Exception:  # the relay runs on whatever a listener does
                        self.log.exception("kvbridge: %s: on_start failed", what)
                try:
                    await relay.wait()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # logged by the relay; a new epoch follows
                    self.stats["crashed"] += 1
                    crashes.warning(what, "kvbridge: %s stopped (%r); restarting (%d crashes so far)", what, exc,
                                    self.stats["crashed"])  # fmt: skip
                else:
                    pause = _RETRY_FIRST_S  # it ran to its end: the next start is not a crash loop
                finally:
                    entry.relay = None
                    await close_quietly(relay, what, self.log)
                await asyncio.sleep(pause)
                pause = min(pause * 2, _RETRY_MAX_S)
        except asyncio.CancelledError:
            pass


class RateLimitedLog:
    """Logs a key's message at most once per ``every_s``: a broker down for hours cannot fill the log."""

    def __init__(self, logger: logging.Logger, every_s: float = _RETRY_MAX_S) -> None:
        self.logger, self.every_s = logger, every_s
        self._last: dict[Any, float] = {}

    def warning(self, key: Any, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self.every_s) >= self.every_s:
            self._last[key] = now
            self.logger.warning(msg, *args)


async def start_retrying(make: Callable[[], Any], what: str, logger: logging.Logger, stats: dict[str, int]) -> Any:
    """``make()`` then ``await .start()``, again after a growing pause while NATS (or the network)
    refuses; None when the configuration cannot work (logged). Counts ``stats["start_failures"]``."""
    pause = _RETRY_FIRST_S
    warn = RateLimitedLog(logger)
    while True:
        try:
            obj = make()
            await obj.start()
            return obj
        except ConfigError as exc:
            stats["start_failures"] += 1
            logger.error("kvbridge: %s cannot start: %s", what, exc)
            return None
        except (ConnectError, OSError, asyncio.TimeoutError) as exc:
            stats["start_failures"] += 1
            warn.warning(what, "kvbridge: %s not started, retrying in the background: %s", what, exc)
        except Exception as exc:  # unforeseen (a JetStream not ready yet, ...): said, and tried again
            stats["start_failures"] += 1
            warn.warning(what, "kvbridge: %s failed to start, retrying in the background: %r", what, exc)
        await asyncio.sleep(pause)
        pause = min(pause * 2, _RETRY_MAX_S)


async def _until_quiet(relay: Relay, quiet_s: float, limit_s: float = 5.0) -> None:
    """Wait until no frame reached ``relay`` for ``quiet_s`` (at most ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    last = relay.stats["frames"]
    while time.monotonic() < deadline:
        await asyncio.sleep(quiet_s)
        now = relay.stats["frames"]
        if now == last:
            return
        last = now


async def close_quietly(obj: Any, what: str, logger: logging.Logger) -> None:
    """``await obj.close()``, to the end even if the caller is cancelled meanwhile; errors logged."""
    try:
        await asyncio.shield(obj.close())
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.warning("kvbridge: closing the %s failed: %r", what, exc)


# --- /kv_event_sources ---------------------------------------------------------------------------


def fetch_json(url: str, timeout: float, api_key: str | None = None) -> Any:
    """GET ``url`` and parse its JSON body (blocking: run it in a thread); with ``api_key``, as
    the bearer of it (a ``vllm serve --api-key`` server guards ``/v1/*``)."""
    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # refused, timed out, cut short
        raise DiscoveryError(f"GET {url}: {exc!r}") from None
    try:
        return json.loads(body)
    except ValueError as exc:
        raise DiscoveryError(f"GET {url}: not JSON ({exc})") from None


def _host_for_zmq(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def specs_from_sources(
    sources: Any, host: str, config: Config, worker: str, *, logger: logging.Logger | None = None
) -> list[RelaySpec]:
    """RelaySpecs for the ranks of a ``/kv_event_sources`` answer: ``*`` becomes ``host``, each
    rank publishes as ``worker`` (``{dp_rank}`` replaced). Ranks whose events are off or whose
    publisher is not ZMQ are left out."""
    logger = logger or log
    if not isinstance(sources, dict):
        raise DiscoveryError(f"/kv_event_sources: expected an object of rank -> config, got {type(sources).__name__}")
    zhost = _host_for_zmq(host)
    specs = []
    for key, src in sources.items():
        try:
            rank = int(key)
            if not isinstance(src, dict) or not isinstance(src.get("endpoint"), str):
                raise ValueError("no endpoint")
        except ValueError as exc:
            logger.warning("kvbridge: /kv_event_sources entry %r skipped: %s", key, exc)
            continue
        if not src.get("enable_kv_cache_events", True) or src.get("publisher", "zmq") != "zmq":
            continue
        replay = src.get("replay_endpoint")
        specs.append(RelaySpec(
            rank=rank,
            endpoint=src["endpoint"].replace("*", zhost),
            replay_endpoint=replay.replace("*", zhost) if isinstance(replay, str) else None,
            topic=str(src.get("topic") or ""),
            config=config.replace(worker_id=worker_name(worker, rank, len(sources)), dp_rank=rank),
        ))  # fmt: skip
    return sorted(specs, key=lambda s: s.rank)


def _node_name(host: str | None) -> str:
    """The node a worker name stands for: ``host``, or this machine's name for a loopback one."""
    if not host or host == "localhost":
        return socket.gethostname()
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return host
    return socket.gethostname() if loopback else host


class Discovery:
    """Follows a vLLM API server's ``/kv_event_sources`` with a :class:`RelaySet`.

    ``url``: the API server, ``http://HOST:PORT``. ``config``: NATS and naming options; its model
    is used unless ``model`` is None and ``config.model`` is the default, in which case the served
    model name is read from ``/v1/models``. ``worker``: the worker id template (``{dp_rank}``
    replaced; default ``KVBRIDGE_WORKER_ID``, else ``<HOST>-dp{dp_rank}``, HOST being this machine's
    hostname when the URL names a loopback address: the name the vLLM plugin gives the same ranks,
    and distinct per node where every node's relay asks its own ``127.0.0.1``). ``api_key``: the
    server's ``--api-key`` (default ``VLLM_API_KEY``, as vLLM reads it), sent as a bearer token:
    vLLM guards ``/v1/models`` with it. Polls every ``interval_s``. Async context manager.

    Every rank listed is taken to run on HOST (``*`` in an endpoint becomes HOST): with data
    parallelism across nodes the API server lists the other nodes' ranks too, and their relays
    would wait on HOST for nothing; relay those with a sidecar on their own node (``kvbridge relay
    --endpoint ... --dp-rank R``) or the vLLM plugin, which relays each rank from its node.
    """

    def __init__(
        self,
        url: str,
        config: Config,
        *,
        model: str | None = None,
        worker: str | None = None,
        interval_s: float = 2.0,
        api_key: str | None = None,
        fetch: Callable[[str, float], Any] = fetch_json,
    ) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"--discover {url!r}: expected http://HOST:PORT of a vLLM API server")
        if interval_s <= 0:
            raise ConfigError(f"discovery interval must be > 0, got {interval_s!r}")
        self.base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        self.host = parts.hostname
        self.config = config if model is None else config.replace(model=model)
        self._model_given = model is not None or config.model != Config.__dataclass_fields__["model"].default
        self.worker = worker_template(worker, _node_name(self.host))
        self.interval_s = interval_s
        self.relays = RelaySet()
        api_key = api_key or os.environ.get("VLLM_API_KEY")
        self._fetch = (lambda u, t: fetch_json(u, t, api_key)) if api_key and fetch is fetch_json else fetch
        self._task: asyncio.Task | None = None
        self.stats = {"polls": 0, "poll_failures": 0}
        self._failing = False
        self._warn = RateLimitedLog(log)  # a server that never says its model: not a line per poll

    @property
    def url(self) -> str:
        return f"{self.base}/kv_event_sources"

    async def start(self) -> Discovery:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvbridge-discover")
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.relays.close()

    async def __aenter__(self) -> Discovery:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _get(self, url: str) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, self._fetch, url, self.interval_s + 5)

    async def _served_model(self) -> None:
        if self._model_given:
            return
        try:
            models = await self._get(f"{self.base}/v1/models")
            name = models["data"][0]["id"]
        except (DiscoveryError, KeyError, IndexError, TypeError) as exc:
            key = "; a server started with --api-key wants it: --api-key or VLLM_API_KEY" if "HTTPError 401" in str(exc) else ""
            self._warn.warning("model", "kvbridge: served model name not read from %s/v1/models (%s%s); using %r "
                               "(--model sets it)", self.base, exc, key, self.config.model)  # fmt: skip
            return
        self.config = self.config.replace(model=name)
        self._model_given = True

    async def _run(self) -> None:
        while True:
            try:
                await self._served_model()
                sources = await self._get(self.url)
                specs = specs_from_sources(sources, self.host, self.config, self.worker)
            except ValueError as exc:  # DiscoveryError, or a ConfigError from an entry it cannot relay
                self.stats["poll_failures"] += 1
                if not self._failing:  # once per outage; the relays keep running meanwhile
                    log.warning("kvbridge: discovery from %s failed, retrying every %.1fs: %s", self.url, self.interval_s, exc)
                self._failing = True
            else:
                if self._failing:
                    log.warning("kvbridge: discovery from %s works again", self.url)
                self._failing = False
                self.stats["polls"] += 1
                before = self.relays.specs
                await self.relays.sync(specs)
                after = self.relays.specs
                if before.keys() != after.keys() or self.stats["polls"] == 1:  # the first answer, even if none
                    log.info("kvbridge: relaying DP ranks %s (%s)", sorted(s.rank for s in after.values()),
                                ", ".join(f"{s.rank}: {s.endpoint}" for s in sorted(after.values(), key=lambda s: s.rank)) or "none")  # fmt: skip
            await asyncio.sleep(self.interval_s)
