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

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "KVEventBatch",
    "__version__",
    "decode_batch",
    "encode_batch",
]
