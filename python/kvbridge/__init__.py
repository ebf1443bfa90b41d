"""kvbridge: an LLM engine's KV-cache block events, loss-free on NATS."""

from kvbridge._native import __version__
from kvbridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from kvbridge.hashing import ALGORITHMS, BlockHasher, hash_blocks

__all__ = [
    "ALGORITHMS",
    "AllBlocksCleared",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "KVEventBatch",
    "__version__",
    "decode_batch",
    "encode_batch",
    "hash_blocks",
]
