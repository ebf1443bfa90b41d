"""The rule every view applies, as its plain-Python spec (kvbridge.wire.residency.Residency):
residency per (medium, group) with copies, kinds per group, the re-announce exception, bad input
counted and skipped -- and the views that run it natively (WorkerView, hash-only; RelayView and
its snapshots) checked against the spec and a plain model on random hybrid streams."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_support import Stream, removed, stored
from kvbridge import Index, _native
from kvbridge.bus.subscriber import Update, WorkerView
from kvbridge.engine.relay import RelayView
from kvbridge.wire.events import AllBlocksCleared, BlockStored, DecodeError, KVEventBatch, decode_batch, encode_batch
from kvbridge.wire.residency import Residency, kind_event, ops_of

SW8 = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8}
FULL = {"kv_cache_spec_kind": "full_attention"}

# (name, events, expected held, expected kinds, expected non-zero stats)
CASES: list[tuple[str, list, dict, dict, dict]] = [
    ("group_idx None is group 0", [stored([1, 2])], {("GPU", 0): {1: 1, 2: 1}}, {}, {}),
    ("groups and media are apart",
     [stored([1, 2], group_idx=0), stored([1], group_idx=1, **SW8), stored([1], medium="CPU"), removed([1], group_idx=1)],
     {("GPU", 0): {1: 1, 2: 1}, ("CPU", 0): {1: 1}}, {1: ("sliding_window", 8)}, {}),
    ("a removal of group 1 leaves group 0's copy", [stored([1], group_idx=0), stored([1], group_idx=1), removed([1], group_idx=1)],
     {("GPU", 0): {1: 1}}, {}, {}),
    ("group_idx 64 skipped whole", [stored([1]), stored([2], group_idx=64), removed([1], group_idx=64)],
     {("GPU", 0): {1: 1}}, {}, {"bad_groups": 2}),
    ("negative group_idx skipped", [stored([1], group_idx=-1)], {}, {}, {"bad_groups": 1}),
    ("a bool is not a group_idx", [stored([1], group_idx=True), removed([1], group_idx=False)], {}, {},
     {"bad_groups": 2, "unknown_removes": 0}),
    ("a kind vLLM does not have is skipped", [stored([1], kv_cache_spec_kind="linear")], {}, {}, {"unknown_kinds": 1}),
    ("a window kind without a window is skipped",
     [stored([1], kv_cache_spec_kind="sliding_window"), stored([2], kv_cache_spec_kind="sliding_window_mla",
                                                             kv_cache_spec_sliding_window=0)],
     {}, {}, {"bad_windows": 2}),
    ("an unscored kind is held; each of its group's events counted",
     [stored([1], group_idx=2, kv_cache_spec_kind="cross_attention"), stored([2], 1, group_idx=2), removed([7], group_idx=2)],
     {("GPU", 2): {1: 1, 2: 1}}, {2: ("cross_attention", None)}, {"unscored_group_events": 3, "unknown_removes": 1}),
    ("mamba is a kind the index scores", [stored([1], group_idx=2, kv_cache_spec_kind="mamba")],
     {("GPU", 2): {1: 1}}, {2: ("mamba", None)}, {}),
    ("kind None keeps the kind; a new kind replaces it",
     [stored([1], group_idx=1, **SW8), stored([2], 1, group_idx=1),
      stored([3], 2, group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=16)],
     {("GPU", 1): {1: 1, 2: 1, 3: 1}}, {1: ("sliding_window", 16)}, {}),
    ("a main kind's window is not kept", [stored([1], kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=4)],
     {("GPU", 0): {1: 1}}, {0: ("full_attention", None)}, {}),
    ("a chain recomputed over a held block is a second copy", [stored([1, 2]), stored([2, 3], 1)],
     {("GPU", 0): {1: 1, 2: 2, 3: 1}}, {}, {}),
    ("copies go one removal at a time", [stored([1, 2]), stored([2], 1), removed([2]), removed([2, 2])],
     {("GPU", 0): {1: 1}}, {}, {"unknown_removes": 1}),
    ("a removal of what is not held changes nothing", [stored([1]), removed([9]), removed([1], medium="CPU")],
     {("GPU", 0): {1: 1}}, {}, {"unknown_removes": 2}),
    ("full-report re-announce adds no copies", [stored([1, 2, 3]), stored([1, 2], **FULL)],
     {("GPU", 0): {1: 1, 2: 1, 3: 1}}, {0: ("full_attention", None)}, {}),
    ("a parent-None store with a new block is counted whole", [stored([1, 2]), stored([1, 2, 3])],
     {("GPU", 0): {1: 2, 2: 2, 3: 1}}, {}, {}),
    ("re-announce is per (medium, group)", [stored([1]), stored([1], group_idx=1)],
     {("GPU", 0): {1: 1}, ("GPU", 1): {1: 1}}, {}, {}),
    ("a cleared worker forgets blocks and kinds",
     [stored([1], group_idx=1, **SW8), AllBlocksCleared(), stored([2])], {("GPU", 0): {2: 1}}, {}, {}),
    ("a store of no blocks announces a kind and holds nothing", [kind_event(1, "sliding_window", 8)], {},
     {1: ("sliding_window", 8)}, {}),
]


@pytest.mark.parametrize("name, events, held, kinds, stats", CASES, ids=[c[0] for c in CASES])
def test_the_rule(name, events, held, kinds, stats):
    decoded = Residency()
    decoded.apply(events)
    views = [decoded]
    payload = encode_batch(KVEventBatch(1.0, events))
    scan = _native.scan_batch_msgpack(payload)
    if scan is None:  # a bool group_idx: only a hand-built event has one, the schema refuses it
        with pytest.raises(DecodeError):
            decode_batch(payload)
    else:
        views.append(Residency())
        views[1].apply_ops(scan[4])
    for res in views:  # the scan's ops and the decoded events' read the same
        assert (res.held, res.kinds) == (held, kinds)
        assert {k: v for k, v in res.stats.items() if v} == {k: v for k, v in stats.items() if v}


def test_the_issues_orphan_example_snapshots_every_group_whole():
    """A 4-block prompt stored in group 0 (full attention) and group 1 (sliding window); group 1
    then evicts its copies of blocks 1-2. Keyed by (medium, hash), the relay's snapshot had one
    orphan block and a late router rebuilt a wrong view."""
    view = RelayView()
    view.apply([
        stored([10, 11, 12, 13], group_idx=0, **FULL),
        stored([10, 11, 12, 13], group_idx=1, **SW8),
        removed([11, 12], group_idx=1),
    ])  # fmt: skip
    snap = view.snapshot()
    assert [(ev.group_idx, ev.block_hashes, ev.parent_block_hash) for ev in snap] == [
        (0, [10, 11, 12, 13], None), (1, [10], None), (1, [13], 12),
    ]  # fmt: skip
    assert all(ev.kv_cache_spec_kind for ev in snap) and snap[2].kv_cache_spec_sliding_window == 8
    late = RelayView()
    late.apply(snap)
    assert late.residency == view.residency
    assert late.residency.held == {("GPU", 0): dict.fromkeys([10, 11, 12, 13], 1), ("GPU", 1): {10: 1, 13: 1}}


def test_a_snapshot_carries_each_copy_with_its_real_parent():
    view = RelayView()
    copy = stored([2, 3], 1, extra_keys=[("x",), None], locality="REMOTE", session_id="s")
    view.apply([stored([1, 2, 3]), copy, removed([1])])
    snap = view.snapshot()
    assert [(ev.block_hashes, ev.parent_block_hash) for ev in snap] == [([2, 3], 1), ([2, 3], 1)]
    assert snap[1] == copy  # the copy's own event (kept as its bytes), every field kept
    late = RelayView()
    late.apply(snap)
    assert late.residency.held == {("GPU", 0): {2: 2, 3: 2}}


def test_a_duplicated_chain_first_block_is_not_recounted_from_a_snapshot():
    # The documented edge: the extra copy of a chain-first block has parent None, and every block
    # of it is held by then: read as a re-announce, as the live rule reads one.
    view = RelayView()
    view.apply([stored([1]), stored([1, 2])])
    assert view.residency.held == {("GPU", 0): {1: 2, 2: 1}}
    late = RelayView()
    late.apply(view.snapshot())
    assert late.residency.held == {("GPU", 0): {1: 1, 2: 1}}


def test_a_snapshot_says_a_kind_its_blocks_do_not():
    view = RelayView()
    view.apply([stored([1], group_idx=1, **SW8), stored([2], 1, group_idx=1, kv_cache_spec_kind="sliding_window",
                                                         kv_cache_spec_sliding_window=16),
                removed([2], group_idx=1), stored([5], group_idx=2, kv_cache_spec_kind="mamba"), removed([5], group_idx=2)])  # fmt: skip
    snap = view.snapshot()
    # Group 2 holds nothing: its kind event also carries its block size (relay.py ``snapshot``).
    assert snap[1:] == [kind_event(1, "sliding_window", 16), kind_event(2, "mamba", None, 4)]
    late = RelayView()
    late.apply(snap)
    assert late.residency == view.residency


def test_a_snapshot_keeps_a_groups_larger_block_size():
    """A group of 8-token blocks (twice the index's 4) that now holds only a one-hash-block store
    (vLLM's partial-tail entry) or nothing: its blocks' events would leave it read at 4 tokens,
    so the snapshot says its size; a late index then scores as the live one does."""

    def ev(hashes, size, group, parent=None, **kw):
        return BlockStored(list(hashes), parent, [0] * size * len(hashes), size, None, "GPU", None, group_idx=group, **kw)

    live = [
        ev([10, 11, 12, 13], 4, 0, **FULL),
        ev([11, 13], 8, 1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4),
        ev([12], 4, 1, parent=11),  # the partial tail: one hash block of group 1
        removed([11, 13], group_idx=1),
        ev([5], 12, 2, kv_cache_spec_kind="cross_attention"),
        removed([5], group_idx=2),
    ]
    view = RelayView()
    view.apply(live)
    snap = view.snapshot()
    assert [(e.group_idx, e.block_hashes, e.block_size) for e in snap] == [
        (0, [10, 11, 12, 13], 4), (1, [12], 4), (1, [], 8), (2, [], 12),
    ]  # fmt: skip
    direct, late = Index(block_size=4, key="engine"), Index(block_size=4, key="engine")
    direct.apply("w", KVEventBatch(0.0, live))
    late.apply("w", KVEventBatch(0.0, snap))
    for n in range(1, 5):
        assert late.find_matches(block_hashes=[10, 11, 12, 13][:n]) == direct.find_matches(block_hashes=[10, 11, 12, 13][:n])
    # Group 2's 12-token blocks align hits to lcm(4, 8, 12) = 24 tokens: none within 16.
    assert direct.find_matches(block_hashes=[10, 11, 12, 13]) == {}
    again = RelayView()
    again.apply(snap)
    assert again.residency == view.residency and again.snapshot() == snap


def test_worker_view_blocks_is_every_hash_held_anywhere():
    view = WorkerView()
    view.apply_events([stored([1, 2], group_idx=0), stored([3], medium="CPU", group_idx=1), stored([2], 1)])
    assert view.blocks == {1, 2, 3}
    assert view.held == {("GPU", 0): {1: 1, 2: 2}, ("CPU", 1): {3: 1}}


# --- random hybrid streams against a plain model ----------------------------------------------------

def _parents_first(snap: list[BlockStored], held: dict) -> None:
    seen: set = set()
    for ev in snap:
        key = (ev.medium, ev.group_idx or 0)
        p = ev.parent_block_hash
        if p is not None and p in held.get(key, ()):
            assert (key, p) in seen, f"{ev} before its parent"
        seen.update((key, h) for h in ev.block_hashes)


@settings(max_examples=150, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from([2, 3]))
def test_random_hybrid_streams_views_equal_the_model_and_snapshots_rebuild_them(rnd, n_groups):
    stream = Stream(rnd, n_groups)
    batches = stream.batches(rnd.randrange(5, 40))
    expected, kinds = stream.model.residency(), stream.model.kinds

    relay, spec = RelayView(), Residency()
    scanned, decoded = WorkerView(), WorkerView()
    for seq, batch in enumerate(batches):
        relay.apply(batch)
        spec.apply(batch)
        decoded.apply_events(batch)
        # The subscriber's path: the payload's bytes, applied natively.
        scanned.apply(Update("m", "w", "e", seq, _body(KVEventBatch(1.0, batch))))
    for res in (spec, relay.residency, scanned.residency, decoded.residency):
        assert (res.held, res.kinds) == (expected, kinds)
    assert scanned.residency.stats == decoded.residency.stats == relay.residency.stats == spec.stats

    snap = relay.snapshot()
    _parents_first(snap, expected)
    assert sum(len(ev.block_hashes) for ev in snap) == sum(sum(v.values()) for v in expected.values())  # nothing extra
    late = RelayView()
    late.apply(snap)
    assert late.residency == relay.residency
    assert late.snapshot() == snap  # a snapshot of a snapshot is the snapshot

    behind = WorkerView()
    behind.apply_events(scanned.as_events())  # what an iterator that fell behind is given
    assert behind.residency == scanned.residency
    assert behind.residency.sizes == scanned.residency.sizes == relay.residency.sizes
    # The spec's events, but for the sizes it does not keep (and each set's order).
    unsized = [msgspec.structs.replace(ev, block_size=0) for ev in scanned.as_events() if ev.block_hashes or ev.kv_cache_spec_kind]
    assert [_sorted(ev) for ev in unsized] == [_sorted(ev) for ev in spec.as_events()]


def _sorted(ev: BlockStored) -> BlockStored:
    return msgspec.structs.replace(ev, block_hashes=sorted(ev.block_hashes))


@settings(max_examples=100, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from([2, 3]))
def test_views_count_what_the_index_counts(rnd, n_groups):
    """The Rust Index reads events by the same rule: on the same stream, the same skipped events,
    unknown removals and events in unscored groups."""
    index, view = Index(block_size=4, key="engine"), WorkerView()
    for batch in Stream(rnd, n_groups).batches(rnd.randrange(5, 40)):
        payload = encode_batch(KVEventBatch(1.0, batch))
        index.apply("w", payload)
        view.apply(Update("m", "w", "e", 0, _body(KVEventBatch(1.0, batch))))
    assert {k: index.stats[k] for k in view.residency.stats} == view.residency.stats


def _body(batch: KVEventBatch) -> Any:
    from kvbridge.bus.update import Body

    body = Body(encode_batch(batch), "msgpack")
    assert body._batch is None, "the scan declined a vLLM-shaped batch"
    return body


def test_ops_of_merges_like_the_scan():
    events = [stored([1, 2]), stored([3], 2), stored([4], 3, group_idx=1), removed([1]), removed([2])]
    ops, n = ops_of(events)
    assert n == 6
    assert ops == _native.scan_batch_msgpack(encode_batch(KVEventBatch(1.0, events)))[4]
    assert [(op[0], op[1], op[7]) for op in ops] == [(0, [1, 2, 3], 2), (0, [4], 1), (1, [1, 2], 2)]


def test_worker_views_read_every_payload_form_alike():
    """msgpack payloads are applied as read on arrival; JSON, other engines' shapes and events
    whose free-form fields nest deeper than the native reader goes are encoded for the view."""
    from kvbridge.bus.update import Body

    deep: Any = None
    for _ in range(40):
        deep = (deep,)
    events = [stored([1, 2], group_idx=1, **SW8), stored([3], 2, extra_keys=[deep]), removed([1], group_idx=1)]
    batch = KVEventBatch(1.0, events)
    positional = msgspec.msgpack.encode([1.0, [["BlockStored", [5], None, [0] * 4, 4, None, "GPU", None]]])
    bodies = {
        "msgpack": Body(encode_batch(batch), "msgpack"),
        "json": Body(encode_batch(batch, "json"), "json"),
        "positional": Body(positional, "msgpack"),
        "events": Body.of(batch),
    }
    assert bodies["msgpack"].read is None  # the extra key nests too deep for the reader: decoded
    assert bodies["json"].read is None and bodies["positional"].read is None
    views = {}
    for name, body in bodies.items():
        views[name] = WorkerView()
        views[name].apply(Update("m", "w", "e", 0, body))
    want = {("GPU", 1): {2: 1}, ("GPU", 0): {3: 1}}
    assert views["msgpack"].held == views["json"].held == views["events"].held == want
    assert views["positional"].held == {("GPU", 0): {5: 1}}
    assert views["json"].residency.kinds == {1: ("sliding_window", 8)}

    plain = Body(encode_batch(KVEventBatch(1.0, events[:1])), "msgpack")
    assert plain.read is not None and (plain.n_events, plain.n_blocks) == (1, 2)
    view = WorkerView()
    view.apply(Update("m", "w", "e", 0, plain))
    assert plain.read is None and view.held == {("GPU", 1): {1: 1, 2: 1}}  # applied, then let go
    view.apply(Update("m", "w", "e", 1, plain))  # the same body again: decoded, applied again
    assert view.held == {("GPU", 1): {1: 2, 2: 2}}
