"""The replay's event loop: a fleet of simulated engines in virtual time, and the signals a router
gets from it, each as production delivers it.

Time jumps from one instant to the next at which something happens. At each instant, as Dynamo's
replay does (``aisimulate-core`` ``replay/agg.rs``: ``process_completed_pass``,
``release_ready_arrivals``, ``drive_ready_workers``): passes that end now hand out their tokens
and their KV events first, then the requests arriving now are routed, then every idle worker with
work starts a pass. A request routed to a busy worker waits for its next pass.

What the policy hears (:class:`~kvbridge.replay.policies.Policy`):

* the engines' KV events, one msgpack ``KVEventBatch`` per pass and worker, exactly the bytes a
  :class:`~kvbridge.KvEventPublisher` would publish, ``event_lag_ms`` after the pass ended;
* a :class:`~kvbridge.LoadReport` per worker every ``report_interval_ms`` (KV-cache usage,
  running, waiting), as the vLLM plugin publishes them;
* its own decisions, each request's first token and its end.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvbridge._native import encode_records
from kvbridge.replay.engine import Engine, EngineConfig, Seq
from kvbridge.replay.trace import Request
from kvbridge.wire.events import LoadReport

__all__ = ["FleetConfig", "Fleet", "simulate"]


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """``workers`` engines of ``engine``'s kind; arrivals are the trace's divided by
    ``arrival_speedup``; KV events reach the router ``event_lag_ms`` after their pass ends; load
    reports every ``report_interval_ms`` (0: none)."""

    workers: int = 4
    engine: EngineConfig = EngineConfig()
    arrival_speedup: float = 1.0
    event_lag_ms: float = 0.0
    report_interval_ms: float = 100.0

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers <= 0:
            raise ValueError(f"workers must be a positive int, got {self.workers!r}")
        for name in ("arrival_speedup",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("event_lag_ms", "report_interval_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


class Fleet:
    """The engines and their names, as a policy sees them."""

    def __init__(self, config: FleetConfig, *, events: bool) -> None:
        self.config = config
        self.engines = [Engine(i, config.engine, events=events) for i in range(config.workers)]
        self.names = [f"worker-{i}" for i in range(config.workers)]
        self.now = 0.0  # ms
        #: (ms, [queued prompt tokens per worker]) when simulate() samples them
        self.samples: list[tuple[float, list[int]]] = []

    def report(self, i: int) -> LoadReport:
        """What worker ``i``'s vLLM plugin would report now (``ts`` in virtual seconds)."""
        e = self.engines[i]
        usage = 1.0 - e.pool.num_free_blocks / e.config.num_blocks
        return LoadReport(
            ts=self.now / 1000.0, kv_cache_usage=usage, running=len(e.running), waiting=len(e.waiting),
            interval_s=self.config.report_interval_ms / 1000.0,
        )


def simulate(
    requests: Sequence[Request],
    policy: Any,
    config: FleetConfig,
    *,
    progress: Callable[[int], None] | None = None,
    sample_ms: float = 0.0,
) -> tuple[list[Seq], Fleet, float]:
    """Replays ``requests`` through ``policy``; ``(requests' outcomes, the fleet, wall seconds)``.
    ``progress(n)`` is called as requests complete (every 1% or so). ``sample_ms`` > 0: every
    that many simulated ms, each worker's queued prompt tokens go to ``fleet.samples``."""
    started = time.perf_counter()
    fleet = Fleet(config, events=policy.needs_events)
    engines = fleet.engines
    policy.attach(fleet)
    speed = config.arrival_speedup
    if requests and not math.isfinite(requests[-1].arrival_ms / speed):
        raise ValueError(f"request {len(requests)} arrives {requests[-1].arrival_ms:g} ms after the first: divided by "
                         f"arrival_speedup {speed:g}, past a float's range")  # fmt: skip
    seqs = [Seq(r) for r in requests]
    arrivals = deque(seqs)
    ends: list[tuple[float, int]] = []  # (pass end ms, worker)
    lag = config.event_lag_ms
    pending_events: deque[tuple[float, int, bytes]] = deque()
    wants_events = policy.needs_events
    interval = config.report_interval_ms if policy.needs_reports else 0.0
    next_report = 0.0 if interval else float("inf")
    route, first_token, finished_cb = policy.route, policy.first_token, policy.finished
    apply_events = policy.events
    completed = 0
    step = max(1, len(seqs) // 100)
    inf = float("inf")
    next_sample = 0.0 if sample_ms > 0 else inf
    while arrivals or ends:
        t_arr = arrivals[0].req.arrival_ms / speed if arrivals else inf
        t_end = ends[0][0] if ends else inf
        now = t_arr if t_arr < t_end else t_end
        while next_sample <= now:
            fleet.samples.append((next_sample, [e.queued_tokens() for e in engines]))
            next_sample += sample_ms
        if next_report <= now:
            # Reports are taken on their own clock; between two instants nothing changes, so
            # the fleet's state now is the state at each report time passed.
            fleet.now = next_report
            for i in range(len(engines)):
                policy.load_report(i, fleet.report(i))
            next_report += interval * (1 + (now - next_report) // interval)
        fleet.now = now
        # 1. passes ending now: their KV events, first tokens, completions
        while ends and ends[0][0] == now:
            _, i = heapq.heappop(ends)
            e = engines[i]
            first, finished = e.end_pass(now)
            if wants_events:
                rec = e.pool.take_record()
                if len(rec):
                    payload = encode_records([rec], now / 1000.0, None)
                    assert payload is not None  # no LoRA, one group: the native encoder writes it
                    if lag:
                        pending_events.append((now + lag, i, payload))
                    else:
                        apply_events(i, payload)
            for seq in first:
                first_token(seq)
            for seq in finished:
                finished_cb(seq)
            if finished:
                completed += len(finished)
                if progress is not None and completed % step < len(finished):
                    progress(completed)
        # 2. arrivals now
        if arrivals and t_arr == now:
            while pending_events and pending_events[0][0] <= now:
                _, i, payload = pending_events.popleft()
                apply_events(i, payload)
            while arrivals and arrivals[0].req.arrival_ms / speed == now:
                seq = arrivals.popleft()
                seq.routed_ms = now
                w = route(seq)
                seq.worker = w
                if not engines[w].enqueue(seq):
                    finished_cb(seq)  # refused: the router hears its end at once
        # 3. idle workers with work start a pass (a request that can never fit is refused: the
        # router hears its end)
        for e in engines:
            if not e.busy and e.has_work():
                duration, refused = e.start_next(now)
                if duration is not None:
                    heapq.heappush(ends, (now + duration, e.index))
                for seq in refused:
                    finished_cb(seq)
    if progress is not None:
        progress(completed)
    return seqs, fleet, time.perf_counter() - started
