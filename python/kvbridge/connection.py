"""Connecting to NATS: fail fast on the first connect, then reconnect as configured.

nats-py retries the *initial* connect with the reconnect policy too, so "reconnect forever" would
also mean "hang forever at start" against a wrong URL or wrong password. Here the first connect
gets one try per server (and a deadline); the configured policy is switched on once connected.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import nats
from nats.aio.client import Client
from nats.errors import AuthorizationError

from kvbridge.config import Config

__all__ = ["AuthenticationError", "ConnectError", "connect"]


class ConnectError(ConnectionError):
    """The first connection to NATS failed; the message names the servers and the cause."""


class AuthenticationError(ConnectError):
    """The server rejected the credentials (authentication failure / authorization violation)."""


def _is_auth_error(exc: BaseException) -> bool:
    if isinstance(exc, AuthorizationError):
        return True
    text = str(exc).lower()
    return "authorization" in text or "authentication" in text


async def connect(
    config: Config,
    *,
    reconnected_cb: Callable[[], Awaitable[None]] | None = None,
    disconnected_cb: Callable[[], Awaitable[None]] | None = None,
    error_cb: Callable[[Exception], Awaitable[None]] | None = None,
    **extra: Any,
) -> Client:
    errors: list[BaseException] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)
        if error_cb is not None:
            await error_cb(exc)

    opts = config.connect_options()
    policy = {k: opts[k] for k in ("allow_reconnect", "max_reconnect_attempts", "reconnect_time_wait")}
    opts.update(allow_reconnect=True, max_reconnect_attempts=1, reconnect_time_wait=0)
    nc = Client()
    # A server that accepts TCP but never answers (or a wrong TLS setup) must not hang start-up.
    deadline = config.connect_timeout_s * (2 * len(config.servers)) + 1.0
    servers = ", ".join(config.servers)
    try:
        await asyncio.wait_for(
            nc.connect(
                **opts,
                error_cb=on_error,
                reconnected_cb=reconnected_cb,
                disconnected_cb=disconnected_cb,
                **extra,
            ),
            deadline,
        )
    except BaseException as exc:
        await _discard(nc)
        if isinstance(exc, asyncio.CancelledError) and not isinstance(exc, asyncio.TimeoutError):
            raise
        causes = errors + [exc]
        if any(_is_auth_error(e) for e in causes):
            raise AuthenticationError(
                f"NATS authentication failed at {servers}: the server rejected the credentials "
                f"(authorization violation)"
            ) from exc
        detail = "; ".join(sorted({f"{type(e).__name__}: {e}" for e in causes if str(e)})) or type(exc).__name__
        raise ConnectError(f"cannot connect to NATS at {servers}: {detail}") from exc
    nc.options.update(policy)
    return nc


async def _discard(nc: Client) -> None:
    try:
        await nc.close()
    except Exception:
        pass
