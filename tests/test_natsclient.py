"""kvbridge's nats-py client (``kvbridge.bus.natsclient``) parses received header blocks natively; it
must give exactly the dict nats-py's own ``Client._process_headers`` gives, for any block."""

import asyncio

from hypothesis import example, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NatsClient

from kvbridge import _native
from kvbridge.bus.natsclient import Client
from kvbridge.tools.server import NatsServer

# Bytes that decide how a header line is read: separators, whitespace Python's bytes.strip() and
# str.isspace() disagree on (\x1c-\x1f), CR and LF alone, non-ASCII, and ordinary name characters.
_PIECES = [b"\r\n", b"\r", b"\n", b":", b": ", b" ", b"\t", b"\x0b", b"\x1c", b"\x1f", b"\x00", b"a", b"Kv-Seq",
           b"-", b"_", b"7", b"\xc3\xa9", b"\xff", b"NATS/1.0", b" 503", b"Status"]  # fmt: skip


def _parsed(client_class, block: bytes):
    """What ``client_class``'s header step makes of ``block``: the dict, or the exception type it
    raises, and the errors it reports to error_cb."""

    async def run():
        nc = client_class()
        errors = []

        async def on_error(exc):
            errors.append(type(exc))

        nc._error_cb = on_error
        try:
            return await nc._process_headers(block), errors
        except Exception as exc:  # nats-py raises on some malformed blocks: so must we
            return type(exc), errors

    return asyncio.run(run())


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=24).map(b"".join), st.booleans())
@example(b"\r\nKv-Seq: 5\r\nKv-Epoch: ab\r\n\r\n", True)
@example(b" 503\r\n\r\n", True)
@example(b"\r\n", True)
@example(b"", True)
@example(b"", False)
def test_header_blocks_parse_as_nats_py_parses_them(body, versioned):
    block = (b"NATS/1.0" if versioned else b"") + body
    assert _parsed(Client, block) == _parsed(NatsClient, block)


def test_kvbridge_headers_take_the_native_path():
    block = (b"NATS/1.0\r\nKv-Seq: 12\r\nKv-Epoch: 0a1b\r\nNats-Msg-Id: w:0a1b:12\r\n"
             b"Content-Type: application/msgpack\r\nKv-Heartbeat: 1\r\n\r\n")  # fmt: skip
    want = {"Kv-Seq": "12", "Kv-Epoch": "0a1b", "Nats-Msg-Id": "w:0a1b:12", "Content-Type": "application/msgpack",
            "Kv-Heartbeat": "1"}  # fmt: skip
    assert _native.parse_nats_headers(block) == want
    assert _parsed(Client, block) == _parsed(NatsClient, block) == (want, [])
    # Not the common form: left to nats-py.
    assert _native.parse_nats_headers(b"NATS/1.0 503\r\n\r\n") is None
    assert _native.parse_nats_headers("NATS/1.0\r\nK: é\r\n\r\n".encode()) is None


async def test_headers_arrive_through_a_real_server():
    with NatsServer() as server:
        nc = Client()
        await nc.connect(server.url)
        try:
            sub = await nc.subscribe("t.hdr")
            await nc.publish("t.hdr", b"x", headers={"Kv-Seq": "3", "Name": "café"})
            msg = await sub.next_msg(timeout=10)
            assert msg.headers == {"Kv-Seq": "3", "Name": "café"}
        finally:
            await nc.close()
