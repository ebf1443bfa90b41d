"""kvbridge: an LLM engine's KV-cache block events, loss-free on NATS.

The package is laid out by role: ``wire`` (the bytes and hashes vLLM defines), ``bus`` (NATS:
connection, outbox, publisher, sequencer, subscriber, JetStream), ``engine`` (the block pool and the
attachments to a running engine: relay, vLLM plugin), ``routing`` (router, index service; the Index
itself is native), ``replay`` (routing policies compared by time on a trace, in a simulated fleet)
and ``tools`` (CLI, demo, local nats-server). ``config``, ``errors`` and
``metrics`` serve every room. The names below are the public API.
"""

from kvbridge._native import Index, __version__
from kvbridge.config import Config, ConfigError
from kvbridge.errors import DiscoveryError, Error, NatsServerError
from kvbridge.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    KVEventBatch,
    LoadReport,
    decode_batch,
    encode_batch,
)
from kvbridge.wire.hashing import ALGORITHMS, BlockHasher, hash_blocks
from kvbridge.bus.connection import AuthenticationError, ConnectError, PermissionDeniedError, WorkerIdInUseError
from kvbridge.bus.jetstream.admin import JetStreamError
from kvbridge.bus.publisher import BackgroundPublisher, KvEventPublisher
from kvbridge.bus.subscriber import KvEventSubscriber
from kvbridge.bus.update import Update, WorkerView
from kvbridge.engine.pool import KVCacheManager
from kvbridge.routing.router import NoWorkersError, Router
from kvbridge.routing.work import EngineModel, hit_tokens
from kvbridge.replay.trace import TraceError
from kvbridge.routing.service import IndexClient, IndexQueryError, IndexService, IndexUnavailableError

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
    "DiscoveryError",
    "EngineModel",
    "Index",
    "IndexClient",
    "IndexQueryError",
    "IndexService",
    "IndexUnavailableError",
    "Error",
    "JetStreamError",
    "KVCacheManager",
    "KVEventBatch",
    "KvEventPublisher",
    "KvEventSubscriber",
    "LoadReport",
    "NatsServerError",
    "NoWorkersError",
    "PermissionDeniedError",
    "Router",
    "TraceError",
    "Update",
    "WorkerIdInUseError",
    "WorkerView",
    "__version__",
    "decode_batch",
    "encode_batch",
    "hash_blocks",
    "hit_tokens",
]
