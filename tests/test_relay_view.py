"""The native view kept in Rust from payload bytes (``_native.ResidencyView``: behind ``RelayView``,
and hash-only, ``sources=False``, behind the subscriber's ``WorkerView``) against the rule's
Python spec: ``Residency`` applied to the decoded events, each copy's ``BlockStored`` remembered in
a dict -- the relay's view before it moved to Rust, kept here as the reference. On random hybrid
streams with bad events, copies, re-announces and clears, and hashes of every wire type: the same
residency, kinds, sizes, counters and snapshots, event for event, in both modes."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_support import Stream, removed, stored
from kvbridge._native import ResidencyView
from kvbridge.bus.update import WorkerView
from kvbridge.engine.relay import RelayView, snapshot_events
from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from kvbridge.wire.residency import Residency, names_windows, state_events


class PyRelayView:
    """The reference: the rule of kvbridge.wire.residency event by event, sources in dicts."""

    def __init__(self) -> None:
        self.residency = Residency()
        self.sources: dict[Any, dict[Any, list[tuple[BlockStored, int]]]] = {}
        self.sizes: dict[int, int] = {}

    def apply(self, events: list[Any]) -> None:
        res, sources = self.residency, self.sources
        windows = names_windows(events)
        for ev in events:
            if isinstance(ev, BlockStored):
                hashes = ev.block_hashes
                root = len(hashes) if ev.parent_block_hash is None else 0
                got = res.store(hashes, ev.medium, ev.group_idx, ev.kv_cache_spec_kind,
                                ev.kv_cache_spec_sliding_window, root, 1, windows)  # fmt: skip
                if got is None:
                    continue
                if ev.block_size > self.sizes.get(got[0][1], 0):
                    self.sizes[got[0][1]] = ev.block_size
                if got[1] or not hashes:
                    continue
                by_hash = sources.setdefault(got[0], {})
                for i, h in enumerate(hashes):
                    by_hash.setdefault(h, []).append((ev, i))
            elif isinstance(ev, BlockRemoved):
                dropped: list[Any] = []
                key = res.remove(ev.block_hashes, ev.medium, ev.group_idx, dropped=dropped)
                for h in dropped:
                    copies = sources[key][h]
                    copies.pop()
                    if not copies:
                        del sources[key][h]
                if key in sources and not sources[key]:
                    del sources[key]
            elif isinstance(ev, AllBlocksCleared):
                res.clear()
                sources.clear()
                self.sizes.clear()

    def snapshot(self) -> list[BlockStored]:
        return snapshot_events(self.sources.values(), self.residency.kinds, self.sizes)


# Block hashes as engines send them: small ints, u64 past 2**63 (msgpack uint64), negative ints
# (int64), 32-byte digests (bin) -- and a mix, where equal values must meet whatever their width.
HASH_FORMS = {
    "int": lambda h: h,
    "u64": lambda h: (1 << 63) + h * 0x9E3779B97F4A7C15 % (1 << 63),
    "negative": lambda h: -h,
    "bytes": lambda h: h.to_bytes(32, "big"),
    "mixed": lambda h: [h, (1 << 64) - h, -h, h.to_bytes(8, "big")][h % 4],
}


def rehash(ev: Any, form: Any) -> Any:
    if isinstance(ev, AllBlocksCleared):
        return ev
    changes: dict[str, Any] = {"block_hashes": [form(h) for h in ev.block_hashes]}
    if isinstance(ev, BlockStored) and ev.parent_block_hash is not None:
        changes["parent_block_hash"] = form(ev.parent_block_hash)
    return msgspec.structs.replace(ev, **changes)


def assert_same(native: RelayView, ref: PyRelayView) -> None:
    assert_same_residency(native.residency, ref)
    assert native.residency.blocks() == native.blocks
    assert len(native) == sum(ref.residency.counts().values())


def assert_same_residency(res: ResidencyView, ref: PyRelayView) -> None:
    want = ref.residency
    assert res.held == want.held
    assert res.kinds == want.kinds
    assert res.stats == want.stats
    assert res.counts() == want.counts()
    assert res.sizes == ref.sizes
    assert res.blocks() == want.blocks()
    assert len(res) == sum(want.counts().values())


@settings(max_examples=150, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from([2, 3]), st.sampled_from(sorted(HASH_FORMS)))
def test_the_native_view_reads_payloads_as_the_python_rule_reads_events(rnd, n_groups, form):
    stream = Stream(rnd, n_groups)
    native, ref = RelayView(), PyRelayView()
    hash_only, worker = ResidencyView(sources=False), WorkerView()  # a subscriber's, fed bytes and events
    for batch in stream.batches(rnd.randrange(5, 40)):
        batch = [rehash(ev, HASH_FORMS[form]) for ev in batch]
        payload = encode_batch(KVEventBatch(1.0, batch, 0))
        n_blocks = sum(len(getattr(ev, "block_hashes", ())) for ev in batch)
        assert native.apply_payload(payload) == (len(batch), n_blocks)
        assert hash_only.apply(payload) == (len(batch), n_blocks)
        worker.apply_events(batch)
        ref.apply(decode_batch(payload).events)
        assert_same(native, ref)
        assert_same_residency(hash_only, ref)
        assert_same_residency(worker.residency, ref)
    assert hash_only == native.residency == worker.residency
    assert not hash_only.keeps_sources and native.residency.keeps_sources
    # What an iterator that fell behind is given: the spec's state, with the sizes it learned.
    assert worker.as_events() == state_events(hash_only.held, ref.residency.kinds, ref.sizes)
    behind = WorkerView()
    behind.apply_events(worker.as_events())
    assert behind.residency == hash_only and behind.residency.sizes == ref.sizes
    snap = native.snapshot()
    assert snap == ref.snapshot()  # the same order, chains, copies and kind events
    late = RelayView()
    late.apply(snap)
    assert late.residency == native.residency


def test_a_payload_the_view_cannot_read_applies_nothing():
    view = RelayView()
    first = encode_batch(KVEventBatch(1.0, [stored([1, 2])]))
    assert view.apply_payload(first) == (1, 2)
    payload = encode_batch(KVEventBatch(2.0, [removed([1]), stored([3], 2), stored([4], 3)]))
    for bad in (payload[:-1], payload + b"\x00", payload[: len(payload) // 2], b"", b"\x93garbage"):
        assert view.apply_payload(bad) is None
        assert view.residency.held == {("GPU", 0): {1: 1, 2: 1}}
    # Older vLLM's positional events: a batch decode_batch reads, the view leaves to its caller.
    positional = msgspec.msgpack.encode([1.0, [["BlockStored", [5], None, [0] * 4, 4, None, "GPU", None]]])
    assert decode_batch(positional).events[0].block_hashes == [5]
    assert view.apply_payload(positional) is None
    view.apply(decode_batch(positional).events)  # what the relay does then
    assert view.residency.held == {("GPU", 0): {1: 1, 2: 1, 5: 1}}


def test_hand_built_events_a_payload_cannot_carry_are_skipped_as_the_rule_skips_them():
    # A bool is no group_idx or window, but msgpack would carry it as one: counted and skipped.
    view, ref = RelayView(), PyRelayView()
    events = [stored([1], group_idx=True), removed([1], group_idx=False), stored([2]),
              stored([3], 2, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=True),
              stored([4], 2, kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=1.5)]  # fmt: skip
    view.apply(events)
    ref.apply(events)
    assert_same(view, ref)
    assert view.residency.stats["bad_groups"] == 2 and view.residency.stats["bad_windows"] == 1


def test_a_copy_keeps_its_events_bytes_until_its_last_copy_goes():
    view = RelayView()
    view.apply([stored([1, 2]), stored([2, 3], 1), removed([2])])  # the second copy of 2 goes first
    groups, raws = view.residency.sources()
    assert [(h, len(copies)) for h, copies in groups[0][2]] == [(1, 1), (2, 1), (3, 1)]
    assert len(raws) == 2
    view.apply([removed([1, 2])])
    groups, raws = view.residency.sources()
    assert [h for h, _ in groups[0][2]] == [3] and len(raws) == 1  # the first event's bytes are gone
    view.apply([AllBlocksCleared()])
    assert view.residency.sources() == ([], {})


def test_a_hash_only_view_keeps_no_sources_and_says_so():
    view = ResidencyView(sources=False)
    assert view.apply(encode_batch(KVEventBatch(1.0, [stored([1, 2]), stored([2, 3], 1), removed([2])]))) == (3, 5)
    assert view.held == {("GPU", 0): {1: 1, 2: 1, 3: 1}}
    with pytest.raises(ValueError, match="hash-only"):
        view.sources()
    view.clear()
    assert view.held == {} and view.sizes == {} and len(view) == 0


@pytest.mark.parametrize("seed", range(3))
def test_a_large_payload_is_applied_with_the_gil_released_and_the_same_result(seed):
    # Over the 16 KiB threshold: the Rust side runs detached; the result must not differ.
    rnd = random.Random(seed)
    hashes = [rnd.getrandbits(64) for _ in range(2000)]
    batch = [stored(hashes[i : i + 50], None if i == 0 else hashes[i - 1]) for i in range(0, 2000, 50)]
    payload = encode_batch(KVEventBatch(1.0, batch))
    assert len(payload) > 16 << 10
    view, ref = RelayView(), PyRelayView()
    assert view.apply_payload(payload) == (40, 2000)
    ref.apply(batch)
    assert_same(view, ref)
    snap = view.snapshot()
    assert snap == ref.snapshot() == batch  # one chain, each event whole



def test_runs_of_one_block_removes_apply_and_count_as_the_rule_does_event_by_event():
    # vLLM sends a BlockRemoved per block; the view applies a run of one (medium, group) at once.
    # Each run here ends differently: another medium, another group, a bad group (counted per
    # event), a group of an unscored kind (counted per event), a group emptied mid-run, a copy.
    from kvbridge._native import read_batch

    setup = [stored([1, 2, 3, 4]), stored([5, 6], medium="CPU"), stored([7, 8], group_idx=1),
             stored([9, 10], group_idx=2, kv_cache_spec_kind="cross_attention"), stored([2], 1)]  # fmt: skip
    runs = [removed([h]) for h in (1, 2, 2, 99)] + [removed([5], medium="CPU"), removed([6], medium="CPU")]
    runs += [removed([7], group_idx=1), removed([8], group_idx=1), removed([7], group_idx=1)]  # emptied, then unknown
    runs += [removed([3], group_idx=64), removed([3], group_idx=64), removed([3]), removed([4])]
    runs += [removed([9], group_idx=2), removed([10], group_idx=2), removed([11], medium=None)]
    view, ref = RelayView(), PyRelayView()
    for batch in (setup, runs):
        payload = encode_batch(KVEventBatch(1.0, batch, 0))
        n_blocks = sum(len(ev.block_hashes) for ev in batch)
        read = read_batch(payload)
        assert read is not None and (read.n_events, read.n_blocks) == (len(batch), n_blocks)
        assert view.apply_payload(payload) == (len(batch), n_blocks)
        ref.apply(batch)
        assert_same(view, ref)
    stats = view.residency.stats
    assert (stats["bad_groups"], stats["unscored_group_events"], stats["unknown_removes"]) == (2, 3, 3)
    assert view.residency.held == {}
