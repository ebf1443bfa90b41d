"""The publisher's numbered send log: seqs, the replay ring, holes, and the send cursor.

One owner for the rules every sender follows (the core sender in :mod:`kvbridge.bus.sender` and
the JetStream one in :mod:`kvbridge.bus.jetstream.acks` drive it through these methods, and neither
touches its state):

* every message gets the next seq when it is numbered, and is kept, encoded, in a ring bounded
  in bytes, contiguous from ``first``: replay serves from it, senders send from it;
* the ring evicts its oldest messages to stay in bounds; a message evicted before it was sent is
  counted (``evicted_unsent``) and the cursor moves past it -- consumers see the hole and resync;
* ``forget(seq)`` lets go of the oldest messages up to ``seq`` before the ring would (messages a
  server will no longer take): replay answers that they are gone;
* a hole (``skip``) takes a seq that no message carries. Nothing before it can be replayed
  usefully (a consumer behind a hole needs a snapshot anyway), so the ring restarts after it and
  unsent messages before it are let go, counted (``skip_unsent`` hands them back instead, to be
  numbered again behind the hole);
* the send cursor is the first seq not yet sent. ``sent(seq)`` moves it past a message that went
  out; ``rewind(seq)`` moves it back for a re-send (JetStream: whatever the stream has not
  acknowledged), never before ``first``;
* ``never_sent`` is the first seq that never went out: ``sent(seq)`` says whether this was
  ``seq``'s first send, so a message is counted as published once however often it is re-sent
  (the core sender counts messages, JetStream counts re-sends, both by this one rule).

No I/O, no clock, no asyncio: the rules are tested without a broker (tests/test_outbox.py).
"""

from __future__ import annotations

from collections import deque

__all__ = ["Outbox"]


class Outbox:
    __slots__ = ("max_bytes", "_entries", "_first", "_bytes", "_cursor", "_never_sent", "evicted_unsent")

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: deque[tuple[bytes, int]] = deque()  # (payload, events in it)
        self._first = 0
        self._bytes = 0
        self._cursor = 0
        self._never_sent = 0
        #: Messages let go before they were ever sent (evicted, or behind a hole).
        self.evicted_unsent = 0

    # -- numbering ------------------------------------------------------------------------------

    def append(self, payload: bytes, n_events: int) -> int:
        """Number ``payload`` with the next seq and keep it; returns that seq."""
        seq = self.end
        self._entries.append((payload, n_events))
        self._bytes += len(payload)
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            self._evict_oldest()
        self._cursor_past_evicted()
        return seq

    def skip(self) -> int:
        """Leave a hole: a seq no message carries. Returns it."""
        hole = self.end
        self.evicted_unsent += self.end - self._cursor
        self._entries.clear()
        self._bytes = 0
        self._first = self._cursor = hole + 1
        return hole

    def forget(self, seq: int) -> None:
        """Let go of the held messages up to ``seq`` (replay then answers that they are gone):
        messages that can no longer be sent as they are (a server's smaller ``max_payload``).
        Unsent ones among them are counted as evicted, as the ring's own evictions are."""
        while self._entries and self._first <= seq:
            self._evict_oldest()
        self._cursor_past_evicted()

    def _evict_oldest(self) -> None:
        old, _ = self._entries.popleft()
        self._bytes -= len(old)
        self._first += 1

    def _cursor_past_evicted(self) -> None:
        if self._cursor < self._first:
            self.evicted_unsent += self._first - self._cursor
            self._cursor = self._first

    def skip_unsent(self) -> tuple[int, list[tuple[bytes, int]]]:
        """``skip()``, handing back the unsent messages it lets go, ``(payload, n_events)`` in seq
        order, instead of counting them: the caller numbers them again behind the hole."""
        unsent = list(self._entries)[self._cursor - self._first :]
        evicted = self.evicted_unsent
        hole = self.skip()
        self.evicted_unsent = evicted
        return hole, unsent

    # -- reading --------------------------------------------------------------------------------

    @property
    def first(self) -> int:
        """The oldest seq still held (== ``end`` when the ring is empty)."""
        return self._first

    @property
    def end(self) -> int:
        """The seq the next message will get."""
        return self._first + len(self._entries)

    @property
    def last_seq(self) -> int:
        """The newest seq given (to a message or a hole); -1 before any."""
        return self.end - 1

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, seq: int) -> tuple[bytes, int]:
        """``(payload, n_events)`` of a held message; IndexError for one not held."""
        if not self._first <= seq < self.end:
            raise IndexError(f"seq {seq} is not held (held: {self._first}..{self.end - 1})")
        return self._entries[seq - self._first]

    def held(self, start: int, stop: int) -> list[tuple[int, bytes]]:
        """``(seq, payload)`` for the held seqs in ``[start, stop]``, copied out: the ring may move
        while a caller sends them."""
        lo, hi = max(start, self._first), min(stop, self.end - 1)
        return [(seq, self._entries[seq - self._first][0]) for seq in range(lo, hi + 1)]

    # -- the send cursor -----------------------------------------------------------------------

    @property
    def cursor(self) -> int:
        """The first seq not yet sent."""
        return self._cursor

    @property
    def unsent(self) -> int:
        return self.end - self._cursor

    @property
    def never_sent(self) -> int:
        """The first seq that never went out: every seq below it was sent at least once (or
        let go unsent, or was a hole); seqs below it that go out again are re-sends."""
        return self._never_sent

    def sent(self, seq: int) -> bool:
        """``seq`` went out: the cursor moves past it (unless the ring moved meanwhile). True
        when this was its first send."""
        if self._cursor == seq:
            self._cursor = seq + 1
        if seq < self._never_sent:
            return False
        self._never_sent = seq + 1
        return True

    def rewind(self, seq: int) -> None:
        """Send again from ``seq`` (or the oldest held, if ``seq`` is gone)."""
        self._cursor = min(self._cursor, max(seq, self._first))
