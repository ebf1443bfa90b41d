"""kvbridge.vllm without vLLM: vLLM 0.33-shaped configs and stats (field names from its sources),
real pyzmq publishers in vLLM's framing (vllm_zmq_frames.json) on the ports vLLM's ranks bind,
and a real nats-server.

The entry-point test needs kvbridge installed with its metadata (``make test`` does that:
``maturin develop``); a bare PYTHONPATH checkout has no entry points.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace as NS

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

import kvbridge.engine.vllm as kv_vllm
from bridge_support import nats_connect, stop_process, wait_until
from engine_shapes import PrefixCacheStats, SchedulerStats
from kvbridge import Config, ConfigError, KvEventSubscriber, decode_batch
from kvbridge.engine.discover import Discovery
from kvbridge.wire.events import BlockStored, KVEventBatch, LoadReport, decode_load_report
from kvbridge.wire.subjects import HDR_SEQ, sanitize_token
from test_relay import WAIT, FakeEngine

HOST = sanitize_token(socket.gethostname())


# --- vLLM 0.33-shaped objects (vllm/config/*.py, vllm/v1/metrics/stats.py) ---------------------------


def vllm_config(port=5557, replay=5567, *, enabled=True, publisher="zmq", topic="kv", api_rank=0, dp_size=2,
                dp_local=None, dp_index=0, model="meta-llama/Llama-3.1-8B-Instruct", served="llama-3-8b"):  # fmt: skip
    kv = NS(enable_kv_cache_events=enabled, publisher=publisher, endpoint=f"tcp://*:{port}",
            replay_endpoint=None if replay is None else f"tcp://*:{replay}", buffer_steps=10_000, hwm=100_000,
            max_queue_size=100_000, topic=topic)  # fmt: skip
    pc = NS(data_parallel_size=dp_size, data_parallel_size_local=dp_size if dp_local is None else dp_local,
            data_parallel_rank=dp_index, data_parallel_index=dp_index, data_parallel_rank_local=None,
            _api_process_count=max(1, api_rank + 1), _api_process_rank=api_rank)  # fmt: skip
    return NS(kv_events_config=kv, parallel_config=pc, model_config=NS(model=model, served_model_name=served))


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for k in list(os.environ):
        if k.startswith("KVBRIDGE_"):
            monkeypatch.delenv(k)
    yield
    kv_vllm.shutdown()


def kvbridge_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vllm.kvbridge"]


# --- engines at vLLM's ports ---------------------------------------------------------------------------


class RankEngine(FakeEngine):
    """test_relay's FakeEngine (vLLM's ZmqEventPublisher on the wire) at fixed ports, as vLLM's
    rank r binds ``tcp://*:P+r`` (here on 127.0.0.1 only)."""

    def __init__(self, pub: zmq.asyncio.Socket, router: zmq.asyncio.Socket) -> None:
        self.pub, self.router = pub, router
        self.port = int(pub.last_endpoint.decode().rsplit(":", 1)[1])
        self.replay_port = int(router.last_endpoint.decode().rsplit(":", 1)[1])
        self.replay_topic = True
        self.held, self.replay_requests = [], []
        self._server = asyncio.ensure_future(self._serve())


def bind_consecutive(ctx: zmq.asyncio.Context, kind: int, n: int) -> list[zmq.asyncio.Socket]:
    """``n`` sockets on consecutive free ports of 127.0.0.1."""
    for _ in range(200):
        base = random.randrange(20000, 60000)
        socks = []
        try:
            for i in range(n):
                s = ctx.socket(kind)
                s.linger = 0
                socks.append(s)
                s.bind(f"tcp://127.0.0.1:{base + i}")
            return socks
        except zmq.ZMQError:
            for s in socks:
                s.close(0)
    raise RuntimeError("no consecutive free ports")


@pytest_asyncio.fixture(loop_scope="function")
async def rank_engines():
    ctx = zmq.asyncio.Context()
    engines: list[RankEngine] = []

    def make(n: int) -> list[RankEngine]:
        pubs = bind_consecutive(ctx, zmq.XPUB, n)
        routers = bind_consecutive(ctx, zmq.ROUTER, n)
        engines.extend(RankEngine(p, r) for p, r in zip(pubs, routers))
        return engines[-n:]

    yield make
    for e in engines:
        await e.aclose()
    ctx.term()


@pytest.fixture(scope="module")
def frames(load_vectors):
    v = load_vectors("vllm_zmq_frames.json")
    return [(f["topic"].encode(), f["seq"], bytes.fromhex(f["payload_hex"])) for f in v["frames"]]


# --- importing --------------------------------------------------------------------------------------


def run_python(code: str, path: list[str], **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in sys.path if p])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=120, **kw)  # fmt: skip


def fake_vllm(tmp_path) -> str:
    """A stand-in vLLM package with 0.33's two logger base classes (vllm/v1/metrics/loggers.py)."""
    pkg = tmp_path / "vllm" / "v1" / "metrics"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "v1", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "loggers.py").write_text(textwrap.dedent("""
        from abc import ABC, abstractmethod
        class StatLoggerBase(ABC):
            @abstractmethod
            def __init__(self, vllm_config, engine_index=0): ...
            @abstractmethod
            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0): ...
            @abstractmethod
            def log_engine_initialized(self): ...
        class AggregateStatLoggerBase(StatLoggerBase):
            @abstractmethod
            def __init__(self, vllm_config, engine_indexes): ...
    """))
    return str(tmp_path)


def test_import_kvbridge_never_imports_vllm(tmp_path):
    path = fake_vllm(tmp_path)  # importable, so only not importing it keeps it out
    proc = run_python("""
        import sys, kvbridge, kvbridge.tools.cli, kvbridge.engine.discover, kvbridge.engine.relay, kvbridge.bus.subscriber
        import kvbridge.wire.events, kvbridge.routing.router, kvbridge.tools.server
        print(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")))
    """, [path])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_with_vllm_present_the_loggers_are_vllms_subclasses(tmp_path):
    proc = run_python("""
        from vllm.v1.metrics.loggers import AggregateStatLoggerBase, StatLoggerBase
        from kvbridge.vllm import KvBridgeStatLogger, logger_factory  # the stable path users type
        cls = logger_factory(servers=["nats://127.0.0.1:1"])
        # vLLM's load_stat_logger_plugin_factories and StatLoggerManager checks
        print(issubclass(KvBridgeStatLogger, StatLoggerBase), issubclass(KvBridgeStatLogger, AggregateStatLoggerBase),
              isinstance(cls, type) and issubclass(cls, AggregateStatLoggerBase))
    """, [fake_vllm(tmp_path)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "True"]


def test_without_vllm_the_stand_in_has_vllms_interface():
    base = kv_vllm._AggregateBase
    assert base.__module__ == "kvbridge.engine.vllm"  # vLLM is not installed here
    assert {"record", "log_engine_initialized", "log", "record_sleep_state", "record_admission_rejection"} <= set(dir(base))
    with pytest.raises(TypeError):
        base(vllm_config=None, engine_indexes=[0])  # abstract, as vLLM's


# --- the plan, from vLLM's config -------------------------------------------------------------------


def test_plan_follows_vllms_rank_offsets_names_and_nodes():
    p = kv_vllm.plan(vllm_config(6000, 6100, dp_size=4, dp_local=2), [0, 1, 2, 3], {"servers": ["nats://127.0.0.1:1"]}, {})
    assert p.off is None and p.no_relay is None and p.config.model == "llama-3-8b"
    assert [(s.rank, s.endpoint, s.replay_endpoint, s.topic) for s in p.relays] == [
        (0, "tcp://127.0.0.1:6000", "tcp://127.0.0.1:6100", "kv"), (1, "tcp://127.0.0.1:6001", "tcp://127.0.0.1:6101", "kv"),
    ]  # fmt: skip
    assert [s.config.worker_id for s in p.relays] == [f"{HOST}-dp0", f"{HOST}-dp1"]
    assert [s.config.dp_rank for s in p.relays] == [0, 1]
    assert len(p.sidecar) == 2 and all("another node" in s for s in p.sidecar)  # ranks 2, 3
    assert "--dp-rank 2" in p.sidecar[0] and f"--worker {HOST}-dp2" in p.sidecar[0]
    assert "--endpoint 'tcp://*:6000'" in p.sidecar[0] and "--servers nats://127.0.0.1:1" in p.sidecar[0]


def test_plan_names_and_options():
    env = {"KVBRIDGE_WORKER_ID": "gpu-{dp_rank}", "KVBRIDGE_MODEL": "from-env", "KVBRIDGE_SUBJECT_PREFIX": "env"}
    p = kv_vllm.plan(vllm_config(), [0, 1], {"subject_prefix": "kw"}, env)
    assert p.config.model == "from-env" and p.config.subject_prefix == "kw"  # keywords over KVBRIDGE_*
    assert [e.worker_id for e in p.engines.values()] == ["gpu-0", "gpu-1"]
    p = kv_vllm.plan(vllm_config(), [0, 1], {"worker_id": "node7"}, {})
    assert [e.worker_id for e in p.engines.values()] == ["node7-dp0", "node7-dp1"]  # kept distinct
    # The offline LLMEngine says engine 0; the rank is data_parallel_index, and so is the port offset.
    p = kv_vllm.plan(vllm_config(7000, None, dp_index=3, dp_local=1, served=["a", "b"]), None, {}, {})
    assert [(s.rank, s.endpoint, s.replay_endpoint) for s in p.relays] == [(3, "tcp://127.0.0.1:7003", None)]
    assert p.config.model == "a" and p.engines[0].dp_rank == 3


@pytest.mark.parametrize("endpoint, why", [("tcp://*:0", "--discover"), ("tcp://10.1.2.3:5557", "connects"),
                                           ("inproc://kv", "in-process")])  # fmt: skip
def test_plan_names_what_a_relay_here_cannot_reach(endpoint, why):
    cfg = vllm_config()
    cfg.kv_events_config.endpoint = endpoint
    p = kv_vllm.plan(cfg, [0, 1], {}, {})
    assert p.relays == [] and len(p.sidecar) == 2 and all(why in s for s in p.sidecar)
    if why == "--discover":  # the relays it asks for name workers as this plugin's load reports do
        assert f"--worker '{HOST}-dp{{dp_rank}}'" in p.sidecar[0]


# --- the plugin, as vLLM loads it ---------------------------------------------------------------------


async def test_plugin_from_its_entry_point_relays_two_ranks(monkeypatch, nats_server, rank_engines, nats_sub, frames):  # noqa: F811
    eps = importlib.metadata.entry_points(group="vllm.stat_logger_plugins")
    ep = {e.name: e for e in eps}.get("kvbridge")
    assert ep is not None, "kvbridge's vllm.stat_logger_plugins entry point (install the package: make test)"
    cls = ep.load()
    e0, e1 = rank_engines(2)
    monkeypatch.setenv("KVBRIDGE_SERVERS", nats_server.url)
    monkeypatch.setenv("KVBRIDGE_HEARTBEAT_S", "0")  # only the engine's batches on the subjects
    cols = [await nats_sub(f"kv.events.plug-m.{HOST}-dp{r}") for r in (0, 1)]
    # vLLM's StatLoggerManager: an AggregateStatLoggerBase subclass, once, with keywords.
    logger = cls(vllm_config=vllm_config(e0.port, e0.replay_port, served="plug-m"), engine_indexes=[0, 1])
    assert [s.endpoint for s in logger.plan.relays] == [f"tcp://127.0.0.1:{e.port}" for e in (e0, e1)]
    assert await e0.wait_subscribed() == b"kv" and await e1.wait_subscribed() == b"kv"
    for f in frames:
        await e0.send(*f)
        await e1.send(*f, drop=f[1] in (2, 3))  # lost at the PUB: the relay asks the engine's replay
    await wait_until(lambda: all(len(c.msgs) == len(frames) for c in cols), WAIT, "both ranks on NATS")
    for c in cols:
        assert [m.data for m in c.msgs] == [p for _, _, p in frames]  # byte-identical
        assert c.seqs() == list(range(len(frames)))
    assert e0.replay_requests == [] and e1.replay_requests == [2]


@pytest.mark.parametrize("case", ["api-rank-1", "events-disabled", "publisher-null", "no-kv-events-config"])
async def test_no_relay_and_one_line_saying_why(case, caplog, nats_server):
    caplog.set_level(logging.INFO)
    cfg = vllm_config(api_rank=1 if case == "api-rank-1" else 0, enabled=case != "events-disabled",
                      publisher="null" if case == "publisher-null" else "zmq")  # fmt: skip
    if case == "no-kv-events-config":
        cfg.kv_events_config = None
    logger = kv_vllm.logger_factory(servers=[nats_server.url])(vllm_config=cfg, engine_indexes=[0, 1])
    assert logger.plan.relays == []
    rt = kv_vllm._runtime
    assert rt is None or len(rt.relays) == 0
    lines = kvbridge_lines(caplog)
    assert len(lines) == 1, lines
    expected = {"api-rank-1": "API server 1", "events-disabled": "KV events are off",
                "publisher-null": "'null'", "no-kv-events-config": "KV events are off"}[case]  # fmt: skip
    assert expected in lines[0]


# --- record() and load reports ----------------------------------------------------------------------------


class LoadCollector:
    def __init__(self) -> None:
        self.reports: list[tuple[str, LoadReport]] = []

    async def on_msg(self, msg) -> None:
        self.reports.append((msg.subject, decode_load_report(msg.data)))

    def total(self, worker: str, name: str) -> int:
        return sum(getattr(r, name) for s, r in self.reports if s.endswith("." + worker))


async def test_record_both_call_forms_publish_load_reports_the_subscriber_exposes(nats_server):
    # Events on, but no ZMQ stream to relay: load reports only.
    cfg = vllm_config(publisher="null", served="load-m")
    logger = kv_vllm.logger_factory(servers=[nats_server.url], load_interval_s=0.1)(vllm_config=cfg, engine_indexes=[0, 1])
    nc = await nats_connect(nats_server.url)
    col = LoadCollector()
    await nc.subscribe("kv.load.load-m.*", cb=col.on_msg)
    try:
        async with KvEventSubscriber(servers=[nats_server.url], model="load-m") as sub:
            s0 = SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, num_skipped_waiting_reqs=1, kv_cache_usage=0.25,
                                prefix_cache_stats=PrefixCacheStats(requests=1, queries=100, hits=40))  # fmt: skip
            s1 = SchedulerStats(num_running_reqs=1, kv_cache_usage=0.5,
                                prefix_cache_stats=PrefixCacheStats(requests=1, queries=32, hits=16))  # fmt: skip
            recorded_at = time.time()
            logger.record(s0, None, mm_cache_stats=None, engine_idx=0)  # the manager's form
            logger.record(scheduler_stats=s1, iteration_stats=None, mm_cache_stats=None, engine_idx=1)  # keywords
            logger.record(s0, None, engine_idx=0)
            w0, w1 = f"{HOST}-dp0", f"{HOST}-dp1"
            await wait_until(lambda: col.total(w0, "prefix_cache_queries") == 200 and col.total(w1, "prefix_cache_hits") == 16,
                             WAIT, "the counters on NATS")  # fmt: skip
            await wait_until(lambda: {("load-m", w0), ("load-m", w1)} <= sub.loads.keys(), WAIT, "the subscriber's loads")
            r0, age = sub.loads[("load-m", w0)]
            assert (r0.kv_cache_usage, r0.running, r0.waiting, r0.dp_rank, r0.engine_index, r0.api_rank) == (0.25, 3, 3, 0, 0, 0)
            assert 0 <= age < WAIT
            r1, _ = sub.loads[("load-m", w1)]
            assert (r1.kv_cache_usage, r1.running, r1.waiting, r1.dp_rank) == (0.5, 1, 0, 1)
    finally:
        await nc.close()
    assert col.total(w0, "prefix_cache_hits") == 80 and col.total(w1, "prefix_cache_queries") == 32
    # The gauges say when they were read: at the steps, before the reports that carry them.
    last = [r for s, r in col.reports if s.endswith("." + w0)][-1]
    assert recorded_at <= last.gauges_ts <= last.ts, (recorded_at, last)
    assert logger.stats["record_errors"] == 0 and logger.stats["loads_published"] >= 2


async def test_a_gauge_that_is_not_a_number_costs_a_report_not_the_reports(nats_server):
    """record()'s fast path stores the gauges as they come; a kv_cache_usage of None (stats of
    another shape) made the report task die, and no report went out again."""
    cfg = vllm_config(publisher="null", served="gauge-m")
    logger = kv_vllm.logger_factory(servers=[nats_server.url], load_interval_s=0.05)(vllm_config=cfg, engine_indexes=[0])
    nc = await nats_connect(nats_server.url)
    col = LoadCollector()
    await nc.subscribe("kv.load.gauge-m.*", cb=col.on_msg)
    try:
        logger.record(SchedulerStats(num_running_reqs=1, kv_cache_usage=None), None, engine_idx=0)
        await wait_until(lambda: logger.stats["load_failures"] >= 1, WAIT, "the bad report counted")
        logger.record(SchedulerStats(num_running_reqs=4, kv_cache_usage=0.5), None, engine_idx=0)
        await wait_until(lambda: any(r.running == 4 for _, r in col.reports), WAIT, "reports going out again")
    finally:
        await nc.close()
    assert all(r.kv_cache_usage == 0.5 for _, r in col.reports)  # none with the bad gauge


async def test_subscriber_adds_counters_across_api_servers(nats_server):
    async with KvEventSubscriber(servers=[nats_server.url], model="multi") as sub:
        nc = await nats_connect(nats_server.url)
        try:
            from kvbridge.wire.events import encode_load_report

            for api, (usage, q) in enumerate([(0.1, 10), (0.3, 5)]):
                r = LoadReport(ts=1.0 + api, kv_cache_usage=usage, prefix_cache_queries=q, interval_s=60, api_rank=api)
                await nc.publish("kv.load.multi.w", encode_load_report(r))
                await nc.flush()
                await wait_until(lambda: ("multi", "w") in sub.loads and sub.loads[("multi", "w")][0].api_rank == api,
                                 WAIT, "the report")  # fmt: skip
            await nc.publish("kv.load.multi.w", b"\xc1 garbage")
            await nc.flush()
            await wait_until(lambda: sub.stats["malformed"] == 1, WAIT, "the malformed report counted")
        finally:
            await nc.close()
        merged, _ = sub.loads[("multi", "w")]
        assert merged.kv_cache_usage == 0.3 and merged.prefix_cache_queries == 15  # newest gauge, summed counters


async def test_stats_carrying_kv_cache_events_are_published(nats_server, nats_sub, frames):  # noqa: F811
    col = await nats_sub(f"kv.events.ev-m.{HOST}-dp0")
    cfg = vllm_config(publisher="null", served="ev-m", dp_size=1)
    logger = kv_vllm.logger_factory(servers=[nats_server.url], heartbeat_s=0)(vllm_config=cfg, engine_indexes=[0])
    for _, _, payload in frames:
        stats = SchedulerStats()
        stats.kv_cache_events = decode_batch(payload)  # a KVEventBatch on the stats, as the original proposal
        logger.record(stats, None, engine_idx=0)
    await wait_until(lambda: len(col.msgs) == len(frames), WAIT, "the stats' events on NATS")
    assert [m.data for m in col.msgs] == [p for _, _, p in frames]
    assert logger.stats["event_batches"] == len(frames)


async def test_stats_carried_events_waiting_for_the_relay_go_out_when_it_starts(own_nats_server, rank_engines, frames):
    # NATS is down when the engine starts: the rank's relay keeps retrying, and the events vLLM
    # put on the stats wait for it. They go out when it starts, not at the engine's next step.
    server = own_nats_server
    await asyncio.to_thread(server.kill)
    (e0,) = rank_engines(1)
    cfg = vllm_config(e0.port, e0.replay_port, served="late-m", dp_size=1)
    logger = kv_vllm.logger_factory(servers=[server.url], heartbeat_s=0)(vllm_config=cfg, engine_indexes=[0])
    rt = kv_vllm._runtime
    (spec,) = logger.plan.relays
    stats = SchedulerStats()
    stats.kv_cache_events = decode_batch(frames[0][2])
    logger.record(stats, None, engine_idx=0)
    sink = rt.sinks[f"late-m/{HOST}-dp0"]
    await wait_until(lambda: not sink.scheduled, WAIT, "the sink's first drain")
    assert rt.relays.relay(spec.endpoint) is None and len(sink.pending) == 1  # the fault: no relay yet
    await asyncio.to_thread(server.start)  # same port
    await wait_until(lambda: rt.relays.relay(spec.endpoint) is not None, 60, "the relay, once NATS is up")
    await wait_until(lambda: sink.stats["batches"] == 1, WAIT, "the waiting events published")
    assert not sink.pending


async def test_stats_carried_events_the_view_cannot_read_are_still_published(nats_server, nats_sub):
    # An extra key nested 40 deep: decodable, beyond the native view's reader (32 levels).
    deep: tuple = ("x",)
    for _ in range(40):
        deep = (deep,)
    col = await nats_sub(f"kv.events.ev-deep.{HOST}-dp0")
    cfg = vllm_config(publisher="null", served="ev-deep", dp_size=1)
    logger = kv_vllm.logger_factory(servers=[nats_server.url], heartbeat_s=0)(vllm_config=cfg, engine_indexes=[0])
    for h, keys in ((1, None), (2, [deep]), (3, None)):
        stats = SchedulerStats()
        stats.kv_cache_events = KVEventBatch(1.0, [BlockStored([h], None, [0] * 4, 4, None, "GPU", None, keys)])
        logger.record(stats, None, engine_idx=0)
    await wait_until(lambda: len(col.msgs) == 3, WAIT, "every batch on NATS, the unreadable one too")
    assert [decode_batch(m.data).events[0].block_hashes for m in col.msgs] == [[1], [2], [3]]


async def test_record_never_raises(caplog):
    caplog.set_level(logging.INFO)
    # NATS down: construction returns, relays and reports retry in the background.
    logger = kv_vllm.logger_factory(servers=["nats://127.0.0.1:1"], connect_timeout_s=0.2)(
        vllm_config=vllm_config(publisher="null"), engine_indexes=[0, 1])  # fmt: skip
    logger.record(None, None)
    logger.record(None, None, mm_cache_stats=None, engine_idx=0)
    logger.record(NS(), None, engine_idx=0)  # no field at all
    logger.record(NS(kv_cache_usage=0.5, num_running_reqs="x"), None, engine_idx=1)  # missing and wrong fields
    logger.record(SchedulerStats(), None, engine_idx=99)  # an engine index it was not built for
    logger.record(SchedulerStats(), None, engine_idx=[1])  # not even hashable
    logger.record(SchedulerStats(kv_cache_usage=0.75, prefix_cache_stats=None), None, engine_idx=1)
    stats = SchedulerStats()
    stats.kv_cache_events = object()  # not a batch
    logger.record(stats, None, engine_idx=0)
    logger.record(SchedulerStats(num_running_reqs=2), None, engine_idx=0)
    logger.log()
    logger.log_engine_initialized()
    logger.record_sleep_state(1, 0)
    logger.record_admission_rejection("max_num_queued_reqs")
    assert logger.stats["unknown_engine"] == 2 and logger.stats["record_errors"] == 3
    assert logger._slots[0].running == 2 and logger._slots[1].usage == 0.75  # the fields that were there
    await wait_until(lambda: any("not started, retrying" in line for line in kvbridge_lines(caplog)), WAIT,
                     "the NATS failure logged")  # fmt: skip
    with pytest.raises(ConfigError, match="unknown kvbridge option"):
        kv_vllm.logger_factory(srevers=["nats://127.0.0.1:1"])  # in the caller's code, not inside vLLM
    for worker, words in ((5, "worker_id: must be a str"), ("", "worker_id .*must be non-empty")):
        with pytest.raises(ConfigError, match=words):
            kv_vllm.logger_factory(worker_id=worker)
    kv_vllm.logger_factory(worker_id="gpu-{dp_rank}")  # a template is a worker id


def test_bad_environment_is_one_error_line_never_an_exception(monkeypatch, caplog):
    monkeypatch.setenv("KVBRIDGE_SERVERS", "http://nope")
    caplog.set_level(logging.INFO)
    logger = kv_vllm.KvBridgeStatLogger(vllm_config=vllm_config(), engine_indexes=[0])
    logger.record(SchedulerStats(), None, engine_idx=0)
    assert logger.plan.off and "servers" in logger.plan.off
    assert len(kvbridge_lines(caplog)) == 1


# --- relay --discover ---------------------------------------------------------------------------------------


class SourcesServer:
    """vLLM's API server as discovery sees it: /kv_event_sources and /v1/models."""

    def __init__(self) -> None:
        self.sources: dict = {}
        self.api_key: str | None = None  # as `vllm serve --api-key`: /v1/* wants it, /kv_event_sources not
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = {"/kv_event_sources": outer.sources,
                        "/v1/models": {"object": "list", "data": [{"id": "disc-m", "object": "model"}]}}.get(self.path)  # fmt: skip
                status = 200 if body is not None else 404
                if outer.api_key and self.path.startswith("/v1/") and (
                        self.headers.get("Authorization") != f"Bearer {outer.api_key}"):  # fmt: skip
                    body, status = {"error": "Unauthorized"}, 401
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="test-http", daemon=True)
        self.thread.start()

    def set_ranks(self, engines, topic="kv") -> None:
        # As vLLM lists them: a fixed tcp://*:P stays '*', already offset per rank.
        self.sources = {str(r): {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{e.port}",
                                 "replay_endpoint": f"tcp://*:{e.replay_port}", "buffer_steps": 10000, "hwm": 100000,
                                 "max_queue_size": 100000, "topic": topic} for r, e in engines}  # fmt: skip

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture
def sources_server():
    s = SourcesServer()
    yield s
    s.close()


async def test_cli_relay_discover_relays_both_ranks(nats_server, rank_engines, nats_sub, frames, sources_server):  # noqa: F811
    e0, e1 = rank_engines(2)
    sources_server.set_ranks([(0, e0), (1, e1)])
    # a loopback URL names the ranks after this node, as the plugin does (not 127_0_0_1 on every node)
    cols = [await nats_sub(f"kv.events.disc-m.{HOST}-dp{r}") for r in (0, 1)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    env["KVBRIDGE_HEARTBEAT_S"] = "0"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvbridge", "relay", "--discover", sources_server.url, "--interval", "0.2",
        "--servers", nats_server.url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        await e0.wait_subscribed()
        await e1.wait_subscribed()
        for f in frames:
            await e0.send(*f, drop=f[1] == 1)
            await e1.send(*f)
        await wait_until(lambda: all(len(c.msgs) == len(frames) for c in cols), WAIT, "both ranks on NATS")
    finally:
        err = await stop_process(proc, WAIT)
    assert proc.returncode == 0, err.decode()
    for c in cols:
        assert [m.data for m in c.msgs] == [p for _, _, p in frames]
    assert e0.replay_requests == [1]
    assert "relaying DP ranks [0, 1]" in err.decode()


async def test_discovery_asks_a_guarded_server_its_model_with_the_api_key(nats_server, rank_engines, sources_server,
                                                                          monkeypatch, caplog):  # fmt: skip
    (e0,) = rank_engines(1)
    sources_server.set_ranks([(0, e0)])
    sources_server.api_key = "sk-test"
    cfg = Config(servers=[nats_server.url], heartbeat_s=0)
    for given, env in (("sk-test", None), (None, "sk-test")):
        if env:
            monkeypatch.setenv("VLLM_API_KEY", env)
        async with Discovery(sources_server.url, cfg, interval_s=0.1, api_key=given) as disc:
            await wait_until(lambda: disc.config.model == "disc-m", WAIT, "the served model, asked with the key")
    monkeypatch.delenv("VLLM_API_KEY")
    async with Discovery(sources_server.url, cfg, interval_s=0.1) as disc:  # without: refused, and said why
        await wait_until(lambda: any("--api-key or VLLM_API_KEY" in r.getMessage() for r in caplog.records), WAIT,
                         "the refused /v1/models said")  # fmt: skip
        assert disc.config.model != "disc-m"


async def test_discovery_follows_ranks_that_appear_and_go_away(nats_server, rank_engines, sources_server):
    e0, e1 = rank_engines(2)
    sources_server.set_ranks([(0, e0)])
    cfg = Config(servers=[nats_server.url], heartbeat_s=0)
    async with Discovery(sources_server.url, cfg, interval_s=0.1) as disc:
        await wait_until(lambda: len(disc.relays) == 1, WAIT, "rank 0")
        assert disc.config.model == "disc-m"  # the served model name, from /v1/models
        sources_server.set_ranks([(0, e0), (1, e1)])
        await wait_until(lambda: len(disc.relays) == 2, WAIT, "rank 1 appearing")
        spec1 = disc.relays.specs[f"tcp://127.0.0.1:{e1.port}"]
        assert (spec1.rank, spec1.replay_endpoint, spec1.config.worker_id) == (
            1, f"tcp://127.0.0.1:{e1.replay_port}", f"{HOST}-dp1")
        sources_server.set_ranks([(1, e1)])
        await wait_until(lambda: list(disc.relays.specs) == [f"tcp://127.0.0.1:{e1.port}"], WAIT, "rank 0 going away")
        sources_server.sources = ["not", "a", "map"]
        await wait_until(lambda: disc.stats["poll_failures"] >= 1, WAIT, "a bad answer counted")
        assert len(disc.relays) == 1  # kept while the answer is bad
        # an entry no relay can follow (a negative rank) is a bad answer too: counted, said, and
        # the discovery goes on (it used to end its task without a word)
        failures = disc.stats["poll_failures"]
        entry = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{e1.port}", "topic": "kv"}
        sources_server.sources = {"-1": entry}
        await wait_until(lambda: disc.stats["poll_failures"] > failures, WAIT, "the negative rank counted")
        assert len(disc.relays) == 1 and not disc._task.done()
        # a rank whose relay cannot be made (port 0: the engine's own choice, unknown here) is
        # logged and left, the others relayed
        sources_server.set_ranks([(1, e1)])
        sources_server.sources["2"] = {**entry, "endpoint": "tcp://*:0"}
        await wait_until(lambda: disc.relays.stats["start_failures"] >= 1, WAIT, "the port-0 relay refused")
        assert f"tcp://127.0.0.1:{e1.port}" in disc.relays.specs and not disc._task.done()


# --- process exit -------------------------------------------------------------------------------------------


async def test_at_exit_the_relays_forward_what_was_sent_then_stop(nats_server, nats_sub, frames):  # noqa: F811
    col = await nats_sub(f"kv.events.exit-m.{HOST}-dp0")
    script = f"""
        import atexit, threading, zmq
        atexit.register(lambda: print("threads at exit:", sorted(t.name for t in threading.enumerate())))
        from types import SimpleNamespace as NS
        from kvbridge.vllm import logger_factory  # registers its atexit after the line above: runs first

        ctx = zmq.Context()
        pub = ctx.socket(zmq.XPUB)
        pub.linger = 1000
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        cfg = NS(kv_events_config=NS(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{{port}}",
                                     replay_endpoint=None, topic="kv"),
                 parallel_config=NS(data_parallel_size=1, data_parallel_size_local=1, data_parallel_index=0,
                                    _api_process_rank=0),
                 model_config=NS(served_model_name="exit-m"))
        logger = logger_factory(servers=["{nats_server.url}"], heartbeat_s=0)(vllm_config=cfg, engine_indexes=[0])
        assert pub.poll(60000), "the relay never subscribed"
        pub.recv()
        for topic, seq, payload in {[(t, s, p) for t, s, p in frames]!r}:
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        print("sent", flush=True)
    """
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", textwrap.dedent(script), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")},
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), WAIT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert lines == ["sent", "threads at exit: ['MainThread']"], (lines, err.decode())
    await wait_until(lambda: len(col.msgs) == len(frames), WAIT, "the frames on NATS")
    assert [m.data for m in col.msgs] == [p for _, _, p in frames]
    assert [int(m.headers[HDR_SEQ]) for m in col.msgs] == list(range(len(frames)))


async def test_plugin_and_logger_factory_in_one_engine_share_one_relay_per_rank(monkeypatch, nats_server, rank_engines,
                                                                                 caplog):  # fmt: skip
    caplog.set_level(logging.INFO)
    e0, e1 = rank_engines(2)
    monkeypatch.setenv("KVBRIDGE_SERVERS", nats_server.url)
    cfg = vllm_config(e0.port, e0.replay_port, served="share-m")
    plugin = kv_vllm.KvBridgeStatLogger(vllm_config=cfg, engine_indexes=[0, 1])
    rt = kv_vllm._runtime
    # Built at once, as vLLM builds an engine's loggers: before the loop has run the first's relays.
    coded = kv_vllm.logger_factory(servers=[nats_server.url])(vllm_config=cfg, engine_indexes=[0, 1])
    attached = [r.getMessage() for r in caplog.records if "kvbridge: attached" in r.getMessage()]
    assert "(2 already run by another kvbridge logger)" not in attached[0]
    assert "(2 already run by another kvbridge logger)" in attached[1], attached
    await wait_until(lambda: len(rt.relays) == 2 and all(rt.relays.relay(s.endpoint) for s in plugin.plan.relays),
                     WAIT, "the plugin's relays")  # fmt: skip
    # A barrier: the loop runs callbacks in order, so the second logger's requests, if any, have run.
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(asyncio.sleep(0), rt.loop))
    assert kv_vllm._runtime is rt and len(rt.relays) == 2
    assert list(coded._slots.values()) == [None, None]  # the plugin reports these workers' load already
    coded.record(SchedulerStats(num_running_reqs=5), None, engine_idx=0)
    assert plugin._slots[0].running == 0 and coded.stats["record_errors"] == 0


async def test_a_second_logger_under_another_model_name_does_not_report_the_engine_twice(monkeypatch, nats_server,
                                                                                          rank_engines, caplog):  # fmt: skip
    # The plugin reports the served name; a logger_factory(model=...) in the same engine would put
    # the same engine's loads under a second model (its events go through the one relay per rank).
    e0, _ = rank_engines(2)
    monkeypatch.setenv("KVBRIDGE_SERVERS", nats_server.url)
    cfg = vllm_config(e0.port, e0.replay_port, served="served-m")
    plugin = kv_vllm.KvBridgeStatLogger(vllm_config=cfg, engine_indexes=[0, 1])
    other = kv_vllm.logger_factory(servers=[nats_server.url], model="other-m")(vllm_config=cfg, engine_indexes=[0, 1])
    assert all(plugin._slots.values()) and list(other._slots.values()) == [None, None]
    said = [r.getMessage() for r in caplog.records if "already reported on" in r.getMessage()]
    assert len(said) == 2 and all("load.served-m." in m and "load.other-m." in m for m in said), said
    # Another engine in the same process (its own config), rank 0 too: reported, by its own logger.
    second = kv_vllm.logger_factory(servers=[nats_server.url])(vllm_config=vllm_config(publisher="null", served="second-m"),
                                                               engine_indexes=[0])  # fmt: skip
    assert second._slots[0] is not None and second._slots[0].subject.startswith("kv.load.second-m.")
    # A third engine under the names of the second (same model, same default worker name) would
    # mix two engines' loads and events on one stream: not reported, and said.
    third = kv_vllm.logger_factory(servers=[nats_server.url])(vllm_config=vllm_config(publisher="null", served="second-m"),
                                                              engine_indexes=[0])  # fmt: skip
    assert third._slots[0] is None
    assert any("another engine of this process already reports on kv.load.second-m." in r.getMessage()
               for r in caplog.records)  # fmt: skip


async def test_an_engine_created_again_is_reported_and_the_gone_ones_reports_stop(nats_server):
    """vLLM gives stat loggers no shutdown call: when an engine (and its logger) is gone, its
    ranks are free again, and its load reports stop; an engine created again under the same
    names (a notebook, an RL loop re-creating LLM) is reported. Before, the first engine's claim
    and report task lived forever: the new engine was refused, the dead one's gauges went on."""
    import gc

    def build(usage: float):
        logger = kv_vllm.logger_factory(servers=[nats_server.url], load_interval_s=0.05)(
            vllm_config=vllm_config(publisher="null", served="again-m"), engine_indexes=[0])  # fmt: skip
        logger.record(SchedulerStats(kv_cache_usage=usage), None, engine_idx=0)
        return logger

    first = build(0.25)
    rt = kv_vllm._runtime
    stats = first.stats
    await wait_until(lambda: stats["loads_published"] >= 1, WAIT, "the first engine's reports")
    tasks = lambda: [t for t in rt.tasks if t.get_name() == "kvbridge-vllm-loads" and not t.done()]  # noqa: E731
    before = len(tasks())
    del first
    gc.collect()
    await wait_until(lambda: len(tasks()) == before - 1, WAIT, "the gone engine's report task to end")
    second = build(0.75)
    assert second._slots[0] is not None  # not refused as "another engine under the same names"
    nc = await nats_connect(nats_server.url)
    col = LoadCollector()
    await nc.subscribe("kv.load.again-m.*", cb=col.on_msg)
    try:
        await wait_until(lambda: len(col.reports) >= 3, WAIT, "reports from the engine created again")
    finally:
        await nc.close()
    assert {r.kv_cache_usage for _, r in col.reports} == {0.75}  # none left from the gone engine


def test_watch_load_columns():
    from kvbridge.tools.cli import load_columns

    report = LoadReport(ts=1.0, kv_cache_usage=0.421, running=3, waiting=2, prefix_cache_queries=200,
                        prefix_cache_hits=50)  # fmt: skip
    assert load_columns({("m", "w"): (report, 1.2)}, "m", "w") == "  [kv 42% run 3 wait 2 hit 25%, 1s ago]"
    assert load_columns({}, "m", "w") == ""
