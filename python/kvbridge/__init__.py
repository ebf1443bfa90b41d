"""kvbridge: an LLM engine's KV-cache block events, loss-free on NATS."""
from kvbridge._native import __version__

__all__ = ["__version__"]
