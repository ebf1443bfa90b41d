"""kvbridge.Index for hybrid-attention engines (several KV-cache groups), media, locality,
physical copies and token-less placeholders: hand-written cases, then random streams against a
plain-Python model of the rules (SPEC-hybrid, "Residency key" .. "Sparse window/mamba groups").

vLLM 0.33 is the reference for the hit rule: v1/core/kv_cache_coordinator.py
``HybridKVCacheCoordinator.find_longest_cache_hit`` (a fixed point over the groups),
v1/core/single_type_kv_cache_manager.py ``SlidingWindowManager.find_longest_cache_hit`` /
``_contiguous_blocks_for_hit`` (cdiv(W - 1, block_size) contiguous blocks, fewer at the start) and
``MambaManager.find_longest_cache_hit`` (the last block of the hit must be held: a window of one
block). Copies: v1/core/block_pool.py ``cache_full_blocks`` (no de-duplication) and
``emit_cached_block_events`` (the full-report re-announce).

Groups of larger blocks (a multiple m of the hash block size): v1/core/kv_cache_utils.py
``BlockHashListWithBlockSize`` (a group block is keyed by the hash of its last hash block) and
``resolve_kv_cache_block_sizes`` (scheduler_block_size = lcm of the groups' block sizes);
kv_cache_coordinator.py ``HybridKVCacheCoordinator._cache_hit_alignment_tokens`` (hits aligned
to it unless fine-grained partial hits are on) and the managers' ``find_longest_cache_hit``
(``FullAttentionManager``: ``hit_length -= hit_length % alignment_tokens``;
``SlidingWindowManager`` / ``MambaManager``: a held block counts as a hit's end only when
``(i + 1) * block_size % alignment_tokens == 0``).
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge import AllBlocksCleared, BlockRemoved, BlockStored, Index, KVEventBatch, encode_batch, hash_blocks

MAIN_KINDS = ("full_attention", "mla_attention", "sink_full_attention")
WINDOW_KINDS = ("sliding_window", "sliding_window_mla")
UNSCORED_KINDS = ("chunked_local_attention", "encoder_only_attention", "cross_attention", "unknown")


def stored(hashes, tokens, *, bs, parent=None, group=None, kind=None, window=None, medium="GPU", locality=None):
    return BlockStored(
        block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens), block_size=bs,
        lora_id=None, medium=medium, lora_name=None, group_idx=group, kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window, locality=locality,
    )  # fmt: skip


def removed(hashes, *, group=None, medium="GPU", locality=None):
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group, locality=locality)


def batch(*events):
    return KVEventBatch(ts=0.0, events=list(events))


# --- hand-written cases ----------------------------------------------------------------------

PROMPT = list(range(100, 116))  # 4 blocks of 4
ENGINE = [11, 12, 13, 14]


def issue_index(key: str) -> Index:
    """The issue's example: group 0 full attention, group 1 a sliding window of 4 tokens (one block
    of 4 needed), the same 4-block prompt stored in both."""
    idx = Index(block_size=4, key=key)
    idx.apply("w", batch(
        stored(ENGINE, PROMPT, bs=4, group=0, kind="full_attention"),
        stored(ENGINE, PROMPT, bs=4, group=1, kind="sliding_window", window=4),
    ))  # fmt: skip
    return idx


def query(idx: Index, **kw):
    if idx.key == "engine":
        return idx.find_matches(block_hashes=ENGINE, **kw)
    return idx.find_matches(PROMPT, **kw)


@pytest.mark.parametrize("key", ["tokens", "engine"])
def test_a_window_group_needs_only_its_window(key):
    idx = issue_index(key)
    assert query(idx) == {"w": 4}
    idx.apply("w", batch(removed([12, 13], group=1)))
    assert query(idx) == {"w": 4}  # vLLM: block 3 alone covers a window of 4 tokens
    idx.apply("w", batch(removed([14], group=1)))
    # The window group now holds block 0 only: vLLM's hit is 1 block (the first
    # num_contiguous_blocks count even when fewer than the window needs).
    assert query(idx) == {"w": 1}
    idx.apply("w", batch(removed([11], group=0)))
    assert query(idx) == {}  # the full group lost block 0: no hit at all
    assert idx.stats["blocks_removed"] == 4 and idx.stats["unknown_removes"] == 0


@pytest.mark.parametrize("key", ["tokens", "engine"])
def test_a_wider_window_and_a_second_window_group(key):
    idx = issue_index(key)
    # Group 2: a window of 9 tokens (cdiv(8, 4) = 2 blocks), holding blocks 0 and 2 only.
    idx.apply("w", batch(stored([11, 13], PROMPT[:12], bs=4, group=2, kind="sliding_window", window=9)))
    # n=4 needs blocks 2, 3 in group 2 (no 3); n=3 needs 1, 2 (no 1); n=2 needs 0, 1; n=1 needs 0.
    assert query(idx) == {"w": 1}
    idx.apply("w", batch(stored([14], PROMPT[:16], bs=4, parent=13, group=2, kind=None)))
    assert query(idx) == {"w": 4}


@pytest.mark.parametrize("key", ["tokens", "engine"])
def test_mamba_is_a_window_of_one_block(key):
    idx = Index(block_size=4, key=key)
    idx.apply("w", batch(
        stored(ENGINE, PROMPT, bs=4, group=0, kind="full_attention"),
        stored([12], PROMPT[:8], bs=4, group=1, kind="mamba"),  # sparse: the state at block 1
    ))  # fmt: skip
    assert query(idx) == {"w": 2}
    # An unscored kind is kept, never scored.
    idx.apply("w", batch(stored([], PROMPT, bs=4, group=2, kind="encoder_only_attention")))
    assert query(idx) == {"w": 2}
    assert idx.stats["unscored_group_events"] == 1


@pytest.mark.parametrize("key", ["tokens", "engine"])
def test_two_copies_need_two_removals(key):
    idx = Index(block_size=4, key=key)
    first = stored(ENGINE[:2], PROMPT[:8], bs=4)
    idx.apply("w", batch(first, stored(ENGINE[2:], PROMPT[8:], bs=4, parent=12)))
    # The chain is recomputed after an eviction left a hole: block 1 is stored again.
    idx.apply("w", batch(removed([11]), stored([11], PROMPT[:4], bs=4)))
    idx.apply("w", batch(stored([12], PROMPT[4:8], bs=4, parent=11)))
    assert query(idx) == {"w": 4}
    idx.apply("w", batch(removed([12])))
    assert query(idx) == {"w": 4}  # one copy of block 1 left
    idx.apply("w", batch(removed([12])))
    assert query(idx) == {"w": 1}
    idx.apply("w", batch(removed([12])))
    assert idx.stats["unknown_removes"] == 1


@pytest.mark.parametrize("key", ["tokens", "engine"])
def test_a_full_report_re_announce_is_not_a_copy(key):
    idx = Index(block_size=4, key=key)
    chain = stored(ENGINE, PROMPT, bs=4)
    idx.apply("w", batch(chain))
    # kv_cache_report_mode="full": reused blocks re-sent from block 0, parent None.
    idx.apply("w", batch(chain, stored(ENGINE[:2], PROMPT[:8], bs=4)))
    idx.apply("w", batch(removed([13])))
    assert query(idx) == {"w": 2}
    # Not all held (block 2 is gone): a real store, every block a copy more.
    idx.apply("w", batch(chain, removed([11])))
    assert query(idx) == {"w": 4}
    idx.apply("w", batch(removed([11, 13])))
    assert query(idx) == {}
    # In another group the same chain is no re-announce: each group keeps its own copies.
    idx.apply("w", batch(stored(ENGINE, PROMPT, bs=4, group=3, kind="full_attention")))
    assert query(idx) == {}  # group 3 is a main group now, and group 0 lacks block 0


@pytest.mark.parametrize("key", ["tokens", "engine"])
def test_in_a_hybrid_worker_a_chain_stored_again_from_block_0_is_a_copy(key):
    """vLLM's window group cut the hit to 0 while the full group held the chain: it recomputes
    and stores a second physical copy, parent None, every block already held -- the shape of a
    re-announce. With a window group known (or named in the same payload) it counts."""
    idx = Index(block_size=4, key=key)
    full = stored(ENGINE, PROMPT, bs=4, group=0, kind="full_attention")
    window = stored(ENGINE[3:], PROMPT, bs=4, group=1, kind="sliding_window", window=4)  # sparse: the tail
    idx.apply("w", batch(full, window))
    idx.apply("w", batch(full))  # the recompute's second copy
    idx.apply("w", batch(removed(ENGINE, group=0)))  # the first copy evicted
    assert query(idx) == {"w": 4}  # the second still holds
    idx.apply("w", batch(removed(ENGINE, group=0)))
    assert query(idx) == {}
    # A snapshot lists group 0's chains first: the payload's window group counts already.
    late = Index(block_size=4, key=key)
    late.apply("w", batch(full, full, window))
    late.apply("w", batch(removed(ENGINE, group=0)))
    assert query(late) == {"w": 4}


@pytest.mark.parametrize("key", ["tokens", "engine"])
def test_placeholders_count_in_their_medium(key):
    idx = Index(block_size=4, key=key)
    idx.apply("w", batch(stored(ENGINE, PROMPT, bs=4, group=0, kind="full_attention")))
    # The offload connector: one hash each, no tokens, block_size 0, medium CPU.
    idx.apply("w", batch(*(stored([h], [], bs=0, group=0, medium="CPU") for h in ENGINE[:3])))
    idx.apply("w", batch(stored([999], [], bs=0, group=0, medium="CPU")))
    assert query(idx, medium="CPU") == {"w": 3}
    assert query(idx, by_medium=True) == {"w": {"GPU": 4, "CPU": 3}}
    idx.apply("w", batch(removed(ENGINE, group=0, medium="GPU")))
    assert query(idx) == {"w": 3}  # CPU keeps the first three
    assert idx.stats["block_size_mismatches"] == 0
    assert idx.stats["unresolved_placeholders"] == (1 if key == "tokens" else 0)


def test_a_placeholder_nobody_stored_with_tokens_is_counted_and_skipped():
    idx = Index(block_size=4)
    idx.apply("w", batch(stored([5, 6], [], bs=0, medium="CPU")))
    assert idx.stats["unresolved_placeholders"] == 2 and len(idx) == 0


def test_sparse_window_hashes_resolve_through_the_main_group():
    idx = Index(block_size=4)
    idx.apply("w", batch(
        stored(ENGINE, PROMPT, bs=4, group=0, kind="full_attention"),
        # The window group retains blocks 2 and 3 only; its tokens cover all four blocks.
        stored([13, 14], PROMPT, bs=4, group=1, kind="sliding_window", window=8),
        stored([77], PROMPT, bs=4, group=1, kind=None),  # a hash nobody stored: counted, skipped
    ))  # fmt: skip
    assert idx.find_matches(PROMPT) == {"w": 4}
    assert idx.stats["unresolved_hashes"] == 1 and idx.stats["block_size_mismatches"] == 0
    # The same shape in a main group is a mismatch, as before.
    idx.apply("w", batch(stored([13], PROMPT, bs=4, group=0)))
    assert idx.stats["block_size_mismatches"] == 1


@pytest.mark.parametrize("key", ["tokens", "engine"])
def test_remote_copies_count_only_when_asked(key):
    idx = Index(block_size=4, key=key)
    idx.apply("w", batch(stored(ENGINE[:2], PROMPT[:8], bs=4)))
    idx.apply("w", batch(stored(ENGINE, PROMPT, bs=4, medium="STORAGE", locality="REMOTE")))
    assert query(idx) == {"w": 2}
    assert query(idx, remote=True) == {"w": 4}
    assert query(idx, medium="STORAGE") == {}
    assert query(idx, medium="STORAGE", remote=True) == {"w": 4}
    assert query(idx, by_medium=True, remote=True) == {"w": {"GPU": 2, "STORAGE": 4}}
    # A removal names its locality: a local one leaves the remote copy alone.
    idx.apply("w", batch(removed([11], medium="STORAGE")))
    assert idx.stats["unknown_removes"] == 1
    idx.apply("w", batch(removed([11], medium="STORAGE", locality="REMOTE")))
    assert query(idx, medium="STORAGE", remote=True) == {}
    assert query(idx, remote=True) == {"w": 4}  # block 0 on the GPU, the rest remote


def test_by_medium_names_the_medium_none_and_leaves_out_zeros():
    idx = Index(block_size=4, key="engine")
    idx.apply("w", batch(stored(ENGINE, PROMPT, bs=4, medium=None), stored([99], PROMPT[:4], bs=4, medium="CPU")))
    idx.apply("v", batch(stored(ENGINE[:1], PROMPT[:4], bs=4, medium="CPU")))
    assert idx.find_matches(block_hashes=ENGINE, by_medium=True) == {"w": {None: 4}, "v": {"CPU": 1}}
    assert idx.find_matches(block_hashes=ENGINE, by_medium=True, medium="CPU") == {"v": {"CPU": 1}}
    assert idx.find_matches(block_hashes=[5], by_medium=True) == {}


def test_clearing_forgets_the_groups_kinds():
    idx = issue_index("engine")
    idx.apply("w", batch(removed([14], group=1)))
    assert query(idx) == {"w": 3}  # block 2 is the window group's last
    idx.apply("w", batch(AllBlocksCleared(), stored(ENGINE, PROMPT, bs=4)))
    assert query(idx) == {"w": 4}  # a single-group worker again


def test_hybrid_and_plain_workers_past_one_word_of_bits():
    idx = Index(block_size=4, key="engine")
    want = {}
    for w in range(150):
        n = 1 + w % 4
        evs = [stored(ENGINE[:n], PROMPT[: 4 * n], bs=4, group=0, kind="full_attention")]
        if w % 3 == 0:  # hybrid: its window group (1 block) holds block 0 only
            evs.append(stored(ENGINE[:1], PROMPT[: 4 * n], bs=4, group=1, kind="sliding_window", window=3))
        idx.apply(f"w{w}", batch(*evs))
        want[f"w{w}"] = 1 if w % 3 == 0 else n
    assert query(idx) == want
    assert query(idx, by_medium=True) == {w: {"GPU": n} for w, n in want.items()}
    idx.remove_worker("w0")
    idx.apply("w0", batch(stored(ENGINE, PROMPT, bs=4)))  # the id again, now a single-group worker
    assert query(idx)["w0"] == 4


# --- groups of larger blocks ------------------------------------------------------------------
# A group whose block size is m times the index's: its block i is keyed by the hash of its last
# hash block, ENGINE[(i + 1) * m - 1] (kv_cache_utils.py ``BlockHashListWithBlockSize``), and a
# hit is a multiple of the lcm of all groups' sizes (``resolve_kv_cache_block_sizes``:
# scheduler_block_size; ``HybridKVCacheCoordinator._cache_hit_alignment_tokens``).


def prefix(idx: Index, n: int, **kw):
    """find_matches for the first n blocks of PROMPT."""
    if idx.key == "engine":
        return idx.find_matches(block_hashes=ENGINE[:n], **kw)
    return idx.find_matches(PROMPT[: 4 * n], **kw)


def coarse_index(key: str, window: int) -> Index:
    """PROMPT in group 0 (full attention, the index's 4-token blocks) and in group 1, a sliding
    window of ``window`` tokens over 8-token blocks keyed by the hashes of blocks 1 and 3."""
    idx = Index(block_size=4, key=key)
    idx.apply("w", batch(
        stored(ENGINE, PROMPT, bs=4, group=0, kind="full_attention"),
        stored([12, 14], PROMPT, bs=8, group=1, kind="sliding_window", window=window),
    ))  # fmt: skip
    return idx


@pytest.mark.parametrize("key", ["tokens", "engine"])
def test_a_window_group_of_larger_blocks_counts_its_window_in_its_own_blocks(key):
    # W = 9: cdiv(8, 8) = 1 block of 8 (2 of the index's 4-token blocks had it been read at 4).
    idx = coarse_index(key, 9)
    assert query(idx) == {"w": 4}
    assert idx.stats["block_size_mismatches"] == 0
    idx.apply("w", batch(removed([14], group=1)))
    # n = 4 needs the group's block 1 (hash 14); n = 3 is no end of its blocks; n = 2 needs its
    # block 0 (hash 12). Before, the group's events were mismatches and the answer was 4.
    assert query(idx) == {"w": 2}
    assert prefix(idx, 3) == {"w": 2} and prefix(idx, 1) == {}
    idx.apply("w", batch(stored([14], PROMPT[8:], bs=8, parent=12, group=1), removed([14], group=0)))
    # The full group holds 3 blocks: the hit is aligned down to the window group's 2.
    assert query(idx) == {"w": 2}


@pytest.mark.parametrize("key", ["tokens", "engine"])
def test_a_hit_is_a_multiple_of_every_groups_block_size(key):
    idx = coarse_index(key, 4)
    assert query(idx) == {"w": 4}
    # An unscored group of 12-token blocks: vLLM aligns hits to lcm(4, 8, 12) = 24 tokens, 6
    # blocks, more than the prompt has.
    idx.apply("w", batch(stored([13], PROMPT[:12], bs=12, group=2, kind="cross_attention")))
    assert query(idx) == {}
    # Forgotten with the worker's cache: a single-group worker again.
    idx.apply("w", batch(AllBlocksCleared(), stored(ENGINE[:3], PROMPT[:12], bs=4)))
    assert prefix(idx, 3) == {"w": 3}


@pytest.mark.parametrize("key", ["tokens", "engine"])
def test_a_full_group_of_larger_blocks_hits_only_at_its_block_ends(key):
    idx = Index(block_size=4, key=key)
    idx.apply("w", batch(stored([12, 14], PROMPT, bs=8)))  # one group (group 0) of 8-token blocks
    idx.apply("v", batch(stored(ENGINE, PROMPT, bs=4)))
    assert query(idx) == {"w": 4, "v": 4}
    assert prefix(idx, 3) == {"w": 2, "v": 3} and prefix(idx, 1) == {"v": 1}
    # vLLM's partial-tail entry (FullAttentionManager._cache_partial_tail_block): a store of one
    # hash block in the group. Kept as the group's block, its size not the group's.
    idx.apply("w", batch(stored([13], PROMPT[8:12], bs=4, parent=12)))
    assert prefix(idx, 3) == {"w": 2, "v": 3}
    idx.apply("w", batch(removed([13]), removed([14])))
    assert idx.stats["blocks_removed"] == 2 and idx.stats["unknown_removes"] == 0
    assert query(idx) == {"w": 2, "v": 4}
    idx.apply("w", batch(removed([12])))
    assert query(idx) == {"v": 4}


def test_larger_blocks_with_extra_keys_are_placed_through_the_engine_hashes():
    """key="tokens": a larger block's extra keys (a multimodal item's offset from the block's
    start) cannot be split into the index's blocks; the hashes stand for what the worker stored
    under them with tokens, as for sparse groups."""
    idx = Index(block_size=4)
    mm = BlockStored(block_hashes=[12, 14], parent_block_hash=None, token_ids=PROMPT, block_size=8, lora_id=None,
                     medium="GPU", lora_name=None, extra_keys=[("img", 3), None], group_idx=1,
                     kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4)  # fmt: skip
    idx.apply("w", batch(stored(ENGINE, PROMPT, bs=4, group=0, kind="full_attention"), mm))
    assert idx.find_matches(PROMPT) == {"w": 4}
    assert idx.stats["unresolved_hashes"] == 0
    idx.apply("v", batch(stored(ENGINE, PROMPT, bs=4, group=0, kind="full_attention")))
    idx.apply("u", batch(mm))  # nobody stored 12 or 14 with tokens on u: counted, skipped
    assert idx.find_matches(PROMPT) == {"w": 4, "v": 4}
    assert idx.stats["unresolved_hashes"] == 2


BAD_SIZES = [0, 6, -4, 8 * 4096 + 4, 4 * 8192, 2**40, 2**63 - 1]


@pytest.mark.parametrize("key", ["tokens", "engine"])
@pytest.mark.parametrize("size", BAD_SIZES)
def test_a_bad_block_size_is_counted_and_skipped(key, size):
    """0 with tokens (not a placeholder), not a multiple of the index's, negative, over 4096 of
    its blocks: the store is a block-size mismatch, teaches the group nothing, removes nothing."""
    idx = coarse_index(key, 4)
    blocks = len(idx)
    bad = raw({"block_hashes": [14], "token_ids": PROMPT, "block_size": size, "group_idx": 1,
               "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 4})  # fmt: skip
    assert idx.apply("w", bad) == 1
    assert idx.stats["block_size_mismatches"] == 1 and idx.stats["malformed_payloads"] == 0
    assert len(idx) == blocks and query(idx) == {"w": 4}
    assert idx.stats["blocks_removed"] == 0 and idx.stats["unknown_removes"] == 0
    idx.apply("w", batch(removed([14], group=1)))
    assert query(idx) == {"w": 2}, "the group is still read at 8 tokens a block"


def test_a_block_size_past_64_bits_drops_the_payload_counted():
    idx = Index(block_size=4)
    assert idx.apply("w", raw({"block_size": 2**70})) == 0
    assert idx.stats["malformed_payloads"] == 1 and len(idx) == 0


def raw(event: dict) -> bytes:
    base = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
            "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip
    return json.dumps([0.0, [{**base, **event}]]).encode()


BAD = [
    ({"group_idx": -1}, "bad_groups"),
    ({"group_idx": 64}, "bad_groups"),
    ({"group_idx": 2**70}, "bad_groups"),
    ({"group_idx": True}, "bad_groups"),
    ({"group_idx": 1.0}, "bad_groups"),
    ({"group_idx": "1"}, "bad_groups"),
    ({"group_idx": [1]}, "bad_groups"),
    ({"group_idx": 1, "kv_cache_spec_kind": "full_attention_v2"}, "unknown_kinds"),
    ({"group_idx": 1, "kv_cache_spec_kind": ""}, "unknown_kinds"),
    ({"group_idx": 1, "kv_cache_spec_kind": 7}, "unknown_kinds"),
    ({"group_idx": 1, "kv_cache_spec_kind": "sliding_window"}, "bad_windows"),
    ({"group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": None}, "bad_windows"),
    ({"group_idx": 1, "kv_cache_spec_kind": "sliding_window_mla", "kv_cache_spec_sliding_window": 0}, "bad_windows"),
    ({"group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": -4}, "bad_windows"),
    ({"group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": "4"}, "bad_windows"),
    ({"group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 4.0}, "bad_windows"),
]


@pytest.mark.parametrize("key", ["tokens", "engine"])
@pytest.mark.parametrize(("fields", "counter"), BAD)
def test_bad_group_kind_or_window_is_counted_and_skipped(key, fields, counter):
    idx = Index(block_size=4, key=key)
    idx.apply("w", raw({"block_hashes": [1], "token_ids": [1, 2, 3, 4]}))
    before = idx.find_matches(block_hashes=[1]) if key == "engine" else idx.find_matches([1, 2, 3, 4])
    # The bad store, then a removal of the same block with the same bad group where it has one.
    assert idx.apply("w", raw(fields)) == 1
    if fields.get("group_idx", 0) not in range(64) or isinstance(fields.get("group_idx"), bool):
        remove = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": fields["group_idx"]}
        assert idx.apply("w", json.dumps([0.0, [remove]]).encode()) == 1
    after = idx.find_matches(block_hashes=[1]) if key == "engine" else idx.find_matches([1, 2, 3, 4])
    assert before == after == {"w": 1}
    stats = idx.stats
    assert stats[counter] >= 1 and stats["malformed_payloads"] == 0
    assert stats["blocks_removed"] == 0 and stats["unknown_removes"] == 0
    # The bad kind taught the group nothing: group 1 stays unannounced (unscored).
    idx.apply("w", raw({"block_hashes": [2], "group_idx": 1}))
    assert (idx.find_matches(block_hashes=[1]) if key == "engine" else idx.find_matches([1, 2, 3, 4])) == {"w": 1}


def test_msgpack_and_json_carry_the_same_groups():
    ev = stored(ENGINE[1:], PROMPT, bs=4, group=5, kind="sliding_window", window=5, medium="CPU", locality="REMOTE")
    for fmt in ("msgpack", "json"):
        idx = Index(block_size=4, key="engine")
        idx.apply("w", encode_batch(batch(stored(ENGINE, PROMPT, bs=4, group=0, kind="full_attention")), fmt))
        idx.apply("w", encode_batch(batch(ev), fmt))
        assert query(idx, remote=True) == {"w": 4}
        # Its remote copies not credited, the window group holds nothing: no hit.
        assert query(idx) == {}
        idx.apply("w", encode_batch(batch(removed([14], group=5, medium="CPU", locality="REMOTE")), fmt))
        assert query(idx, remote=True) == {"w": 3}, fmt  # n=4 needs block 3 (cdiv(4, 4) = 1 block)


def test_positional_events_have_no_group():
    idx = Index(block_size=4, key="engine")
    payload = json.dumps([0.0, [["BlockStored", ENGINE, None, PROMPT, 4, None, "GPU", None]]]).encode()
    idx.apply("w", payload)
    assert query(idx) == {"w": 4}


def test_bad_arguments_name_the_argument():
    idx = Index(block_size=4)
    with pytest.raises(TypeError, match="by_medium"):
        idx.find_matches(PROMPT, by_medium=1)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="remote"):
        idx.find_matches(PROMPT, remote="yes")  # type: ignore[call-overload]


# --- random streams against the model --------------------------------------------------------

BS = 2
DOCS = [list(range(1, 13)), [1, 2, 3, 4, 50, 60, 70, 80, 90, 91], [7] * 8, list(range(200, 224))]
MAX_SCALE = 4096  # the largest group block size, in index blocks, the index accepts
MEDIA = ["GPU", "CPU", None]


def ehash(doc: int, block: int) -> int:
    """One engine hash per (document, block), shared by all groups and workers (one seed)."""
    return doc * 1000 + block + 1


def root_key(doc: int, block: int) -> int:
    return hash_blocks(DOCS[doc][: (block + 1) * BS], BS, algo="xxh3")[block]


def kind_value(kind, window):
    """What a store's kind says: 'main', ('window', tokens), 'unscored' or None; an error name."""
    if kind is None:
        return None
    if kind in MAIN_KINDS:
        return "main"
    if kind in WINDOW_KINDS:
        if not isinstance(window, int) or window < 1:
            return "bad_windows"
        return ("window", window)
    if kind == "mamba":
        return ("window", 1)  # MambaManager: the block at the hit's end, as a window of 1 token
    if kind in UNSCORED_KINDS:
        return "unscored"
    return "unknown_kinds"


class Model:
    """The spec, brute force: (worker, class) -> {engine hash: [index key, copies]} with class =
    (medium, group, remote), and per (worker, group) the kind its stores said."""

    STATS = ("blocks_stored", "blocks_removed", "unknown_removes", "unresolved_placeholders",
             "unresolved_hashes", "unscored_group_events", "block_size_mismatches", "unknown_parents")  # fmt: skip

    def __init__(self, key: str) -> None:
        self.key = key
        self.res: dict[str, dict[tuple, dict[int, list[int]]]] = {}
        self.kinds: dict[str, dict[int, object]] = {}
        # (worker, group) -> its block size in index blocks: the largest its stores announced.
        self.scales: dict[str, dict[int, int]] = {}
        self.stats = dict.fromkeys(self.STATS, 0)

    def resolve(self, w: str, cls: tuple, e: int):
        slots = self.res.get(w, {})
        for c in [cls] + [c for c in slots if c != cls]:
            if e in slots.get(c, {}):
                return slots[c][e][0]
        return None

    def store(self, w: str, ev: BlockStored) -> None:
        self.res.setdefault(w, {})
        group = ev.group_idx or 0
        kind = kind_value(ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window)
        n = len(ev.block_hashes)
        placeholder = ev.block_size == 0 and not ev.token_ids
        size = ev.block_size  # this event's blocks, in tokens
        if not placeholder and not (size > 0 and size % BS == 0 and size // BS <= MAX_SCALE):
            self.stats["block_size_mismatches"] += n > 0
            return
        if kind is not None:
            self.kinds.setdefault(w, {})[group] = kind
        if not placeholder:
            scales = self.scales.setdefault(w, {})
            scales[group] = max(scales.get(group, 1), size // BS)
        kind = self.kinds.get(w, {}).get(group)
        self.stats["unscored_group_events"] += kind == "unscored"
        if n == 0:
            return
        size = size or BS
        dense = len(ev.token_ids) == n * size
        sparse = (not dense and bool(ev.token_ids) and (kind == "unscored" or isinstance(kind, tuple))
                  and len(ev.token_ids) > n * size and len(ev.token_ids) % size == 0)  # fmt: skip
        if not (placeholder or dense or sparse):
            self.stats["block_size_mismatches"] += 1
            return
        cls = (ev.medium, group, ev.locality == "REMOTE")
        pairs = []
        if self.key == "engine":
            p = ev.parent_block_hash
            if p is not None and not any(p in slot for slot in self.res[w].values()):
                self.stats["unknown_parents"] += 1  # counted, the blocks kept
            pairs = [(e, e) for e in ev.block_hashes]
        elif dense:
            if ev.parent_block_hash is not None and self.resolve(w, cls, ev.parent_block_hash) is None:
                self.stats["unknown_parents"] += 1
                return
            # A block of m index blocks: the index hash of its last one (the engine hash of a
            # group block is that of its last hash block, so key_of holds for every size).
            pairs = [(e, self.key_of[e]) for e in ev.block_hashes]
        else:
            for e in ev.block_hashes:
                k = self.resolve(w, cls, e)
                if k is None:
                    self.stats["unresolved_placeholders" if placeholder else "unresolved_hashes"] += 1
                else:
                    pairs.append((e, k))
        slot = self.res[w].setdefault(cls, {})
        skipped = n - len(pairs)
        self.stats["blocks_stored"] += len(pairs)
        # The full-report re-announce, in a worker without window or mamba groups (with them a
        # chain stored again from block 0 is usually a real copy: docs/hybrid.md).
        plain = not any(isinstance(k, tuple) for k in self.kinds.get(w, {}).values())
        if plain and ev.parent_block_hash is None and not skipped and all(e in slot for e in ev.block_hashes):
            return
        for e, k in pairs:
            if e in slot:
                slot[e][1] += 1
            else:
                slot[e] = [k, 1]

    def remove(self, w: str, ev: BlockRemoved) -> None:
        group = ev.group_idx or 0
        self.stats["unscored_group_events"] += self.kinds.get(w, {}).get(group) == "unscored"
        slot = self.res.get(w, {}).get((ev.medium, group, ev.locality == "REMOTE"), {})
        for e in ev.block_hashes:
            if e in slot:
                slot[e][1] -= 1
                if not slot[e][1]:
                    del slot[e]
                self.stats["blocks_removed"] += 1
            else:
                self.stats["unknown_removes"] += 1

    def clear(self, w: str) -> None:
        self.res.pop(w, None)
        self.kinds.pop(w, None)
        self.scales.pop(w, None)

    def score(self, w: str, keys: list[int], medium=..., remote=False) -> int:
        """vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit`` transcribed: a fixed point
        over the groups, each group read at its own block size (scale s: its block i is index
        block (i + 1) * s - 1), lengths in index blocks, aligned to A = lcm of the scales."""

        def held(g: int, i: int) -> bool:
            return any(
                any(v[0] == keys[i] for v in slot.values())
                for (m, grp, rem), slot in self.res.get(w, {}).items()
                if grp == g and (medium is ... or m == medium) and (remote or not rem)
            )

        kinds = self.kinds.get(w, {})
        scales = self.scales.get(w, {})
        main = {g for g, k in kinds.items() if k == "main"} | ({0} if kinds.get(0) is None else set())
        windows = {g: k[1] for g, k in kinds.items() if isinstance(k, tuple)}
        if not main and not windows:
            return 0
        align = math.lcm(1, *scales.values())

        def full(g: int, hit: int) -> int:  # FullAttentionManager.find_longest_cache_hit
            s = scales.get(g, 1)
            run = 0
            while run < hit // s and held(g, (run + 1) * s - 1):
                run += 1
            return run * s - run * s % align

        def window(g: int, hit: int) -> int:  # SlidingWindowManager.find_longest_cache_hit
            s = scales.get(g, 1)
            need = -(-(windows[g] - 1) // (s * BS))  # _contiguous_blocks_for_hit
            contiguous = 0
            for i in range(hit // s - 1, -1, -1):
                if held(g, (i + 1) * s - 1):
                    if contiguous == 0 and (i + 1) * s % align:
                        continue  # not a hit's end: skipped
                    contiguous += 1
                    if contiguous >= need:
                        return (i + contiguous) * s
                else:
                    contiguous = 0
            while contiguous * s % align:
                contiguous -= 1
            return contiguous * s

        hit = len(keys)
        while True:
            cur = hit
            for g in sorted(main):
                cur = min(cur, full(g, cur))
            for g in sorted(windows):
                cur = window(g, cur)
            if cur >= hit:
                return hit
            hit = cur

    def find_matches(self, keys, medium=..., remote=False) -> dict[str, int]:
        scores = {w: self.score(w, keys, medium, remote) for w in {*self.res, *self.kinds}}
        return {w: n for w, n in scores.items() if n}

    def by_medium(self, keys, remote=False) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for m in MEDIA:
            for w, n in self.find_matches(keys, m, remote).items():
                out.setdefault(w, {})[m] = n
        return out


Model.key_of = {ehash(d, b): root_key(d, b) for d in range(len(DOCS)) for b in range(len(DOCS[d]) // BS)}


@st.composite
def group_kinds(draw):
    """Per group: the kind its stores announce, and a second kind some stores may switch to."""
    windows = st.sampled_from([1, 2, 3, 5, 8])
    return {
        0: draw(st.sampled_from([("full_attention", None), ("mla_attention", None), ("sliding_window", 4)])),
        1: ("sliding_window", draw(windows)),
        2: draw(st.sampled_from([("mamba", None), ("unknown", None), ("sliding_window_mla", 7), ("cross_attention", None)])),
    }  # fmt: skip


@st.composite
def streams(draw, n_groups: int):
    kinds = draw(group_kinds())
    # Per group its block size in index blocks (vLLM lets each group have its own): a full or
    # window group of 2 or 4 index blocks in some streams.
    scales = {0: draw(st.sampled_from([1, 1, 2])), 1: draw(st.sampled_from([1, 2, 4])), 2: draw(st.sampled_from([1, 2]))}
    ops = []
    for _ in range(draw(st.integers(1, 30))):
        w = f"w{draw(st.integers(0, 2))}"
        op = draw(st.integers(0, 19))
        if op == 0:
            ops.append(("clear", w, None))
            continue
        if op == 1:
            ops.append(("remove_worker", w, None))
            continue
        group = draw(st.integers(0, n_groups - 1))
        medium = draw(st.sampled_from(MEDIA))
        locality = draw(st.sampled_from([None, None, None, "LOCAL", "REMOTE"]))
        doc = draw(st.integers(0, len(DOCS) - 1))
        # Mostly the group's own size; sometimes one index block (vLLM's partial-tail entries
        # of a larger group are stores of one hash block) or a size the index must refuse.
        m = scales[group] if draw(st.integers(0, 5)) else 1
        size = BS * m if draw(st.integers(0, 15)) else draw(st.sampled_from([BS + 1, -BS, 2**40, BS * 8192]))
        nb = len(DOCS[doc]) // (BS * m)  # the group's blocks in the document
        if op < 8:
            blocks = draw(st.lists(st.integers(0, nb - 1), max_size=4)) if nb else []
            ev: object = removed([ehash(doc, (b + 1) * m - 1) for b in blocks], group=group, medium=medium,
                                 locality=locality)  # fmt: skip
        else:
            start = draw(st.sampled_from([0, 0, draw(st.integers(0, max(0, nb - 1)))]))
            end = draw(st.integers(start, max(start, nb)))
            blocks = list(range(start, end))
            form = draw(st.sampled_from(["dense", "dense", "sparse", "placeholder"]))
            kind, window = kinds[group] if draw(st.integers(0, 4)) else (None, None)
            group_idx = None if group == 0 and draw(st.booleans()) else group
            # A group block is keyed by the engine hash of its last hash block
            # (BlockHashListWithBlockSize); its parent is the block before's.
            if form == "placeholder":
                ev = stored([ehash(doc, (b + 1) * m - 1) for b in blocks[:1]], [], bs=0, group=group_idx, kind=kind,
                            window=window, medium=medium, locality=locality)  # fmt: skip
            else:
                if form == "sparse":
                    blocks = [b for b in blocks if draw(st.booleans())]
                ev = stored([ehash(doc, (b + 1) * m - 1) for b in blocks], DOCS[doc][start * BS * m : end * BS * m],
                            bs=size, parent=ehash(doc, start * m - 1) if start else None, group=group_idx, kind=kind,
                            window=window, medium=medium, locality=locality)  # fmt: skip
        ops.append(("apply", w, ev))
    return ops


@st.composite
def coarse_streams(draw):
    """Streams dense in hits over groups of larger blocks: one or two workers, one medium, two
    long documents, stores mostly from block 0, few removals. Group 0 full attention (1 or 2
    index blocks a block), group 1 a sliding window (1, 2 or 4), group 2 mamba, a second window
    or an unscored kind (1, 2 or 3: an unscored group's size still aligns the hit, as vLLM's
    scheduler_block_size is the lcm over every group)."""
    kinds = {0: ("full_attention", None), 1: ("sliding_window", draw(st.sampled_from([1, 3, 5, 9, 17]))),
             2: draw(st.sampled_from([("mamba", None), ("sliding_window", 6), ("chunked_local_attention", None)]))}  # fmt: skip
    scales = {0: draw(st.sampled_from([1, 2])), 1: draw(st.sampled_from([1, 2, 4])), 2: draw(st.sampled_from([1, 2, 3]))}
    n_groups = draw(st.integers(2, 3))
    ops = []
    for _ in range(draw(st.integers(1, 25))):
        w = f"w{draw(st.integers(0, 1))}"
        group = draw(st.integers(0, n_groups - 1))
        doc = draw(st.sampled_from([0, 3]))
        m = scales[group]
        nb = len(DOCS[doc]) // (BS * m)
        if draw(st.integers(0, 5)) == 0:
            blocks = draw(st.lists(st.integers(0, nb - 1), min_size=1, max_size=2))
            ops.append(("apply", w, removed([ehash(doc, (b + 1) * m - 1) for b in blocks], group=group)))
            continue
        start = draw(st.sampled_from([0, 0, 0, draw(st.integers(0, nb - 1))]))
        end = draw(st.integers(start + 1, nb))
        blocks = list(range(start, end))
        if group and draw(st.booleans()):
            blocks = [b for b in blocks if draw(st.booleans())]  # sparse: the retained blocks only
        kind, window = kinds[group]
        ops.append(("apply", w, stored([ehash(doc, (b + 1) * m - 1) for b in blocks],
                                       DOCS[doc][start * BS * m : end * BS * m], bs=BS * m,
                                       parent=ehash(doc, start * m - 1) if start else None, group=group, kind=kind,
                                       window=window)))  # fmt: skip
    return ops


def fed(ops, key: str) -> tuple[Index, Model]:
    """An index and the model, both fed ``ops``."""
    idx, model = Index(BS, key), Model(key)
    for op, w, ev in ops:
        if op == "clear":
            idx.apply(w, batch(AllBlocksCleared()))
            model.clear(w)
        elif op == "remove_worker":
            idx.remove_worker(w)
            model.clear(w)
        else:
            idx.apply(w, encode_batch(batch(ev)))
            (model.store if isinstance(ev, BlockStored) else model.remove)(w, ev)
    return idx, model


def check(ops, key: str) -> None:
    idx, model = fed(ops, key)
    assert {k: idx.stats[k] for k in Model.STATS} == model.stats
    for d in range(len(DOCS)):
        nb = len(DOCS[d]) // BS
        keys = [ehash(d, b) for b in range(nb)] if key == "engine" else [root_key(d, b) for b in range(nb)]
        for n in range(1, nb + 1) if nb > 6 else {1, nb // 2, nb}:
            q = keys[:n]

            def ask(**kw):
                if key == "tokens" and "by_medium" not in kw and n == nb:
                    return idx.find_matches(DOCS[d][: nb * BS], **kw)
                return idx.find_matches(block_hashes=q, **kw)

            assert ask() == model.find_matches(q)
            assert ask(remote=True) == model.find_matches(q, remote=True)
            for m in ("GPU", "CPU"):
                assert ask(medium=m) == model.find_matches(q, m)
            assert ask(by_medium=True) == model.by_medium(q)
            assert ask(by_medium=True, remote=True) == model.by_medium(q, remote=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 3).flatmap(streams))
def test_engine_keyed_streams_equal_the_model(ops):
    check(ops, "engine")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 3).flatmap(streams))
def test_token_keyed_streams_equal_the_model(ops):
    check(ops, "tokens")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(coarse_streams())
def test_groups_of_larger_blocks_equal_vllms_hit(ops):
    """Hits over groups whose blocks are 2 or 4 index blocks equal vLLM's rule (the model's
    ``score``: each group read at its own size, hits aligned to the lcm of the sizes)."""
    check(ops, "engine")
    check(ops, "tokens")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.integers(2, 3).flatmap(streams), coarse_streams()))
def test_a_routers_hit_is_vllms_at_the_cap(ops):
    """What kvbridge.Router credits a worker is vLLM's hit for the prompt less its last token
    (KVCacheManager.get_computed_blocks: max_cache_hit_length = num_tokens - 1, the window rule
    held at that length), for every prompt length, block-aligned or not."""
    from kvbridge import Router
    from kvbridge.routing.work import EngineModel

    idx, model = fed(ops, "tokens")
    engine = EngineModel()
    # Every tier worth a GPU block: the credit is the best medium's hit.
    router = Router(idx, block_size=BS, engine=engine, medium_weights={"GPU": 1.0, "CPU": 1.0}, provisional_ttl_s=0,
                    workers=["w0", "w1", "w2"])  # fmt: skip
    for d, doc in enumerate(DOCS):
        keys = [root_key(d, b) for b in range(len(doc) // BS)]
        for n in range(1, len(doc) + 1):
            cap = (n - 1) // BS
            held = {w: max(by.values()) for w, by in model.by_medium(keys[:cap]).items()}
            costs = router.costs(doc[:n])
            for w, cost in costs.items():
                assert cost == pytest.approx(engine.prefill_ms(n - BS * held.get(w, 0))), (d, n, w, held)
