"""Hypothesis strategies for random KVEventBatches.

``batches(wire)`` draws batches using every field, int and bytes hashes, and free-form
``extra_keys``/``metadata``. What the free-form parts may hold depends on the property:

- ``"any"``: everything the encoders write (nested tuples, bytes, NaN/inf) -- for byte identity;
- ``"msgpack"``: what decodes back to an equal value (nested tuples come back as lists, NaN
  never compares equal);
- ``"json"``: additionally no bytes in free-form parts (JSON gives them back as base64 str).
"""

from __future__ import annotations

from typing import Literal

from hypothesis import strategies as st

from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

Wire = Literal["any", "msgpack", "json"]

# Every msgpack int width, both signs, and the u64 range vLLM's hashes live in.
ints = st.one_of(
    st.integers(-40, 300),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([2**7, 2**8, 2**15, 2**16, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]),
)
# Short names and ones past the fixstr/str8 boundaries.
texts = st.one_of(st.text(max_size=12), st.text(min_size=28, max_size=300))
hashes = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32), st.binary(max_size=300))


def _optional(strategy):
    return st.none() | strategy


def free_values(wire: Wire):
    finite_only = wire != "any"
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        ints,
        st.floats(allow_nan=not finite_only, allow_infinity=wire != "json"),
        texts,
    )
    if wire != "json":
        leaves |= st.binary(max_size=300)

    def containers(children):
        nested = st.lists(children, max_size=5) | st.dictionaries(texts, children, max_size=4)
        if wire == "any":
            nested |= st.lists(children, max_size=5).map(tuple)
        return nested

    return st.recursive(leaves, containers, max_leaves=10)


def events(wire: Wire):
    free = free_values(wire)
    stored = st.builds(
        BlockStored,
        block_hashes=st.lists(hashes, max_size=20),
        parent_block_hash=_optional(hashes),
        token_ids=st.lists(ints, max_size=70),
        block_size=ints,
        lora_id=_optional(ints),
        medium=_optional(texts),
        lora_name=_optional(texts),
        extra_keys=_optional(st.lists(_optional(st.lists(free, max_size=4).map(tuple)), max_size=5)),
        group_idx=_optional(ints),
        kv_cache_spec_kind=_optional(texts),
        kv_cache_spec_sliding_window=_optional(ints),
        locality=_optional(texts),
        ownership=_optional(texts),
        session_id=_optional(texts),
        lookahead_token_ids=_optional(st.lists(st.lists(ints, max_size=6), max_size=5)),
        metadata=_optional(st.dictionaries(texts, free, max_size=4)),
    )
    removed = st.builds(
        BlockRemoved,
        block_hashes=st.lists(hashes, max_size=20),
        medium=_optional(texts),
        group_idx=_optional(ints),
        locality=_optional(texts),
        ownership=_optional(texts),
    )
    return st.one_of(stored, removed, st.just(AllBlocksCleared()))


def batches(wire: Wire = "any"):
    return st.builds(
        KVEventBatch,
        ts=st.floats(allow_nan=wire == "any", allow_infinity=wire != "json"),
        events=st.lists(events(wire), max_size=8),
        data_parallel_rank=_optional(ints),
    )


def corrupted(payload: bytes, rnd) -> bytes:
    """``payload`` with one to three bytes overwritten and, a third of the time, cut short: the
    damage a reader must refuse or read exactly as msgspec does (``rnd``: hypothesis' randoms)."""
    out = bytearray(payload)
    for _ in range(rnd.randrange(1, 4)):
        out[rnd.randrange(len(out))] = rnd.randrange(256)
    if rnd.random() < 0.3:
        del out[rnd.randrange(len(out)) :]
    return bytes(out)
