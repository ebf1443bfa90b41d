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
from kvbridge.pool import BlockPool, KVCacheManager

__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "KVCacheManager",
    "KVEventBatch",
    "__version__",
    "decode_batch",
    "encode_batch",
]
