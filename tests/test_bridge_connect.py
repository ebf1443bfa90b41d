"""Configuration, authentication, TLS, the wire format as `nats sub` sees it, and the replay /
snapshot protocol spoken directly -- none of these need a block pool."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import time
import urllib.request

import pytest

from bridge_support import nats_connect, wait_until
from kvbridge import (
    AuthenticationError,
    BlockStored,
    Config,
    ConfigError,
    ConnectError,
    KvEventPublisher,
    KvEventSubscriber,
    decode_batch,
)
from kvbridge.tools.server import NatsServer

pytestmark = pytest.mark.timeout(60)


def stored(h: int, parent=None) -> BlockStored:
    return BlockStored([h], parent, [h] * 4, 4, None, "GPU", None)


# -- config ---------------------------------------------------------------------------------------


def test_config_from_env_and_keywords():
    env = {
        "KVBRIDGE_SERVERS": "nats://a:4222, nats://b:4222",
        "KVBRIDGE_MODEL": "meta-llama/Llama 3.1",
        "KVBRIDGE_WORKER_ID": "node.1",
        "KVBRIDGE_DP_RANK": "2",
        "KVBRIDGE_ENCODING": "json",
        "KVBRIDGE_LINGER_MS": "0.5",
        "KVBRIDGE_JETSTREAM": "true",
        "KVBRIDGE_RING_BUFFER_BYTES": "1048576",
    }
    c = Config.from_env(env, worker_id="override")
    assert c.servers == ["nats://a:4222", "nats://b:4222"]
    assert c.model == "meta-llama/Llama_3_1"  # one subject token
    assert c.worker_id == "override" and c.dp_rank == 2 and c.encoding == "json"
    assert c.linger_ms == 0.5 and c.jetstream is True and c.ring_buffer_bytes == 1 << 20


@pytest.mark.parametrize(
    "kwargs, env, words",
    [
        ({"encoding": "xml"}, {}, "KVBRIDGE_ENCODING"),
        ({"servers": "http://x:1"}, {}, "not a NATS URL"),
        ({"user": "u"}, {}, "user and password"),
        ({"tls_ca": "/nonexistent/ca.pem"}, {}, "file not found"),
        ({}, {"KVBRIDGE_MAX_BATCH_EVENTS": "many"}, "KVBRIDGE_MAX_BATCH_EVENTS"),
        ({"max_batch_events": 0}, {}, "max_batch_events"),
        ({"bogus": 1}, {}, "unknown kvbridge option"),
        ({"worker_id": ""}, {}, r"worker_id \(KVBRIDGE_WORKER_ID\): must be non-empty"),
        ({"model": None}, {}, r"model \(KVBRIDGE_MODEL\): must be a str"),
        ({"jetstream": "no"}, {}, "jetstream .*True or False"),
        ({"metrics_port": "9100"}, {}, "metrics_port .*TCP port"),
        ({"heartbeat_s": float("nan")}, {}, "heartbeat_s .*finite number"),
        ({"worker_timeout_s": float("inf")}, {}, "worker_timeout_s .*finite number"),
        ({"request_timeout_s": float("nan")}, {}, "request_timeout_s .*> 0"),
        ({"subject_prefix": "kv..x"}, {}, "subject_prefix"),
        ({"metrics_addr": ""}, {}, "metrics_addr"),
        ({"stream_max_age_s": float("inf")}, {}, r"stream_max_age_s .*finite number > 0"),
        ({}, {"KVBRIDGE_CONNECT_TIMEOUT_S": "inf"}, r"connect_timeout_s \(KVBRIDGE_CONNECT_TIMEOUT_S\).*finite"),
        ({"inbox_prefix": "_INBOX.a\nb"}, {}, "inbox_prefix"),
        ({"inbox_prefix": 5}, {}, "inbox_prefix"),
        ({"jetstream": True, "stream_name": 5}, {}, "stream_name"),
        ({"max_reconnect_attempts": True}, {}, "max_reconnect_attempts .*got True"),
        ({"dp_rank": True}, {}, "dp_rank .*got True"),
        ({"servers": [1]}, {}, "servers .*list of str"),
        ({"servers": 5}, {}, "servers .*list of str"),
        ({"encoding": ["json"]}, {}, "encoding .*must be one of"),
        ({"user": 1, "password": 2}, {}, "user .*must be a str, got int"),
        ({"token": 5}, {}, "token .*must be a str"),
    ],
)
def test_config_errors_are_clear(kwargs, env, words):
    with pytest.raises(ConfigError, match=words):
        Config.from_env(env, **kwargs)


async def test_a_closed_publisher_is_not_started_again(nats_server):
    pub = await KvEventPublisher(servers=[nats_server.url], model="m", worker_id="once").start()
    await pub.close()
    with pytest.raises(RuntimeError, match="closed KvEventPublisher cannot be started again"):
        await pub.start()


def test_step_before_attach_says_what_is_missing():
    pub = KvEventPublisher(model="m", worker_id="unattached")
    with pytest.raises(RuntimeError, match=r"attach\(manager\) first"):
        pub.step()


# The "fast" in these tests is a bound on how long a failure takes to be reported (a refused
# connection, a rejected credential: no retry loop, no connect timeout to sit out), generous enough
# for a loaded machine: not a speed measurement.
FAIL_FAST_S = 5.0


async def test_connect_to_nothing_fails_fast():
    t0 = time.monotonic()
    with pytest.raises(ConnectError, match="cannot connect to NATS at nats://127.0.0.1:1"):
        await KvEventPublisher(Config(servers="nats://127.0.0.1:1")).start()
    took = time.monotonic() - t0
    print(f"failed after {took:.2f}s")
    assert took < FAIL_FAST_S


# -- auth and TLS -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["userpass", "token"])
async def test_auth_right_credentials_connect_wrong_fail_fast(mode):
    server_auth = {"user": "alice", "password": "s3cret"} if mode == "userpass" else {"token": "t0ken"}
    wrong = {"user": "alice", "password": "nope"} if mode == "userpass" else {"token": "nope"}
    with NatsServer(**server_auth) as server:
        pub = await KvEventPublisher(Config(servers=server.url, worker_id="a", **server_auth)).start()
        sub = await KvEventSubscriber(Config(servers=server.url, **server_auth)).start()
        await pub.close()
        await sub.close()
        for creds in (wrong, {}):
            t0 = time.monotonic()
            with pytest.raises(AuthenticationError, match="authentication failed"):
                await KvEventPublisher(Config(servers=server.url, **creds)).start()
            took = time.monotonic() - t0
            print(f"{mode} {creds or 'no credentials'}: rejected in {took:.3f}s")
            assert took < FAIL_FAST_S


def _make_ca_and_server_cert(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def write_key(key, name):
        path = tmp_path / name
        path.write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        return str(path)

    def write_cert(cert, name):
        path = tmp_path / name
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(path)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvbridge test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return write_cert(ca, "ca.pem"), write_cert(cert, "server.pem"), write_key(key, "server-key.pem")


async def test_tls_with_test_ca(tmp_path):
    ca, cert, key = _make_ca_and_server_cert(tmp_path)
    with NatsServer(tls_cert=cert, tls_key=key) as server:
        assert server.url.startswith("tls://")
        got = []
        sub = await KvEventSubscriber(Config(servers=server.url, tls_ca=ca), on_update=got.append).start()
        pub = await KvEventPublisher(Config(servers=server.url, tls_ca=ca, worker_id="tls")).start()
        assert pub._nc._out_fd == -1  # a TLS transport's socket is never written to directly
        pub.publish([stored(1)])
        await asyncio.wait_for(_until(lambda: any(u.batch.events for u in got)), 10)
        await pub.close()
        await sub.close()
        # Without the CA the server's certificate is not trusted: a clear, fast failure.
        t0 = time.monotonic()
        with pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            await KvEventPublisher(Config(servers=server.url, worker_id="x")).start()
        # Reported at the first failed handshake, not at the connect deadline (connect_timeout_s 2 s,
        # twice per server, + 1 s = 5 s) that nats-py's retries would run to.
        assert time.monotonic() - t0 < 4.0


async def _until(cond):
    while not cond():
        await asyncio.sleep(0.02)


# -- the wire, as `nats sub 'kv.events.>'` shows it ------------------------------------------------


async def test_json_mode_is_readable_by_a_plain_subscriber(nats_server):
    nc = await nats_connect(nats_server.url)
    seen: list = []

    async def on_msg(m):
        seen.append(m)

    sub = await nc.subscribe("kvjson.events.>", cb=on_msg)
    await nc.flush()
    pub = await KvEventPublisher(
        Config(servers=nats_server.url, subject_prefix="kvjson", model="my.model", worker_id="w 1", encoding="json")
    ).start()
    pub.publish([stored(11), stored(12, 11)])
    await asyncio.wait_for(_until(lambda: len(seen) >= 2), 10)
    # seq 0 is the heartbeat every publisher sends as it starts (it announces the epoch).
    hb, m = seen[0], seen[1]
    assert hb.headers["Kv-Seq"] == "0" and json.loads(hb.data)[1] == []
    assert m.subject == "kvjson.events.my_model.w_1"
    assert m.headers["Kv-Seq"] == "1" and m.headers["Kv-Epoch"] == pub.epoch
    assert m.headers["Nats-Msg-Id"] == f"w_1:{pub.epoch}:1"
    assert m.headers["Content-Type"] == "application/json"
    assert m.headers["Kv-Heartbeat"] == "1"  # the default heartbeat_s, advertised on every message
    body = json.loads(m.data)  # [ts, [events...], dp_rank], as vLLM's structure
    assert body[1][0]["type"] == "BlockStored" and body[1][1]["parent_block_hash"] == 11
    print("nats sub would print:", m.data.decode())
    await pub.close()
    await sub.unsubscribe()
    await nc.close()


# -- replay / snapshot protocol ---------------------------------------------------------------------


class _Pool:
    """Just enough of a pool for the protocol: a fixed cached set and no new events."""

    def __init__(self, blocks):
        self.blocks = blocks

    def take_events(self):
        return []

    def snapshot(self):
        return [stored(h) for h in self.blocks]


async def _collect(nc, subject, payload, until):
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, payload, reply=inbox)
    out = []
    while True:
        m = await sub.next_msg(timeout=5)
        out.append(m)
        if (m.headers or {}).get("Kv-Reply") in until:
            await sub.unsubscribe()
            return out


async def test_replay_and_snapshot_protocol(nats_server):
    # A 4 KiB ring holds only the last few messages, so old seqs are "gone". No heartbeat: one
    # would add a seq between reading last_seq and the answers that are checked against it.
    pub = await KvEventPublisher(
        Config(servers=nats_server.url, subject_prefix="proto", worker_id="p", ring_buffer_bytes=4096, linger_ms=0,
               heartbeat_s=0)  # fmt: skip
    ).start()
    pub.attach(_Pool([7, 8, 9]))
    for i in range(100):
        pub.publish([stored(i)])
        await asyncio.sleep(0.001)
    await wait_until(lambda: pub.stats["events"] == 100 and pub.stats["unsent"] == 0, 10, "all 100 events sent")
    nc = await nats_connect(nats_server.url)
    last = pub.stats["last_seq"]
    oldest = pub.stats["oldest_seq"]
    assert 0 < oldest < last

    ok = await _collect(nc, pub.subjects.replay, json.dumps({"from": last - 2}).encode(), ("end", "gone"))
    assert [m.headers["Kv-Seq"] for m in ok] == [str(last - 2), str(last - 1), str(last), str(last)]
    assert ok[-1].headers["Kv-Reply"] == "end"
    assert decode_batch(ok[0].data).events  # replayed exactly as published

    bounded = await _collect(nc, pub.subjects.replay, json.dumps({"from": oldest, "to": oldest + 1}).encode(), ("end", "gone"))
    assert [int(m.headers["Kv-Seq"]) for m in bounded[:-1]] == [oldest, oldest + 1]

    gone = await _collect(nc, pub.subjects.replay, json.dumps({"from": 0}).encode(), ("end", "gone"))
    assert len(gone) == 1 and gone[0].headers["Kv-Reply"] == "gone"
    assert gone[0].headers["Kv-Oldest"] == str(oldest)
    print("gone answer:", gone[0].data.decode())

    snap = await _collect(nc, pub.subjects.snapshot, b"{}", ("snapshot-end", "unavailable"))
    end = snap[-1].headers
    assert end["Kv-Reply"] == "snapshot-end" and end["Kv-Seq"] == str(pub.stats["last_seq"])
    assert int(end["Kv-Count"]) == len(snap) - 1
    assert {h for m in snap[:-1] for ev in decode_batch(m.data).events for h in ev.block_hashes} == {7, 8, 9}
    await nc.close()
    await pub.close()


async def test_metrics_exporter_serves_counters(nats_server):
    pub = await KvEventPublisher(
        Config(servers=nats_server.url, subject_prefix="metrics", worker_id="m", metrics_port=0)
    ).start()
    from kvbridge import metrics

    try:  # the exporter's thread and socket outlive a failed test otherwise
        port = metrics.start_exporter(0)
        pub.publish([stored(1), stored(2, 1), stored(3, 2)])
        await wait_until(lambda: pub.stats["events"] == 3 and pub.stats["unsent"] == 0, 10, "the 3 events sent")
        url = f"http://127.0.0.1:{port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        text = body.decode()
        # Values only a working publish path produces: the three events went out, nothing is queued.
        assert 'kvbridge_published_events_total{model="default",worker="m"} 3.0' in text.splitlines()
        assert 'kvbridge_queue_depth{model="default",worker="m"} 0.0' in text.splitlines()
        assert 'kvbridge_published_messages_total{model="default",worker="m"}' in text
    finally:
        await pub.close()
        metrics.stop_exporters()
