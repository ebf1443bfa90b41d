"""The package's layout by role keeps its promises: the paths users type stay the very same module
objects as their new homes, and ``kvbridge``'s top-level names are the ones it always had."""

import importlib
import subprocess
import sys

import pytest

import kvbridge

# The old path users type (an older install's vLLM plugin value, kvbridge.vllm.logger_factory in users'
# code, the docs and issues) -> its home.
STABLE = {
    "kvbridge.vllm": "kvbridge.engine.vllm",
    "kvbridge.router": "kvbridge.routing.router",
    "kvbridge.server": "kvbridge.tools.server",
    "kvbridge.events": "kvbridge.wire.events",
    "kvbridge.pool": "kvbridge.engine.pool",
    "kvbridge.publisher": "kvbridge.bus.publisher",
    "kvbridge.consumer": "kvbridge.bus.subscriber",
}

# kvbridge.__all__ as it was before the regroup, plus every public exception (issue 20), copied
# here so a change to it is a change here.
TOP_LEVEL = [
    "ALGORITHMS", "AllBlocksCleared", "AuthenticationError", "BackgroundPublisher", "BlockHasher",
    "BlockRemoved", "BlockStored", "Config", "ConfigError", "ConnectError", "DecodeError", "DiscoveryError",
    "Index", "IndexClient", "IndexQueryError", "IndexService", "IndexUnavailableError", "Error",
    "JetStreamError", "KVCacheManager", "KVEventBatch", "KvEventPublisher", "KvEventSubscriber",
    "NatsServerError", "NoWorkersError", "PermissionDeniedError", "Router", "Update",
    "WorkerIdInUseError", "WorkerView", "__version__", "decode_batch", "encode_batch", "hash_blocks",
]  # fmt: skip


@pytest.mark.parametrize("old, new", STABLE.items())
def test_a_stable_path_is_the_very_module_of_its_new_home(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)
    assert sys.modules[old] is sys.modules[new]
    parent, _, child = old.rpartition(".")
    assert getattr(sys.modules[parent], child) is sys.modules[new]  # `import kvbridge.vllm` binds it too


def test_monkeypatching_through_a_stable_path_reaches_the_code(monkeypatch):
    import kvbridge.server
    import kvbridge.tools.server

    def missing() -> str:
        raise kvbridge.server.NatsServerError("patched")

    monkeypatch.setattr(kvbridge.server, "find_nats_server", missing)
    assert kvbridge.tools.server.find_nats_server is missing


def test_top_level_names_unchanged():
    assert kvbridge.__all__ == TOP_LEVEL
    assert all(hasattr(kvbridge, name) for name in TOP_LEVEL)


def test_a_stable_path_alone_imports_cleanly():
    # A fresh process whose first kvbridge import is an old path (what vLLM's plugin loader and
    # users' scripts do): no import circle, and the private names are there.
    code = (
        "import kvbridge.events as e, kvbridge.router as r, kvbridge.server as s, kvbridge.vllm as v\n"
        "print(e.__name__, r.__name__, s.__name__, v.__name__, callable(e._MapBlockStored), callable(v._AggregateBase))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [
        "kvbridge.wire.events", "kvbridge.routing.router", "kvbridge.tools.server", "kvbridge.engine.vllm", "True", "True",
    ]  # fmt: skip
