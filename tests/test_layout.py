"""The package's layout by role: one home per module, ``kvbridge.vllm`` as the one face users type
besides the package, ``kvbridge``'s top-level names as they always were, and imports inside the
package that never go back up through the package face or run in a circle."""

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import kvbridge

PACKAGE = pathlib.Path(kvbridge.__file__).parent

# kvbridge.__all__ as it was before the regroup, plus every public exception (issue 20) and the
# router's EngineModel (issue 30), the LoadReport that KvEventSubscriber.loads holds and
# hit_tokens (what an IndexClient is asked for routing), copied here so a change to it is a
# change here.
TOP_LEVEL = [
    "ALGORITHMS", "AllBlocksCleared", "AuthenticationError", "BackgroundPublisher", "BlockHasher",
    "BlockRemoved", "BlockStored", "Config", "ConfigError", "ConnectError", "DecodeError", "DiscoveryError",
    "EngineModel", "Index", "IndexClient", "IndexQueryError", "IndexService", "IndexUnavailableError", "Error",
    "JetStreamError", "KVCacheManager", "KVEventBatch", "KvEventPublisher", "KvEventSubscriber",
    "LoadReport", "NatsServerError", "NoWorkersError", "PermissionDeniedError", "Router", "TraceError", "Update",
    "WorkerIdInUseError", "WorkerView", "__version__", "decode_batch", "encode_batch", "hash_blocks",
    "hit_tokens",
]  # fmt: skip

# The alias modules of the regroup, gone before any release (issue 20): each name has one home.
REMOVED = ["kvbridge.router", "kvbridge.server", "kvbridge.events", "kvbridge.pool", "kvbridge.publisher",
           "kvbridge.consumer"]  # fmt: skip


def test_top_level_names_unchanged():
    assert kvbridge.__all__ == TOP_LEVEL
    assert all(hasattr(kvbridge, name) for name in TOP_LEVEL)


@pytest.mark.parametrize("name", REMOVED)
def test_the_regroups_aliases_are_gone(name):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)


def test_kvbridge_vllm_re_exports_the_plugins_public_names():
    import kvbridge.engine.vllm as home
    import kvbridge.vllm as face

    assert face is not home  # a plain module, not a second name for the same object
    assert face.__all__ == home.__all__
    assert all(getattr(face, name) is getattr(home, name) for name in home.__all__)


def test_kvbridge_vllm_alone_imports_cleanly():
    # A fresh process whose first kvbridge import is the face (what users' scripts do).
    code = "from kvbridge.vllm import logger_factory, KvBridgeStatLogger\nprint(logger_factory.__module__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["kvbridge.engine.vllm"]


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _top_level_imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(imported module, names) for each import that runs when the module is loaded: statements at
    the top level (and under ``if``/``try``), not inside functions or ``if TYPE_CHECKING``."""
    found: list[tuple[str, list[str]]] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                found.extend((a.name, []) for a in node.names)
            elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body)
                for handler in node.handlers:
                    walk(handler.body)

    walk(tree.body)
    return found


def test_no_module_imports_through_the_package_face():
    # `from kvbridge import X` inside the package runs kvbridge/__init__.py's imports in the middle of
    # its own: only the face itself (and the vLLM face, a re-export) may name the package.
    offenders = []
    for name, tree in _modules().items():
        if name in ("kvbridge", "kvbridge.vllm"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "kvbridge" and node.level == 0:
                offenders.append(f"{name}: from kvbridge import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Import) and any(a.name == "kvbridge" for a in node.names):
                offenders.append(f"{name}: import kvbridge")
    assert offenders == []


def test_the_packages_load_time_imports_have_no_cycle():
    modules = _modules()
    names = set(modules)
    graph: dict[str, set[str]] = {}
    for name, tree in modules.items():
        edges = set()
        for target, imported in _top_level_imports(tree):
            if not target.startswith("kvbridge"):
                continue
            subs = {f"{target}.{n}" for n in imported if f"{target}.{n}" in names}
            edges |= subs or ({target} if target in names else set())
        # A package's __init__ importing its own submodules is how a package is assembled, not a cycle
        # (the face `kvbridge` imports them all; that no submodule imports it back is the test above).
        graph[name] = {t for t in edges if not t.startswith(name + ".")}
    assert "kvbridge.bus.connection" in graph["kvbridge.bus.publisher"]  # the walk sees real imports

    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []
