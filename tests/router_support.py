"""What the time-cost router tests share: a clock they move by hand and an index fed one worker's
stored prompt."""

from __future__ import annotations

from kvbridge import BlockStored, Index, KVEventBatch

BS = 16


class Clock:
    """A router's ``clock=``: seconds, moved by the test."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def store(index: Index, worker: str, tokens: list[int]) -> None:
    """``worker`` holds ``tokens``' full blocks (one BlockStored, on the GPU)."""
    n = len(tokens) // BS
    ev = BlockStored(list(range(1, n + 1)), None, tokens[: n * BS], BS, None, "GPU", None, None)
    index.apply(worker, KVEventBatch(0.0, [ev]))
