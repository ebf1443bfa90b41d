"""Attach kvbridge to a stock vLLM (0.33) with no code: a stat-logger plugin, and ``logger_factory``.

In vLLM 0.33 block events never reach a stat logger: each engine-core process (one per
data-parallel rank) publishes them on its own ZMQ PUB socket (``--kv-events-config``). So the
logger here hosts one :class:`kvbridge.engine.relay.Relay` per engine rank it manages, and publishes the
engines' load from ``record()``.

* **Plugin**: ``pip install kvbridge`` into vLLM's environment registers :class:`KvBridgeStatLogger`
  under the entry-point group ``vllm.stat_logger_plugins`` (name ``kvbridge``; ``VLLM_PLUGINS``
  selects plugins as usual). vLLM's API server builds it once as
  ``KvBridgeStatLogger(vllm_config=..., engine_indexes=[...])``. Settings come from ``KVBRIDGE_*``
  variables (``KVBRIDGE_SERVERS`` at least), since ``--kv-events-config`` rejects extra keys.
* **Code**: ``AsyncLLM.from_engine_args(..., stat_loggers=[logger_factory(servers=[...])])`` or
  ``LLMEngine.from_engine_args(..., stat_loggers=[...])`` (stats logging on); keyword options
  win over ``KVBRIDGE_*``. Both routes in one engine share the relays and the load reports: one
  per rank, never two (the first logger built names them; a second one under another model or
  worker name says so in a warning).

What it does, decided once at construction and said in one log line:

* events off (no ``kv_events_config``, or ``enable_kv_cache_events`` false): nothing at all;
* otherwise every API server publishes a :class:`kvbridge.wire.events.LoadReport` per engine on
  ``<prefix>.load.<model>.<worker>`` at most every ``load_interval_s`` (its ``api_rank`` in it:
  each step's stats reach one API server only; its ``url`` and ``dp_rank`` tell ``kvbridge proxy``
  where to send that worker's requests, see :func:`advertise_url`);
* relays run only with ``publisher: "zmq"`` and only in API-server rank 0 (with
  ``--api-server-count N`` every API server builds its own logger). Each rank's endpoint follows
  vLLM's rule (tcp port + rank, ``*`` is this host). Ranks that cannot be relayed from here
  (engines on other nodes, ``:0`` ports, endpoints the engine connects to) are named in one line
  with the sidecar command that covers them;
* block events found on the stats (``scheduler_stats.kv_cache_events``, engines and forks that put
  a ``KVEventBatch`` there) are published directly, on the rank's worker subject.

Names: model = the served model name (``model=`` / ``KVBRIDGE_MODEL`` win); worker =
``<hostname>-dp<rank>`` unless ``worker_id=`` / ``KVBRIDGE_WORKER_ID`` is given (``{dp_rank}`` in it
is replaced; without it, several ranks get ``-dp<rank>`` appended).

Threading: ``record()`` runs on vLLM's event loop and only stores numbers (a few attribute
writes). Everything else -- relays, NATS connections, load reports -- runs on one daemon thread
with its own event loop, shared by every logger of the process. Nothing raises into vLLM:
failures are logged (rate-limited) and counted in ``logger.stats``. NATS down at start: vLLM starts
and serves, relays and reports retry in the background. At process exit (``atexit``) the relays
forward what the engines already sent, then everything stops.

Logging: lines go to the ``vllm.kvbridge`` logger, because vLLM configures only the ``vllm``
logger (a line elsewhere never shows in ``vllm serve`` output). When vLLM has configured it and the
root logger has no handler, the ``kvbridge`` loggers (relay, publisher) share vLLM's handlers too.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import socket
import sys
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvbridge.config import ENV_PREFIX, Config, ConfigError
from kvbridge.bus.connection import connect
from kvbridge.engine.discover import (
    RateLimitedLog,
    RelaySet,
    RelaySpec,
    close_quietly,
    start_retrying,
    worker_name,
    worker_template,
)
from kvbridge.wire.events import DecodeError, KVEventBatch, LoadReport, decode_batch, encode_load_report
from kvbridge.bus.publisher import KvEventPublisher
from kvbridge.metrics import tally
from kvbridge.engine.relay import RelayView, engine_endpoint
from kvbridge.wire.subjects import CONTENT_TYPES, HDR_CONTENT_TYPE, load_subject

__all__ = ["KvBridgeStatLogger", "Plan", "advertise_url", "logger_factory", "plan", "shutdown"]

log = logging.getLogger("vllm.kvbridge")

try:  # the plugin loader accepts only subclasses of vLLM's own classes
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase as _AggregateBase
    from vllm.v1.metrics.loggers import StatLoggerBase as _StatLoggerBase
except Exception:  # vLLM absent (or not importable): stand-ins with vLLM 0.33's interface

    class _StatLoggerBase(ABC):  # type: ignore[no-redef]
        """Stand-in for ``vllm.v1.metrics.loggers.StatLoggerBase``."""

        @abstractmethod
        def __init__(self, vllm_config: Any, engine_index: int = 0): ...

        @abstractmethod
        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None: ...  # fmt: skip

        @abstractmethod
        def log_engine_initialized(self) -> None: ...

        def log(self) -> None:  # noqa: A003
            pass

        def record_sleep_state(self, is_awake: int, level: int) -> None:
            pass

    class _AggregateBase(_StatLoggerBase):  # type: ignore[no-redef]
        """Stand-in for ``vllm.v1.metrics.loggers.AggregateStatLoggerBase``."""

        @abstractmethod
        def __init__(self, vllm_config: Any, engine_indexes: list[int]): ...

        def record_admission_rejection(self, reason: str) -> None:
            pass


_MAX_PENDING_EVENT_BATCHES = 10_000  # stats-carried batches waiting for NATS; beyond: oldest dropped
_EXIT_QUIET_S = 0.2  # at exit, a relay reads until its engine has been quiet this long


# --- what to do, from vLLM's config (pure: tested without vLLM) ------------------------------------


@dataclass
class _Engine:
    engine_index: int
    dp_rank: int
    worker_id: str
    config: Config  # this rank's: worker_id and dp_rank set


@dataclass
class Plan:
    """What a logger does for ``vllm_config``: built once, said in the log lines."""

    off: str | None = None  # why nothing at all happens
    config: Config | None = None
    api_rank: int = 0
    engines: dict[int, _Engine] = field(default_factory=dict)  # by engine index
    relays: list[RelaySpec] = field(default_factory=list)
    no_relay: str | None = None  # why this process runs no relay at all
    sidecar: list[str] = field(default_factory=list)  # ranks not relayed from here, and how to cover them
    url: str | None = None  # this API server as clients reach it, for a gateway (LoadReport.url)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default) if obj is not None else default


def _served_model(vllm_config: Any) -> str | None:
    mc = _get(vllm_config, "model_config")
    name = _get(mc, "served_model_name") or _get(mc, "model")
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name) if name else None


def _is_bind(endpoint: str) -> bool:
    # vLLM's ZmqEventPublisher._is_bind_endpoint: otherwise the engine connects, as a relay does.
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _port(endpoint: str) -> int | None:
    tail = endpoint.rsplit(":", 1)[-1] if endpoint.startswith("tcp://") else ""
    return int(tail) if tail.isdigit() else None


def advertise_url(environ: Any = None, argv: list[str] | None = None) -> str | None:
    """This API server's base URL for gateways: ``KVBRIDGE_ADVERTISE_URL``, else ``vllm serve``'s
    ``--host``/``--port`` (the API server's address is in its arguments, not in ``VllmConfig``;
    a wildcard or absent host becomes this machine's name, the port defaults to vLLM's 8000);
    None when this is not ``vllm serve``."""
    env = os.environ if environ is None else environ
    given = env.get(ENV_PREFIX + "ADVERTISE_URL")
    if given:
        return str(given).rstrip("/")
    args = sys.argv if argv is None else argv
    if "serve" not in args[1:]:
        return None
    found: dict[str, str] = {}
    for i, arg in enumerate(args):
        for name in ("--host", "--port"):
            if arg == name and i + 1 < len(args):
                found[name] = args[i + 1]
            elif arg.startswith(name + "="):
                found[name] = arg.split("=", 1)[1]
    host = found.get("--host") or ""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{found.get('--port', '8000')}"


def plan(vllm_config: Any, engine_indexes: list[int] | None, options: dict[str, Any], environ: Any = None) -> Plan:
    """Decide, from vLLM's config and the options (keywords over ``KVBRIDGE_*``), what to run."""
    env = os.environ if environ is None else environ
    kv = _get(vllm_config, "kv_events_config")
    if kv is None or not _get(kv, "enable_kv_cache_events", False):
        return Plan(off="KV events are off in vLLM (start it with --kv-events-config "
                        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", ...}')")  # fmt: skip
    pc = _get(vllm_config, "parallel_config")
    api_rank = int(_get(pc, "_api_process_rank", 0) or 0)
    dp_index = int(_get(pc, "data_parallel_index", _get(pc, "data_parallel_rank", 0)) or 0)
    local = max(int(_get(pc, "data_parallel_size_local", 1) or 1), 1)
    indexes = list(engine_indexes) if engine_indexes else [0]

    model_given = "model" in options or ENV_PREFIX + "MODEL" in env
    extra = {} if model_given else {"model": _served_model(vllm_config) or "default"}
    config = Config.from_env(env, **options, **extra)
    template = worker_template(options.get("worker_id"), socket.gethostname(), env)

    p = Plan(config=config, api_rank=api_rank, url=advertise_url(env))
    for idx in indexes:
        # The offline LLMEngine always says engine 0; its rank is the config's data_parallel_index.
        rank = dp_index if indexes == [0] else idx
        worker = worker_name(template, rank, len(indexes))
        p.engines[idx] = _Engine(idx, rank, worker, config.replace(worker_id=worker, dp_rank=rank))

    publisher = _get(kv, "publisher") or "zmq"
    if publisher != "zmq":
        p.no_relay = f"vLLM's KV event publisher is {publisher!r}, not 'zmq': no ZMQ stream to relay"
        return p
    if api_rank != 0:
        p.no_relay = f"this is API server {api_rank}: the relays run in API server 0"
        return p
    endpoint = str(_get(kv, "endpoint", "tcp://*:5557"))
    replay = _get(kv, "replay_endpoint")
    topic = str(_get(kv, "topic", "") or "")
    for e in p.engines.values():
        r = e.dp_rank
        if endpoint.startswith("inproc://"):
            p.sidecar.append(f"dp{r}: {endpoint} is in-process to the engine, out of a relay's reach")
        elif not _is_bind(endpoint):
            p.sidecar.append(f"dp{r}: the engine connects to {endpoint}: give it a bind endpoint (tcp://*:PORT)")
        elif _port(endpoint) == 0 or (replay and _port(replay) == 0):
            # --worker: the names this plugin's load reports use, so that a router joins the two
            p.sidecar.append(f"dp{r}: port 0 is chosen by the engine: run `kvbridge relay --discover "
                             f"http://API_HOST:API_PORT --model {config.model} --worker '{template}' "
                             f"--servers {','.join(config.servers)}` anywhere")  # fmt: skip
        elif not dp_index <= r < dp_index + local:
            cmd = (f"kvbridge relay --endpoint '{endpoint}' "
                   + (f"--replay-endpoint '{replay}' " if replay else "")
                   + f"--topic '{topic}' --dp-rank {r} --model {config.model} --worker {e.worker_id} "
                   + f"--servers {','.join(config.servers)}")  # fmt: skip
            p.sidecar.append(f"dp{r} runs on another node: run `{cmd}` there")
        else:
            p.relays.append(RelaySpec(
                rank=r,
                endpoint=engine_endpoint(endpoint, r),
                replay_endpoint=engine_endpoint(replay, r) if replay else None,
                topic=topic,
                config=e.config,
            ))  # fmt: skip
    return p


# --- the process-wide background thread ------------------------------------------------------------


class _Runtime:
    """One daemon thread with its own event loop, for every kvbridge logger of the process: the
    relays (one per engine endpoint), the NATS connections for load reports, the publishers for
    stats-carried events. Started by the first logger that needs it, stopped at exit."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.relays = RelaySet(log, on_start=self._relay_started)
        # (engine config, DP rank) -> the load subject its reporter publishes on: one reporter per
        # engine rank per process. Keyed by the config object's id (vLLM hands every logger of one
        # engine the same one), which is held so that the id stays its.
        self.claimed: dict[tuple[int, int], tuple[Any, str]] = {}
        # Endpoints a logger has asked a relay for, on its own thread: the loop adds them to
        # ``relays`` later, and a second logger built meanwhile must not count them as its own.
        self.relayed: set[str] = set()
        self.sinks: dict[str, _EventSink] = {}  # by worker events subject
        self.connections: dict[tuple, _LoadConnection] = {}
        self.tasks: set[asyncio.Task] = set()
        self.thread = threading.Thread(target=self._run, name="kvbridge-vllm", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _relay_started(self, endpoint: str) -> None:  # loop
        """Stats-carried events that waited for this rank's relay go out now, not at the next step."""
        for sink in list(self.sinks.values()):
            if sink.relay_endpoint == endpoint and sink.pending:
                sink._drain()

    def call(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the loop (from any thread)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def spawn(self, coro: Any, name: str) -> None:
        """Loop side: a task kept until done, cancelled at close."""
        task = self.loop.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def connection(self, config: Config) -> _LoadConnection:
        """Loop side: the shared NATS connection for ``config``'s servers and credentials."""
        key = (tuple(config.servers), config.user, config.password, config.token, config.creds_file,
               config.nkey_seed_file, config.tls_ca, config.tls_cert, config.tls_key)  # fmt: skip
        conn = self.connections.get(key)
        if conn is None:
            conn = self.connections[key] = _LoadConnection(config)
            self.spawn(conn.run(), "kvbridge-vllm-nats")
        return conn

    async def _shutdown(self) -> None:
        await self.relays.close(quiet_s=_EXIT_QUIET_S)
        await asyncio.gather(*(s.close() for s in self.sinks.values()))
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.connections.values()))

    def close(self, timeout: float = 10.0) -> None:
        if not self.thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(timeout)
        except Exception as exc:  # a timeout included: exit must not hang
            log.warning("kvbridge: shutdown incomplete after %.0fs: %r", timeout, exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.loop.close()


_runtime: _Runtime | None = None
_runtime_lock = threading.Lock()


def _get_runtime() -> _Runtime:
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = _Runtime()
        return _runtime


def shutdown(timeout: float = 10.0) -> None:
    """Stop everything kvbridge runs in this process for vLLM: the relays forward what their
    engines already sent, load reports stop, connections close, the thread ends. Registered with
    ``atexit``; loggers created afterwards start afresh."""
    global _runtime
    with _runtime_lock:
        rt, _runtime = _runtime, None
    if rt is not None:
        rt.close(timeout)


atexit.register(shutdown)


# --- load reports ----------------------------------------------------------------------------------


class _LoadConnection:
    """A NATS connection for load reports, (re)tried in the background; ``nc`` None until it is up."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.nc: Any = None
        self.stats = {"start_failures": 0}

    async def start(self) -> None:
        self.nc = await connect(self.config)

    async def run(self) -> None:
        await start_retrying(lambda: self, "NATS connection for load reports", log, self.stats)

    async def close(self) -> None:
        nc, self.nc = self.nc, None
        if nc is not None:
            try:
                await nc.flush(timeout=1)
            except Exception:
                pass
            await nc.close()


class _Slot:
    """One engine's latest numbers, written by ``record()`` (vLLM's thread), read by the loop.
    Counters only grow here; the loop keeps what it reported, so neither side resets the other's."""

    __slots__ = ("usage", "running", "waiting", "queries", "hits", "records", "engine", "subject",
                 "sink", "sent_queries", "sent_hits", "sent_at", "read_at")  # fmt: skip

    def __init__(self, engine: _Engine, subject: str, sink: _EventSink | None) -> None:
        self.usage = 0.0
        self.running = self.waiting = self.queries = self.hits = self.records = 0
        self.engine, self.subject, self.sink = engine, subject, sink
        self.sent_queries = self.sent_hits = 0
        self.sent_at = self.read_at = time.time()  # read_at: when the gauges were (zeros: at start)


# --- block events carried on the stats --------------------------------------------------------------


class _EventSink:
    """Block events found on ``scheduler_stats``, for one rank: handed over by ``record()`` without
    waiting, converted and published on the loop -- through the rank's relay when it has one (so its
    view, and snapshots, include them), else through a publisher of its own."""

    def __init__(self, rt: _Runtime, engine: _Engine, relay_endpoint: str | None) -> None:
        self.rt, self.engine, self.relay_endpoint = rt, engine, relay_endpoint
        self.pending: deque[Any] = deque()
        self.scheduled = False
        self.publisher: KvEventPublisher | None = None
        self.view = RelayView()
        self.starting = False
        self.stats = {"batches": 0, "dropped": 0, "malformed": 0, "start_failures": 0, "view_unread": 0}

    def put(self, obj: Any) -> None:  # vLLM's thread
        pending = self.pending
        pending.append(obj)
        if len(pending) > _MAX_PENDING_EVENT_BATCHES:
            pending.popleft()
            self.stats["dropped"] += 1
        if not self.scheduled:  # cleared by the loop before it drains: nothing is left behind
            self.scheduled = True
            self.rt.call(self._drain)

    def _target(self) -> tuple[KvEventPublisher, RelayView] | None:
        relay = self.rt.relays.relay(self.relay_endpoint) if self.relay_endpoint else None
        if relay is not None:
            return relay.publisher, relay.view
        if self.relay_endpoint is not None and self.relay_endpoint in self.rt.relays:
            return None  # the relay is (re)starting: wait for it
        if self.publisher is not None:
            return self.publisher, self.view
        if not self.starting:
            self.starting = True
            self.rt.spawn(self._start(), f"kvbridge-vllm-events-{self.engine.worker_id}")
        return None

    async def _start(self) -> None:
        pub = await start_retrying(lambda: KvEventPublisher(self.engine.config), "publisher for stats-carried KV events",
                                   log, self.stats)  # fmt: skip
        if pub is not None:
            pub.attach(self.view)
            self.publisher = pub
            self._drain()

    def _drain(self) -> None:  # loop
        self.scheduled = False
        target = self._target()
        if target is None:
            return  # kept pending until the publisher is up (bounded)
        pub, view = target
        pending = self.pending
        while pending:
            batch = self._convert(pending.popleft())
            if batch is None:
                continue
            with pub.lock:
                try:
                    view.apply(batch.events)
                except ValueError as exc:  # a value nested beyond the view's reader: published, not in the view
                    if (n := tally(self.stats, "view_unread")) is not None:
                        log.warning("kvbridge: stats-carried events published but left out of the relay's view "
                                    "(%d so far): %s", n, exc)  # fmt: skip
                pub.publish_batch(batch)
            self.stats["batches"] += 1

    def _convert(self, obj: Any) -> KVEventBatch | None:
        try:
            if isinstance(obj, KVEventBatch):
                return obj
            if isinstance(obj, (list, tuple)):
                obj = [time.time(), list(obj), self.engine.dp_rank]
            # vLLM's KVEventBatch is wire-identical to ours: its bytes decode to our Structs.
            return decode_batch(msgspec.msgpack.encode(obj))
        except (DecodeError, TypeError, msgspec.EncodeError) as exc:
            if (n := tally(self.stats, "malformed")) is not None:
                log.warning("kvbridge: kv_cache_events on the stats not readable (%d so far): %s", n, exc)
            return None

    async def close(self) -> None:
        if self.publisher is not None:
            self._drain()
            await close_quietly(self.publisher, "publisher for stats-carried KV events", log)


# --- the logger --------------------------------------------------------------------------------------


class KvBridgeStatLogger(_AggregateBase):
    """vLLM stat logger (aggregate: one for all engine indexes): relays each rank's KV events to NATS
    and publishes load reports. See the module documentation. ``options`` are :class:`kvbridge.Config`
    fields and win over ``KVBRIDGE_*``; :func:`logger_factory` binds them for ``stat_loggers=``."""

    _options: dict[str, Any] = {}

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None, **options: Any) -> None:
        self.vllm_config = vllm_config
        self.engine_indexes = list(engine_indexes) if engine_indexes else [0]
        self.stats = {"record_errors": 0, "unknown_engine": 0, "event_batches": 0, "loads_published": 0,
                      "load_failures": 0}  # fmt: skip
        self._slots: dict[int, _Slot | None] = dict.fromkeys(self.engine_indexes)  # None: not reported here
        self._warn = RateLimitedLog(log)
        self.plan = Plan(off="not configured")
        try:
            self.plan = plan(vllm_config, self.engine_indexes, {**self._options, **options})
            self._start()
        except Exception as exc:  # never into vLLM
            self.plan = Plan(off=f"error: {exc}")
            log.error("kvbridge: not attached: %s", exc, exc_info=not isinstance(exc, ConfigError))

    # -- construction ----------------------------------------------------------------------------

    def _start(self) -> None:
        p = self.plan
        if p.off:
            log.info("kvbridge: not attached: %s", p.off)
            return
        assert p.config is not None
        _share_vllm_handlers()
        rt = _get_runtime()
        relay_of = {s.rank: s.endpoint for s in p.relays}
        mine: list[tuple[int, int]] = []
        for idx, e in p.engines.items():
            subject = load_subject(p.config.subject_prefix, p.config.model, e.worker_id)
            claim = (id(self.vllm_config), e.dp_rank)
            if claim in rt.claimed:  # another kvbridge logger of this engine reports this rank
                self._slots[idx] = None
                owner = rt.claimed[claim][1]
                if owner != subject:  # under another name: say which one the stream uses
                    log.warning("kvbridge: DP rank %d is already reported on %s by another kvbridge logger of this "
                                "engine (the plugin and a logger_factory both attached?): not also on %s",
                                e.dp_rank, owner, subject)  # fmt: skip
                continue
            if any(subject == s for _, s in list(rt.claimed.values())):  # (a gone logger may release meanwhile)  # another engine, the same names
                self._slots[idx] = None
                log.warning("kvbridge: another engine of this process already reports on %s (DP rank %d): this "
                            "one is not reported; give it another model or worker name (worker_id=...)",
                            subject, e.dp_rank)  # fmt: skip
                continue
            rt.claimed[claim] = (self.vllm_config, subject)
            mine.append(claim)
            sink = None
            if p.api_rank == 0:
                key = f"{p.config.model}/{e.worker_id}"
                sink = rt.sinks.get(key)
                if sink is None:
                    sink = rt.sinks[key] = _EventSink(rt, e, relay_of.get(e.dp_rank))
            self._slots[idx] = _Slot(e, subject, sink)
        new = [s for s in p.relays if s.endpoint not in rt.relayed]
        for spec in new:
            rt.relayed.add(spec.endpoint)
            rt.call(rt.relays.add, spec)
        # vLLM gives stat loggers no shutdown call: when the engine is gone, so is its logger, and
        # its ranks may be claimed again (a notebook, an RL loop re-creating the engine).
        weakref.finalize(self, _release, rt, [(c, rt.claimed[c]) for c in mine])
        reporting = [s for s in self._slots.values() if s is not None]
        if reporting and p.config.load_interval_s > 0:
            me = weakref.ref(self)  # the task must not keep the logger, and its engine's claim, alive
            rt.call(lambda: rt.spawn(KvBridgeStatLogger._report_loads(me, rt), "kvbridge-vllm-loads"))
        workers = ", ".join(f"dp{e.dp_rank}={e.worker_id}" for e in p.engines.values())
        what = (f"relaying DP ranks {[s.rank for s in p.relays]} "
                f"({', '.join(s.endpoint for s in p.relays)})" if p.relays else f"no relay ({p.no_relay or 'none to run here'})")
        shared = len(p.relays) - len(new)
        every = (f"load reports every {p.config.load_interval_s}s" if reporting and p.config.load_interval_s > 0
                 else "no load reports" + ("" if reporting else " (another kvbridge logger sends them)"))  # fmt: skip
        log.info("kvbridge: attached to model %s (%s), API server %d: %s%s; %s to NATS %s",
                 p.config.model, workers, p.api_rank, what,
                 f" ({shared} already run by another kvbridge logger)" if shared else "",
                 every, ",".join(p.config.servers))  # fmt: skip
        if p.sidecar:
            log.warning("kvbridge: not relayed from this process: %s", "; ".join(p.sidecar))

    # -- vLLM's calls (its event loop thread) --------------------------------------------------------

    def record(
        self,
        scheduler_stats: Any = None,
        iteration_stats: Any = None,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Store this step's numbers for the background thread; never raises, never waits."""
        if scheduler_stats is None:
            return
        try:
            slot = self._slots[engine_idx]
            if slot is None:
                return  # reported by another logger
            s = scheduler_stats
            usage = s.kv_cache_usage
            running = s.num_running_reqs
            waiting = s.num_waiting_reqs + s.num_skipped_waiting_reqs
            pcs = s.prefix_cache_stats
            queries, hits = pcs.queries, pcs.hits
            slot.usage, slot.running, slot.waiting = usage, running, waiting
            slot.queries += queries
            slot.hits += hits
            slot.records += 1
            slot.read_at = time.time()  # another API server's report may hold fresher gauges
            events = getattr(s, "kv_cache_events", None)
            if events:
                self._events(slot, events)
        except Exception as exc:
            self._record_slowly(scheduler_stats, engine_idx, exc)

    def _record_slowly(self, s: Any, engine_idx: Any, exc: Exception) -> None:
        """The fast path failed: an unknown engine, or stats of another shape. Take what is there."""
        try:
            if not (isinstance(engine_idx, int) and engine_idx in self._slots):
                self.stats["unknown_engine"] += 1
                self._warn.warning("engine", "kvbridge: stats for engine index %r, which this logger was not "
                                   "built for (%s): skipped", engine_idx, sorted(self._slots))  # fmt: skip
                return
            slot = self._slots[engine_idx]
            if slot is None:
                return
            self.stats["record_errors"] += 1
            self._warn.warning("record", "kvbridge: scheduler stats not as expected (%r): using the fields present", exc)
            pcs = getattr(s, "prefix_cache_stats", None)
            slot.usage = _number(s, "kv_cache_usage", slot.usage)
            slot.running = _number(s, "num_running_reqs", slot.running)
            slot.waiting = _number(s, "num_waiting_reqs", 0) + _number(s, "num_skipped_waiting_reqs", 0)
            slot.queries += _number(pcs, "queries", 0)
            slot.hits += _number(pcs, "hits", 0)
            slot.records += 1
            slot.read_at = time.time()
            events = getattr(s, "kv_cache_events", None)
            if events:
                self._events(slot, events)
        except Exception as exc2:  # nothing reaches vLLM
            self.stats["record_errors"] += 1
            self._warn.warning("record2", "kvbridge: record() failed: %r", exc2)

    def _events(self, slot: _Slot, events: Any) -> None:
        if slot.sink is None:
            self._warn.warning("events", "kvbridge: kv_cache_events on the stats of API server %d not published: "
                               "only API server 0 publishes them, in order", self.plan.api_rank)  # fmt: skip
            return
        slot.sink.put(events)
        self.stats["event_batches"] += 1

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:  # noqa: A003
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass

    # -- the background thread's side -----------------------------------------------------------------

    @staticmethod
    async def _report_loads(me: weakref.ref[KvBridgeStatLogger], rt: _Runtime) -> None:
        """Reports every ``load_interval_s`` until the logger is gone (its engine with it)."""
        logger = me()
        if logger is None:
            return
        plan, stats, warn = logger.plan, logger.stats, logger._warn
        config = plan.config
        assert config is not None
        slots = [s for s in logger._slots.values() if s is not None]
        del logger
        conn = rt.connection(config)
        headers = {HDR_CONTENT_TYPE: CONTENT_TYPES[config.encoding]}
        while True:
            await asyncio.sleep(config.load_interval_s)
            if me() is None:
                return
            nc = conn.nc
            if nc is None or not nc.is_connected:
                continue  # counters keep growing: the next report covers the outage
            for slot in slots:
                if not slot.records and plan.url is None:
                    continue  # with a URL an idle engine reports too: a gateway must know it to send it work
                now = time.time()
                queries, hits = slot.queries, slot.hits
                e = slot.engine
                try:
                    # Inside the try: record()'s fast path stores the stats' gauges as they come, and
                    # a gauge that is not a number (stats of another shape) must cost this report,
                    # not the task that sends them all.
                    report = LoadReport(
                        ts=now, kv_cache_usage=float(slot.usage), running=int(slot.running), waiting=int(slot.waiting),
                        prefix_cache_queries=queries - slot.sent_queries, prefix_cache_hits=hits - slot.sent_hits,
                        interval_s=now - slot.sent_at, api_rank=plan.api_rank, engine_index=e.engine_index,
                        dp_rank=e.dp_rank, url=plan.url, gauges_ts=slot.read_at,
                    )  # fmt: skip
                    await nc.publish(slot.subject, encode_load_report(report, config.encoding), headers=headers)
                except Exception as exc:
                    stats["load_failures"] += 1
                    warn.warning("load", "kvbridge: load report not published: %r", exc)
                    continue
                slot.sent_queries, slot.sent_hits, slot.sent_at = queries, hits, now
                stats["loads_published"] += 1


def _release(rt: _Runtime, claims: list[tuple[tuple[int, int], Any]]) -> None:
    """A logger is gone: the ranks it claimed are free (unless claimed again since)."""
    for key, entry in claims:
        if rt.claimed.get(key) is entry:
            del rt.claimed[key]


def _number(obj: Any, name: str, default: Any) -> Any:
    value = getattr(obj, name, default)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def logger_factory(**options: Any) -> type[KvBridgeStatLogger]:
    """A stat-logger class for ``stat_loggers=[...]`` (``AsyncLLM`` / ``LLMEngine``), with
    ``options`` (:class:`kvbridge.Config` fields, e.g. ``servers=``, ``model=``, ``worker_id=``)
    bound; they win over ``KVBRIDGE_*``. Checked here: an unknown or malformed option raises
    :class:`kvbridge.ConfigError` in the caller, not later inside vLLM."""
    probe = dict(options)
    if "worker_id" in options:  # a template ({dp_rank}) checked as the rank-0 name it makes
        worker = options["worker_id"]
        if not isinstance(worker, str):
            raise ConfigError(f"kvbridge config worker_id: must be a str (a {{dp_rank}} template allowed), got {worker!r}")
        probe["worker_id"] = worker_name(worker, 0)
    Config.from_env(**probe)
    return type("KvBridgeStatLogger", (KvBridgeStatLogger,), {"_options": dict(options), "__module__": __name__})


def _share_vllm_handlers() -> None:
    """Let the ``kvbridge`` loggers (relay, publisher) show in ``vllm serve`` output: vLLM
    configures only its own logger, and without a root handler their warnings would go nowhere
    useful. Done only when vLLM has configured its logger and nothing else is configured."""
    vllm_logger, ours = logging.getLogger("vllm"), logging.getLogger("kvbridge")
    if vllm_logger.handlers and not ours.handlers and not logging.getLogger().handlers:
        for h in vllm_logger.handlers:
            ours.addHandler(h)
        ours.propagate = False
