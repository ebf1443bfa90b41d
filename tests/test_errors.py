"""One root for kvbridge's own errors, each keeping the builtin base callers already catch; one
place that merges a given config with keyword options."""

import pytest

import kvbridge
from kvbridge import Config, ConfigError
from kvbridge.bus.connection import AuthenticationError, ConnectError, PermissionDeniedError, WorkerIdInUseError
from kvbridge.engine.discover import DiscoveryError
from kvbridge.tools.server import NatsServerError


def _package_exceptions() -> dict[str, type]:
    """Every public exception class defined anywhere in the package (each module imported)."""
    import importlib
    import pkgutil

    found: dict[str, type] = {}
    for mod in pkgutil.walk_packages(kvbridge.__path__, "kvbridge."):
        if mod.name.endswith("__main__"):
            continue  # runs the CLI
        module = importlib.import_module(mod.name)
        for name, obj in vars(module).items():
            if (isinstance(obj, type) and issubclass(obj, BaseException) and not name.startswith("_")
                    and obj.__module__.startswith("kvbridge")):  # fmt: skip
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_exception_the_package_defines_is_a_kvbridge_error_and_exported():
    found = _package_exceptions()
    assert len(found) >= 13, sorted(found)  # the walk really found them (13 when this was written)
    for qualname, cls in found.items():
        assert issubclass(cls, kvbridge.Error), qualname
        assert getattr(kvbridge, cls.__name__, None) is cls, f"{qualname} is not exported as kvbridge.{cls.__name__}"


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (kvbridge.ConfigError, ValueError),
        (kvbridge.DecodeError, ValueError),
        (DiscoveryError, ValueError),
        (kvbridge.ConnectError, ConnectionError),
        (AuthenticationError, ConnectError),
        (PermissionDeniedError, ConnectError),
        (WorkerIdInUseError, ConnectError),
        (kvbridge.JetStreamError, RuntimeError),
        (NatsServerError, RuntimeError),
        (kvbridge.IndexQueryError, ValueError),
        (kvbridge.IndexUnavailableError, TimeoutError),
        (kvbridge.NoWorkersError, LookupError),
    ],
)
def test_every_error_is_a_kvbridge_error_and_keeps_its_builtin_base(cls, builtin):
    assert issubclass(cls, kvbridge.Error) and issubclass(cls, builtin)
    with pytest.raises(kvbridge.Error):
        raise cls("x")
    with pytest.raises(builtin):
        raise cls("x")


def test_the_root_error_is_exported():
    assert "Error" in kvbridge.__all__ and "JetStreamError" in kvbridge.__all__
    assert kvbridge.errors.Error is kvbridge.Error


def test_decode_error_is_caught_as_the_root():
    with pytest.raises(kvbridge.Error, match="."):
        kvbridge.decode_batch(b"\xc1not msgpack")


def test_resolve_without_config_reads_the_environment_then_options(monkeypatch):
    monkeypatch.setenv("KVBRIDGE_MODEL", "from-env")
    monkeypatch.setenv("KVBRIDGE_WORKER_ID", "w-env")
    cfg = Config.resolve(None, worker_id="w-opt")
    assert (cfg.model, cfg.worker_id) == ("from-env", "w-opt")


def test_resolve_with_config_applies_options_and_ignores_the_environment(monkeypatch):
    monkeypatch.setenv("KVBRIDGE_MODEL", "from-env")
    base = Config(model="given", worker_id="w0")
    assert Config.resolve(base) is base
    cfg = Config.resolve(base, worker_id="w1")
    assert (cfg.model, cfg.worker_id) == ("given", "w1") and base.worker_id == "w0"


def test_resolve_checks_options_like_a_new_config():
    with pytest.raises(ConfigError, match="unknown kvbridge option 'modle'"):
        Config.resolve(Config(), modle="x")
    with pytest.raises(ConfigError, match="unknown kvbridge option 'modle'"):
        Config.resolve(None, modle="x")
    with pytest.raises(ConfigError, match="max_batch_events"):
        Config.resolve(Config(), max_batch_events=0)


def test_publisher_subscriber_and_relay_take_config_and_options_alike(monkeypatch):
    from kvbridge.engine.relay import Relay

    monkeypatch.setenv("KVBRIDGE_MODEL", "from-env")
    base = Config(model="given", worker_id="w0")
    pub = kvbridge.KvEventPublisher(base, worker_id="w1")
    sub = kvbridge.KvEventSubscriber(base, worker_id="w2")
    relay = Relay(base, endpoint="tcp://127.0.0.1:1", worker_id="w3")
    assert [(c.model, c.worker_id) for c in (pub.config, sub.config, relay.config)] == [
        ("given", "w1"), ("given", "w2"), ("given", "w3")
    ]
    assert kvbridge.KvEventPublisher(worker_id="w4").config.model == "from-env"
