"""The send log's seq / hole / eviction / cursor rules, without a broker."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbridge.bus.outbox import Outbox


def test_seqs_are_given_in_order_and_held_contiguously():
    ob = Outbox(max_bytes=100)
    assert (ob.first, ob.end, ob.last_seq, ob.cursor, ob.unsent) == (0, 0, -1, 0, 0)
    assert [ob.append(b"x" * 10, 1) for _ in range(3)] == [0, 1, 2]
    assert (ob.first, ob.end, ob.last_seq, len(ob), ob.nbytes) == (0, 3, 2, 3, 30)
    assert ob.get(1) == (b"x" * 10, 1)
    assert ob.held(1, 99) == [(1, b"x" * 10), (2, b"x" * 10)]
    with pytest.raises(IndexError, match="seq 3 is not held"):
        ob.get(3)


# (case, setup, expected (first, end, cursor, evicted_unsent)) -- each a rule of the module doc.
CASES = [
    ("sent messages move the cursor", lambda ob: [ob.append(b"a", 1), ob.append(b"b", 1), ob.sent(0)], (0, 2, 1, 0)),
    ("a send out of turn does not move it", lambda ob: [ob.append(b"a", 1), ob.append(b"b", 1), ob.sent(1)], (0, 2, 0, 0)),
    ("eviction keeps the ring in bounds", lambda ob: [ob.sent(ob.append(b"x" * 6, 1)) for _ in range(3)], (1, 3, 3, 0)),
    ("an unsent evicted message is counted, the cursor skips it", lambda ob: [ob.append(b"x" * 6, 1) for _ in range(3)],
     (1, 3, 1, 1)),
    ("a message larger than the bound is still held (alone)", lambda ob: [ob.append(b"x" * 50, 1)], (0, 1, 0, 0)),
    ("a hole takes a seq and restarts the ring after it", lambda ob: [ob.append(b"a", 1), ob.sent(0), ob.skip()],
     (2, 2, 2, 0)),
    ("unsent messages before a hole are let go, counted", lambda ob: [ob.append(b"a", 1), ob.append(b"b", 1), ob.skip()],
     (3, 3, 3, 2)),
    ("forget lets go of sent messages up to a seq, no hole",
     lambda ob: [ob.append(b"a", 1), ob.append(b"b", 1), ob.sent(0), ob.sent(1), ob.forget(0)], (1, 2, 2, 0)),
    ("forget counts unsent messages it lets go, the cursor skips them",
     lambda ob: [ob.append(b"a", 1), ob.append(b"b", 1), ob.append(b"c", 1), ob.sent(0), ob.forget(1)], (2, 3, 2, 1)),
    ("forget before the oldest held does nothing", lambda ob: [ob.append(b"a", 1), ob.forget(-1)], (0, 1, 0, 0)),
    ("skip_unsent is a hole that counts nothing let go (the caller has the unsent)",
     lambda ob: [ob.append(b"a", 1), ob.append(b"b", 1), ob.sent(0), ob.skip_unsent()], (3, 3, 3, 0)),
    ("a rewind sends again from there", lambda ob: [ob.append(b"a", 1), ob.append(b"b", 1), ob.sent(0), ob.sent(1),
                                                   ob.rewind(0)], (0, 2, 0, 0)),
    ("a rewind never goes before the oldest held", lambda ob: [ob.sent(ob.append(b"x" * 6, 1)) for _ in range(3)]
     + [ob.rewind(0)], (1, 3, 1, 0)),
    ("a rewind never moves the cursor forward", lambda ob: [ob.append(b"a", 1), ob.append(b"b", 1), ob.rewind(1)],
     (0, 2, 0, 0)),
]


@pytest.mark.parametrize("case,setup,expected", CASES, ids=[c[0] for c in CASES])
def test_outbox_rules(case, setup, expected):
    ob = Outbox(max_bytes=12)
    setup(ob)
    assert (ob.first, ob.end, ob.cursor, ob.evicted_unsent) == expected, case


def test_a_seq_is_sent_for_the_first_time_once():
    # The one count of "published" (the core sender's messages) and of JetStream's re-sends.
    ob = Outbox(max_bytes=100)
    for _ in range(3):
        ob.append(b"m", 1)
    assert ob.never_sent == 0
    assert [ob.sent(0), ob.sent(1)] == [True, True] and ob.never_sent == 2
    ob.rewind(0)
    assert [ob.sent(0), ob.sent(1), ob.sent(2)] == [False, False, True] and ob.never_sent == 3
    ob.skip()  # a hole is never sent, and the next message's first send still counts
    ob.append(b"n", 1)
    assert ob.never_sent == 3 and ob.sent(4) is True and ob.never_sent == 5


def test_skip_unsent_hands_back_the_unsent_in_seq_order():
    ob = Outbox(max_bytes=100)
    for payload in (b"a", b"bb", b"ccc"):
        ob.append(payload, len(payload))
    ob.sent(0)
    assert ob.skip_unsent() == (3, [(b"bb", 2), (b"ccc", 3)])
    assert ob.append(b"bb", 2) == 4 and ob.unsent == 1  # numbered again behind the hole


class OutboxMachine(RuleBasedStateMachine):
    """Against a plain model: every seq is given once, the ring is a suffix of what was
    appended since the last hole, within its bound (or one message), the cursor is in it, and
    everything that left the ring unsent was counted."""

    def __init__(self) -> None:
        super().__init__()
        self.ob = Outbox(max_bytes=64)
        self.messages: dict[int, bytes] = {}
        self.holes: set[int] = set()
        self.next = 0
        self.sent: set[int] = set()
        self.renumbered: set[int] = set()  # handed back by skip_unsent: not let go

    @rule(size=st.integers(0, 40))
    def append(self, size: int) -> None:
        self.append_payload(bytes([self.next % 256]) * size)

    def append_payload(self, payload: bytes) -> None:
        assert self.ob.append(payload, 1) == self.next
        self.messages[self.next] = payload
        self.next += 1

    @rule()
    def skip(self) -> None:
        assert self.ob.skip() == self.next
        self.holes.add(self.next)
        self.next += 1

    @precondition(lambda self: self.ob.unsent > 0)
    @rule()
    def send_next(self) -> None:
        seq = self.ob.cursor
        assert self.ob.get(seq)[0] == self.messages[seq]
        assert self.ob.sent(seq) == (seq not in self.sent)  # first send: once per seq, re-sends are not
        self.sent.add(seq)

    @rule()
    def skip_unsent(self) -> None:
        cursor, evicted = self.ob.cursor, self.ob.evicted_unsent
        hole, unsent = self.ob.skip_unsent()
        assert hole == self.next and unsent == [(self.messages[s], 1) for s in range(cursor, hole)]
        assert self.ob.evicted_unsent == evicted
        self.holes.add(hole)
        self.renumbered.update(range(cursor, hole))
        self.next += 1
        for payload, _ in unsent:  # numbered again behind the hole, as the publisher does
            self.append_payload(payload)

    @rule(ahead=st.integers(-2, 6))
    def forget(self, ahead: int) -> None:
        self.ob.forget(self.ob.first + ahead)

    @rule(back=st.integers(0, 10))
    def rewind(self, back: int) -> None:
        before = self.ob.cursor
        self.ob.rewind(before - back)
        assert max(self.ob.first, before - back) == self.ob.cursor or self.ob.cursor == before

    @invariant()
    def consistent(self) -> None:
        ob = self.ob
        assert ob.end == self.next and ob.last_seq == self.next - 1
        assert ob.first <= ob.cursor <= ob.end
        assert ob.never_sent == max(self.sent, default=-1) + 1
        held = ob.held(0, self.next)
        assert [s for s, _ in held] == list(range(ob.first, ob.end))
        assert all(p == self.messages[s] for s, p in held)
        assert not any(h in range(ob.first, ob.end) for h in self.holes)
        assert ob.nbytes == sum(len(p) for _, p in held)
        assert ob.nbytes <= ob.max_bytes or len(ob) == 1
        # Everything below the oldest held that was neither sent nor a hole nor numbered again was
        # counted as let go.
        gone_unsent = {s for s in self.messages if s < ob.first and s not in self.sent | self.renumbered}
        assert ob.evicted_unsent >= len(gone_unsent)


TestOutboxMachine = OutboxMachine.TestCase
TestOutboxMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
