"""KV-aware worker choice: the worker that would give the prompt its first token soonest.

The default cost (``cost="time"``) is a predicted time to first token in ms
(:mod:`kvbridge.routing.work`)::

    cost(w) = T(queued(w) + weight * uncached(w)),  weight = overlap_weight * (1 + backlog_weight * backlog)

``uncached(w)``: the prompt's tokens ``w`` does not hold, its hit counted as vLLM counts it
(at most ``floor((L - 1) / block_size)`` blocks); ``queued(w)``: the prompt tokens routed to
``w`` that have not produced their first token yet, drained as the engine computes them
between signals (a pass's fixed cost included); ``T``: the engine model's time for that many prompt tokens, its passes slowed by the
decode steps of ``w``'s active requests; ``backlog``: the shortest queue among the candidates, in
passes (when every worker has one, prefill added anywhere also delays the requests that will
queue behind it, so the prompt's own work weighs more). The signals are the production ones: the index's
overlap scores (and provisional residency), the router's own decisions, each request's first
token (:meth:`Router.first_token`) and end (:meth:`Router.done`), and, when given
(``reports=``), the workers' LoadReports (KV-cache use, running requests).

The cost before it (``cost="blocks"``, Dynamo-style): for a request of ``B`` full blocks, a
worker that already holds the first ``overlap`` of them costs
``overlap_weight * (B - overlap) + load``, load in requests. Requests against blocks: long
prefills pile onto the worker holding their prefix, whatever its queue (docs/routing.md).

``overlap`` counts a block at the best storage tier that holds it (``medium_weights``: GPU 1.0,
CPU 0.75, DISK and STORAGE 0.25 by default, as Dynamo weighs them): a prefix held on the GPU for
2 blocks and in CPU memory for 6 counts ``2 * 1.0 + 4 * 0.75 = 5`` blocks, since loading from a
slower tier is cheaper than recomputing but not free. Blocks an event marked
``locality="REMOTE"`` are not credited unless ``remote=True``. The lowest cost wins; ties go to a
seeded random pick among the tied workers, so runs repeat. With ``temperature > 0`` the choice
is sampled instead, ``P(w) ∝ exp(-c'(w) / temperature)`` over the costs rescaled to
``c' = (cost - min) / (max - min)`` in [0, 1] (as Dynamo's softmax sampling does), which spreads
load among near-equal workers; still deterministic for a given ``seed``.

    >>> router = Router(index)                        # a kvbridge.Index fed by a KvEventSubscriber
    >>> with router.route(prompt_ids) as (worker, overlap):
    ...     send(worker, prompt)                       # in flight until the block exits
    ...     router.first_token(worker)                 # when its first token streams back
"""

from __future__ import annotations

import math
import operator
import random
import threading
import time
import uuid
from contextlib import contextmanager
from collections.abc import Mapping
from typing import Any, Callable, Hashable, Iterable, Iterator, Literal, NamedTuple, Sequence

from kvbridge._native import Index, RouterCore
from kvbridge.errors import Error
from kvbridge.routing.provisional import ProvisionalResidency
from kvbridge.routing.work import EngineModel, hit_tokens
from kvbridge.wire.hashing import hash_blocks

__all__ = [
    "DEFAULT_MEDIUM_WEIGHTS", "Decision", "EngineModel", "NoWorkersError", "ReportLoads", "Router", "report_loads",
    "softmax_probabilities", "tiered_overlap",
]

Loads = Mapping[str, float] | Callable[[str], "float | None"]
#: ``{worker: leading blocks}`` or, per storage tier, ``{worker: {medium: leading blocks}}``.
Scores = Mapping[str, "int | Mapping[str | None, int]"]

#: Dynamo's tier weights. A medium not named here counts as the lowest of them; ``None`` (engines
#: that do not say) is the GPU, vLLM's default medium.
DEFAULT_MEDIUM_WEIGHTS: Mapping[str, float] = {"GPU": 1.0, "CPU": 0.75, "DISK": 0.25, "STORAGE": 0.25}


_NO_WORKERS = (
    "no workers to route to: the index knows none yet (no events received) and no candidates were given "
    "(Router(workers=...) or choose(..., workers=...))"
)

#: A peer's request still counts in its worker's load for at most this long without its "done"
#: (the peer may have died with it in flight).
PEER_IN_FLIGHT_MAX_S = 600.0



class Decision(NamedTuple):
    """A routing decision (``op="route"``) or its end (``op="done"``), as replicas share them:
    which router (``replica``, its ``id`` for it), which worker, when (the router's ``clock``:
    wall-clock seconds by default, which replicas compare with their own, so a router shared
    through :class:`~kvbridge.routing.sync.RouteSync` keeps the default clock) and the prompt's
    :meth:`Router.block_keys`."""

    op: Literal["route", "done"]
    replica: str
    id: int
    worker: str
    ts: float
    keys: list[int]


class NoWorkersError(Error, LookupError):
    """There is no worker to route to: the index knows none and none were given."""


def _as_int(value: Any) -> Any:
    """``value`` as a Python int when it is an integer of another type (numpy's); else as it is."""
    return operator.index(value) if not isinstance(value, int) and hasattr(value, "__index__") else value


def _check_number(name: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def tiered_overlap(by_medium: Mapping[str | None, int], weights: Mapping[str, float]) -> float:
    """Leading blocks held, each counted at the best tier holding it: ``by_medium`` gives per
    medium how many leading blocks it holds, so block ``i`` is worth the largest weight among the
    media holding more than ``i`` blocks. (The router's core applies this rule natively,
    rust/route/scoring.rs; tests/test_router_native.py holds the two to the same figures.)"""
    lowest = min(weights.values(), default=0.0)
    tiers = sorted(
        ((n, weights.get("GPU" if m is None else m, lowest)) for m, n in by_medium.items() if n > 0),
        reverse=True,
    )
    # Sorted deepest first: the stretch (next tier's reach, this tier's reach] is held by this
    # tier and every deeper one, so it is worth the best weight seen so far.
    total, best = 0.0, 0.0
    for i, (n, w) in enumerate(tiers):
        best = max(best, w)
        below = tiers[i + 1][0] if i + 1 < len(tiers) else 0
        total += best * (n - below)
    return total


def softmax_probabilities(costs: Mapping[str, float], temperature: float) -> dict[str, float]:
    """Sampling probability per worker: ``exp(-c'/temperature)`` normalised, ``c'`` the costs
    rescaled to [0, 1] (all equal costs: uniform)."""
    _check_number("temperature", temperature, positive=True)
    if not costs:
        return {}
    lo, hi = min(costs.values()), max(costs.values())
    span = hi - lo
    weights = {w: math.exp(-((c - lo) / span if span else 0.0) / temperature) for w, c in costs.items()}
    total = sum(weights.values())
    return {w: x / total for w, x in weights.items()}


class Router:
    """Chooses a worker per request from an index's overlap scores and the workers' load.

    ``index``: a :class:`kvbridge.Index`, or anything with ``workers`` and ``find_matches(tokens, *,
    lora_name, extra_keys, by_medium, remote)`` answering as it does (``by_medium=True``:
    ``{worker: {medium: leading blocks held there}}``); ``None`` if only
    :meth:`choose_scores` is used (scores from an :class:`kvbridge.IndexClient`).
    ``block_size``: tokens per block (default: ``index.block_size``).
    ``loads`` (``cost="blocks"`` only): a mapping worker -> load, or a callable ``load(worker)``
    returning a number or None; a worker it has no number for is weighed by the router's own
    in-flight count.
    ``workers``: candidates besides those the index knows (a worker with nothing cached yet).
    ``medium_weights``: what a block held in each storage tier is worth against one to prefill
    (default :data:`DEFAULT_MEDIUM_WEIGHTS`); ``remote``: credit blocks whose events said
    ``locality="REMOTE"`` (default False: a block on another node is not this worker's).

    ``cost``: ``"time"`` (default; the module doc) or ``"blocks"`` (the cost before it, with
    ``loads``). ``engine``: the engines' :class:`EngineModel` for the time cost (default: Dynamo
    1.6.1's replay model of a vLLM engine). ``reports``: for the time cost, the workers'
    latest :class:`kvbridge.LoadReport` s: a :class:`ReportLoads` (read in bulk each time its
    reports refresh: the fast path) or its :meth:`ReportLoads.report`, or any callable
    ``report(worker)`` returning a report or None (asked per candidate, per decision); while it says requests are running, its KV-cache use sets the
    decode step a prompt's passes share there, beside the router's own accounting. ``backlog_weight``: how much more the
    prompt's own uncached work weighs per pass of backlog on the least loaded worker (when every
    worker has a backlog, work added anywhere delays the requests queueing behind it; 0: the
    plain predicted TTFT). ``clock``: the time in seconds
    (default ``time.time``; a replay passes its virtual clock).

    ``provisional_ttl_s``: how long a choice counts as the chosen worker holding the request's
    full blocks before its own events say so (:mod:`kvbridge.routing.provisional`; 0 turns it
    off); ``max_provisional`` bounds those entries; a worker whose cache the index saw cleared
    (``Index.clears``) loses them. ``subscriber`` (a
    :class:`kvbridge.KvEventSubscriber` feeding ``index``) tells which workers' streams are exact
    and which are being repaired, and which restarted (see :attr:`stats`); ``model`` picks its
    workers when it follows several models.

    Load (``cost="blocks"``): with ``loads=report_loads(...)`` a worker's load is its freshest report's running +
    waiting plus the requests routed to it after those gauges were read and still in flight
    (this router's, and its peers' with :class:`kvbridge.routing.sync.RouteSync`); with other
    ``loads`` the number as given; without a number, the requests in flight.
    """

    #: Settings the native core takes at construction: assigning one later is refused (it would
    #: not reach the core).
    FIXED = frozenset({
        "index", "block_size", "overlap_weight", "temperature", "workers", "medium_weights", "remote", "subscriber",
        "cost", "engine", "backlog_weight", "reports", "clock", "provisional",
    })  # fmt: skip

    def __setattr__(self, name: str, value: Any) -> None:
        if name in Router.FIXED and "_core" in self.__dict__:
            raise AttributeError(
                f"Router.{name} is fixed at construction (the router's native core holds it): make a new Router"
            )
        object.__setattr__(self, name, value)

    def __init__(
        self,
        index: Any = None,
        *,
        block_size: int | None = None,
        overlap_weight: float = 1.0,
        loads: Loads | None = None,
        temperature: float = 0.0,
        seed: int | None = 0,
        workers: Iterable[str] = (),
        medium_weights: Mapping[str, float] | None = None,
        remote: bool = False,
        provisional_ttl_s: float = 2.0,
        max_provisional: int = 100_000,
        subscriber: Any = None,
        model: str | None = None,
        cost: Literal["time", "blocks"] = "time",
        engine: EngineModel | None = None,
        backlog_weight: float = 2.0,
        reports: "ReportLoads | Callable[[str], Any] | None" = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if block_size is None:
            block_size = getattr(index, "block_size", None)
            if block_size is None:
                raise ValueError("block_size is required when the index does not say its block size")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        held_in = getattr(index, "block_size", None)
        if isinstance(held_in, int) and held_in != block_size:  # overlaps would be in the index's blocks
            raise ValueError(f"block_size {block_size} differs from the index's ({held_in}): the overlaps it answers "
                             f"count its blocks")  # fmt: skip
        if loads is not None and not (isinstance(loads, Mapping) or callable(loads)):
            raise TypeError(f"loads must be a mapping worker -> load or a callable, got {type(loads).__name__}")
        if cost not in ("time", "blocks"):
            raise ValueError(f"cost must be 'time' or 'blocks', got {cost!r}")
        if cost == "time" and loads is not None:
            raise ValueError(
                "loads= (requests per worker) weighs the 'blocks' cost; the time cost reads LoadReports "
                "through reports= (e.g. report_loads(subscriber).report): pass cost='blocks' to keep loads"
            )
        if engine is not None and not isinstance(engine, EngineModel):
            raise TypeError(f"engine must be an EngineModel, got {type(engine).__name__}")
        if reports is not None and not callable(reports):
            raise TypeError(f"reports must be a callable worker -> LoadReport | None, got {type(reports).__name__}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable () -> seconds, got {type(clock).__name__}")
        self.cost = cost
        self.backlog_weight = _check_number("backlog_weight", backlog_weight)
        self.engine = EngineModel() if engine is None else engine
        self.reports = reports
        self.clock = clock
        self.index = index
        self.block_size = block_size
        self.overlap_weight = _check_number("overlap_weight", overlap_weight)
        self.temperature = _check_number("temperature", temperature)
        self.loads = loads
        self.workers = tuple(_check_worker("workers", w) for w in _names("workers", workers))
        if medium_weights is None:
            medium_weights = DEFAULT_MEDIUM_WEIGHTS
        if not isinstance(medium_weights, Mapping) or not medium_weights:
            raise TypeError(f"medium_weights must be a non-empty mapping medium -> weight, got {medium_weights!r}")
        for m in medium_weights:
            if not isinstance(m, str) or not m:
                raise TypeError(f"medium_weights: a medium is a non-empty str, got {m!r}")
        self.medium_weights = {m: _check_number(f"medium_weights[{m!r}]", w) for m, w in medium_weights.items()}
        if not isinstance(remote, bool):
            raise TypeError(f"remote must be a bool, got {remote!r}")
        self.remote = remote
        self.provisional = ProvisionalResidency(provisional_ttl_s, max_entries=max_provisional, clock=clock)
        self._provisional_on = self.provisional.enabled
        # Decided in one native call (no subscriber to read worker states from, no sampling).
        self._simple = cost == "time" and self.temperature == 0 and subscriber is None
        self.subscriber = subscriber
        self.model = model
        #: This router's name among replicas sharing decisions (RouteSync).
        self.replica = uuid.uuid4().hex[:12]
        self._rng = random.Random(seed)
        # Reentrant: load() and routed_since() are public and also asked during a decision.
        self._lock = threading.RLock()
        # The state and the hot path: native (kvbridge._native.RouterCore), one call a decision.
        eng = self.engine
        self._core = RouterCore(
            index, self.provisional, block_size=block_size, time=cost == "time", prefill=eng.prefill,
            decode=eng.decode, max_num_batched_tokens=eng.max_num_batched_tokens,
            kv_capacity_tokens=eng.kv_capacity_tokens, overlap_weight=self.overlap_weight,
            backlog_weight=self.backlog_weight, remote=remote, medium_weights=list(self.medium_weights.items()),
            workers=list(self.workers),
        )  # fmt: skip
        # A kvbridge.Index is read by the core itself; another index answers find_matches here.
        self._native_index = isinstance(index, Index)
        # LoadReports: a ReportLoads is read in bulk when its reports refresh; another callable
        # is asked per candidate.
        source = getattr(reports, "__self__", None)
        self._report_source = source if isinstance(source, ReportLoads) and reports == source.report else None
        if isinstance(reports, ReportLoads):
            self._report_source = reports
        self._reports_seen: Any = None
        self._reports_read = -math.inf
        self._reports_every = 0.0 if self._report_source is None else self._report_source.refresh_s
        if reports is not None and self._report_source is None:
            self._core.report_fn = reports
        # Request ids <-> the decisions they were routed by (only when callers name requests).
        self._requests: dict[Hashable, int] = {}
        self._request_of: dict[int, Hashable] = {}
        # Peers' requests in flight: (replica, decision id) -> (worker, wall-clock time).
        self._peer_sent: dict[tuple[str, int], tuple[str, float]] = {}
        self._epochs: dict[str, str | None] = {}
        #: Called with each :class:`Decision` this router makes or ends (RouteSync publishes them).
        self.listeners: list[Callable[[Decision], None]] = []
        self._counts = {"peer_decisions": 0, "peer_dones": 0, "restarts_seen": 0}

    # -- scoring --------------------------------------------------------------------------------

    @property
    def in_flight(self) -> dict[str, int]:
        """``{worker: requests chosen and not yet done}``."""
        # Under the lock: a decision holds the core while it may wait for the index's lock
        # with the GIL released (a long prompt).
        with self._lock:
            return self._core.in_flight()

    def load(self, worker: str) -> float:
        """The load term of ``worker``'s cost (``cost="blocks"``)."""
        with self._lock:
            return self._load(worker)

    def _load(self, worker: str) -> float:
        loads = self.loads
        value = None
        if loads is not None:
            value = loads.get(worker) if type(loads) is dict or isinstance(loads, Mapping) else loads(worker)
        if value is None:
            return float(self._core.in_flight().get(worker, 0) + self._peer_count(worker, -math.inf))
        load = _check_number(f"load of worker {worker!r}", value)
        as_of = getattr(loads, "as_of", None)
        if as_of is not None and (since := as_of(worker)) is not None:
            load += self.routed_since(worker, since)
        return load

    def routed_since(self, worker: str, ts: float) -> int:
        """Requests sent to ``worker`` after time ``ts`` (the router's clock) and still in
        flight (this router's and its peers'): what a load report taken at ``ts`` does not
        count yet."""
        with self._lock:
            return self._core.routed_since(worker, ts) + self._peer_count(worker, ts)

    def _peer_count(self, worker: str, ts: float) -> int:
        if not self._peer_sent:
            return 0
        horizon = time.time() - PEER_IN_FLIGHT_MAX_S
        stale = [key for key, (_, t) in self._peer_sent.items() if t < horizon]
        for key in stale:  # a peer that died with requests in flight never says they are done
            del self._peer_sent[key]
        return sum(1 for w, t in self._peer_sent.values() if w == worker and t > ts)

    def costs_from_scores(
        self,
        scores: Scores,
        num_blocks: int,
        workers: Sequence[str] | None = None,
        *,
        num_tokens: int | None = None,
    ) -> dict[str, float]:
        """``{worker: cost}`` for a request of ``num_blocks`` full blocks (``num_tokens`` tokens:
        default ``num_blocks * block_size``) with these overlaps (per worker a block count, or
        ``{medium: block count}`` as ``by_medium`` answers give), as they are (no provisional
        residency)."""
        num_blocks, num_tokens = self._sizes(num_blocks, num_tokens)
        with self._lock:
            return self._decide(None, _as_dict(scores), num_blocks, num_tokens, None, None, None, workers, False,
                                costs_only=True)[0]  # fmt: skip

    def scores(self, tokens: Sequence[int], *, lora_name: str | None = None, extra_keys: Any = None) -> dict[str, int]:
        """``{worker: leading blocks held}`` in any medium (what the index answers by default)."""
        return self._index().find_matches(tokens, lora_name=lora_name, extra_keys=extra_keys, remote=self.remote)

    def tier_scores(
        self, tokens: Sequence[int], *, lora_name: str | None = None, extra_keys: Any = None
    ) -> dict[str, dict[str | None, int]]:
        """``{worker: {medium: leading blocks held there}}``: what :meth:`costs` and
        :meth:`choose` weigh with ``medium_weights``."""
        return self._index().find_matches(
            tokens, lora_name=lora_name, extra_keys=extra_keys, by_medium=True, remote=self.remote
        )

    def _hit_part(self, tokens: Sequence[int], lora_name: str | None, extra_keys: Any,
                  want_keys: bool) -> tuple[Any, list[int] | None]:  # fmt: skip
        """The Python path's ask, as the native core asks a kvbridge.Index: the scores by tier
        and (``want_keys``) the block keys of the part of the prompt vLLM can hit
        (:func:`~kvbridge.routing.work.hit_tokens`)."""
        part = hit_tokens(tokens, self.block_size)
        if extra_keys is not None and len(part) < len(tokens):
            extra_keys = extra_keys[: len(part) // self.block_size]
        scores = self.tier_scores(part, lora_name=lora_name, extra_keys=extra_keys)
        return scores, self.block_keys(part, lora_name=lora_name, extra_keys=extra_keys) if want_keys else None

    def _index(self) -> Any:
        if self.index is None:
            raise ValueError("this router has no index: use choose_scores() with scores from an IndexClient")
        return self.index

    def block_keys(self, tokens: Sequence[int], *, lora_name: str | None = None, extra_keys: Any = None) -> list[int]:
        """The keys provisional residency records for a prompt's full blocks (the chained xxh3
        hash a token-keyed ``Index`` uses; replicas agree on them whatever the engines hash)."""
        return hash_blocks(tokens, self.block_size, algo="xxh3", lora_name=lora_name, extra_keys=extra_keys)

    def costs(
        self,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        extra_keys: Any = None,
        workers: Sequence[str] | None = None,
    ) -> dict[str, float]:
        """``{worker: cost}`` for this prompt (what :meth:`choose` minimises)."""
        if not self._native_index:
            scores, keys = self._hit_part(tokens, lora_name, extra_keys, True)
            n = len(tokens)
            with self._lock:
                return self._decide(None, _as_dict(scores), n // self.block_size, n, keys, None, None, workers, True,
                                    costs_only=True)[0]  # fmt: skip
        with self._lock:
            return self._decide(tokens, None, 0, 0, None, lora_name, extra_keys, workers, True, costs_only=True)[0]

    # -- choosing -------------------------------------------------------------------------------

    def choose(
        self,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        extra_keys: Any = None,
        workers: Sequence[str] | None = None,
        request_id: Hashable | None = None,
    ) -> tuple[str, int]:
        """Pick a worker for this prompt: ``(worker, leading blocks it holds)``, counted as vLLM
        can use them: in the prompt less its last token (:func:`~kvbridge.routing.work.hit_tokens`,
        at most ``floor((L - 1) / block_size)`` blocks). The request is in flight there until
        :meth:`done` (or use :meth:`route`), its prompt queued until :meth:`first_token`, and the
        worker holds those blocks provisionally (``provisional_ttl_s``).

        ``workers``: choose among exactly these (default: the index's workers and the router's
        ``workers``). ``request_id``: names the request in :meth:`first_token` and :meth:`done`
        (default: a worker's requests are taken to finish in the order sent). Raises
        :class:`NoWorkersError` when there is none."""
        use_keys = self._provisional_on or bool(self.listeners)
        if not self._native_index:
            scores, keys = self._hit_part(tokens, lora_name, extra_keys, use_keys)
            n = len(tokens)
            return self.choose_scores(scores, n // self.block_size, workers=workers, keys=keys, num_tokens=n,
                                      request_id=request_id)  # fmt: skip
        with self._lock:
            self._check_new(request_id)
            if self._simple and workers is None:  # the common case: one call
                now = self.clock()
                if self._report_source is not None and abs(now - self._reports_read) >= self._reports_every:
                    self._sync_reports(now)
                made = self._core.decide(tokens, None, 0, 0, None, lora_name, extra_keys, None, now, use_keys,
                                         use_keys and bool(self.listeners), self._rng, None, None, False)  # fmt: skip
                if made is None:
                    raise NoWorkersError(_NO_WORKERS)
            else:
                made, now = self._decide(tokens, None, 0, 0, None, lora_name, extra_keys, workers, use_keys)
            if request_id is not None:
                self._name_request(made, request_id)
        if self.listeners:
            self._tell_route(made, now)
        return made[0], made[1]

    def choose_scores(
        self,
        scores: Scores,
        num_blocks: int,
        *,
        workers: Sequence[str] | None = None,
        keys: Sequence[int] | None = None,
        num_tokens: int | None = None,
        request_id: Hashable | None = None,
    ) -> tuple[str, int]:
        """:meth:`choose` from overlap scores obtained elsewhere (e.g. ``await
        IndexClient.find_matches(hit_tokens(tokens, block_size))``: asked of the part of the
        prompt vLLM can hit, as :meth:`choose` asks) for a request of ``num_blocks`` full blocks
        (``num_tokens`` tokens: what the time cost weighs; default ``num_blocks * block_size``).
        ``keys``: that part's :meth:`block_keys`, for provisional residency (none without)."""
        num_blocks, num_tokens = self._sizes(num_blocks, num_tokens)
        with self._lock:
            self._check_new(request_id)
            made, now = self._decide(None, _as_dict(scores), num_blocks, num_tokens, keys, None, None, workers,
                                     keys is not None)  # fmt: skip
            if request_id is not None:
                self._name_request(made, request_id)
        if self.listeners:
            self._tell_route(made, now)
        return made[0], made[1]

    def _sizes(self, num_blocks: int, num_tokens: int | None) -> tuple[int, int]:
        """``(num_blocks, num_tokens)`` checked, as Python ints (``num_tokens`` default: the
        blocks' tokens)."""
        num_blocks, num_tokens = _as_int(num_blocks), _as_int(num_tokens)  # numpy integers, as arrays give them
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        if num_tokens is None:
            return num_blocks, num_blocks * self.block_size
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < num_blocks * self.block_size:
            raise ValueError(f"num_tokens must be an int >= num_blocks * block_size, got {num_tokens!r}")
        return num_blocks, num_tokens

    def _check_new(self, request_id: Hashable | None) -> None:
        if request_id is not None and request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in flight")

    # Both called only when there is something to do: a decision's own cost is what the fast
    # path of choose() is measured by (bench/router.py).
    def _name_request(self, made: Any, request_id: Hashable) -> None:
        """(Under the lock.) ``request_id`` names decision ``made`` for first_token() and done()."""
        self._requests[request_id] = made[2]
        self._request_of[made[2]] = request_id

    def _tell_route(self, made: Any, now: float) -> None:
        """(Outside the lock: a listener may be slow.) Tells the listeners of decision ``made``."""
        worker, _, ident, keys = made
        self._tell(Decision("route", self.replica, ident, worker, now, keys or []))

    def _decide(
        self,
        tokens: Any,
        scores: dict[str, Any] | None,
        num_blocks: int,
        num_tokens: int,
        keys: Sequence[int] | None,
        lora_name: str | None,
        extra_keys: Any,
        workers: Sequence[str] | None,
        use_keys: bool,
        costs_only: bool = False,
    ) -> tuple[Any, float]:
        """One decision by the core (under the lock): ``(worker, leading, decision id, keys)``
        or, with ``costs_only``, the costs; and the clock's time it was made at."""
        if workers is not None:
            workers = list(_names("workers", workers))
            if not workers:
                raise NoWorkersError("workers is empty: no candidate to route to")
        resyncing = None
        if use_keys and self.subscriber is not None:
            resyncing = [w for w, state in self._states().items() if state == "resyncing"]
        now = self.clock()
        if self._report_source is not None:
            self._sync_reports(now)
        load = None
        if self.cost == "blocks" and (self.loads is not None or self._peer_sent):
            # Every worker that may be a candidate (the core knows the rest by their in-flight count).
            known = set(self._core.workers()).union(scores or (), workers or ())
            if self.index is not None:
                known.update(self.index.workers)
            load = {w: self.load(w) for w in known}
        sample = self.temperature > 0 and not costs_only
        want_keys = bool(self.listeners)
        made = self._core.decide(
            tokens, scores, num_blocks, num_tokens, keys, lora_name, extra_keys, workers, now, use_keys, want_keys,
            self._rng, load, resyncing, costs_only or sample,
        )  # fmt: skip
        if made is None:
            raise NoWorkersError(_NO_WORKERS)
        if sample:  # sampled among all, then made for the one drawn
            probs = softmax_probabilities(made, self.temperature)
            names = list(probs)
            drawn = self._rng.choices(names, weights=[probs[w] for w in names])[0]
            made = self._core.decide(
                tokens, scores, num_blocks, num_tokens, keys, lora_name, extra_keys, [drawn], now, use_keys, want_keys,
                self._rng, load, resyncing, False,
            )  # fmt: skip
        return made, now

    def _sync_reports(self, now: float) -> None:
        """Gives the core the reports of the ReportLoads when they may have refreshed (it reads
        its subscriber at most every ``refresh_s``; the clock read here is the router's)."""
        source = self._report_source
        assert source is not None
        if abs(now - self._reports_read) < self._reports_every:
            return
        self._reports_read = now
        fresh = source._fresh()
        if fresh is not self._reports_seen:
            self._core.set_reports(fresh)
            self._reports_seen = fresh

    def first_token(self, worker: str, request_id: Hashable | None = None) -> None:
        """A request sent to ``worker`` produced its first token (``request_id``; None: its
        oldest request without one): its prompt left the queue, which is reset to the uncached
        prompt tokens of the requests there still waiting for their first token.
        A request not known (already done, or never chosen here) is ignored."""
        with self._lock:
            ident = None
            if request_id is not None and (ident := self._requests.get(request_id)) is None:
                return
            self._core.first_token(worker, ident, self.clock())

    def done(self, worker: str, request_id: Hashable | None = None) -> None:
        """A request sent to ``worker`` finished (``request_id``; None: the oldest of its
        requests counts as the one that finished): it leaves the worker's load."""
        with self._lock:
            if request_id is None:
                ended = self._core.done(worker, None, self.clock())
            else:
                ident = self._requests.get(request_id)
                ended = None if ident is None else self._core.done(worker, ident, self.clock())
            if ended is None:
                if not self._core.in_flight().get(worker):
                    raise ValueError(f"worker {worker!r} has no request in flight")
                raise ValueError(f"request {request_id!r} is not in flight on worker {worker!r}")
            ident, sent = ended
            if self._request_of:
                rid = self._request_of.pop(ident, None)
                if rid is not None:
                    del self._requests[rid]
        if self.listeners:
            self._tell(Decision("done", self.replica, ident, worker, sent, []))

    def _tell(self, decision: Decision) -> None:
        for listener in self.listeners:
            listener(decision)

    # -- peers and worker states ------------------------------------------------------------------

    def apply_peer(self, decision: Decision) -> None:
        """A peer router's decision (see :class:`kvbridge.routing.sync.RouteSync`): its worker
        holds the blocks provisionally for what is left of the TTL, and, under ``cost="blocks"``,
        the request counts in that worker's :meth:`load` until the peer says it is done (the time
        cost learns a peer's work from LoadReports, not from its decisions). This router's own
        decisions are ignored."""
        if decision.replica == self.replica:
            return
        key = (decision.replica, decision.id)
        with self._lock:
            if decision.op == "done":
                if self._peer_sent.pop(key, None) is not None:
                    self._counts["peer_dones"] += 1
                return
            self._counts["peer_decisions"] += 1
            self._peer_sent[key] = (decision.worker, decision.ts)
            if decision.keys:
                age = max(0.0, time.time() - decision.ts)
                self.provisional.add(decision.worker, decision.keys, ttl_s=self.provisional.ttl_s - age)

    def forget_worker(self, worker: str) -> None:
        """``worker`` restarted, cleared its cache or is gone: what it was sent is not there."""
        with self._lock:
            self.provisional.reset(worker)

    def _states(self) -> dict[str, str]:
        """Worker -> "exact" | "resyncing" from the subscriber (empty without one). A worker
        whose epoch changed (it restarted) or that vanished loses its provisional entries."""
        sub = self.subscriber
        if sub is None:
            return {}
        states: dict[str, str] = {}
        epochs: dict[str, str | None] = {}
        for (model, worker), (state, epoch) in sub.worker_states().items():
            if self.model is None or model == self.model:
                states[worker] = state
                epochs[worker] = epoch
        for worker, epoch in self._epochs.items():
            if epochs.get(worker, "gone") != epoch:
                self.provisional.reset(worker)
                self._counts["restarts_seen"] += 1
        self._epochs = epochs
        return states

    @property
    def stats(self) -> dict[str, Any]:
        """Counters (decisions, peer_decisions, peer_dones, restarts_seen), the provisional
        entries' (``provisional_*``), and ``workers``: per candidate worker how its score is
        known -- "exact" (its stream is in order), "resyncing" (a hole or restart being repaired:
        scored by provisional residency only) or "provisional-only" (it never sent events)."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts, decisions=self._core.decisions)
            out.update({f"provisional_{k}": v for k, v in self.provisional.stats.items()})
            out["provisional_entries"] = len(self.provisional)
            states = self._states()
            known = set(self.workers) | set(self._core.in_flight()) | set(states)
            if self.index is not None:
                known.update(self.index.workers)
            if self.subscriber is None and self.index is not None:
                states = dict.fromkeys(self.index.workers, "exact")
            out["workers"] = {w: states.get(w, "provisional-only") for w in sorted(known)}
        return out

    @contextmanager
    def route(
        self,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        extra_keys: Any = None,
        workers: Sequence[str] | None = None,
    ) -> Iterator[tuple[str, int]]:
        """:meth:`choose`, then :meth:`done` when the block exits (normally or not): this
        request's, whatever else the worker serves meanwhile."""
        rid = _RouteBlock()
        worker, overlap = self.choose(tokens, lora_name=lora_name, extra_keys=extra_keys, workers=workers,
                                      request_id=rid)  # fmt: skip
        try:
            yield worker, overlap
        finally:
            self.done(worker, rid)


class _RouteBlock:
    """The request id of one :meth:`Router.route` block (its identity is the id)."""

    __slots__ = ()


class ReportLoads:
    """``reports=`` for a time-cost :class:`Router` (or ``loads=`` with ``cost="blocks"``) from the
    workers' ``LoadReport`` s, as a
    :class:`kvbridge.KvEventSubscriber` collects them (``subscriber.loads``): a worker's load is its
    ``running + waiting`` requests, the same unit as the router's in-flight count, and
    :meth:`as_of` tells the router when its gauges were read, so it adds what it routed there
    since. A worker without a report younger than ``max_age_s`` gets None (the router counts its
    requests in flight). ``model``: the model whose workers are routed (needed when the
    subscriber follows several). The reports are read at most every ``refresh_s`` seconds, not
    once per worker per choice. ``live``: while it returns False (``kvbridge proxy`` passes "NATS
    is connected"), there are no reports: reports stop with the stream, and the router's own
    accounting of what it sent decides."""

    def __init__(
        self,
        subscriber: Any,
        *,
        model: str | None = None,
        max_age_s: float = 5.0,
        refresh_s: float = 0.05,
        live: Callable[[], bool] | None = None,
    ) -> None:
        _check_number("max_age_s", max_age_s, positive=True)
        _check_number("refresh_s", refresh_s)
        if live is not None and not callable(live):
            raise TypeError(f"live must be a callable () -> bool, got {type(live).__name__}")
        self.subscriber = subscriber
        self.model = model
        self.max_age_s = max_age_s
        self.refresh_s = refresh_s
        self.live = live
        self._cache: dict[str, Any] = {}
        self._read_at = -math.inf

    def _fresh(self) -> dict[str, Any]:
        if self.live is not None and not self.live():
            # A new empty dict each time: the router hands the core a changed answer by identity.
            self._read_at = -math.inf  # back up: read afresh, not what was cached before
            self._cache = {}
            return self._cache
        now = time.monotonic()
        if now - self._read_at >= self.refresh_s:
            fresh: dict[str, Any] = {}
            for (m, w), (report, age) in self.subscriber.loads.items():
                if (self.model is None or m == self.model) and age <= self.max_age_s:
                    if w in fresh and self.model is None:
                        raise ValueError(f"worker {w!r} reports load for several models: pass model=")
                    fresh[w] = report
            self._cache = fresh
            self._read_at = now
        return self._cache

    def __call__(self, worker: str) -> float | None:
        found = self._fresh().get(worker)
        return None if found is None else float(found.running + found.waiting)

    def as_of(self, worker: str) -> float | None:
        """The wall-clock time the gauges :meth:`__call__` answers from were read."""
        found = self._fresh().get(worker)
        if found is None:
            return None
        return found.ts if found.gauges_ts is None else found.gauges_ts

    def report(self, worker: str) -> Any:
        """The worker's latest :class:`kvbridge.LoadReport` younger than ``max_age_s``, or None
        (``reports=`` of a time-cost :class:`Router`)."""
        return self._fresh().get(worker)


#: ``report_loads(subscriber, model=...)``: the name the README and the proxy use for a
#: :class:`ReportLoads` over a subscriber's reports.
report_loads = ReportLoads


def _as_dict(scores: Scores) -> dict[str, Any]:
    """Scores as the core reads them: a dict (a worker's per-medium counts may be any mapping)."""
    return scores if type(scores) is dict else dict(scores)


def _names(name: str, workers: Any) -> Any:
    """``workers`` as given, refused if a str (whose letters would each be a worker)."""
    if isinstance(workers, str):
        raise TypeError(f"{name} must be a collection of worker names, not a str: got {workers!r}")
    return workers


def _check_worker(name: str, worker: Any) -> str:
    if not isinstance(worker, str) or not worker:
        raise TypeError(f"{name}: a worker is a non-empty str, got {worker!r}")
    return worker
