import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvbridge
from kvbridge.engine._reference_pool import BlockPool, PyKVCacheManager
from kvbridge.engine.pool import NativeKVCacheManager
from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch


def chain(tokens, block_size, lora_name=None, **kw):
    """Event hashes of a whole sequence, from its start: what incremental hashing must equal.
    LoRA salts each block's hash through extra keys ``(lora_name,)``, as vLLM does."""
    extra = None if lora_name is None else [(lora_name,)] * (len(tokens) // block_size)
    return kvbridge.hash_blocks(tokens, block_size, extra_keys=extra, **kw)


class View:
    """A consumer's replay of the event stream into a plain dict, checking the stream's rules."""

    def __init__(self):
        self.blocks = {}  # hash -> (parent, token_ids, lora_name, lora_id)

    def apply(self, event, block_size):
        if isinstance(event, BlockStored):
            assert event.block_size == block_size
            assert len(event.token_ids) == block_size * len(event.block_hashes)
            parent = event.parent_block_hash
            assert parent is None or parent in self.blocks, "parent not stored, or removed since"
            if event.lora_name is None:
                assert event.extra_keys is None
            else:
                assert event.extra_keys == [(event.lora_name,)] * len(event.block_hashes)
            for i, h in enumerate(event.block_hashes):
                assert h not in self.blocks, "hash stored twice without a removal between"
                toks = event.token_ids[i * block_size : (i + 1) * block_size]
                self.blocks[h] = (parent, toks, event.lora_name, event.lora_id)
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                assert h in self.blocks, "removal of a hash that is not stored"
                del self.blocks[h]
        else:
            assert isinstance(event, AllBlocksCleared)
            self.blocks.clear()

    def apply_all(self, events, block_size):
        for event in events:
            self.apply(event, block_size)
        return self


class RefModel:
    """The pool's rules restated with plain lists and linear scans (slow, obviously right)."""

    def __init__(self, num_blocks, block_size, algo="xxh3"):
        self.n, self.bs, self.algo = num_blocks, block_size, algo
        self.ref = [0] * num_blocks
        self.hash = [None] * num_blocks
        self.free = list(range(num_blocks))  # head (evicted first) at index 0
        self.holders = {}  # hash -> block ids holding it, oldest first; keys = cached set
        self.reqs = {}  # rid -> [blocks, tokens, lora_name, lora_id]
        self.events = []
        self.lora_ids = {}  # lora_name -> the id a manager numbers it with

    def _new_blocks(self, count):
        out, removed = [], []
        for _ in range(count):
            b = self.free.pop(0)
            h = self.hash[b]
            if h is not None:
                self.holders[h].remove(b)
                if not self.holders[h]:
                    del self.holders[h]
                    removed.append(h)
                self.hash[b] = None
            self.ref[b] = 1
            out.append(b)
        if removed:
            self.events.append(BlockRemoved(block_hashes=removed, medium="GPU"))
        return out

    def _cache(self, blocks, tokens, first, lora_name, lora_id):
        """Blocks[first:] of the request are full now; tokens are the request's tokens."""
        hashes = chain(tokens, self.bs, lora_name, algo=self.algo)
        runs = []
        for i in range(first, len(hashes)):
            b, h = blocks[i], hashes[i]
            self.hash[b] = h
            is_new = h not in self.holders
            self.holders.setdefault(h, []).append(b)
            if is_new:
                if runs and runs[-1][1] == i:
                    runs[-1][1] = i + 1
                else:
                    runs.append([i, i + 1])
        for start, end in runs:
            self.events.append(
                BlockStored(
                    block_hashes=hashes[start:end],
                    parent_block_hash=hashes[start - 1] if start else None,
                    token_ids=tokens[start * self.bs : end * self.bs],
                    block_size=self.bs,
                    lora_id=lora_id,
                    medium="GPU",
                    lora_name=lora_name,
                    extra_keys=None if lora_name is None else [(lora_name,)] * (end - start),
                )
            )

    def allocate(self, rid, tokens, lora_name, lora_id):
        hashes = chain(tokens, self.bs, lora_name, algo=self.algo)
        hit = []
        for h in hashes:
            if h not in self.holders:
                break
            hit.append(self.holders[h][0])
        total = -(-len(tokens) // self.bs)
        if total - len(hit) + sum(self.ref[b] == 0 for b in hit) > len(self.free):
            return None
        if lora_name is not None and lora_id is None:
            lora_id = self.lora_ids.setdefault(lora_name, len(self.lora_ids) + 1)
        for b in hit:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        blocks = hit + self._new_blocks(total - len(hit))
        self._cache(blocks, tokens, len(hit), lora_name, lora_id)
        self.reqs[rid] = [blocks, list(tokens), lora_name, lora_id]
        return len(hit) * self.bs

    def append(self, rid, new):
        blocks, tokens, lora_name, lora_id = self.reqs[rid]
        total = -(-(len(tokens) + len(new)) // self.bs)
        if total - len(blocks) > len(self.free):
            return False
        first = len(tokens) // self.bs
        tokens += new
        blocks += self._new_blocks(max(total - len(blocks), 0))
        self._cache(blocks, tokens, first, lora_name, lora_id)
        return True

    def free_request(self, rid):
        blocks = self.reqs.pop(rid)[0]
        fresh = []
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] is None:
                    fresh.append(b)
                else:
                    self.free.append(b)
        self.free[:0] = fresh

    def reset(self):
        if len(self.free) != self.n:
            return False
        self.hash = [None] * self.n
        self.holders = {}
        self.events.append(AllBlocksCleared())
        return True


# Few distinct tokens, small blocks and a small pool: shared prefixes, duplicate blocks,
# evictions and failed allocations all happen within a few steps.
SYSTEM_PROMPTS = [[7, 7, 1, 2, 3, 1], [7, 7, 1, 3], [5, 6]]
tokens_st = st.lists(st.integers(0, 3), max_size=9)
prompt_st = st.tuples(st.sampled_from(SYSTEM_PROMPTS + [[]]), tokens_st).map(
    lambda t: t[0] + t[1]
).filter(bool)
lora_st = st.sampled_from([(None, None), (None, None), ("adapter-a", 3), ("adapter-a", None)])


class PoolMachine(RuleBasedStateMachine):
    """The native manager against the Python one (the spec) step by step -- same results, same
    events, same free queue, same blocks, same snapshot -- and both against RefModel."""

    algo = "xxh3"

    @initialize(num_blocks=st.integers(4, 16), block_size=st.integers(1, 4))
    def setup(self, num_blocks, block_size):
        self.bs = block_size
        self.mgr = NativeKVCacheManager(num_blocks, block_size, algo=self.algo)
        self.spec = PyKVCacheManager(num_blocks, block_size, algo=self.algo)
        self.ref = RefModel(num_blocks, block_size, self.algo)
        self.view = View()
        self.next_id = 0

    def _sync(self):
        events = self.mgr.take_events()
        assert events == self.spec.take_events()
        assert events == self.ref.events
        self.ref.events = []
        self.view.apply_all(events, self.bs)

    @precondition(lambda self: len(self.ref.reqs) < 5)
    @rule(prompt=prompt_st, lora=lora_st)
    def allocate(self, prompt, lora):
        rid = f"r{self.next_id}"
        self.next_id += 1
        lora_name, lora_id = lora
        expected_hit = 0
        for h in chain(prompt, self.bs, lora_name, algo=self.algo):
            if h not in self.view.blocks:
                break
            expected_hit += self.bs
        fits = self.mgr.can_allocate(prompt, lora_name=lora_name)
        assert fits == self.spec.can_allocate(prompt, lora_name=lora_name)
        got = self.mgr.allocate(rid, prompt, lora_name=lora_name, lora_id=lora_id)
        assert (got is not None) == fits, "can_allocate said otherwise"
        assert got == self.spec.allocate(rid, prompt, lora_name=lora_name, lora_id=lora_id)
        assert got == self.ref.allocate(rid, prompt, lora_name, lora_id)
        if got is not None:
            assert got == expected_hit, "cached tokens != longest cached prefix"
        self._sync()

    @precondition(lambda self: 0 < len(self.ref.reqs) < 5)
    @rule(data=st.data())
    def fork(self, data):
        # Parallel sampling: a second request with the same tokens so far.
        rid = data.draw(st.sampled_from(sorted(self.ref.reqs)))
        _, tokens, lora_name, lora_id = self.ref.reqs[rid]
        self.allocate(list(tokens), (lora_name, lora_id))

    def _append(self, rid, new):
        ok = self.mgr.append(rid, new)
        assert ok == self.spec.append(rid, new)
        assert ok == self.ref.append(rid, new)
        if not ok:  # out of blocks: preempt, as an engine would
            self.mgr.free(rid)
            self.spec.free(rid)
            self.ref.free_request(rid)

    @precondition(lambda self: len(self.ref.reqs) > 0)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), max_size=5))
    def append(self, data, new):
        self._append(data.draw(st.sampled_from(sorted(self.ref.reqs))), new)
        self._sync()

    @precondition(lambda self: len(self.ref.reqs) > 1)
    @rule(new=st.lists(st.integers(0, 1), min_size=1, max_size=3))
    def decode_step(self, new):
        # Every running request produces the same tokens: requests with equal histories fill
        # equal blocks in their own block ids, the duplicate-copy case.
        for rid in sorted(self.ref.reqs):
            self._append(rid, new)
        self._sync()

    @precondition(lambda self: len(self.ref.reqs) > 0)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.ref.reqs)))
        self.mgr.free(rid)
        self.spec.free(rid)
        self.ref.free_request(rid)
        self._sync()

    @precondition(lambda self: len(self.ref.holders) > 0 and len(self.ref.reqs) <= 1)
    @rule()
    def reset(self):
        assert self.mgr.reset() == self.spec.reset() == self.ref.reset()
        self._sync()

    @invariant()
    def same_state(self):
        pool, spec = self.mgr.pool, self.spec.pool
        assert set(pool.cached_block_hashes()) == set(self.view.blocks) == set(self.ref.holders)
        assert pool.cached_block_hashes() == spec.cached_block_hashes()  # the same order too
        assert pool.num_free_blocks == spec.num_free_blocks == len(self.ref.free)
        assert pool.num_cached_blocks == spec.num_cached_blocks
        assert pool.usage == spec.usage
        assert pool.free_block_ids() == spec.free_block_ids() == self.ref.free
        assert len(self.mgr) == len(self.spec) == len(self.ref.reqs)
        for rid, (blocks, tokens, _, _) in self.ref.reqs.items():
            assert rid in self.mgr
            assert self.mgr.get_block_ids(rid) == blocks
            assert self.mgr.num_tokens(rid) == len(tokens)
        for b in pool.blocks:
            assert b.ref_cnt == self.ref.ref[b.block_id]
            assert b.block_hash == self.ref.hash[b.block_id]

    @invariant()
    def prefix_closed(self):
        # A cached block's parent is cached too, which is what lets snapshot() order parents
        # first and lets a new consumer place every snapshot block.
        for parent, _, _, _ in self.view.blocks.values():
            assert parent is None or parent in self.view.blocks

    @invariant()
    def snapshot_reproduces_view(self):
        snap = self.mgr.snapshot()
        assert snap == self.spec.snapshot()
        replayed = View().apply_all(snap, self.bs)  # View checks parents-before-children
        assert replayed.blocks == self.view.blocks


PoolMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
TestPoolStateMachine = PoolMachine.TestCase


class VllmAlgoPoolMachine(PoolMachine):
    """The same, with a vLLM algorithm: chains continue on full digests, events carry their
    64-bit tails."""

    algo = "sha256_cbor"


VllmAlgoPoolMachine.TestCase.settings = settings(
    PoolMachine.TestCase.settings, max_examples=80
)
TestVllmAlgoPoolStateMachine = VllmAlgoPoolMachine.TestCase


# --- targeted behaviour: both managers ---------------------------------------------------------


@pytest.fixture(params=[PyKVCacheManager, NativeKVCacheManager], ids=["python", "native"])
def Manager(request):
    return request.param


def stored(events):
    return [e for e in events if isinstance(e, BlockStored)]


def test_allocate_reports_cached_prefix_and_stores_one_event_per_call(Manager):
    m = Manager(16, 4)
    prompt = list(range(10))
    assert m.allocate("a", prompt) == 0
    (ev,) = m.take_events()
    hashes = chain(prompt, 4)
    assert ev == BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=prompt[:8],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    assert m.allocate("b", prompt[:9] + [99, 98, 97, 96]) == 8
    (ev,) = m.take_events()
    assert ev.parent_block_hash == hashes[-1]
    assert ev.block_hashes == chain(prompt[:9] + [99, 98, 97, 96], 4)[2:]
    assert m.get_block_ids("b")[:2] == m.get_block_ids("a")[:2]


def test_append_hashes_incrementally_and_equals_whole_sequence_hash(Manager):
    m = Manager(32, 4)
    seq = list(range(100, 131))
    m.allocate("a", seq[:5])
    for i in range(5, len(seq), 3):
        assert m.append("a", seq[i : i + 3])
    events = stored(m.take_events())
    assert [h for e in events for h in e.block_hashes] == chain(seq, 4)
    assert [t for e in events for t in e.token_ids] == seq[: len(seq) // 4 * 4]
    for prev, ev in zip(events, events[1:]):
        assert ev.parent_block_hash == prev.block_hashes[-1]


class SpyHasher:
    """Wraps a native BlockHasher, logging how many tokens and blocks each update carries."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def update(self, tokens, extra_keys=None, **kw):
        out = self.inner.update(tokens, extra_keys, **kw)
        self.log.append((len(tokens), len(out)))
        return out

    def copy(self):
        return SpyHasher(self.inner.copy(), [])

    @property
    def num_pending(self):
        return self.inner.num_pending


@pytest.mark.parametrize("lora", [None, "x"])
def test_each_token_goes_to_the_native_hash_once(monkeypatch, lora):
    m = PyKVCacheManager(64, 4)
    log = []
    real = m.pool.new_hasher
    monkeypatch.setattr(m.pool, "new_hasher", lambda *a, **k: SpyHasher(real(*a, **k), log))
    m.allocate("a", list(range(18)), lora_name=lora)  # 4 full blocks, one call
    for t in range(40):
        m.append("a", [t])
    assert len(log) == 41 and sum(n for n, _ in log) == 58  # one call each, never from the start
    assert log[0][1] == 4 and sum(b for _, b in log) == 58 // 4
    assert [h for e in stored(m.take_events()) for h in e.block_hashes] == chain(
        list(range(18)) + list(range(40)), 4, lora
    )


def test_lru_eviction_tail_first_and_one_removal_per_reuse(Manager):
    m = Manager(4, 2)
    m.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8])  # 4 blocks, all cached
    h = chain([1, 2, 3, 4, 5, 6, 7, 8], 2)
    m.free("a")
    m.take_events()
    assert m.allocate("b", [9, 9, 9]) == 0  # needs 2 blocks: the chain's last two go
    events = m.take_events()
    assert events[0] == BlockRemoved(block_hashes=[h[3], h[2]], medium="GPU")
    assert isinstance(events[1], BlockStored) and len(events) == 2
    # The surviving head of the chain is still a hit.
    m.free("b")
    assert m.allocate("c", [1, 2, 3, 4, 0]) == 4


def test_uncached_blocks_are_reused_before_cached_ones(Manager):
    m = Manager(4, 4)
    m.allocate("a", [1, 2, 3, 4, 5])  # one cached block, one partial
    m.free("a")
    m.take_events()
    assert m.allocate("b", [9]) == 0
    assert m.take_events() == []  # it got the partial block; nothing evicted
    assert m.allocate("c", [1, 2, 3, 4]) == 4


def test_free_prefix_hits_count_against_free_blocks(Manager):
    m = Manager(3, 2)
    m.allocate("a", [1, 2, 3, 4, 5, 6])
    m.free("a")
    # Hitting 3 free blocks takes them all; one more block is needed and none is left.
    assert m.allocate("b", [1, 2, 3, 4, 5, 6, 7]) is None
    assert m.allocate("b", [1, 2, 3, 4, 5, 6]) == 6


def test_failed_allocate_and_append_change_nothing(Manager):
    m = Manager(3, 2)
    m.allocate("a", [1, 2, 3, 4])
    m.take_events()
    free = m.pool.num_free_blocks
    assert m.allocate("b", [5, 6, 7, 8, 9, 10]) is None
    assert "b" not in m and m.take_events() == [] and m.pool.num_free_blocks == free
    assert m.append("a", [5, 6, 7]) is False
    assert m.num_tokens("a") == 4 and m.take_events() == []
    assert m.append("a", [5, 6]) is True


def test_duplicate_blocks_are_reported_once_and_removed_with_their_last_copy(Manager):
    m = Manager(8, 2)
    m.allocate("a", [1])
    m.allocate("b", [1])
    m.append("a", [2, 3, 4])
    m.append("b", [2, 3, 4])  # same tokens in its own blocks: no second BlockStored
    events = m.take_events()
    assert len(stored(events)) == 1 and len(stored(events)[0].block_hashes) == 2
    assert set(m.get_block_ids("a")).isdisjoint(m.get_block_ids("b"))
    m.free("a")
    m.allocate("c", [9] * 12)  # takes every free block, a's copies last: b still holds both
    removed = [h for e in m.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == []
    assert m.allocate("d", [1, 2, 3, 4, 5]) is None  # out of blocks, but the hit is there
    m.free("c")
    assert m.allocate("d", [1, 2, 3, 4, 5]) == 4
    assert m.get_block_ids("d")[:2] == m.get_block_ids("b")[:2]


def test_the_oldest_remaining_copy_takes_over(Manager):
    m = Manager(9, 2)
    for rid in "abc":
        m.allocate(rid, [1])
    for rid in "abc":
        m.append(rid, [2])  # three blocks hold one hash, a's first
    a, b, c = (m.get_block_ids(rid)[0] for rid in "abc")
    m.free("a")
    m.allocate("fill", [9] * 14)  # all seven free blocks, a's copy last
    m.free("c")
    m.free("b")
    assert m.allocate("d", [1, 2, 3]) == 2
    assert m.get_block_ids("d")[0] == b


def test_reset_only_when_no_block_is_in_use(Manager):
    m = Manager(4, 2)
    m.allocate("a", [1, 2, 3])
    m.take_events()
    assert m.reset() is False and m.take_events() == []
    m.free("a")
    assert m.reset() is True
    assert m.take_events() == [AllBlocksCleared()]
    assert m.snapshot() == [] and m.pool.num_cached_blocks == 0
    assert m.allocate("b", [1, 2, 3]) == 0


def test_lora_salts_the_hash_and_fills_the_event(Manager):
    m = Manager(16, 2)
    m.allocate("base", [1, 2, 3, 4])
    assert m.allocate("a", [1, 2, 3, 4], lora_name="adapter-a") == 0
    assert m.allocate("a2", [1, 2, 3, 4], lora_name="adapter-a") == 4
    assert m.allocate("b", [1, 2], lora_name="adapter-b", lora_id=42) == 0
    assert m.allocate("a3", [1, 2], lora_name="adapter-a") == 2
    base, a, b = stored(m.take_events())
    assert a.block_hashes == chain([1, 2, 3, 4], 2, "adapter-a") != base.block_hashes
    assert (a.lora_name, a.lora_id, a.extra_keys) == ("adapter-a", 1, [("adapter-a",)] * 2)
    assert (b.lora_name, b.lora_id) == ("adapter-b", 42)
    assert (base.lora_name, base.lora_id, base.extra_keys) == (None, None, None)
    snap = m.snapshot()
    assert [(e.lora_name, e.lora_id) for e in snap] == [
        (None, None),
        ("adapter-a", 1),
        ("adapter-b", 42),
    ]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_vllm_algorithms_publish_the_digest_tail_and_chain_on_full_digests(Manager, algo):
    m = Manager(16, 4, algo=algo, seed="test-seed")
    seq = list(range(23))
    m.allocate("a", seq[:6], lora_name="lora-x")
    m.append("a", seq[6:])
    extra = [("lora-x",)] * 5
    digests = kvbridge.hash_blocks(
        seq, 4, algo=algo, seed="test-seed", as_bytes=True, extra_keys=extra
    )
    events = stored(m.take_events())
    assert [h for e in events for h in e.block_hashes] == [
        int.from_bytes(d[-8:], "big") for d in digests
    ]
    assert events[0].extra_keys == [("lora-x",)]
    assert m.allocate("b", seq[:9], lora_name="lora-x") == 8
    if Manager is NativeKVCacheManager:
        return  # the native pool keeps no digests: it has no new_hasher(after=)
    # The pool keeps each cached block's full digest, so a chain can continue from it.
    h = m.pool.new_hasher(after=events[-1].block_hashes[-1])
    assert h.parent == digests[-1]


def test_a_chain_continues_from_a_cached_block():
    m = PyKVCacheManager(16, 4)
    seq = list(range(40))
    m.allocate("a", seq[:12])
    third = chain(seq, 4)[2]
    rest, _ = m.pool.hash_tokens(m.pool.new_hasher(after=third), seq[12:])
    assert rest == chain(seq, 4)[3:]
    with pytest.raises(KeyError, match="not cached"):
        m.pool.new_hasher(after=12345)


def test_dynamo_algorithms(Manager):
    with pytest.raises(ValueError, match="dynamo_seq"):
        Manager(4, 4, algo="dynamo")
    m = Manager(8, 4, algo="dynamo_seq")
    seq = list(range(12))
    m.allocate("a", seq, lora_name="x")
    (ev,) = m.take_events()
    assert ev.block_hashes == kvbridge.hash_blocks(seq, 4, algo="dynamo_seq", lora_name="x")
    assert (ev.lora_name, ev.extra_keys) == ("x", None)  # Dynamo salts with the name itself


def test_snapshot_merges_chains_and_replays_to_the_cached_set(Manager):
    m = Manager(64, 2)
    m.allocate("a", list(range(20)))
    m.allocate("b", list(range(10)) + [50, 51, 52, 53])
    m.allocate("c", [7, 7, 7, 7], lora_name="x")
    view = View().apply_all(m.take_events(), 2)
    snap = m.snapshot()
    assert len(snap) == 3  # a's chain, b's branch off it, c's chain
    assert View().apply_all(snap, 2).blocks == view.blocks
    # The wire format is unchanged: a snapshot encodes like any batch.
    encode_batch(KVEventBatch(ts=0.0, events=snap))


def test_events_disabled(Manager):
    m = Manager(4, 2, enable_events=False)
    m.allocate("a", [1, 2, 3])
    m.free("a")
    assert m.reset() and m.take_events() == []


def test_medium_is_carried_into_events(Manager):
    m = Manager(2, 2, medium="CPU")
    m.allocate("a", [1, 2, 3, 4])
    m.free("a")
    m.allocate("b", [5, 6])
    assert {e.medium for e in m.take_events()} == {"CPU"}


def test_misuse_raises_clear_errors(Manager):
    m = Manager(8, 2)
    m.allocate("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already allocated"):
        m.allocate("a", [1])
    for call in (lambda: m.append("x", [1]), lambda: m.free("x"), lambda: m.get_block_ids("x")):
        with pytest.raises(KeyError, match="unknown request id 'x'"):
            call()
    with pytest.raises(ValueError, match="empty"):
        m.allocate("b", [])
    with pytest.raises(ValueError, match="index 1 is -1"):
        m.allocate("b", [1, -1, 3])  # in a full block
    with pytest.raises(ValueError, match="index 2 is 4294967296"):
        m.allocate("b", [1, 2, 2**32])  # in the partial tail
    with pytest.raises(TypeError):
        m.allocate("b", ["x"])
    for not_tokens in (None, 7):
        with pytest.raises(TypeError, match=f"token ids must be .* not {type(not_tokens).__name__}$"):
            m.allocate("b", not_tokens)
        with pytest.raises(TypeError, match="token ids must be"):
            m.append("a", not_tokens)
    with pytest.raises(ValueError, match="index 0 is -5"):
        m.append("a", [-5, 1])  # completes a block
    with pytest.raises(ValueError, match="index 1 is 4294967296"):
        m.append("a", [1, 2**32])  # second token lands in a new partial block
    m2 = Manager(1, 2)
    m2.allocate("a", [1, 2])
    with pytest.raises(ValueError, match="index 0 is -1"):
        m2.append("a", [-1])  # no block left, but a bad token is still an error
    with pytest.raises(TypeError, match="lora_name"):
        m.allocate("b", [1], lora_name=5)
    assert "b" not in m and m.num_tokens("a") == 3 and m2.append("a", [3]) is False
    assert m.append("a", [4]) and m.num_tokens("a") == 4
    with pytest.raises(ValueError, match="positive"):
        Manager(0, 16)
    with pytest.raises(ValueError, match="positive"):
        BlockPool(4, 0)
    with pytest.raises(ValueError):
        BlockPool(4, 4, algo="nope")


def test_numpy_and_array_inputs(Manager):
    import numpy as np  # a test dependency: fail loudly if missing
    import array

    m = Manager(8, 2)
    m.allocate("a", np.arange(5, dtype=np.int64))
    m.append("a", array.array("I", [5, 6]))
    assert [t for e in stored(m.take_events()) for t in e.token_ids] == list(range(6))


def test_snapshot_from_another_thread_while_the_engine_mutates(Manager):
    m = Manager(64, 4)
    stop = threading.Event()
    errors = []
    steps = [0]

    def engine():
        try:
            while not stop.is_set():
                i = steps[0]
                rid = i % 8
                if rid in m:
                    m.free(rid)
                m.allocate(rid, [i % 5] * 8 + list(range(i % 13)))
                m.append(rid, [1, 2, 3])
                steps[0] = i + 1
        except Exception as exc:  # an engine thread that died would leave a static pool behind
            errors.append(exc)

    t = threading.Thread(target=engine)
    t.start()
    seen = set()  # the engine's step count at each snapshot
    try:
        for _ in range(200):
            seen.add(steps[0])
            snap = m.snapshot()
            try:
                View().apply_all(snap, 4)
            except AssertionError as exc:
                errors.append(exc)
    finally:
        stop.set()
        t.join()
    assert not errors
    assert len(seen) > 1  # the pool changed while the snapshots were taken


# --- the native manager equals the spec on every algorithm --------------------------------------


def outcome(call):
    """A call's result, or its exception's type and message: errors must match too."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 -- comparing which one
        return (type(exc), str(exc))


@pytest.mark.parametrize("algo", ["xxh3", "dynamo_seq", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_native_equals_spec_on_a_random_workload(algo):
    import random

    rnd = random.Random(algo)
    seed = None if algo == "dynamo_seq" else "s"
    native = NativeKVCacheManager(24, 3, algo=algo, seed=seed, medium="CPU")
    spec = PyKVCacheManager(24, 3, algo=algo, seed=seed, medium="CPU")
    prefixes = [[rnd.randrange(50) for _ in range(rnd.randrange(1, 10))] for _ in range(4)]
    loras = [(None, None), ("a", None), ("b", 7), ("", None), (None, 9)]
    live = []
    for step in range(600):
        r = rnd.random()
        if r < 0.35 or not live:
            rid = rnd.choice([step, f"r{step}", (step, "x")])
            tokens = rnd.choice(prefixes) + [rnd.randrange(50) for _ in range(rnd.randrange(0, 7))]
            if rnd.random() < 0.03:
                tokens[rnd.randrange(len(tokens))] = rnd.choice([-1, 2**32, "t"])
            name, lora_id = rnd.choice(loras)
            calls = [lambda m: m.allocate(rid, tokens, lora_name=name, lora_id=lora_id)]
            if live and rnd.random() < 0.1:
                calls = [lambda m: m.allocate(live[0], tokens)]  # duplicate id
        elif r < 0.7:
            rid = rnd.choice(live)
            new = [rnd.randrange(50) for _ in range(rnd.randrange(0, 5))]
            calls = [lambda m: m.append(rid, new)]
        elif r < 0.95:
            rid = live.pop(rnd.randrange(len(live)))
            calls = [lambda m: m.free(rid)]
        else:
            calls = [lambda m: m.free("nope"), lambda m: m.reset()]
        for call in calls:
            got = outcome(lambda: call(native))
            assert got == outcome(lambda: call(spec)), f"step {step}"
            if r < 0.35 or not live:
                if got is not None and not isinstance(got, tuple) and rid not in live:
                    live.append(rid)
        assert native.take_events() == spec.take_events(), f"step {step}"
        if step % 50 == 0:
            assert native.snapshot() == spec.snapshot()
            assert native.pool.free_block_ids() == spec.pool.free_block_ids()
    assert native.snapshot() == spec.snapshot()


def test_native_manager_rejects_what_the_spec_rejects():
    for kwargs in [dict(algo="dynamo"), dict(algo="nope"), dict(algo="dynamo_seq", seed=1)]:
        assert outcome(lambda: NativeKVCacheManager(4, 4, **kwargs)) == outcome(
            lambda: PyKVCacheManager(4, 4, **kwargs)
        )
    for args in [(0, 4), (4, 0), (4.0, 4), (True, 4)]:
        assert outcome(lambda: NativeKVCacheManager(*args)) == outcome(lambda: PyKVCacheManager(*args))


# --- hybrid KV-cache groups (vLLM 0.33's coordinator; see kvbridge.engine.pool) -----------------

HYBRID = [("full_attention", None), ("sliding_window", 4)]


def group_events(events, group_idx):
    return [e for e in events if e.group_idx == group_idx]


def removed_keys(events):
    return [(e.group_idx, h) for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_hybrid_stores_once_per_group_with_its_kind_and_window(Manager):
    m = Manager(16, 2, groups=HYBRID)
    prompt = [1, 2, 3, 4, 5]
    assert m.allocate("a", prompt) == 0
    full, window = m.take_events()
    hashes = chain(prompt, 2)
    common = dict(block_hashes=hashes, parent_block_hash=None, token_ids=prompt[:4], block_size=2,
                  lora_id=None, medium="GPU", lora_name=None)
    # block_pool.py cache_full_blocks: the same block hash in every group (get_block_hash);
    # kv_cache_manager.py take_events: kind and window annotated per group.
    assert full == BlockStored(**common, group_idx=0, kv_cache_spec_kind="full_attention")
    assert window == BlockStored(
        **common, group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4
    )
    ids = m.get_group_block_ids("a")
    assert len(ids) == 2 and ids[0] == m.get_block_ids("a") and set(ids[0]).isdisjoint(ids[1])
    assert m.groups == (("full_attention", None), ("sliding_window", 4))


def test_hybrid_window_releases_blocks_that_left_it_and_evicts_them_later(Manager):
    # W=4, block size 2: once 7 tokens are computed, tokens before 7 - 4 + 1 = 4 are outside
    # the window (SlidingWindowManager.get_num_skipped_tokens): blocks 0 and 1 go.
    m = Manager(12, 2, groups=HYBRID)
    m.allocate("a", [1, 2, 3, 4, 5, 6, 7])
    hashes = chain([1, 2, 3, 4, 5, 6, 7, 8], 2)
    window_ids = m.get_group_block_ids("a")[1]
    m.take_events()
    assert m.append("a", [8])  # remove_skipped_blocks runs with the 7 tokens computed so far
    assert m.get_group_block_ids("a")[1] == [None, None, *window_ids[2:]]
    # Released last block first (_remove_blocks_in_range), at the free queue's tail: cached.
    assert m.pool.free_block_ids()[-2:] == [window_ids[1], window_ids[0]]
    full, window = m.take_events()
    assert (full.group_idx, window.group_idx, window.block_hashes) == (0, 1, [hashes[3]])
    # Taking every free block evicts the released ones, each its own BlockRemoved of group 1.
    assert m.allocate("b", [9] * 5) == 0
    events = m.take_events()
    assert removed_keys(events) == [(1, hashes[1]), (1, hashes[0])]
    assert [e for e in events if isinstance(e, BlockRemoved)][0] == BlockRemoved(
        block_hashes=[hashes[1]], medium="GPU", group_idx=1
    )


def test_hybrid_hit_is_cut_back_to_where_the_window_holds_its_blocks(Manager):
    # W=4, block size 2: a hit of n blocks needs the window group to hold blocks [n-2, n).
    m = Manager(17, 2, groups=HYBRID)
    prompt = list(range(1, 12))  # 5 full blocks and one token
    hashes = chain(prompt, 2)
    m.allocate("a", prompt)
    m.append("a", [0])  # the window group releases blocks 3, 2, 1, 0 (that order)
    m.take_events()
    # 5 fresh blocks + 1: "b" takes 3 per group, evicting the window group's block 3.
    assert m.allocate("b", [50, 51, 52, 53, 54, 55]) == 0
    assert removed_keys(m.take_events()) == [(1, hashes[3])]
    # Full attention holds 5 blocks; the window group holds 0, 1, 2 and 4 (a's, in use).
    # n=5 needs [3, 5): block 3 is gone; n=4 needs [2, 4): gone; n=3 needs [1, 3): held.
    assert m.hit_blocks(prompt) == 3
    assert m.take_events() == [] and m.pool.num_free_blocks == 3
    m.free("b")
    assert m.allocate("c", prompt) == 6
    table = m.get_group_block_ids("c")[1]
    # Only the hit's blocks inside the window are taken (add_local_computed_blocks): 1 and 2.
    assert table[0] is None and None not in table[1:]
    # Blocks 3 and 4 were recomputed: group 0 holds them twice now, and says so (no
    # de-duplication in vLLM's BlockHashToBlockMap).
    stored_full = [e for e in stored(m.take_events()) if e.group_idx == 0]
    assert [h for e in stored_full for h in e.block_hashes] == hashes[3:5]
    snap0 = [h for e in m.snapshot() if e.group_idx == 0 for h in e.block_hashes]
    assert sorted(snap0) == sorted(chain(prompt + [0], 2) + hashes[3:5])  # a's 6 blocks too


def test_hybrid_last_token_is_never_a_hit_so_whole_block_prompts_duplicate(Manager):
    m = Manager(8, 2, groups=HYBRID)
    prompt = [1, 2, 3, 4]
    m.allocate("a", prompt)
    assert m.hit_blocks(prompt) == 1 and m.hit_blocks(prompt + [5]) == 2
    assert m.allocate("b", prompt) == 2  # get_computed_blocks: max hit num_tokens - 1
    h = chain(prompt, 2)
    second = stored(m.take_events())[2:]
    assert [(e.group_idx, e.block_hashes, e.parent_block_hash) for e in second] == [
        (0, [h[1]], h[0]), (1, [h[1]], h[0])
    ]
    assert [(e.group_idx, e.block_hashes) for e in m.snapshot()] == [
        (0, h), (0, [h[1]]), (1, h), (1, [h[1]])
    ]
    assert m.pool.num_cached_blocks == 4  # (group, hash) keys
    m.free("a")
    m.free("b")
    m.allocate("c", [9] * 7)  # every block: each copy's eviction is its own removal
    assert sorted(removed_keys(m.take_events())) == sorted(
        [(0, h[0]), (0, h[1]), (0, h[1]), (1, h[0]), (1, h[1]), (1, h[1])]
    )
    assert m.snapshot() == [] or all(e.block_hashes != h for e in m.snapshot())


def test_hybrid_main_groups_only_and_failed_append(Manager):
    m = Manager(6, 2, groups=[("full_attention", None), ("mla_attention", None)])
    m.allocate("a", [1, 2, 3])
    assert [e.kv_cache_spec_kind for e in m.take_events()] == ["full_attention", "mla_attention"]
    assert m.hit_blocks([1, 2, 3]) == 1 and m.hit_blocks([1, 2]) == 0
    assert m.append("a", [4, 5, 6, 7, 8]) is False  # 2 more blocks per group: 4 > 2 free
    assert m.num_tokens("a") == 3 and m.take_events() == []
    assert m.append("a", [4]) is True and m.pool.num_free_blocks == 2


def test_hit_blocks_single_group_changes_nothing(Manager):
    m = Manager(8, 2)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.take_events()
    free = m.pool.free_block_ids()
    assert m.hit_blocks([1, 2, 3, 4]) == 2 and m.hit_blocks([1, 2, 9]) == 1 and m.hit_blocks([]) == 0
    assert m.hit_blocks([1, 2], lora_name="x") == 0
    assert m.take_events() == [] and m.pool.free_block_ids() == free
    assert m.allocate("b", [1, 2, 3, 4]) == 2 * 2
    assert m.get_group_block_ids("b") == [m.get_block_ids("b")] and m.groups is None


BAD_GROUPS = [
    ("full_attention", r"groups must be a list of \(kind, window\) pairs or None, got .full_attention."),
    ([], "groups must hold 1 to 64 groups, got 0"),
    ([("full_attention", None)] * 65, "groups must hold 1 to 64 groups, got 65"),
    ([("full_attention",)], r"groups\[0\] must be a \(kind, window\) pair, got \('full_attention',\)"),
    ([("full_attention", None), "sliding_window"], r"groups\[1\] must be a \(kind, window\) pair"),
    ([("full_attention", 128)], r"groups\[0\]: full_attention takes no window \(None\), got 128"),
    ([("sliding_window", 128)], r"groups\[0\] must be a main-attention kind \(full_attention, mla_attention, sink_full_attention\), got 'sliding_window'"),
    ([("full_attention", None), ("sliding_window", None)], r"groups\[1\]: sliding_window needs a window, an int >= 1 \(tokens\), got None"),
    ([("full_attention", None), ("sliding_window", 0)], r"groups\[1\]: sliding_window needs a window.*got 0"),
    ([("full_attention", None), ("sliding_window", True)], r"groups\[1\]: sliding_window needs a window.*got True"),
    ([("full_attention", None), ("sliding_window", 4.0)], r"groups\[1\]: sliding_window needs a window.*got 4.0"),
    ([("full_attention", None), ("mamba", None)], r"groups\[1\]: kind must be one of full_attention, mla_attention, sink_full_attention, sliding_window, sliding_window_mla, got 'mamba'"),
    ([(None, None)], r"groups\[0\]: kind must be one of .*, got None"),
]


@pytest.mark.parametrize("groups, message", BAD_GROUPS)
def test_groups_are_validated_with_the_position_and_what_was_expected(Manager, groups, message):
    with pytest.raises(ValueError, match=message):
        Manager(8, 2, groups=groups)
    assert outcome(lambda: NativeKVCacheManager(8, 2, groups=groups)) == outcome(
        lambda: PyKVCacheManager(8, 2, groups=groups)
    )


def test_accepted_groups(Manager):
    for groups in ([["sink_full_attention", None]], (("full_attention", None), ("sliding_window_mla", 1), ("sliding_window", 10**30))):
        m = Manager(8, 2, groups=groups)
        assert m.groups == tuple(tuple(g) for g in groups)
        assert m.allocate("a", [1, 2, 3]) == 0


# --- hybrid: native against the spec step by step, both against the stream's own rules -------

GROUP_CONFIGS = [
    [("full_attention", None), ("sliding_window", 1)],
    [("full_attention", None), ("sliding_window", 3)],
    [("full_attention", None), ("sliding_window", 6)],
    [("mla_attention", None), ("sliding_window", 2), ("sliding_window_mla", 5)],
    [("full_attention", None), ("mla_attention", None), ("sliding_window", 4)],
    [("sink_full_attention", None)],
]


class CopyView:
    """A consumer's replay of a hybrid stream: copies per (group, hash), one per stored block,
    one less per removal (the shared spec's copy count, without the re-announce exception,
    which this pool never needs: it re-sends nothing)."""

    def __init__(self, groups, block_size, sparse=False):
        self.groups, self.bs, self.sparse = groups, block_size, sparse
        self.copies = {}

    def apply_all(self, events):
        for e in events:
            if isinstance(e, BlockStored):
                kind, window = self.groups[e.group_idx]
                assert (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == (kind, window)
                # Sparse retention announces the kept blocks with every block's tokens.
                assert e.block_size == self.bs and len(e.token_ids) % self.bs == 0
                assert len(e.token_ids) == self.bs * len(e.block_hashes) or self.sparse
                for h in e.block_hashes:
                    self.copies[e.group_idx, h] = self.copies.get((e.group_idx, h), 0) + 1
            elif isinstance(e, BlockRemoved):
                assert e.group_idx is not None and len(e.block_hashes) == 1  # one per block, as vLLM
                key = (e.group_idx, e.block_hashes[0])
                assert self.copies.get(key, 0) > 0, "removal of a copy that is not stored"
                self.copies[key] -= 1
                if not self.copies[key]:
                    del self.copies[key]
            else:
                self.copies.clear()
        return self

    def hit(self, hashes, max_blocks):
        """The brief's rule, read off the stream: the largest n <= max_blocks with every main
        group holding [0, n) and every window group [max(0, n - k), n), k = max(1, cdiv(W - 1, b))."""
        def held(g, lo, hi):
            return all((g, hashes[i]) in self.copies for i in range(lo, hi))

        for n in range(min(max_blocks, len(hashes)), -1, -1):
            if all(
                held(g, 0, n) if w is None else held(g, max(0, n - max(1, -(-(w - 1) // self.bs))), n)
                for g, (_, w) in enumerate(self.groups)
            ):
                return n
        return 0


class HybridPoolMachine(RuleBasedStateMachine):
    """Hybrid groups: the native manager equals the spec in results, events, free queue, block
    states, per-group tables and snapshots; allocate and hit_blocks equal the rule read off
    the event stream; every removal removes a stored copy; a snapshot replays to the copies."""

    @initialize(
        num_blocks=st.integers(6, 24), block_size=st.integers(1, 3), groups=st.sampled_from(GROUP_CONFIGS),
        segments=st.sampled_from([None, None, 0, 2, 3]),
    )
    def setup(self, num_blocks, block_size, groups, segments):
        self.bs, self.groups = block_size, groups
        retention = None if segments is None else segments * block_size
        self.mgr = NativeKVCacheManager(num_blocks, block_size, groups=groups, retention_interval=retention)
        self.spec = PyKVCacheManager(num_blocks, block_size, groups=groups, retention_interval=retention)
        self.view = CopyView(groups, block_size, sparse=retention is not None)
        self.reqs = {}  # rid -> (tokens, lora_name)
        self.next_id = 0

    def _sync(self):
        events = self.mgr.take_events()
        assert events == self.spec.take_events()
        self.view.apply_all(events)

    def _both(self, method, *args, **kwargs):
        got = getattr(self.mgr, method)(*args, **kwargs)
        assert got == getattr(self.spec, method)(*args, **kwargs), method
        return got

    @precondition(lambda self: len(self.reqs) < 5)
    @rule(prompt=prompt_st, lora=lora_st)
    def allocate(self, prompt, lora):
        rid = f"r{self.next_id}"
        self.next_id += 1
        lora_name, lora_id = lora
        hashes = chain(prompt, self.bs, lora_name)
        expected = self.view.hit(hashes, (len(prompt) - 1) // self.bs)
        assert self._both("hit_blocks", prompt, lora_name=lora_name) == expected
        fits = self._both("can_allocate", prompt, lora_name=lora_name)
        got = self._both("allocate", rid, prompt, lora_name=lora_name, lora_id=lora_id)
        assert (got is not None) == fits, "can_allocate said otherwise"
        if got is not None:
            assert got == expected * self.bs
            self.reqs[rid] = (list(prompt), lora_name)
        self._sync()

    @precondition(lambda self: 0 < len(self.reqs) < 5)
    @rule(data=st.data())
    def fork(self, data):
        tokens, lora_name = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        self.allocate(list(tokens), (lora_name, None))

    def _append(self, rid, new):
        if self._both("append", rid, new):
            self.reqs[rid][0].extend(new)
        else:  # out of blocks: preempt, as an engine would
            self._both("free", rid)
            del self.reqs[rid]

    @precondition(lambda self: len(self.reqs) > 0)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), max_size=6))
    def append(self, data, new):
        self._append(data.draw(st.sampled_from(sorted(self.reqs))), new)
        self._sync()

    @precondition(lambda self: len(self.reqs) > 1)
    @rule(new=st.lists(st.integers(0, 1), min_size=1, max_size=3))
    def decode_step(self, new):
        for rid in sorted(self.reqs):
            self._append(rid, new)
        self._sync()

    @precondition(lambda self: len(self.reqs) > 0)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self._both("free", rid)
        del self.reqs[rid]
        self._sync()

    @precondition(lambda self: len(self.reqs) <= 1)
    @rule()
    def reset(self):
        self._both("reset")
        self._sync()

    @invariant()
    def same_state(self):
        pool, spec = self.mgr.pool, self.spec.pool
        assert pool.free_block_ids() == spec.free_block_ids()
        assert pool.cached_block_hashes() == spec.cached_block_hashes()
        assert pool.num_cached_blocks == spec.num_cached_blocks == len(self.view.copies)
        states = [(b.ref_cnt, b.block_hash) for b in pool.blocks]
        assert states == [(b.ref_cnt, b.block_hash) for b in spec.blocks]
        # Every copy the stream announced is a block holding that hash.
        assert sum(self.view.copies.values()) == sum(h is not None for _, h in states)
        for rid, (tokens, _) in self.reqs.items():
            assert self.mgr.get_group_block_ids(rid) == self.spec.get_group_block_ids(rid)
            assert self.mgr.num_tokens(rid) == len(tokens)

    @invariant()
    def snapshot_replays_to_the_copies(self):
        snap = self.mgr.snapshot()
        assert snap == self.spec.snapshot()
        assert CopyView(self.groups, self.bs).apply_all(snap).copies == self.view.copies  # dense shape


HybridPoolMachine.TestCase.settings = settings(
    PoolMachine.TestCase.settings, max_examples=200
)
TestHybridPoolStateMachine = HybridPoolMachine.TestCase


def test_longest_hit_is_the_coordinators_fixed_point():
    # HybridKVCacheCoordinator.find_longest_cache_hit repeats over the groups until none cuts
    # the hit back: group 2 (k=2) cuts 5 to 3, then group 1 (k=1) no longer holds block 2.
    pool = BlockPool(16, 1, groups=[("full_attention", None), ("sliding_window", 2), ("sliding_window", 3)])
    hashes = [11, 12, 13, 14, 15]
    for g, held in [(0, range(5)), (1, [0, 1, 4]), (2, [0, 1, 2])]:
        for i in held:
            pool.cache_full_blocks(pool.get_new_blocks(1), [hashes[i]], [i], group_idx=g)
    assert [pool.window_blocks(g) for g in range(3)] == [0, 1, 2]
    assert pool.longest_hit(hashes, 5) == 2
    assert pool.longest_hit(hashes, 1) == 1 and pool.longest_hit([99], 1) == 0


def test_sparse_retention_keeps_window_tails_at_the_replay_boundary_and_the_junction(Manager):
    # vLLM's default prefix_cache_retention_interval=0: a window group caches only the k blocks
    # before each reachable boundary (SlidingWindowManager.reachable_block_mask): the prompt's
    # num_tokens - 1, and a shared-prefix junction found at admission. W=4, block size 2: k=2.
    m = Manager(32, 2, groups=HYBRID, retention_interval=0)
    prompt = list(range(1, 12))  # 5 full blocks and one token: boundary 10 -> block 5
    h = chain(prompt, 2)
    m.allocate("a", prompt)
    full, window = m.take_events()
    assert full.block_hashes == h and window.block_hashes == h[3:5]
    assert window.token_ids == prompt[:10] and window.parent_block_hash is None  # every token
    m.append("a", [0, 0, 0, 0])  # decode blocks are past every boundary: not kept
    assert [len(e.block_hashes) for e in stored(m.take_events())] == [2, 0]
    # A snapshot lists what is held, in the dense shape.
    ha = chain(prompt + [0] * 4, 2)
    assert [(e.group_idx, e.block_hashes, e.parent_block_hash) for e in m.snapshot()] == [
        (0, ha[:5], None), (0, ha[5:], ha[4]), (1, h[3:5], h[2])
    ]
    # A sibling sharing 3 blocks: group 1 lacks blocks 1-2, so no hit -- but group 0 ran to
    # block 3, a junction (shared_prefix_boundary) whose window tail the sibling now keeps.
    sibling = prompt[:6] + [90, 91, 92]
    assert m.allocate("b", sibling) == 0
    window = stored(m.take_events())[1]
    assert window.block_hashes == chain(sibling, 2)[1:3] + chain(sibling, 2)[3:4]
    assert m.hit_blocks(prompt[:6] + [50, 51]) == 3


def test_periodic_retention_and_its_validation(Manager):
    m = Manager(32, 1, groups=[("full_attention", None), ("sliding_window", 3)], retention_interval=4)
    m.allocate("a", list(range(1, 11)))  # k=2: the last 2 of every 4 blocks, and before 9
    window = stored(m.take_events())[1]
    assert window.block_hashes == [chain(list(range(1, 11)), 1)[i] for i in (2, 3, 6, 7, 8)]
    assert m.retention_interval == 4
    for bad, message in [
        (dict(retention_interval=0), "needs groups"),
        (dict(groups=HYBRID, retention_interval=3), r"multiple of block_size \(2\), got 3"),
        (dict(groups=HYBRID, retention_interval=-2), "got -2"),
        (dict(groups=HYBRID, retention_interval=True), "got True"),
    ]:
        with pytest.raises(ValueError, match=message):
            Manager(8, 2, **bad)
        assert outcome(lambda: NativeKVCacheManager(8, 2, **bad)) == outcome(lambda: PyKVCacheManager(8, 2, **bad))


def test_hybrid_snapshot_from_another_thread_while_the_engine_mutates(Manager):
    groups = [("full_attention", None), ("sliding_window", 6)]
    m = Manager(48, 2, groups=groups, retention_interval=0)
    stop = threading.Event()
    steps, errors = [], []

    def engine():
        try:
            i = 0
            while not (i and stop.is_set()):  # at least one step, however the threads run
                rid = i % 6
                if rid in m:
                    m.free(rid)
                if m.allocate(rid, [i % 4] * 6 + list(range(i % 9))) is not None:
                    m.append(rid, [1, 2, 3])
                i += 1
                steps.append(i)
        except Exception as exc:  # noqa: BLE001 -- reported below, not lost in the thread
            errors.append(exc)

    t = threading.Thread(target=engine)
    t.start()
    try:
        # CopyView checks every event of each snapshot: each is a consistent state.
        views = [CopyView(groups, 2).apply_all(m.snapshot()) for _ in range(100)]
    finally:
        stop.set()
        t.join()
    assert not errors and steps and len(views) == 100


# --- take_record: the events kept native, written as msgpack from the record -----------------------


def _workload(m, rnd, steps):
    """Allocate/append/free at random; yields after every step (for the caller to take its events)."""
    running = []
    for step in range(steps):
        for _ in range(rnd.randint(0, 2)):
            lora = rnd.choice([None, None, "ada"]) if m.groups is None else None
            if m.allocate(step * 10 + len(running), [rnd.randrange(1 << 17) for _ in range(rnd.randint(1, 40))],
                          lora_name=lora) is not None:  # fmt: skip
                running.append(step * 10 + len(running))
        for r in list(running):
            if rnd.random() < 0.3 or not m.append(r, [rnd.randrange(1 << 17) for _ in range(rnd.randint(1, 6))]):
                m.free(r)
                running.remove(r)
        if step % 17 == 16 and not running:
            m.reset()
        yield


@pytest.mark.parametrize("medium", ["GPU", None, "a-medium-name-over-31-bytes-long-for-str8"])
@pytest.mark.parametrize("groups", [None, HYBRID])
def test_a_record_is_what_take_events_gives_and_encodes_to_the_same_bytes(medium, groups):
    import random

    from kvbridge._native import EventRecord, encode_records

    # Two managers driven alike: one drained by take_events, the other by take_record.
    a = NativeKVCacheManager(24, 2, medium=medium, groups=groups)
    b = NativeKVCacheManager(24, 2, medium=medium, groups=groups)
    written = left = 0
    for _ in zip(_workload(a, random.Random(5), 300), _workload(b, random.Random(5), 300)):
        events, rec = a.take_events(), b.take_record()
        assert isinstance(rec, EventRecord) and len(rec) == len(events)
        assert rec.events() == events and rec.events() == events  # a record can be read again
        assert rec.n_blocks == sum(len(getattr(e, "block_hashes", ())) for e in events)
        for rank in (None, 0, 5, -1, 1 << 40):
            payload = encode_records([rec], 12.5, rank)
            if payload is None:  # a LoRA's or a hybrid pool's events: left to the caller, never other bytes
                left += 1
                assert groups is not None or any(getattr(e, "lora_name", None) for e in events)
            else:
                written += 1
                assert payload == encode_batch(KVEventBatch(12.5, events, rank))
    assert b.take_record().events() == [] and len(b.take_record()) == 0
    assert left > 0 and (written > 0) == (groups is None)


def test_records_encode_together_as_one_batch_of_their_events():
    from kvbridge._native import encode_records

    m = NativeKVCacheManager(4, 2)
    m.allocate("a", [1, 2, 3, 4, 5])
    first = m.take_record()
    m.free("a")
    m.allocate("b", [9, 8, 7, 6, 5, 4, 3])  # evicts a's cached blocks
    second = m.take_record()
    assert m.reset() is False
    events = first.events() + second.events()
    assert any(isinstance(e, BlockRemoved) for e in events)
    assert encode_records([first, second], 3.0, None) == encode_batch(KVEventBatch(3.0, events))
    assert encode_records([], 3.0, 2) == encode_batch(KVEventBatch(3.0, [], 2))
    with pytest.raises(TypeError):
        encode_records([first, events[0]], 3.0, None)  # type: ignore[list-item]
