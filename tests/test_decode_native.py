"""The native msgpack decode (``_native.BatchDecoder``, rust/decode.rs) that ``decode_batch`` tries
first on ``bytes``.

Its contract: whenever it answers, the batch equals msgspec's decode of the same bytes, field for
field and type for type; anything else (another shape, a malformed payload, the free-form fields)
is ``None``, and msgspec decides.
"""

import gc
import struct
import sys
import threading

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from event_strategies import batches, corrupted
from kvbridge._native import BatchDecoder
from kvbridge.wire import events as wire_events
from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch

_msgspec_decode = msgspec.msgpack.Decoder(KVEventBatch).decode


def _decoder() -> BatchDecoder:
    return BatchDecoder(KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared)


def _same(native: KVEventBatch, reference: KVEventBatch) -> None:
    # Bit for bit: a NaN ts equals nothing.
    assert struct.pack("<d", native.ts) == struct.pack("<d", reference.ts)
    assert type(native) is KVEventBatch
    assert native.data_parallel_rank == reference.data_parallel_rank
    assert len(native.events) == len(reference.events)
    for a, b in zip(native.events, reference.events):
        assert type(a) is type(b)
        assert a == b
        for field in a.__struct_fields__:
            va, vb = getattr(a, field), getattr(b, field)
            assert type(va) is type(vb), field
            if isinstance(va, list):
                assert [type(x) for x in va] == [type(x) for x in vb], field


def _plain(ev):
    """``ev`` without the free-form fields the native decoder leaves to msgspec."""
    if isinstance(ev, BlockStored):
        return msgspec.structs.replace(ev, extra_keys=None, lookahead_token_ids=None, metadata=None)
    return ev


plain_batches = batches("vllm").map(lambda b: msgspec.structs.replace(b, events=[_plain(ev) for ev in b.events]))


@settings(max_examples=300, deadline=None)
@given(plain_batches)
def test_native_decode_equals_msgspec(batch):
    payload = encode_batch(batch)
    native = _decoder().decode(payload)
    assert native is not None  # vLLM's shape without free-form fields: always read natively
    _same(native, _msgspec_decode(payload))
    _same(decode_batch(payload), native)


@settings(max_examples=200, deadline=None)
@given(batches("vllm"))
def test_native_decode_leaves_free_form_fields_to_msgspec(batch):
    payload = encode_batch(batch)
    native = _decoder().decode(payload)
    free_form = any(
        isinstance(ev, BlockStored) and (ev.extra_keys, ev.lookahead_token_ids, ev.metadata) != (None, None, None)
        for ev in batch.events
    )
    if free_form:
        assert native is None
    else:
        _same(native, _msgspec_decode(payload))
    _same(decode_batch(payload), _msgspec_decode(payload))


@settings(max_examples=300, deadline=None)
@given(plain_batches, st.randoms(use_true_random=False))
def test_native_decode_never_accepts_what_msgspec_rejects(batch, rnd):
    payload = corrupted(encode_batch(batch), rnd)
    native = _decoder().decode(payload)
    try:
        reference = _msgspec_decode(payload)
    except (msgspec.DecodeError, TypeError, RecursionError):
        assert native is None
    else:
        if native is not None:
            _same(native, reference)


def test_token_ids_share_one_int_per_value():
    tokens = [300, 70_000, 300, (1 << 18) - 1, 1 << 18, 2**40, -5, 0, 2**64 - 1]
    payload = encode_batch(KVEventBatch(1.5, [BlockStored([1], None, tokens, 9, None, "GPU", None)], 0))
    d = _decoder()
    first, second = d.decode(payload), d.decode(payload)
    assert first.events[0].token_ids == tokens == second.events[0].token_ids
    a, b = first.events[0].token_ids, second.events[0].token_ids
    # Below the cache's bound: one object per value, within a batch and across batches.
    assert a[0] is a[2] is b[0] and a[1] is b[1] and a[3] is b[3]
    # Beyond it (and negative): fresh ints, equal all the same.
    assert a[4] is not b[4] and a[5] is not b[5]


def test_other_shapes_are_left_to_msgspec():
    d = _decoder()
    positional = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2], 2, None, "GPU", None]], None])
    map_batch = msgspec.msgpack.encode({"ts": 1.0, "events": [], "data_parallel_rank": None})
    unknown_field = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "cache_salt": "x"}], None]
    )
    int_ts = msgspec.msgpack.encode([1, [], None])
    trailing = encode_batch(KVEventBatch(1.0, [])) + b"\x00"
    for payload in (positional, map_batch, unknown_field, int_ts, b"", b"\xc1", trailing):
        assert d.decode(payload) is None
    # decode_batch still reads the foreign ones, as msgspec and the foreign-shape decoders do.
    assert decode_batch(positional).events[0].token_ids == [1, 2]
    assert decode_batch(unknown_field) == KVEventBatch(1.0, [BlockRemoved([1], "GPU")], None)
    assert decode_batch(int_ts) == KVEventBatch(1.0, [], None)


def test_decode_batch_uses_the_native_decoder_for_bytes_only():
    batch = KVEventBatch(2.0, [BlockStored([7], 6, [1000, 1001], 2, None, "GPU", None), AllBlocksCleared()], None)
    payload = encode_batch(batch)
    tokens = [decode_batch(payload).events[0].token_ids[0] for _ in range(2)]
    assert tokens[0] is tokens[1]  # shared: the native decoder's
    views = [decode_batch(memoryview(payload)).events[0].token_ids[0] for _ in range(2)]
    assert views[0] == 1000 and views[0] is not views[1]  # msgspec's own
    assert decode_batch(bytearray(payload)) == decode_batch(payload) == batch


def test_a_decoder_busy_on_this_thread_declines_instead_of_waiting():
    # A garbage collection inside a decode (here forced at its first list) runs callbacks and
    # finalizers, which may decode again on the same thread: that one must answer None at once
    # (msgspec then decodes), not deadlock or raise.
    decode = _decoder().decode  # bound beforehand: making a bound method could itself collect
    payload = encode_batch(KVEventBatch(3.0, [BlockStored([1, 2], None, [5] * 8, 4, None, "GPU", None)] * 20, 1))
    inner = []

    def during_gc(phase, info):
        if phase == "start" and not inner:
            inner.append(decode(payload))

    threshold = gc.get_threshold()
    gc.collect()  # from a count of 0, the decode's own lists start the next collection
    gc.callbacks.append(during_gc)
    gc.set_threshold(1)
    try:
        outer = decode(payload)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(during_gc)
    assert inner == [None]
    _same(outer, _msgspec_decode(payload))


def test_threads_share_the_module_decoder():
    payloads = [
        encode_batch(KVEventBatch(float(i), [BlockStored([i], None, list(range(i, i + 64)), 64, None, "GPU", None)], i))
        for i in range(50)
    ]
    errors = []

    def work():
        try:
            for _ in range(20):
                for p in payloads:
                    _same(wire_events.decode_batch(p), _msgspec_decode(p))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_shared_ints_keep_their_counts_whatever_the_decode_ends_in():
    # The cached ints' counts are written inline: every reference a list took must go when the
    # list does, whether the decode answered or gave up mid-list, after a list, at a later event
    # or at the batch's end (the lists it built then are dropped half filled).
    d = _decoder()

    def stored(tokens, **fields):
        ev = {"type": "BlockStored", "block_hashes": [2**63], "parent_block_hash": None, "token_ids": tokens}
        ev.update({"block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None})
        ev.update(fields)
        return ev

    good = msgspec.msgpack.encode([1.0, [stored([5000, 7, 5000, 2**40])]])
    token = d.decode(good).events[0].token_ids[0]
    base = sys.getrefcount(token)
    refused = [
        msgspec.msgpack.encode([1.0, [stored([5000] * 10 + [1.5])]]),
        msgspec.msgpack.encode([1.0, [stored([5000] * 10, block_size="x")]]),
        msgspec.msgpack.encode([1.0, [stored([5000] * 10), {"type": "Nope"}]]),
        msgspec.msgpack.encode([1.0, [stored([5000] * 10)], "rank"]),
        msgspec.msgpack.encode([1.0, [stored([5000] * 10)]]) + b"\x00",
    ]
    for _ in range(100):
        for payload in refused:
            assert d.decode(payload) is None
    assert sys.getrefcount(token) == base
    kept = [d.decode(good) for _ in range(100)]
    assert sys.getrefcount(token) == base + 200
    del kept
    assert sys.getrefcount(token) == base
