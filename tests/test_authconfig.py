"""``kvbridge auth-config`` against a real nats-server: with the generated users a worker cannot
publish on another worker's subject (the server refuses, kvbridge says so at start), a second
process with the same worker id is still caught, a router syncs every worker; with --jetstream the
same on a JetStream server, where a worker cannot delete the stream and the router creates it."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from bridge_support import Engine, nats_connect, views_match, wait_until
from kvbridge import Config, KvEventPublisher, KvEventSubscriber
from kvbridge.tools.authconfig import authorization_block, principals
from kvbridge.bus.connection import PermissionDeniedError, WorkerIdInUseError
from kvbridge.tools.server import NatsServer

pytestmark = pytest.mark.timeout(90)
MODEL = "Mx.1"  # sanitised to Mx_1 in subjects and user permissions alike (and mixed case)
PW = {"w1": "pw-w1", "w2": "pw-w2", "r1": "pw-r1"}


def client(server, prefix: str, user: str, role: str, **kw) -> Config:
    inbox = next(p.inbox for p in principals(MODEL, ["w1", "w2"], ["r1"], prefix=prefix) if p.name == user)
    base = dict(servers=server.url, model=MODEL, subject_prefix=prefix, user=user, password=PW[user],
                inbox_prefix=inbox, heartbeat_s=0.5, request_timeout_s=1.0, reconnect_wait_s=0.2)  # fmt: skip
    if role == "worker":
        base["worker_id"] = user
    base.update(kw)
    return Config(**base)


def conf_file(tmp_path, prefix: str, jetstream: bool) -> str:
    block = authorization_block(MODEL, ["w1", "w2"], ["r1"], prefix=prefix, jetstream=jetstream, stream_name="AUJ",
                                passwords=PW)  # fmt: skip
    path = tmp_path / "auth.conf"
    path.write_text(block)
    return str(path)


async def refused(server, user: str, subject: str) -> bool:
    """Publish on ``subject`` as ``user`` with a raw client: did the server refuse it?"""
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await nats_connect(server.url, user=user, password=PW[user], error_cb=on_error)
    await nc.publish(subject, b"x")
    await nc.flush()
    await nc.flush()
    await nc.close()
    return any("permissions violation" in str(e).lower() and subject.lower() in str(e).lower() for e in errors)


async def scenario(server, prefix: str, **kw) -> None:
    p = prefix
    # The router starts first (with --jetstream it is the one allowed to create the stream).
    router = await KvEventSubscriber(client(server, p, "r1", "router", **kw), model=MODEL).start()
    # w1's credentials do not let it act as w2: refused by the server, named by kvbridge at start.
    with pytest.raises(PermissionDeniedError, match=rf"{p}\.events\.Mx_1\.w2"):
        await KvEventPublisher(client(server, p, "w1", "worker", worker_id="w2", **kw)).start()
    assert await refused(server, "w1", f"{p}.events.Mx_1.w2")
    assert await refused(server, "w1", f"_INBOX.{p}.Mx_1.w.w2.x")  # nor into another worker's inbox
    assert not await refused(server, "w1", f"{p}.events.Mx_1.w1")

    pubs = [await KvEventPublisher(client(server, p, w, "worker", **kw)).start() for w in ("w1", "w2")]
    # The worker-id probe still works under these permissions: a second w1 is caught.
    with pytest.raises(WorkerIdInUseError):
        await KvEventPublisher(client(server, p, "w1", "worker", **kw)).start()
    engines = {(router.config.model, pub.config.worker_id): Engine(pub, 2000, seed=90 + i, step_sleep=0.002)
               for i, pub in enumerate(pubs)}  # fmt: skip
    for e in engines.values():
        e.start()
    for e in engines.values():
        await asyncio.to_thread(e.finish)
    await wait_until(lambda: views_match(router, engines), 30, "the router's views == pools")
    stats = router.stats
    print(f"router: {stats}; workers: {[pub.stats['permission_errors'] for pub in pubs]} permission errors")
    assert stats["permission_errors"] == 0 and all(pub.stats["permission_errors"] == 0 for pub in pubs)
    if not kw.get("jetstream"):
        assert stats["snapshots"] >= 2  # the workers answered the router's requests into its inbox
    # A late router (worker caches full by now) syncs every worker too.
    late = await KvEventSubscriber(client(server, p, "r1", "router", **kw), model=MODEL).start()
    await wait_until(lambda: views_match(late, engines), 30, "a late router's views == pools")
    for c in (late, router, *pubs):
        await c.close()


async def test_generated_users_keep_workers_apart_and_let_routers_sync(tmp_path):
    with NatsServer(config_file=conf_file(tmp_path, "au", jetstream=False)) as server:
        await scenario(server, "au")
        # A router may not publish events, but may share routing decisions with its replicas.
        assert await refused(server, "r1", "au.events.Mx_1.w1")
        assert not await refused(server, "r1", "au.route.Mx_1")
        assert await refused(server, "w1", "au.route.Mx_1")


async def test_generated_users_with_jetstream(tmp_path):
    with NatsServer(jetstream=True, config_file=conf_file(tmp_path, "auj", jetstream=True)) as server:
        await scenario(server, "auj", jetstream=True, stream_name="AUJ")
        # A worker configured with other stream limits may not update the stream: said at start.
        with pytest.raises(PermissionDeniedError, match=r"\$JS\.API\.STREAM\.UPDATE\.AUJ"):
            await KvEventPublisher(client(server, "auj", "w2", "worker", jetstream=True, stream_name="AUJ",
                                          stream_max_age_s=600)).start()  # fmt: skip
        # Workers write to the stream but may not change or delete it.
        for api_call in ("DELETE", "UPDATE", "PURGE", "CREATE"):
            assert await refused(server, "w1", f"$JS.API.STREAM.{api_call}.AUJ")
        nc = await nats_connect(server.url, user="r1", password=PW["r1"], inbox_prefix="_INBOX.auj.Mx_1.r.r1")
        info = await nc.jetstream().stream_info("AUJ")
        assert info.state.messages > 0 and info.config.subjects == ["auj.events.>"]
        await nc.close()


def test_cli_prints_a_block_nats_server_accepts(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kvbridge", "auth-config", "--model", MODEL, "--workers", "w1,w.2", "--routers", "r1",
         "--jetstream", "--prefix", "kvx"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    text = out.stdout
    assert '"kvx.events.Mx_1.w_2"' in text and "KVBRIDGE_INBOX_PREFIX=_INBOX.kvx.Mx_1.w.w_2" in text
    assert "$JS.API.STREAM.DELETE" not in text and "$JS.API.STREAM.UPDATE" not in text
    conf = tmp_path / "gen.conf"
    conf.write_text(text)
    # nats-server's own config check (-t) accepts it.
    from kvbridge.tools.server import find_nats_server

    check = subprocess.run([find_nats_server(), "-c", str(conf), "-t"], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    bad = subprocess.run([sys.executable, "-m", "kvbridge", "auth-config", "--model", "m", "--workers", "a,a"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "workers[1]" in bad.stderr
