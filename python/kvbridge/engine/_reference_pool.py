"""The executable spec of :mod:`kvbridge.engine.pool`: a prefix-caching block pool in plain Python.

``BlockPool`` is the block level (free queue in eviction order, ref counts, hash -> cached block
map, eviction, reset) and ``PyKVCacheManager`` the request level over it. They follow the rules
written in :mod:`kvbridge.engine.pool`'s docstring, and the native ``KVCacheManager`` is checked against
them step by step in tests/test_pool.py. Nothing here is on a hot path: it is the oracle, read it
to learn what the native manager does. (The free queue is a linked list through the blocks, as
in vLLM.) Not thread-safe below the manager, whose public methods share one lock.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from kvbridge.wire.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, merge_runs
from kvbridge.wire.hashing import BlockHasher
from kvbridge.engine.pool import Block, announce_empty_groups

if TYPE_CHECKING:
    from kvbridge._native import Algorithm

__all__ = ["BlockPool", "PyKVCacheManager", "check_groups"]

#: vLLM 0.33's KVCacheSpecKind values the pool models: main-attention kinds hold every block of a
#: request (FullAttentionManager); window kinds free the blocks that left their window
#: (SlidingWindowManager).
MAIN_KINDS = ("full_attention", "mla_attention", "sink_full_attention")
WINDOW_KINDS = ("sliding_window", "sliding_window_mla")
#: group_idx is 0..=63 on the wire (the shared spec's residency key).
MAX_GROUPS = 64


def check_groups(groups: Any) -> tuple[tuple[str, int | None], ...] | None:
    """``groups`` as a tuple of (kind, window) pairs, or None; a ValueError names the bad entry.

    The native manager (rust/pool.rs ``check_groups``) raises the same messages."""
    if groups is None:
        return None
    if isinstance(groups, (str, bytes)) or not isinstance(groups, (list, tuple)):
        raise ValueError(f"groups must be a list of (kind, window) pairs or None, got {groups!r}")
    if not 0 < len(groups) <= MAX_GROUPS:
        raise ValueError(f"groups must hold 1 to {MAX_GROUPS} groups, got {len(groups)}")
    out = []
    for i, group in enumerate(groups):
        if not isinstance(group, (list, tuple)) or len(group) != 2:
            raise ValueError(f"groups[{i}] must be a (kind, window) pair, got {group!r}")
        kind, window = group
        if kind in MAIN_KINDS:
            if window is not None:
                raise ValueError(f"groups[{i}]: {kind} takes no window (None), got {window!r}")
        elif kind in WINDOW_KINDS:
            if type(window) is not int or window < 1:
                raise ValueError(f"groups[{i}]: {kind} needs a window, an int >= 1 (tokens), got {window!r}")
        else:
            raise ValueError(
                f"groups[{i}]: kind must be one of {', '.join(MAIN_KINDS + WINDOW_KINDS)}, got {kind!r}"
            )
        if i == 0 and window is not None:
            raise ValueError(f"groups[0] must be a main-attention kind ({', '.join(MAIN_KINDS)}), got {kind!r}")
        out.append((kind, window))
    return tuple(out)

# vLLM's own algorithms chain on full digests; their 64-bit event hash is the digest's tail.
_VLLM_ALGOS = frozenset({"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"})


class BlockPool:
    """Blocks, their free queue in eviction order, and the hash -> cached block map.

    ``algo``/``seed`` choose the chained hash (see ``kvbridge.wire.hashing``); ``medium`` is put in
    every event. Not thread-safe: callers serialise (``KVCacheManager`` does). Methods taking
    blocks take each block at most once per call.

    ``groups`` (see :func:`check_groups`) makes the pool hybrid, as vLLM's one ``BlockPool``
    shared by every KV-cache group (vllm/v1/core/block_pool.py): the map is keyed by
    (group, hash) -- vLLM's ``make_block_hash_with_group_id``, the same block hash in every
    group -- and, as there, nothing is de-duplicated: every cached block is announced
    (``BlockStored`` with ``group_idx`` and the group's kind and window, one per
    ``cache_full_blocks`` call) and every evicted cached block is removed on its own
    (``BlockRemoved([hash], medium, group_idx)``, as ``_emit_block_removed_events``), so a hash
    two blocks hold is stored twice and removed twice.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        algo: Algorithm = "xxh3",
        seed: Any = None,
        medium: str | None = MEDIUM_GPU,
        enable_events: bool = True,
        groups: Any = None,
    ) -> None:
        self.groups = check_groups(groups)
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if algo == "dynamo":
            raise ValueError("algo 'dynamo' hashes blocks without their prefix; use 'dynamo_seq'")
        # A bad algo or seed fails here; requests clone this root chain.
        self._root = BlockHasher(block_size, algo=algo, seed=seed)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.algo = algo
        self.seed = seed
        self.medium = medium
        self._as_bytes = algo in _VLLM_ALGOS
        # vLLM salts a LoRA block's hash with extra keys (lora_name,), and so do we, except for
        # Dynamo's hash, whose extra keys are multimodal hashes and which salts with the name.
        self._lora_in_extra_keys = algo != "dynamo_seq"
        self.blocks = [Block(i) for i in range(num_blocks)]
        # The free queue: head.next is evicted first. Sentinels spare the loops None checks.
        self._head, self._tail = Block(-1), Block(-1)
        chain = [self._head, *self.blocks, self._tail]
        for a, b in zip(chain, chain[1:]):
            a.next, b.prev = b, a
        self._num_free = num_blocks
        # hash -> (block, run). A run is what one cache_full_blocks call stored, shared by its
        # blocks: (parent hash, hashes, token ids, (lora_name, lora_id) | None, chain values).
        # Per block that is one small tuple, not a copy of its tokens; and all of it is
        # immutable, so a snapshot can copy the dict and read the entries unlocked. Insertion
        # order is topological: a hash's parent is cached whenever it is, so it came first.
        self._cached: dict[Any, tuple[Block, tuple]] = {}
        # Further blocks holding an already cached hash, oldest first. Rare.
        self._copies: dict[Any, list[Block]] = {}
        self._events: list | None = [] if enable_events else None
        # Hybrid only: per block id (insertion number, run, index in run, group) while it holds a
        # hash. Copies are announced one by one, so a snapshot lists every holder, not each key.
        self._meta: list[tuple[int, tuple, int, int] | None] = [None] * num_blocks
        self._seq = 0

    # --- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def usage(self) -> float:
        return 1.0 - self._num_free / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Distinct cached hashes."""
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free blocks in eviction order, first evicted first."""
        out, b, tail = [], self._head.next, self._tail
        while b is not tail:
            out.append(b.block_id)
            b = b.next
        return out

    def cached_block_hashes(self) -> list[int]:
        """The cached hashes, parents before children (hybrid: one per cached (group, hash),
        in the order each was first cached)."""
        if self.groups is not None:
            return [h for _, h in self._cached]
        return list(self._cached)

    def get_cached_block(self, block_hash: int, group_idx: int = 0) -> Block | None:
        """The oldest block holding ``block_hash`` (in group ``group_idx`` of a hybrid pool)."""
        entry = self._cached.get(self._key(group_idx, block_hash))
        return None if entry is None else entry[0]

    def held_prefix(self, group_idx: int, block_hashes: Sequence[int], max_blocks: int) -> int:
        """How many leading blocks of ``block_hashes`` (at most max_blocks) group ``group_idx`` holds."""
        n = 0
        for h in block_hashes[:max_blocks]:
            if self._key(group_idx, h) not in self._cached:
                break
            n += 1
        return n

    def _key(self, group_idx: int, block_hash: int) -> Any:
        return block_hash if self.groups is None else (group_idx, block_hash)

    # --- the hybrid hit rule ------------------------------------------------------------------

    def window_blocks(self, group_idx: int) -> int:
        """Contiguous blocks before a hit that a window group must hold (vLLM's
        ``SlidingWindowManager._contiguous_blocks_for_hit``: cdiv(W - 1, block_size)); 0 for a main
        group. A window of 1 token gives 0 there, yet its right-to-left scan still needs the
        hit's last block, so 1 is the least (the same scan, read off)."""
        window = self.groups[group_idx][1] if self.groups else None
        return 0 if window is None else max(1, -(-(window - 1) // self.block_size))

    def skipped_blocks(self, group_idx: int, num_tokens: int) -> int:
        """Leading blocks a group no longer attends to once ``num_tokens`` are computed
        (``get_num_skipped_tokens`` // block_size: tokens before num_tokens - W + 1)."""
        window = self.groups[group_idx][1] if self.groups else None
        return 0 if window is None else max(0, num_tokens - window + 1) // self.block_size

    def longest_hit(self, block_hashes: Sequence[int], max_blocks: int) -> int:
        """``HybridKVCacheCoordinator.find_longest_cache_hit`` in blocks: the largest n <=
        max_blocks such that every main group holds blocks [0, n) and every window group holds
        [max(0, n - k), n), k = :meth:`window_blocks` (the fixed point over
        ``SlidingWindowManager.find_longest_cache_hit``; a window group's hit may be shorter
        than k when it starts at block 0)."""
        assert self.groups is not None
        cached = self._cached
        mains = [g for g, (_, w) in enumerate(self.groups) if w is None]
        n = 0
        for h in block_hashes[:max_blocks]:
            if any((g, h) not in cached for g in mains):
                break
            n += 1
        windows = [(g, self.window_blocks(g)) for g, (_, w) in enumerate(self.groups) if w is not None]
        changed = True
        while changed:  # each window group takes the longest hit it allows up to n; repeat until none shortens it
            changed = False
            for g, k in windows:
                m = self._window_hit(g, k, block_hashes, n)
                if m < n:
                    n, changed = m, True
        return n

    def _window_hit(self, g: int, k: int, block_hashes: Sequence[int], n: int) -> int:
        # Right to left, the first k contiguous held blocks end the hit; with none, the run
        # held from block 0 is the hit (SlidingWindowManager.find_longest_cache_hit).
        cached, run = self._cached, 0
        for i in range(n - 1, -1, -1):
            if (g, block_hashes[i]) in cached:
                run += 1
                if run >= k:
                    return i + k
            else:
                run = 0
        return run

    def find_cached_prefix(self, block_hashes: Iterable[int]) -> list[Block]:
        """The blocks of the longest cached prefix of ``block_hashes`` (hybrid: in group 0)."""
        keys: Iterable[Any] = block_hashes if self.groups is None else [(0, h) for h in block_hashes]
        get = self._cached.get
        hit: list[Block] = []
        for h in keys:
            entry = get(h)
            if entry is None:
                break
            hit.append(entry[0])
        return hit

    # --- hashing ---------------------------------------------------------------------------

    def new_hasher(self, lora_name: str | None = None, after: int | None = None) -> BlockHasher:
        """A chain for one sequence with this pool's algorithm and seed, starting at the root or
        continuing the cached block ``after`` (so a cached prefix need not be hashed again)."""
        parent = None
        if after is not None:
            entry = self._cached.get(self._key(0, after))
            if entry is None:
                raise KeyError(f"block hash {after} is not cached")
            _, hashes, _, _, chains = entry[1]
            parent = chains[hashes.index(after)]
        elif lora_name is None or self._lora_in_extra_keys:
            return self._root.copy()
        salt = {} if self._lora_in_extra_keys else {"lora_name": lora_name}
        return BlockHasher(self.block_size, algo=self.algo, seed=self.seed, parent=parent, **salt)

    def hash_tokens(
        self, hasher: BlockHasher, token_ids: Sequence[int], lora_name: str | None = None
    ) -> tuple[list[int], list[Any]]:
        """Feed a sequence's next tokens to its chain in one native call (which validates every
        token and changes nothing if one is bad). Returns the 64-bit event hashes of the blocks
        they complete and the chain values (full digests for vLLM's algorithms) to continue."""
        extra = None
        if lora_name is not None and self._lora_in_extra_keys:
            extra = [(lora_name,)] * ((hasher.num_pending + len(token_ids)) // self.block_size)
        if self._as_bytes:
            digests = hasher.update(token_ids, extra, as_bytes=True)
            return [int.from_bytes(d[-8:], "big") for d in digests], digests
        hashes = hasher.update(token_ids, extra)
        return hashes, hashes

    # --- block lifecycle ---------------------------------------------------------------------

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on prefix-hit blocks; free ones leave the free queue."""
        taken = 0
        for b in blocks:
            if b.ref_cnt == 0:
                prev, nxt = b.prev, b.next
                prev.next, nxt.prev = nxt, prev
                taken += 1
            b.ref_cnt += 1
        self._num_free -= taken

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Take ``num_blocks`` from the head of the free queue, evicting any cached ones (one
        ``BlockRemoved`` per call for the hashes that left the cache)."""
        if not 0 <= num_blocks <= self._num_free:
            raise ValueError(f"cannot get {num_blocks} free blocks, {self._num_free} are free")
        return self._new_blocks(num_blocks)

    def _new_blocks(self, num_blocks: int) -> list[Block]:
        out: list[Block] = []
        if not num_blocks:
            return out
        removed: list[int | bytes] = []
        cached, copies, events = self._cached, self._copies, self._events
        b = self._head.next
        for _ in range(num_blocks):
            out.append(b)
            b.ref_cnt = 1
            h = b.block_hash
            if h is not None:
                b.block_hash = None
                if self.groups is not None:
                    g = self._meta[b.block_id][3]  # type: ignore[index]
                    self._meta[b.block_id] = None
                    self._drop_cached(b, (g, h))
                    if events is not None:  # every holder, one event each, as vLLM
                        events.append(BlockRemoved([h], self.medium, g))
                elif not copies:  # no hash has a second holder: this block was its only one
                    del cached[h]
                    removed.append(h)
                elif self._drop_cached(b, h):
                    removed.append(h)
            b = b.next
        self._head.next, b.prev = b, self._head  # unlink the taken prefix at once
        self._num_free -= num_blocks
        if removed and events is not None:
            events.append(BlockRemoved(removed, self.medium))
        return out

    def _drop_cached(self, block: Block, h: Any) -> bool:
        """Forget that ``block`` holds key ``h``; True when that was the key's last copy."""
        entry = self._cached[h]
        copies = self._copies.get(h)
        if entry[0] is block:
            if not copies:
                del self._cached[h]
                return True
            # The oldest other copy takes over (vLLM hits the first inserted block);
            # re-assigning keeps the hash's place in the order.
            self._cached[h] = (copies.pop(0), entry[1])
        else:
            copies.remove(block)  # type: ignore[union-attr]  # a block that is not the entry's is a copy
        if not copies:
            del self._copies[h]
        return False

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        *,
        parent_block_hash: int | None = None,
        chain_values: Sequence[Any] | None = None,
        lora_name: str | None = None,
        lora_id: int | None = None,
        group_idx: int = 0,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Mark newly filled blocks as cached, as one chain continuing ``parent_block_hash``.

        The blocks must be in use and not hold a hash yet; ``token_ids`` are exactly their
        tokens; ``chain_values`` (default: the hashes) is what a later hash continues from.
        Records one ``BlockStored`` for the hashes not already cached by other blocks; in a
        hybrid pool, one for all of them, in group ``group_idx``. ``block_mask`` (hybrid): only
        the blocks it marks True are cached and announced; the event still carries every
        block's tokens and the chain's parent (vLLM's ``cache_full_blocks(block_mask=)``).
        """
        n = len(blocks)
        if len(block_hashes) != n or len(token_ids) != n * self.block_size:
            raise ValueError(
                f"{n} blocks need {n} hashes and {n * self.block_size} token ids, "
                f"got {len(block_hashes)} and {len(token_ids)}"
            )
        lora = None if lora_name is None and lora_id is None else (lora_name, lora_id)
        if n and self.groups is not None:
            if not 0 <= group_idx < len(self.groups):
                raise ValueError(f"group_idx must be in 0..{len(self.groups) - 1}, got {group_idx!r}")
            self._cache_group(
                blocks, list(block_hashes), list(token_ids), parent_block_hash,
                list(chain_values or block_hashes), lora, group_idx, block_mask,
            )
        elif n:
            self._cache(
                blocks, list(block_hashes), list(token_ids), parent_block_hash,
                list(chain_values or block_hashes), lora,
            )

    def _cache(self, blocks: Sequence[Block], hashes: list, tokens: list, parent: Any, chains: list, lora: Any) -> None:
        # The lists become the run record: the caller hands them over and keeps no reference.
        cached = self._cached
        run = (parent, hashes, tokens, lora, chains)
        for b, h in zip(blocks, hashes):
            b.block_hash = h
        # Some hashes may already be held by other blocks (identical decodes). As a cached
        # hash's parent is cached they form a prefix of this call, but report any runs in between.
        runs, start = [], 0
        for i, (b, h) in enumerate(zip(blocks, hashes)):
            if h in cached:
                self._copies.setdefault(h, []).append(b)
                if i > start:
                    runs.append((start, i))
                start = i + 1
            else:
                cached[h] = (b, run)
        if start < len(hashes):
            runs.append((start, len(hashes)))
        if self._events is not None:
            self._events.extend(self._stored_slice(run, s, e) for s, e in runs)

    def _cache_group(
        self, blocks: Sequence[Block], hashes: list, tokens: list, parent: Any, chains: list, lora: Any, g: int,
        mask: Sequence[bool] | None = None,
    ) -> None:
        # vLLM's cache_full_blocks: each kept block enters the (group, hash) map, a second
        # holder beside the first (BlockHashToBlockMap.insert), and is announced.
        run = (parent, hashes, tokens, lora, chains, g)
        cached, meta = self._cached, self._meta
        for i, (b, h) in enumerate(zip(blocks, hashes)):
            if mask is not None and not mask[i]:
                continue
            b.block_hash = h
            self._seq += 1
            meta[b.block_id] = (self._seq, run, i, g)
            key = (g, h)
            if key in cached:
                self._copies.setdefault(key, []).append(b)
            else:
                cached[key] = (b, run)
        if self._events is not None and mask is None:
            self._events.append(self._stored_slice(run, 0, len(hashes)))
        elif self._events is not None:  # vLLM's sparse shape: the kept hashes, every token
            kept = [h for h, keep in zip(hashes, mask) if keep]  # type: ignore[arg-type]
            self._events.append(self._stored(kept, parent, tokens, lora, g))

    def free_blocks(self, ordered_blocks: Iterable[Block]) -> None:
        """Drop one reference per block; the order is eviction order, first evicted first.
        Blocks reaching zero go to the tail if cached, to the head if not."""
        blocks = list(ordered_blocks)
        for b in blocks:
            if b.ref_cnt <= 0:
                raise ValueError(f"{b!r} is already free")
        self._free_blocks(blocks)

    def _free_blocks(self, blocks: Iterable[Block]) -> None:
        tail = self._tail
        last = tail.prev
        fresh: list[Block] = []
        released = 0
        for b in blocks:
            ref_cnt = b.ref_cnt - 1
            b.ref_cnt = ref_cnt
            if ref_cnt:
                continue
            released += 1
            if b.block_hash is None:
                fresh.append(b)
            else:
                last.next, b.prev = b, last
                last = b
        last.next, tail.prev = tail, last
        if fresh:
            first = self._head.next
            for b in reversed(fresh):
                b.next, first.prev = first, b
                first = b
            self._head.next, first.prev = first, self._head
        self._num_free += released

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self._num_free != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self._cached = {}
        self._copies = {}
        self._meta = [None] * self.num_blocks
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    # --- events --------------------------------------------------------------------------------

    def take_events(self) -> list:
        """The events recorded since the last call, in order."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def snapshot(self) -> list[BlockStored]:
        """Every cached hash as ``BlockStored`` events, parents before children; replaying them
        into an empty view reproduces the cached set.

        Hybrid: every block holding a hash, group by group, in the order they were cached (so
        a hash two blocks hold appears twice, each copy in the event of the call that cached
        it; a window group's block whose parent left the window keeps that parent)."""
        if self.groups is not None:
            meta = self._meta
            held = sorted((m[3], m[0], m[1], m[2]) for m in meta if m is not None)
            return merge_runs(((run, i) for _, _, run, i in held), self._stored_slice)
        return self._snapshot_events(list(self._cached.items()))

    def _snapshot_events(self, items: list[tuple[int, tuple]]) -> list[BlockStored]:
        def indexed() -> Iterator[tuple[tuple, int]]:
            run: Any = None
            i = -1
            for h, (_, r) in items:  # the next block of the same run, or look it up in its run
                i = i + 1 if r is run and i + 1 < len(r[1]) and r[1][i + 1] == h else r[1].index(h)
                run = r
                yield r, i

        return merge_runs(indexed(), self._stored_slice)

    def _stored_slice(self, run: tuple, first: int, end: int) -> BlockStored:
        parent, hashes, tokens, lora = run[:4]
        bs = self.block_size
        return self._stored(
            hashes[first:end], hashes[first - 1] if first else parent,
            tokens[first * bs : end * bs], lora, *run[5:],
        )

    def _stored(self, hashes: list, parent: Any, tokens: list, lora: Any, group: int | None = None) -> BlockStored:
        # Positional, in BlockStored's field order (cheaper than keywords on the hot path).
        if lora is None and group is None:
            return BlockStored(hashes, parent, tokens, self.block_size, None, self.medium, None)
        lora_name, lora_id = lora or (None, None)
        # vLLM 0.33 publishes, per block, what was mixed into its hash.
        extra: list[tuple[Any, ...] | None] | None = (
            [(lora_name,)] * len(hashes) if self._lora_in_extra_keys and lora_name else None
        )
        if group is None:
            return BlockStored(hashes, parent, tokens, self.block_size, lora_id, self.medium, lora_name, extra)
        # KVCacheManager.take_events annotates the group's kind and window.
        kind, window = self.groups[group]  # type: ignore[index]
        return BlockStored(
            hashes, parent, tokens, self.block_size, lora_id, self.medium, lora_name, extra, group, kind, window
        )


def check_retention(retention_interval: Any, block_size: int, groups: Any) -> None:
    """vLLM's prefix_cache_retention_interval check (kv_cache_coordinator.py
    ``_validate_prefix_cache_retention_interval``), for a hybrid pool only; the native manager
    raises the same messages."""
    if retention_interval is None:
        return
    if groups is None:
        raise ValueError("retention_interval applies to window groups: it needs groups")
    if type(retention_interval) is not int or retention_interval < 0 or retention_interval % block_size:
        raise ValueError(
            f"retention_interval must be None or an int >= 0 that is a multiple of block_size "
            f"({block_size}), got {retention_interval!r}"
        )


def _as_token_list(token_ids: Any) -> list[int]:
    # numpy/array inputs become plain ints (events carry lists); a list is only read, and
    # what is kept of it is sliced off.
    if type(token_ids) is list:
        return token_ids
    tolist = getattr(token_ids, "tolist", None)
    if tolist is not None:
        return tolist()
    try:
        return list(token_ids)
    except TypeError:
        raise TypeError(_NOT_TOKENS.format(type(token_ids).__name__)) from None


# The native manager raises the same message (rust/pool.rs).
_NOT_TOKENS = "token ids must be a list of int, an int array or an iterable of int, not {}"


class _Request:
    __slots__ = (
        "blocks", "num_tokens", "tail", "hasher", "last_hash", "lora_name", "lora_id", "tables", "skipped",
        "boundaries",
    )

    def __init__(
        self, blocks: list[Block], num_tokens: int, tail: list[int], hasher: BlockHasher, last_hash: int | None,
        lora_name: str | None, lora_id: int | None,
    ) -> None:
        self.blocks: list[Block] = blocks
        self.num_tokens: int = num_tokens
        self.tail: list[int] = tail  # tokens of the partial last block
        self.hasher: BlockHasher = hasher  # the chain so far (it keeps the tail too)
        self.last_hash: int | None = last_hash  # the last full block's: the next event's parent
        self.lora_name = lora_name
        self.lora_id = lora_id
        # Hybrid: one block table per group (``blocks`` is group 0's); a window group's first
        # ``skipped[g]`` entries are None, vLLM's null block, once they left the window.
        self.tables: list[list[Block | None]] = [blocks]  # type: ignore[list-item]
        self.skipped: list[int] = [0]
        # Token positions whose window tails sparse retention keeps: the prompt's replay
        # boundary and a shared-prefix junction (coordinator.cache_blocks).
        self.boundaries: tuple[int, ...] = ()


class PyKVCacheManager:
    """Requests on top of a :class:`BlockPool`: what engines and simulators call.

    Every full block is cached as soon as it fills; hashing is incremental (a request's tokens
    reach the native hash once, one call per ``allocate``/``append``). Public methods are
    serialised by one lock (see the module docstring).

    With ``groups`` (hybrid, see ``kvbridge.engine.pool``) a request holds one block table per
    group, all from the one pool; ``allocate`` hits by :meth:`BlockPool.longest_hit` capped at
    the prompt's last token; ``append`` first releases window blocks its tokens so far no longer
    attend to (vLLM's ``remove_skipped_blocks`` before ``allocate_slots`` allocates).
    """

    def __init__(
        self, num_blocks: int, block_size: int, *, retention_interval: int | None = None, **pool_options: Any
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size, **pool_options)
        self.groups = self.pool.groups
        self.block_size = block_size
        check_retention(retention_interval, block_size, self.groups)
        self.retention_interval = retention_interval
        self._requests: dict[Any, _Request] = {}
        self._lora_ids: dict[str, int] = {}
        self._lock = threading.Lock()

    def _request(self, request_id: Any) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request id {request_id!r}")
        return req

    def allocate(
        self,
        request_id: Any,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        lora_id: int | None = None,
    ) -> int | None:
        """Admit a request with its prompt. Returns how many prompt tokens were found cached
        (a multiple of the block size), or None -- with nothing changed -- when there are not
        enough free blocks. ``lora_id`` defaults to a per-manager id for ``lora_name``."""
        tokens = _as_token_list(token_ids)
        if not tokens:
            raise ValueError("token_ids is empty: a request needs at least one token")
        if lora_name is not None and not isinstance(lora_name, str):
            raise TypeError(f"lora_name must be a str or None, got {type(lora_name).__name__}")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already allocated")
            if self.groups is not None:
                return self._admit_groups(request_id, tokens, lora_name, lora_id)
            pool = self.pool
            bs = self.block_size
            num_full = len(tokens) // bs
            hasher = pool.new_hasher(lora_name)
            hashes, chains = pool.hash_tokens(hasher, tokens, lora_name)
            hit = pool.find_cached_prefix(hashes)
            num_hit = len(hit)
            num_new = -(-len(tokens) // bs) - num_hit
            # Free hits leave the free queue too.
            if num_new + sum(b.ref_cnt == 0 for b in hit) > pool.num_free_blocks:
                return None
            lora_id = self._lora_id(lora_name, lora_id)
            pool.touch(hit)
            new = pool.get_new_blocks(num_new)
            req = _Request(hit, len(tokens), tokens[num_full * bs :], hasher, hashes[-1] if num_full else None, lora_name, lora_id)
            if num_full > num_hit:
                pool.cache_full_blocks(
                    new[: num_full - num_hit],
                    hashes[num_hit:],
                    tokens[num_hit * bs : num_full * bs],
                    parent_block_hash=hashes[num_hit - 1] if num_hit else None,
                    chain_values=chains[num_hit:],
                    lora_name=lora_name,
                    lora_id=lora_id,
                )
            hit += new
            self._requests[request_id] = req
            return num_hit * bs

    def _lora_id(self, lora_name: str | None, lora_id: int | None) -> int | None:
        if lora_name is not None and lora_id is None:
            return self._lora_ids.setdefault(lora_name, len(self._lora_ids) + 1)
        return lora_id

    def _admit_groups(self, request_id: Any, tokens: list[int], lora_name: str | None, lora_id: int | None) -> int | None:
        # KVCacheManager.get_computed_blocks (hit capped at num_tokens - 1) then allocate_slots:
        # touch every group's hit, take each group's new blocks in group order, cache per group.
        pool, bs, groups = self.pool, self.block_size, self.groups
        assert groups is not None
        hasher = pool.new_hasher(lora_name)
        hashes, chains = pool.hash_tokens(hasher, tokens, lora_name)
        n = pool.longest_hit(hashes, (len(tokens) - 1) // bs)
        # A window group leaves the hit's blocks before its window as null blocks, untouched
        # (SingleTypeKVCacheManager.add_local_computed_blocks).
        skipped = [pool.skipped_blocks(g, n * bs) for g in range(len(groups))]
        hits = [[pool.get_cached_block(hashes[i], g) for i in range(s, n)] for g, s in enumerate(skipped)]
        # get_computed_blocks' shared_prefix_boundary: group 0 (the first group the coordinator
        # asks) ran past the hit, a junction a window group has not kept.
        longest = pool.held_prefix(0, hashes, (len(tokens) - 1) // bs) if self.retention_interval is not None else n
        boundaries = (len(tokens) - 1, longest * bs) if longest > n else (len(tokens) - 1,)
        num_new = -(-len(tokens) // bs) - n
        evictable = sum(b.ref_cnt == 0 for hit in hits for b in hit)  # type: ignore[union-attr]
        if num_new * len(groups) + evictable > pool.num_free_blocks:
            return None
        lora_id = self._lora_id(lora_name, lora_id)
        for hit in hits:
            pool.touch(hit)  # type: ignore[arg-type]
        tables: list[list[Block | None]] = [[*([None] * s), *hit] for s, hit in zip(skipped, hits)]
        for table in tables:
            table += pool.get_new_blocks(num_new)
        req = _Request(tables[0], 0, [], hasher, hashes[n - 1] if n else None, lora_name, lora_id)  # type: ignore[arg-type]
        req.tables, req.skipped, req.boundaries = tables, skipped, boundaries
        self._cache_filled(req, n, hashes[n:], chains[n:], tokens[n * bs :])
        self._requests[request_id] = req
        return n * bs

    def _cache_filled(self, req: _Request, full0: int, hashes: list, chains: list, new: list[int]) -> None:
        """Cache the blocks ``new`` (the request's tokens after its first ``full0`` full blocks,
        its tail included) completes, after the first ``full0``, in every group."""
        bs = self.block_size
        tokens = req.tail + new
        req.num_tokens = full0 * bs + len(tokens)
        cut = len(hashes) * bs
        req.tail = tokens[cut:]
        if not hashes:
            return
        parent = req.last_hash if full0 else None
        for g, table in enumerate(req.tables):
            self.pool.cache_full_blocks(
                table[full0 : full0 + len(hashes)],  # type: ignore[arg-type]
                hashes, tokens[:cut], parent_block_hash=parent, chain_values=chains,
                lora_name=req.lora_name, lora_id=req.lora_id, group_idx=g,
                block_mask=self._retained(g, req, full0, full0 + len(hashes)),
            )
        req.last_hash = hashes[-1]

    def _retained(self, g: int, req: _Request, start: int, end: int) -> list[bool] | None:
        """SlidingWindowManager.reachable_block_mask for blocks [start, end) of group g (None:
        all, as for a main group or dense retention): per ``retention_interval``-token segment
        its last k blocks, and the k blocks before each of the request's boundaries, k =
        cdiv(W - 1, block_size) (no EAGLE)."""
        interval, window = self.retention_interval, self.groups[g][1]  # type: ignore[index]
        if interval is None or window is None:
            return None
        bs = self.block_size
        need = -(-(window - 1) // bs)
        mask = [False] * (end - start)
        if interval:
            per_segment = interval // bs
            if need >= per_segment:
                return None
            for i in range(start, end):
                mask[i - start] = i % per_segment >= per_segment - need
        for boundary in req.boundaries:
            last = boundary // bs
            for j in range(max(start, last - need), min(end, last)):
                mask[j - start] = True
        return mask

    def _release_window(self, req: _Request) -> None:
        # SingleTypeKVCacheManager.remove_skipped_blocks: free what the window left behind,
        # last block first (_remove_blocks_in_range), and null it in the table.
        for g, table in enumerate(req.tables):
            first, end = req.skipped[g], min(self.pool.skipped_blocks(g, req.num_tokens), len(table))
            if end > first:
                self.pool.free_blocks(reversed(table[first:end]))  # type: ignore[arg-type]
                table[first:end] = [None] * (end - first)
                req.skipped[g] = end

    def hit_blocks(self, token_ids: Sequence[int], *, lora_name: str | None = None) -> int:
        """How many leading blocks ``allocate(.., token_ids, lora_name=..)`` would hit now,
        changing nothing (see ``kvbridge.engine.pool.NativeKVCacheManager.hit_blocks``)."""
        tokens = _as_token_list(token_ids)
        with self._lock:
            pool = self.pool
            hashes, _ = pool.hash_tokens(pool.new_hasher(lora_name), tokens, lora_name)
            if self.groups is None:
                return len(pool.find_cached_prefix(hashes))
            return pool.longest_hit(hashes, (len(tokens) - 1) // self.block_size) if tokens else 0

    def can_allocate(self, token_ids: Sequence[int], *, lora_name: str | None = None) -> bool:
        """Whether ``allocate(.., token_ids, lora_name=..)`` would succeed now -- the pool can hold
        the whole sequence, its cached prefix counted -- changing nothing (a scheduler's admission
        check before it allocates a long prompt chunk by chunk)."""
        tokens = _as_token_list(token_ids)
        with self._lock:
            pool, bs = self.pool, self.block_size
            hashes, _ = pool.hash_tokens(pool.new_hasher(lora_name), tokens, lora_name)
            hits: list[list[Block | None]]
            if self.groups is None:
                hits = [list(pool.find_cached_prefix(hashes))]
                n = len(hits[0])
            else:
                n = pool.longest_hit(hashes, (len(tokens) - 1) // bs)
                skipped = [pool.skipped_blocks(g, n * bs) for g in range(len(self.groups))]
                hits = [[pool.get_cached_block(hashes[i], g) for i in range(s, n)] for g, s in enumerate(skipped)]
            num_new = -(-len(tokens) // bs) - n
            evictable = sum(b.ref_cnt == 0 for hit in hits for b in hit)  # type: ignore[union-attr]
            return num_new * len(hits) + evictable <= pool.num_free_blocks

    def append(self, request_id: Any, new_token_ids: Sequence[int]) -> bool:
        """Decode growth: add tokens to a running request, caching blocks as they fill.
        Returns False -- with nothing changed -- when there are not enough free blocks."""
        new = _as_token_list(new_token_ids)
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                raise KeyError(f"unknown request id {request_id!r}")
            pool = self.pool
            bs = self.block_size
            num_tokens = req.num_tokens + len(new)
            num_new = -(-num_tokens // bs) - len(req.blocks)
            if self.groups is not None:
                # Hash on a copy: a bad token raises before anything changes, a refusal keeps
                # the request's chain as it was.
                hasher = req.hasher.copy()
                hashes, chains = pool.hash_tokens(hasher, new, req.lora_name)
                self._release_window(req)  # even when the blocks then do not suffice, as vLLM
                if max(num_new, 0) * len(self.groups) > pool.num_free_blocks:
                    return False
                req.hasher = hasher
                for table in req.tables:
                    table += pool.get_new_blocks(max(num_new, 0))
                self._cache_filled(req, req.num_tokens // bs, hashes, chains, new)
                return True
            if num_new > pool.num_free_blocks:
                # Still hash (a copy of the chain): a bad token raises rather than hide as "full".
                pool.hash_tokens(req.hasher.copy(), new, req.lora_name)
                return False
            hashes, chains = pool.hash_tokens(req.hasher, new, req.lora_name)
            full0 = req.num_tokens // bs
            req.num_tokens = num_tokens
            if num_new > 0:
                req.blocks += pool.get_new_blocks(num_new)
            if not hashes:
                req.tail += new
                return True
            tokens = req.tail + new
            cut = len(hashes) * bs
            req.tail = tokens[cut:]
            pool.cache_full_blocks(
                req.blocks[full0 : full0 + len(hashes)],
                hashes,
                tokens[:cut],
                parent_block_hash=req.last_hash,
                chain_values=chains,
                lora_name=req.lora_name,
                lora_id=req.lora_id,
            )
            req.last_hash = hashes[-1]
            return True

    def free(self, request_id: Any) -> None:
        """Release a request's blocks; its cached blocks stay hittable until evicted."""
        with self._lock:
            req = self._request(request_id)
            del self._requests[request_id]
            # Tail first, so a chain's last blocks are evicted before its first ones; group by
            # group (KVCacheCoordinator.free), a window group without its null blocks.
            for table, skipped in zip(req.tables, req.skipped):
                self.pool.free_blocks(reversed(table[skipped:]))  # type: ignore[arg-type]

    def reset(self) -> bool:
        """Clear the prefix cache (``AllBlocksCleared``); False while any request holds blocks."""
        with self._lock:
            return self.pool.reset_prefix_cache()

    def take_events(self) -> list:
        """Drain the recorded events, in order."""
        with self._lock:
            return self.pool.take_events()

    def snapshot(self) -> list[BlockStored]:
        """Every cached block as ``BlockStored`` events, parents before children (hybrid: see
        ``announce_empty_groups``)."""
        with self._lock:
            pool = self.pool
            return announce_empty_groups(pool.snapshot(), pool.groups, pool.block_size, pool.medium)

    def get_block_ids(self, request_id: Any) -> list[int]:
        """The request's block table (hybrid: group 0's)."""
        with self._lock:
            return [b.block_id for b in self._request(request_id).blocks]

    def get_group_block_ids(self, request_id: Any) -> list[list[int | None]]:
        """The request's block table per group; None where a window group released a block."""
        with self._lock:
            return [[None if b is None else b.block_id for b in t] for t in self._request(request_id).tables]

    def num_tokens(self, request_id: Any) -> int:
        with self._lock:
            return self._request(request_id).num_tokens

    def __contains__(self, request_id: Any) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)


