"""The native hash-only scan (``_native.scan_batch_msgpack``) that subscribers use for their views.

Its contract: whenever it returns a result, ``decode_batch`` accepts the same bytes and gives the
same ts, rank, event count and block hashes in order; anything it is unsure of is ``None``.
"""

import struct

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from event_strategies import batches, corrupted
from kvbridge import _native
from kvbridge.wire.residency import ops_of as _ops_of
from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, KVEventBatch, decode_batch, encode_batch


def _check_agrees(payload: bytes) -> bool:
    """True if the scan accepted ``payload``; asserts it agrees with the full decode."""
    scanned = _native.scan_batch_msgpack(payload)
    if scanned is None:
        return False
    batch = decode_batch(payload)  # must not raise
    ts, rank, n_events, n_blocks, ops = scanned
    # Bit for bit: a corrupted payload can carry a NaN ts, which equals nothing.
    assert struct.pack("<d", ts) == struct.pack("<d", batch.ts)
    assert (rank, n_events) == (batch.data_parallel_rank, len(batch.events))
    assert (ops, n_blocks) == _ops_of(batch.events)
    return True


@settings(max_examples=300, deadline=None)
@given(batches("vllm"))
def test_scan_agrees_with_decode_on_vllm_batches(batch):
    assert _check_agrees(encode_batch(batch))


@settings(max_examples=300, deadline=None)
@given(batches("vllm"), st.randoms(use_true_random=False))
def test_scan_never_accepts_what_decode_rejects(batch, rnd):
    payload = corrupted(encode_batch(batch), rnd)
    try:
        decode_batch(payload)
    except DecodeError:
        assert _native.scan_batch_msgpack(payload) is None
    else:
        _check_agrees(payload)


def test_scan_merges_runs_and_keeps_order():
    events = [
        BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", None),
        BlockStored([3], 2, [1, 2, 3, 4], 4, None, "GPU", None),
        BlockRemoved([1], "GPU"),
        AllBlocksCleared(),
        BlockStored([b"\x00" * 32], None, [5, 6, 7, 8], 4, 7, None, "lora"),
    ]
    ts, rank, n_events, n_blocks, ops = _native.scan_batch_msgpack(encode_batch(KVEventBatch(2.5, events, 3)))
    assert (ts, rank, n_events, n_blocks) == (2.5, 3, 5, 5)
    assert ops == [
        (0, [1, 2, 3], "GPU", None, 2, None, None, 2),
        (1, [1], "GPU", None, 0, None, None, 1),
        (2, [], None, None, 0, None, None, 1),
        (0, [b"\x00" * 32], None, None, 1, None, None, 1),
    ]


def test_scan_splits_runs_where_the_residency_rule_reads_differently():
    def stored(hashes, parent, **kw):
        return BlockStored(hashes, parent, [0] * 4 * len(hashes), 4, None, kw.pop("medium", "GPU"), None, **kw)

    events = [
        stored([1], None, group_idx=0, kv_cache_spec_kind="full_attention"),
        stored([2], 1, group_idx=0, kv_cache_spec_kind="full_attention"),  # joins: same attributes, a parent
        stored([1], None, group_idx=0, kv_cache_spec_kind="full_attention"),  # parent None: an op of its own
        stored([1], None, group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=8),
        stored([2], 1, group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=16),
        stored([3], 2, group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=16),
        stored([4], 3, group_idx=1, medium="CPU", kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=16),
        BlockRemoved([2], "GPU", group_idx=1),
        BlockRemoved([1], "GPU", group_idx=0),
        BlockRemoved([5], "GPU", group_idx=-3),
    ]
    payload = encode_batch(KVEventBatch(1.0, events))
    ops = _native.scan_batch_msgpack(payload)[4]
    assert ops == [
        (0, [1, 2], "GPU", 0, 1, "full_attention", None, 2),
        (0, [1], "GPU", 0, 1, "full_attention", None, 1),
        (0, [1], "GPU", 1, 1, "sliding_window", 8, 1),
        (0, [2, 3], "GPU", 1, 0, "sliding_window", 16, 2),
        (0, [4], "CPU", 1, 0, "sliding_window", 16, 1),
        (1, [2], "GPU", 1, 0, None, None, 1),
        (1, [1], "GPU", 0, 0, None, None, 1),
        (1, [5], "GPU", -3, 0, None, None, 1),
    ]
    assert _check_agrees(payload)


def test_scan_declines_other_shapes():
    good = KVEventBatch(1.0, [BlockStored([1], None, [1, 2], 2, None, "GPU", None)])
    for payload in [
        b"",
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]),  # required fields missing
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 1, None]]]),  # positional event
        msgspec.msgpack.encode({"ts": 1.0, "events": []}),  # map-encoded batch
        msgspec.msgpack.encode([1, []]),  # int ts: msgspec may take it, the scan leaves it to msgspec
        encode_batch(good) + b"\x00",  # trailing bytes
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                       "token_ids": [1], "block_size": 1, "lora_id": None, "medium": "GPU",
                                       "lora_name": None, "cache_salt": "x"}]]),  # unknown field (SGLang)
    ]:
        assert _native.scan_batch_msgpack(payload) is None, payload


def test_scan_rejects_invalid_utf8_like_msgspec():
    payload = encode_batch(KVEventBatch(1.0, [BlockRemoved([1], "GPU")]))
    bad = payload.replace(b"\xa3GPU", b"\xa3G\xffU")
    assert _native.scan_batch_msgpack(bad) is None
