"""kvbridge.hash_blocks / BlockHasher against the shared vectors and Python reference models."""
import array
import copy
import hashlib
import os
import pickle
import struct
import subprocess
import sys

import cbor2
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvbridge
import kvbridge.wire.hashing
from kvbridge import ALGORITHMS, BlockHasher, hash_blocks

VLLM_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
U64 = 2**64 - 1


def as_tuple(x):
    """JSON has lists where vLLM had tuples."""
    return tuple(as_tuple(i) for i in x) if isinstance(x, list) else x


# --- Python reference models, written as the engines write them ------------------------------

def vllm_fn(algo):
    ser = (lambda o: pickle.dumps(o, protocol=5)) if "cbor" not in algo else (lambda o: cbor2.dumps(o, canonical=True))
    h = (lambda b: hashlib.sha256(b).digest()) if algo.startswith("sha256") else xxhash.xxh3_128_digest
    return lambda obj: h(ser(obj))


def vllm_ref(algo, tokens, bs, seed="vllm-none-hash", extra_keys=None, parent=None):
    fn = vllm_fn(algo)
    prev = parent or fn(seed)
    out = []
    for i in range(len(tokens) // bs):
        ek = extra_keys[i] if extra_keys else None
        prev = fn((prev, tuple(tokens[i * bs:(i + 1) * bs]), ek))
        out.append(prev)
    return out


def salted(base, lora=None, ns=None):
    if lora:
        base = (base + xxhash.xxh3_64_intdigest(lora.encode(), 0)) & U64
    if ns:
        base = (base + xxhash.xxh3_64_intdigest(ns.encode(), 1)) & U64
    return base


def xxh3_ref(tokens, bs, seed=0, lora=None, ns=None, extra_keys=None, parent=None):
    h = parent if parent is not None else salted(seed, lora, ns)
    out = []
    for i in range(len(tokens) // bs):
        s = h
        if extra_keys and extra_keys[i] is not None:
            s = xxhash.xxh3_64_intdigest(cbor2.dumps(extra_keys[i], canonical=True), h)
        h = xxhash.xxh3_64_intdigest(struct.pack(f"<{bs}I", *tokens[i * bs:(i + 1) * bs]), s)
        out.append(h)
    return out


def dynamo_ref(tokens, bs, lora=None, ns=None, mm=None):
    seed = salted(1337, lora, ns)
    out = []
    for i in range(len(tokens) // bs):
        data = struct.pack(f"<{bs}I", *tokens[i * bs:(i + 1) * bs])
        if mm and mm[i]:
            data += b"".join(struct.pack("<Q", h) for h in sorted(mm[i]))
        out.append(xxhash.xxh3_64_intdigest(data, seed))
    return out


def dynamo_seq_ref(local, parent=None):
    out = []
    for i, h in enumerate(local):
        prev = out[-1] if out else parent
        out.append(h if prev is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, h), 1337))
    return out


def u64(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & U64


# --- the shared vectors -----------------------------------------------------------------------

def case_name(case):
    return f"{case['algo']} seed={case['seed']} bs={case['block_size']}"


def case_extra_keys(case):
    keys = [as_tuple(b["extra_keys"]) for b in case["blocks"]]
    return keys if any(k is not None for k in keys) else None


def test_vllm_vectors(load_vectors, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    cases = load_vectors("vllm_block_hashes.json")["cases"]
    for case in cases:
        kw = dict(algo=case["algo"], seed=case["seed"], extra_keys=case_extra_keys(case))
        got = hash_blocks(case["tokens"], case["block_size"], **kw)
        assert got == [b["hash_u64"] for b in case["blocks"]], case_name(case)
        got = hash_blocks(case["tokens"], case["block_size"], as_bytes=True, **kw)
        assert [d.hex() for d in got] == [b["hash_hex"] for b in case["blocks"]], case_name(case)
    assert {c["algo"] for c in cases} == set(VLLM_ALGOS)


def test_vllm_vectors_seed_from_environment(load_vectors, monkeypatch):
    for case in load_vectors("vllm_block_hashes.json")["cases"]:
        if case["seed"] == "vllm-none-hash":
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", case["seed"])
        got = hash_blocks(case["tokens"], case["block_size"], algo=case["algo"], extra_keys=case_extra_keys(case))
        assert got == [b["hash_u64"] for b in case["blocks"]], case_name(case)


def test_explicit_seed_beats_environment(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    tokens = list(range(32))
    assert hash_blocks(tokens, 16, algo="sha256", seed="vllm-none-hash") == [u64(d) for d in vllm_ref("sha256", tokens, 16)]


def test_dynamo_vectors(load_vectors):
    for case in load_vectors("dynamo_local_hashes.json")["cases"]:
        kw = dict(lora_name=case["lora_name"], cache_namespace=case["cache_namespace"])
        name = f"bs={case['block_size']} {kw}"
        assert hash_blocks(case["tokens"], case["block_size"], algo="dynamo", **kw) == case["local_hashes"], name
        got = hash_blocks(case["tokens"], case["block_size"], algo="dynamo", as_bytes=True, **kw)
        assert got == [h.to_bytes(8, "big") for h in case["local_hashes"]], name
        seq = hash_blocks(case["tokens"], case["block_size"], algo="dynamo_seq", **kw)
        assert seq == dynamo_seq_ref(case["local_hashes"]), name


def test_dynamo_empty_salts_are_absent():
    tokens = list(range(64))
    assert hash_blocks(tokens, 16, algo="dynamo", lora_name="", cache_namespace="") == hash_blocks(tokens, 16, algo="dynamo")


def test_dynamo_multimodal_hashes():
    tokens = list(range(48))
    mm = [(5, 3), None, (2**64 - 1,)]
    assert hash_blocks(tokens, 16, algo="dynamo", extra_keys=mm, lora_name="x") == dynamo_ref(tokens, 16, lora="x", mm=mm)


# --- our own xxh3 chain -------------------------------------------------------------------------

def test_xxh3_definition():
    tokens = list(range(100))
    assert hash_blocks(tokens, 16) == xxh3_ref(tokens, 16)
    assert hash_blocks(tokens, 16, seed=7, lora_name="a", cache_namespace="b") == xxh3_ref(tokens, 16, 7, "a", "b")
    assert hash_blocks(tokens, 16, seed="s") == xxh3_ref(tokens, 16, xxhash.xxh3_64_intdigest(b"s"))
    assert hash_blocks(tokens, 16, seed=b"s") == hash_blocks(tokens, 16, seed="s")
    # Without seed or salt the first block is plain XXH3_64 of its bytes.
    assert hash_blocks(tokens, 16)[0] == xxhash.xxh3_64_intdigest(struct.pack("<16I", *range(16)))


def test_xxh3_extra_keys():
    tokens = list(range(48))
    keys = [("lora", 1), None, ("mm", b"\x00", -5)]
    assert hash_blocks(tokens, 16, extra_keys=keys) == xxh3_ref(tokens, 16, extra_keys=keys)
    assert hash_blocks(tokens, 16, extra_keys=keys) != hash_blocks(tokens, 16)


def test_as_bytes_is_big_endian_u64_for_64_bit_algos():
    tokens = list(range(64))
    for algo in ("xxh3", "dynamo", "dynamo_seq"):
        ints = hash_blocks(tokens, 16, algo=algo)
        assert hash_blocks(tokens, 16, algo=algo, as_bytes=True) == [h.to_bytes(8, "big") for h in ints]


def test_partial_block_ignored():
    for algo in ALGORITHMS:
        assert hash_blocks(list(range(47)), 16, algo=algo) == hash_blocks(list(range(32)), 16, algo=algo)
        assert hash_blocks(list(range(15)), 16, algo=algo) == []
        assert hash_blocks([], 16, algo=algo) == []


def test_exports():
    assert set(ALGORITHMS) == {"xxh3", "dynamo", "dynamo_seq", *VLLM_ALGOS}
    assert kvbridge.hash_blocks is hash_blocks
    assert kvbridge.wire.hashing.BlockHasher is BlockHasher


# --- incremental hashing ------------------------------------------------------------------------

def chain_args(algo):
    return {"seed": "0"} if algo in VLLM_ALGOS else {}


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_parent_continues_chain(algo):
    tokens = [(i * 7919) % 150000 for i in range(160)]
    whole = hash_blocks(tokens, 16, algo=algo, as_bytes=True, **chain_args(algo))
    for split in (1, 4, 9):
        head = hash_blocks(tokens[:16 * split], 16, algo=algo, as_bytes=True, **chain_args(algo))
        if algo == "dynamo":
            tail = hash_blocks(tokens[16 * split:], 16, algo=algo, as_bytes=True)
        else:
            tail = hash_blocks(tokens[16 * split:], 16, algo=algo, parent=head[-1], as_bytes=True, **chain_args(algo))
        assert head + tail == whole
    if algo in ("xxh3", "dynamo_seq"):
        ints = hash_blocks(tokens, 16, algo=algo)
        assert hash_blocks(tokens[32:], 16, algo=algo, parent=ints[1]) == ints[2:]


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_block_hasher_matches_one_shot(algo):
    tokens = [(i * 104729) % 2**32 for i in range(16 * 12 + 5)]
    keys = [("k", i) if i % 3 == 0 else None for i in range(12)]
    if algo.startswith("dynamo"):
        keys = [(i, 2**63) if i % 3 == 0 else None for i in range(12)]
    want = hash_blocks(tokens, 16, algo=algo, extra_keys=keys, **chain_args(algo))
    h = BlockHasher(16, algo=algo, **chain_args(algo))
    got, pos = [], 0
    for step in (1, 15, 16, 17, 3, 40, 1, 1, 100, 1000):
        chunk = tokens[pos:pos + step]
        n_new = (h.num_pending + len(chunk)) // 16
        done = h.num_blocks
        got += h.update(chunk, keys[done:done + n_new] if n_new else None)
        pos += len(chunk)
    assert got == want
    assert (h.num_blocks, h.num_pending) == (12, 5)
    assert h.last_hash == want[-1]
    assert h.parent == hash_blocks(tokens, 16, algo=algo, extra_keys=keys, as_bytes=True, **chain_args(algo))[-1]


def test_block_hasher_state_and_fork():
    h = BlockHasher(4, algo="sha256_cbor", seed="0")
    assert (h.algo, h.block_size, h.num_blocks, h.num_pending, h.parent, h.last_hash) == ("sha256_cbor", 4, 0, 0, None, None)
    assert h.update([1, 2, 3]) == []
    fork = h.copy()
    assert copy.copy(h).num_pending == 3
    a = h.update([4, 5], as_bytes=True)
    b = fork.update(array.array("I", [4, 6]), as_bytes=True)
    assert a == vllm_ref("sha256_cbor", [1, 2, 3, 4], 4, seed="0")
    assert a == b and h.parent == a[0] and h.num_pending == 1 and fork.num_pending == 1
    assert "BlockHasher(block_size=4" in repr(h)


def test_block_hasher_parent_argument():
    tokens = list(range(64))
    whole = hash_blocks(tokens, 16, algo="xxhash", seed="1", as_bytes=True)
    h = BlockHasher(16, algo="xxhash", seed="1", parent=whole[1])
    assert h.update(tokens[32:], as_bytes=True) == whole[2:]


# --- inputs -------------------------------------------------------------------------------------

def test_input_kinds_agree():
    import numpy as np  # a test dependency: fail loudly if missing
    tokens = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1] * 8 + list(range(5))
    want = {algo: hash_blocks(tokens, 8, algo=algo) for algo in ALGORITHMS}
    kinds = [
        tuple(tokens),
        iter(tokens),
        (t for t in tokens),
        array.array("I", tokens),
        array.array("L", tokens),
        array.array("Q", tokens),
        array.array("q", tokens),
        memoryview(array.array("Q", tokens)),
        np.array(tokens, dtype=np.uint32),
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint64),
        np.array(tokens, dtype=">u4"),
        np.array(tokens, dtype=">i8"),
        np.array([t for t in tokens for _ in (0, 1)], dtype=np.uint32)[::2],
        np.array([t for t in tokens for _ in (0, 1, 2)], dtype=np.int64)[::3],
        [np.int64(t) for t in tokens],
    ]
    small = [t for t in tokens if t < 2**31]
    want_small = {algo: hash_blocks(small, 8, algo=algo) for algo in ALGORITHMS}
    small_kinds = [array.array("i", small), np.array(small, dtype=np.int32), np.array(small, dtype="<i4")]
    for algo in ALGORITHMS:
        for kind in kinds:
            kind = iter(tokens) if hasattr(kind, "__next__") else kind
            assert hash_blocks(kind, 8, algo=algo) == want[algo], (algo, type(kind))
        for kind in small_kinds:
            assert hash_blocks(kind, 8, algo=algo) == want_small[algo]


def test_empty_inputs():
    import numpy as np  # a test dependency: fail loudly if missing
    for tokens in ([], (), array.array("I"), np.array([], dtype=np.uint32), np.array([], dtype=np.int64), iter([])):
        assert hash_blocks(tokens, 16, algo="sha256") == []


def test_out_buffer():
    import numpy as np  # a test dependency: fail loudly if missing
    tokens = np.arange(16 * 10 + 3, dtype=np.uint32)
    for algo in ALGORITHMS:
        want = hash_blocks(tokens, 16, algo=algo)
        out = np.zeros(12, dtype=np.uint64)
        assert hash_blocks(tokens, 16, algo=algo, out=out) == 10
        assert out[:10].tolist() == want and out[10:].tolist() == [0, 0]
        q = array.array("Q", [0] * 10)
        assert hash_blocks(tokens.tolist(), 16, algo=algo, out=q) == 10 and q.tolist() == want
        assert hash_blocks(tokens[:15], 16, algo=algo, out=array.array("Q")) == 0


def test_out_buffer_errors():
    import numpy as np  # a test dependency: fail loudly if missing
    tokens = list(range(64))
    with pytest.raises(ValueError, match="out has room for 3 hashes but the tokens make 4 full blocks"):
        hash_blocks(tokens, 16, out=np.zeros(3, dtype=np.uint64))
    for bad in (np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.uint32), np.zeros(4, dtype=">u8")):
        with pytest.raises(TypeError, match="out must be an aligned native uint64 buffer"):
            hash_blocks(tokens, 16, out=bad)
    with pytest.raises(ValueError, match="as_bytes"):
        hash_blocks(tokens, 16, out=np.zeros(4, dtype=np.uint64), as_bytes=True)
    with pytest.raises(BufferError):
        hash_blocks(tokens, 16, out=bytes(32))
    with pytest.raises(BufferError, match="1-dimensional"):
        hash_blocks(tokens, 16, out=np.zeros((2, 2), dtype=np.uint64))


def test_unaligned_buffer():
    raw = bytearray(1 + 4 * 32)
    raw[1:] = struct.pack("<32I", *range(32))
    view = memoryview(raw)[1:].cast("I")
    assert hash_blocks(view, 16) == hash_blocks(list(range(32)), 16)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_long_input_released_gil_path(algo):
    import numpy as np  # a test dependency: fail loudly if missing
    n = (1 << 16) + 1000
    tokens = [(i * 2654435761) % 2**32 for i in range(n)]
    want = hash_blocks(tokens[:16 * 64], 16, algo=algo)
    for kind in (tokens, np.array(tokens, dtype=np.uint32), np.array(tokens, dtype=np.int64)):
        got = hash_blocks(kind, 16, algo=algo)
        assert len(got) == n // 16 and got[:64] == want
    if algo == "xxh3":
        assert got == xxh3_ref(tokens, 16)


# --- pickle framing and memo, byte for byte ---------------------------------------------------

@pytest.mark.parametrize("n", [20000, 32749, 32750, 32751, 40000, 70001])
@pytest.mark.parametrize("magnitude", [1, 300, 70000, 2**31 + 5])
def test_pickle_frames_of_long_blocks(n, magnitude):
    tokens = [(magnitude + i) % 2**32 for i in range(n)]
    for algo in ("sha256", "xxhash"):
        got = hash_blocks(tokens, n, algo=algo, seed="x", as_bytes=True)
        assert got == vllm_ref(algo, tokens, n, seed="x")


@pytest.mark.parametrize("size", [65535, 65536, 200000])
def test_pickle_unframed_large_payloads(size):
    tokens = list(range(32))
    big_s, big_b = "z" * size, b"y" * size
    keys = [(big_b, "s", big_b), (big_s, ("é" * size,))]
    for algo in VLLM_ALGOS:
        assert hash_blocks(tokens, 16, algo=algo, extra_keys=keys) == [u64(d) for d in vllm_ref(algo, tokens, 16, extra_keys=keys)]


def test_pickle_memo_by_identity():
    tokens = list(range(32))
    shared_s, shared_t = "".join(["sha", "red"]), ("t", 1)
    keys = [(shared_s, shared_s, "shared", ("x",) * 3, shared_t, (shared_t, shared_s)), (b"a", b"a", (), ())]
    many = tuple(str(i) for i in range(300))
    keys.append(many + many)
    tokens += list(range(16))
    parent = vllm_fn("sha256")("p")
    keys_with_parent = [(parent, parent), None, None]
    for algo in VLLM_ALGOS:
        assert hash_blocks(tokens, 16, algo=algo, extra_keys=keys) == [u64(d) for d in vllm_ref(algo, tokens, 16, extra_keys=keys)]
    got = hash_blocks(tokens, 16, algo="sha256", parent=parent, extra_keys=keys_with_parent)
    assert got == [u64(d) for d in vllm_ref("sha256", tokens, 16, extra_keys=keys_with_parent, parent=parent)]


def test_vllm_seed_kinds():
    tokens = list(range(16))
    for algo in VLLM_ALGOS:
        for seed in ("", "ünï", b"raw", 0, -1, 2**70, -(2**70)):
            assert hash_blocks(tokens, 16, algo=algo, seed=seed) == [u64(d) for d in vllm_ref(algo, tokens, 16, seed=seed)]


# --- property tests against the references ------------------------------------------------------

token_ids = st.integers(0, 2**32 - 1) | st.integers(0, 300) | st.integers(0, 70000)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**70), 2**70)
    | st.integers(-(2**2100), 2**2100)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.sampled_from(["lora-a", b"mm", ("shared", 1)])  # repeated objects: pickle BINGETs
)


def tuples_of(inner):
    return st.lists(inner, max_size=5).map(tuple)


values = st.recursive(scalars, tuples_of, max_leaves=12)
extra_key = st.none() | st.lists(values, max_size=5).map(tuple)


@st.composite
def chains(draw, key=extra_key):
    bs = draw(st.integers(1, 40))
    n_blocks = draw(st.integers(0, 6))
    tokens = draw(st.lists(token_ids, min_size=bs * n_blocks, max_size=bs * n_blocks + bs - 1))
    keys = draw(st.none() | st.lists(key, min_size=n_blocks, max_size=n_blocks))
    return tokens, bs, keys


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(), st.sampled_from(VLLM_ALGOS), st.text(max_size=10))
def test_vllm_matches_reference(chain, algo, seed):
    tokens, bs, keys = chain
    want = vllm_ref(algo, tokens, bs, seed=seed, extra_keys=keys)
    assert hash_blocks(tokens, bs, algo=algo, seed=seed, extra_keys=keys, as_bytes=True) == want
    assert hash_blocks(array.array("I", tokens), bs, algo=algo, seed=seed, extra_keys=keys) == [u64(d) for d in want]


@settings(max_examples=200, deadline=None)
@given(chains(), st.integers(0, U64), st.none() | st.text(max_size=8), st.none() | st.text(max_size=8))
def test_xxh3_matches_reference(chain, seed, lora, ns):
    tokens, bs, keys = chain
    assert hash_blocks(tokens, bs, seed=seed, lora_name=lora, cache_namespace=ns, extra_keys=keys) == xxh3_ref(tokens, bs, seed, lora, ns, keys)


@settings(max_examples=200, deadline=None)
@given(chains(st.none() | st.lists(st.integers(0, U64), max_size=4).map(tuple)), st.none() | st.text(max_size=8), st.none() | st.text(max_size=8))
def test_dynamo_matches_reference(chain, lora, ns):
    tokens, bs, mm = chain
    local = dynamo_ref(tokens, bs, lora, ns, mm)
    assert hash_blocks(tokens, bs, algo="dynamo", extra_keys=mm, lora_name=lora, cache_namespace=ns) == local
    assert hash_blocks(tokens, bs, algo="dynamo_seq", extra_keys=mm, lora_name=lora, cache_namespace=ns) == dynamo_seq_ref(local)


@settings(max_examples=100, deadline=None)
@given(st.lists(token_ids, max_size=200), st.integers(1, 20), st.sampled_from(ALGORITHMS), st.data())
def test_incremental_matches_one_shot(tokens, bs, algo, data):
    want = hash_blocks(tokens, bs, algo=algo, as_bytes=True, **chain_args(algo))
    h = BlockHasher(bs, algo=algo, **chain_args(algo))
    got, pos = [], 0
    while pos < len(tokens):
        step = data.draw(st.integers(1, 3 * bs))
        got += h.update(tokens[pos:pos + step], as_bytes=True)
        pos += step
    assert got == want


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,index,value", [
    ([1, 2, -1], 2, "-1"),
    ([2**32], 0, "4294967296"),
    ([0, 2**100], 1, str(2**100)),
    (array.array("i", [5, -3]), 1, "-3"),
    (array.array("q", [2**40]), 0, str(2**40)),
])
def test_token_out_of_range(tokens, index, value):
    with pytest.raises(ValueError, match=rf"token at index {index} is {value}, outside 0..4294967295"):
        hash_blocks(tokens, 1)


def test_token_out_of_range_numpy():
    import numpy as np  # a test dependency: fail loudly if missing
    with pytest.raises(ValueError, match="index 3 is -7"):
        hash_blocks(np.array([1, 2, 3, -7], dtype=np.int32), 2)
    with pytest.raises(ValueError, match="index 1 is 4294967296"):
        hash_blocks(np.array([1, 2**32], dtype=np.uint64), 2)


@pytest.mark.parametrize("tokens", [None, 5, 2.5])
def test_tokens_not_a_sequence(tokens):
    with pytest.raises(TypeError, match=f"tokens must be a list/tuple of int, .* not {type(tokens).__name__}$"):
        hash_blocks(tokens, 1)


@pytest.mark.parametrize("tokens,index,kind", [
    ([1, "2"], 1, "str"),
    ((1, 2, 3.0), 2, "float"),
    ([True], 0, "bool"),
    ([1, None], 1, "NoneType"),
    (iter([1, b"x"]), 1, "bytes"),
])
def test_token_not_an_int(tokens, index, kind):
    with pytest.raises(TypeError, match=rf"token at index {index} is {kind}, not int"):
        hash_blocks(tokens, 1)


def test_tokens_wrong_container():
    import numpy as np  # a test dependency: fail loudly if missing
    with pytest.raises(TypeError, match="not str"):
        hash_blocks("abc", 1)
    with pytest.raises(TypeError, match="format 'd'"):
        hash_blocks(array.array("d", [1.0]), 1)
    with pytest.raises(TypeError, match="format 'h'"):
        hash_blocks(array.array("h", [1]), 1)
    with pytest.raises(TypeError, match="format 'B'"):
        hash_blocks(b"\x01\x02", 1)
    with pytest.raises(BufferError, match="1-dimensional"):
        hash_blocks(np.zeros((2, 2), dtype=np.uint32), 1)
    with pytest.raises(TypeError, match="or an iterable of int, not int$"):
        hash_blocks(5, 1)


@pytest.mark.parametrize("bs", [0, -1])
def test_block_size_below_one(bs):
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        hash_blocks([1, 2], bs)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockHasher(bs)


def test_block_size_not_int():
    with pytest.raises(TypeError):
        hash_blocks([1, 2], "16")


def test_unknown_algo_lists_valid():
    with pytest.raises(ValueError, match="unknown algo 'md5'; valid: xxh3, dynamo, dynamo_seq, sha256, sha256_cbor, xxhash, xxhash_cbor"):
        hash_blocks([1], 1, algo="md5")
    with pytest.raises(ValueError, match="unknown algo"):
        BlockHasher(1, algo="SHA256")


def test_extra_keys_errors():
    with pytest.raises(ValueError, match="extra_keys has 1 entries but the tokens make 2 full blocks"):
        hash_blocks(list(range(4)), 2, algo="sha256", extra_keys=[None])
    with pytest.raises(ValueError, match="extra_keys has 3 entries but the tokens make 2 full blocks"):
        hash_blocks(list(range(5)), 2, extra_keys=[None] * 3)
    with pytest.raises(TypeError, match="extra_keys must be a list"):
        hash_blocks([1], 1, extra_keys="a")
    with pytest.raises(TypeError, match=r"extra_keys\[0\] must be None or a tuple, not list"):
        hash_blocks([1], 1, algo="sha256", extra_keys=[["a"]])
    with pytest.raises(TypeError, match=r"extra_keys\[1\]: unsupported type float"):
        hash_blocks([1, 2], 1, algo="sha256", extra_keys=[None, ("a", 1.5)])
    with pytest.raises(TypeError, match=r"extra_keys\[0\]: unsupported type list"):
        hash_blocks([1], 1, algo="sha256_cbor", extra_keys=[(["nested"],)])
    with pytest.raises(ValueError, match=r"extra_keys\[0\]\[1\]: dynamo takes multimodal object hashes"):
        hash_blocks([1], 1, algo="dynamo", extra_keys=[(1, "x")])
    with pytest.raises(ValueError, match=r"extra_keys\[0\]\[0\]"):
        hash_blocks([1], 1, algo="dynamo_seq", extra_keys=[(-1,)])
    with pytest.raises(ValueError, match="surrogates"):
        hash_blocks([1], 1, algo="sha256_cbor", extra_keys=[("\ud800",)])
    with pytest.raises(ValueError, match="extra_keys has 1 entries but the tokens make 0"):
        BlockHasher(2).update([1], [None])


def test_lone_surrogates_pickle_like_python():
    keys = [("\ud800x",)]
    assert hash_blocks([1], 1, algo="sha256", extra_keys=keys) == [u64(d) for d in vllm_ref("sha256", [1], 1, extra_keys=keys)]


def test_seed_errors():
    with pytest.raises(TypeError, match="seed must be str, bytes or int, not float"):
        hash_blocks([1], 1, algo="sha256", seed=1.5)
    with pytest.raises(TypeError, match="seed must be str, bytes or int, not list"):
        hash_blocks([1], 1, seed=[1])
    with pytest.raises(ValueError, match="seed must be in 0..2\\*\\*64-1"):
        hash_blocks([1], 1, seed=-1)
    with pytest.raises(ValueError, match="dynamo takes no seed"):
        hash_blocks([1], 1, algo="dynamo", seed=5)


def test_parent_errors():
    digest = hash_blocks([1], 1, algo="sha256", as_bytes=True)[0]
    with pytest.raises(TypeError, match="full digest"):
        hash_blocks([1], 1, algo="sha256", parent=u64(digest))
    with pytest.raises(ValueError, match="must be its 32-byte digest, got 16 bytes"):
        hash_blocks([1], 1, algo="sha256", parent=digest[:16])
    with pytest.raises(ValueError, match="must be its 16-byte digest"):
        hash_blocks([1], 1, algo="xxhash_cbor", parent=digest)
    with pytest.raises(ValueError, match="must be its 8-byte digest"):
        hash_blocks([1], 1, parent=b"\x00")
    with pytest.raises(ValueError, match="0..2\\*\\*64-1"):
        hash_blocks([1], 1, parent=-1)
    with pytest.raises(TypeError, match="parent must be bytes or int, not str"):
        hash_blocks([1], 1, parent="abc")
    with pytest.raises(ValueError, match="use algo='dynamo_seq'"):
        hash_blocks([1], 1, algo="dynamo", parent=1)
    with pytest.raises(TypeError, match="full digest"):
        BlockHasher(1, algo="xxhash", parent=5)


def test_salts_rejected_for_vllm():
    with pytest.raises(ValueError, match="extra_keys"):
        hash_blocks([1], 1, algo="sha256", lora_name="a")
    with pytest.raises(ValueError, match="extra_keys"):
        BlockHasher(1, algo="xxhash", cache_namespace="t")


def test_errors_leave_block_hasher_unchanged():
    h = BlockHasher(2)
    h.update([1])
    with pytest.raises(TypeError):
        h.update([2, "x"])
    assert h.num_pending == 1 and h.num_blocks == 0
    assert h.update([2]) == hash_blocks([1, 2], 2)


def test_extra_keys_nested_too_deep():
    key = ()
    for _ in range(300):
        key = (key,)
    with pytest.raises(ValueError, match=r"extra_keys\[0\]: extra key nested too deeply"):
        hash_blocks([1], 1, algo="sha256", extra_keys=(key,))


def test_reentrant_index_and_shrinking_list():
    class Reentrant:
        def __index__(self):
            hash_blocks(list(range(100)), 4, algo="sha256")  # uses the same per-thread scratch
            return 5

    assert hash_blocks([Reentrant(), 6], 2, algo="sha256") == hash_blocks([5, 6], 2, algo="sha256")

    tokens = [1, 2, 3, 4]

    class Shrinking:
        def __index__(self):
            tokens.clear()
            return 7

    tokens[1] = Shrinking()
    with pytest.raises(IndexError):
        hash_blocks(tokens, 1)


def test_threads_do_not_share_state():
    from concurrent.futures import ThreadPoolExecutor

    jobs = [([(i * k) % 150000 for i in range(70_000 if k % 2 else 3000)], algo) for k in range(1, 9) for algo in ("sha256", "xxh3")]
    serial = [hash_blocks(t, 16, algo=a) for t, a in jobs]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda job: hash_blocks(job[0], 16, algo=job[1]), jobs)) == serial


def test_refcounts_unchanged():
    tokens = list(range(10_000, 10_064))
    key = ("k", 10**30)
    before = [sys.getrefcount(t) for t in tokens[:3]], sys.getrefcount(key)
    for algo in ALGORITHMS:
        keys = [(1,)] * 4 if algo.startswith("dynamo") else [key] * 4
        hash_blocks(tokens, 16, algo=algo, extra_keys=keys)
    del keys
    assert ([sys.getrefcount(t) for t in tokens[:3]], sys.getrefcount(key)) == before


def test_stable_api_path_identical(vectors_dir):
    """Lists of ints are read from CPython's layout where it is known; the API path agrees."""
    env = {**os.environ, "KVBRIDGE_ENCODE_STABLE_API": "1", "KVBRIDGE_VECTORS": str(vectors_dir)}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not stable_api"]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
