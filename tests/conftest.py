import json
import os
from pathlib import Path

import pytest
import pytest_asyncio


def _vectors_dir() -> Path:
    # The tests' own copy (tests/vectors/README.md says where it came from); KVBRIDGE_VECTORS
    # points at another set, e.g. newer vectors to try before copying them in.
    env = os.environ.get("KVBRIDGE_VECTORS")
    return Path(env) if env else Path(__file__).resolve().parent / "vectors"


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    path = _vectors_dir()
    if not path.is_dir():
        pytest.fail(f"compatibility vectors not found at {path} (set KVBRIDGE_VECTORS)")
    return path


@pytest.fixture(scope="session")
def load_vectors(vectors_dir):
    def load(name: str):
        return json.loads((vectors_dir / name).read_text())

    return load


# --- bridge: a real nats-server, and a check that nothing outlives the session -----------------


@pytest.fixture(scope="session")
def nats_server():
    """One nats-server (with JetStream) shared by the ordinary bridge tests."""
    from kvbridge.tools.server import NatsServer

    with NatsServer(jetstream=True) as server:
        yield server


@pytest_asyncio.fixture(loop_scope="function")
async def nats_sub(nats_server):
    """subscribe(subject) -> a Collector of the raw messages on it, over one shared connection."""
    from bridge_support import Collector, nats_connect

    nc = await nats_connect(nats_server.url)

    async def subscribe(subject: str) -> Collector:
        c = Collector()
        await nc.subscribe(subject, cb=c.on_msg)
        await nc.flush()
        return c

    yield subscribe
    await nc.close()


@pytest.fixture
def own_nats_server():
    """A private nats-server for tests that kill or restart it."""
    from kvbridge.tools.server import NatsServer

    with NatsServer() as server:
        yield server


@pytest.fixture
def own_js_server():
    """A private nats-server with JetStream (temp store dir, kept across restart()) to kill."""
    from kvbridge.tools.server import NatsServer

    with NatsServer(jetstream=True) as server:
        yield server


def _child_pids() -> set[int]:
    pids: set[int] = set()
    for task in Path("/proc/self/task").glob("*"):
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            pass
    return pids


@pytest.fixture
def stop_engines_at_end():
    """Call it with test engine threads (bridge_support.Engine): they are stopped and joined when
    the test ends, also when it fails midway (a test's own finish() is the success path)."""
    engines: list = []
    yield engines.extend
    for e in engines:
        e.stop_flag.set()
    for e in engines:
        if e.ident is not None:
            e.join(30)


@pytest.fixture(scope="session", autouse=True)
def _no_leftovers():
    """Tests must leave no process, kvbridge thread or test engine thread behind."""
    import threading
    import time

    yield
    deadline = time.monotonic() + 5
    while True:
        threads = [t.name for t in threading.enumerate() if t.name.startswith(("kvbridge", "engine-")) and t.is_alive()]
        children = _child_pids()
        if not threads and not children or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not threads, f"threads left running: {threads}"
    assert not children, f"child processes left running: {children}"
