"""Every per-worker (epoch, seq) rule, without a broker: a table of message sequences and what
the sequencer must decide for each, then the resync outcomes."""

from __future__ import annotations

import pytest

from kvbridge.bus.sequencer import MAX_PARKED, Sequencer, Verdict

D, DUP, CONF, START, FIRST, CHANGE, PARK, GAP = (
    Verdict.DELIVER, Verdict.DUPLICATE, Verdict.CONFLICT, Verdict.STREAM_START, Verdict.FIRST_CONTACT,
    Verdict.EPOCH_CHANGE, Verdict.PARKED, Verdict.GAP,
)  # fmt: skip


def following(epoch: str = "A", next_seq: int = 0) -> Sequencer:
    """A sequencer in sync with ``epoch`` (a snapshot consistent with next_seq - 1 landed)."""
    s = Sequencer()
    s.snapshot_taken(epoch, next_seq - 1)
    return s


# (case, start, messages as (epoch, seq) or (epoch, seq, {"syncing"/"jetstream": True}), verdicts,
#  then next_seq and parked seqs after them)
TABLE = [
    ("first contact parks and wants a snapshot", Sequencer, [("A", 5)], [FIRST], 0, [5]),
    ("in order is delivered", following, [("A", 0), ("A", 1), ("A", 2)], [D, D, D], 3, []),
    ("an older seq is a duplicate", following, [("A", 0), ("A", 0)], [D, DUP], 1, []),
    ("a hole parks what follows and is a gap", following, [("A", 0), ("A", 2), ("A", 3)], [D, GAP, GAP], 1, [2, 3]),
    ("while syncing everything newer is parked", following, [("A", 0, {"syncing": True}), ("A", 1, {"syncing": True})],
     [PARK, PARK], 0, [0, 1]),
    ("a new epoch after a followed one is an epoch change", following, [("A", 0), ("B", 0)], [D, CHANGE], 1, [0]),
    ("a new epoch drops what was parked for another", following, [("A", 3), ("B", 7)], [GAP, CHANGE], 0, [7]),
    ("JetStream: seq 0 of a new epoch starts from the stream", Sequencer, [("A", 0, {"jetstream": True})], [START], 0,
     []),
    ("JetStream: not while a resync is under way", Sequencer, [("A", 0, {"jetstream": True, "syncing": True})],
     [FIRST], 0, [0]),
    ("JetStream: a new epoch's later seq still needs a snapshot", Sequencer, [("A", 4, {"jetstream": True})], [FIRST],
     0, [4]),
]


@pytest.mark.parametrize("case,start,messages,verdicts,next_seq,parked", TABLE, ids=[t[0] for t in TABLE])
def test_sequencer_table(case, start, messages, verdicts, next_seq, parked):
    s = start()
    got = []
    for m in messages:
        epoch, seq = m[0], m[1]
        opts = m[2] if len(m) > 2 else {}
        got.append(s.offer(epoch, seq, f"{epoch}{seq}", **opts))
    assert got == verdicts, case
    assert s.next_seq == next_seq and sorted(s.parked) == parked, case


def test_parked_messages_come_out_in_order_once_the_hole_fills():
    s = following()
    assert [s.offer("A", q, q) for q in (0, 3, 2)] == [D, GAP, GAP]
    assert s.replayed("A", 1) is True  # the replay brings the missing one
    ready, stale = s.ready()
    assert ready == [(2, 2), (3, 3)] and stale == 0 and s.next_seq == 4 and not s.parked


def test_stale_parked_messages_are_counted_as_duplicates():
    s = following()
    s.offer("A", 0, 0, syncing=True)
    s.offer("A", 1, 1, syncing=True)
    s.snapshot_taken("A", 1)  # the snapshot already covers both
    ready, stale = s.ready()
    assert ready == [] and stale == 2 and s.next_seq == 2


def test_hole_filled_is_seen_without_asking():
    s = following()
    s.offer("A", 1, 1)  # gap: 0 missing
    assert not s.hole_filled
    s.parked[0] = 0  # JetStream: the re-sent message lands behind the later one
    assert s.hole_filled


def test_replayed_messages():
    s = following("A", 3)
    assert s.replayed("B", 3) is False  # another epoch: skipped
    assert s.replayed("A", 2) is False  # had it already
    assert s.replayed("A", 4) is None  # leaves a hole: ask again
    assert s.replayed("A", 3) is True and s.next_seq == 4


def test_a_snapshot_after_first_contact_continues_after_its_seq():
    s = Sequencer()
    assert s.offer("A", 7, "a7") is FIRST
    # Until a snapshot adopts it, the new epoch's messages are all first contact: parked.
    assert s.offer("A", 8, "a8", syncing=True) is FIRST
    s.snapshot_taken("A", 7)
    ready, stale = s.ready()
    assert ready == [(8, "a8")] and stale == 1 and s.epoch == "A" and not s.need_snapshot


def test_no_pool_joins_the_live_stream_at_the_oldest_parked():
    s = Sequencer()
    s.offer("A", 4, "a4")
    s.offer("A", 5, "a5", syncing=True)
    assert s.join_live("A") == 3  # the empty reset stands for seq 3
    ready, _ = s.ready()
    assert ready == [(4, "a4"), (5, "a5")]


def test_begin_stream_delivers_from_seq_zero():
    s = Sequencer()
    assert s.offer("A", 0, "a0", jetstream=True) is START
    s.begin_stream("A")
    assert s.next_seq == 1 and s.epoch == "A" and not s.need_snapshot
    assert s.offer("A", 1, "a1", jetstream=True) is D


def test_a_retired_epoch_is_a_duplicate_unless_it_sends_something_new():
    s = following("A")
    for q in range(3):
        s.offer("A", q, q)
    assert s.offer("B", 0, "b0") is CHANGE
    s.snapshot_taken("B", 0)  # A retired with its last seq, 2
    assert s.retired == {"A": 2}
    assert s.offer("A", 1, "late") is DUP  # a late copy from the dead incarnation
    assert s.offer("A", 3, "new") is CONF  # newer than anything it sent: it is alive
    assert s.offer("A", 3, "again") is DUP
    assert s.offer("A", 4, "more") is CONF


def test_forged_parked_messages_beyond_the_workers_last_seq_are_dropped():
    s = following()
    s.offer("A", 1, 1)
    s.offer("A", 99, 99)
    before = set(s.parked)
    assert s.drop_bogus(before, last=1) == 1 and sorted(s.parked) == [1]


def test_parking_is_bounded():
    s = following()
    for q in range(1, MAX_PARKED + 10):
        s.offer("A", q, q)
    assert len(s.parked) == MAX_PARKED and min(s.parked) == 10  # the oldest let go: replay fetches them


def test_what_is_parked_is_one_epochs_never_handed_out_under_anothers_seq():
    # Following A; B (a new incarnation) speaks, then a late A message is parked during the
    # resync, which adopts A. B's parked seq 5 must not come out as A's seq 5.
    s = following("A", 1)
    assert s.offer("B", 5, "b5") is CHANGE
    assert s.offer("A", 1, "a1", syncing=True) is PARK
    assert s.parked_epoch == "A" and s.parked == {1: "a1"}
    s.snapshot_taken("A", 0)
    assert s.ready() == ([(1, "a1")], 0)
    out = []
    for seq in (2, 3, 4, 5):
        assert s.offer("A", seq, f"a{seq}") is D
        out.append(f"a{seq}")
        out += [item for _, item in s.ready()[0]]
    assert out == ["a2", "a3", "a4", "a5"]
    # B, let go for A's message, was still retired by the resync that adopted A.
    assert s.offer("B", 5, "b5") is DUP and s.offer("B", 6, "b6") is CONF


def test_a_revived_epoch_is_an_epoch_change_again():
    s = following("A", 1)
    assert s.offer("B", 0, "b0") is CHANGE
    s.snapshot_taken("A", 0)  # a stale answer of A's, read after B spoke: B is given up
    assert s.offer("B", 1, "b1") is CONF
    s.revive("B")
    assert s.offer("B", 2, "b2") is CHANGE and s.need_snapshot and s.parked == {2: "b2"}
    s.snapshot_taken("B", 1)
    assert s.epoch == "B" and s.ready() == ([(2, "b2")], 0)
    assert s.offer("A", 0, "late") is DUP  # A retired in turn


def test_rivals_are_bounded():
    s = following("A", 1)
    for i in range(1000):
        s.offer(f"forged{i}", 0, i, syncing=True)
        s.offer("A", 1, "a1", syncing=True)
    assert len(s.rivals) <= 64
