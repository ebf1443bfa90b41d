"""One worker's ``(epoch, seq)`` rules, apart from any network: the consumer side of the delivery
contract (docs/delivery.md).

:class:`kvbridge.KvEventSubscriber` keeps one :class:`Sequencer` per worker and does what its
verdicts say (deliver, count, ask for a replay or a snapshot); everything it decides is here, in
plain code with no I/O, tested case by case in tests/test_sequencer.py. Items (message bodies)
are opaque: the sequencer only parks and hands them back in order.

* A message of the epoch being followed is delivered when its seq is the next one; an older seq is
  a duplicate; a newer one is a gap: it is parked, and the worker must be asked for the range.
* A message of another epoch is a first contact or a restart: it is parked and the worker must be
  resynced from a snapshot. In JetStream mode a seq 0 of a new epoch starts that incarnation from
  the stream instead (a new incarnation starts empty, and the stream holds all of it).
* Epochs given up (old incarnations, forged headers) are remembered with the highest seq seen
  from them: their late messages are duplicates, but a *newer* seq means that incarnation may
  still be publishing -- two live publishers on one subject: a conflict. (Or its last messages
  were still in flight when it was given up: the subscriber calls it a conflict only if the epoch
  keeps speaking.)
* While a resync is under way, messages are parked; a snapshot or replay that lands moves
  ``next_seq`` and the parked messages that follow come out in order. What is parked is always
  one epoch's (``parked_epoch``): parking another's lets the first go (replay or snapshot fetch
  it again), so a message is never handed out under another incarnation's seq.
* A retired epoch can be revived (``revive``): the subscriber does so when the incarnation it
  follows has gone silent while a retired one keeps speaking -- a snapshot answered by a dying
  incarnation and read after its successor had spoken made the successor the retired one.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["Sequencer", "Verdict"]

# Parked out-of-order messages per worker; beyond this the oldest are let go (replay fetches them).
MAX_PARKED = 65536
# Epochs proven stale per worker; bounded, oldest forgotten.
MAX_RETIRED = 64


class Verdict(enum.Enum):
    DELIVER = "deliver"  # the next seq: deliver it, then whatever parked follows (ready())
    DUPLICATE = "duplicate"  # seen already, or from a retired incarnation: drop
    CONFLICT = "conflict"  # a retired incarnation sent something new: two live publishers
    STREAM_START = "stream-start"  # JetStream: this incarnation starts here (begin_stream())
    FIRST_CONTACT = "first-contact"  # a new epoch, nothing followed before: parked, snapshot
    EPOCH_CHANGE = "epoch-change"  # a new epoch replacing a followed one: parked, snapshot
    PARKED = "parked"  # a resync is under way: parked until it lands
    GAP = "gap"  # seqs are missing before this one: parked, ask for a replay


class Sequencer:
    __slots__ = ("epoch", "next_seq", "parked", "parked_epoch", "rivals", "retired", "need_snapshot")

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.next_seq = 0
        self.parked: dict[int, Any] = {}
        self.parked_epoch: str | None = None
        #: Epochs other than the followed one whose parked messages were let go for another's
        #: during a resync -> their highest parked seq: retired with the parked epoch on adopt.
        self.rivals: dict[str, int] = {}
        #: Retired epoch -> the highest seq seen from it: a dead incarnation sends nothing newer.
        self.retired: dict[str, int] = {}
        self.need_snapshot = True

    def offer(self, epoch: str, seq: int, item: Any, *, syncing: bool = False, jetstream: bool = False) -> Verdict:
        """What to do with a live message."""
        if epoch != self.epoch:
            last = self.retired.get(epoch)
            if last is not None:
                if seq > last:
                    self.retired[epoch] = seq
                    return Verdict.CONFLICT
                return Verdict.DUPLICATE
            if seq == 0 and jetstream and not syncing:
                return Verdict.STREAM_START
            self._park(epoch, seq, item)
            changed = self.epoch is not None and not self.need_snapshot
            self.need_snapshot = True
            return Verdict.EPOCH_CHANGE if changed else Verdict.FIRST_CONTACT
        if seq < self.next_seq:
            return Verdict.DUPLICATE
        if syncing:
            self._park(epoch, seq, item)
            return Verdict.PARKED
        if seq == self.next_seq:
            self.next_seq = seq + 1
            return Verdict.DELIVER
        self._park(epoch, seq, item)
        return Verdict.GAP

    def _park(self, epoch: str, seq: int, item: Any) -> None:
        parked = self.parked
        if self.parked_epoch != epoch:
            # Another epoch's parked messages are let go: kept, they would come out of ready()
            # under this epoch's seqs. A new epoch among them is remembered to be retired if
            # this resync adopts another one (as it would have been, parked to the end).
            if self.parked_epoch != self.epoch:
                _note(self.rivals, self.parked_epoch, max(parked, default=-1))
            parked.clear()
            self.parked_epoch = epoch
        parked[seq] = item
        if len(parked) > MAX_PARKED:
            del parked[min(parked)]

    def ready(self) -> tuple[list[tuple[int, Any]], int]:
        """The parked messages that now follow in order (taken out, ``next_seq`` moved past
        them), and how many parked ones turned out to be stale (duplicates)."""
        parked = self.parked
        stale = [s for s in parked if s < self.next_seq]
        for s in stale:
            del parked[s]
        out = []
        while parked:
            item = parked.pop(self.next_seq, None)
            if item is None:
                break
            out.append((self.next_seq, item))
            self.next_seq += 1
        return out, len(stale)

    @property
    def hole_filled(self) -> bool:
        """The next seq is parked: the hole filled itself (JetStream re-sends land late)."""
        return not self.need_snapshot and self.next_seq in self.parked

    # -- resync outcomes ------------------------------------------------------------------------

    def adopt(self, epoch: str) -> None:
        """Follow ``epoch`` from now on; the ones given up are retired."""
        if self.epoch != epoch:
            self._retire(self.epoch, self.next_seq - 1)
        if self.parked_epoch != epoch:
            self._retire(self.parked_epoch, max(self.parked, default=-1))
            self.parked.clear()
        for rival, last in self.rivals.items():
            if rival != epoch:
                self._retire(rival, last)
        self.rivals.clear()
        self.epoch = self.parked_epoch = epoch

    def revive(self, epoch: str) -> None:
        """Forget that ``epoch`` was retired: its next message is an epoch change again."""
        self.retired.pop(epoch, None)

    def _retire(self, epoch: str | None, last_seq: int) -> None:
        _note(self.retired, epoch, last_seq)

    def begin_stream(self, epoch: str) -> None:
        """JetStream: the incarnation ``epoch`` starts at seq 0, which the caller delivers now."""
        self.adopt(epoch)
        self.need_snapshot = False
        self.next_seq = 1

    def snapshot_taken(self, epoch: str, seq: int) -> None:
        """A snapshot of ``epoch`` consistent with ``seq`` was delivered: continue after it."""
        self.adopt(epoch)
        self.next_seq = seq + 1
        self.need_snapshot = False

    def join_live(self, epoch: str) -> int:
        """No snapshot to be had (no pool behind the publisher): follow the live stream from the
        oldest parked message. Returns the seq the empty reset stands for."""
        self.adopt(epoch)
        self.next_seq = min(self.parked) if self.parked else self.next_seq
        self.need_snapshot = False
        return self.next_seq - 1

    def replayed(self, epoch: str, seq: int) -> bool | None:
        """A replayed message: True to deliver it (``next_seq`` moves), False to skip it (another
        epoch, or already had), None when it leaves a hole (the worker skipped: ask again)."""
        if epoch != self.epoch or seq < self.next_seq:
            return False
        if seq > self.next_seq:
            return None
        self.next_seq = seq + 1
        return True

    def drop_bogus(self, before: set[int], last: int) -> int:
        """Parked seqs (among ``before``) beyond ``last``, the newest the worker says it has sent,
        were not sent by it: drop them. Returns how many."""
        bogus = [s for s in before if s > last and s in self.parked]
        for s in bogus:
            del self.parked[s]
        return len(bogus)


def _note(epochs: dict[str, int], epoch: str | None, last_seq: int) -> None:
    """Remember ``epoch`` in ``epochs`` with the highest seq seen from it; past ``MAX_RETIRED``
    (forged epochs, one message each) the oldest is forgotten."""
    if epoch is not None:
        epochs[epoch] = max(last_seq, epochs.get(epoch, -1))
        while len(epochs) > MAX_RETIRED:
            del epochs[next(iter(epochs))]
