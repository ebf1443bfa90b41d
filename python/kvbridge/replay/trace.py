"""Traces a replay reads: Mooncake's JSONL, and a JSONL of token ids (a user's own logs).

Mooncake (kvcache-ai/Mooncake, FAST'25 release; what Dynamo's replay reads): one JSON object per
line, ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens) and ``hash_ids``: one id
per ``trace_block_size``-token block of the prompt (512 in Mooncake's files), equal ids meaning
equal content at the same position. Prompts are made of tokens the way Dynamo 1.6.1's replay makes
them (``aisimulate-core`` ``replay/loadgen/trace.rs``, ``HashIdInterner`` and
``synthesize_validated_trace_tokens``): every distinct hash id gets a canonical number in order of
first appearance, and token ``p`` of the prompt is the canonical number of ``hash_ids[p //
trace_block_size]``. So two prompts share exactly the leading blocks whose ids they share, and
the engine's blocks (of any size dividing the trace block) chain the same way. A line may say
its own block (``hash_block_size``, as ``kvbridge proxy --record`` writes when it records finer
blocks than Mooncake's); it overrides ``trace_block_size``.

Token ids: one JSON object per line, ``timestamp`` (ms), ``output_length`` and ``tokens`` (the
prompt's ids; ``input_length`` optional, must match). ``kvbridge proxy --record`` writes the
Mooncake form (hash ids of the prompt's blocks, no text: :mod:`kvbridge.routing.record`).

A bad line is a :class:`TraceError` naming the file, the line and what was expected.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from os import PathLike
from typing import Any, Iterable, Iterator

from kvbridge.errors import Error

__all__ = ["Request", "TraceError", "load_trace", "parse_trace"]

#: Mooncake's block of ``hash_ids``.
MOONCAKE_BLOCK = 512


class TraceError(Error, ValueError):
    """A trace line that cannot be replayed (the message names the file and line)."""


@dataclass(slots=True)
class Request:
    """One request of a trace: arrival (ms from the trace's first), prompt and output lengths,
    and the prompt as runs of one token id (``[(token, count), ...]``, compact for Mooncake's
    prompts) or as a list of token ids."""

    index: int
    arrival_ms: float
    input_length: int
    output_length: int
    prompt: list[tuple[int, int]] | list[int] = field(repr=False)
    runs: bool = True

    @property
    def tokens(self) -> array:
        """The prompt's token ids as an ``array('I')``, made on each call (the native pool, index
        and hashing read it in place)."""
        if not self.runs:
            return array("I", self.prompt)
        out = array("I")
        for token, count in self.prompt:  # type: ignore[misc]
            out += array("I", (token,)) * count
        return out


def _int(obj: dict[str, Any], key: str, where: str, minimum: int) -> int:
    if key not in obj:
        raise TraceError(f"{where}: missing key {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"{where}: {key} must be an integer, got {v!r}")
    if v < minimum:
        raise TraceError(f"{where}: {key} must be >= {minimum}, got {v}")
    return v


def _timestamp(obj: dict[str, Any], where: str) -> float:
    if "timestamp" not in obj:
        raise TraceError(f"{where}: missing key 'timestamp'")
    v = obj["timestamp"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise TraceError(f"{where}: timestamp must be a finite number of ms, got {v!r}")
    if v < 0:
        raise TraceError(f"{where}: timestamp must be >= 0, got {v}")
    try:
        return float(v)
    except OverflowError:  # an int past a float's range
        raise TraceError(f"{where}: timestamp must be a finite number of ms, got an integer of {len(str(v))} digits") from None


def parse_trace(lines: Iterable[str | bytes], *, name: str = "<trace>", trace_block_size: int = MOONCAKE_BLOCK) -> Iterator[Request]:
    """The requests of a trace's lines, in order (blank lines skipped). Arrivals are relative to
    the first request's timestamp; timestamps must not go back."""
    if isinstance(trace_block_size, bool) or not isinstance(trace_block_size, int) or trace_block_size <= 0:
        raise ValueError(f"trace_block_size must be a positive int, got {trace_block_size!r}")
    canon: dict[Any, int] = {}
    first: float | None = None
    last = -1.0
    index = 0
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except ValueError as e:  # UnicodeDecodeError too: bytes that are not UTF-8
            raise TraceError(f"{where}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        ts = _timestamp(obj, where)
        if ts < last:
            raise TraceError(f"{where}: timestamp goes back ({ts:g} ms after {last:g} ms)")
        last = ts
        if first is None:
            first = ts
        out_len = _int(obj, "output_length", where, 1)
        if "tokens" in obj:
            tokens = _token_ids(obj["tokens"], where)
            if "input_length" in obj and _int(obj, "input_length", where, 1) != len(tokens):
                raise TraceError(f"{where}: input_length {obj['input_length']} != {len(tokens)} tokens")
            yield Request(index, ts - first, len(tokens), out_len, tokens, runs=False)
        else:
            in_len = _int(obj, "input_length", where, 1)
            tbs = _int(obj, "hash_block_size", where, 1) if "hash_block_size" in obj else trace_block_size
            runs = _from_hash_ids(obj, in_len, tbs, canon, where)
            yield Request(index, ts - first, in_len, out_len, runs)
        index += 1


def _token_ids(v: Any, where: str) -> list[int]:
    if not isinstance(v, list) or not v:
        raise TraceError(f"{where}: tokens must be a non-empty list of token ids")
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32:
            raise TraceError(f"{where}: tokens[{i}] must be a token id in 0..2^32-1, got {t!r}")
    return v


def _from_hash_ids(obj: dict[str, Any], in_len: int, tbs: int, canon: dict[Any, int], where: str) -> list[tuple[int, int]]:
    if "hash_ids" not in obj:
        raise TraceError(f"{where}: missing key 'hash_ids' (or 'tokens')")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise TraceError(f"{where}: hash_ids must be a list, got {type(ids).__name__}")
    blocks = -(-in_len // tbs)
    if len(ids) != blocks:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length {in_len}: {blocks} expected "
            f"(one per {tbs}-token block, the last possibly partial)"
        )
    runs = []
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, (int, str)):
            raise TraceError(f"{where}: hash_ids[{i}] must be an integer or string, got {h!r}")
        c = canon.get(h)
        if c is None:
            c = canon[h] = len(canon)
        runs.append((c, min(tbs, in_len - tbs * i)))
    return runs


def load_trace(path: str | PathLike[str], *, trace_block_size: int = MOONCAKE_BLOCK, limit: int | None = None) -> list[Request]:
    """The requests of a trace file (at most ``limit`` of them)."""
    out: list[Request] = []
    if limit is not None and limit <= 0:
        return out
    with open(path, "rb") as f:  # json reads UTF-8 bytes; a line that is not is named as such
        for req in parse_trace(f, name=str(path), trace_block_size=trace_block_size):
            out.append(req)
            if len(out) == limit:
                break  # what follows is not read
    return out
