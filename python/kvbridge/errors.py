"""The root of kvbridge's own exceptions.

Every error kvbridge raises on purpose (bad configuration, a refused or failed connection, a
payload that is not a KV event batch, JetStream or the local nats-server not being usable)
derives from :class:`Error`, so an application or the CLI can catch "kvbridge said no" in one
clause. Each subclass also keeps the builtin base it had before (e.g. ``ValueError``,
``ConnectionError``, ``TimeoutError``, ``RuntimeError``), so code that catches those keeps
working. A wrong argument to a function (a type, a range) is a plain ``TypeError`` /
``ValueError`` naming it, as Python's own functions raise.

This module imports nothing from kvbridge: every other module can import it.
"""

from __future__ import annotations

__all__ = ["DiscoveryError", "Error", "NatsServerError"]


class Error(Exception):
    """Base of every exception kvbridge raises on purpose; the message says what went wrong."""


class NatsServerError(Error, RuntimeError):
    """The local nats-server (``kvbridge.tools.server``) binary is missing, or it did not come up.
    Here rather than beside the server so ``import kvbridge`` exports it without the tools."""


class DiscoveryError(Error, ValueError):
    """``/kv_event_sources`` could not be read or is not shaped as vLLM serves it
    (``kvbridge.engine.discover``; here so ``import kvbridge`` exports it without zmq)."""
