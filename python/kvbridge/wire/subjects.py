"""Subject names and header names: the parts of the wire contract that are not the payload.

Publisher and consumer both build and parse through here so the two sides cannot drift.
See docs/wire-format.md.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

__all__ = [
    "CONTENT_TYPES",
    "FORMATS",
    "Format",
    "HDR_CONTENT_TYPE",
    "HDR_COUNT",
    "HDR_EPOCH",
    "HDR_HEARTBEAT",
    "HDR_MSG_ID",
    "HDR_OLDEST",
    "HDR_REPLY",
    "HDR_SEQ",
    "QUERY_QUEUE_GROUP",
    "REPLY_END",
    "REPLY_ERROR",
    "REPLY_GONE",
    "REPLY_SNAPSHOT",
    "REPLY_SNAPSHOT_END",
    "REPLY_UNAVAILABLE",
    "WorkerSubjects",
    "events_pattern",
    "load_subject",
    "parse_events_subject",
    "parse_load_subject",
    "query_subject",
    "route_subject",
    "sanitize_token",
]

HDR_SEQ = "Kv-Seq"
HDR_EPOCH = "Kv-Epoch"
HDR_MSG_ID = "Nats-Msg-Id"
# The publisher's heartbeat interval in seconds ("0": it sends none), on every event message, so a
# subscriber never expires a worker sooner than a few of that worker's own heartbeats.
HDR_HEARTBEAT = "Kv-Heartbeat"
HDR_CONTENT_TYPE = "Content-Type"
# Replies to replay/snapshot requests are streams of messages to the requester's inbox; the kind of
# each message is in Kv-Reply (absent on the replayed event messages themselves, which are sent
# exactly as they were published).
HDR_REPLY = "Kv-Reply"
HDR_OLDEST = "Kv-Oldest"
HDR_COUNT = "Kv-Count"

#: The NATS queue group index service replicas answer queries in (one answer per query).
QUERY_QUEUE_GROUP = "kvbridge-index"

REPLY_END = "end"  # replay done; Kv-Seq = newest seq the publisher holds (-1: none yet)
REPLY_GONE = "gone"  # the start seq is no longer buffered; Kv-Oldest = oldest seq still held
REPLY_SNAPSHOT = "snapshot"  # one chunk of a snapshot (a KVEventBatch of BlockStored)
REPLY_SNAPSHOT_END = "snapshot-end"  # Kv-Seq = seq the snapshot is consistent with, Kv-Count = chunks
REPLY_UNAVAILABLE = "unavailable"  # no pool attached: this publisher cannot snapshot
REPLY_ERROR = "error"  # the request failed; the body says why (a request never goes unanswered)

#: A payload encoding: vLLM's msgpack, or the same structure as JSON.
Format = Literal["msgpack", "json"]
CONTENT_TYPES: dict[Format, str] = {"msgpack": "application/msgpack", "json": "application/json"}
FORMATS: dict[str, Format] = {v: k for k, v in CONTENT_TYPES.items()}

_BAD_TOKEN_CHARS = re.compile(r"[.*>\s]+")


def sanitize_token(name: str) -> str:
    """Make ``name`` one NATS subject token: ``.``, ``*``, ``>`` and whitespace become ``_``."""
    token = _BAD_TOKEN_CHARS.sub("_", str(name))
    if not token:
        raise ValueError("a subject token cannot be empty")
    return token


class WorkerSubjects(NamedTuple):
    events: str
    replay: str
    snapshot: str

    @classmethod
    def build(cls, prefix: str, model: str, worker: str) -> WorkerSubjects:
        tail = f"{sanitize_token(model)}.{sanitize_token(worker)}"
        return cls(f"{prefix}.events.{tail}", f"{prefix}.replay.{tail}", f"{prefix}.snapshot.{tail}")


def events_pattern(prefix: str, model: str | None = None, worker: str | None = None, kind: str = "events") -> str:
    """The subscription subject for events (or ``kind``) of one model/worker, or ``*`` for any."""
    m = sanitize_token(model) if model else "*"
    w = sanitize_token(worker) if worker else "*"
    return f"{prefix}.{kind}.{m}.{w}"


def query_subject(prefix: str, model: str) -> str:
    """Where an index service answers overlap queries for ``model`` (a queue group: replicas share it)."""
    return f"{prefix}.query.{sanitize_token(model)}"


def route_subject(prefix: str, model: str) -> str:
    """Where router replicas of one model share their decisions (:mod:`kvbridge.routing.sync`)."""
    return f"{prefix}.route.{sanitize_token(model)}"


def parse_events_subject(subject: str, prefix: str, kind: str = "events") -> tuple[str, str] | None:
    """``(model, worker)`` of an events (or ``kind``) subject under ``prefix``, None if it is not one."""
    head = f"{prefix}.{kind}."
    if not subject.startswith(head):
        return None
    parts = subject[len(head) :].split(".")
    if len(parts) != 2 or not all(parts):
        return None
    return parts[0], parts[1]


# -- load reports (kvbridge.wire.events.LoadReport): <prefix>.load.<model>.<worker> ---------------------


def load_subject(prefix: str, model: str | None = None, worker: str | None = None) -> str:
    """One worker's load subject; a model or worker left out is ``*`` (a subscription pattern)."""
    return events_pattern(prefix, model, worker, "load")


def parse_load_subject(subject: str, prefix: str) -> tuple[str, str] | None:
    """``(model, worker)`` of a load subject under ``prefix``, None if it is not one."""
    return parse_events_subject(subject, prefix, "load")
