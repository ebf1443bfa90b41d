"""Type stub for kvbridge._native, the Rust core: the contract between Rust and Python.

Each part of the core adds its own section below.
"""
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Literal, SupportsIndex, TypeAlias, final, overload

from typing_extensions import Buffer, disjoint_base

__version__: str
__all__ = [
    "__version__",
    "ProvisionalResidency",
    "RouterCore",
    "hash_blocks",
    "BlockHasher",
    "ALGORITHMS",
    "encode_batch_msgpack",
    "_encode_layout",
    "scan_batch_msgpack",
    "BatchDecoder",
    "unpack_query_ints",
    "eventfd_signal",
    "eventfd_consume",
    "timerfd_new",
    "timerfd_every",
    "KVCacheManager",
    "EventRecord",
    "encode_records",
    "Index",
    "parse_nats_headers",
    "scan_nats_msgs",
    "ResidencyView",
    "ReadBatch",
    "read_batch",
]

# --- chained block hashing (rust/hash.rs; documented in kvbridge.wire.hashing) --------------------

Algorithm: TypeAlias = Literal[
    "xxh3", "dynamo", "dynamo_seq", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor"
]
#: list/tuple of int, a 1-D buffer of 32/64-bit ints (array.array, numpy), or any iterable of int.
Tokens: TypeAlias = Buffer | Iterable[SupportsIndex]
ExtraKeyItem: TypeAlias = str | int | bytes | bool | None | tuple["ExtraKeyItem", ...]
#: One per full block: None, or a tuple (vLLM: LoRA/multimodal/salt keys; Dynamo: mm hashes).
ExtraKey: TypeAlias = tuple[ExtraKeyItem, ...] | None
Seed: TypeAlias = str | bytes | int

ALGORITHMS: Final[tuple[Algorithm, ...]]

@overload
def hash_blocks(
    tokens: Tokens,
    block_size: int,
    *,
    algo: Algorithm = "xxh3",
    seed: Seed | None = None,
    parent: bytes | int | None = None,
    extra_keys: Sequence[ExtraKey] | None = None,
    as_bytes: Literal[False] = False,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
    out: None = None,
) -> list[int]: ...
@overload
def hash_blocks(
    tokens: Tokens,
    block_size: int,
    *,
    algo: Algorithm = "xxh3",
    seed: Seed | None = None,
    parent: bytes | int | None = None,
    extra_keys: Sequence[ExtraKey] | None = None,
    as_bytes: Literal[True],
    lora_name: str | None = None,
    cache_namespace: str | None = None,
    out: None = None,
) -> list[bytes]: ...
@overload
def hash_blocks(
    tokens: Tokens,
    block_size: int,
    *,
    algo: Algorithm = "xxh3",
    seed: Seed | None = None,
    parent: bytes | int | None = None,
    extra_keys: Sequence[ExtraKey] | None = None,
    as_bytes: Literal[False] = False,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
    out: Buffer,
) -> int:
    """Writes the 64-bit hashes into `out` (numpy uint64 / array('Q')); returns the block count."""

@final
class BlockHasher:
    """One growing sequence's chain: update() returns the hashes of newly completed blocks."""

    def __new__(
        cls,
        block_size: int,
        *,
        algo: Algorithm = "xxh3",
        seed: Seed | None = None,
        parent: bytes | int | None = None,
        lora_name: str | None = None,
        cache_namespace: str | None = None,
    ) -> BlockHasher: ...
    @overload
    def update(
        self, tokens: Tokens, extra_keys: Sequence[ExtraKey] | None = None, *, as_bytes: Literal[False] = False
    ) -> list[int]: ...
    @overload
    def update(
        self, tokens: Tokens, extra_keys: Sequence[ExtraKey] | None = None, *, as_bytes: Literal[True]
    ) -> list[bytes]: ...
    def copy(self) -> BlockHasher: ...
    def __copy__(self) -> BlockHasher: ...
    @property
    def algo(self) -> Algorithm: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int:
        """Full blocks hashed so far."""
    @property
    def num_pending(self) -> int:
        """Tokens waiting for their block to fill."""
    @property
    def parent(self) -> bytes | None:
        """The digest the next block chains on, as as_bytes=True returns it."""
    @property
    def last_hash(self) -> int | None:
        """The last block's 64-bit hash."""

# --- batch encoding (rust/encode.rs; used through kvbridge.wire.events.encode_batch) ---------------

from kvbridge.wire.events import KVEventBatch
def encode_batch_msgpack(batch: KVEventBatch) -> bytes:
    """The exact bytes ``msgspec.msgpack.Encoder().encode(batch)`` writes, built natively.

    Accepts any msgspec Struct built from None, bool, int (-2**63 .. 2**64-1), float, str,
    bytes, bytearray, list, tuple and dict (and their subclasses msgspec also accepts), nested
    up to 256 levels. Raises TypeError for anything else (memoryview, set, enums, datetimes,
    Struct types with omit_defaults and a non-None default, ...) rather than write other bytes;
    OverflowError and UnicodeEncodeError exactly where msgspec raises them.
    Set KVBRIDGE_ENCODE_STABLE_API=1 before the first call to skip the direct reads of
    CPython int/list internals (a testing knob; the bytes are the same).
    """

def _encode_layout() -> Literal["api", "signed-size", "tagged-value"]:
    """Which CPython int/list reader the encoder uses here; "api" when the fast path is off."""

# --- hash-only batch reading (rust/scan.rs; the rule's Python spec's ops, for the tests) -----------

#: (ts, data_parallel_rank, n_events, n_blocks, ops), each op (kind, hashes, medium, group_idx,
#: root, spec_kind, window, n_events) with kind 0 = stored, 1 = removed, 2 = all cleared;
#: consecutive events of one kind and the same medium, group_idx, spec kind and window merged, a
#: parent-None store always starting an op (root: its length, else 0) -- kvbridge.wire.residency.Op.
#: None when the payload is not vLLM's msgpack shape and needs a full decode.
def scan_batch_msgpack(
    payload: bytes
) -> tuple[
    float,
    int | None,
    int,
    int,
    list[tuple[int, list[int | bytes], str | None, int | None, int, str | None, int | None, int]],
] | None: ...

# --- native batch decode (rust/decode.rs; used by kvbridge.wire.events.decode_batch) -----------

@final
class BatchDecoder:
    """Decodes vLLM 0.33's msgpack ``KVEventBatch`` into the given Structs, sharing one int per
    token id value; equal to msgspec's decode whenever it answers."""

    def __new__(cls, batch: type, stored: type, removed: type, cleared: type) -> BatchDecoder: ...
    def decode(self, payload: bytes) -> object | None:
        """The batch, or None for a payload in a shape it does not read (msgspec decodes it)."""

# --- NATS protocol reading (rust/natsproto.rs; used by kvbridge.bus.natsclient) -------------------

#: The dict nats-py 2.16's Client._process_headers makes of an all-ASCII header block without an
#: inline status ({} where it makes None); None for any other block (nats-py parses those).
def parse_nats_headers(block: bytes) -> dict[str, str] | None: ...

#: The complete MSG/HMSG frames (in the server's form) at the head of a read buffer, at most
#: max_frames, each as nats-py's parser passes it to Client._process_msg: (sid, subject, reply,
#: payload, headers or None); the number of bytes they take; and whether what follows is the
#: start of a frame still arriving (True) rather than something for nats-py's parser.
def scan_nats_msgs(
    buf: bytearray, max_frames: int = 4096
) -> tuple[list[tuple[int, bytes, bytes, bytes, bytes | None]], int, bool]: ...

# --- publisher wake-up (rust/wake.rs) -------------------------------------------------------------

#: Add 1 to a non-blocking eventfd without releasing the GIL; False if the write failed.
def eventfd_signal(fd: int) -> bool: ...
#: Read (reset) a non-blocking eventfd or timerfd without releasing the GIL; True if it was signalled.
def eventfd_consume(fd: int) -> bool: ...
#: A non-blocking timerfd (CLOCK_MONOTONIC), or -1.
def timerfd_new() -> int: ...
#: Fire every interval_ns (0 disarms); False on error.
def timerfd_every(fd: int, interval_ns: int) -> bool: ...

# --- block pool (rust/pool.rs; used through kvbridge.engine.pool.NativeKVCacheManager) ------------

from typing import Any, Hashable
from kvbridge.wire.events import AllBlocksCleared, BlockRemoved, BlockStored

@disjoint_base
class KVCacheManager:
    """The request level of the prefix-caching block pool; kvbridge.engine.pool documents it.
    One mutex serialises every method; none releases the GIL except to hash >= 64k tokens."""

    def __new__(
        cls,
        num_blocks: int,
        block_size: int,
        *,
        algo: Algorithm = "xxh3",
        seed: Seed | None = None,
        medium: str | None = "GPU",
        enable_events: bool = True,
        groups: Sequence[tuple[str, int | None] | list[Any]] | None = None,
        retention_interval: int | None = None,
    ) -> KVCacheManager: ...
    @property
    def groups(self) -> tuple[tuple[str, int | None], ...] | None: ...
    @property
    def retention_interval(self) -> int | None: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def algo(self) -> Algorithm: ...
    @property
    def seed(self) -> Any: ...
    @property
    def medium(self) -> str | None: ...
    def allocate(
        self, request_id: Hashable, token_ids: Tokens, *, lora_name: str | None = None, lora_id: int | None = None
    ) -> int | None: ...
    def append(self, request_id: Hashable, new_token_ids: Tokens) -> bool: ...
    def free(self, request_id: Hashable) -> None: ...
    def reset(self) -> bool: ...
    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]: ...
    def take_record(self) -> EventRecord:
        """take_events() kept native: no Python object per event until EventRecord.events()."""
    def snapshot(self) -> list[BlockStored]: ...
    def get_block_ids(self, request_id: Hashable) -> list[int]: ...
    def get_group_block_ids(self, request_id: Hashable) -> list[list[int | None]]: ...
    def hit_blocks(self, token_ids: Tokens, *, lora_name: str | None = None) -> int: ...
    def can_allocate(self, token_ids: Tokens, *, lora_name: str | None = None) -> bool:
        """Whether ``allocate(.., token_ids)`` would succeed now (the pool can hold the whole
        sequence, its cached prefix counted); changes nothing."""
    def num_tokens(self, request_id: Hashable) -> int: ...
    def __contains__(self, request_id: Hashable, /) -> bool: ...
    def __len__(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    def cached_block_hashes(self) -> list[int]: ...
    def free_block_ids(self) -> list[int]: ...
    def block_states(self) -> list[tuple[int, int | None]]:
        """(ref_cnt, block_hash or None) per block id."""

@final
class EventRecord:
    """A KVCacheManager's drained events as it recorded them (``take_record()``)."""

    @property
    def n_blocks(self) -> int:
        """Block events: the hashes its BlockStored and BlockRemoved events carry."""
    def __len__(self) -> int: ...
    def events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """What take_events() would have returned (new objects on each call)."""

def encode_records(records: list[EventRecord], ts: float, data_parallel_rank: int | None) -> bytes | None:
    """encode_batch(KVEventBatch(ts, [each record's events...], data_parallel_rank)) written from
    the records; None when they hold an event left to msgspec (a LoRA's, a hybrid pool's)."""

# --- the global KV index (rust/index.rs; exported as kvbridge.Index) ------------------------------

@final
class Index:
    """Per worker, medium and KV-cache group, which KV blocks it holds; per query, how many
    leading blocks of a prompt each worker would hit. Thread-safe: queries run while other threads apply events.

    key="tokens" (default): blocks are keyed by the index's own chain, the xxh3 hash of
    ``hash_blocks(tokens, block_size, algo="xxh3", lora_name=..., extra_keys=...)``, computed from
    each BlockStored's token ids (so it does not matter which hash the engine used); the LoRA
    name vLLM repeats as the first extra key of each block is left out (``lora_name`` salts
    instead), and an empty extra-key entry counts as None. key="engine": keyed by the engines'
    block hashes (bytes hashes reduced as vLLM does: the last 8 bytes, big-endian); queries then
    pass ``block_hashes``. Removing a block removes that block only.

    Residency is per (worker, medium, KV-cache group, locality); ``group_idx`` None is group 0.
    A block stored twice (vLLM does not de-duplicate) needs two removals, except a chain from
    block 0 that the (worker, medium, group) already holds whole (vLLM's full-report
    re-announce) in a worker without window or mamba groups. Token-less placeholders (``block_size`` 0) and sparse window/mamba stores are
    keyed through the worker's earlier stores of the same engine hash (key="tokens"). A worker's
    hit is vLLM's: the blocks all its full-attention groups hold, cut back to the largest n
    where each sliding-window group holds its last max(1, cdiv(W - 1, block_size)) blocks before
    n (a mamba group: block n - 1); other kinds are kept, not scored. A group whose ``block_size`` is a
    multiple m of the index's is read at its own size (its block i is the index's block
    (i + 1) * m - 1, windows counted in its blocks) and hits are multiples of the lcm of the
    groups' m, as vLLM aligns them (docs/hybrid.md); other sizes are ``block_size_mismatches``.
    """

    def __new__(cls, block_size: int = 16, key: Literal["tokens", "engine"] = "tokens") -> Index: ...
    def apply(
        self,
        worker: str,
        data: bytes | bytearray | memoryview | KVEventBatch,
        format: Literal["msgpack", "json"] | None = None,
    ) -> int:
        """Applies one payload (msgpack or JSON; None = JSON if it starts with '[' or '{') or a
        decoded batch; returns its number of events, 0 if it is not a batch (counted)."""
    def apply_many(
        self,
        messages: Iterable[tuple[str, bytes | bytearray | memoryview | KVEventBatch]],
        format: Literal["msgpack", "json"] | None = None,
    ) -> list[int]:
        """``apply`` of each ``(worker, data)`` in order (a backlog of messages, a batch received
        at once): the same index, counters and return values as one call each. From 64 KiB of
        payloads they are read on a second thread while this one applies those before; the
        index is locked (and the GIL released) for the whole call."""
    @overload
    def find_matches(
        self,
        tokens: Tokens | None = None,
        *,
        block_hashes: Iterable[int | bytes] | Buffer | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[ExtraKey | list[ExtraKeyItem]] | None = None,
        medium: str | None = None,
        by_medium: Literal[False] = False,
        remote: bool = False,
        lists: Literal[False] = False,
        top_k: int | None = None,
    ) -> dict[str, int]:
        """{worker: leading blocks it would hit} for each worker with a hit; ``medium``: in that
        medium only; ``remote``: credit copies stored with locality "REMOTE"."""
    @overload
    def find_matches(
        self,
        tokens: Tokens | None = None,
        *,
        by_medium: Literal[True],
        block_hashes: Iterable[int | bytes] | Buffer | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[ExtraKey | list[ExtraKeyItem]] | None = None,
        medium: str | None = None,
        remote: bool = False,
    ) -> dict[str, dict[str | None, int]]:
        """{worker: {medium: hit on that medium's blocks alone}}, hits of 0 left out."""
    @overload
    def find_matches(
        self, tokens: Tokens | None = None, *, block_hashes: Iterable[int | bytes] | Buffer | None = None,
        lora_name: str | None = None, extra_keys: Sequence[ExtraKey | list[ExtraKeyItem]] | None = None,
        medium: str | None = None, by_medium: Literal[False] = False, remote: bool = False,
        lists: Literal[True], top_k: int | None = None,
    ) -> tuple[list[str], list[int]]:
        """The answer as parallel lists (workers, hits) in worker id order, no dict built; with
        ``top_k`` the k longest hits, longest first (ties in worker id order). ``block_hashes``
        as a buffer (array('Q'), numpy uint64, or bytes of packed native-endian 64-bit ints) and
        ``tokens`` as one (array('I'), numpy) are read without a Python int per item; bytes and
        aligned contiguous buffers in place, without a copy (the cheapest call)."""
    def remove_worker(self, worker: str) -> None: ...
    def clears(self, worker: str) -> int | None:
        """How many times ``worker``'s cache was cleared (AllBlocksCleared) since the index first
        heard of it; None for a worker it does not know."""
    def clear(self) -> None: ...
    @property
    def workers(self) -> list[str]:
        """Workers heard from (a well-formed payload, even an empty one), sorted."""
    @property
    def memory_bytes(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def key(self) -> Literal["tokens", "engine"]: ...
    @property
    def stats(self) -> dict[str, int]:
        """payloads, events, blocks_stored, blocks_removed, cleared, unknown_parents,
        block_size_mismatches, events_without_tokens, malformed_payloads, unknown_removes,
        bad_extra_keys, bad_token_ids, too_many_media (over 256 (medium, group, locality)
        classes), too_many_workers, bad_groups, bad_windows, unknown_kinds,
        unscored_group_events, unresolved_placeholders, unresolved_hashes (counters since
        creation, kept by clear()); blocks, workers (now)."""
    def __len__(self) -> int:
        """Distinct blocks held by any worker."""


# rust/index/args.rs: the index service's query fields (kvbridge.routing.service)
def unpack_query_ints(raw: Buffer, field: str) -> memoryview | None:
    """A query field's msgpack array of ints (a msgspec.Raw) as a memoryview of packed ints ('I'
    for "tokens", else 'Q'); None when absent or nil; ValueError in msgspec's words."""

# --- views from payload bytes (rust/view.rs; behind engine.relay.RelayView and bus.update.WorkerView) ---

@final
class ReadBatch:
    """A msgpack ``KVEventBatch`` in vLLM 0.33's shape read whole and checked (as
    ``scan_batch_msgpack`` checks it), not applied: ``ResidencyView.apply_read`` applies it
    without reading the bytes again. Holds the payload and its events' hashes."""

    @property
    def ts(self) -> float: ...
    @property
    def rank(self) -> int | None:
        """``data_parallel_rank``."""
    @property
    def n_events(self) -> int: ...
    @property
    def n_blocks(self) -> int:
        """Block hashes stored and removed."""

def read_batch(payload: bytes) -> ReadBatch | None:
    """Reads a payload for a view (GIL released from 16 KiB); None for any payload
    ``scan_batch_msgpack`` would not read."""

@final
class ResidencyView:
    """What an engine's cache holds, kept from its msgpack payloads by the rule of
    ``kvbridge.wire.residency`` (per ``(medium, group)``, each block's copies; each group's kind
    and window and largest block size; the full-report re-announce exception; bad ``group_idx``,
    unknown kinds and window kinds without a window skipped and counted): the one place the
    package's views run it, held to its Python spec ``Residency`` by the tests. Reads like a
    ``Residency``. With ``sources=True`` (the relay's) each copy keeps the msgpack bytes of the
    ``BlockStored`` it came in, for snapshots; ``sources=False`` (a subscriber's ``WorkerView``)
    keeps hashes only. Not thread-safe: one caller at a time (the relay holds its publisher's
    lock, a subscriber runs on its loop)."""

    def __new__(cls, sources: bool = True) -> ResidencyView: ...
    @property
    def keeps_sources(self) -> bool:
        """Whether copies keep their source events' bytes (``sources=``)."""
    def clear(self) -> None:
        """Forgets every block, kind and size, as an ``AllBlocksCleared`` does (counters stay)."""
    def apply(self, payload: bytes) -> tuple[int, int] | None:
        """Applies a ``KVEventBatch`` in vLLM 0.33's msgpack shape whole (with the GIL released
        from 16 KiB), returning ``(events, block hashes)``; None, applying nothing, for any
        payload ``scan_batch_msgpack`` would not read either."""
    def apply_read(self, batch: ReadBatch) -> tuple[int, int]:
        """Applies a batch :func:`read_batch` read (its bytes are not read again), whole:
        ``(events, block hashes)``."""
    @property
    def held(self) -> dict[tuple[str | None, int], dict[int | bytes, int]]:
        """``{(medium, group): {hash: copies}}``, built on each call."""
    @property
    def kinds(self) -> dict[int, tuple[str, int | None]]:
        """``{group: (kind, window or None)}``, in the order groups first named a kind."""
    @property
    def sizes(self) -> dict[int, int]:
        """``{group: largest block_size}`` of the stores the rule did not skip, since the last clear."""
    @property
    def stats(self) -> dict[str, int]:
        """bad_groups, bad_windows, unknown_kinds, unscored_group_events, unknown_removes."""
    def counts(self) -> dict[tuple[str | None, int], int]:
        """Blocks each ``(medium, group)`` holds, a block with copies once."""
    def blocks(self) -> set[int | bytes]:
        """Every hash held in some medium and group."""
    def sources(
        self,
    ) -> tuple[list[tuple[str | None, int, list[tuple[int | bytes, list[tuple[int, int]]]]]], dict[int, bytes]]:
        """``(groups, sources)``: per ``(medium, group)`` in the order it first held a block, each
        held hash in the order it came with its copies ``(source, index in it)``, oldest first;
        ``sources``: each source's ``BlockStored`` as msgpack bytes. ValueError for a hash-only
        view (``sources=False``)."""
    def __len__(self) -> int:
        """Blocks held, counted once per ``(medium, group)``."""
    def __eq__(self, other: object, /) -> bool:
        """Same ``held`` and ``kinds``."""

# --- the router's core (rust/route.rs; its face is kvbridge.routing.router.Router) ----------------

@final
class ProvisionalResidency:
    """Per worker, the block keys a router has just sent it and until when
    (:mod:`kvbridge.routing.provisional`). Bounded: at most ``max_entries`` (key, worker) entries;
    past that the oldest decisions go (``stats["dropped"]``). Not thread-safe: a router calls it
    under its lock."""

    clock: Callable[[], float]
    def __new__(
        cls, ttl_s: float | None = None, *, max_entries: int | None = None, clock: Callable[[], float] | None = None
    ) -> ProvisionalResidency:
        """``ttl_s``: seconds an entry lasts (default 2.0; 0: off); ``max_entries``: default
        100,000; ``clock``: default ``time.monotonic``."""
    @property
    def ttl_s(self) -> float: ...
    @property
    def max_entries(self) -> int: ...
    @property
    def enabled(self) -> bool:
        """``ttl_s > 0``."""
    @property
    def stats(self) -> dict[str, int]:
        """added, expired, dropped (entries); confirmed, reset (calls that took something)."""
    def __len__(self) -> int:
        """(key, worker) entries held."""
    def add(self, worker: str, keys: Sequence[int], *, ttl_s: float | None = None) -> None:
        """``worker`` is about to hold ``keys`` (a prompt's chain, first block first); ``ttl_s``:
        the time left of a peer's decision (default the full TTL)."""
    def scores(self, keys: Sequence[int]) -> dict[str, int]:
        """Per worker expected to hold ``keys[0]``: how many leading ``keys`` it holds."""
    def confirm(self, worker: str, keys: Sequence[int]) -> None:
        """The worker's own events now show it holding ``keys``: their entries end."""
    def reset(self, worker: str) -> None:
        """The worker's cache was reset or it is gone: nothing it was sent stays."""

@final
class RouterCore:
    """The state and hot path of :class:`kvbridge.routing.router.Router` (its Python face, which
    documents the cost): one decision per :meth:`decide` call. Not thread-safe: the router calls it
    under its lock."""

    report_fn: Callable[[str], Any] | None
    def __new__(
        cls,
        index: Any,
        provisional: ProvisionalResidency,
        *,
        block_size: int,
        time: bool,
        prefill: tuple[float, float, float],
        decode: tuple[float, float, float],
        max_num_batched_tokens: int,
        kv_capacity_tokens: int | None,
        overlap_weight: float,
        backlog_weight: float,
        remote: bool,
        medium_weights: list[tuple[str, float]],
        workers: list[str],
    ) -> RouterCore: ...
    def decide(
        self,
        tokens: Tokens | None,
        scores: dict[str, Any] | None,
        num_blocks: int,
        num_tokens: int,
        keys: Sequence[int] | None,
        lora_name: str | None,
        extra_keys: Any,
        workers: Sequence[str] | None,
        now: float,
        use_keys: bool,
        want_keys: bool,
        rng: Any,
        load: dict[str, float] | None,
        resyncing: Sequence[str] | None,
        costs_only: bool,
    ) -> Any:
        """``(worker, leading blocks, decision id, keys or None)`` with the request in flight
        there, the costs ``{worker: cost}`` with ``costs_only``, or None without candidates."""
    def first_token(self, worker: str, id: int | None, now: float) -> bool: ...
    def done(self, worker: str, id: int | None, now: float) -> tuple[int, float] | None: ...
    @property
    def decisions(self) -> int:
        """Decisions made (requests put in flight)."""
    def workers(self) -> list[str]: ...
    def in_flight(self) -> dict[str, int]: ...
    def routed_since(self, worker: str, ts: float) -> int: ...
    def set_reports(self, reports: dict[str, Any]) -> None: ...
