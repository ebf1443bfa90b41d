"""A prefix-caching KV block pool with vLLM v1's semantics that records KV events.

``BlockPool`` is the block level (free queue, ref counts, hash -> cached block map, eviction,
reset); ``KVCacheManager`` is the request level an engine or a simulator calls. Every change to
the set of cached blocks is recorded as ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
events, drained in order by ``take_events()``.

What carries over from vLLM (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``):

* The free queue is in eviction order. Freeing a request puts its blocks back last-block-first,
  so a chain's tail is evicted before its head; blocks that hold a hash go to the tail (kept
  longest), blocks without one go to the head (reused first, they can never be hit).
* A block that is allocated while it still holds a hash is evicted from the cache at that moment.
* A prefix hit on a free block takes it out of the free queue (``touch``), so the blocks needed by
  an allocation are the new ones plus the evictable hits.
* Block ids handed to a request never change, so two blocks may hold the same hash (e.g. two
  requests decoding the same tokens). Unlike vLLM -- which then publishes the same hash twice and
  removes it while another copy is still cached -- the events here describe the *set of cached
  hashes*: a hash is stored when its first copy appears and removed when its last copy goes.
  That keeps the event stream exact for consumers that replay it.

Deliberate differences: there is no null block (no sliding-window or Mamba groups), so all
``num_blocks`` are usable; and ``allocate`` reports a full hit when every prompt block is cached
(vLLM recomputes the last block to get logits -- a scheduling concern, not a caching one).

Threading: ``BlockPool`` is not thread-safe. ``KVCacheManager`` serialises its public methods
with one lock, so a publisher may call ``take_events()`` / ``snapshot()`` from another thread
(e.g. an asyncio loop) while the engine thread allocates. ``snapshot()`` copies the hash map
under the lock (C speed) and builds events after releasing it. A snapshot reflects every event
recorded so far, including those not yet drained by ``take_events()``; re-applying those events
on top of the snapshot converges to the same set, since each hash's state is decided by its
last event.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable, Sequence

from kvbridge.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvbridge.hashing import BlockHasher

__all__ = ["Block", "BlockPool", "KVCacheManager"]

# vLLM's own algorithms chain on full digests; their 64-bit event hash is the digest's tail.
_VLLM_ALGOS = frozenset({"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"})


def _as_token_list(token_ids: Any) -> list[int]:
    # A private copy: the caller may reuse its list, and numpy/array inputs become plain ints.
    tolist = getattr(token_ids, "tolist", None)
    return tolist() if tolist is not None else list(token_ids)


class Block:
    """One KV block. ``block_hash`` is the 64-bit event hash while the block is cached."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """Blocks, their free queue in eviction order, and the hash -> cached block map.

    ``algo``/``seed`` choose the chained hash (see ``kvbridge.hash_blocks``); ``medium`` is put in
    every event. Not thread-safe: callers serialise (``KVCacheManager`` does).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        algo: str = "xxh3",
        seed: Any = None,
        medium: str | None = MEDIUM_GPU,
        enable_events: bool = True,
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if algo == "dynamo":
            raise ValueError("algo 'dynamo' hashes blocks without their prefix; use 'dynamo_seq'")
        BlockHasher(block_size, algo=algo, seed=seed)  # a bad algo or seed fails here
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
        # An OrderedDict is a C doubly linked list: O(1) popleft, append, prepend and removal.
        self._free: OrderedDict[Block, None] = OrderedDict.fromkeys(self.blocks)
        # hash -> (block, parent hash, token ids, (lora_name, lora_id) | None, chain value).
        # One tuple per hash, immutable, so a snapshot can copy the dict and read it unlocked.
        # Insertion order is topological: a hash's parent is cached whenever the hash is (a
        # request's blocks are freed tail first), so parents are always inserted earlier.
        self._cached: dict[int, tuple] = {}
        # Further blocks holding an already cached hash (see the module docstring). Rare.
        self._copies: dict[int, list[Block]] = {}
        self._events: list | None = [] if enable_events else None

    # --- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Distinct cached hashes."""
        return len(self._cached)

    def cached_block_hashes(self) -> list[int]:
        """The cached hashes, parents before children."""
        return list(self._cached)

    def get_cached_block(self, block_hash: int) -> Block | None:
        entry = self._cached.get(block_hash)
        return None if entry is None else entry[0]

    def find_cached_prefix(self, block_hashes: Iterable[int]) -> tuple[list[Block], int]:
        """The cached blocks of the longest cached prefix of ``block_hashes``, and how many of
        them are free (taking them costs free blocks)."""
        cached = self._cached
        hit: list[Block] = []
        evictable = 0
        for h in block_hashes:
            entry = cached.get(h)
            if entry is None:
                break
            block = entry[0]
            hit.append(block)
            if block.ref_cnt == 0:
                evictable += 1
        return hit, evictable

    def new_hasher(self, lora_name: str | None = None, after: int | None = None) -> BlockHasher:
        """A chain for one sequence with this pool's algorithm and seed, starting at the root or
        continuing the cached block ``after`` (so a cached prefix need not be hashed again)."""
        parent = None
        if after is not None:
            entry = self._cached.get(after)
            if entry is None:
                raise KeyError(f"block hash {after} is not cached")
            parent = entry[4]
        if self._lora_in_extra_keys:
            return BlockHasher(self.block_size, algo=self.algo, seed=self.seed, parent=parent)
        return BlockHasher(
            self.block_size, algo=self.algo, seed=self.seed, parent=parent, lora_name=lora_name
        )

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
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0:
                del free[block]
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Pop ``num_blocks`` from the head of the free queue, evicting any cached ones (one
        ``BlockRemoved`` per call for the hashes that left the cache)."""
        free = self._free
        if num_blocks > len(free):
            raise ValueError(f"cannot get {num_blocks} free blocks, {len(free)} are free")
        popitem = free.popitem
        out: list[Block] = []
        removed: list[int] = []
        for _ in range(num_blocks):
            block = popitem(False)[0]
            h = block.block_hash
            if h is not None:
                block.block_hash = None
                if self._drop_cached(block, h):
                    removed.append(h)
            block.ref_cnt = 1
            out.append(block)
        if removed and self._events is not None:
            self._events.append(BlockRemoved(block_hashes=removed, medium=self.medium))
        return out

    def _drop_cached(self, block: Block, h: int) -> bool:
        """Forget that ``block`` holds ``h``; True when that was the hash's last copy."""
        entry = self._cached[h]
        copies = self._copies.get(h)
        if entry[0] is block:
            if not copies:
                del self._cached[h]
                return True
            # The oldest other copy takes over (vLLM hits the first inserted block);
            # re-assigning keeps the hash's place in the order.
            self._cached[h] = (copies.pop(0),) + entry[1:]
        else:
            copies.remove(block)
        if not copies:
            del self._copies[h]
        return False

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[int],
        token_ids: list[int],
        *,
        parent_block_hash: int | None = None,
        chain_values: Sequence[Any] | None = None,
        lora_name: str | None = None,
        lora_id: int | None = None,
    ) -> None:
        """Mark newly filled blocks as cached, as one chain continuing ``parent_block_hash``.

        ``blocks`` must not hold a hash yet; ``token_ids`` are exactly their tokens;
        ``chain_values`` (default: the hashes) is what a later hash continues from. Records one
        ``BlockStored`` -- split into one per run only if some hash was already cached by
        another block, since the event stream reports each cached hash once.
        """
        bs = self.block_size
        n = len(blocks)
        if len(block_hashes) != n or len(token_ids) != n * bs:
            raise ValueError(
                f"{n} blocks need {n} hashes and {n * bs} token ids, "
                f"got {len(block_hashes)} and {len(token_ids)}"
            )
        cached = self._cached
        lora = None if lora_name is None and lora_id is None else (lora_name, lora_id)
        parent = parent_block_hash
        runs: list[tuple[int, int, int | None]] = []
        run_start, run_parent = 0, parent
        i = off = 0
        for block, h, chain in zip(blocks, block_hashes, chain_values or block_hashes):
            block.block_hash = h
            if h not in cached:
                cached[h] = (block, parent, token_ids[off : off + bs], lora, chain)
            else:
                self._copies.setdefault(h, []).append(block)
                if i > run_start:
                    runs.append((run_start, i, run_parent))
                run_start, run_parent = i + 1, h
            parent = h
            i += 1
            off += bs
        if self._events is None:
            return
        if run_start < n:
            runs.append((run_start, n, run_parent))
        for start, end, run_parent in runs:
            self._events.append(
                BlockStored(
                    block_hashes=list(block_hashes[start:end]),
                    parent_block_hash=run_parent,
                    token_ids=token_ids[start * bs : end * bs],
                    block_size=bs,
                    lora_id=lora_id,
                    medium=self.medium,
                    lora_name=lora_name,
                    extra_keys=self._extra_keys(lora_name, end - start),
                )
            )

    def _extra_keys(self, lora_name: str | None, n: int) -> list | None:
        # What vLLM 0.33 publishes: per block, what was mixed into its hash.
        if lora_name is None or not self._lora_in_extra_keys:
            return None
        return [(lora_name,)] * n

    def free_blocks(self, ordered_blocks: Iterable[Block]) -> None:
        """Drop one reference per block; ``ordered_blocks`` is eviction order, first evicted
        first. Blocks reaching zero go to the tail if cached, to the head if not."""
        free = self._free
        fresh: list[Block] = []
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block!r} is already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    fresh.append(block)
                else:
                    free[block] = None
        for block in reversed(fresh):
            free[block] = None
            free.move_to_end(block, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for entry in self._cached.values():
            entry[0].block_hash = None
        for copies in self._copies.values():
            for block in copies:
                block.block_hash = None
        self._cached = {}
        self._copies = {}
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
        into an empty view reproduces the cached set."""
        return self._snapshot_events(list(self._cached.items()))

    def _snapshot_events(self, items: list[tuple[int, tuple]]) -> list[BlockStored]:
        # Consecutive entries that continue each other (same LoRA) become one event, as they
        # were usually stored: a snapshot of a long chain is one event, not one per block.
        out: list[BlockStored] = []
        hashes: list[int] = []
        tokens: list[int] = []
        first_parent: int | None = None
        lora: tuple | None = None
        last: int | None = None
        for h, (_, parent, block_tokens, block_lora, _) in items:
            if hashes and (parent != last or block_lora != lora):
                out.append(self._stored(hashes, first_parent, tokens, lora))
                hashes, tokens = [], []
            if not hashes:
                first_parent, lora = parent, block_lora
            hashes.append(h)
            tokens += block_tokens
            last = h
        if hashes:
            out.append(self._stored(hashes, first_parent, tokens, lora))
        return out

    def _stored(self, hashes: list[int], parent: int | None, tokens: list[int], lora) -> BlockStored:
        lora_name, lora_id = lora or (None, None)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=self.block_size,
            lora_id=lora_id,
            medium=self.medium,
            lora_name=lora_name,
            extra_keys=self._extra_keys(lora_name, len(hashes)),
        )


class _Request:
    __slots__ = ("blocks", "tokens", "hasher", "last_hash", "lora_name", "lora_id")

    def __init__(self, blocks, tokens, hasher, last_hash, lora_name, lora_id) -> None:
        self.blocks: list[Block] = blocks
        self.tokens: list[int] = tokens
        self.hasher: BlockHasher = hasher  # the chain so far, plus the partial block's tokens
        self.last_hash: int | None = last_hash  # the last full block's: the next event's parent
        self.lora_name = lora_name
        self.lora_id = lora_id


class KVCacheManager:
    """Requests on top of a :class:`BlockPool`: what engines and simulators call.

    Every full block is cached as soon as it fills; hashing is incremental (each block is hashed
    once per request, with one native call per ``allocate``/``append``). Public methods are
    serialised by one lock (see the module docstring).
    """

    def __init__(self, num_blocks: int, block_size: int, **pool_options: Any) -> None:
        self.pool = BlockPool(num_blocks, block_size, **pool_options)
        self.block_size = block_size
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
            if lora_name is not None and lora_id is None:
                lora_id = self._lora_ids.setdefault(lora_name, len(self._lora_ids) + 1)
            pool = self.pool
            bs = self.block_size
            num_full = len(tokens) // bs
            hasher = pool.new_hasher(lora_name)
            hashes, chains = pool.hash_tokens(hasher, tokens, lora_name)
            hit, evictable = pool.find_cached_prefix(hashes)
            num_hit = len(hit)
            num_new = -(-len(tokens) // bs) - num_hit
            if num_new + evictable > pool.num_free_blocks:
                return None
            pool.touch(hit)
            new = pool.get_new_blocks(num_new)
            if num_full > num_hit:
                pool.cache_full_blocks(
                    new[: num_full - num_hit],
                    hashes[num_hit:],
                    tokens[num_hit * bs : num_full * bs],
                    parent_block_hash=hashes[num_hit - 1] if num_hit else None,
                    chain_values=chains[num_hit:] if chains is not hashes else None,
                    lora_name=lora_name,
                    lora_id=lora_id,
                )
            hit += new
            self._requests[request_id] = _Request(
                hit, tokens, hasher, hashes[-1] if num_full else None, lora_name, lora_id
            )
            return num_hit * bs

    def append(self, request_id: Any, new_token_ids: Sequence[int]) -> bool:
        """Decode growth: add tokens to a running request, caching blocks as they fill.
        Returns False -- with nothing changed -- when there are not enough free blocks."""
        new = _as_token_list(new_token_ids)
        with self._lock:
            req = self._request(request_id)
            if not new:
                return True
            pool = self.pool
            bs = self.block_size
            tokens = req.tokens
            full0 = len(tokens) // bs
            num_new = -(-(len(tokens) + len(new)) // bs) - len(req.blocks)
            if num_new > pool.num_free_blocks:
                # Still hash (a copy of the chain): a bad token raises rather than hide as "full".
                pool.hash_tokens(req.hasher.copy(), new, req.lora_name)
                return False
            hashes, chains = pool.hash_tokens(req.hasher, new, req.lora_name)
            tokens += new
            if num_new > 0:
                req.blocks += pool.get_new_blocks(num_new)
            if hashes:
                full1 = full0 + len(hashes)
                pool.cache_full_blocks(
                    req.blocks[full0:full1],
                    hashes,
                    tokens[full0 * bs : full1 * bs],
                    parent_block_hash=req.last_hash,
                    chain_values=chains if chains is not hashes else None,
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
            # Tail first, so a chain's last blocks are evicted before its first ones.
            self.pool.free_blocks(reversed(req.blocks))

    def reset(self) -> bool:
        """Clear the prefix cache (``AllBlocksCleared``); False while any request holds blocks."""
        with self._lock:
            return self.pool.reset_prefix_cache()

    def take_events(self) -> list:
        """Drain the recorded events, in order."""
        with self._lock:
            return self.pool.take_events()

    def snapshot(self) -> list[BlockStored]:
        """Every cached block as ``BlockStored`` events, parents before children."""
        with self._lock:
            items = list(self.pool._cached.items())
        return self.pool._snapshot_events(items)

    def get_block_ids(self, request_id: Any) -> list[int]:
        """The request's block table."""
        with self._lock:
            return [b.block_id for b in self._request(request_id).blocks]

    def num_tokens(self, request_id: Any) -> int:
        with self._lock:
            return len(self._request(request_id).tokens)

    def __contains__(self, request_id: Any) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)
