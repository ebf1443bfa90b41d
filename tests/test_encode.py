"""The native encoder writes exactly msgspec's bytes, or refuses with TypeError."""

import collections
import datetime
import enum
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
from event_strategies import batches
from hypothesis import given, settings

from kvbridge import _native
from kvbridge.wire import events
from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

reference = msgspec.msgpack.Encoder().encode
native = _native.encode_batch_msgpack


def _payloads(load_vectors):
    yield from (v["payload_hex"] for v in load_vectors("vllm_event_batches.json")["vectors"])
    yield from (f["payload_hex"] for f in load_vectors("vllm_zmq_frames.json")["frames"])


def test_vectors_identical_on_every_path(load_vectors):
    for payload_hex in _payloads(load_vectors):
        payload = bytes.fromhex(payload_hex)
        batch = events.decode_batch(payload)
        assert native(batch) == payload
        for choice in (None, True, False):
            assert events.encode_batch(batch, native=choice) == payload


@settings(max_examples=400, deadline=None)
@given(batches("any"))
def test_random_batches_identical(batch):
    assert native(batch) == reference(batch)


def _with_value(value):
    stored = BlockStored([1], None, [1], 16, None, None, None, extra_keys=[(value,)], metadata={"v": value})
    return KVEventBatch(0.5, [stored])


Point = collections.namedtuple("Point", "x y")

EDGE_VALUES = [
    # every int form and its boundaries
    *[0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1],
    *[-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)],
    # floats are always float64, including the odd ones
    *[0.0, -0.0, 1.5, 1e300, float("inf"), float("-inf"), float("nan")],
    # fixstr/str8/str16/str32 and bin8/bin16/bin32 boundaries, multi-byte utf-8
    *["", "a" * 31, "a" * 32, "a" * 255, "a" * 256, "é" * 32767, "é" * 32768, "x" * 65536],
    *[b"", b"x" * 255, b"x" * 256, b"x" * 65535, b"x" * 65536, bytearray(b"ab")],
    # fixarray/array16/array32 and fixmap/map16 boundaries, nesting, subclasses msgspec accepts
    *[[], list(range(15)), list(range(16)), list(range(65536)), (), (1, (2, (b"3", None)))],
    *[{}, {str(i): i for i in range(15)}, {str(i): i for i in range(16)}, {"a": 1, 2: "b", "ü": [1.0]}],
    *[True, False, None, collections.OrderedDict(a=1), Point(1, 2), [[[[]]]]],
]


@pytest.mark.parametrize("value", EDGE_VALUES, ids=lambda v: type(v).__name__)
def test_edge_values_identical(value):
    assert native(value) == reference(value)
    assert native(_with_value(value)) == reference(_with_value(value))


def test_blockstored_map16_header_counts_written_fields():
    minimal = reference(BlockStored([1], None, [], 16, None, None, None))
    assert native(BlockStored([1], None, [], 16, None, None, None)) == minimal
    assert minimal[:3] == b"\xde\x00\x08"  # 7 required fields + tag, sized for 16
    full = BlockStored([1], 2, [3], 16, 4, "GPU", "l", [("k",)], 0, "full", 5, "a", "b", "c", {"m": 1})
    assert native(full)[:3] == reference(full)[:3] == b"\xde\x00\x10"
    removed = BlockRemoved([1], "GPU", group_idx=2)
    assert native(removed) == reference(removed)
    assert native(removed)[0] == 0x84  # fixmap: BlockRemoved has 5 fields + tag
    assert native(AllBlocksCleared()) == b"\x81\xa4type\xb0AllBlocksCleared"


class Renamed(msgspec.Struct, tag=7, tag_field="kind", rename="camel", omit_defaults=True):
    first_field: int
    second_field: str | None = None


class Row(msgspec.Struct, array_like=True, tag="row"):
    a: int
    b: Renamed | None = None


class WithDefault(msgspec.Struct, omit_defaults=True):
    a: int = 0


class Palette(enum.Enum):
    RED = "red"


@pytest.mark.parametrize(
    "value",
    [Renamed(1), Renamed(2, "x"), Row(1), Row(2, Renamed(3, "y")), WithDefault(5)],
    ids=repr,
)
def test_struct_options_are_honoured(value):
    if isinstance(value, WithDefault):
        with pytest.raises(TypeError, match="default other than None"):
            native(value)
    else:
        assert native(value) == reference(value)


def _nested(depth):
    value = None
    for _ in range(depth):
        value = (value,)
    return value


@pytest.mark.parametrize(
    "value",
    [memoryview(b"ab"), {1, 2}, Palette.RED, datetime.date(2025, 1, 1), _nested(300), WithDefault(1)],
    ids=lambda v: type(v).__name__,
)
def test_unrepresentable_values_raise_type_error_and_fall_back(value):
    batch = _with_value(value)
    with pytest.raises(TypeError, match="native encoder"):
        native(batch)
    with pytest.raises(TypeError):
        events.encode_batch(batch, native=True)
    assert events.encode_batch(batch) == reference(batch)


@pytest.mark.parametrize("value", [object(), 1j, msgspec.UNSET])
def test_values_nobody_encodes(value):
    for choice in (None, True, False):
        with pytest.raises(TypeError):
            events.encode_batch(_with_value(value), native=choice)


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**40, "lone \ud800 surrogate"])
def test_same_errors_as_msgspec(value):
    batch = _with_value(value)
    with pytest.raises(Exception) as expected:
        reference(batch)
    for choice in (None, True, False):
        with pytest.raises(expected.type):
            events.encode_batch(batch, native=choice)


def test_encode_batch_arguments():
    batch = KVEventBatch(1.0, [])
    with pytest.raises(ValueError, match="msgpack only"):
        events.encode_batch(batch, "json", native=True)
    assert events.encode_batch(batch, "json") == b"[1.0,[],null]"
    with pytest.raises(TypeError, match="KVEventBatch"):
        events.encode_batch([1.0, []], native=True)


def test_threads_share_nothing(load_vectors):
    batches_ = [events.decode_batch(bytes.fromhex(h)) for h in _payloads(load_vectors)]
    expected = [reference(b) for b in batches_]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(20):
            assert list(pool.map(native, batches_)) == expected


def test_buffer_reuse_after_a_huge_batch():
    huge = KVEventBatch(1.0, [BlockStored([1], None, list(range(2**16)), 16, None, None, None)] * 200)
    assert native(huge) == reference(huge)
    small = KVEventBatch(2.0, [AllBlocksCleared()])
    assert native(small) == reference(small)


# Planning a Struct type runs Python code (getattr on an instance). Here that code clears the very
# list the instance sits in, freeing its 40 MB item array (unmapped at once: too big for the heap),
# so a walk still reading that array when the plan is built would crash; a walk that stops, plans
# and starts over encodes the list as it is by then. A subprocess, so that a crash is a failure.
_PLANNED_MID_WALK = """
import msgspec
from kvbridge import _native

items = [None] * 5_000_000

class FirstSeenInAList(msgspec.Struct):
    x: int

    def __getattribute__(self, name):
        items.clear()
        return object.__getattribute__(self, name)

class Holder(msgspec.Struct, array_like=True):
    items: list

first = FirstSeenInAList(1)
items.insert(0, first)
holder = Holder(items)
encoded = _native.encode_batch_msgpack(holder)
assert items == [], "planning never ran the type's __getattribute__: the test proves nothing"
assert encoded == msgspec.msgpack.encode(holder) == b"\\x91\\x90", encoded[:16]
"""


def test_no_plan_is_built_while_a_list_is_walked():
    result = subprocess.run([sys.executable, "-c", _PLANNED_MID_WALK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_fast_path_on_known_interpreters():
    expected = {(3, 11): "signed-size", (3, 12): "tagged-value", (3, 13): "tagged-value", (3, 14): "tagged-value"}
    if os.environ.get("KVBRIDGE_ENCODE_STABLE_API"):
        assert _native._encode_layout() == "api"
    elif sys.version_info[:2] in expected:
        assert _native._encode_layout() == expected[sys.version_info[:2]]


def test_stable_api_path_identical():
    """The fast reads of interpreter internals are optional: this whole file passes without them."""
    env = {**os.environ, "KVBRIDGE_ENCODE_STABLE_API": "1"}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not stable_api"]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
