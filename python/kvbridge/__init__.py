"""kvbridge: an LLM engine's KV-cache block events, loss-free on NATS."""

from kvbridge._native import Index, __version__
from kvbridge.config import Config, ConfigError
from kvbridge.connection import AuthenticationError, ConnectError, PermissionDeniedError, WorkerIdInUseError
from kvbridge.consumer import KvEventSubscriber, Update, WorkerView
from kvbridge.errors import Error
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
from kvbridge.jetstream import JetStreamError
from kvbridge.pool import KVCacheManager
from kvbridge.publisher import BackgroundPublisher, KvEventPublisher
from kvbridge.router import Router
from kvbridge.service import IndexClient, IndexService

__all__ = [
    "ALGORITHMS",
    "AllBlocksCleared",
    "AuthenticationError",
    "BackgroundPublisher",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "Config",
    "ConfigError",
    "ConnectError",
    "DecodeError",
    "Index",
    "IndexClient",
    "IndexService",
    "Error",
    "JetStreamError",
    "KVCacheManager",
    "KVEventBatch",
    "KvEventPublisher",
    "KvEventSubscriber",
    "PermissionDeniedError",
    "Router",
    "Update",
    "WorkerIdInUseError",
    "WorkerView",
    "__version__",
    "decode_batch",
    "encode_batch",
    "hash_blocks",
]
