"""kvbridge: an LLM engine's KV-cache block events, loss-free on NATS."""
from kvbridge._native import __version__
from kvbridge.hashing import ALGORITHMS, BlockHasher, hash_blocks

__all__ = ["__version__", "ALGORITHMS", "BlockHasher", "hash_blocks"]
