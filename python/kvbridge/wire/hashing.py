"""Chained KV-block hashing: one hash per full block of token ids, each covering its whole prefix.

The work happens in the native core (``kvbridge._native``); this module is where the algorithms
are defined for readers. A trailing partial block is never hashed.

``algo``:

``"xxh3"`` (default; kvbridge's own fast chain)
    ``h[-1] = seed`` (0 by default; a str/bytes seed is first reduced with XXH3_64), salted like
    Dynamo: ``+ XXH3_64(lora_name, seed=0) + XXH3_64(cache_namespace, seed=1)`` (mod 2**64, empty
    strings are absent). ``h[i] = XXH3_64(block i as u32 little-endian, seed=s[i])`` where
    ``s[i] = h[i-1]``, or for a block with extra keys ``s[i] = XXH3_64(canonical CBOR of the
    extra keys, seed=h[i-1])``. Chaining through the seed lets a token buffer be hashed in place.
``"dynamo"``
    Dynamo's ``compute_block_hash_for_seq`` (LocalBlockHash, content only, not chained):
    XXH3_64 over the block's u32 LE tokens, then its multimodal hashes (``extra_keys[i]`` = a
    tuple of ints) sorted as u64 LE, seed ``1337 + XXH3_64(lora_name, 0) + XXH3_64(ns, 1)``.
``"dynamo_seq"``
    Dynamo's SequenceHash over those local hashes: ``seq[0] = local[0]``,
    ``seq[i] = XXH3_64(seq[i-1] u64 LE ++ local[i] u64 LE, seed=1337)``.
``"sha256"``, ``"sha256_cbor"``, ``"xxhash"``, ``"xxhash_cbor"``
    vLLM's ``hash_block_tokens``, byte for byte: ``d[i] = H(ser((d[i-1] or NONE_HASH,
    tuple(block_i), extra_keys[i])))`` with ``ser`` = ``pickle.dumps(protocol=5)`` or
    ``cbor2.dumps(canonical=True)`` and ``H`` = SHA-256 or XXH3-128 (big-endian digest).
    ``NONE_HASH = H(ser(seed))``, seed = the ``seed`` argument, else ``$PYTHONHASHSEED``, else
    ``"vllm-none-hash"`` (vLLM itself picks a random seed for the xxhash variants when
    PYTHONHASHSEED is unset; pass the seed that vLLM process used).

Outputs: by default ints, vLLM's 64-bit event hash (``int.from_bytes(d, "big") & (2**64-1)``,
i.e. the digest's last 8 bytes); the 64-bit algorithms' hash is that int itself. With
``as_bytes=True``: full digests (32 bytes for sha256*, 16 for xxhash*, 8 big-endian bytes for
xxh3/dynamo*). ``out=`` takes a writable uint64 buffer (numpy ``uint64``, ``array('Q')``)
instead: the 64-bit hashes are written into it and the number of blocks is returned, which
skips creating a Python int per block (the main cost once tokens come from a buffer).

``parent`` continues a chain instead of starting one, so a growing request is hashed block by
block, never from the start: for vLLM algorithms the previous block's full digest (bytes; the
64-bit event hash cannot continue a chain and is rejected), for xxh3/dynamo_seq the previous
hash (int or its 8 bytes). With a parent, ``seed`` only matters through the parent (for
``dynamo_seq``, lora/namespace still salt every block's local hash). ``dynamo`` takes no parent.

``extra_keys``: None or one entry per full block, each None or a tuple of str/int/bytes/bool/
None/nested tuples (vLLM: LoRA, multimodal, cache salt keys, as vLLM builds them; Dynamo: the
block's multimodal object hashes). vLLM algorithms reject ``lora_name``/``cache_namespace``:
put those in ``extra_keys`` as the engine version does. Pickle memoizes by object identity, so
the same str/bytes/tuple object twice in one block's key pickles as a back-reference; that is
reproduced exactly. Subclasses (namedtuple, enums) and floats are rejected rather than guessed.

Tokens: list/tuple of int, array.array, numpy arrays or any 1-D buffer of 32- or 64-bit ints
(numpy is never imported), or any iterable of ints. Ids must lie in 0..2**32-1. A list's ints are
read straight from CPython's int layout on the versions where it is known and self-tested (as the
batch encoder does); ``KVBRIDGE_ENCODE_STABLE_API=1`` forces the C API for both.
Long inputs (64k tokens and more) are hashed with the GIL released.

``BlockHasher`` keeps one sequence's chain state for the block pool: ``update(tokens)`` returns the
hashes of the blocks those tokens complete and keeps the partial block for the next call.

    >>> hash_blocks(prompt_ids, 16, algo="sha256")            # vLLM's default, as event hashes
    >>> d = hash_blocks(prompt_ids, 16, algo="sha256", as_bytes=True)
    >>> hash_blocks(more_ids, 16, algo="sha256", parent=d[-1])  # continue the chain
    >>> h = BlockHasher(16, algo="sha256"); h.update(prompt_ids); h.update([next_token])
"""
from kvbridge._native import ALGORITHMS, BlockHasher, hash_blocks

__all__ = ["ALGORITHMS", "BlockHasher", "hash_blocks"]
