"""kvbridge's nats-py client (``kvbridge.bus.natsclient``) cuts message frames and parses header
blocks natively; it must hand on exactly what nats-py's own ``Parser.parse`` and
``Client._process_headers`` do, for any input."""

import asyncio
import logging
import re
import socket
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NatsClient
from nats.protocol.parser import Parser as NatsParser

from bridge_support import wait_until
from kvbridge import BlockStored, Config, KvEventPublisher, KvEventSubscriber, _native, decode_batch
from kvbridge.bus import natsclient
from kvbridge.bus.natsclient import Client, Parser
from kvbridge.tools.server import NatsServer

# Bytes that decide how a header line is read: separators, whitespace Python's bytes.strip() and
# str.isspace() disagree on (\x1c-\x1f), CR and LF alone, non-ASCII, and ordinary name characters.
_PIECES = [b"\r\n", b"\r", b"\n", b":", b": ", b" ", b"\t", b"\x0b", b"\x1c", b"\x1f", b"\x00", b"a", b"Kv-Seq",
           b"-", b"_", b"7", b"\xc3\xa9", b"\xff", b"NATS/1.0", b" 503", b"Status"]  # fmt: skip


def _parsed(client_class, block: bytes):
    """What ``client_class``'s header step makes of ``block``: the dict, or the exception type it
    raises, and the errors it reports to error_cb."""

    async def run():
        nc = client_class()
        errors = []

        async def on_error(exc):
            errors.append(type(exc))

        nc._error_cb = on_error
        try:
            return await nc._process_headers(block), errors
        except Exception as exc:  # nats-py raises on some malformed blocks: so must we
            return type(exc), errors

    return asyncio.run(run())


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=24).map(b"".join), st.booleans())
@example(b"\r\nKv-Seq: 5\r\nKv-Epoch: ab\r\n\r\n", True)
@example(b" 503\r\n\r\n", True)
@example(b"\r\n", True)
@example(b"", True)
@example(b"", False)
def test_header_blocks_parse_as_nats_py_parses_them(body, versioned):
    block = (b"NATS/1.0" if versioned else b"") + body
    assert _parsed(Client, block) == _parsed(NatsClient, block)


def test_kvbridge_headers_take_the_native_path():
    block = (b"NATS/1.0\r\nKv-Seq: 12\r\nKv-Epoch: 0a1b\r\nNats-Msg-Id: w:0a1b:12\r\n"
             b"Content-Type: application/msgpack\r\nKv-Heartbeat: 1\r\n\r\n")  # fmt: skip
    want = {"Kv-Seq": "12", "Kv-Epoch": "0a1b", "Nats-Msg-Id": "w:0a1b:12", "Content-Type": "application/msgpack",
            "Kv-Heartbeat": "1"}  # fmt: skip
    assert _native.parse_nats_headers(block) == want
    assert _parsed(Client, block) == _parsed(NatsClient, block) == (want, [])
    # Not the common form: left to nats-py.
    assert _native.parse_nats_headers(b"NATS/1.0 503\r\n\r\n") is None
    assert _native.parse_nats_headers("NATS/1.0\r\nK: é\r\n\r\n".encode()) is None


async def test_headers_arrive_through_a_real_server():
    with NatsServer() as server:
        nc = Client()
        await nc.connect(server.url)
        try:
            sub = await nc.subscribe("t.hdr")
            await nc.publish("t.hdr", b"x", headers={"Kv-Seq": "3", "Name": "café"})
            msg = await sub.next_msg(timeout=10)
            assert msg.headers == {"Kv-Seq": "3", "Name": "café"}
        finally:
            await nc.close()


@pytest.mark.parametrize("encoding, heartbeat_s, beat", [("msgpack", 1.0, "1"), ("json", 0.25, "0.25")])
def test_the_publishers_header_block_is_the_one_nats_py_builds(encoding, heartbeat_s, beat):
    pub = KvEventPublisher(Config(model="m", worker_id="w-1", encoding=encoding, heartbeat_s=heartbeat_s))
    for seq in (0, 9, 10, 123_456_789_012):
        headers = {"Kv-Seq": str(seq), "Kv-Epoch": pub.epoch, "Nats-Msg-Id": f"w-1:{pub.epoch}:{seq}",
                   "Content-Type": f"application/{encoding}", "Kv-Heartbeat": beat}  # fmt: skip
        # nats-py's _send_publish: the version line, "key: value" lines in dict order, a blank line.
        want = b"NATS/1.0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\n"
        assert pub._header_block(seq) == want
        assert _native.parse_nats_headers(want) == headers


async def test_a_replayed_message_carries_the_headers_it_went_live_with(nats_server):
    cfg = Config(servers=nats_server.url, subject_prefix="rph", model="m", worker_id="w")
    nc = NatsClient()
    await nc.connect(nats_server.url)
    pub = await KvEventPublisher(cfg).start()
    try:
        live = await nc.subscribe(pub.subjects.events)
        await nc.flush()
        pub.publish([BlockStored([1], None, [1, 2], 2, None, "GPU", None)])
        first = await live.next_msg(timeout=10)
        while not decode_batch(first.data).events:  # past the heartbeats
            first = await live.next_msg(timeout=10)
        inbox = nc.new_inbox()
        replies = await nc.subscribe(inbox)
        seq = first.headers["Kv-Seq"]
        await nc.publish(pub.subjects.replay, f'{{"from": {seq}, "to": {seq}}}'.encode(), reply=inbox)
        replayed = await replies.next_msg(timeout=10)
        assert (replayed.headers, replayed.data) == (first.headers, first.data)
        assert (await replies.next_msg(timeout=10)).headers["Kv-Reply"] == "end"
    finally:
        await pub.close()
        await nc.close()


async def test_publish_headed_writes_at_once_only_with_nothing_queued_ahead():
    block = b"NATS/1.0\r\nKv-Seq: 1\r\nKv-Epoch: ab\r\n\r\n"
    with NatsServer() as server:
        nc = Client()
        await nc.connect(server.url)
        try:
            sub = await nc.subscribe("t.h")
            await nc.flush()
            assert nc.publish_now("t.h", b"a", block)  # an idle connection: written in this pass
            assert not nc._pending
            await nc.publish("t.h", b"b")  # on nats-py's list until its flusher task runs
            assert nc._pending  # the premise
            assert not nc.publish_now("t.h", b"c", block)  # would overtake b: nothing done
            await nc.publish_headed("t.h", b"c", block)  # behind b, on nats-py's path
            await nc.publish_headed("t.h", b"d", block, reply="r.x")
            got = [await sub.next_msg(timeout=10) for _ in range(4)]
            assert [m.data for m in got] == [b"a", b"b", b"c", b"d"]
            headed = {"Kv-Seq": "1", "Kv-Epoch": "ab"}
            assert [m.headers for m in got] == [headed, None, headed, headed]
            assert [m.reply for m in got] == ["", "", "", "r.x"]
            assert nc.stats["out_msgs"] == 4 and nc.stats["out_bytes"] == 4
        finally:
            await nc.close()
        assert not nc.publish_now("t.h", b"e", block)  # closed: nothing done, and publish_headed says why
        with pytest.raises(natsclient._errors.ConnectionClosedError):
            await nc.publish_headed("t.h", b"e", block)


def _traced_ops(server: NatsServer, port: int) -> list[str]:
    """The protocol operations a traced nats-server (-V) read from the client on ``port``."""
    mark = f"127.0.0.1:{port} - cid:"
    text = Path(server.log_file).read_text()
    return [line.split("<<- [", 1)[1].split()[0].rstrip("]") for line in text.splitlines() if mark in line and "<<- [" in line]


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "nats-py-own-client"])
async def test_a_flush_returns_only_after_the_server_read_what_was_sent_before_it(fast, monkeypatch):
    # nats-py 2.16's flush writes its PING straight to the socket while a SUB just made waits for
    # the flusher task: the PONG came back before the server had the subscription (a router
    # replica started with RouteSync missed the first decision published after its start()).
    if not fast:
        monkeypatch.setattr(natsclient, "_MISSING", ("Client._renamed_in_a_later_release()",))
        monkeypatch.setattr(natsclient, "_warned", True)
    with NatsServer(extra_args=["-V"]) as server:
        nc = Client()
        assert (type(nc) is natsclient._FastClient) is fast
        await nc.connect(server.url)
        try:
            port = nc._transport._io_writer.transport.get_extra_info("sockname")[1]
            await wait_until(lambda: _traced_ops(server, port)[-1:] == ["PING"], 10.0, "the handshake's PING traced")
            before = len(_traced_ops(server, port))
            await nc.subscribe("t.order")
            await nc.publish("t.order", b"x")
            await nc.flush()
            # the server answered the last PING traced; the SUB and the PUB came before it
            ops = _traced_ops(server, port)[before:]
            assert "SUB" in ops and "PUB" in ops and ops[-1] == "PING", ops
            assert ops.index("SUB") < ops.index("PUB"), ops
        finally:
            await nc.close()


async def test_publish_many_now_writes_all_in_order_and_leaves_what_the_socket_refuses_queued():
    block = b"NATS/1.0\r\nKv-Seq: 1\r\n\r\n"
    payloads = [bytes([i]) * (200_000 + i) for i in range(8)]  # far more than the send buffer below
    with NatsServer() as server:
        nc = Client()
        await nc.connect(server.url)
        try:
            got: list[bytes] = []
            done = asyncio.Event()

            def on_msg(subject: str, headers: dict[str, str] | None, data: bytes) -> None:
                got.append(data)
                if len(got) == len(payloads) + 1:
                    done.set()

            await nc.subscribe_direct("t.m", on_msg)
            await nc.flush()
            assert nc._out_fd >= 0  # the premise: a plain TCP connection, written by writev
            nc._socket_out.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            assert nc.publish_many_now("t.m", [(p, block) for p in payloads[:-1]])
            assert nc._socket_out.get_write_buffer_size()  # the premise: the socket took only part of it
            assert not nc.publish_now("t.m", payloads[-1], block)  # would overtake the rest: nothing done
            assert not nc.publish_many_now("t.m", [(payloads[-1], block)])
            await nc.publish_headed("t.m", payloads[-1], block)  # behind them, on nats-py's path
            await nc.publish("t.m", b"end")
            await asyncio.wait_for(done.wait(), 30)
            assert got[: len(payloads)] == payloads and got[-1] == b"end"
            assert nc.stats["out_msgs"] == len(payloads) + 1
        finally:
            await nc.close()
        assert not nc.publish_many_now("t.m", [(b"x", block)])  # closed: nothing done


async def test_a_direct_subscription_gets_what_a_plain_one_gets():
    with NatsServer() as server:
        nc = Client()
        await nc.connect(server.url)
        try:
            got = []
            direct = await nc.subscribe_direct("t.d.*", lambda *m: got.append(m))
            plain = await nc.subscribe("t.d.*")
            sent = [("t.d.a", b"x", {"Kv-Seq": "3", "Kv-Epoch": "ab"}),  # the native header form
                    ("t.d.b", b"", {"Name": "caf\u00e9"}),  # non-ASCII: nats-py's header parser
                    ("t.d.c", b"y" * 70_000, None)]  # fmt: skip
            for subject, data, headers in sent:
                await nc.publish(subject, data, headers=headers)
            want = []
            for _ in sent:
                m = await plain.next_msg(timeout=10)
                want.append((m.subject, m.headers, m.data))
            assert got == want == [(subject, headers, data) for subject, data, headers in sent]
            assert nc.stats["in_msgs"] == 2 * len(sent)
            await direct.unsubscribe()
            await nc.publish("t.d.a", b"late")
            assert (await plain.next_msg(timeout=10)).data == b"late"
            assert len(got) == len(sent) and nc._direct == {}
        finally:
            await nc.close()


# -- message frames ------------------------------------------------------------------------------


class _Recorder:
    """The client side of a parser: records every call, in order."""

    _direct: dict = {}  # no direct subscriptions (Client.subscribe_direct)

    def __init__(self):
        self.calls = []

    async def _process_msg(self, sid, subject, reply, payload, headers):
        self.calls.append(("msg", sid, subject, reply, payload, headers))

    async def _process_ping(self):
        self.calls.append(("ping",))

    async def _process_pong(self):
        self.calls.append(("pong",))

    async def _process_info(self, info):
        self.calls.append(("info", info))

    async def _process_err(self, err):
        self.calls.append(("err", err))


def _fed(parser_class, chunks: list[bytes]):
    """Every call ``parser_class`` makes for a stream read in ``chunks``, and the exception type it
    stops with (None). (How a frame still arriving is held between reads is each parser's own.)"""

    async def run():
        nc = _Recorder()
        ps = parser_class(nc)
        try:
            for chunk in chunks:
                await ps.parse(chunk)
            error = None
        except Exception as exc:
            error = type(exc)
        return nc.calls, error

    return asyncio.run(run())


_HDR = b"NATS/1.0\r\nKv-Seq: 7\r\n\r\n"
_OPS = st.one_of(
    st.builds(lambda subj, sid, reply, data: b"MSG %s %d %s%d\r\n%s\r\n" % (subj, sid, reply, len(data), data),
              st.sampled_from([b"kv.events.m.w1", b"a", b"\xc3\xa9.x"]), st.integers(0, 10**6),
              st.sampled_from([b"", b"_INBOX.abc ", b"123 "]), st.binary(max_size=40)),
    st.builds(lambda sid, reply, hdr, data: b"HMSG s.t %d %s%d %d\r\n%s%s\r\n" % (sid, reply, len(hdr),
                                                                                   len(hdr) + len(data), hdr, data),
              st.integers(0, 99), st.sampled_from([b"", b"r.1 "]), st.sampled_from([_HDR, b"NATS/1.0 503\r\n\r\n"]),
              st.binary(max_size=40)),
    st.sampled_from([b"PING\r\n", b"PONG\r\n", b"+OK\r\n", b'INFO {"max_payload": 5}\r\n', b"-ERR 'x'\r\n",
                     b"MSG  a 1 2\r\nhi\r\n", b"MSG a\t1 2\r\nhi\r\n", b"MSG a 1 2 \r\nhi\r\n", b"MSG a x 2\r\nhi\r\n",
                     b"HMSG a 1 5 2\r\nhi\r\n", b"MSG a 1 2\r\nhiXY", b"BOGUS\r\n",
                     # Header blocks no server writes (nats-py's pattern reads the first across lines):
                     b"HMSG s.t 0 0 1\r\n0\r\n", b"HMSG s 1 3 5\r\nab\r\nhi\r\n", b"HMSG s 1 12 12\r\nnats/1.0\r\n\r\n\r\n"]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_OPS, max_size=12).map(b"".join), st.lists(st.integers(1, 80), max_size=12))
@example(b"MSG a 1 5\r\nhello\r\nPING\r\nHMSG b 2 r 12 14\r\nNATS/1.0\r\n\r\nhi\r\n", [3, 30, 1])
@example(b"HMSG s.t 0 0 1\r\n0\r\nMSG a 1 1\r\nx\r\n", [])
def test_frames_reach_the_client_as_nats_py_cuts_them(stream, cuts):
    chunks, at = [], 0
    for n in cuts:
        chunks.append(stream[at : at + n])
        at += n
    chunks.append(stream[at:])
    assert _fed(Parser, chunks) == _fed(NatsParser, chunks)


def test_many_frames_in_one_read_take_the_native_cut():
    frames = [b"HMSG kv.events.m.w%d %d %d %d\r\n%s%s\r\n" % (i, i, len(_HDR), len(_HDR) + 3, _HDR, b"abc") for i in range(50)]
    buf = bytearray(b"".join(frames) + b"PING\r\nMSG a 1 2\r\nh")
    got, used, partial = _native.scan_nats_msgs(buf)
    assert used == sum(map(len, frames)) and not partial  # PING next: nats-py's
    assert got == [(i, b"kv.events.m.w%d" % i, b"", b"abc", _HDR) for i in range(50)]
    assert _native.scan_nats_msgs(buf, max_frames=2)[1:] == (sum(map(len, frames[:2])), False)
    assert _native.scan_nats_msgs(bytearray(b"PING\r\n")) == ([], 0, False)
    assert _native.scan_nats_msgs(bytearray(frames[0] + b"MSG a 1 2\r\nh")) == (got[:1], len(frames[0]), True)
    assert isinstance(Client()._ps, Parser)


# -- nats-py's private members, and the versions the pin allows ------------------------------------

ROOT = Path(__file__).resolve().parent.parent
_FALLBACK_LOG = "lacks what kvbridge's fast receive path uses"


def test_the_installed_nats_py_has_every_member_the_fast_path_needs():
    # Inside the pinned range the fast path is taken: a nats-py that lost a member fails here
    # rather than running on the fallback unnoticed.
    assert natsclient.missing_internals() == ()
    assert type(Client()) is natsclient._FastClient


async def _round_trip(url: str, prefix: str, n: int) -> tuple[list[tuple[int, bool]], list[int], KvEventSubscriber]:
    """A subscriber without on_update (the direct path) iterated while a publisher sends ``n``
    one-block batches; the (seq, reset) of every update up to the last, and the hashes stored."""
    cfg = Config(servers=url, subject_prefix=prefix, model="m", worker_id="sub", heartbeat_s=0)
    sub = await KvEventSubscriber(cfg, queue_size=4 * n).start()
    it = sub.__aiter__()
    pub = await KvEventPublisher(cfg.replace(worker_id="w")).start()
    for i in range(n):
        pub.publish([BlockStored([i + 1], i or None, [i] * 4, 4, None, "GPU", None)])
        await asyncio.sleep(0.001)  # the loop sends each on its own: many messages to keep in order
    await wait_until(lambda: pub.stats["events"] == n, 20, f"the {n} events sent")
    seqs, hashes = [], []
    while not seqs or seqs[-1][0] < pub.stats["last_seq"]:
        u = await asyncio.wait_for(it.__anext__(), 20)
        seqs.append((u.seq, u.reset))
        hashes += [h for ev in u.batch.events for h in ev.block_hashes]
    await pub.close()
    await sub.close()
    return seqs, hashes, sub


async def test_without_a_private_member_nats_py_s_own_client_delivers_in_order(monkeypatch, caplog, nats_server):
    # A nats-py that renamed something the fast path needs, as seen at import.
    monkeypatch.setitem(natsclient._NEEDS_METHODS, "_renamed_in_a_later_release", ())
    monkeypatch.setattr(natsclient, "_MISSING", natsclient.missing_internals())
    monkeypatch.setattr(natsclient, "_warned", False)
    assert natsclient._MISSING == ("Client._renamed_in_a_later_release()",)
    caplog.set_level(logging.WARNING, logger="kvbridge")
    nc = Client()
    assert type(nc) is Client and not hasattr(nc, "_direct")  # nats-py's own parser and delivery
    assert type(nc._ps) is NatsParser
    await nc.connect(nats_server.url)
    assert await nc.link_alive(10, "a probe") is True  # its PONG came back
    await nc.close()
    assert await nc.link_alive(10, "a probe") is False
    seqs, hashes, sub = await _round_trip(nats_server.url, "fallback", 300)
    assert type(sub._nc) is Client
    assert len(seqs) > 100, seqs  # the premise: many messages
    assert seqs[0][1] and all(not reset for _, reset in seqs[1:])  # first contact, then live only
    assert [s for s, _ in seqs] == list(range(seqs[0][0], seqs[0][0] + len(seqs)))
    assert hashes == list(range(1, 301))  # every block, live, in the order published
    warnings = [r.getMessage() for r in caplog.records if _FALLBACK_LOG in r.getMessage()]
    assert len(warnings) == 1 and "_renamed_in_a_later_release" in warnings[0], warnings  # three clients, one line


_OLDEST_SCRIPT = """
import asyncio, importlib.metadata, sys
sys.path.insert(0, sys.argv[3])  # the tests' helpers
from kvbridge.bus import natsclient
import test_natsclient

assert importlib.metadata.version("nats-py") == sys.argv[2], importlib.metadata.version("nats-py")
assert natsclient.missing_internals() == (), natsclient.missing_internals()
seqs, hashes, sub = asyncio.run(test_natsclient._round_trip(sys.argv[1], "oldest", 300))
assert type(sub._nc) is natsclient._FastClient
assert len(seqs) > 100, seqs
assert seqs[0][1] and all(not reset for _, reset in seqs[1:])
assert [s for s, _ in seqs] == list(range(seqs[0][0], seqs[0][0] + len(seqs)))
assert hashes == list(range(1, 301))  # every block, live, in the order published
print("round trip in order on nats-py", sys.argv[2], "with", len(seqs), "updates")
"""


def _oldest_pinned() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in deps if d.startswith("nats-py"))
    match = re.fullmatch(r"nats-py>=(\d+\.\d+\.\d+),<\S+", pin)
    assert match, f"the nats-py pin {pin!r} is not of the form nats-py>=X.Y.Z,<...: update this test"
    return match.group(1)


@pytest.fixture(scope="session")
def oldest_nats_py(tmp_path_factory) -> tuple[str, str]:
    """A venv holding the oldest nats-py the pin allows, and this checkout's kvbridge (its built
    extension) and other dependencies behind it on sys.path: (its python, the version). The wheel
    is kept in target/test-wheels, so runs after the first need no registry."""
    version = _oldest_pinned()
    wheels = ROOT / "target" / "test-wheels"
    if not list(wheels.glob(f"nats_py-{version}-*.whl")):
        got = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", f"nats-py=={version}", "-w",
                              str(wheels)], capture_output=True, text=True, timeout=300)  # fmt: skip
        if got.returncode != 0:
            pytest.fail(f"cannot fetch nats-py {version} (the oldest the pin allows) into {wheels}: is the package "
                        f"registry reachable? pip said:\n{got.stdout}{got.stderr}")  # fmt: skip
    venv = tmp_path_factory.mktemp("oldest-nats-py") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index", "--find-links",
                    str(wheels), f"nats-py=={version}"], check=True, timeout=300)  # fmt: skip
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    # After the venv's own site-packages (its nats-py first): kvbridge as built here, then the
    # test environment's packages for the rest of kvbridge's dependencies.
    kvbridge_home = Path(natsclient.__file__).resolve().parents[2]
    Path(site, "kvbridge-under-test.pth").write_text(f"{kvbridge_home}\n{sysconfig.get_path('purelib')}\n")
    return python, version


def test_the_oldest_pinned_nats_py_delivers_in_order_on_the_fast_path(oldest_nats_py, nats_server):
    python, version = oldest_nats_py
    proc = subprocess.run([python, "-c", _OLDEST_SCRIPT, nats_server.url, version, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"round trip in order on nats-py {version}" in proc.stdout
