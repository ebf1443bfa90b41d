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
"""

from __future__ import annotations

from typing import Optional

from nats.aio import client as _nats
from nats.protocol import parser as _parser

from kvbridge._native import parse_nats_headers, scan_nats_msgs

__all__ = ["Client"]

# With fast_mail_parser installed nats-py parses headers with it, under rules of its own: then
# every block goes to nats-py.
_NATIVE = getattr(_nats, "parse_email", None) is None


class Parser(_parser.Parser):
    """nats-py's parser, with the message frames at the head of the buffer cut natively."""

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        while self.state == _parser.AWAITING_CONTROL_LINE and buf:
            frames, used, partial = scan_nats_msgs(buf)
            if used:
                del buf[:used]
                process = self.nc._process_msg
                for frame in frames:
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


class Client(_nats.Client):
    def __init__(self) -> None:
        super().__init__()
        self._ps = Parser(self)

    async def _process_headers(self, headers: Optional[bytes]) -> Optional[dict[str, str]]:
        if _NATIVE and headers.__class__ is bytes:
            parsed = parse_nats_headers(headers)
            if parsed is not None:
                return parsed or None
        return await super()._process_headers(headers)
