"""What a worker's cache holds, as its events say: the rule every view applies, as plain Python.

The package's views run the rule in Rust, in one place: ``_native.ResidencyView`` (rust/view.rs),
the relay's view (``RelayView``, keeping each copy's source event for snapshots) and each worker's
in a subscriber (``WorkerView``, hash-only: ``ResidencyView(sources=False)``). :class:`Residency`
here is its plain-Python executable spec, as ``kvbridge.engine._reference_pool`` is the native
pool's: tests/test_relay_view.py and tests/test_residency.py hold the native view to it on random
hybrid streams, event for event. :func:`view_payload` is how decoded or hand-built events reach a
native view (as msgpack bytes, the one input it reads); :func:`state_events` how a view's state is
said as events.

A worker's cache is several caches: one per ``(medium, group)`` -- a hybrid-attention model keeps
one KV-cache group per attention type (vLLM's ``group_idx``; ``None`` is group 0, as older
engines and SGLang send it), each in every medium it is offloaded to. :class:`Residency` keeps,
per ``(medium, group)``, ``{block hash: copies}`` and, per group, the kind (and sliding window)
its stores announced. The rules (docs/hybrid.md; the Rust ``Index`` reads events by the same, and
so does ``_native.ResidencyView``):

* ``group_idx`` must be an int 0..63 (not a bool): any other event is skipped whole and counted
  (``bad_groups``); it removes nothing elsewhere.
* a store's ``kv_cache_spec_kind`` must be one of vLLM's ``KVCacheSpecKind`` values, else the
  event is skipped (``unknown_kinds``); a window kind needs a window int >= 1, else skipped
  (``bad_windows``). A kind of None leaves the group's kind as it was. Groups of a kind the
  ``Index`` does not score (:data:`UNSCORED_KINDS`) are kept like any other; each store or
  removal in one is counted (``unscored_group_events``), as the ``Index`` counts them.
* vLLM does not de-duplicate physical blocks: every stored block adds a copy, every removal
  drops one, a block is held while it has a copy. A removal of a block not held is counted
  (``unknown_removes``) and changes nothing. The exception is vLLM's full-report-mode
  re-announce (``emit_cached_block_events``: cached prefix blocks sent again from block 0 with
  parent None, no state change): in a worker without window or mamba groups, a parent-None
  store all of whose blocks the ``(medium, group)`` already holds adds no copies. The events
  cannot tell a re-announce from a genuine second copy of a whole chain from block 0; without
  window groups such a copy is rare (a one-block prompt recomputed), with them it is common
  (a window group cut the hit to 0 while the main group held the chain), so there every store
  counts and re-announces over-count.
* ``AllBlocksCleared`` empties every medium and group and forgets the kinds.
* Each group's largest ``block_size`` among the stores not skipped, since the last clear (the
  native view's ``sizes``; not kept by :class:`Residency`, whose ops do not carry it: the tests'
  reference computes it beside it): what a group's blocks are read at when they are said again.

The spec reads events as *ops* (:data:`Op`): what the native scan (``_native.scan_batch_msgpack``)
reports per run of like events, or :func:`ops_of` for decoded events -- the same tuples either
way, so a ``Residency`` built from either is the same (tests/test_residency.py, test_scan.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

import msgspec

from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch

__all__ = [
    "CLEARED",
    "KINDS",
    "MAIN_KINDS",
    "MAX_GROUPS",
    "Op",
    "REMOVED",
    "Residency",
    "STORED",
    "UNSCORED_KINDS",
    "WINDOW_KINDS",
    "kind_event",
    "names_windows",
    "ops_of",
    "state_events",
    "view_payload",
]

MAX_GROUPS = 64
MAIN_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
# Known to vLLM (KVCacheSpecKind), kept in views, left out of the Index's scores. Mamba is not
# among them: the Index scores it as a window of one block (MambaManager's hit).
UNSCORED_KINDS = frozenset({"chunked_local_attention", "encoder_only_attention", "cross_attention", "unknown"})
KINDS = MAIN_KINDS | WINDOW_KINDS | UNSCORED_KINDS | {"mamba"}
#: Groups that cut a worker's hits short, so that a chain stored again from block 0 is a copy.
HYBRID_KINDS = WINDOW_KINDS | {"mamba"}

STORED, REMOVED, CLEARED = 0, 1, 2

#: ``(kind, hashes, medium, group_idx, root, spec_kind, window, n_events)``: consecutive events of
#: one kind with the same medium, group_idx, spec kind and window, in one op. ``root``: how many
#: leading hashes came in a parent-None store (the re-announce candidates); a parent-None store
#: always starts an op of its own, so no op holds two. ``group_idx`` is as sent (checked here).
Op = tuple[int, list[Any], "str | None", Any, int, "str | None", Any, int]

Key = tuple["str | None", int]

COUNTERS = ("bad_groups", "bad_windows", "unknown_kinds", "unscored_group_events", "unknown_removes")


def ops_of(events: Iterable[Any]) -> tuple[list[Op], int]:
    """The scan's ops for decoded events, and the number of block hashes in them."""
    ops: list[Any] = []
    n_blocks = 0
    last: list[Any] | None = None
    for ev in events:
        cls = ev.__class__
        if cls is BlockStored:
            hashes = ev.block_hashes
            group, window = ev.group_idx, ev.kv_cache_spec_sliding_window
            # The classes too: a hand-built event's True must not merge with a 1.
            attrs = (STORED, ev.medium, group, ev.kv_cache_spec_kind, window, group.__class__, window.__class__)
            root = ev.parent_block_hash is None
        elif cls is BlockRemoved:
            group = ev.group_idx
            hashes, attrs, root = ev.block_hashes, (REMOVED, ev.medium, group, None, None, group.__class__, None), False
        elif cls is AllBlocksCleared:
            hashes, attrs, root = [], (CLEARED, None, None, None, None, None, None), False
        else:
            continue
        n_blocks += len(hashes)
        if last is not None and not root and last[0] == attrs:
            last[1].extend(hashes)
            last[2] += 1
        else:
            last = [attrs, list(hashes), 1, len(hashes) if root else 0]
            ops.append(last)
    out: list[Op] = [(a[0], h, a[1], a[2], r, a[3], a[4], n) for a, h, n, r in ops]
    return out, n_blocks


def names_windows(events: Iterable[Any]) -> bool:
    """Whether a batch names a window or mamba group (see :meth:`Residency.store`)."""
    return any(ev.__class__ is BlockStored and ev.kv_cache_spec_kind in HYBRID_KINDS for ev in events)


def kind_event(
    group: int, kind: str, window: int | None, block_size: int = 0, medium: str | None = None
) -> BlockStored:
    """A store of no blocks that announces ``group``'s kind: how a view's state says a kind its
    blocks' events do not (the kind changed since, or the group holds nothing). A pool gives its
    own ``block_size`` and ``medium``, so the event looks like its others."""
    return BlockStored([], None, [], block_size, None, medium, None, group_idx=group, kv_cache_spec_kind=kind,
                       kv_cache_spec_sliding_window=window)  # fmt: skip


def state_events(
    held: dict[Key, dict[Any, int]], kinds: dict[int, tuple[str, int | None]], sizes: dict[int, int] | None = None
) -> list[BlockStored]:
    """A view's state as stores without token ids or parents (for a consumer that keeps hashes, not
    chains): one per ``(medium, group)``, a hash listed once per copy -- the first store into an
    empty ``(medium, group)``, so every copy counts; a placeholder (``block_size`` 0), as an index
    reads one -- then a :func:`kind_event` for each group's kind, carrying the group's largest
    block size when ``sizes`` knows it (a store of no blocks saying only the size for a group
    with no kind), so an index reads a group of larger blocks at its own size."""
    sizes = sizes or {}
    out = [
        BlockStored([h for h, c in blocks.items() for _ in range(c)], None, [], 0, None, medium, None,
                    group_idx=group)  # fmt: skip
        for (medium, group), blocks in held.items()
    ]
    out.extend(kind_event(g, kind, window, sizes.get(g, 0)) for g, (kind, window) in kinds.items())
    out.extend(BlockStored([], None, [], size, None, None, None, group_idx=g)
               for g, size in sizes.items() if g not in kinds and size > 0)  # fmt: skip
    return out


def _wire_safe(ev: Any, lean: bool = False) -> Any:
    """``ev`` as the wire can carry it, read the same by a native view: a ``group_idx`` or window
    that is not an int (a bool, from hand-built events; the wire's decoders never make one) becomes
    one the rule skips and counts alike (group -1: ``bad_groups``; window 0: ``bad_windows`` for
    a window kind, ignored otherwise). ``lean``: without the free-form fields the rule never reads
    (``extra_keys``, ``metadata``), which may nest deeper than the view's reader goes."""
    cls = ev.__class__
    if cls is AllBlocksCleared:
        return ev
    group = ev.group_idx
    if group is not None and group.__class__ is not int:
        ev = msgspec.structs.replace(ev, group_idx=-1)
    if cls is BlockStored:
        window = ev.kv_cache_spec_sliding_window
        if window is not None and window.__class__ is not int:
            ev = msgspec.structs.replace(ev, kv_cache_spec_sliding_window=0)
        if lean and (ev.extra_keys is not None or ev.metadata is not None):
            ev = msgspec.structs.replace(ev, extra_keys=None, metadata=None)
    return ev


def view_payload(events: Iterable[Any], lean: bool = False) -> bytes:
    """Decoded (or hand-built) events as the msgpack batch in vLLM 0.33's shape that a native view
    applies (``ResidencyView.apply``) -- read by the same rule as the events (:func:`_wire_safe`).
    ``lean``: the free-form fields left out (a hash-only view, whose snapshots need none)."""
    return encode_batch(KVEventBatch(0.0, [_wire_safe(ev, lean) for ev in events]))


class Residency:
    """``held``: ``{(medium, group): {hash: copies}}`` (no empty entries); ``kinds``: ``{group:
    (kind, window or None)}``; ``stats``: the skipped and unknown counts (module doc).

    Inside, a set per ``(medium, group)`` holds each block's first copy and a dict its further
    ones: copies are rare, and with none involved a store or removal is one set operation, as
    fast as the plain set of hashes views kept before groups and copies."""

    __slots__ = ("_sets", "_extra", "kinds", "stats")

    def __init__(self) -> None:
        self._sets: dict[Key, set[Any]] = {}
        self._extra: dict[Key, dict[Any, int]] = {}
        self.kinds: dict[int, tuple[str, int | None]] = {}
        self.stats = dict.fromkeys(COUNTERS, 0)

    # -- the rule ----------------------------------------------------------------------------------

    def _group(self, group_idx: Any, n: int) -> int | None:
        if group_idx is None:
            return 0
        if group_idx.__class__ is int and 0 <= group_idx < MAX_GROUPS:
            return group_idx
        self.stats["bad_groups"] += n
        return None

    def store(
        self, hashes: list[Any], medium: str | None, group_idx: Any = None, spec_kind: str | None = None,
        window: Any = None, root: int = 0, n: int = 1, windows: bool = False,
    ) -> tuple[Key, int] | None:  # fmt: skip
        """Applies ``n`` stores (one op). Returns the ``(medium, group)`` and the index of the first
        hash that got a copy (``root`` when the leading parent-None run was a re-announce), or None
        when the events were skipped. ``windows``: the batch this store came in names a window or
        mamba group (:func:`names_windows`), so the worker counts as hybrid already."""
        group = self._group(group_idx, n)
        if group is None:
            return None
        if spec_kind is not None:
            if spec_kind in WINDOW_KINDS:
                if window.__class__ is not int or window < 1:
                    self.stats["bad_windows"] += n
                    return None
            elif spec_kind not in KINDS:
                self.stats["unknown_kinds"] += n
                return None
            else:
                window = None
            self.kinds[group] = (spec_kind, window)
        if group in self.kinds and self.kinds[group][0] in UNSCORED_KINDS:
            self.stats["unscored_group_events"] += n
        key = (medium, group)
        held = self._sets.get(key)
        if held is None:
            if not hashes:
                return key, 0
            held = self._sets[key] = set()
        # The re-announce exception holds for workers without window or mamba groups only: those
        # groups cut hits short, and vLLM then recomputes from block 0 a chain its main group
        # still holds -- a real copy that looks exactly like a re-announce (module doc).
        plain = root and not windows and not any(k in HYBRID_KINDS for k, _ in self.kinds.values())
        first = root if plain and held.issuperset(hashes[:root]) else 0
        new = hashes[first:] if first else hashes
        if held.isdisjoint(new):
            before = len(held)
            held.update(new)
            if len(held) - before == len(new):
                return key, first
            new = [h for h, c in Counter(new).items() for _ in range(c - 1)]  # repeated within the op
        extra = self._extra.setdefault(key, {})
        for h in new:
            if h in held:
                extra[h] = extra.get(h, 0) + 1
            else:
                held.add(h)
        if not extra:
            del self._extra[key]
        return key, first

    def remove(
        self, hashes: list[Any], medium: str | None, group_idx: Any = None, n: int = 1,
        dropped: list[Any] | None = None,
    ) -> Key | None:  # fmt: skip
        """Applies ``n`` removals (one op): one copy less of each hash (``dropped`` collects the
        hashes that lost one). Returns the ``(medium, group)``, or None when skipped."""
        group = self._group(group_idx, n)
        if group is None:
            return None
        if group in self.kinds and self.kinds[group][0] in UNSCORED_KINDS:
            self.stats["unscored_group_events"] += n
        key = (medium, group)
        held = self._sets.get(key)
        if held is None:
            self.stats["unknown_removes"] += len(hashes)
            return key
        extra = self._extra.get(key)
        if dropped is None and (extra is None or extra.keys().isdisjoint(hashes)):
            before = len(held)
            held.difference_update(hashes)
            self.stats["unknown_removes"] += len(hashes) - (before - len(held))
        else:
            extra = extra if extra is not None else {}
            unknown = 0
            for h in hashes:
                c = extra.get(h)
                if c is not None:
                    if c == 1:
                        del extra[h]
                    else:
                        extra[h] = c - 1
                elif h in held:
                    held.remove(h)
                else:
                    unknown += 1
                    continue
                if dropped is not None:
                    dropped.append(h)
            self.stats["unknown_removes"] += unknown
            if not extra:
                self._extra.pop(key, None)
        if not held:
            del self._sets[key]
        return key

    def clear(self) -> None:
        self._sets.clear()
        self._extra.clear()
        self.kinds.clear()

    def apply_ops(self, ops: list[Op]) -> None:
        # A batch naming a window group makes the worker hybrid for all of it: a snapshot lists
        # group 0's chains before the window groups' events.
        windows = any(op[5] in HYBRID_KINDS for op in ops)
        for kind, hashes, medium, group_idx, root, spec_kind, window, n in ops:
            if kind == STORED:
                self.store(hashes, medium, group_idx, spec_kind, window, root, n, windows)
            elif kind == REMOVED:
                self.remove(hashes, medium, group_idx, n)
            else:
                self.clear()

    def apply(self, events: Iterable[Any]) -> None:
        self.apply_ops(ops_of(events)[0])

    # -- reading ------------------------------------------------------------------------------------

    @property
    def held(self) -> dict[Key, dict[Any, int]]:
        """``{(medium, group): {hash: copies}}``, built on each call."""
        out = {}
        for key, held in self._sets.items():
            extra = self._extra.get(key, {})
            out[key] = {h: 1 + extra.get(h, 0) for h in held}
        return out

    def blocks(self) -> set[Any]:
        """Every hash held in some medium and group."""
        return set().union(*self._sets.values())

    def counts(self) -> dict[Key, int]:
        """How many blocks each ``(medium, group)`` holds (a block with copies once)."""
        return {key: len(held) for key, held in self._sets.items()}

    def as_events(self) -> list[BlockStored]:
        """The state as events (:func:`state_events`; no block sizes: this class keeps none)."""
        return state_events(self.held, self.kinds)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Residency):
            return NotImplemented
        return self.held == other.held and self.kinds == other.kinds

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Residency(held={self.held!r}, kinds={self.kinds!r})"
