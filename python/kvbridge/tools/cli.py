"""``kvbridge`` command line: ``watch`` the event stream, ``relay`` a stock engine's ZMQ events to
NATS, serve overlap queries from an ``index``, put a KV-aware OpenAI gateway in front of vLLM
(``proxy``), compare routing policies on a trace (``replay``), run the end-to-end ``demo``, or
print least-privilege NATS users (``auth-config``).

Connection options come from ``KVBRIDGE_*`` environment variables (see :class:`kvbridge.Config`);
the flags below override them.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
import time
from typing import Any, Sequence

import msgspec

from kvbridge.config import ENV_PREFIX, Config, ConfigError
from kvbridge.errors import Error
from kvbridge.tools.argtypes import non_negative, non_negative_int, positive, positive_int
from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvbridge.wire.subjects import QUERY_QUEUE_GROUP

__all__ = ["main"]


def _connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection (default: KVBRIDGE_* environment variables)")
    g.add_argument("--servers", help="NATS server URL(s), comma-separated (KVBRIDGE_SERVERS)")
    g.add_argument("--prefix", dest="subject_prefix", metavar="PREFIX", help="subject prefix (KVBRIDGE_SUBJECT_PREFIX, default kv)")
    g.add_argument("--user", help="user name; with --password")
    g.add_argument("--password", help="password; with --user")
    g.add_argument("--token", help="authentication token")
    g.add_argument("--creds", dest="creds_file", metavar="FILE", help="NATS .creds file")
    g.add_argument("--tls-ca", dest="tls_ca", help="CA bundle to verify the server with")
    g.add_argument("--tls-cert", dest="tls_cert", help="client certificate (mutual TLS)")
    g.add_argument("--tls-key", dest="tls_key", help="client key (mutual TLS)")


def _stop_on_signals(event: asyncio.Event | None = None) -> asyncio.Event:
    """An event (``event``, or a new one) that SIGINT and SIGTERM set: how every long-running
    command learns to stop cleanly."""
    stop = asyncio.Event() if event is None else event
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _run_to_the_end(coro: Any) -> int:
    """``asyncio.run(coro)``, a SIGTERM unwinding it as Ctrl-C does (cancelled: every ``with``
    and ``finally`` runs, so a demo's nats-servers and HTTP servers go with it): 143."""

    async def main() -> int:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)  # type: ignore[union-attr]
        return await coro

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        return 128 + signal.SIGTERM


def _config(args: argparse.Namespace, **extra: Any) -> Config:
    names = ("servers", "subject_prefix", "user", "password", "token", "creds_file", "tls_ca", "tls_cert", "tls_key")
    overrides = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    return Config.from_env(**overrides, **extra)


# --- watch -----------------------------------------------------------------------------------------


def _hash(h: Any) -> str:
    return h.hex()[:16] if isinstance(h, bytes) else f"{h:016x}"


def _where(medium: Any, group_idx: Any) -> str:
    return f"{'-' if medium is None else medium}/g{0 if group_idx is None else group_idx}"


def describe_events(events: Sequence[Any], by_group: bool = False) -> str:
    """One compact line for a batch's events, as a person reads a stream; ``by_group`` names each
    event's medium and KV-cache group (for a worker that holds more than one)."""
    parts = []
    for ev in events:
        where = f" {_where(ev.medium, ev.group_idx)}" if by_group and not isinstance(ev, AllBlocksCleared) else ""
        if isinstance(ev, BlockStored):
            parent = "root" if ev.parent_block_hash is None else _hash(ev.parent_block_hash)
            lora = f" lora={ev.lora_name}" if ev.lora_name else ""
            parts.append(f"+{len(ev.block_hashes)} stored{where} ({parent} -> {_hash(ev.block_hashes[-1])}){lora}"
                         if ev.block_hashes else f"+0 stored{where}")  # fmt: skip
        elif isinstance(ev, BlockRemoved):
            parts.append(f"-{len(ev.block_hashes)} removed{where}")
        elif isinstance(ev, AllBlocksCleared):
            parts.append("all cleared")
    return ", ".join(parts) if parts else "(heartbeat)"


def residency_columns(view: Any) -> str:
    """A worker's blocks per medium and group (a ``WorkerView``), when it holds more than one; ""
    otherwise, so a single-group stream reads as it always has."""
    counts = view.residency.counts() if view is not None else {}
    if len(counts) < 2:
        return ""
    cells = [f"{_where(medium, group)} {n}" for (medium, group), n in sorted(counts.items(), key=str)]
    return f"  [held: {', '.join(cells)}]"


def load_columns(loads: dict, model: str, worker: str) -> str:
    """The worker's latest load report (``KvEventSubscriber.loads``) as a few columns, or ""."""
    entry = loads.get((model, worker))
    if entry is None:
        return ""
    r, age = entry
    hit = f" hit {100 * r.prefix_cache_hits / r.prefix_cache_queries:.0f}%" if r.prefix_cache_queries else ""
    return f"  [kv {100 * r.kv_cache_usage:.0f}% run {r.running} wait {r.waiting}{hit}, {age:.0f}s ago]"


def json_line(u: Any, loads: dict) -> str:
    """``watch --json``'s object for one update (an ``Update``), with the worker's latest load report.

    Model and worker come off subjects any publisher may name, so they go through the encoder."""
    line: dict[str, Any] = {"model": u.model, "worker": u.worker, "seq": u.seq, "source": u.source, "batch": u.batch}
    report = loads.get((u.model, u.worker))
    if report is not None:
        line["load"] = report[0]
    return msgspec.json.encode(line).decode()


def _watch_parser(sub: Any) -> None:
    w = sub.add_parser(
        "watch", help="print the event stream, per worker, in order, gaps repaired",
        description="Print each worker's event batches in order, gaps repaired; when the worker publishes load "
        "reports (the vLLM stat logger does), each line ends with its latest: [kv <KV-cache usage> run <running> "
        "wait <waiting> hit <prefix-cache hit rate>, <age> ago]. A worker holding blocks in more than one medium or "
        "KV-cache group (hybrid attention, offloading): each event names its medium/group (GPU/g1) and the line "
        "shows the blocks held in each: [held: GPU/g0 <n>, GPU/g1 <n>, ...].",
    )  # fmt: skip
    w.add_argument("--model", help="only this model (default: all)")
    w.add_argument("--worker", help="only this worker (default: all)")
    w.add_argument("--json", action="store_true", help="one JSON object per batch instead of a summary line")
    w.add_argument("--count", type=non_negative_int, default=0, help="stop after this many updates (default: run until Ctrl-C)")
    w.add_argument("--heartbeats", action="store_true", help="also print heartbeats (empty batches idle publishers send)")
    _connection_args(w)


async def _watch(args: argparse.Namespace) -> int:
    from kvbridge.bus.subscriber import KvEventSubscriber

    seen = 0
    done = asyncio.Event()

    def on_update(u: Any) -> None:
        nonlocal seen
        if not u.reset and u.n_events == 0 and not args.heartbeats:
            return  # every idle publisher sends one per heartbeat_s: noise unless asked for
        stamp = time.strftime("%H:%M:%S", time.localtime(u.batch.ts)) + f".{int(u.batch.ts * 1000) % 1000:03d}"
        loads = sub.loads
        load = load_columns(loads, u.model, u.worker)
        view = sub.views.get((u.model, u.worker))  # already holds this update
        held = residency_columns(view)
        if args.json:
            print(json_line(u, loads))
        elif u.reset:
            blocks = sum(len(ev.block_hashes) for ev in u.batch.events if isinstance(ev, BlockStored))
            print(f"{stamp} {u.model}/{u.worker} seq={u.seq} [{u.source}] view reset: {blocks} cached blocks{held}{load}")
        else:
            tag = "" if u.source == "live" else f" [{u.source}]"
            line = describe_events(u.batch.events, by_group=bool(held))
            print(f"{stamp} {u.model}/{u.worker} seq={u.seq}{tag} {line}{held}{load}")
        sys.stdout.flush()
        seen += 1
        if args.count and seen >= args.count:
            done.set()

    # Views: a worker's blocks per medium and group are shown beside each of its lines.
    sub = KvEventSubscriber(_config(args), model=args.model, worker=args.worker, on_update=on_update)
    _stop_on_signals(done)
    async with sub:
        print(f"watching {sub.subject} on {', '.join(sub.config.servers)} (Ctrl-C to stop)", file=sys.stderr)
        await done.wait()
    print(f"{seen} updates; {sub.stats}", file=sys.stderr)
    return 0


# --- relay -----------------------------------------------------------------------------------------


def _relay_parser(sub: Any) -> None:
    r = sub.add_parser(
        "relay", help="publish a stock vLLM/SGLang engine's ZMQ KV events on NATS (a sidecar), gaps repaired by replay",
        description="Subscribe to the engine's ZMQ KV events (vLLM: --kv-events-config '{\"enable_kv_cache_events\": "
        "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5567\", "
        "\"topic\": \"kv\"}') and publish every batch, unchanged, on <prefix>.events.<model>.<worker>. "
        "With --discover, one relay per data-parallel rank that a vLLM API server lists at /kv_event_sources, "
        "following ranks that appear or go away. Runs until SIGINT/SIGTERM, then forwards what has arrived and exits.",
    )  # fmt: skip
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--endpoint", help="the engine's ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557 (* means this host)")
    src.add_argument(
        "--discover", metavar="URL",
        help="a vLLM API server, http://HOST:PORT: relay every rank its /kv_event_sources lists (* there means HOST); "
        "--endpoint, --replay-endpoint, --topic and --dp-rank then come from it",
    )  # fmt: skip
    r.add_argument("--interval", type=positive, default=2.0, help="with --discover: seconds between polls (default 2)")
    r.add_argument("--api-key", help="with --discover: the API server's --api-key, which guards its /v1/models "
                   "(default: VLLM_API_KEY)")  # fmt: skip
    r.add_argument("--replay-endpoint", help="the engine's ZMQ replay (ROUTER) endpoint, e.g. tcp://127.0.0.1:5567; without it a gap is a loss")
    r.add_argument("--topic", default="", help="ZMQ topic prefix to subscribe to, as the engine's 'topic' (default: all)")
    r.add_argument("--dp-rank", type=non_negative_int, help="the engine's data-parallel rank: connect to the ports + rank, as the engine binds them")
    r.add_argument("--model", help="the subject's <model> token (KVBRIDGE_MODEL; with --discover, default: the served "
                   "model name from /v1/models)")
    r.add_argument("--worker", help="the subject's <worker> token (KVBRIDGE_WORKER_ID, default <host>-<pid>), "
                   "{dp_rank} replaced by --dp-rank (0 without it); with --discover a template for every rank "
                   "(default <HOST>-dp{dp_rank}; this machine's name for a loopback HOST)")  # fmt: skip
    r.add_argument("--encoding", choices=("msgpack", "json"), help="wire encoding (KVBRIDGE_ENCODING, default msgpack: the engine's bytes)")
    _connection_args(r)


async def _discover(args: argparse.Namespace) -> int:
    import logging

    from kvbridge.engine.discover import Discovery

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("kvbridge").addHandler(handler)
    logging.getLogger("kvbridge").setLevel(logging.INFO)
    extra = {"encoding": args.encoding} if args.encoding else {}
    discovery = Discovery(args.discover, _config(args, **extra), model=args.model, worker=args.worker,
                          interval_s=args.interval, api_key=args.api_key)  # fmt: skip
    stop = _stop_on_signals()
    async with discovery:
        print(f"following {discovery.url} every {args.interval}s (Ctrl-C to stop)", file=sys.stderr, flush=True)
        await stop.wait()
    print(f"relays stopped; {discovery.relays.stats}, {discovery.stats}", file=sys.stderr)
    return 0


async def _relay(args: argparse.Namespace) -> int:
    from kvbridge.engine.relay import Relay

    if args.discover:
        given = [flag for flag, v in (("--replay-endpoint", args.replay_endpoint), ("--topic", args.topic),
                                      ("--dp-rank", args.dp_rank)) if v not in (None, "")]  # fmt: skip
        if given:
            raise ConfigError(f"--discover takes {', '.join(given)} from the server's /kv_event_sources: drop "
                              f"{'it' if len(given) == 1 else 'them'}")  # fmt: skip
        return await _discover(args)
    if args.api_key:
        raise ConfigError("--api-key goes with --discover (it is the API server's)")

    extra = {k: v for k, v in (("model", args.model), ("encoding", args.encoding)) if v}
    # A worker template (the vLLM plugin's KVBRIDGE_WORKER_ID may hold {dp_rank}) names this rank.
    template = args.worker or os.environ.get(ENV_PREFIX + "WORKER_ID")
    if template:
        from kvbridge.engine.discover import worker_name

        extra["worker_id"] = worker_name(template, args.dp_rank or 0)
    relay = Relay(
        _config(args, **extra), endpoint=args.endpoint, replay_endpoint=args.replay_endpoint, topic=args.topic,
        dp_rank=args.dp_rank,
    )  # fmt: skip
    stop = _stop_on_signals()
    failed = False
    async with relay:
        print(
            f"relaying {relay.endpoint} (replay: {relay.replay_endpoint or 'none'}) to "
            f"{relay.publisher.subjects.events} on {', '.join(relay.config.servers)} (Ctrl-C to stop)",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        running = asyncio.ensure_future(relay.wait())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if running.done():
            failed = not running.cancelled() and running.exception() is not None  # logged by the relay
        else:
            running.cancel()
    print(f"relay stopped; {relay.stats}", file=sys.stderr)
    return 1 if failed else 0


# --- index -----------------------------------------------------------------------------------------


def _index_parser(sub: Any) -> None:
    i = sub.add_parser(
        "index", help="keep a KV index of a model's workers and answer overlap queries on NATS (replicas share them)",
        description="Subscribe to <prefix>.events.<model>.*, keep an index of every worker's cached blocks, and "
        "answer queries on <prefix>.query.<model> in a queue group (run several for load sharing and failover). "
        "Request: {\"tokens\": [...]} or {\"block_hashes\": [...]}, optionally with \"lora_name\", \"extra_keys\" "
        "(one entry per block: null or a list), \"medium\", \"remote\" (also credit copies on another node) and "
        "\"by_medium\" (the reply then adds \"media\": {worker: {medium: leading blocks held there}}, \"\" for a "
        "medium the engine did not name); JSON, or msgpack with Content-Type: "
        "application/msgpack. Reply: {\"scores\": {worker: leading blocks held}, \"workers\": N} in the same "
        "encoding, or {\"error\": \"...\"}. Try: nats req kv.query.MODEL '{\"tokens\": [1, 2, 3]}'. "
        "Runs until SIGINT/SIGTERM.",
    )  # fmt: skip
    i.add_argument("--model", help="the model whose workers to index (KVBRIDGE_MODEL; default: default)")
    i.add_argument("--block-size", type=positive_int, default=16, help="tokens per block, as the engines use (default 16)")
    i.add_argument(
        "--key", choices=("tokens", "engine"), default="tokens",
        help="tokens (default): the index hashes token ids itself, queries send tokens; engine: keyed by the "
        "engines' own block hashes, queries send block_hashes",
    )  # fmt: skip
    i.add_argument("--queue-group", default=QUERY_QUEUE_GROUP, help=f"NATS queue group shared by replicas (default {QUERY_QUEUE_GROUP})")
    i.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (KVBRIDGE_METRICS_PORT)")
    _connection_args(i)


async def _index(args: argparse.Namespace) -> int:
    from kvbridge.routing.service import IndexService

    extra = {k: v for k, v in (("model", args.model), ("metrics_port", args.metrics_port)) if v is not None}
    service = IndexService(
        _config(args, **extra), block_size=args.block_size, key=args.key, queue_group=args.queue_group
    )
    stop = _stop_on_signals()
    async with service:
        print(
            f"index of {service.subscriber.subject}: answering {service.subject} (queue group "
            f"{service.queue_group}) on {', '.join(service.config.servers)} (Ctrl-C to stop)",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        await stop.wait()
    s = service.stats
    print(
        f"index service stopped; {s['queries']} queries ({s['errors']} errors), {s['workers']} workers, "
        f"{s['blocks']} blocks", file=sys.stderr,
    )  # fmt: skip
    return 0


# --- proxy -----------------------------------------------------------------------------------------


def _proxy_parser(sub: Any) -> None:
    x = sub.add_parser(
        "proxy", help="an OpenAI-compatible gateway that sends each request to the vLLM server caching its prompt",
        description="Serve the OpenAI API (POST /v1/completions, /v1/chat/completions, streaming or not; GET "
        "/v1/models, /health, /metrics) and forward each request, unchanged, to the worker predicted to give it "
        "its first token soonest: the prompt's tokens it does not hold cached, behind the prompt work already sent "
        "there, timed by an engine model (docs/proxy.md). Workers and their URLs come from the vLLM plugin's load "
        "reports on NATS (KVBRIDGE_ADVERTISE_URL, or vllm serve's --host/--port) and from --worker. Runs until "
        "SIGINT/SIGTERM.",
    )  # fmt: skip
    x.add_argument("--model", required=True, help="the served model name clients ask for (and the subjects' <model>)")
    x.add_argument("--listen", type=_listen, default=("127.0.0.1", 8080), metavar="HOST:PORT",
                   help="where to serve (default 127.0.0.1:8080, beside a vLLM server on its 8000)")  # fmt: skip
    x.add_argument("--worker", action="append", default=[], metavar="ID=URL[@RANK]",
                   help="a worker and its API server (repeat); @RANK pins that DP rank with X-data-parallel-rank; "
                   "adds to, and overrides, what load reports say")  # fmt: skip
    x.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block, as the engines use (default 16)")
    x.add_argument("--tokenizer", metavar="PATH", help="a tokenizers JSON file (tokenizer.json) to tokenize completions' "
                   "prompts locally; default (and always for chat): the engines' POST /tokenize, cached")  # fmt: skip
    x.add_argument("--index-service", action="store_true",
                   help="ask `kvbridge index` replicas for overlap scores instead of keeping an index in-process "
                   "(they must run --key tokens, the default, with the proxy's --block-size)")  # fmt: skip
    x.add_argument("--policy", choices=("kv", "rr", "random"), default="kv",
                   help="kv (default): the KV-aware router; rr: round robin; random: a seeded random pick (to "
                   "compare, or to --record traffic as a blind policy sees it)")  # fmt: skip
    x.add_argument("--seed", type=int, help="seed of the router's tie-breaks and of --policy random (default: random)")
    x.add_argument("--record", metavar="FILE", help="append each routed request to FILE as a Mooncake trace line "
                   "(arrival ms, input and output tokens, the prompt's block hashes; no text) for `kvbridge replay`")
    x.add_argument("--record-block-size", type=positive_int, metavar="N",
                   help="with --record: tokens per recorded block hash, the grain of sharing a replay sees (default "
                   "--block-size; 512: Mooncake's own form, which Dynamo's replay reads, but prompts sharing less than "
                   "512 tokens then share nothing)")  # fmt: skip
    x.add_argument("--overlap-weight", type=non_negative, default=1.0, help="weight of the prompt's own uncached tokens "
                   "against the prompt work queued ahead of it on a worker (default 1)")  # fmt: skip
    e = x.add_argument_group("engine model: how the router times a worker's work (default: Dynamo 1.6.1's replay "
                             "model of a vLLM engine; docs/proxy.md)")  # fmt: skip
    from kvbridge.routing.work import EngineModel

    model = EngineModel()
    e.add_argument("--engine-prefill", type=_coefficients, metavar="C0,C1,C2",
                   help="a pass's prefill ms for T new prompt tokens: C0 + C1 T + C2 T^2 (default "
                   f"{','.join(map(str, model.prefill))})")  # fmt: skip
    e.add_argument("--engine-decode", type=_coefficients, metavar="D0,D1,D2",
                   help="a decode step's ms at KV-cache use u in [0, 1]: D0 + D1 u + D2 u^2 (default "
                   f"{','.join(map(str, model.decode))})")  # fmt: skip
    e.add_argument("--engine-max-batched-tokens", type=positive_int, metavar="N",
                   help=f"prompt tokens per pass, vLLM's max_num_batched_tokens (default {model.max_num_batched_tokens})")
    e.add_argument("--engine-kv-tokens", type=non_negative_int, metavar="N",
                   help=f"tokens of KV cache per worker (default {model.kv_capacity_tokens}; 0: unknown, KV-cache use "
                   "does not slow the decode step)")  # fmt: skip
    x.add_argument("--max-body-bytes", type=positive_int, default=16 << 20, help="larger requests get 413 (default 16 MiB)")
    x.add_argument("--connect-timeout", type=positive, default=5.0, help="seconds to connect to a worker (default 5)")
    x.add_argument("--read-timeout", type=positive, default=600.0,
                   help="seconds a worker may stay silent, prefill included (default 600)")
    x.add_argument("--tokenize-timeout", type=positive, default=5.0, help="seconds for a /tokenize answer or an index-service query (default 5)")
    x.add_argument("--down-s", type=non_negative, default=5.0, help="seconds a failed worker is left out (default 5)")
    x.add_argument("--tokenize-cache", type=non_negative_int, default=4096, help="prompts whose token ids are kept (default 4096)")
    _connection_args(x)


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port of 0-65535, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


async def _proxy(args: argparse.Namespace) -> int:
    import logging

    from kvbridge.routing.proxy import KvProxy
    from kvbridge.routing.upstreams import parse_worker

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        workers = dict(parse_worker(spec) for spec in args.worker)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.record_block_size is not None and args.record is None:
        raise ConfigError("--record-block-size goes with --record")
    host, port = args.listen
    config = _config(args)
    try:
        engine = _engine_model(args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        proxy = KvProxy(
            config, model=args.model, host=host, port=port, workers=workers, block_size=args.block_size,
            tokenizer=args.tokenizer, index_service=args.index_service, overlap_weight=args.overlap_weight,
            max_body_bytes=args.max_body_bytes, connect_timeout_s=args.connect_timeout,
            read_timeout_s=args.read_timeout, tokenize_timeout_s=args.tokenize_timeout, down_s=args.down_s,
            tokenize_cache=args.tokenize_cache, seed=args.seed, policy=args.policy, engine=engine, record=args.record,
            record_block_size=args.record_block_size,
        )  # fmt: skip
    except OSError as exc:  # the listening socket is bound here (or --record's file opened)
        where = f"--record {args.record}" if exc.filename else f"--listen {host}:{port}"
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    stop = _stop_on_signals()
    async with proxy:
        index = "index service" if args.index_service else "in-process index"
        routing = {"kv": f"kv-aware, {index}", "rr": "round robin", "random": "random"}[args.policy]
        record = f"; recording to {args.record}" if args.record else ""
        print(f"kvbridge proxy for {args.model} on {proxy.url} ({routing}, NATS {', '.join(config.servers)}); "
              f"workers from load reports{' and --worker' if workers else ''}{record} (Ctrl-C to stop)",
              file=sys.stderr, flush=True)  # fmt: skip
        await stop.wait()
    written = f"; {proxy.recorder.written} requests recorded to {args.record}" if proxy.recorder is not None else ""
    print(f"proxy stopped{written}", file=sys.stderr)
    return 0


def _coefficients(value: str) -> tuple[float, float, float]:
    try:
        parts = tuple(float(x) for x in value.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 3 or not all(math.isfinite(c) for c in parts):
        raise argparse.ArgumentTypeError(f"expected three finite numbers, comma-separated, got {value!r}")
    return parts


def _engine_model(args: argparse.Namespace) -> Any:
    """The proxy's EngineModel from the --engine-* flags (None: the default model)."""
    from kvbridge.routing.work import EngineModel

    given = {k: v for k, v in (("prefill", args.engine_prefill), ("decode", args.engine_decode),
                               ("max_num_batched_tokens", args.engine_max_batched_tokens)) if v is not None}  # fmt: skip
    if args.engine_kv_tokens is not None:
        given["kv_capacity_tokens"] = args.engine_kv_tokens or None
    return EngineModel(**given) if given else None


# --- demo ------------------------------------------------------------------------------------------


def _demo_parser(sub: Any) -> None:
    d = sub.add_parser(
        "demo", help="start a local nats-server and simulated workers; compare KV-aware, round-robin and random routing "
        "by time to first token; kill the broker mid-run",
        description="Three fleets of simulated engine workers, one per routing policy (KV-aware, round-robin, random), "
        "serve the same multi-turn chats through a local nats-server, which is SIGKILLed and restarted mid-run. Each "
        "worker is the engine model kvbridge.replay simulates: vLLM's scheduler (token budget, chunked prefill, "
        "queueing for blocks, preemption) over the worker's KV-cache pool, each pass timed by Dynamo 1.6.1's "
        "polynomial model; its pool's KV events go out on NATS at the end of every pass. Simulated time runs with the "
        "wall clock, one simulated millisecond per millisecond (a busy machine may fall behind; the demo says by how "
        "much), so a turn's time to first token includes its wait in the queue while the events are on their way. "
        "The chats arrive for --duration s, then the bursts; the run ends once every request has its first token (what "
        "is still decoding stops there). Exit status 1 if a subscriber's view of a pool, or an index, ends different from the pools.",
    )  # fmt: skip
    d.add_argument("--workers", type=positive_int, default=3, help="simulated engine workers per fleet (default 3)")
    d.add_argument("--duration", type=positive, default=8.0, help="seconds of chat traffic, simulated and wall clock (default 8)")
    d.add_argument("--num-blocks", type=positive_int, help="KV blocks per worker (default 16384; --http: 2048)")
    d.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (default 16)")
    d.add_argument("--no-kill", action="store_true", help="do not SIGKILL the broker mid-run")
    d.add_argument("--seed", type=int, default=0, help="workload random seed (default 0)")
    d.add_argument("--encoding", choices=("msgpack", "json"), default="msgpack", help="wire encoding (default msgpack)")
    d.add_argument("--turns-per-s", type=positive, default=60.0,
                   help="chat turns arriving per second, the same turns at the same times at every fleet (default 60)")
    d.add_argument(
        "--prefill-ms-per-block", type=non_negative,
        help="with --http: milliseconds a stand-in engine waits per block not found cached before the first token "
        "(default 2.0)",
    )  # fmt: skip
    d.add_argument("--bursts", type=non_negative_int, default=4, metavar="N",
                   help="after the chats, N bursts of requests sharing a new 512-token prefix arriving together, as "
                   "agentic fan-out does, 200 ms apart (default 4; 0: none)")  # fmt: skip
    d.add_argument("--burst-size", type=positive_int, default=12, help="requests per burst (default 12)")
    d.add_argument("--sliding-window", type=non_negative_int, default=0, metavar="W",
                   help="a hybrid model: each worker's pool has a full-attention and a sliding-window KV-cache group "
                   "of W tokens, as vLLM runs gpt-oss or Gemma 3 (default 0: one full-attention group)")  # fmt: skip
    d.add_argument("--http", action="store_true",
                   help="instead: stand-in OpenAI-compatible engines behind `kvbridge proxy`, chats sent through the "
                   "openai client, against round-robin and random (needs the openai package)")  # fmt: skip
    d.add_argument("--http-turns", type=positive_int, default=120, help="with --http: chat turns per policy (default 120)")
    d.add_argument("--cluster", type=non_negative_int, default=0, metavar="N",
                   help="run on an N-node NATS cluster (every client gets every URL); the node holding the "
                   "router's connection is SIGKILLed mid-run (default: one server)")  # fmt: skip


# What the --http demo (stand-in engines behind the proxy) does not run: given with it, refused.
_NOT_WITH_HTTP = ("duration", "no_kill", "encoding", "turns_per_s", "bursts", "burst_size", "sliding_window", "cluster")


def _demo(args: argparse.Namespace) -> int:
    defaults = build_parser().parse_args(["demo"])
    given = [name for name in _NOT_WITH_HTTP if getattr(args, name) != getattr(defaults, name)]
    if args.http and given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        print(f"kvbridge demo: {flags} {'goes' if len(given) == 1 else 'go'} with the simulated engines, not --http "
              "(stand-in engines behind the proxy)", file=sys.stderr)  # fmt: skip
        return 2
    if not args.http and args.http_turns != defaults.http_turns:
        print("kvbridge demo: --http-turns goes with --http", file=sys.stderr)
        return 2
    if args.cluster == 1:
        print("kvbridge demo: --cluster 1 is one server (a cluster needs 2 or more nodes to fail over to)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.num_blocks is None:
        args.num_blocks = 2048 if args.http else 16384
    if args.prefill_ms_per_block is None:
        args.prefill_ms_per_block = 2.0
    elif not args.http:
        print("kvbridge demo: --prefill-ms-per-block goes with --http (the simulated engines are timed by "
              "the replay's engine model)", file=sys.stderr)  # fmt: skip
        return 2
    if args.http:
        from kvbridge.tools.demo_http import run_http_demo

        return _run_to_the_end(run_http_demo(args))
    from kvbridge.tools.demo import run_demo

    return _run_to_the_end(run_demo(args))


# --- auth-config -----------------------------------------------------------------------------------


def _auth_parser(sub: Any) -> None:
    a = sub.add_parser(
        "auth-config",
        help="print a least-privilege nats-server authorization block for one model's workers and routers",
        description="Print a nats-server 'authorization' block: one user per worker and router of MODEL, each "
        "allowed exactly the subjects kvbridge uses (docs/security.md). Include it in nats-server.conf.",
    )
    a.add_argument("--model", required=True, help="model name (sanitised as in subjects)")
    a.add_argument("--workers", required=True, help="worker ids, comma-separated (each becomes a user)")
    a.add_argument("--routers", default="", help="router / index-service names, comma-separated")
    a.add_argument("--jetstream", action="store_true", help="add the JetStream API subjects each role needs")
    a.add_argument("--prefix", default="kv", help="subject prefix (default kv)")
    a.add_argument("--stream-name", default="KV_EVENTS", help="JetStream stream name (default KV_EVENTS)")
    a.add_argument("--password-env", metavar="VAR", help="write passwords as $VAR_<USER>, read by nats-server from "
                   "its environment, instead of generating random ones")  # fmt: skip


def _auth_config(args: argparse.Namespace) -> int:
    from kvbridge.tools.authconfig import authorization_block

    split = lambda s: [x for x in s.split(",") if x.strip()]  # noqa: E731
    try:
        print(authorization_block(args.model, split(args.workers), split(args.routers), prefix=args.prefix,
                                  jetstream=args.jetstream, stream_name=args.stream_name,
                                  password_env=args.password_env), end="")  # fmt: skip
    except ValueError as exc:
        print(f"kvbridge auth-config: {exc}", file=sys.stderr)
        return 2
    return 0


# --- entry point -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge",
        description="Watch the KV-cache event stream on NATS, relay a stock vLLM/SGLang engine's ZMQ KV events to "
        "NATS, serve overlap queries from a KV index, run a KV-aware OpenAI-compatible gateway (proxy), compare "
        "routing policies by time on a request trace (replay), print least-privilege NATS users (auth-config), or "
        "run the end-to-end demo.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_watch_parser, _relay_parser, _index_parser, _demo_parser, _proxy_parser):
        add(sub)
    from kvbridge.tools import replay_cmd

    replay_cmd.add_parser(sub)
    _auth_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "replay":
            from kvbridge.tools import replay_cmd

            return replay_cmd.run(args)
        run = {"watch": _watch, "relay": _relay, "index": _index, "proxy": _proxy}.get(args.command)
        if run is not None:
            return asyncio.run(run(args))
        return _auth_config(args) if args.command == "auth-config" else _demo(args)
    except ConfigError as exc:
        print(f"kvbridge: configuration error: {exc}", file=sys.stderr)
        return 2
    except Error as exc:
        # kvbridge's own refusals (connect, auth, permissions, JetStream, local server) are for the
        # user to fix, not bugs: one line, no traceback.
        print(f"kvbridge: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
