"""What the gateway (:mod:`kvbridge.routing.proxy`) knows about its upstreams: which worker is
served at which URL and DP rank, which ones are backing off after a failure, the prompt token
ids it already asked an engine for, and its Prometheus metrics."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ProxyMetrics", "Target", "TokenCache", "Upstreams", "parse_worker"]


@dataclass(frozen=True)
class Target:
    """Where one worker's requests go: its API server's base URL, and the DP rank to pin with
    vLLM's ``X-data-parallel-rank`` header (None: no header, the server picks)."""

    url: str
    dp_rank: int | None = None


def parse_worker(spec: str) -> tuple[str, Target]:
    """``ID=URL`` or ``ID=URL@RANK`` (``--worker``) -> ``(worker id, Target)``; ValueError says why not."""
    worker, sep, rest = spec.partition("=")
    if not sep or not worker or not rest:
        raise ValueError(f"--worker {spec!r}: expected ID=URL or ID=URL@RANK, e.g. host-dp0=http://10.0.0.5:8000@0")
    url, at, rank = rest.rpartition("@")
    if not at or not rank.isdigit():
        url, rank = rest, ""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--worker {spec!r}: the URL must start with http:// or https://")
    return worker, Target(url.rstrip("/"), int(rank) if rank else None)


class Upstreams:
    """Worker -> :class:`Target`: ``static`` ones (``--worker``, which win) and those learned from
    load reports that carry a URL. A worker that failed is *down* for ``down_s`` seconds and not
    offered, unless every worker is down (then all are: trying beats refusing).

    Learned workers are kept while NATS is down -- the last known fleet keeps serving -- and
    forgotten when no report of theirs was heard for ``forget_s`` while NATS is up (counted from
    NATS coming back, so that a fleet reports again before it is forgotten), whether their last
    report is still in ``loads`` or the subscriber has dropped them."""

    def __init__(self, static: Mapping[str, Target] | None = None, *, down_s: float = 5.0, forget_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.clock = clock
        self.static = dict(static or {})
        self.learned: dict[str, Target] = {}
        self.down_s, self.forget_s = down_s, forget_s
        self._down_until: dict[str, float] = {}
        self._heard: dict[str, float] = {}  # learned worker -> monotonic time of its latest report
        self._up_since: float | None = None  # monotonic time NATS was last seen coming up

    def learn(self, loads: Mapping[tuple[str, str], tuple[Any, float]], model: str, nats_up: bool) -> None:
        """Take workers from a subscriber's ``loads`` (``{(model, worker): (LoadReport, age)}``)."""
        now = self.clock()
        for (m, worker), (report, age) in loads.items():
            url = getattr(report, "url", None)
            if m != model or not url:
                continue
            self.learned[worker] = Target(url.rstrip("/"), report.dp_rank)
            self._heard[worker] = now - age
        if not nats_up:
            self._up_since = None
            return
        if self._up_since is None:
            self._up_since = now
        for worker, heard in list(self._heard.items()):
            if now - max(heard, self._up_since) > self.forget_s:
                del self._heard[worker]
                self.learned.pop(worker, None)

    @property
    def all(self) -> dict[str, Target]:
        return {**self.learned, **self.static}

    def up(self) -> dict[str, Target]:
        """The workers to offer the router now (see the class doc)."""
        everyone = self.all
        now = self.clock()
        live = {w: t for w, t in everyone.items() if self._down_until.get(w, 0.0) <= now}
        return live or everyone

    def mark_down(self, worker: str) -> None:
        self._down_until[worker] = self.clock() + self.down_s

    def is_down(self, worker: str) -> bool:
        return self._down_until.get(worker, 0.0) > self.clock()


class TokenCache:
    """A bounded LRU of prompt -> token ids (what an engine's ``/tokenize`` answered)."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"the tokenize cache size must be >= 0, got {size}")
        self.size = size
        self._items: OrderedDict[Hashable, list[int]] = OrderedDict()

    def get(self, key: Hashable) -> list[int] | None:
        tokens = self._items.get(key)
        if tokens is not None:
            self._items.move_to_end(key)
        return tokens

    def put(self, key: Hashable, tokens: list[int]) -> None:
        if not self.size:
            return
        self._items[key] = tokens
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


# Seconds: from a cache hit (microseconds) to an engine's /tokenize or first byte under load.
_TIME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class ProxyMetrics:
    """The gateway's metrics, in a registry of its own (several proxies in one process -- tests --
    do not collide); ``/metrics`` serves it with the default registry (the subscriber's)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvbridge_proxy_requests", "Requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)  # fmt: skip
        self.choices = Counter("kvbridge_proxy_worker_choices", "Requests forwarded, by worker", ["worker"], registry=r)
        self.overlap = Histogram("kvbridge_proxy_overlap_blocks", "Prompt blocks the chosen worker held cached",
                                 buckets=_BLOCK_BUCKETS, registry=r)  # fmt: skip
        self.tokenize = Histogram("kvbridge_proxy_tokenize_seconds", "Time to the prompt's token ids, by source "
                                  "(cache, local, engine)", ["source"], buckets=_TIME_BUCKETS, registry=r)  # fmt: skip
        self.ttfb = Histogram("kvbridge_proxy_upstream_ttfb_seconds", "From forwarding to the upstream's first body "
                              "byte (streams) or whole answer", buckets=_TIME_BUCKETS, registry=r)  # fmt: skip
        self.retries = Counter("kvbridge_proxy_retries", "Requests sent again to the next-best worker", registry=r)
        self.errors = Counter("kvbridge_proxy_errors", "Failures, by kind", ["kind"], registry=r)
        self.nats = Gauge("kvbridge_proxy_nats_connected", "1 while the proxy hears NATS (KV-aware routing), 0 "
                          "while it routes by load alone among the last known workers", registry=r)  # fmt: skip
        self.workers = Gauge("kvbridge_proxy_workers", "Workers known, by state", ["state"], registry=r)
