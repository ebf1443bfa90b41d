"""Every framing rule of kvbridge.bus.framer, as a table, without a broker (milliseconds).

Each case drives a fresh ``Framer`` (dp_rank 7) through one or more calls; what comes out is
decoded back into events, each frame numbered into an ``Outbox`` by ``number`` (frame i takes seq
i, a hole included), and the four counters compared. tests/test_delivery_faults.py keeps one case
of the same rules end to end through a real nats-server."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from kvbridge.bus.framer import Frame, Framer, number
from kvbridge.bus.outbox import Outbox
from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch

TS = 1.5
DP_RANK = 7
BS = 4  # tokens per block
COUNTERS = ("invalid_events", "split_events", "split_batches", "oversize_dropped")


def S(*hashes: int, parent: int | None = None, bs: int = BS) -> BlockStored:
    return BlockStored(list(hashes), parent, [h % 100 for h in hashes for _ in range(bs)], bs, None, "GPU", None)


def R(*hashes: int) -> BlockRemoved:
    return BlockRemoved(list(hashes), "GPU")


C = AllBlocksCleared()
BIG = S(2, bs=4096)  # one block: cannot be cut
BAD = S(1 << 64)  # a hash msgspec cannot write


def size(*events: Any, fmt: str = "msgpack") -> int:
    """Bytes of one message holding ``events``: the limits below are set from these."""
    return len(encode_batch(KVEventBatch(TS, list(events), DP_RANK), fmt))  # type: ignore[arg-type]


def frames_of(events: list[Any], rank: int | None = None) -> Callable[[Framer], list[Frame]]:
    return lambda f: f.frame(TS, events, rank)


def forwarded(events: list[Any], payload: bytes) -> Callable[[Framer], list[Frame]]:
    return lambda f: f.forwarded(KVEventBatch(TS, events, None), payload)


def bytes_alone(payload: bytes, n_events: int) -> Callable[[Framer], list[Frame]]:
    return lambda f: f.forwarded(None, payload, n_events)


def snapshot(events: list[Any]) -> Callable[[Framer], list[Frame]]:
    return lambda f: [Frame(payload, len(decode_batch(payload).events)) for payload in f.snapshot(TS, events)]


def described(ev: Any) -> tuple:
    if isinstance(ev, BlockStored):
        return ("S", *ev.block_hashes, "<-", ev.parent_block_hash)
    if isinstance(ev, BlockRemoved):
        return ("R", *ev.block_hashes)
    return ("C",)


def stored(*hashes: int, parent: int | None = None) -> tuple:
    return ("S", *hashes, "<-", parent)


HOLE = None
FOREIGN = encode_batch(KVEventBatch(99.0, [S(5)], 3))  # bytes as another publisher wrote them

# (case, framer options (and what the runner expects: "rank"), calls, expected frames: the events of each (HOLE: a seq hole), non-zero counters)
CASES: list[tuple[str, dict[str, Any], list[Callable[[Framer], list[Frame]]], list[Any], dict[str, int]]] = [
    ("a heartbeat is one empty batch", {}, [frames_of([])], [[]], {}),
    ("a run within the limits is one message", {}, [frames_of([S(1), R(2), C])],
     [[stored(1), ("R", 2), ("C",)]], {}),
    ("max_events cuts a run", {"max_events": 2}, [frames_of([S(1), S(2), S(3), S(4), S(5)])],
     [[stored(1), stored(2)], [stored(3), stored(4)], [stored(5)]], {}),
    ("a run over max_bytes is encoded again in halves", {"max_bytes": size(S(1), S(2))},
     [frames_of([S(1), S(2), S(3), S(4)])], [[stored(1), stored(2)], [stored(3), stored(4)]], {}),
    ("halves go down to one event per message", {"max_bytes": size(S(1))}, [frames_of([S(1), S(2), S(3)])],
     [[stored(1)], [stored(2)], [stored(3)]], {}),
    ("the bytes-per-event estimate cuts later runs before encoding (to 80% of max_bytes)",
     {"max_bytes": size(*[S(i) for i in range(1, 5)])},
     [frames_of([S(i) for i in range(1, 9)]), frames_of([S(i) for i in range(11, 19)])],
     [[stored(i) for i in range(1, 5)], [stored(i) for i in range(5, 9)],  # halving: no estimate yet
      [stored(11), stored(12), stored(13)], [stored(14), stored(15), stored(16)], [stored(17), stored(18)]], {}),
    ("an event over max_bytes is cut into parent-linked slices, counted once",
     {"max_bytes": size(S(10, 11, parent=9))}, [frames_of([S(*range(10, 18), parent=9)])],
     [[stored(10, 11, parent=9)], [stored(12, 13, parent=11)], [stored(14, 15, parent=13)],
      [stored(16, 17, parent=15)]], {"split_events": 1}),
    ("each oversize event is counted", {"max_bytes": size(S(10, 11, parent=9))},
     [frames_of([S(10, 11, 12), S(20, 21, 22)])],
     [[stored(10)], [stored(11, 12, parent=10)], [stored(20)], [stored(21, 22, parent=20)]], {"split_events": 2}),
    ("a removal over max_bytes is cut too", {"max_bytes": size(R(1, 2))}, [frames_of([R(1, 2, 3, 4)])],
     [[("R", 1, 2)], [("R", 3, 4)]], {"split_events": 1}),
    ("one block over max_bytes but within max_payload goes alone", {"max_bytes": size(S(1))},
     [frames_of([S(1), BIG, S(3)])], [[stored(1)], [stored(2)], [stored(3)]], {}),
    ("one block over max_payload is a seq hole, the rest goes out", {"max_payload": size(S(1), S(3))},
     [frames_of([S(1), BIG, S(3)])], [[stored(1)], HOLE, [stored(3)]], {"oversize_dropped": 1}),
    ("a non-event in a run is dropped before numbering", {}, [frames_of([S(1), "x", 7, S(2)])],
     [[stored(1), stored(2)]], {"invalid_events": 2}),
    ("a run of nothing but non-events is no message at all", {}, [frames_of(["x"]), frames_of([S(1)])],
     [[stored(1)]], {"invalid_events": 1}),
    ("an event msgspec cannot write is found by halves and dropped", {},
     [frames_of([S(1), BAD, S(3), S(4)])], [[stored(1)], [stored(3), stored(4)]], {"invalid_events": 1}),
    ("JSON messages are cut by the same rules", {"format": "json", "max_bytes": size(S(1), S(2), fmt="json")},
     [frames_of([S(1), S(2), S(3), S(4)])], [[stored(1), stored(2)], [stored(3), stored(4)]], {}),
    ("a batch's own rank is kept (None: the configured dp_rank)", {"rank": 3},
     [frames_of([S(1)], rank=3)], [[stored(1)]], {}),
    ("forwarded msgpack bytes go as they are", {}, [forwarded([S(1)], FOREIGN)], [[stored(5)]], {}),
    ("forwarded bytes over max_payload are encoded and cut, counted",
     {"max_payload": size(S(1), S(2))}, [forwarded([S(1), S(2), S(3), S(4)], b"x" * (size(S(1), S(2)) + 1))],
     [[stored(1), stored(2)], [stored(3), stored(4)]], {"split_batches": 1}),
    ("forwarded bytes alone (no batch) go as they are", {}, [bytes_alone(FOREIGN, 1)], [[stored(5)]], {}),
    ("forwarded bytes alone over max_payload are decoded and cut, counted", {"max_payload": size(S(1), S(2))},
     [bytes_alone(encode_batch(KVEventBatch(TS, [S(1), S(2), S(3), S(4)], DP_RANK)), 4)],
     [[stored(1), stored(2)], [stored(3), stored(4)]], {"split_batches": 1}),
    ("forwarded bytes alone that must be decoded and are no batch are dropped as invalid", {"format": "json"},
     [bytes_alone(b"not a batch", 3)], [], {"invalid_events": 3}),
    ("in JSON mode forwarded msgpack bytes are encoded again (not a split)", {"format": "json"},
     [forwarded([S(1)], FOREIGN)], [[stored(1)]], {}),
    ("a snapshot is cut like live messages", {"max_bytes": size(S(1))}, [snapshot([S(1), S(2), S(3)])],
     [[stored(1)], [stored(2)], [stored(3)]], {}),
    ("a snapshot has no seqs, so a block over max_payload is left out of it (a hole live), counted",
     {"max_payload": size(S(1), S(3))}, [snapshot([S(1), BIG, S(3)])], [[stored(1)], [stored(3)]],
     {"oversize_dropped": 1}),
]


@pytest.mark.parametrize("case, options, calls, expected, counters", CASES, ids=[c[0] for c in CASES])
def test_framing_rule(case, options, calls, expected, counters):
    framer = Framer(options.get("format", "msgpack"), max_events=options.get("max_events", 1000),
                    max_bytes=options.get("max_bytes", 1 << 20), dp_rank=DP_RANK,
                    max_payload=options.get("max_payload", 1 << 20))  # fmt: skip
    frames = [frame for call in calls for frame in call(framer)]
    got = []
    for frame in frames:
        if frame.payload is None:
            got.append(HOLE)
            continue
        batch = decode_batch(frame.payload, options.get("format", "msgpack"))
        assert frame.n_events == len(batch.events)
        assert len(frame.payload) <= framer.max_payload
        if frame.payload is not FOREIGN:
            assert (batch.ts, batch.data_parallel_rank) == (TS, options.get("rank", DP_RANK))
        got.append([described(ev) for ev in batch.events])
    assert got == expected
    assert framer.counts == dict.fromkeys(COUNTERS, 0) | counters

    # Numbered in order: frame i takes seq i, a hole takes one too (and the ring restarts after it).
    outbox = Outbox(1 << 30)
    number(outbox, frames)
    assert outbox.last_seq == len(frames) - 1
    after_hole = max((i + 1 for i, f in enumerate(frames) if f.payload is None), default=0)
    assert outbox.held(0, len(frames)) == [(i, frames[i].payload) for i in range(after_hole, len(frames))]


def test_the_slices_of_an_event_applied_in_order_are_the_event():
    ev = BlockStored(list(range(10, 19)), 9, list(range(9 * BS)), BS, None, "CPU", "lora", extra_keys=[(i,) for i in range(9)])
    framer = Framer(max_events=1000, max_bytes=size(S(10, 11, parent=9)) + 40)
    slices = [e for f in framer.frame(TS, [ev]) for e in decode_batch(f.payload).events]  # type: ignore[arg-type]
    assert len(slices) > 2 and framer.counts["split_events"] == 1
    assert [h for s in slices for h in s.block_hashes] == ev.block_hashes
    assert [t for s in slices for t in s.token_ids] == ev.token_ids
    assert [k for s in slices for k in s.extra_keys] == ev.extra_keys
    assert [s.parent_block_hash for s in slices] == [9] + [s.block_hashes[-1] for s in slices[:-1]]
    assert {(s.medium, s.lora_name, s.block_size) for s in slices} == {("CPU", "lora", BS)}


def test_the_server_limit_caps_max_bytes_once_known():
    framer = Framer(max_events=1000, max_bytes=8 << 20)
    assert (framer.max_payload, framer.max_bytes) == (1 << 20, 1 << 20)  # the server default until known
    framer.limit(4 << 20)
    assert (framer.max_payload, framer.max_bytes) == (4 << 20, 4 << 20)  # not the default's cap
    framer.limit(1000)
    assert (framer.max_payload, framer.max_bytes) == (1000, 1000)


def _records() -> list[Any]:
    """Three records of a native pool: two small stores, then a removal-heavy one."""
    from kvbridge import KVCacheManager

    m = KVCacheManager(6, BS)
    out = []
    m.allocate("a", list(range(3 * BS)))
    out.append(m.take_record())
    m.free("a")
    m.allocate("b", list(range(100, 100 + 5 * BS)))  # evicts a's blocks
    out.append(m.take_record())
    m.free("b")
    m.allocate("c", list(range(200, 200 + 2 * BS)))
    out.append(m.take_record())
    return out


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_records_are_framed_whole_within_the_limits_or_as_their_events(fmt):
    recs = _records()
    events = [ev for r in recs for ev in r.events()]
    assert [len(r) for r in recs] == [1, 2, 2]

    def run(max_events: int, max_bytes: int, records: list[Any]) -> tuple[list[Frame], list[Frame]]:
        a = Framer(fmt, max_events=max_events, max_bytes=max_bytes, dp_rank=DP_RANK)  # type: ignore[arg-type]
        b = Framer(fmt, max_events=max_events, max_bytes=max_bytes, dp_rank=DP_RANK)  # type: ignore[arg-type]
        return a.records(TS, records), b.frame(TS, [ev for r in records for ev in r.events()])

    # All within the limits: one message, the bytes encode_batch writes (JSON: as frame() makes it).
    got, as_events = run(1000, 1 << 20, recs)
    assert got == as_events == [Frame(encode_batch(KVEventBatch(TS, events, DP_RANK), fmt), 5)]
    # Too many bytes or events for one message: cut between records, in order, each cut the bytes
    # of its records' events (msgpack); JSON goes the events' way.
    whole = len(encode_batch(KVEventBatch(TS, events, DP_RANK), fmt))
    for max_events, max_bytes in ((1000, whole - 1), (4, 1 << 20)):
        got, as_events = run(max_events, max_bytes, recs)
        if fmt == "json":
            assert got == as_events
            continue
        assert [f.n_events for f in got] == [1, 4]  # halves: [first], [second, third]
        assert all(f.payload is not None and len(f.payload) <= max_bytes for f in got)
        assert [ev for f in got for ev in decode_batch(f.payload).events] == events  # type: ignore[arg-type]
    # One record over the limits by itself: its events are cut as frame() cuts them.
    one = len(encode_batch(KVEventBatch(TS, recs[1].events(), DP_RANK), fmt))
    for max_events, max_bytes in ((1000, one - 1), (1, 1 << 20)):
        got, as_events = run(max_events, max_bytes, recs[1:2])
        assert got == as_events and len(got) == 2


def test_a_record_the_native_writer_leaves_goes_as_its_events():
    from kvbridge import KVCacheManager

    m = KVCacheManager(6, BS)
    m.allocate("a", list(range(3 * BS)), lora_name="ada")
    rec = m.take_record()
    framer = Framer(max_events=1000, max_bytes=1 << 20, dp_rank=DP_RANK)
    assert framer.records(TS, [rec]) == [Frame(encode_batch(KVEventBatch(TS, rec.events(), DP_RANK)), 1)]
