"""Least-privilege nats-server users for a kvbridge deployment (``kvbridge auth-config``).

One user per worker and per router of one model. What each may do is exactly what kvbridge does
(docs/security.md explains each line):

worker ``W``
    publish its own events and load subjects; request on its own replay subject (the start-up
    probe for a second publisher with the same worker id); answer replay/snapshot requests, which
    are streams of messages to the requester's inbox. ``allow_responses`` allows one reply per
    request, so replies are allowed by subject instead: every client gets its own inbox prefix
    (``inbox_prefix``: ``_INBOX.<prefix>.<model>.w.<W>`` for a worker, ``...r.<R>`` for a router),
    and a worker may publish into routers' inboxes (and its own, to answer its twin's probe)
    only -- never into another worker's. Subscribe: its own replay/snapshot subjects and its own
    inbox. With JetStream: read the stream's info; never create, update or delete it.
router ``R``
    subscribe every events and load subject of the model (and the query subject: a router may
    host the index service, one reply per query via ``allow_responses``), and its own inbox;
    request replay/snapshot from any worker and query the index service; publish and subscribe the
    model's route subject (replicas sharing decisions, kvbridge.routing.sync). With JetStream: create
    the stream if it is missing (whoever creates it sets its replicas), read its info, create and
    delete its own ephemeral consumers, answer flow control.

Names are sanitised exactly as subjects are (:func:`kvbridge.wire.subjects.sanitize_token`).
"""

from __future__ import annotations

import re
import secrets
from typing import Iterable, NamedTuple, Sequence

from kvbridge.wire.subjects import WorkerSubjects, load_subject, sanitize_token

__all__ = ["Principal", "authorization_block", "inbox_prefix", "principals"]


class Principal(NamedTuple):
    role: str  # "worker" | "router"
    name: str  # sanitised: the NATS user name and (for a worker) the worker id
    inbox: str  # its inbox_prefix
    publish: list[str]
    subscribe: list[str]
    allow_responses: bool


def inbox_prefix(prefix: str, model: str, role: str, name: str) -> str:
    """The reply-inbox prefix of one user: ``_INBOX.<prefix>.<model>.<w|r>.<name>``."""
    return f"_INBOX.{prefix}.{sanitize_token(model)}.{role[0]}.{sanitize_token(name)}"


def _names(names: Iterable[str], what: str) -> list[str]:
    out: list[str] = []
    for i, raw in enumerate(names):
        try:
            name = sanitize_token(raw.strip())
        except ValueError:
            raise ValueError(f"{what}[{i}]: empty name (expected a comma-separated list of names)") from None
        if name in out:
            raise ValueError(f"{what}[{i}]: {raw!r} is listed twice (after sanitising: {name!r})")
        out.append(name)
    return out


def principals(model: str, workers: Sequence[str], routers: Sequence[str] = (), *, prefix: str = "kv",
               jetstream: bool = False, stream_name: str = "KV_EVENTS") -> list[Principal]:  # fmt: skip
    """The users and their permissions, workers first."""
    m = sanitize_token(model)
    ws, rs = _names(workers, "workers"), _names(routers, "routers")
    if not ws:
        raise ValueError("workers: at least one worker name is required")
    both = set(ws) & set(rs)
    if both:
        raise ValueError(f"routers: {sorted(both)} also named as workers; every user needs its own name")
    router_inboxes = f"_INBOX.{prefix}.{m}.r.>"
    js_info = f"$JS.API.STREAM.INFO.{stream_name}"
    out = []
    for w in ws:
        subj = WorkerSubjects.build(prefix, m, w)
        inbox = inbox_prefix(prefix, m, "worker", w)
        publish = [subj.events, load_subject(prefix, m, w), subj.replay, router_inboxes, inbox + ".>"]
        if jetstream:
            publish.append(js_info)
        out.append(Principal("worker", w, inbox, publish, [subj.replay, subj.snapshot, inbox + ".>"], False))
    for r in rs:
        inbox = inbox_prefix(prefix, m, "router", r)
        publish = [f"{prefix}.replay.{m}.*", f"{prefix}.snapshot.{m}.*", f"{prefix}.query.{m}", f"{prefix}.route.{m}"]
        if jetstream:
            publish += [
                js_info,
                f"$JS.API.STREAM.CREATE.{stream_name}",
                f"$JS.API.CONSUMER.CREATE.{stream_name}",
                f"$JS.API.CONSUMER.CREATE.{stream_name}.>",
                f"$JS.API.CONSUMER.DELETE.{stream_name}.*",
                f"$JS.FC.{stream_name}.>",
            ]
        subscribe = [f"{prefix}.events.{m}.*", load_subject(prefix, m), f"{prefix}.query.{m}", f"{prefix}.route.{m}", inbox + ".>"]
        out.append(Principal("router", r, inbox, publish, subscribe, True))
    return out


_ENV_SAFE = re.compile(r"[^A-Za-z0-9_]")


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def authorization_block(model: str, workers: Sequence[str], routers: Sequence[str] = (), *, prefix: str = "kv",
                        jetstream: bool = False, stream_name: str = "KV_EVENTS", password_env: str | None = None,
                        passwords: dict[str, str] | None = None) -> str:  # fmt: skip
    """A nats-server ``authorization { users = [...] }`` block.

    Passwords: ``password_env="NATS_PASS"`` writes ``$NATS_PASS_<USER>`` (nats-server reads it from
    its environment); otherwise ``passwords[name]``, or a random one per user, also printed in a
    comment for handing out."""
    people = principals(model, workers, routers, prefix=prefix, jetstream=jetstream, stream_name=stream_name)
    given = dict(passwords or {})
    lines = [
        f"# kvbridge users for model {model!r} under subject prefix {prefix!r}"
        + (f", JetStream stream {stream_name}" if jetstream else ""),
        "# Each client connects as its user with KVBRIDGE_INBOX_PREFIX set as shown (replies reach it there only).",
    ]
    if jetstream:
        lines.append("# The stream is created by a router (or an admin): workers may only read its info, so start a")
        lines.append("# router first, and give workers the stream_* settings the stream has.")
    secrets_out = []
    entries = []
    for p in people:
        if password_env:
            pw = "$" + _ENV_SAFE.sub("_", f"{password_env}_{p.name}").upper()
        else:
            pw = given.get(p.name) or secrets.token_urlsafe(18)
            secrets_out.append(f"#   {p.name}: {pw}")
            pw = _quote(pw)
        env = f"KVBRIDGE_USER={p.name} KVBRIDGE_INBOX_PREFIX={p.inbox}"
        if p.role == "worker":
            env += f" KVBRIDGE_WORKER_ID={p.name}"
        body = [
            f"    # {p.role} {p.name}: {env}",
            f"    {{user: {_quote(p.name)}, password: {pw}, permissions: {{",
            f"      publish: {{allow: [{', '.join(_quote(s) for s in p.publish)}]}}",
            f"      subscribe: {{allow: [{', '.join(_quote(s) for s in p.subscribe)}]}}",
        ]
        if p.allow_responses:
            body.append("      allow_responses: true")
        body.append("    }}")
        entries.append("\n".join(body))
    if secrets_out:
        lines.append("# Generated passwords (hand each to its client, then delete these lines):")
        lines += secrets_out
    elif password_env:
        lines.append(f"# Passwords come from nats-server's environment: {password_env.upper()}_<USER>.")
    lines.append("authorization {")
    lines.append("  users = [")
    lines.append("\n".join(entries))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"
