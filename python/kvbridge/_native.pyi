"""Type stub for kvbridge._native, the Rust core: the contract between Rust and Python.

Each part of the core adds its own section below.
"""

__version__: str

# --- batch encoding (rust/encode.rs; used through kvbridge.events.encode_batch) ---------------

from typing import Literal

from kvbridge.events import KVEventBatch

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
