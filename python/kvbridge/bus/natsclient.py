"""kvbridge's NATS client: nats-py's ``Client`` with the hot part of receiving done natively.

A subscriber spends most of its time per message inside nats-py, in two Python loops: the
protocol parser (regular expressions and buffer slicing per frame) and the header dict (a loop
over the lines of every message's header block; kvbridge's event messages carry five: Kv-Seq,
Kv-Epoch, Nats-Msg-Id, Content-Type, Kv-Heartbeat). ``_native.scan_nats_msgs`` cuts every
complete message frame at the head of the read buffer in one call and
``_native.parse_nats_headers`` builds the header dict in one call, each for the form the
server writes; anything else (other protocol operations, partial frames, status lines,
non-ASCII headers) and every later step of receiving (subscriptions, JetStream flow control,
callbacks) is nats-py's own. tests/test_natsclient.py holds both to nats-py's answers.

``Client.publish_headed`` is for a publisher that sends many messages with the same few
headers: it takes the header block ready-made as bytes (nats-py checks and encodes every header
of every message) and, when nothing is queued ahead of it and the socket's buffer is empty,
writes the HPUB to the socket in the caller's own pass of the loop. nats-py appends every publish
to its pending list and wakes its flusher task to write it: a Future, a queue and one more pass
of the loop per message, most of what a publisher sending one message per engine step spends
in the loop. Whatever finds something queued, or a buffer not yet drained, takes nats-py's
path, so the order of everything written is nats-py's and its flusher's ``drain()`` still holds
a publisher back from a slow server.

``Client.subscribe_direct`` is for a subscriber whose handling of a message is short and never
waits (kvbridge's event subscriber without an ``on_update`` to await): its handler is called
from the read loop itself with the subject, headers and payload, where nats-py would build a
``Msg``, queue it and wake the subscription's task to await a callback (about 8 µs a message
here, more than the header parsing and the frame cut together).

Dead links: a path that dies without a FIN or RST (a dead node, a NAT or conntrack entry gone)
leaves the socket open and swallows every write. The keepalive (``ping_interval_s``,
``max_outstanding_pings``) or a caller's probe (``Client.link_alive``) finds it: PINGs go
unanswered and nothing else arrives either (a PONG queued behind a backlog is late, not lost,
so any byte received counts as a sign of life, and so does a full socket taking bytes again). Then the connection is logged (which server, how
it was found), counted (``link_failures``) and replaced, its socket aborted rather than closed
(see ``_replace_dead_link``).

``Client.flush`` covers everything sent before it: nats-py's writes its PING to the socket at
once, ahead of commands still waiting for the flusher task (a SUB just made), so its PONG could
come back before the server had them. kvbridge's start-ups rely on a flush meaning "the server
has my subscriptions" (and has reported any refusal).

nats-py's private members: all of the above overrides or calls them (``_process_msg``,
``_process_headers``, ``_remove_sub``, the parser's state, the keepalive's PING bookkeeping). At
import they are checked against what this module needs (``_NEEDS``, ``missing_internals``); a
nats-py without one of them gets nats-py's own client instead, with the two additions done
through its public API (``subscribe_direct`` as a callback subscription, ``link_alive`` as a
flush): slower, the same messages in the same order, dead links found by nats-py's own keepalive
(``link_failures`` stays 0). That is logged once, naming what is missing. The versions in
pyproject.toml's pin are tested (tests/test_natsclient.py runs the oldest in a venv of its own).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import logging
import os
import time
from asyncio import selector_events as _selector_events
from collections.abc import Callable, Sequence
from typing import Any, Optional

from nats import errors as _errors
from nats.aio import client as _nats
from nats.errors import StaleConnectionError, UnexpectedEOF
from nats.protocol import parser as _parser

from kvbridge._native import parse_nats_headers, scan_nats_msgs

__all__ = ["Client", "DirectHandler", "missing_internals"]

log = logging.getLogger("kvbridge.connection")

#: ``handler(subject, headers, payload)``; headers as nats-py gives them (a dict, or None).
DirectHandler = Callable[[str, Optional[dict[str, str]], bytes], None]

# With fast_mail_parser installed nats-py parses headers with it, under rules of its own: then
# every block goes to nats-py.
_NATIVE = getattr(_nats, "parse_email", None) is None

# Direct writes gather a message's parts with os.writev where there is one (POSIX), at most
# IOV_MAX parts a call (1024 on Linux; POSIX promises 16 at least).
# Only asyncio's own plain socket transport is written around (its class is private: without
# it, every write is the transport's).
_PLAIN_TRANSPORT: Optional[type] = getattr(_selector_events, "_SelectorSocketTransport", None)
_WRITEV = hasattr(os, "writev") and _PLAIN_TRANSPORT is not None
_IOV_MAX = os.sysconf("SC_IOV_MAX") if _WRITEV else 0


# What the fast path takes from nats-py beyond its public API. Methods: the parameter names it
# overrides or calls them with. Attributes: on a client and its parser as constructed.
_NEEDS_METHODS: dict[str, tuple[str, ...]] = {
    "_process_msg": ("sid", "subject", "reply", "data", "headers"),
    "_process_headers": ("headers",),
    "_remove_sub": ("sid", "max_msgs"),
    "_process_connect_init": (),
    "_ping_interval": (),
    "_process_op_err": ("e",),
    "_send_ping": ("future",),
    "_flush_pending": (),
    "_send_command": ("cmd",),
}
_NEEDS_CLIENT_ATTRS = ("_ps", "_pending", "_pending_data_size", "_pings_outstanding", "_pongs", "_transport", "stats",
                       "_flush_queue", "_max_payload", "_max_pending_size", "is_closed", "is_draining_pubs")  # fmt: skip
_NEEDS_PARSER_ATTRS = ("buf", "state", "nc")
_NEEDS_MODULE = ((_nats, "PING_PROTO"), (_parser, "Parser"), (_parser, "AWAITING_CONTROL_LINE"))


def missing_internals() -> tuple[str, ...]:
    """The nats-py private members the fast path needs that this nats-py lacks (empty: none)."""
    missing = [f"{mod.__name__}.{name}" for mod, name in _NEEDS_MODULE if not hasattr(mod, name)]
    for name, params in _NEEDS_METHODS.items():
        method = getattr(_nats.Client, name, None)
        try:
            have = tuple(inspect.signature(method).parameters)[1:] if callable(method) else None
        except (TypeError, ValueError):
            have = None
        if have is None or have[: len(params)] != params:
            missing.append(f"Client.{name}({', '.join(params)})")
    try:
        nc = _nats.Client()
    except Exception as exc:  # pragma: no cover - a nats-py whose client needs more to construct
        return (*missing, f"Client() ({exc!r})")
    missing += [f"Client.{a}" for a in _NEEDS_CLIENT_ATTRS if not hasattr(nc, a)]
    stats = getattr(nc, "stats", None)
    if not isinstance(stats, dict) or not {"in_msgs", "in_bytes", "out_msgs", "out_bytes"} <= stats.keys():
        missing.append("Client.stats['in_msgs', 'in_bytes', 'out_msgs', 'out_bytes']")
    parser_class = getattr(_parser, "Parser", None)
    if parser_class is None or not isinstance(getattr(nc, "_ps", None), parser_class):
        missing.append("Client._ps (a nats.protocol.parser.Parser)")
    else:
        missing += [f"Parser.{a}" for a in _NEEDS_PARSER_ATTRS if not hasattr(nc._ps, a)]
    return tuple(missing)


_MISSING = missing_internals()
_warned = False


def _nats_py_version() -> str:
    try:
        return importlib.metadata.version("nats-py")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        return "(version unknown)"


def _warn_stock_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("kvbridge: nats-py %s lacks what kvbridge's fast receive path uses (%s): using nats-py's own "
                    "client instead (slower, same results; dead links found by its keepalive)",
                    _nats_py_version(), ", ".join(_MISSING))  # fmt: skip


class Parser(_parser.Parser):
    """nats-py's parser, with the message frames at the head of the buffer cut natively."""

    async def parse(self, data: bytes = b"") -> None:
        if data:
            self.nc._last_alive = time.monotonic()  # the keepalive's sign of life
        buf = self.buf
        buf.extend(data)
        while self.state == _parser.AWAITING_CONTROL_LINE and buf:
            frames, used, partial = scan_nats_msgs(buf)
            if used:
                del buf[:used]
                nc = self.nc
                process, direct = nc._process_msg, nc._direct
                for frame in frames:
                    handler = direct.get(frame[0])
                    if handler is None or not nc._deliver_now(handler, *frame):
                        await process(*frame)
                    if self.buf is not buf:
                        return  # reset by a reconnect: what is left belonged to the old connection
            if partial:
                # A frame still arriving stays whole in the buffer (nats-py would hold its
                # control line as parser state), so the next read cuts it here too.
                return
            if not used:
                break
        await super().parse()


# The keepalive's PING waits this share of ping_interval_s for something to ride with (an idle
# publisher's heartbeat comes every heartbeat_s, as often as the PINGs by default). What is left
# of the interval is the PONG's (any byte received counts as one).
_PING_RIDES = 0.8
_PING = _nats.PING_PROTO

_FLUSH_TIMEOUT_S = getattr(_nats, "DEFAULT_FLUSH_TIMEOUT", 10)  # nats-py's flush default

# `_native_headers`' answer for a block in a form it leaves to nats-py.
_OTHER: Any = object()


def _header_dict(block: bytes) -> dict[str, str]:
    """The headers of a block ``publish_headed`` takes, as nats-py's ``publish`` takes them."""
    lines = block.decode().split("\r\n")[1:]
    return dict(line.split(": ", 1) for line in lines if line)


def _native_headers(headers: Optional[bytes]) -> Optional[dict[str, str]]:
    """nats-py's header dict for ``headers`` (None for none), or ``_OTHER``."""
    if not headers:
        return None
    if _NATIVE and headers.__class__ is bytes:
        parsed = parse_nats_headers(headers)
        if parsed is not None:
            return parsed or None
    return _OTHER


class Client(_nats.Client):
    """kvbridge's client: constructed, it is the fast one (``_FastClient``) when this nats-py has
    every private member that needs, else this class, nats-py's own client with kvbridge's two
    additions done through its public API (module doc)."""

    def __new__(cls) -> Client:
        if cls is Client:
            if not _MISSING:
                cls = _FastClient
            else:
                _warn_stock_once()
        return super().__new__(cls)

    def __init__(self) -> None:
        super().__init__()
        #: Connections found dead by silence (PINGs unanswered) and replaced.
        self.link_failures = 0

    async def subscribe_direct(self, subject: str, handler: DirectHandler) -> Any:
        """A plain subscription (no queue group) whose messages go to ``handler`` from the read
        loop. The handler must return quickly, never block and catch its own exceptions: the
        connection reads nothing meanwhile. Unsubscribing (or closing) ends it as any other.
        (With nats-py's own client: from the subscription's task, in the same order.)"""

        async def deliver(msg: Any) -> None:
            handler(msg.subject, msg.headers, msg.data)

        # The handler never waits, so the queue between the read loop and the callback grows only
        # while the event loop is busy elsewhere: limits far above nats-py's defaults, which drop.
        return await self.subscribe(subject, cb=deliver, pending_msgs_limit=1 << 20,
                                    pending_bytes_limit=512 * 1024 * 1024)  # fmt: skip

    async def publish_headed(self, subject: str, payload: bytes, header_block: bytes, reply: str = "") -> None:
        """``publish(subject, payload, reply, headers)`` with the headers given as their block,
        ``b"NATS/1.0\r\n"`` then ``b"Key: value\r\n"`` lines then ``b"\r\n"``, keys and values
        as nats-py accepts them (the caller vouches). The same errors as ``publish``. (With
        nats-py's own client: its ``publish``, the block read back into a dict.)"""
        await self.publish(subject, payload, reply=reply, headers=_header_dict(header_block))

    def publish_now(self, subject: str, payload: bytes, header_block: bytes) -> bool:
        """``publish_headed`` without a reply, done here and now if it can be without waiting
        and without anything queued ahead of it: then True. False: nothing was done (not
        connected, something queued, the socket's buffer not drained; always, with nats-py's own
        client), and ``publish_headed`` is the way."""
        return False

    def publish_many_now(self, subject: str, messages: Sequence[tuple[bytes, bytes]]) -> bool:
        """``publish_now`` for several ``(payload, header_block)`` messages at once, in order, all
        or none: one write to the socket where nats-py's path or ``publish_now`` per message make
        one each while the socket keeps up (at a relay's rates, a write per 44 KiB message cost
        more kernel time than the raw forwarder's nats-py spends, which coalesces)."""
        return False

    async def flush(self, timeout: int = _FLUSH_TIMEOUT_S) -> None:
        """nats-py's ``flush``, made to cover everything sent before it. nats-py writes the PING
        to the socket at once, while the commands before it (a SUB just made, a publish) wait in
        its pending list for the flusher task: the PONG can come back before the server has seen
        them (a subscription not yet in place when ``flush`` returns, a refusal not yet
        reported). With nats-py's own client: a second round trip, whose PING goes out after
        the flusher woken by the first has written them."""
        await super().flush(timeout)
        await super().flush(timeout)

    async def link_alive(self, timeout: float, why: str) -> bool:
        """Whether the server answers a PING within ``timeout`` seconds (False while not
        connected). With nats-py's own client a PONG late behind a backlog counts as none, and
        replacing a dead link is its keepalive's."""
        if not self.is_connected:
            return False
        try:
            await self.flush(timeout)  # type: ignore[arg-type]  # seconds for asyncio.wait_for: any number
        except Exception:
            return False
        return True


class _FastClient(Client):
    def __init__(self) -> None:
        super().__init__()
        self._ps = Parser(self)
        self._direct: dict[int, DirectHandler] = {}
        self._last_alive = time.monotonic()
        # The connection's asyncio transport, for publish_headed's direct writes (None: never).
        self._socket_out: Optional[asyncio.WriteTransport] = None
        # Its socket's descriptor when the transport is asyncio's plain TCP one, whose bytes go to
        # the socket as written (not TLS): direct writes gather their parts in one writev instead
        # of joining them into a copy of the payload first. -1: the transport's write.
        self._out_fd = -1

    async def subscribe_direct(self, subject: str, handler: DirectHandler) -> Any:
        sub = await self.subscribe(subject)
        self._direct[sub._id] = handler
        return sub

    def _deliver_now(self, handler: DirectHandler, sid: int, subject: bytes, reply: bytes, data: bytes,
                     headers: Optional[bytes]) -> bool:  # fmt: skip
        """A direct subscription's message, handed over here unless its header block is in a
        form left to nats-py (False: ``_process_msg`` takes it)."""
        hdr = _native_headers(headers)
        if hdr is _OTHER:
            return False
        self._hand(handler, subject, data, hdr)
        return True

    def _hand(self, handler: DirectHandler, subject: bytes, data: bytes, hdr: Optional[dict[str, str]]) -> None:
        stats = self.stats
        stats["in_msgs"] += 1
        stats["in_bytes"] += len(data)
        handler(subject.decode(), hdr, data)

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        handler = self._direct.get(sid)
        if handler is None:
            await super()._process_msg(sid, subject, reply, data, headers)
        else:  # a frame nats-py's parser cut, or one whose header block is nats-py's to read
            self._hand(handler, subject, data, await self._process_headers(headers))

    async def _process_headers(self, headers: Optional[bytes]) -> Optional[dict[str, str]]:
        hdr = _native_headers(headers)
        return await super()._process_headers(headers) if hdr is _OTHER else hdr

    def publish_now(self, subject: str, payload: bytes, header_block: bytes) -> bool:
        return self.publish_many_now(subject, ((payload, header_block),))

    def publish_many_now(self, subject: str, messages: Sequence[tuple[bytes, bytes]]) -> bool:
        # Written now only with nothing ahead of it: nats-py's pending list empty (a keepalive
        # PING waiting to ride goes first, on nats-py's path) and the socket's buffer drained
        # (else the flusher's drain() is what holds us back from a slow server).
        out = self._socket_out
        if (self._pending or out is None or not self.is_connected or self.is_draining_pubs or out.is_closing()
                or out.get_write_buffer_size()):  # fmt: skip
            return False
        limit = self._max_payload
        if any(len(payload) > limit for payload, _ in messages):
            return False
        parts: list[bytes] = []
        for payload, header_block in messages:
            parts += self._hpub_parts(subject, "", header_block, payload)
        self._write_parts(out, parts)
        return True

    def _write_parts(self, out: asyncio.WriteTransport, parts: list[bytes]) -> None:
        """Write ``parts`` in order to a transport whose buffer is empty. To the socket itself in
        one writev when it is a plain one; what the socket does not take then goes to the transport,
        which sends it when the socket drains (and nothing can be written between the two). An
        error is left to the transport: it meets it again and handles it as for any write."""
        fd = self._out_fd
        if fd < 0 or len(parts) > _IOV_MAX:
            out.write(b"".join(parts))
            return
        try:
            n = os.writev(fd, parts)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            out.write(b"".join(parts))
            return
        for i, part in enumerate(parts):
            if n < len(part):
                # The rest part by part (the transport keeps or copies each; a join would copy
                # all of it once more first).
                out.write(memoryview(part)[n:] if n else part)
                for rest in parts[i + 1 :]:
                    out.write(rest)
                return
            n -= len(part)

    def _hpub_parts(self, subject: str, reply: str, header_block: bytes, payload: bytes) -> list[bytes]:
        """The HPUB command for one message, in parts, counted in nats-py's stats as its publish
        counts it."""
        n, size = len(header_block), len(payload)
        head = f"HPUB {subject} {reply} {n} {n + size}\r\n" if reply else f"HPUB {subject} {n} {n + size}\r\n"
        stats = self.stats
        stats["out_msgs"] += 1
        stats["out_bytes"] += size
        return [head.encode(), header_block, payload, b"\r\n"]

    def _hpub(self, subject: str, reply: str, header_block: bytes, payload: bytes) -> bytes:
        """The HPUB command for one message, counted in nats-py's stats as its publish counts it."""
        return b"".join(self._hpub_parts(subject, reply, header_block, payload))

    async def publish_headed(self, subject: str, payload: bytes, header_block: bytes, reply: str = "") -> None:
        if not reply and self.publish_now(subject, payload, header_block):
            return
        # nats-py's publish checks, in its order (the subject is the caller's, built from tokens).
        if self.is_closed:
            raise _errors.ConnectionClosedError
        if self.is_draining_pubs:
            raise _errors.ConnectionDrainingError
        size = len(payload)
        connected = self.is_connected
        if not connected and (self._max_pending_size <= 0 or size + self._pending_data_size > self._max_pending_size):
            raise _errors.OutboundBufferLimitError
        if size > self._max_payload:
            raise _errors.MaxPayloadError
        await self._send_command(self._hpub(subject, reply, header_block, payload))
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()

    async def flush(self, timeout: int = _FLUSH_TIMEOUT_S) -> None:
        await _nats.Client.flush(self, timeout)  # one round trip: _send_ping keeps the order

    async def _send_ping(self, future: Optional[asyncio.Future] = None) -> None:
        # nats-py writes the PING straight to the socket (Client.flush's doc): what waits for
        # the flusher goes first, as the flusher would write it.
        transport = self._transport
        if self._pending and self.is_connected and transport is not None:
            pending, self._pending, self._pending_data_size = self._pending, [], 0
            transport.writelines(pending)
        await super()._send_ping(future)

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        self._direct.pop(sid, None)
        super()._remove_sub(sid, max_msgs)

    # -- dead links -------------------------------------------------------------------------------

    async def link_alive(self, timeout: float, why: str) -> bool:
        """Whether the server answers a PING: True once its PONG is back (everything the server
        sent before it has then been read). While bytes keep arriving the PONG is on its way behind
        them; ``timeout`` seconds with nothing received: the connection is replaced as a dead link
        (logged with ``why``) and the answer is False, as it is while not connected."""
        transport = self._transport
        if not self.is_connected:
            return False
        pong: asyncio.Future = asyncio.get_running_loop().create_future()
        try:
            await self._send_ping(pong)
            while not pong.done():
                since = time.monotonic()
                await asyncio.wait((pong,), timeout=timeout)
                if self._transport is not transport or not self.is_connected:
                    return False  # reconnecting already: nothing to tell about the link
                if not pong.done() and self._last_alive <= since:
                    how = f"no PONG, nothing received for {timeout:.1f} s after a probe PING ({why})"
                    await self._replace_dead_link(how)
                    return False
        except Exception:  # closed meanwhile
            return False
        return not pong.cancelled()

    async def _process_connect_init(self) -> None:
        await super()._process_connect_init()
        self._last_alive = time.monotonic()  # the handshake was read without the parser
        # The other sign of life: a socket whose buffers were full takes more (the peer
        # acknowledged what it had). A publisher the server reads slowly (the server throttles
        # fast producers for slow consumers) has its PONG behind its own backlog.
        writer = getattr(self._transport, "_io_writer", None)
        self._socket_out = None
        self._out_fd = -1
        if isinstance(writer, asyncio.StreamWriter):
            self._socket_out = writer.transport
            sock = writer.transport.get_extra_info("socket")
            # Exactly asyncio's plain socket transport (a TLS one wraps a socket too, and writes
            # what it encrypts): its buffer empty, bytes written to the socket go out in order.
            if (_WRITEV and type(writer.transport) is _PLAIN_TRANSPORT and sock is not None
                    and writer.transport.get_extra_info("sslcontext") is None):  # fmt: skip
                self._out_fd = sock.fileno()
            protocol = writer.transport.get_protocol()
            resume = protocol.resume_writing

            def resumed() -> None:
                self._last_alive = time.monotonic()
                resume()

            protocol.resume_writing = resumed  # type: ignore[method-assign]

    async def _ping_interval(self) -> None:
        """nats-py's keepalive with two changes. Any byte received counts as an answer (and a
        full socket taking bytes again: ``_process_connect_init``): a subscriber far behind reads
        the PONG only after everything the server queued before it, seconds later on a link that
        works; a dead path delivers nothing at all. And the PING
        rides with the next thing written (an idle publisher's heartbeat: one send instead of
        two), or goes alone shortly before the next tick."""
        interval = self.options["ping_interval"]
        ride = interval * _PING_RIDES
        tick, wait = time.monotonic(), interval
        while True:
            await asyncio.sleep(wait)
            wait = interval
            if not self.is_connected:
                continue
            if self._last_alive > tick:
                self._pings_outstanding = 0
            tick = time.monotonic()
            try:
                self._pings_outstanding += 1
                if self._pings_outstanding > self.options["max_outstanding_pings"]:
                    await self._process_op_err(StaleConnectionError())
                    return
                self._pongs.append(asyncio.get_running_loop().create_future())
                pending = self._pending
                pending.append(_PING)
                self._pending_data_size += len(_PING)
                try:
                    await asyncio.sleep(ride)
                except asyncio.CancelledError:
                    self._withdraw_pings()  # reconnecting or closing
                    raise
                wait = interval - ride
                if self._pending is pending and self.is_connected:  # nothing written meanwhile
                    await self._flush_pending()
            except (asyncio.CancelledError, RuntimeError, AttributeError):  # as nats-py's: closing
                break

    def _withdraw_pings(self) -> None:
        """Takes the keepalive's PINGs out of what is still to be written: sent on the next
        connection, their PONGs would be taken for other PINGs' (a flush's)."""
        pending = self._pending
        kept = [cmd for cmd in pending if cmd is not _PING]
        if len(kept) != len(pending):
            self._pending_data_size -= (len(pending) - len(kept)) * len(_PING)
            self._pending = kept

    async def _process_op_err(self, e: Exception) -> None:
        # nats-py files an EOF (a closed socket: nothing dead about the path) under stale too.
        if isinstance(e, StaleConnectionError) and not isinstance(e, UnexpectedEOF) and self.is_connected:
            pings = self._pings_outstanding - 1  # the one that tipped it over was not sent
            if pings >= self.options["max_outstanding_pings"]:
                silent = time.monotonic() - self._last_alive
                how = f"no PONG, nothing received for {silent:.1f} s ({pings} PINGs unanswered)"
            else:  # the server's -ERR 'Stale Connection': our PONGs stopped reaching it
                how = "the server found this connection stale (our PONGs did not reach it)"
            await self._replace_dead_link(how)
            return
        await super()._process_op_err(e)

    async def _replace_dead_link(self, how: str) -> None:
        self.link_failures += 1
        url = self.connected_url
        log.warning("kvbridge %s: %s: %s: dead link, reconnecting (%d so far)", self.options.get("name"),
                    url.geturl() if url else "?", how, self.link_failures)  # fmt: skip
        # Abort, not close: asyncio's close() first waits for the queued bytes to drain, which
        # on a dead path never happens, and nats-py's reconnect waits for the close. What the dead
        # socket swallowed is the publishers' ring's to re-send (replay) after the reconnect.
        writer = getattr(self._transport, "_io_writer", None)  # TCP and TLS; websockets time out on their own
        if isinstance(writer, asyncio.StreamWriter):
            writer.transport.abort()
        self._withdraw_pings()
        await super()._process_op_err(StaleConnectionError())
