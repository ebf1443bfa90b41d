"""Connecting to NATS: fail fast on the first connect, then reconnect as configured.

nats-py retries the *initial* connect with the reconnect policy too, so "reconnect forever" would
also mean "hang forever at start" against a wrong URL or wrong password. Here the first connect
gets one try per server (and a deadline); the configured policy is switched on once connected.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import time
from collections import Counter
from typing import Any, Awaitable, Callable, Iterable

from nats.aio.client import Client
from nats.errors import AuthorizationError

from kvbridge.config import Config
from kvbridge.errors import Error
from kvbridge.bus.natsclient import Client as _KvClient

__all__ = [
    "AuthenticationError",
    "ConnectError",
    "PermissionDeniedError",
    "Permissions",
    "WorkerIdInUseError",
    "connect",
]

log = logging.getLogger("kvbridge.connection")


class ConnectError(Error, ConnectionError):
    """The first connection to NATS failed; the message names the servers and the cause."""


class AuthenticationError(ConnectError):
    """The server rejected the credentials (authentication failure / authorization violation)."""


class PermissionDeniedError(ConnectError):
    """The server refused this user a subject kvbridge needs (publish or subscribe); the message
    names the operation and the subject."""


class WorkerIdInUseError(ConnectError):
    """Another live publisher already serves this worker id."""


# nats-server: -ERR 'Permissions Violation for Publish to "kv.events.m.w"' (Subscription likewise,
# with ' using queue "q"' for queue subscriptions).
_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"', re.IGNORECASE)
# At most one log line per (operation, subject) in this many seconds.
_LOG_EVERY_S = 30.0


class Permissions:
    """The permission violations the server reported on one connection.

    The server reports a refused publish or subscription asynchronously (an ``-ERR`` that nats-py
    hands to ``error_cb``, without closing the connection), so nothing else would ever show it:
    a refused publish looks sent. This counts them per (operation, subject), logs them at WARNING
    (at most once per subject per 30 s), and lets a starting client turn them into an error."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.count = 0
        self.by_subject: Counter[tuple[str, str]] = Counter()
        self._last_log: dict[tuple[str, str], float] = {}
        self._ignored: str | None = None

    async def on_error(self, exc: Exception) -> None:
        m = _VIOLATION.search(str(exc))
        if m is None:
            return
        # nats-py lowercases the server's error text: subjects are compared lowercased.
        key = ("publish" if m.group(1).lower() == "publish" else "subscribe", m.group(2).lower())
        if key == ("publish", self._ignored):
            return
        self.count += 1
        self.by_subject[key] += 1
        now = time.monotonic()
        if now - self._last_log.get(key, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._last_log[key] = now
            log.warning("kvbridge %s: NATS refused to let this user %s %s (%d refusal(s) so far)",
                        self.who, key[0], key[1], self.by_subject[key])  # fmt: skip

    def ignore_publish(self, subject: str | None) -> None:
        """Do not count refusals to publish on ``subject`` (a probe that may be refused)."""
        self._ignored = subject.lower() if subject is not None else None

    def refused_publish(self, subject: str) -> int:
        return self.by_subject[("publish", subject.lower())]

    def denied(self, op: str, subject: str) -> bool:
        return self.by_subject[(op, subject.lower())] > 0

    def raise_if_denied(self, *, publish: Iterable[str] = (), subscribe: Iterable[str] = ()) -> None:
        for op, subjects in (("publish", publish), ("subscribe", subscribe)):
            for subject in subjects:
                if self.denied(op, subject):
                    raise PermissionDeniedError(
                        f"kvbridge {self.who}: the NATS server does not allow this user to {op} {subject!r} "
                        f"(permissions violation); grant it in the server's authorization config"
                    )


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
    # An untrusted certificate or rejected credentials do not change on a retry, and nats-py would
    # retry until the deadline: once there have been as many such errors as servers (each may be
    # the one that works), the connect ends.
    fatal = asyncio.Event()
    fatal_errors = 0

    async def on_error(exc: Exception) -> None:
        nonlocal fatal_errors
        errors.append(exc)
        if isinstance(exc, ssl.SSLError) or _is_auth_error(exc):
            fatal_errors += 1
            if fatal_errors >= len(config.servers):
                fatal.set()
        if error_cb is not None:
            await error_cb(exc)

    opts = config.connect_options()
    policy = {k: opts[k] for k in ("allow_reconnect", "max_reconnect_attempts", "reconnect_time_wait")}
    opts.update(allow_reconnect=True, max_reconnect_attempts=1, reconnect_time_wait=0)
    nc = _KvClient()  # nats-py's, with native header parsing (kvbridge.bus.natsclient)
    # A server that accepts TCP but never answers (or a wrong TLS setup) must not hang start-up.
    deadline = config.connect_timeout_s * (2 * len(config.servers)) + 1.0
    servers = ", ".join(config.servers)
    connecting = asyncio.ensure_future(
        nc.connect(**opts, error_cb=on_error, reconnected_cb=reconnected_cb, disconnected_cb=disconnected_cb, **extra)
    )
    gave_up = asyncio.ensure_future(fatal.wait())
    try:
        await asyncio.wait((connecting, gave_up), timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done():
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            raise asyncio.TimeoutError() if not fatal.is_set() else errors[-1]
        connecting.result()  # its own error, if it failed
    except BaseException as exc:
        if not connecting.done():  # we were cancelled while it ran
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
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
    finally:
        gave_up.cancel()
    nc.options.update(policy)
    return nc


async def _discard(nc: Client) -> None:
    try:
        await nc.close()
    except Exception:
        pass
