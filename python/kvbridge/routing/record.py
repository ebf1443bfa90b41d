"""``kvbridge proxy --record FILE``: what the gateway routes, as a trace ``kvbridge replay`` reads.

One JSON line per routed request, in arrival order, in Mooncake's form
(:mod:`kvbridge.replay.trace`)::

    {"timestamp": 1234.5, "input_length": 6758, "output_length": 212, "hash_ids": [...]}

* ``timestamp``: ms since the first request this file records (appending to a trace continues
  its timeline: the first new line comes at its last timestamp);
* ``input_length``: the prompt's tokens, as the engine counts them (the ids the proxy routes by);
* ``output_length``: the completion's tokens, from the answer's ``usage`` (a stream's last
  chunk, or the JSON body), else the streamed chunks that carried text; at least 1;
* ``hash_ids``: one id per ``block``-token block of the prompt, the last one possibly partial:
  the chained xxh3 hash of :func:`kvbridge.hash_blocks` over the full blocks, and for a partial
  last block the same chain continued over its tokens. Two prompts share exactly the leading ids
  whose blocks, and everything before them, are equal; a replay rebuilds prompts that share
  exactly those blocks. No prompt text or token id is written.
* ``hash_block_size``: ``block``, on every line unless it is Mooncake's 512 (then the file is
  Mooncake's form exactly, which Dynamo's replay reads too).

The block is the grain of sharing the replay sees: prompts that share less than a block share
nothing in the file. ``kvbridge proxy`` records at its ``--block-size`` (the engines' block, what
vLLM can reuse) unless ``--record-block-size`` says otherwise; 512 loses, for example, every
system prompt shorter than 512 tokens.

A line is written when its request ends (its output length is known then) and every request
that arrived before it has been written, so the file's timestamps never go back; writes go to a
buffered file, flushed once per batch of lines ready (an append to the page cache, not a wait for
the disk). One proxy process per file: two writing the same file would interleave timelines.
"""

from __future__ import annotations

import json
import os
import time
from os import PathLike
from typing import IO, Any, Sequence

import msgspec

from kvbridge.config import ConfigError
from kvbridge.wire.hashing import hash_blocks

__all__ = ["TRACE_BLOCK", "TraceRecorder", "prompt_hash_ids"]

#: Mooncake's tokens per ``hash_ids`` entry, what ``kvbridge replay`` assumes of a line that
#: does not say (``hash_block_size``).
TRACE_BLOCK = 512

_encode = msgspec.json.Encoder().encode


def prompt_hash_ids(tokens: Sequence[int], block: int = TRACE_BLOCK) -> list[int]:
    """The ``hash_ids`` of a prompt: ``ceil(len(tokens) / block)`` chained ids (module doc)."""
    ids = hash_blocks(tokens, block, algo="xxh3")
    rest = len(tokens) - len(ids) * block
    if rest:
        ids += hash_blocks(tokens[len(tokens) - rest :], rest, algo="xxh3", parent=ids[-1] if ids else None)
    return ids


class TraceRecorder:
    """Appends routed requests to ``path`` (module doc): :meth:`arrive` when a request is taken,
    :meth:`finish` (or :meth:`skip`) when it ends, :meth:`close` at the end.

    ``block``: the tokens per ``hash_ids`` entry (default Mooncake's 512). A path that cannot be
    opened for appending, or a non-empty file whose last line is not a trace line, is a
    :class:`kvbridge.ConfigError` naming it."""

    def __init__(self, path: str | PathLike[str], *, block: int = TRACE_BLOCK, clock: Any = time.monotonic) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise ConfigError(f"record block must be a positive int (tokens per hash id), got {block!r}")
        self.path = os.fspath(path)
        self.block = block
        self.clock = clock
        start = _last_timestamp(self.path)
        try:
            self._file: IO[bytes] | None = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        except OSError as exc:
            raise ConfigError(f"--record {self.path}: cannot open it for appending: {exc.strerror or exc}") from None
        self._base_ms = start
        self._t0: float | None = None
        self._next = 0  # the next slot arrive() hands out
        self._head = 0  # the oldest slot not written yet
        self._ready: dict[int, bytes | None] = {}  # slot -> its line (None: not recorded)
        self._arrived: dict[int, float] = {}
        self.written = 0

    def arrive(self) -> int:
        """A request arrived now: its slot in the file's order."""
        now = self.clock()
        if self._t0 is None:
            self._t0 = now
        slot = self._next
        self._next += 1
        self._arrived[slot] = self._base_ms + (now - self._t0) * 1000.0
        return slot

    def finish(self, slot: int, tokens: Sequence[int], output_length: int) -> None:
        """The request of ``slot`` ended: its prompt's ``tokens`` and the tokens it generated."""
        ts = self._arrived.pop(slot)
        line = {"timestamp": round(ts, 3), "input_length": len(tokens), "output_length": max(1, output_length),
                "hash_ids": prompt_hash_ids(tokens, self.block)}  # fmt: skip
        if self.block != TRACE_BLOCK:
            line["hash_block_size"] = self.block
        self._ready[slot] = _encode(line) + b"\n"
        self._flush()

    def skip(self, slot: int) -> None:
        """The request of ``slot`` is not recorded (its prompt's tokens are unknown)."""
        del self._arrived[slot]
        self._ready[slot] = None
        self._flush()

    def _flush(self) -> None:
        ready, out = self._ready, []
        while self._head in ready:
            line = ready.pop(self._head)
            self._head += 1
            if line is not None:
                out.append(line)
        if out and self._file is not None:
            self._file.write(b"".join(out))
            self._file.flush()
            self.written += len(out)

    def close(self) -> None:
        """Write what has ended (a request still in flight holds back those after it: they are
        written too, its own line left out), and close the file."""
        if self._file is None:
            return
        for slot in list(self._arrived):
            self.skip(slot)
        self._file.close()
        self._file = None


def _last_timestamp(path: str) -> float:
    """The timestamp of a trace file's last line (0 for a missing or empty file)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size == 0:
                return 0.0
            f.seek(max(0, size - 65536))
            tail = f.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    except FileNotFoundError:
        return 0.0
    except OSError as exc:
        raise ConfigError(f"--record {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        ts = json.loads(tail)["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"--record {path}: the file is not empty and its last line is not a trace line "
                          "(a JSON object with a timestamp): record to a new file") from None  # fmt: skip
    return float(ts)
