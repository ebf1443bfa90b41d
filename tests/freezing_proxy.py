"""A TCP proxy on loopback that can play a dead network path: after ``freeze()`` the connections
it carries stay open at both ends but nothing crosses any more, in either direction (what arrives
is read and dropped, and counted), as when a node, a NAT or conntrack entry or a route dies
without a FIN or RST. Connections made after the freeze are forwarded normally, so a client that
notices can reconnect through it; ``freeze(new_connections=False)`` makes it a dead node instead:
later connections are accepted and then hear nothing, so a client has to try another server.

``freeze(hold=True)``: the proxy stops reading instead of dropping, as a path that no longer
acknowledges anything: the senders' socket buffers fill, and then their own write buffers
(``held_bytes()`` counts what waits unread at the proxy)."""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios
from typing import Any

HOST = "127.0.0.1"


class _Side(asyncio.Protocol):
    """One socket of a proxied connection; what it reads goes to its peer's socket unless frozen."""

    def __init__(self, link: _Link, direction: str) -> None:
        self.link, self.direction = link, direction
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        link = self.link
        peer = link.peer_of(self)
        if link.frozen:
            link.proxy.dropped[self.direction] += len(data)
        elif peer is None or peer.transport is None:
            link.early.append(data)  # the client spoke before the server side was dialed
        else:
            peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        # A live path passes a close on; a dead one does not (that is the point of freezing it).
        if not self.link.frozen:
            self.link.close()


class _Link:
    def __init__(self, proxy: FreezingProxy, frozen: bool) -> None:
        self.proxy, self.frozen = proxy, frozen
        self.client = _Side(self, "to_server")
        self.server: _Side | None = None
        self.early: list[bytes] = []

    def peer_of(self, side: _Side) -> _Side | None:
        return self.server if side is self.client else self.client

    def close(self) -> None:
        for side in (self.client, self.server):
            if side is not None and side.transport is not None:
                side.transport.close()


class FreezingProxy:
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:<target_port>``. ``dropped`` counts the bytes
    read from frozen connections and not passed on, per direction (``to_server``, ``to_client``)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.dropped = {"to_server": 0, "to_client": 0}
        self.connections = 0
        self._links: list[_Link] = []
        self._server: asyncio.AbstractServer | None = None
        self._frozen_new = False

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.port}"

    @property
    def dropped_bytes(self) -> int:
        return sum(self.dropped.values())

    async def start(self) -> FreezingProxy:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def _accept(self) -> _Side:
        link = _Link(self, self._frozen_new)
        self._links.append(link)
        self.connections += 1
        if not link.frozen:
            asyncio.ensure_future(self._dial(link))
        return link.client

    async def _dial(self, link: _Link) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, side = await loop.create_connection(lambda: _Side(link, "to_client"), HOST, self.target_port)
        except OSError:
            link.close()
            return
        link.server = side
        if link.frozen:
            return
        for data in link.early:
            side.transport.write(data)  # type: ignore[union-attr]
        link.early.clear()

    def freeze(self, *, new_connections: bool = True, hold: bool = False) -> None:
        """Stop every connection open now, both ways, sockets left open. ``new_connections``:
        whether connections made from now on are forwarded (False: a dead node). ``hold``: stop
        reading them rather than read and drop."""
        for link in self._links:
            link.frozen = True
            for side in (link.client, link.server):
                if hold and side is not None and side.transport is not None:
                    side.transport.pause_reading()
        self._frozen_new = not new_connections

    def held_bytes(self) -> int:
        """Bytes that arrived on frozen connections and wait unread in the proxy's sockets."""
        total = 0
        for link in self._links:
            for side in (link.client, link.server):
                sock = side.transport.get_extra_info("socket") if side is not None and side.transport else None
                if link.frozen and sock is not None and sock.fileno() >= 0:
                    total += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        return total

    async def close(self) -> None:
        for link in self._links:
            link.frozen = False
            link.close()
        self._links.clear()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
