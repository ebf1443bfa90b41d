"""One configuration object for publisher and subscriber.

Built from keyword arguments, ``KVBRIDGE_<FIELD>`` environment variables (``Config.from_env``), or
both (keywords win). Every field is checked once, here, with an error naming the field and the
environment variable, so a typo fails at start rather than as a NATS error minutes later.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import ssl
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from kvbridge.errors import Error
from kvbridge.wire.subjects import CONTENT_TYPES, Format, sanitize_token

__all__ = ["Config", "ConfigError"]

ENV_PREFIX = "KVBRIDGE_"
_SCHEMES = ("nats", "tls", "ws", "wss")


class ConfigError(Error, ValueError):
    """A configuration value is missing, malformed or inconsistent."""


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class Config:
    #: NATS server URL(s); a comma-separated string is split. Env: KVBRIDGE_SERVERS.
    servers: list[str] = field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    user: str | None = None
    password: str | None = None
    token: str | None = None
    #: A NATS .creds file (user JWT + nkey seed), or a bare nkey seed file.
    creds_file: str | None = None
    nkey_seed_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Subject prefix of this client's reply inboxes (nats-py's default ``_INBOX``). Give each user
    #: its own (``kvbridge auth-config`` prints it) so it may subscribe to its own replies only.
    inbox_prefix: str = "_INBOX"

    subject_prefix: str = "kv"
    model: str = "default"
    worker_id: str = field(default_factory=_default_worker_id)
    dp_rank: int | None = None
    encoding: Format = "msgpack"

    #: A NATS message carries at most this many events / bytes. linger_ms 0 (default): an idle
    #: publisher sends each hand-off at once, a busy one coalesces what arrives while it sends;
    #: > 0: poll for hand-offs at that interval while busy (fewer, larger messages, more latency).
    max_batch_events: int = 1024
    max_batch_bytes: int = 512 * 1024
    linger_ms: float = 0.0
    #: Bytes of encoded messages kept for replay and for re-sending after an outage.
    ring_buffer_bytes: int = 64 * 1024 * 1024
    #: Engine hand-offs not yet taken by the publisher loop; beyond it the oldest are dropped.
    queue_max_batches: int = 65536
    #: An idle publisher sends an empty batch this often so consumers notice a lost tail.
    heartbeat_s: float = 1.0

    connect_timeout_s: float = 2.0
    #: -1: reconnect forever.
    max_reconnect_attempts: int = -1
    reconnect_wait_s: float = 0.5
    request_timeout_s: float = 2.0
    #: Keepalive: a PING to the server this often; a connection with more than
    #: ``max_outstanding_pings`` of them unanswered, and nothing else received meanwhile, is dead
    #: and replaced (reconnect). A path that dies without a FIN or RST (a dead node, NAT or
    #: conntrack entry) is noticed within ``ping_interval_s * (max_outstanding_pings + 1)``: 3 s
    #: by default (nats-py's: 6 min).
    ping_interval_s: float = 1.0
    max_outstanding_pings: int = 2
    #: Subscribers drop a worker not heard from for this long (never sooner than 3 of the worker's
    #: own heartbeat intervals; a worker with heartbeat_s 0 is never dropped by time). 0: never.
    worker_timeout_s: float = 10.0

    jetstream: bool = False
    stream_name: str = "KV_EVENTS"
    stream_max_age_s: float = 3600.0
    stream_duplicate_window_s: float = 120.0
    #: Copies of the stream kept by a JetStream cluster (1..5; at most the cluster's JetStream
    #: servers). Applied by whoever creates the stream; an existing stream keeps its own.
    stream_replicas: int = 1

    #: vLLM stat logger (kvbridge.vllm): publish each engine's LoadReport at most this often; 0: never.
    load_interval_s: float = 1.0

    #: Prometheus HTTP exporter port on 127.0.0.1-or-``metrics_addr``; None: no exporter.
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if isinstance(self.servers, str):
            self.servers = [s.strip() for s in self.servers.split(",") if s.strip()]
        self._validate()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Defaults, overridden by ``KVBRIDGE_*`` variables, overridden by ``overrides``."""
        env = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        for key in overrides:
            if key not in known:
                raise ConfigError(f"unknown kvbridge option {key!r}")
        values: dict[str, Any] = {}
        for name, f in known.items():
            var = ENV_PREFIX + name.upper()
            if name in overrides:
                values[name] = overrides[name]
            elif var in env:
                values[name] = _parse_env(var, env[var], f.type)
        return cls(**values)

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied, checked like a new config."""
        known = {f.name for f in fields(self)}
        for key in changes:
            if key not in known:
                raise ConfigError(f"unknown kvbridge option {key!r}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def resolve(cls, config: Config | None = None, **options: Any) -> Config:
        """The config a component was given, as its constructors take it: ``config`` with
        ``options`` applied, or (no ``config``) the environment with ``options`` applied."""
        if config is None:
            return cls.from_env(**options)
        if not isinstance(config, Config):
            raise TypeError(f"config must be a kvbridge.Config, got {type(config).__name__} (options go as keywords: "
                            f"servers=..., model=...)")  # fmt: skip
        return config.replace(**options) if options else config

    # -- validation ---------------------------------------------------------------------------

    def _validate(self) -> None:
        if not isinstance(self.servers, (list, tuple)) or not all(isinstance(u, str) for u in self.servers):
            _fail("servers", f"must be NATS URLs (a list of str, or one str, comma-separated), got {self.servers!r}")
        if not self.servers:
            _fail("servers", "at least one NATS server URL is required")
        for name in ("user", "password", "token"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                _fail(name, f"must be a str, got {type(value).__name__}")  # the value itself may be a secret
        for url in self.servers:
            scheme = url.split("://", 1)[0] if "://" in url else ""
            if scheme not in _SCHEMES:
                _fail("servers", f"{url!r} is not a NATS URL (expected {'/'.join(_SCHEMES)}://host:port)")
        if (self.user is None) != (self.password is None):
            _fail("user", "user and password must be given together")
        if self.token is not None and self.user is not None:
            _fail("token", "use either a token or user/password, not both")
        if self.creds_file and self.nkey_seed_file:
            _fail("creds_file", "use either a creds file or an nkey seed file, not both")
        if bool(self.tls_cert) != bool(self.tls_key):
            _fail("tls_cert", "a TLS client certificate needs its key (tls_key), and vice versa")
        for name in ("creds_file", "nkey_seed_file", "tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                _fail(name, f"file not found: {path}")
        if not isinstance(self.encoding, str) or self.encoding not in CONTENT_TYPES:
            _fail("encoding", f"must be one of {sorted(CONTENT_TYPES)}, got {self.encoding!r}")
        for name in ("subject_prefix", "inbox_prefix"):
            value = getattr(self, name)
            if not isinstance(value, str) or any(c in value for c in " *>\t\r\n") or "" in value.split("."):
                _fail(name, f"{value!r} is not a valid subject prefix (dot-separated tokens, no wildcards)")
        for name in ("model", "worker_id"):
            value = getattr(self, name)
            if not isinstance(value, str):
                _fail(name, f"must be a str, got {value!r}")
            try:
                setattr(self, name, sanitize_token(value))
            except ValueError:
                _fail(name, "must be non-empty")
        for name, low in (
            ("max_batch_events", 1),
            ("max_batch_bytes", 1024),
            ("ring_buffer_bytes", 1024),
            ("queue_max_batches", 1),
            ("max_outstanding_pings", 1),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                _fail(name, f"must be an integer >= {low}, got {value!r}")
        for name in ("linger_ms", "heartbeat_s", "reconnect_wait_s", "stream_duplicate_window_s", "worker_timeout_s",
                     "load_interval_s"):
            value = getattr(self, name)
            if not _number(value) or not 0 <= value < math.inf:
                _fail(name, f"must be a finite number >= 0, got {value!r}")
        for name in ("connect_timeout_s", "request_timeout_s", "stream_max_age_s", "ping_interval_s"):
            value = getattr(self, name)
            if not _number(value) or not 0 < value < math.inf:
                _fail(name, f"must be a finite number > 0, got {value!r}")
        value = self.max_reconnect_attempts
        if not isinstance(value, int) or isinstance(value, bool) or value < -1:
            _fail("max_reconnect_attempts", f"must be -1 (forever) or a count >= 0, got {value!r}")
        value = self.dp_rank
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            _fail("dp_rank", f"must be a non-negative integer, got {value!r}")
        if not isinstance(self.jetstream, bool):
            _fail("jetstream", f"must be True or False, got {self.jetstream!r}")
        port = self.metrics_port
        if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535):
            _fail("metrics_port", f"must be a TCP port (an int from 0 to 65535) or None, got {port!r}")
        if not isinstance(self.metrics_addr, str) or not self.metrics_addr:
            _fail("metrics_addr", f"must be a host address, got {self.metrics_addr!r}")
        if not isinstance(self.stream_replicas, int) or isinstance(self.stream_replicas, bool) or not (
            1 <= self.stream_replicas <= 5
        ):
            _fail("stream_replicas", f"must be an integer from 1 to 5 (JetStream's limit), got {self.stream_replicas!r}")
        name = self.stream_name
        if self.jetstream and (not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum()):
            _fail("stream_name", f"{self.stream_name!r} is not a valid stream name")

    # -- what nats-py needs ---------------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext | None:
        needs_tls = self.tls_ca or self.tls_cert or any(u.startswith(("tls://", "wss://")) for u in self.servers)
        if not needs_tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` (reconnect policy and auth), minus callbacks."""
        opts: dict[str, Any] = {
            "servers": list(self.servers),
            "connect_timeout": self.connect_timeout_s,
            "reconnect_time_wait": self.reconnect_wait_s,
            # nats-py 2.x treats any value <= 0 as "forever" and a positive value as a limit, so
            # 0 attempts has to be spelled as "do not reconnect".
            "max_reconnect_attempts": self.max_reconnect_attempts if self.max_reconnect_attempts != 0 else 1,
            "allow_reconnect": self.max_reconnect_attempts != 0,
            "name": f"kvbridge/{self.model}/{self.worker_id}",
            "inbox_prefix": self.inbox_prefix,
            "ping_interval": self.ping_interval_s,
            "max_outstanding_pings": self.max_outstanding_pings,
        }
        if self.user is not None:
            opts["user"], opts["password"] = self.user, self.password
        if self.token is not None:
            opts["token"] = self.token
        if self.creds_file:
            opts["user_credentials"] = self.creds_file
        if self.nkey_seed_file:
            opts["nkeys_seed"] = self.nkey_seed_file
        ctx = self.ssl_context()
        if ctx is not None:
            opts["tls"] = ctx
        return opts


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fail(name: str, why: str) -> None:
    raise ConfigError(f"kvbridge config {name} ({ENV_PREFIX}{name.upper()}): {why}")


def _parse_env(var: str, raw: str, annotation: Any) -> Any:
    kind = str(annotation)
    try:
        if kind.startswith("bool"):
            low = raw.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(raw)
            return low in ("1", "true", "yes", "on")
        if kind.startswith("int"):
            return int(raw) if raw.strip() else None
        if kind.startswith("float"):
            return float(raw)
        if kind.startswith("list"):
            return [s.strip() for s in raw.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"{var}={raw!r}: expected {kind.split(' ')[0]}") from None
    return raw if raw != "" or "None" not in kind else None
