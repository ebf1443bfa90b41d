"""kvbridge's NATS client: nats-py's ``Client`` with the header block of each received message
parsed natively.

A subscriber spends most of its time per message inside nats-py, and the largest single piece
was the header dict: a Python loop over the lines of every message's header block (kvbridge's
event messages carry five: Kv-Seq, Kv-Epoch, Nats-Msg-Id, Content-Type, Kv-Heartbeat).
``_native.parse_nats_headers`` builds the same dict in one call for the common form (all
ASCII, no inline status line); every other block, and every other step of receiving, is
nats-py's own. tests/test_natsclient.py holds the two parsers to the same answers.
"""

from __future__ import annotations

from typing import Optional

from nats.aio import client as _nats

from kvbridge._native import parse_nats_headers

__all__ = ["Client"]

# With fast_mail_parser installed nats-py parses headers with it, under rules of its own: then
# every block goes to nats-py.
_NATIVE = getattr(_nats, "parse_email", None) is None


class Client(_nats.Client):
    async def _process_headers(self, headers: Optional[bytes]) -> Optional[dict[str, str]]:
        if _NATIVE and headers.__class__ is bytes:
            parsed = parse_nats_headers(headers)
            if parsed is not None:
                return parsed or None
        return await super()._process_headers(headers)
