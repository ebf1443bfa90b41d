"""kvbridge.Index against a plain-Python model of its rules, and its argument checks.

The model (``RefIndex``) is the spec in dicts: per (worker, medium) a dict engine hash ->
[index key, copies] (key="tokens", the key being ``hash_blocks(..., algo="xxh3")`` of the event's
tokens chained on the parent's key) or engine hash -> copies (key="engine"); a store of a chain
from block 0 that the slot already holds whole is vLLM's re-announce, not a copy.
``find_matches`` is then brute force over it. tests/test_index_hybrid.py covers groups.
"""

from __future__ import annotations

import itertools
import random
import threading

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge_support import prefix_scores
from event_strategies import batches
from kvbridge import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    Index,
    KVCacheManager,
    KVEventBatch,
    decode_batch,
    encode_batch,
    hash_blocks,
)

BS = 2
MASK = 2**64 - 1


def engine_key(h) -> int:
    """An engine hash as the index keeps it: ints as u64, bytes reduced like vLLM."""
    return int.from_bytes(h, "big") & MASK if isinstance(h, bytes) else h & MASK


def as_tuples(v):
    return tuple(as_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v


def strip_lora(entry, lora_name):
    """The index's canonical extra key of one block: vLLM's leading LoRA name left out."""
    if entry is None:
        return None
    entry = as_tuples(entry)
    if lora_name is not None and entry and entry[0] == lora_name:
        entry = entry[1:]
    return entry or None


def index_keys(tokens, parent=None, lora_name=None, extra_keys=None) -> list[int]:
    extra = None if extra_keys is None else [strip_lora(e, lora_name) for e in extra_keys]
    return hash_blocks(tokens, BS, algo="xxh3", parent=parent, lora_name=lora_name, extra_keys=extra)


class RefIndex:
    STATS = (
        "events", "blocks_stored", "blocks_removed", "cleared", "unknown_parents", "block_size_mismatches",
        "events_without_tokens", "malformed_payloads", "unknown_removes", "bad_extra_keys",
    )  # fmt: skip

    def __init__(self, key: str = "tokens") -> None:
        self.key = key
        self.workers: dict[str, dict] = {}  # worker -> {medium: {engine: key} | set}, in creation order
        self.stats = dict.fromkeys(self.STATS, 0)

    def apply(self, worker: str, batch: KVEventBatch | None) -> None:
        if batch is None:
            self.stats["malformed_payloads"] += 1
            return
        slots = self.workers.setdefault(worker, {})
        for ev in batch.events:
            self.stats["events"] += 1
            if isinstance(ev, BlockStored):
                self._stored(worker, slots, ev)
            elif isinstance(ev, BlockRemoved):
                slot = slots.get(ev.medium)
                for h in map(engine_key, ev.block_hashes):
                    if slot is not None and h in slot:
                        if self.key == "tokens":
                            slot[h][1] -= 1
                            if not slot[h][1]:
                                del slot[h]
                        else:
                            slot[h] -= 1
                            if not slot[h]:
                                del slot[h]
                        self.stats["blocks_removed"] += 1
                    else:
                        self.stats["unknown_removes"] += 1
            else:
                self.stats["cleared"] += 1
                slots.clear()

    def _stored(self, worker, slots, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        if n == 0:
            return
        if ev.block_size != BS or len(ev.token_ids) not in (0, n * BS):
            self.stats["block_size_mismatches"] += 1
            return
        if not ev.token_ids:
            self.stats["events_without_tokens"] += 1
            if self.key == "tokens":
                return
        engine = [engine_key(h) for h in ev.block_hashes]
        if self.key == "engine":
            if ev.parent_block_hash is not None:
                p = engine_key(ev.parent_block_hash)
                if not any(p in s for s in slots.values()):
                    self.stats["unknown_parents"] += 1
            slot = slots.setdefault(ev.medium, {})
            if not (ev.parent_block_hash is None and all(e in slot for e in engine)):
                for e in engine:
                    slot[e] = slot.get(e, 0) + 1
        else:
            if ev.extra_keys is not None and len(ev.extra_keys) != n:
                self.stats["bad_extra_keys"] += 1
                return
            parent = None
            if ev.parent_block_hash is not None:
                p = engine_key(ev.parent_block_hash)
                same = [slots[ev.medium]] if ev.medium in slots else []
                found = [s[p][0] for s in same + [s for m, s in slots.items() if m != ev.medium] if p in s]
                if not found:
                    self.stats["unknown_parents"] += 1
                    return
                parent = found[0]
            keys = index_keys(ev.token_ids, parent, ev.lora_name, ev.extra_keys)
            slot = slots.setdefault(ev.medium, {})
            if not (ev.parent_block_hash is None and all(e in slot for e in engine)):
                for e, k in zip(engine, keys):
                    if e in slot and slot[e][0] == k:
                        slot[e][1] += 1
                    else:
                        slot[e] = [k, 1]
        self.stats["blocks_stored"] += n

    def remove_worker(self, worker: str) -> None:
        self.workers.pop(worker, None)

    def clear(self) -> None:
        self.workers.clear()

    def holders(self, medium=...) -> dict[int, set[str]]:
        out: dict[int, set[str]] = {}
        for w, slots in self.workers.items():
            for m, slot in slots.items():
                if medium is not ... and m != medium:
                    continue
                for k in (v[0] for v in slot.values()) if self.key == "tokens" else slot:
                    out.setdefault(k, set()).add(w)
        return out

    def find_matches(self, keys: list[int], medium=...) -> dict[str, int]:
        holders = self.holders(medium)
        scores: dict[str, int] = {}
        for w in holders.get(keys[0], ()) if keys else ():
            n = 0
            while n < len(keys) and w in holders.get(keys[n], ()):
                n += 1
            scores[w] = n
        return scores


def check_equal(idx: Index, ref: RefIndex, queries=()) -> None:
    stats = idx.stats
    assert {k: stats[k] for k in ref.STATS} == ref.stats
    assert idx.workers == sorted(ref.workers)
    holders = ref.holders()
    assert len(idx) == len(holders)
    for k, workers in holders.items():
        assert idx.find_matches(block_hashes=[k]) == dict.fromkeys(workers, 1)
    for medium in ("GPU", "CPU"):  # (medium=None asks for any medium)
        for k, workers in ref.holders(medium).items():
            assert idx.find_matches(block_hashes=[k], medium=medium) == dict.fromkeys(workers, 1)
    for tokens, lora_name, extra in queries:
        keys = index_keys(tokens, None, lora_name, extra)
        query_extra = None if extra is None else [strip_lora(e, lora_name) for e in extra]
        want = ref.find_matches(keys)
        assert idx.find_matches(tokens, lora_name=lora_name, extra_keys=query_extra) == want
        assert idx.find_matches(block_hashes=keys) == want
        check_lists(idx, want, keys, tokens, lora_name=lora_name, extra_keys=query_extra)
        assert idx.find_matches(tokens, lora_name=lora_name, extra_keys=query_extra, medium="CPU") == (
            ref.find_matches(keys, "CPU")
        )


def check_lists(idx: Index, want: dict[str, int], keys: list[int], tokens, **tokens_args) -> None:
    """find_matches(lists=True) and buffer inputs answer what the dict does."""
    from array import array

    packed = array("Q", [k & MASK for k in keys])
    assert idx.find_matches(block_hashes=packed.tobytes()) == want
    for kwargs in ({"block_hashes": packed}, {"block_hashes": memoryview(packed)}, {"tokens": tokens, **tokens_args}):
        workers, counts = idx.find_matches(**kwargs, lists=True)
        assert dict(zip(workers, counts)) == want and len(workers) == len(want)
    workers, counts = idx.find_matches(block_hashes=packed, top_k=2, lists=True)
    assert counts == sorted(want.values(), reverse=True)[:2]
    assert all(want[w] == n for w, n in zip(workers, counts))


def test_top_k_and_lists_exactly():
    """top_k keeps the k longest hits, longest first, ties in worker id order (the order the
    index first heard the workers); lists=True pairs every worker with its count, whether the
    count is one of the shared int objects (below 1024) or made for the answer, and whether the
    worker's name was cached by an earlier answer or is new under a reused id."""
    from array import array

    idx = Index(BS, key="engine")
    # Leading runs: ties at 3 and at 1; one run past the shared ints (1030), one at their edge.
    lengths = {"w0": 3, "w1": 5, "w2": 3, "w3": 1, "w4": 1030, "w5": 3, "w6": 1, "w7": 1024, "w8": 1023}
    lengths |= {f"x{i}": 1 + i % 4 for i in range(14)}  # 23 workers: a top_k of 17 drops some
    chain = list(range(1, 1031))
    for worker, n in lengths.items():
        idx.apply(worker, encode_batch(KVEventBatch(0.0, [BlockStored(chain[:n], None, [1] * BS * n, BS, None, "GPU", None)])))
    order = list(lengths)
    query = array("Q", chain + [99_999])

    def expect(k):
        ranked = sorted(lengths.items(), key=lambda item: (-item[1], order.index(item[0])))
        return [w for w, _ in ranked[:k]], [n for _, n in ranked[:k]]

    for k in (0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 22, 23, 50):  # by insertion up to 16, sorted above
        assert idx.find_matches(block_hashes=query, top_k=k, lists=True) == expect(k), k
        assert idx.find_matches(block_hashes=query.tobytes(), top_k=k) == dict(zip(*expect(k))), k
    assert idx.find_matches(block_hashes=query, lists=True) == (order, [lengths[w] for w in order])
    with pytest.raises(ValueError, match="top_k must be an int >= 0, got -1"):  # not an OverflowError
        idx.find_matches(block_hashes=query, top_k=-1)
    # A removed worker's id named again by a new worker: the answer names the new one.
    idx.remove_worker("w3")
    idx.apply("new", encode_batch(KVEventBatch(0.0, [BlockStored(chain[:2], None, [1] * BS * 2, BS, None, "GPU", None)])))
    del lengths["w3"]
    lengths["new"] = 2
    workers, counts = idx.find_matches(block_hashes=query, lists=True)
    assert dict(zip(workers, counts)) == lengths and len(workers) == len(lengths)
    assert idx.find_matches(block_hashes=query, top_k=1, lists=True) == (["w4"], [1030])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_token_queries_hash_only_as_far_as_the_walk_goes_yet_answer_as_their_block_hashes(data):
    """A token query makes its keys as the walk reaches them (rust/index/keys.rs: 8 blocks at
    a time, the walk looking 16 ahead), so a hit may end anywhere in a long prompt: before,
    inside or after what was made, for up to 64 workers (one bit word) and more. Each answers
    what brute force and the same query by block hashes (all made first) answer, from a list and
    an array('I'), as a dict, lists, top_k and by medium."""
    from array import array

    n_workers = data.draw(st.sampled_from([3, 70]), label="workers")
    n_blocks = data.draw(st.integers(0, 70), label="blocks")
    lora = data.draw(st.sampled_from([None, "ad"]), label="lora")
    rnd = random.Random(data.draw(st.integers(0, 2**32), label="seed"))
    prompt = [rnd.randrange(150_000) for _ in range(n_blocks * BS + rnd.randrange(BS))]
    idx = Index(BS, key="tokens")
    want: dict[str, int] = {}
    for w in range(n_workers):
        held = data.draw(st.integers(0, n_blocks), label="held")
        hole = data.draw(st.integers(0, held), label="hole")  # == held: no hole
        if not held:
            continue
        name = f"w{w}"
        events = [BlockStored(list(range(1, held + 1)), None, prompt[: held * BS], BS, None, "GPU", lora)]
        if hole < held:
            events.append(BlockRemoved([hole + 1], "GPU"))
        idx.apply(name, encode_batch(KVEventBatch(0.0, events)))
        if hole:
            want[name] = hole
    keys = index_keys(prompt[: n_blocks * BS], lora_name=lora)
    assert idx.find_matches(block_hashes=keys) == want
    assert idx.find_matches(prompt, lora_name=lora) == want
    workers, counts = idx.find_matches(array("I", prompt), lora_name=lora, lists=True)
    assert dict(zip(workers, counts)) == want and len(workers) == len(want)
    workers, counts = idx.find_matches(array("I", prompt), lora_name=lora, top_k=3, lists=True)
    assert counts == sorted(want.values(), reverse=True)[:3]
    assert all(want[w] == n for w, n in zip(workers, counts))
    assert idx.find_matches(prompt, lora_name=lora, by_medium=True) == {w: {"GPU": n} for w, n in want.items()}


def test_a_long_token_query_made_with_the_gil_released_answers_as_a_short_one():
    """From 4096 blocks a query runs with the GIL released; its token ids (a list's copy, an
    array's buffer copied) are hashed there as the walk goes."""
    from array import array

    n = 4100
    prompt = [(i * 7919) % 150_000 for i in range(n * BS)]
    idx = Index(BS, key="tokens")
    idx.apply("all", encode_batch(KVEventBatch(0.0, [BlockStored(list(range(1, n + 1)), None, prompt, BS, None, "GPU", None)])))
    idx.apply("most", encode_batch(KVEventBatch(0.0, [BlockStored(list(range(1, n)), None, prompt[:-BS], BS, None, "GPU", None)])))
    idx.apply("few", encode_batch(KVEventBatch(0.0, [BlockStored([1, 2, 3], None, prompt[: 3 * BS], BS, None, "GPU", None)])))
    want = {"all": n, "most": n - 1, "few": 3}
    assert idx.find_matches(prompt) == want
    assert idx.find_matches(array("I", prompt), lists=True) == (["all", "most", "few"], [n, n - 1, 3])
    assert idx.find_matches(prompt[: 5000 * BS // 2]) == {"all": 2500, "most": 2500, "few": 3}


# --- random event streams --------------------------------------------------------------------

# Three documents whose blocks the streams store, remove and query; a block's engine hash is
# a function of (document, block, lora), with a per-worker offset half of the time (engines
# with different seeds), so parents chain as an engine's would.
DOCS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 50, 60, 70, 80], [7, 7, 7, 7, 7, 7]]
LORAS = [None, "ad"]
EXTRAS = [(), ("mm-1", 0), ("salt",), (b"\x00emb",)]


def engine_hash(worker: int, doc: int, block: int, lora: int, form: int):
    h = (doc * 100 + block) * 10 + lora + (worker * 7919 if form == 1 else 0)
    if form == 2:
        return h.to_bytes(32, "big")  # a full digest, reduced to h
    if form == 3:
        return (h | 1 << 63) - 2**64  # a u64 >= 2**63, as a signed engine writes it
    return h


@st.composite
def stored_events(draw, worker: int):
    d = draw(st.integers(0, len(DOCS) - 1))
    n_doc_blocks = len(DOCS[d]) // BS
    start = draw(st.integers(0, n_doc_blocks - 1))
    n = draw(st.integers(0, n_doc_blocks - start))
    lora = draw(st.integers(0, 1))
    form = draw(st.integers(0, 3))
    lora_name = LORAS[lora]
    tokens = DOCS[d][start * BS : (start + n) * BS]
    parent = engine_hash(worker, d, start - 1, lora, form) if start else None
    if draw(st.integers(0, 9)) == 0:
        parent = draw(st.integers(0, 2**64 - 1))  # a parent nobody stored
    extra = None
    if draw(st.booleans()):
        extra = [
            ((lora_name,) if lora_name and draw(st.booleans()) else ()) + draw(st.sampled_from(EXTRAS))
            for _ in range(n)
        ]
        extra = [e or None for e in extra]
    block_size = BS
    oddity = draw(st.integers(0, 15))
    if oddity == 0:
        block_size = BS + 1
    elif oddity == 1 and tokens:
        tokens = tokens[:-1]
    elif oddity == 2:
        tokens = []  # an offload placeholder
    elif oddity == 3 and extra:
        extra = extra[:-1]
    return BlockStored(
        block_hashes=[engine_hash(worker, d, start + i, lora, form) for i in range(n)],
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=lora or None,
        medium=draw(st.sampled_from(["GPU", "GPU", "CPU", None])),
        lora_name=lora_name,
        extra_keys=extra,
    )


@st.composite
def removed_events(draw, worker: int):
    ints = lambda hi: draw(st.integers(0, hi))  # noqa: E731
    hashes = [engine_hash(worker, ints(2), ints(4), ints(1), ints(3)) for _ in range(ints(4))]
    return BlockRemoved(block_hashes=hashes, medium=draw(st.sampled_from(["GPU", "CPU", None])))


@st.composite
def operations(draw):
    ops = []
    for _ in range(draw(st.integers(1, 25))):
        worker = draw(st.integers(0, 2))
        kind = draw(st.integers(0, 19))
        if kind == 0:
            ops.append(("remove_worker", worker, None, None))
        elif kind == 1:
            ops.append(("clear", worker, None, None))
        else:
            one = st.one_of(
                stored_events(worker), stored_events(worker), removed_events(worker), st.just(AllBlocksCleared())
            )
            evs = draw(st.lists(one, max_size=4))
            how = draw(st.sampled_from(["msgpack", "json", "batch", "detect", "malformed"]))
            ops.append(("apply", worker, KVEventBatch(ts=1.0, events=evs, data_parallel_rank=0), how))
    return ops


def run_ops(ops, key: str):
    idx, ref = Index(BS, key), RefIndex(key)
    for op, worker, batch, how in ops:
        name = f"worker-{worker}"
        if op == "remove_worker":
            idx.remove_worker(name)
            ref.remove_worker(name)
        elif op == "clear":
            idx.clear()
            ref.clear()
        else:
            if how == "batch":
                n = idx.apply(name, batch)
            elif how == "malformed":
                payload = encode_batch(batch)[:-1]  # cut short: never a batch
                n = idx.apply(name, payload)
                batch = None
            else:
                fmt = "msgpack" if how == "detect" else how
                payload = encode_batch(batch, fmt)
                n = idx.apply(name, payload, None if how == "detect" else fmt)
                # What the payload says (JSON has no bytes: bytes extra keys arrive as base64 text).
                batch = decode_batch(payload, fmt)
            assert n == (0 if batch is None else len(batch.events))
            ref.apply(name, batch)
    return idx, ref


QUERIES = [
    (doc[: len(doc) // BS * BS], lora, extra)
    for doc in DOCS
    for lora in LORAS
    for extra in (None, [("mm-1", 0)] + [None] * (len(doc) // BS - 1))
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations())
def test_tokens_index_equals_the_model(ops):
    idx, ref = run_ops(ops, "tokens")
    check_equal(idx, ref, QUERIES)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations())
def test_engine_index_equals_the_model(ops):
    idx, ref = run_ops(ops, "engine")
    check_equal(idx, ref)
    # Brute force over engine hashes: the leading blocks of each document's chain.
    for d in range(len(DOCS)):
        for lora in (0, 1):
            for form in (0, 1):
                for w in range(3):
                    keys = [engine_key(engine_hash(w, d, b, lora, form)) for b in range(len(DOCS[d]) // BS)]
                    assert idx.find_matches(block_hashes=keys) == ref.find_matches(keys)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations(), st.sampled_from(["tokens", "engine"]), st.booleans())
def test_apply_many_builds_the_index_apply_builds(ops, key, two_threads):
    """The same operations, each run of applies as one apply_many call: the same counts, stats
    and answers as apply one by one. A 64 KiB malformed payload (counted on both sides) leads
    each call with `two_threads`: from 64 KiB the payloads are read on a second thread."""
    one, many = Index(BS, key), Index(BS, key)
    pad = [("pad", b"\xc1" * (64 << 10))] if two_threads else []
    pending: list[tuple[str, object]] = []

    def flush() -> None:
        if not pending:
            return
        msgs = pad + pending
        assert many.apply_many(msgs) == [one.apply(w, d) for w, d in msgs]
        pending.clear()

    for op, worker, batch, how in ops:
        name = f"worker-{worker}"
        if op == "apply":
            if how == "batch":
                pending.append((name, batch))
            elif how == "malformed":
                pending.append((name, encode_batch(batch)[:-1]))
            else:
                payload = encode_batch(batch, "msgpack" if how == "detect" else how)
                pending.append((name, payload if how != "json" else bytearray(payload)))
            continue
        flush()
        for idx in (one, many):
            if op == "remove_worker":
                idx.remove_worker(name)
            else:
                idx.clear()
    flush()
    assert many.stats == one.stats
    assert (many.workers, len(many)) == (one.workers, len(one))
    if key == "tokens":
        for tokens, lora_name, extra in QUERIES:
            query_extra = None if extra is None else [strip_lora(e, lora_name) for e in extra]
            want = one.find_matches(tokens, lora_name=lora_name, extra_keys=query_extra)
            assert many.find_matches(tokens, lora_name=lora_name, extra_keys=query_extra) == want
    else:
        for d in range(len(DOCS)):
            for lora, form, w in itertools.product((0, 1), (0, 1), range(3)):
                keys = [engine_key(engine_hash(w, d, b, lora, form)) for b in range(len(DOCS[d]) // BS)]
                assert many.find_matches(block_hashes=keys) == one.find_matches(block_hashes=keys)


def test_apply_many_two_threads_on_a_long_stream():
    """Thousands of payloads (megabytes: the two-thread path, many chunks), stores with
    parents, removals, clears and malformed payloads in between: the same index as apply."""
    rng = random.Random(7)
    msgs: list[tuple[str, bytes]] = []
    # Per worker: its chain's blocks, (engine hash, token ids).
    chains: dict[str, list[tuple[int, list[int]]]] = {}
    for i in range(4000):
        w = f"w{rng.randrange(8)}"
        chain = chains.setdefault(w, [])
        if rng.random() < 0.02:
            msgs.append((w, b"\xc1" * rng.randrange(1, 50)))
            continue
        evs: list[object] = []
        if chain and rng.random() < 0.3:
            evs.append(BlockRemoved(block_hashes=[chain.pop()[0]], medium="GPU"))
        if rng.random() < 0.01:
            evs.append(AllBlocksCleared())
            chain.clear()
        doc, start = rng.randrange(4), len(chain)
        blocks = [
            (doc * 10_000 + b + 1, [(doc * 31 + t) % 97 for t in range(b * BS, (b + 1) * BS)])
            for b in range(start, start + rng.randrange(1, 6))
        ]
        evs.append(
            BlockStored(
                block_hashes=[h for h, _ in blocks],
                parent_block_hash=chain[-1][0] if chain else None,
                token_ids=[t for _, ts in blocks for t in ts],
                block_size=BS,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        )
        chain.extend(blocks)
        msgs.append((w, encode_batch(KVEventBatch(ts=float(i), events=evs))))
    assert sum(len(d) for _, d in msgs) > 256 << 10
    for key in ("tokens", "engine"):
        one, many = Index(BS, key), Index(BS, key)
        want = [one.apply(w, d) for w, d in msgs]
        assert many.apply_many(iter(msgs)) == want
        assert many.stats == one.stats and one.stats["malformed_payloads"] > 0
        assert (many.workers, len(many)) == (one.workers, len(one))
        hits = 0
        for chain in chains.values():
            for cut in range(0, len(chain) + 1, 3):
                if key == "engine":
                    q = {"block_hashes": [h for h, _ in chain[:cut]]}
                else:
                    q = {"tokens": [t for _, ts in chain[:cut] for t in ts]}
                got = many.find_matches(**q)
                assert got == one.find_matches(**q)
                hits += bool(got)
        assert hits > 0


def test_the_same_stream_from_bytes_json_and_batches_gives_the_same_state():
    rng = random.Random(5)
    idxs = [Index(4) for _ in range(3)]
    pools = {f"w{i}": KVCacheManager(40, 4, algo="sha256_cbor") for i in range(3)}
    prefixes = [[rng.randrange(100) for _ in range(24)] for _ in range(4)]
    for step in range(300):
        w = rng.choice(list(pools))
        pool = pools[w]
        rid = f"r{step}"
        lora = rng.choice([None, "ad"])
        prompt = rng.choice(prefixes)[: rng.randrange(4, 25)] + [rng.randrange(100)] * rng.randrange(9)
        if pool.allocate(rid, prompt, lora_name=lora) is not None:
            pool.free(rid)
        batch = KVEventBatch(ts=float(step), events=pool.take_events())
        assert idxs[0].apply(w, encode_batch(batch)) == len(batch.events)
        assert idxs[1].apply(w, bytearray(encode_batch(batch, "json"))) == len(batch.events)
        assert idxs[2].apply(w, batch) == len(batch.events)
    for tokens in prefixes:
        for lora in (None, "ad"):
            answers = [i.find_matches(tokens, lora_name=lora) for i in idxs]
            assert answers[0] == answers[1] == answers[2]
    assert len(idxs[0]) == len(idxs[1]) == len(idxs[2]) > 0
    assert idxs[0].stats == idxs[1].stats == idxs[2].stats


def test_tokens_and_engine_keys_agree_on_vllm_hashes():
    """A stream from sha256_cbor pools (vLLM's hash, LoRA in extra keys): the tokens index queried
    with tokens and the engine index queried with hash_blocks(sha256_cbor) score alike."""
    rng = random.Random(11)
    tokens_idx, engine_idx = Index(4), Index(4, key="engine")
    pools = {f"w{i}": KVCacheManager(24, 4, algo="sha256_cbor") for i in range(4)}
    prefixes = [[rng.randrange(50) for _ in range(28)] for _ in range(5)]
    live: dict[str, list[str]] = {w: [] for w in pools}
    for step in range(600):
        w = rng.choice(list(pools))
        pool = pools[w]
        if live[w] and rng.random() < 0.5:
            pool.free(live[w].pop(rng.randrange(len(live[w]))))
        else:
            rid = f"r{step}"
            prompt = rng.choice(prefixes)[: rng.randrange(4, 29)] + [rng.randrange(50)] * rng.randrange(6)
            if pool.allocate(rid, prompt, lora_name=rng.choice([None, None, "ad"])) is not None:
                live[w].append(rid)
        if rng.random() < 0.005:
            for rid in live[w]:
                pool.free(rid)
            live[w].clear()
            pool.reset()
        payload = encode_batch(KVEventBatch(ts=0.0, events=pool.take_events()))
        tokens_idx.apply(w, payload)
        engine_idx.apply(w, payload)
        if step % 50 == 0:
            for prefix in prefixes:
                for lora in (None, "ad"):
                    n = len(prefix) // 4
                    hashes = hash_blocks(prefix, 4, algo="sha256_cbor", extra_keys=[(lora,)] * n if lora else None)
                    want = brute_force(pools, hashes)
                    assert tokens_idx.find_matches(prefix, lora_name=lora) == want
                    assert engine_idx.find_matches(block_hashes=hashes) == want
    assert tokens_idx.stats["unknown_parents"] == engine_idx.stats["unknown_parents"] == 0


def brute_force(pools: dict[str, KVCacheManager], hashes: list[int]) -> dict[str, int]:
    return prefix_scores({w: set(pool.cached_block_hashes()) for w, pool in pools.items()}, hashes)


# --- payloads the schema accepts, and garbage ---------------------------------------------------


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_every_batch_the_schema_encodes_is_read(fmt, data):
    batch = data.draw(batches(fmt))
    idx = Index(BS)
    payload = encode_batch(batch, fmt)
    assert idx.apply("w", payload) == len(batch.events)
    assert idx.stats["malformed_payloads"] == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
def test_garbage_is_counted_and_never_raises(payload):
    idx = Index(BS)
    n = idx.apply("w", payload)
    try:
        fmt = "json" if payload.lstrip()[:1] in (b"[", b"{") else "msgpack"
        batch = decode_batch(payload, fmt)
    except (DecodeError, msgspec.DecodeError):
        assert n == 0
        assert idx.stats["malformed_payloads"] == 1
        assert idx.workers == []
    else:
        assert n == len(batch.events)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_payload_cut_anywhere_is_malformed_and_applies_nothing(data):
    # Token ids and hashes of every width, then the payload cut inside any of them: the index
    # reads a payload whole or not at all.
    batch = data.draw(batches("msgpack"))
    payload = encode_batch(batch)
    cut = data.draw(st.integers(0, len(payload) - 1))
    idx = Index(BS)
    assert idx.apply("w", payload[:cut]) == 0
    assert idx.stats["malformed_payloads"] == 1
    assert (idx.workers, len(idx)) == ([], 0)


def test_foreign_shapes_apply_like_their_decoded_batch():
    pos_stored = ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "GPU", "ad"]
    pos_removed = ["BlockRemoved", [12], "GPU"]
    sglang_maps = [
        {"type": "BlockStored", "block_hashes": [21], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2},
        {"type": "BlockStored", "block_hashes": [22], "parent_block_hash": 21, "token_ids": [5, 6], "block_size": 2,
         "cache_salt": "s"},
    ]  # fmt: skip
    payloads = [
        msgspec.msgpack.encode([1.0, [pos_stored, pos_removed, ["AllBlocksCleared"], pos_stored]]),
        msgspec.msgpack.encode([1.0, sglang_maps, 0]),
        msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": None}),
        msgspec.json.encode([1.0, [pos_stored[:5], ["BlockStored", [13], 11, [5, 6], 2]]]),
    ]
    for payload in payloads:
        fmt = "json" if payload[:1] == b"[" else "msgpack"
        by_bytes, by_batch = Index(BS), Index(BS)
        assert by_bytes.apply("w", payload) == by_batch.apply("w", decode_batch(payload, fmt)) > 0
        for tokens, lora in (([1, 2, 3, 4], "ad"), ([1, 2, 3, 4], None), ([1, 2, 5, 6], None), ([1, 2, 5, 6], "ad")):
            assert by_bytes.find_matches(tokens, lora_name=lora) == by_batch.find_matches(tokens, lora_name=lora)
        assert by_bytes.stats == by_batch.stats
        assert by_bytes.stats["malformed_payloads"] == 0


def test_removing_a_block_keeps_its_children_and_a_refill_counts_again():
    idx = Index(BS)
    tokens = [1, 2, 3, 4, 5, 6]
    idx.apply("a", encode_batch(KVEventBatch(0.0, [BlockStored([1, 2, 3], None, tokens, BS, None, "GPU", None)])))
    idx.apply("a", encode_batch(KVEventBatch(0.0, [BlockRemoved([2], "GPU")])))
    assert idx.find_matches(tokens) == {"a": 1}
    assert idx.find_matches(block_hashes=index_keys(tokens)[2:]) == {"a": 1}  # the child is still there
    idx.apply("a", encode_batch(KVEventBatch(0.0, [BlockStored([2], 1, tokens[2:4], BS, None, "GPU", None)])))
    assert idx.find_matches(tokens) == {"a": 3}


def test_lora_name_leading_extra_keys_are_left_out_and_salt_the_chain():
    idx = Index(BS)
    tokens = [1, 2, 3, 4]
    ev = BlockStored([1, 2], None, tokens, BS, 7, "GPU", "ad", extra_keys=[("ad", "salt"), ("ad",)])
    idx.apply("a", encode_batch(KVEventBatch(0.0, [ev])))
    assert idx.find_matches(tokens, lora_name="ad", extra_keys=[("salt",), None]) == {"a": 2}
    assert idx.find_matches(tokens, lora_name="ad", extra_keys=[["salt"], ()]) == {"a": 2}  # lists, empty = None
    assert idx.find_matches(tokens, lora_name="ad") == {}  # the salt is part of block 0
    assert idx.find_matches(tokens, extra_keys=[("salt",), None]) == {}  # no LoRA: another chain
    keys = hash_blocks(tokens, BS, algo="xxh3", lora_name="ad", extra_keys=[("salt",), None])
    assert idx.find_matches(block_hashes=keys) == {"a": 2}


def test_engine_mode_takes_placeholders_and_bytes_hashes():
    idx = Index(BS, key="engine")
    digest = bytes(range(32))
    ev = BlockStored([digest, 5], None, [], BS, None, "CPU", None)
    assert idx.apply("a", encode_batch(KVEventBatch(0.0, [ev]))) == 1
    assert idx.stats["events_without_tokens"] == 1
    assert idx.find_matches(block_hashes=[digest, 5]) == {"a": 2}
    assert idx.find_matches(block_hashes=[int.from_bytes(digest[-8:], "big"), 5], medium="CPU") == {"a": 2}
    assert idx.find_matches(block_hashes=[digest], medium="GPU") == {}
    tokens_idx = Index(BS)
    tokens_idx.apply("a", encode_batch(KVEventBatch(0.0, [ev])))
    assert len(tokens_idx) == 0 and tokens_idx.stats["events_without_tokens"] == 1


def test_many_workers_beyond_one_word_of_bits():
    idx = Index(BS)
    tokens = list(range(40))
    for w in range(150):
        n = 1 + w % 20
        ev = BlockStored(list(range(n)), None, tokens[: n * BS], BS, None, "GPU", None)
        idx.apply(f"w{w:03}", encode_batch(KVEventBatch(0.0, [ev])))
    want = {f"w{w:03}": 1 + w % 20 for w in range(150)}
    assert idx.find_matches(tokens) == want
    for w in range(0, 150, 3):
        idx.remove_worker(f"w{w:03}")
        del want[f"w{w:03}"]
    assert idx.find_matches(tokens) == want
    idx.apply("late", encode_batch(KVEventBatch(0.0, [BlockStored([0], None, tokens[:BS], BS, None, "GPU", None)])))
    assert idx.find_matches(tokens) == {**want, "late": 1}
    assert idx.memory_bytes > 0 and len(idx) == 20


# --- arguments --------------------------------------------------------------------------------


def test_wrong_argument_types_raise_naming_the_argument():
    import array

    idx = Index(BS)
    payload = encode_batch(KVEventBatch(0.0, []))
    cases = [
        (lambda: idx.apply(5, payload), TypeError, "worker must be str"),
        (lambda: idx.apply("w", "text"), TypeError, "data must be bytes"),
        (lambda: idx.apply("w", [1, 2]), TypeError, "data must be bytes"),
        (lambda: idx.apply("w", payload, 1), TypeError, "format must be str"),
        (lambda: idx.apply("w", payload, "xml"), ValueError, "format must be 'msgpack', 'json' or None"),
        (lambda: idx.apply_many([("w", payload, 1)]), TypeError, r"items must be \(worker, data\) tuples"),
        (lambda: idx.apply_many([(5, payload)]), TypeError, "worker must be str"),
        (lambda: idx.apply_many([("w", "text")]), TypeError, "data must be bytes"),
        (lambda: idx.apply_many(5), TypeError, "not iterable"),
        (lambda: idx.apply_many([], "xml"), ValueError, "format must be 'msgpack', 'json' or None"),
        (lambda: Index(0), ValueError, "block_size"),
        (lambda: Index("16"), TypeError, "block_size"),
        (lambda: Index(16, key="hash"), ValueError, "key must be 'tokens' or 'engine'"),
        (lambda: idx.find_matches(), TypeError, "needs tokens or block_hashes"),
        (lambda: idx.find_matches([1, 2], block_hashes=[1]), TypeError, "not both"),
        (lambda: idx.find_matches([1, 2**32]), ValueError, "token at index 1"),
        (lambda: idx.find_matches([1, -1]), ValueError, "token at index 1"),
        (lambda: idx.find_matches("abc"), TypeError, "tokens"),
        (lambda: idx.find_matches([1, 2, 3, 4], extra_keys=[None]), ValueError, "2 full blocks"),
        (lambda: idx.find_matches([1, 2], extra_keys=[(1.5,)]), TypeError, r"extra_keys\[0\]\[0\]"),
        (lambda: idx.find_matches([1, 2], extra_keys=["salt"]), TypeError, r"extra_keys\[0\] must be None or a tuple"),
        (lambda: idx.find_matches([1, 2], extra_keys=5), TypeError, "extra_keys must be a list"),
        (lambda: idx.find_matches([1, 2], lora_name=3), TypeError, "lora_name must be str"),
        (lambda: idx.find_matches([1, 2], medium=b"GPU"), TypeError, "medium must be str"),
        (lambda: idx.find_matches(block_hashes=[1, "x"]), TypeError, r"block_hashes\[1\] must be int or bytes"),
        (lambda: idx.find_matches(block_hashes=[2**64]), ValueError, r"block_hashes\[0\]"),
        (lambda: idx.find_matches(block_hashes=b"ab"), TypeError, "block_hashes must be"),
        (lambda: idx.find_matches(block_hashes=array.array("I", [1, 2])), TypeError, "block_hashes must be"),
        (lambda: idx.find_matches(block_hashes="ab", lists=True), TypeError, "block_hashes must be"),
        (lambda: idx.find_matches(block_hashes=[1], top_k=-1, lists=True), ValueError, "top_k must be an int >= 0"),
        (lambda: idx.find_matches([1, 2], by_medium=True, lists=True), ValueError, "not with lists or top_k"),
        (lambda: idx.find_matches(block_hashes=[1], lora_name="a"), ValueError, "go with tokens"),
        (lambda: Index(BS, key="engine").find_matches([1, 2]), ValueError, "block_hashes="),
        (lambda: idx.remove_worker(None), TypeError, "worker must be str"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert idx.stats["payloads"] == 0  # nothing got as far as the index


def test_block_hashes_from_numpy_any_byte_order_and_stride():
    import numpy as np  # in the test extra: fail loudly if missing
    idx = Index(BS, key="engine")
    idx.apply("a", encode_batch(KVEventBatch(0.0, [BlockStored([2**63 + 5, 7, 9], None, [1] * 6, BS, None, "GPU", None)])))
    keys = [2**63 + 5, 7, 9, 11]
    for arr in (np.array(keys, dtype=np.uint64), np.array(keys, dtype=">u8"), np.repeat(np.array(keys, dtype=np.uint64), 2)[::2]):
        assert idx.find_matches(block_hashes=arr) == {"a": 3}
        assert idx.find_matches(block_hashes=arr, lists=True) == (["a"], [3])
    assert idx.find_matches(block_hashes=np.array(keys, dtype=np.uint64).view(np.int64), lists=True) == (["a"], [3])


def test_block_hashes_read_in_place_or_copied():
    """Hashes are read in place from bytes and aligned native buffers, copied from unaligned
    ones: the same answer either way, and the caller's object is left as it was."""
    from array import array

    import numpy as np  # in the test extra: fail loudly if missing
    idx = Index(BS, key="engine")
    idx.apply("a", encode_batch(KVEventBatch(0.0, [BlockStored([2**63 + 5, 7, 9], None, [1] * 6, BS, None, "GPU", None)])))
    keys = array("Q", [2**63 + 5, 7, 9, 11])
    raw = keys.tobytes()
    unaligned = np.frombuffer(b"\0" + raw, dtype=np.uint64, offset=1)
    assert unaligned.ctypes.data % 8 != 0
    for buf in (raw, bytearray(raw), memoryview(raw), memoryview(b"\0" + raw)[1:], keys, unaligned, np.frombuffer(raw, dtype=np.uint64)):
        assert idx.find_matches(block_hashes=buf) == {"a": 3}, type(buf)
        assert idx.find_matches(block_hashes=buf, lists=True) == (["a"], [3]), type(buf)
        assert idx.find_matches(block_hashes=buf, top_k=1, lists=True) == (["a"], [3]), type(buf)
        assert idx.find_matches(block_hashes=buf, by_medium=True) == {"a": {"GPU": 3}}, type(buf)
    assert keys.tolist() == [2**63 + 5, 7, 9, 11] and raw == keys.tobytes()
    assert idx.find_matches(block_hashes=b"") == {} and idx.find_matches(block_hashes=array("Q"), lists=True) == ([], [])
    with pytest.raises(TypeError, match=r"block_hashes must be .*not a multiple of 8"):
        idx.find_matches(block_hashes=raw[:-1])


def test_token_buffers_in_place_or_copied_answer_alike():
    """Token ids are read in place from aligned native 32-bit buffers, copied from the rest; the
    query's keys, its answer's vector and the buffer export are reused from call to call. Every
    way answers as a list does, in any order of long, short, empty and failing calls."""
    from array import array

    import numpy as np  # in the test extra: fail loudly if missing
    idx = Index(4, key="tokens")
    chain = list(range(1, 4 * 40 + 1))
    for w, n in (("a", 40), ("b", 3), ("c", 1)):
        idx.apply(w, encode_batch(KVEventBatch(0.0, [BlockStored(list(range(1, n + 1)), None, chain[: 4 * n], 4, None, "GPU", None)])))
    raw = array("I", chain).tobytes()
    unaligned = np.frombuffer(b"\0" + raw, dtype=np.uint32, offset=1)
    assert unaligned.ctypes.data % 4 != 0
    ways = [
        lambda t: t,
        lambda t: array("I", t),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.frombuffer(b"\0" + array("I", t).tobytes(), dtype=np.uint32, offset=1),
        lambda t: np.repeat(np.array(t, dtype=np.uint32), 2)[::2],
        lambda t: np.array(t, dtype=">u4"),
        lambda t: array("q", t),
        lambda t: memoryview(array("I", t)),
    ]
    rng = random.Random(5)
    for _ in range(200):
        n = rng.choice([0, 3, 4, 9, 12, 40 * 4, 40 * 4 + 3])
        tokens = chain[:n]
        want = idx.find_matches(tokens)
        assert want == {w: m for w, m in (("a", n // 4), ("b", min(3, n // 4)), ("c", min(1, n // 4))) if m}
        lists = (sorted(want), [want[w] for w in sorted(want)])
        given = rng.choice(ways)(tokens)
        assert idx.find_matches(given) == want
        assert idx.find_matches(given, lists=True) == lists
        assert idx.find_matches(given, top_k=1, lists=True) == (lists[0][:1], lists[1][:1])
        if rng.random() < 0.2:  # a failing call in between leaves nothing behind
            with pytest.raises(BufferError, match="1-dimensional"):
                idx.find_matches(np.zeros((2, 2), np.uint32))
            with pytest.raises(ValueError, match="token at index 1"):
                idx.find_matches(np.array([1, -1], dtype=np.int32))
            with pytest.raises(TypeError, match="format 'd'"):
                idx.find_matches(array("d", [1.0]))
    assert unaligned.tolist() == chain  # the caller's buffer is left as it was


@pytest.mark.parametrize("bs", [16, 32, 64, 5])
def test_token_queries_find_what_stores_keyed_at_every_block_size(bs):
    """A query's tokens are hashed by a loop of their own (the block's length a constant for 16,
    32 and 64) where stores hash through the chain: both key the blocks alike, with and without
    a LoRA name, whatever the query's partial last block."""
    from array import array

    rng = random.Random(bs)
    chain = [rng.randrange(2**32) for _ in range(bs * 12)]
    for lora in (None, "adapter-1"):
        idx = Index(bs, key="tokens")
        for w, n in (("a", 12), ("b", 7), ("c", 1)):
            stored = BlockStored(list(range(1, n + 1)), None, chain[: bs * n], bs, None, "GPU", lora)
            idx.apply(w, encode_batch(KVEventBatch(0.0, [stored])))
        for n in (0, bs - 1, bs, 5 * bs + 1, 12 * bs):
            tokens = chain[:n]
            want = {w: m for w, m in (("a", n // bs), ("b", min(7, n // bs)), ("c", min(1, n // bs))) if m}
            assert idx.find_matches(tokens, lora_name=lora) == want
            assert idx.find_matches(array("I", tokens), lora_name=lora) == want
            keys = hash_blocks(tokens, bs, algo="xxh3", lora_name=lora)
            assert idx.find_matches(block_hashes=[k & MASK for k in keys]) == want
        # Salted by the name: the same tokens under another (or no) LoRA match nothing.
        assert idx.find_matches(chain, lora_name="other") == {}


def test_inputs_and_properties():
    import array

    idx = Index(4, key="tokens")
    assert (idx.block_size, idx.key, len(idx), idx.workers) == (4, "tokens", 0, [])
    assert idx.apply("idle", b"[0.5, []]") == 0  # a heartbeat: the worker is known
    ev = BlockStored([1], None, [1, 2, 3, 4], 4, None, "GPU", None)
    assert idx.apply("m", memoryview(encode_batch(KVEventBatch(0.0, [ev])))) == 1
    assert idx.workers == ["idle", "m"]
    for tokens in ([1, 2, 3, 4, 5], array.array("I", [1, 2, 3, 4]), array.array("q", [1, 2, 3, 4, 9]), (1, 2, 3, 4)):
        assert idx.find_matches(tokens) == {"m": 1}
    assert idx.find_matches([1, 2, 3]) == {}  # no full block
    assert "blocks=1" in repr(idx)
    idx.clear()
    assert (len(idx), idx.workers, idx.stats["payloads"]) == (0, [], 2)


# --- threads ----------------------------------------------------------------------------------


def _growing_chain(seed: int) -> tuple[list[int], list[int], list[bytes], set[int]]:
    """One worker's chain of 9,000 4-token blocks (hashes 1..9000) as payloads of 1, 5 or 3,000
    blocks (some over 64 KiB, which apply with the GIL released), and the chain lengths they end at."""
    rng = random.Random(seed)
    total = 9000
    tokens = [rng.randrange(70_000, 1_000_000) for _ in range(4 * total)]  # 5 msgpack bytes each
    hashes = list(range(1, total + 1))
    payloads, ends, start = [], {0}, 0
    while start < total:
        n = min(rng.choice([1, 5, 3000]), total - start)
        ev = BlockStored(
            hashes[start : start + n], hashes[start - 1] if start else None, tokens[start * 4 : (start + n) * 4], 4,
            None, "GPU", None,
        )  # fmt: skip
        payloads.append(encode_batch(KVEventBatch(0.0, [ev])))
        start += n
        ends.add(start)
    assert max(map(len, payloads)) >= 64 * 1024
    return tokens, hashes, payloads, ends


def _read_while_applying(idx: Index, payloads: list[bytes], read) -> list[int]:
    """Applies ``payloads`` to worker "w" while another thread calls ``read()`` (a list of the
    chain lengths it saw) over and over; what it saw, in order, after asserting it raised nothing."""
    seen: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader():
        try:
            while not stop.is_set():
                seen.extend(read())
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    t = threading.Thread(target=reader, name="kvbridge-test-reader")
    t.start()
    try:
        for p in payloads:
            idx.apply("w", p)
    finally:
        stop.set()
        t.join(timeout=60)
    assert not errors
    return seen


def test_queries_from_another_thread_see_whole_payloads_while_events_apply():
    """A concurrent reader must only ever see a prefix length some payload ended at."""
    idx = Index(4)
    tokens, _, payloads, ends = _growing_chain(3)
    seen = _read_while_applying(idx, payloads, lambda: [idx.find_matches(tokens).get("w", 0)])
    assert seen and all(s in ends for s in seen)
    assert seen == sorted(seen)
    assert idx.find_matches(tokens) == {"w": len(tokens) // 4}


def test_buffer_queries_while_long_payloads_apply():
    """Hashes from an exported buffer are read in place only while the GIL is held: a query that
    meets a long apply holding the state's lock copies them and waits with the GIL released. A
    concurrent reader, in every answer form, only ever sees a prefix length some payload ended at."""
    from array import array

    idx = Index(4, key="engine")
    _, hashes, payloads, ends = _growing_chain(5)
    packed = array("Q", hashes)

    def read() -> list[int]:
        seen = []
        for buf in (packed, packed.tobytes()):
            for answer in (
                idx.find_matches(block_hashes=buf, lists=True),
                idx.find_matches(block_hashes=buf, top_k=1, lists=True),
            ):
                assert answer[0] in ([], ["w"])  # one worker's chain, or nothing yet
                seen.append(answer[1][0] if answer[1] else 0)
        return seen

    seen = _read_while_applying(idx, payloads, read)
    assert seen and all(s in ends for s in seen)
    assert seen == sorted(seen)
    assert idx.find_matches(block_hashes=packed, lists=True) == (["w"], [len(hashes)])
    assert packed.tolist() == hashes
