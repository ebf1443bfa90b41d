"""The subscriber's repair of a worker's stream: replay and snapshot requests.

A worker whose stream has a hole asks its replay subject for the missing range; one that is new
to us, restarted (a new epoch) or whose replay answered "gone" or brought back a malformed
message asks its snapshot subject instead, delivered as one ``reset=True`` update. Parked live
messages then follow in order. One resync task per worker at most; a request nobody answers is
asked again with growing pauses (longer while nobody serves the subject at all), until the worker
answers or expires. In JetStream mode a hole is first given a moment to fill from the stream.
The publisher's side of these requests is :mod:`kvbridge.bus.answers`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from nats.errors import NoRespondersError

from kvbridge.bus.delivery import Delivery
from kvbridge.bus.update import decode, parse_event_msg
from kvbridge.bus.worker import Worker
from kvbridge.wire.events import DecodeError, KVEventBatch
from kvbridge.wire.subjects import (
    FORMATS,
    HDR_CONTENT_TYPE,
    HDR_COUNT,
    HDR_EPOCH,
    HDR_REPLY,
    HDR_SEQ,
    REPLY_END,
    REPLY_ERROR,
    REPLY_GONE,
    REPLY_SNAPSHOT,
    REPLY_SNAPSHOT_END,
    REPLY_UNAVAILABLE,
)

__all__ = ["Resync"]

log = logging.getLogger("kvbridge.subscriber")

# JetStream mode: how long a hole may wait for the stream to fill it before the worker is asked.
_STREAM_HOLE_GRACE_S = 0.5
# Resync back-off: first pause, and the longest; nobody serving the subject starts it higher.
_BACKOFF_S = 0.05
_BACKOFF_NO_RESPONDERS_S = 0.5
_BACKOFF_MAX_S = 4.0
# _request's answer when nobody subscribes to the subject (a made-up or gone worker).
_NO_RESPONDERS = object()


class Resync(Delivery):
    """A worker's hole or restart repaired from the worker itself."""

    def _ensure_sync(self, w: Worker) -> None:
        if w.syncing is None and not self._closed:
            w.syncing = asyncio.create_task(self._resync(w), name=f"kvbridge-resync-{w.worker}")

    async def _resync(self, w: Worker) -> None:
        backoff = _BACKOFF_S
        try:
            if self.config.jetstream:
                await asyncio.sleep(_STREAM_HOLE_GRACE_S)
            seq = w.seq
            while not self._closed:
                if seq.hole_filled:
                    # The hole filled itself (JetStream: re-sends after a broker crash land in the
                    # stream behind later messages), possibly while the worker did not answer.
                    await self._drain_parked(w)
                    if not seq.parked:
                        return
                ok = await (self._snapshot(w) if seq.need_snapshot else self._replay(w))
                if ok is not True:
                    if ok is _NO_RESPONDERS:  # nobody serves this subject (yet): no hurry
                        backoff = max(backoff, _BACKOFF_NO_RESPONDERS_S)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    continue
                backoff = _BACKOFF_S
                await self._drain_parked(w)
                if not seq.need_snapshot and not seq.parked:
                    return
        finally:
            w.syncing = None

    async def _request(self, subject: str, payload: bytes, until: tuple[str, ...]) -> list[Any] | object | None:
        """Send a request and collect the reply stream up to a message whose Kv-Reply is in ``until``
        (or an error reply); None if nobody answered in time (the worker may be down: the caller
        retries), ``_NO_RESPONDERS`` if nobody serves the subject."""
        nc = self._nc
        inbox = nc.new_inbox()
        try:
            sub = await nc.subscribe(inbox, pending_msgs_limit=1 << 20, pending_bytes_limit=1 << 30)
            try:
                await nc.publish(subject, payload, reply=inbox)
                replies = []
                while True:
                    m = await sub.next_msg(timeout=self.config.request_timeout_s)
                    headers = m.headers or {}
                    kind = headers.get(HDR_REPLY)
                    if kind in until:
                        replies.append(m)
                        return replies
                    if kind == REPLY_ERROR:
                        self._counts["request_errors"] += 1
                        log.warning("kvbridge subscriber: %s answered with an error: %s", subject,
                                    m.data[:500].decode(errors="replace"))  # fmt: skip
                        return None
                    if kind is None and HDR_SEQ not in headers:
                        # nats-py hands the server's 503 "no responders" status to the inbox as a message.
                        return _NO_RESPONDERS if headers.get("Status") == "503" else None
                    replies.append(m)
            finally:
                await sub.unsubscribe()
        except NoRespondersError:
            return _NO_RESPONDERS
        except Exception as exc:  # timeouts, disconnects, a closing client
            if not self._closed:
                self._counts["request_timeouts"] += 1
                if self._permissions.denied("publish", subject):
                    log.debug("kvbridge request on %s refused by NATS permissions", subject)
                else:
                    log.debug("kvbridge request on %s failed: %r", subject, exc)
            return None

    async def _replay(self, w: Worker) -> object:  # True, False or _NO_RESPONDERS
        self._counts["replays"] += 1
        sq = w.seq
        parked_before = set(sq.parked)
        replies = await self._request(
            w.subjects.replay, json.dumps({"from": sq.next_seq, "epoch": sq.epoch}).encode(), (REPLY_END, REPLY_GONE)
        )
        if not isinstance(replies, list):
            return replies or False
        end = replies[-1].headers
        if end.get(HDR_EPOCH) != sq.epoch or end[HDR_REPLY] == REPLY_GONE:
            if end[HDR_REPLY] == REPLY_GONE:
                self._counts["replays_gone"] += 1
            sq.need_snapshot = True
            return True
        for m in replies[:-1]:
            try:
                epoch, seq, batch = parse_event_msg(m.headers or {}, m.data, self._raw_bodies)
            except DecodeError:
                # The worker's own copy is bad: every replay would bring it back. Only a snapshot
                # gets past it.
                self._counts["malformed"] += 1
                sq.need_snapshot = True
                return True
            take = sq.replayed(epoch, seq)
            if take is None:
                return False  # the publisher skipped: ask again (it will say "gone")
            if take:
                await self._notify(self._deliver(w, seq, batch, "replay"))
        # A parked message beyond what the worker had published when it answered was not sent by it.
        try:
            last = int(end.get(HDR_SEQ, "-1"))
        except ValueError:
            return False
        self._counts["malformed"] += sq.drop_bogus(parked_before, last)
        return True

    async def _snapshot(self, w: Worker) -> object:  # True, False or _NO_RESPONDERS
        replies = await self._request(w.subjects.snapshot, b"{}", (REPLY_SNAPSHOT_END, REPLY_UNAVAILABLE))
        if not isinstance(replies, list):
            return replies or False
        end = replies[-1].headers
        epoch = end.get(HDR_EPOCH)
        if not epoch:
            return False
        if end[HDR_REPLY] == REPLY_UNAVAILABLE:
            # No pool behind this publisher: nothing to rebuild from. Join the live stream where it is.
            at = w.seq.join_live(epoch)
            self._counts["snapshots"] += 1
            await self._notify(self._deliver(w, at, KVEventBatch(time.time(), []), "snapshot", reset=True))
            return True
        try:
            seq = int(end[HDR_SEQ])
            count = int(end[HDR_COUNT])
            chunks = [m for m in replies[:-1] if (m.headers or {}).get(HDR_REPLY) == REPLY_SNAPSHOT]
            if len(chunks) != count:
                return False  # part of the stream was lost: ask again
            events: list[Any] = []
            ts, rank = time.time(), None
            for m in chunks:
                batch = decode(m.data, FORMATS.get(m.headers.get(HDR_CONTENT_TYPE), "msgpack"))
                events.extend(batch.events)
                ts, rank = batch.ts, batch.data_parallel_rank
        except (KeyError, ValueError):
            self._counts["malformed"] += 1
            return False
        w.seq.snapshot_taken(epoch, seq)
        self._counts["snapshots"] += 1
        await self._notify(self._deliver(w, seq, KVEventBatch(ts, events, rank), "snapshot", reset=True))
        return True
