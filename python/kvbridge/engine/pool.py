"""A prefix-caching KV block pool with vLLM v1's semantics that records KV events.

``KVCacheManager`` is the request level an engine or a simulator calls (the block level -- free
queue, ref counts, hash -> cached block map, eviction, reset -- lives inside it). Every change to
the set of cached blocks is recorded as ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
events, drained in order by ``take_events()``.

``KVCacheManager`` (Rust, ``rust/pool.rs``) is the request level. Each public method is one
native call -- hashing, prefix lookup, free queue, ref counts, eviction and event recording
included; events become Python objects only in ``take_events()``/``snapshot()``. Its ``.pool``
answers the pool's queries (``num_free_blocks``, ``num_cached_blocks``, ``usage``,
``cached_block_hashes()``, ``free_block_ids()``, ``blocks`` as read-only copies). ``lora_id``
must be an int or None.

The executable spec is plain Python, in ``kvbridge.engine._reference_pool`` (``BlockPool`` and
``PyKVCacheManager``, as tiktoken keeps ``_educational``): the native manager is checked against
it step by step (tests/test_pool.py), and the rules below are the spec's.

What carries over from vLLM (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``):

* The free queue is in eviction order. Freeing a request puts its blocks back last-block-first,
  so a chain's tail is evicted before its head; blocks that hold a hash go to the tail (kept
  longest), blocks without one go to the head (reused first, they can never be hit).
* A block that is allocated while it still holds a hash is evicted from the cache at that moment.
* A prefix hit on a free block takes it out of the free queue (``touch``), so the blocks needed by
  an allocation are the new ones plus the evictable hits.
* Block ids handed to a request never change, so two blocks may hold the same hash (e.g. two
  requests decoding the same tokens); a hit takes the oldest. Unlike vLLM -- which then
  publishes the same hash twice and removes it while another copy is still cached -- the events
  here describe the *set of cached hashes*: a hash is stored when its first copy appears and
  removed when its last copy goes. That keeps the event stream exact for consumers that replay
  it. (A cached hash's parent is always cached too: freeing puts a chain's tail ahead of its
  head in the queue.)

Deliberate differences: there is no null block, so all ``num_blocks`` are usable; and
``allocate`` reports a full hit when every prompt block is cached (vLLM recomputes the last block
to get logits -- a scheduling concern, not a caching one).

Hybrid KV-cache groups (``groups=[("full_attention", None), ("sliding_window", 128)]``: per
group its vLLM ``KVCacheSpecKind`` and, for a window kind, the window W in tokens; see
``_reference_pool.check_groups`` for what is accepted) follow vLLM 0.33 instead, where the
single-group rules above do not:

* One pool serves every group (vLLM's one ``BlockPool``); a request holds one block table per
  group (``get_group_block_ids``; ``get_block_ids`` is group 0's), each group taking the same
  number of blocks per step, in group order.
* The cache is keyed by (group, block hash), the block hash being the same in every group
  (``make_block_hash_with_group_id`` / ``get_block_hash``). Nothing is de-duplicated
  (``BlockHashToBlockMap``): each ``cache_full_blocks`` call gives one ``BlockStored`` per group
  with ``group_idx``, ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` (None for a main
  group, as ``KVCacheManager.take_events`` annotates) listing every newly full block, even a
  hash another block of the group holds; each evicted cached block gives its own
  ``BlockRemoved([hash], medium, group_idx)`` (``_emit_block_removed_events``; no kind there).
  So a prompt recomputed after an eviction hole stores a second copy, and two removals follow.
* ``allocate`` hits what ``HybridKVCacheCoordinator.find_longest_cache_hit`` finds: the largest
  n such that every main group holds blocks [0, n) and every window group [max(0, n - k), n),
  k = cdiv(W - 1, block_size) (at least 1: vLLM's right-to-left scan needs the hit's last
  block even for W = 1), with n below the prompt's last token (``get_computed_blocks``:
  num_tokens - 1). A window group takes only the hit blocks inside its window; the others are
  null blocks in its table (``add_local_computed_blocks``).
* A window group releases the blocks before num_tokens - W + 1 (``get_num_skipped_tokens``),
  last block first, at the start of each ``append`` (``remove_skipped_blocks`` runs before
  ``allocate_slots`` allocates -- so even an ``append`` that then returns False has released
  them). Released cached blocks stay hittable in the free queue until reused; their eviction
  is that group's ``BlockRemoved``. A request's tokens count as computed once passed.
* ``free`` releases group by group (``KVCacheCoordinator.free``), each tail first.
* ``snapshot()`` lists every block holding a hash, group by group in caching order, so a hash
  two blocks hold appears twice (the shared spec's snapshot rule);
  ``num_cached_blocks``/``cached_block_hashes()`` count (group, hash) keys.
* ``retention_interval`` is vLLM's ``prefix_cache_retention_interval`` for window groups
  (``SlidingWindowManager.reachable_block_mask``, no EAGLE). None (the default here, so a
  window group caches every full block) is vLLM's dense setting; vLLM's own default is 0: a
  window group then caches only the k blocks before each reachable boundary -- the prompt's
  ``num_tokens - 1`` and the shared-prefix junction found at admission (group 0's own cached
  prefix, when it runs past the hit: ``get_computed_blocks``' ``shared_prefix_boundary``); a
  positive multiple of ``block_size`` also keeps the last k blocks of every such segment. Its
  ``BlockStored`` lists the kept hashes only, with every block's tokens (the shared spec's
  "sparse" events, often zero hashes); the blocks not kept stay uncached.
* Not modelled: EAGLE; Mamba and other kinds; per-group block sizes; vLLM's null block
  (``num_blocks`` are all usable).

``hit_blocks(token_ids, *, lora_name=None)`` answers, without changing anything, how many
leading blocks ``allocate`` would hit now (``allocate`` returns that times ``block_size`` when
it succeeds). In a hybrid pool the prompt's last token is never a hit; to compare with a
score over all of a sequence's full blocks (an index's ``find_matches``), pass the tokens plus
one more.

Threading: the manager serialises its public methods with one lock, so a publisher may call ``take_events()`` / ``snapshot()`` from another thread
(e.g. an asyncio loop) while the engine thread allocates. ``snapshot()`` copies the hash map
under the lock (C speed) and builds events after releasing it. A snapshot reflects every event
recorded so far, including those not yet drained by ``take_events()``: a publisher drains and
hands those over first, under its own lock (``KvEventPublisher.take_snapshot``), which the engine
holds from mutating the pool until its events are handed over. Events that reached consumers
after a snapshot already holding them would not converge: an index or a view counts a block
stored twice as two copies, and one removal leaves one. The native manager does the same with a
Rust mutex (waiting for it releases the GIL, so it cannot deadlock with it); a method never
releases the GIL while it works, except to hash 64k tokens or more.
"""

from __future__ import annotations

from typing import Sequence

from kvbridge._native import KVCacheManager as _NativeManager
from kvbridge.wire.events import BlockStored
from kvbridge.wire.residency import kind_event

__all__ = ["Block", "KVCacheManager", "NativeKVCacheManager", "announce_empty_groups"]

class Block:
    """One KV block. ``block_hash`` is its 64-bit event hash while cached. A block is in the
    free queue exactly when ``ref_cnt`` is 0; ``prev``/``next`` link the queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        # Linked into the queue (or between its sentinels) before anything follows them.
        self.prev: Block = None  # type: ignore[assignment]
        self.next: Block = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class _NativePool:
    """The block-pool queries of a :class:`NativeKVCacheManager` (each takes its lock)."""

    __slots__ = ("_m",)

    def __init__(self, manager: NativeKVCacheManager) -> None:
        self._m = manager

    num_blocks = property(lambda self: self._m.num_blocks)
    block_size = property(lambda self: self._m.block_size)
    algo = property(lambda self: self._m.algo)
    seed = property(lambda self: self._m.seed)
    medium = property(lambda self: self._m.medium)
    num_free_blocks = property(lambda self: self._m.num_free_blocks)
    num_cached_blocks = property(lambda self: self._m.num_cached_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self._m.num_free_blocks / self._m.num_blocks

    def cached_block_hashes(self) -> list[int]:
        """The cached hashes, parents before children."""
        return self._m.cached_block_hashes()

    def free_block_ids(self) -> list[int]:
        """The free blocks in eviction order, first evicted first."""
        return self._m.free_block_ids()

    @property
    def blocks(self) -> list[Block]:
        """A copy of every block's state (unlinked ``Block`` objects)."""
        out = []
        for i, (ref_cnt, block_hash) in enumerate(self._m.block_states()):
            b = Block(i)
            b.ref_cnt, b.block_hash = ref_cnt, block_hash
            out.append(b)
        return out


class NativeKVCacheManager(_NativeManager):
    """The reference ``PyKVCacheManager``'s API and behaviour, in one native call per method.

    ``NativeKVCacheManager(num_blocks, block_size, *, algo="xxh3", seed=None, medium="GPU",
    enable_events=True, groups=None, retention_interval=None)``; ``allocate(request_id, token_ids, *, lora_name=None,
    lora_id=None)``, ``append``, ``free``, ``reset``, ``take_events``, ``snapshot``,
    ``get_block_ids``, ``get_group_block_ids``, ``hit_blocks(token_ids, *, lora_name=None)``,
    ``can_allocate``,
    ``num_tokens``, ``in``, ``len``, ``groups``, ``retention_interval``; ``.pool`` for the pool's
    queries. ``take_record()`` drains the events as ``take_events()`` does but keeps them native
    (an ``EventRecord``: ``events()`` builds them); the publisher's ``step()`` and ``publish()``
    take it and write it as msgpack without making an event object.
    """

    __slots__ = ()

    @property
    def pool(self) -> _NativePool:
        return _NativePool(self)

    def snapshot(self) -> list[BlockStored]:
        """Every cached block as ``BlockStored`` events, parents before children (hybrid: see
        :func:`announce_empty_groups`)."""
        return announce_empty_groups(super().snapshot(), self.groups, self.block_size, self.medium)


def announce_empty_groups(
    events: list[BlockStored], groups: Sequence[tuple[str, int | None]] | None, block_size: int, medium: str | None
) -> list[BlockStored]:
    """A hybrid pool's snapshot ends with a store of no blocks naming the kind of each group that
    holds nothing: a view rebuilt from it must know the group exists (a window group holding
    nothing allows no hit past its window), as one that followed the stream does."""
    if not groups:
        return events
    named = {ev.group_idx for ev in events}
    return events + [
        kind_event(g, kind, window, block_size, medium) for g, (kind, window) in enumerate(groups) if g not in named
    ]


KVCacheManager = NativeKVCacheManager
