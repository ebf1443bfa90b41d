"""JetStream mode's stream: created or updated in place, and what a failing JetStream API call means.

The stream
    One stream, ``stream_name`` (default ``KV_EVENTS``), over ``<prefix>.events.>``: every model
    and worker under the prefix. One stream per prefix rather than per model because stream
    subjects may not overlap, so per-model streams would need per-model names and every consumer
    would need to know them; a subscriber filters by model/worker with the consumer's filter
    subject instead. File storage, limits retention, ``max_age = stream_max_age_s``,
    ``duplicate_window = stream_duplicate_window_s`` (de-duplication on ``Nats-Msg-Id``).

    Every publisher ensures the stream at start: created if missing, otherwise *updated in place*
    (never deleted and re-created, so what other workers stored stays) when our subject is not
    covered or the limits differ from this publisher's config. Updating with a smaller max age
    drops older messages: that is the operator's choice, made by configuring it.

In a cluster
    ``stream_replicas`` (default 1) is the replica count a *new* stream gets; more than the
    cluster has JetStream servers, or more than 1 on a single server, is refused with a
    :class:`JetStreamError` saying so. An existing stream keeps its count (a mismatch is logged):
    workers configured differently never scale a shared stream up and down. Losing the node that
    leads the stream means a few seconds (4-9 s measured on one machine) in which the stream
    stores nothing and its API may not answer: publishers keep everything in the ring, log the
    outage (at most every 5 s) and re-send when the new leader answers; starting publishers and
    subscribers wait up to ``START_PATIENCE_S`` for JetStream to answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js import api
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from kvbridge.config import Config, ConfigError
from kvbridge.errors import Error

__all__ = ["OUTAGE_LOG_EVERY_S", "START_PATIENCE_S", "JetStreamError", "api_failure", "ensure_stream", "stream_subjects"]

log = logging.getLogger("kvbridge.jetstream")

# How long a publisher or subscriber starting keeps trying while JetStream does not answer (a
# cluster electing a leader takes a few seconds); a server without JetStream fails at once.
START_PATIENCE_S = 15.0
# A stream outage is logged at most this often while it lasts.
OUTAGE_LOG_EVERY_S = 5.0
# JetStream API error code: "stream name already in use" (another worker created it first).
_ERR_STREAM_NAME_IN_USE = 10058
# "JetStream system temporarily unavailable": a cluster without a meta leader for now.
_ERR_UNAVAILABLE = 10008
# Replica counts the server cannot place: 10074 "replicas > 1 not supported in non-clustered mode",
# 10005 "no suitable peers for placement", 10023 "insufficient resources", 10052 "replicas > 5".
_ERR_REPLICAS = (10074, 10005, 10023, 10052)


class JetStreamError(Error, RuntimeError):
    """JetStream is not available, or the stream cannot be created/updated as configured.
    ``transient``: JetStream did not answer in time (a leader election, an overload): try later."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def stream_subjects(config: Config) -> list[str]:
    return [f"{config.subject_prefix}.events.>"]


async def ensure_stream(nc: Any, config: Config, *, update: bool = True, patience: float = 0.0,
                        permissions: Any = None) -> api.StreamInfo:  # fmt: skip
    """Create the stream, or update it in place to cover our subject with our limits (``update``;
    subscribers only create a missing one: a reader should not change what writers keep).

    The creator sets ``stream_replicas``; an existing stream keeps its replica count whatever our
    config says (a mismatch is logged): publishers configured differently must not scale a shared
    stream up and down against each other. JetStream not answering for a while is what a cluster
    electing a leader looks like: tried again for up to ``patience`` seconds -- unless
    ``permissions`` (:class:`kvbridge.bus.connection.Permissions`) shows that the server refused the
    request itself, which also looks like no answer: then PermissionDeniedError names the subject."""
    if config.stream_duplicate_window_s > config.stream_max_age_s:
        raise ConfigError(
            "kvbridge config stream_duplicate_window_s (KVBRIDGE_STREAM_DUPLICATE_WINDOW_S): "
            f"{config.stream_duplicate_window_s}s is longer than stream_max_age_s ({config.stream_max_age_s}s)"
        )
    deadline = time.monotonic() + patience
    while True:
        try:
            return await _ensure_stream_once(nc, config, update)
        except JetStreamError as exc:
            if exc.transient and permissions is not None:
                name = config.stream_name
                permissions.raise_if_denied(
                    publish=[f"$JS.API.STREAM.{op}.{name}" for op in ("INFO", "CREATE", "UPDATE")]
                )
            if not exc.transient or time.monotonic() + config.request_timeout_s / 2 > deadline:
                raise
            log.info("kvbridge: %s; trying again", exc)
            await asyncio.sleep(min(0.5, config.request_timeout_s / 2))


async def _ensure_stream_once(nc: Any, config: Config, update: bool) -> api.StreamInfo:
    jsm = nc.jetstream(timeout=config.request_timeout_s)
    want = stream_subjects(config)
    try:
        for _ in range(3):  # create/update races with other workers starting at the same time
            try:
                info = await jsm.stream_info(config.stream_name)
            except NotFoundError:
                try:
                    return await jsm.add_stream(
                        api.StreamConfig(
                            name=config.stream_name,
                            subjects=want,
                            storage=api.StorageType.FILE,
                            retention=api.RetentionPolicy.LIMITS,
                            discard=api.DiscardPolicy.OLD,
                            max_age=config.stream_max_age_s,
                            duplicate_window=config.stream_duplicate_window_s,
                            num_replicas=config.stream_replicas,
                        )
                    )
                except APIError as exc:
                    if exc.err_code == _ERR_STREAM_NAME_IN_USE:
                        continue
                    if exc.err_code in _ERR_REPLICAS:
                        raise JetStreamError(
                            f"cannot create JetStream stream {config.stream_name!r} with stream_replicas="
                            f"{config.stream_replicas} (KVBRIDGE_STREAM_REPLICAS): the server refused "
                            f"({exc.description or exc}); a stream cannot have more replicas than the cluster "
                            f"has JetStream servers, and a single server (no cluster) takes 1 only"
                        ) from exc
                    raise
            current = info.config
            have = current.num_replicas or 1
            if have != config.stream_replicas:
                log.warning(
                    "kvbridge: JetStream stream %s exists with %d replica(s), this config says stream_replicas=%d: "
                    "keeping the stream's (whoever creates a stream sets its replicas; change it with the "
                    "nats CLI, not by starting workers configured otherwise)",
                    config.stream_name, have, config.stream_replicas,
                )  # fmt: skip
            subjects = list(current.subjects or [])
            missing = [s for s in want if s not in subjects]
            if not update or (
                not missing
                and _same(current.max_age, config.stream_max_age_s)
                and _same(current.duplicate_window, config.stream_duplicate_window_s)
            ):
                return info
            log.info(
                "kvbridge: updating stream %s in place (subjects +%s, max_age %ss, duplicate_window %ss)",
                config.stream_name, missing, config.stream_max_age_s, config.stream_duplicate_window_s,
            )  # fmt: skip
            # evolve() keeps everything else, num_replicas included.
            return await jsm.update_stream(
                current.evolve(
                    subjects=subjects + missing,
                    max_age=config.stream_max_age_s,
                    duplicate_window=config.stream_duplicate_window_s,
                )
            )
        raise JetStreamError(f"stream {config.stream_name}: kept changing while being created")
    except (APIError, NatsError, asyncio.TimeoutError) as exc:
        if isinstance(exc, JetStreamError):
            raise
        raise api_failure(f"cannot create or update JetStream stream {config.stream_name!r} over {want}", exc,
                           config) from exc  # fmt: skip


def api_failure(what: str, exc: BaseException, config: Config) -> JetStreamError:
    """A JetStream API call failed: say whether JetStream is absent or only unavailable for now."""
    if isinstance(exc, (ServiceUnavailableError, NoRespondersError)):
        # A server without -js answers the API with "no responders" at once.
        # nats-py's text for it is a row of Nones: say what it means.
        return JetStreamError(
            f"JetStream is not enabled on the NATS server at {', '.join(config.servers)} (nothing answers $JS.API, "
            f"so {what}): "
            f"start nats-server with -js, or unset KVBRIDGE_JETSTREAM"
        )
    timeout = config.request_timeout_s
    if isinstance(exc, asyncio.TimeoutError) or (isinstance(exc, APIError) and exc.err_code == _ERR_UNAVAILABLE):
        why = (f"JetStream did not answer within {timeout}s ({type(exc).__name__}: {exc}); a JetStream cluster "
               f"electing a leader (after a node loss: a few seconds) or an overloaded server")  # fmt: skip
        return JetStreamError(f"{what}: {why}", transient=True)
    return JetStreamError(f"{what}: {type(exc).__name__}: {exc}")


def _same(seconds: float | None, want: float) -> bool:
    return seconds is not None and abs(seconds - want) < 1e-3
