"""The publisher's answers to consumers repairing their view: replay and snapshot requests.

A replay request (``{"from": seq, "to": seq}`` on the worker's replay subject) is answered from
the ring: each message held in the range with the header block it went out with, then an end
message carrying the last seq; a range the ring no longer holds is answered "gone" (the
requester then asks for a snapshot). A snapshot request is answered from the attached pool: its
blocks cut into messages as live events are (one too large for a message goes in slices), then
an end message with the seq the snapshot is consistent with (:meth:`Answers.take_snapshot`: the
cut of the threading contract in :mod:`kvbridge.bus.handoff`) and how many messages it took. A
request is never left unanswered while we can send: a bad one, or a pool that fails, is answered
with an error.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from nats.errors import Error as NatsError

from kvbridge.config import Config
from kvbridge.bus.coalescer import Coalescer
from kvbridge.bus.handoff import CUT
from kvbridge.wire.subjects import (
    HDR_CONTENT_TYPE,
    HDR_COUNT,
    HDR_EPOCH,
    HDR_OLDEST,
    HDR_REPLY,
    HDR_SEQ,
    REPLY_END,
    REPLY_ERROR,
    REPLY_GONE,
    REPLY_SNAPSHOT,
    REPLY_SNAPSHOT_END,
    REPLY_UNAVAILABLE,
)

__all__ = ["Answers"]

log = logging.getLogger("kvbridge.publisher")


class Answers(Coalescer):
    """Replay answered from the ring, snapshots from the attached pool."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._counts.update(dict.fromkeys(("replays", "replays_gone", "snapshots", "snapshot_errors"), 0))

    async def _reply(self, inbox: str, payload: bytes, headers: dict[str, str] | bytes) -> bool:
        """``headers``: a dict, or a held message's header block (a replay sends it as it went live)."""
        try:
            if isinstance(headers, bytes):
                await self._nc.publish_headed(inbox, payload, headers)
            else:
                await self._nc.publish(inbox, payload, headers=headers)
            return True
        except NatsError:
            return False  # the requester times out and asks again

    async def _reply_error(self, inbox: str, why: str) -> None:
        """A request never goes unanswered while we can send: say what went wrong."""
        await self._reply(inbox, why.encode(), {HDR_REPLY: REPLY_ERROR, HDR_EPOCH: self.epoch})

    async def _on_replay(self, msg: Any) -> None:
        if not msg.reply:
            return
        self._drain()
        self._wake.set()  # type: ignore[union-attr]
        outbox = self._outbox
        last = outbox.last_seq
        try:
            req = json.loads(msg.data or b"{}")
            start = int(req.get("from", 0))
            end = last if req.get("to") is None else min(int(req["to"]), last)
        except (ValueError, TypeError, AttributeError) as exc:
            await self._reply_error(msg.reply, f"bad replay request: {exc}")
            return
        self._counts["replays"] += 1
        if start < outbox.first and start <= end:
            self._counts["replays_gone"] += 1
            body = json.dumps({"error": "gone", "from": start, "oldest": outbox.first, "last": last}).encode()
            await self._reply(
                msg.reply, body, {HDR_REPLY: REPLY_GONE, HDR_EPOCH: self.epoch, HDR_OLDEST: str(outbox.first), HDR_SEQ: str(last)}
            )
            return
        batch = outbox.held(start, end)  # copied out: the ring can move while we await the sends
        for seq, payload in batch:
            if not await self._reply(msg.reply, payload, self._header_block(seq)):
                return
        await self._reply(msg.reply, b"", {HDR_REPLY: REPLY_END, HDR_EPOCH: self.epoch, HDR_SEQ: str(last)})

    async def _on_snapshot(self, msg: Any) -> None:
        if not msg.reply:
            return
        if self._manager is None:
            await self._reply(msg.reply, b"no pool attached", {HDR_REPLY: REPLY_UNAVAILABLE, HDR_EPOCH: self.epoch})
            return
        try:
            blocks, seq = self.take_snapshot()
            # The same cuts as live messages: an event too large for one message goes in slices.
            payloads = self._framer.snapshot(time.time(), blocks) if blocks else []
        except Exception as exc:  # the pool failed us: the requester is told, and asks again later
            self._counts["snapshot_errors"] += 1
            log.exception("kvbridge publisher %s: snapshot failed", self.config.worker_id)
            await self._reply_error(msg.reply, f"snapshot failed: {type(exc).__name__}: {exc}")
            return
        finally:
            self._wake.set()  # type: ignore[union-attr]  # the sender may have new messages
        self._counts["snapshots"] += 1
        headers = {HDR_REPLY: REPLY_SNAPSHOT, HDR_EPOCH: self.epoch, HDR_CONTENT_TYPE: self._content_type}
        for payload in payloads:
            if not await self._reply(msg.reply, payload, headers):
                return
        end = {HDR_REPLY: REPLY_SNAPSHOT_END, HDR_EPOCH: self.epoch, HDR_SEQ: str(seq), HDR_COUNT: str(len(payloads))}
        await self._reply(msg.reply, b"", end)

    def take_snapshot(self) -> tuple[list[Any], int]:
        """The attached pool's cached blocks and the seq they are consistent with (loop thread)."""
        manager = self._manager
        with self.lock:
            events = manager.take_events()
            if events:
                self.publish(events)
            blocks = list(manager.snapshot())
            self._queue.append(CUT)
        return blocks, self._drain()
