"""The delivery holes of "loss-free under every fault", each read off a real nats-server:
heartbeats with default options, bad publish() arguments, events larger than max_payload, an
abandoned or stalled iterator, worker expiry, permission refusals, worker id collisions."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import sys
import time
from pathlib import Path

import msgspec
import pytest

from bridge_support import nats_connect, pool_hashes, wait_until
from kvbridge import (
    Config,
    KvEventPublisher,
    KvEventSubscriber,
    PermissionDeniedError,
    WorkerIdInUseError,
    decode_batch,
)
from kvbridge.wire.events import BlockRemoved, BlockStored, KVEventBatch
from kvbridge.bus.worker import Worker
from kvbridge.engine.pool import KVCacheManager
from kvbridge.tools.server import NatsServer
from kvbridge.wire.subjects import FORMATS, HDR_CONTENT_TYPE, HDR_COUNT, HDR_EPOCH, HDR_HEARTBEAT, HDR_REPLY, HDR_SEQ
from kvbridge.wire.subjects import REPLY_END, REPLY_SNAPSHOT_END, WorkerSubjects

MODEL = "m"


def stored(h: int, parent: int | None = None) -> BlockStored:
    return BlockStored([h], parent, list(range(4)), 4, None, "GPU", None)


class RawCollector:
    """A plain nats-py subscriber, as `nats sub` would see the stream."""

    def __init__(self) -> None:
        self.msgs: list = []

    async def on_msg(self, msg) -> None:
        self.msgs.append(msg)

    def batches(self) -> list[tuple[int, KVEventBatch]]:
        out = []
        for m in self.msgs:
            fmt = FORMATS[m.headers[HDR_CONTENT_TYPE]]
            out.append((int(m.headers[HDR_SEQ]), decode_batch(m.data, fmt)))
        return out

    def heartbeats(self) -> int:
        return sum(1 for _, b in self.batches() if not b.events)


async def raw_subscribe(server: NatsServer, subject: str):
    nc = await nats_connect(server.url)
    col = RawCollector()
    sub = await nc.subscribe(subject, cb=col.on_msg)
    await nc.flush()
    return nc, sub, col


def views_equal(sub: KvEventSubscriber, pub: KvEventPublisher, manager) -> bool:
    view = sub.views.get((pub.config.model, pub.config.worker_id))
    if view is None or view.epoch != pub.epoch or not sub.in_sync():
        return False
    with pub.lock:
        return view.blocks == pool_hashes(manager)


# -- heartbeats -----------------------------------------------------------------------------------


@pytest.mark.parametrize("linger_ms", [0.0, 5.0], ids=["default-linger", "linger-5ms"])
async def test_idle_publisher_heartbeats_from_start_and_after_traffic(nats_server, linger_ms):
    nc, _, col = await raw_subscribe(nats_server, "hb.events.>")
    options = {} if linger_ms == 0 else {"linger_ms": linger_ms}
    pub = await KvEventPublisher(servers=[nats_server.url], subject_prefix="hb", model=MODEL, worker_id="w", **options).start()
    assert pub.config.heartbeat_s == 1.0  # the default: nothing set here
    # From start: idle, yet an empty batch every heartbeat_s.
    await wait_until(lambda: col.heartbeats() >= 3, 15, "3 heartbeats from an idle publisher")
    # Traffic, then idle again: the loop must leave its busy polling and heartbeat again.
    for i in range(200):
        pub.publish([stored(1000 + i)])
        await asyncio.sleep(0.001)
    await wait_until(lambda: sum(len(b.events) for _, b in col.batches()) == 200, 15, "the 200 events")
    after = len(col.msgs)
    await wait_until(lambda: sum(1 for _, b in col.batches()[after:] if not b.events) >= 3, 15,
                     "3 heartbeats after traffic")  # fmt: skip
    seqs = [s for s, _ in col.batches()]
    # Heartbeats are numbered like any message. (Contiguous from the first one seen: a raw
    # subscriber's SUB may reach a loaded server just after the start heartbeat, seq 0.)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    assert all(m.headers["Kv-Heartbeat"] == "1" for m in col.msgs)
    assert pub.stats["heartbeats"] >= 6
    await pub.close()
    await nc.close()


async def test_heartbeat_s_zero_sends_nothing_while_idle(nats_server):
    nc, _, col = await raw_subscribe(nats_server, "hb0.events.>")
    pub = await KvEventPublisher(servers=[nats_server.url], subject_prefix="hb0", model=MODEL, worker_id="w",
                                 heartbeat_s=0).start()  # fmt: skip
    pub.publish([stored(1)])
    await wait_until(lambda: len(col.msgs) == 1, 10, "the one event")
    # The window in which a 1 s heartbeat would have shown is measured by one: a publisher with the
    # default heartbeat_s on the same subscription, started after the event, sends its second.
    control = await KvEventPublisher(servers=[nats_server.url], subject_prefix="hb0", model=MODEL,
                                     worker_id="control").start()  # fmt: skip
    await wait_until(lambda: sum(m.subject.endswith(".control") for m in col.msgs) >= 2, 15,
                     "the control publisher's start heartbeat and the next")  # fmt: skip
    mine = [m for m in col.msgs if m.subject.endswith(".w")]
    assert len(mine) == 1 and mine[0].headers["Kv-Heartbeat"] == "0"
    assert pub.stats["heartbeats"] == 0
    await control.close()
    await pub.close()
    await nc.close()


async def test_no_heartbeat_while_an_engine_steps_faster_than_heartbeat_s(nats_server):
    # An engine thread stepping every 0.1 s: each hand-off reaches a sleeping sender through the
    # eventfd (the one-hand-off path that sends from the wake-up callback itself). The one heartbeat
    # timer must see those emits and stay quiet, and take up heartbeats again once the steps stop.
    nc, _, col = await raw_subscribe(nats_server, "hbb.events.>")
    pub = await KvEventPublisher(servers=[nats_server.url], subject_prefix="hbb", model=MODEL, worker_id="w").start()
    assert pub.config.heartbeat_s == 1.0
    steps = 25

    def engine() -> None:
        for i in range(steps):
            pub.publish([stored(5000 + i)])
            time.sleep(0.1)  # the engine's pace, 10x heartbeat_s's rate: not what is asserted

    await asyncio.to_thread(engine)
    await wait_until(lambda: sum(len(b.events) for _, b in col.batches()) == steps, 15, "every step's event")
    batches = col.batches()
    with_events = [i for i, (_, b) in enumerate(batches) if b.events]
    busy = batches[with_events[0] : with_events[-1] + 1]
    assert all(b.events for _, b in busy), [(s, len(b.events)) for s, b in busy]  # no heartbeat among them
    seqs = [s for s, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    after = len(batches)
    await wait_until(lambda: sum(1 for _, b in col.batches()[after:] if not b.events) >= 2, 15,
                     "heartbeats again once the engine is idle")  # fmt: skip
    await pub.close()
    await nc.close()


# -- bad publish() arguments ----------------------------------------------------------------------


BAD_ARGUMENTS = [
    (42, "got int"),
    (object(), "got object"),
    ("abc", "got str"),
    (b"bytes", "got bytes"),
    ([1, 2, 3], "events[0] is int"),
    ({"type": "BlockStored"}, "got dict"),
    ([None], "events[0] is NoneType"),
    ([stored(1), "x"], "events[1] is str"),
    (KVEventBatch(0.0, [stored(1), 7]), "batch.events[1] is int"),
]


async def test_bad_publish_arguments_raise_and_the_stream_carries_on(nats_server):
    nc, _, col = await raw_subscribe(nats_server, "bad.events.>")
    pub = await KvEventPublisher(servers=[nats_server.url], subject_prefix="bad", model=MODEL, worker_id="w").start()
    for i, (arg, says) in enumerate(BAD_ARGUMENTS):
        with pytest.raises(TypeError, match=re.escape(says)):
            pub.publish(arg)
        pub.publish([stored(100 + i)])  # and the stream carries on
    for arg in (42, [stored(1)], KVEventBatch(0.0, ["x"])):
        with pytest.raises(TypeError, match="publish_batch"):
            pub.publish_batch(arg)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="payload must be bytes"):
        pub.publish_batch(KVEventBatch(0.0, []), payload="text")  # type: ignore[arg-type]
    # A hand-made non-event slipped in after the hand-off: dropped and counted, never numbered.
    events = [stored(999)]
    pub.publish(events)
    events.append(12345)  # no await in between: the loop has not drained the hand-off yet
    want = {100 + i for i in range(len(BAD_ARGUMENTS))} | {999}
    await wait_until(lambda: {ev.block_hashes[0] for _, b in col.batches() for ev in b.events} == want, 15,
                     "every good event")  # fmt: skip
    seqs = [s for s, _ in col.batches()]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # no garbage took a seq
    assert all(isinstance(ev, BlockStored) for _, b in col.batches() for ev in b.events)
    assert pub.stats["invalid_events"] == 1
    await pub.close()
    await nc.close()


# -- events larger than max_payload ---------------------------------------------------------------


def _llama3_prompt(n_tokens: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(65536, 128256) for _ in range(n_tokens)]  # ids >= 65536: 5 msgpack bytes each


async def _replayed_hashes(server: NatsServer, pub: KvEventPublisher, start: int) -> tuple[set, int]:
    """Ask the worker's replay subject directly; the stored hashes it sends back, and the messages."""
    nc = await nats_connect(server.url)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(pub.subjects.replay, json.dumps({"from": start}).encode(), reply=inbox)
    hashes: set = set()
    n = 0
    while True:
        m = await sub.next_msg(timeout=10)
        if m.headers.get(HDR_REPLY) == REPLY_END:
            break
        n += 1
        assert len(m.data) <= nc.max_payload
        for ev in decode_batch(m.data, FORMATS[m.headers[HDR_CONTENT_TYPE]]).events:
            if isinstance(ev, BlockStored):
                hashes.update(ev.block_hashes)
    await nc.close()
    return hashes, n


@pytest.mark.timeout(240)
# One case end to end; JSON and the server's default limit frame alike (tests/test_framer.py).
@pytest.mark.parametrize("encoding, max_payload", [("msgpack", 65536)])
async def test_a_256k_token_prompt_is_delivered_live_by_replay_and_by_snapshot(tmp_path, encoding, max_payload):
    conf = tmp_path / "server.conf"
    conf.write_text(f"max_payload: {max_payload}\n" if max_payload else "")
    with NatsServer(config_file=str(conf)) as server:
        cfg = Config(servers=server.url, model=MODEL, worker_id="big", encoding=encoding)
        live = await KvEventSubscriber(cfg).start()
        pub = await KvEventPublisher(cfg).start()
        manager = KVCacheManager(num_blocks=16384 + 64, block_size=16)
        pub.attach(manager)
        await wait_until(lambda: (MODEL, "big") in live.views and live.in_sync(), 20, "first contact")
        first_seq = pub.stats["last_seq"] + 1
        with pub.lock:
            assert manager.allocate("long", _llama3_prompt(256 * 1024, seed=1)) == 0
        pub.step()
        expected = pool_hashes(manager)
        assert len(expected) == 16384
        await wait_until(lambda: views_equal(live, pub, manager), 60, "live view == pool")
        assert pub.stats["split_events"] >= 1 and pub.stats["oversize_dropped"] == 0
        assert live.stats["gaps"] == 0  # every slice arrived in order: nothing was lost
        replayed, n_msgs = await _replayed_hashes(server, pub, first_seq)
        assert replayed == expected and n_msgs > 1
        late = await KvEventSubscriber(cfg).start()  # knows nothing: rebuilds from a snapshot
        await wait_until(lambda: views_equal(late, pub, manager), 60, "snapshot view == pool")
        assert late.stats["snapshots"] == 1
        for c in (late, live, pub):
            await c.close()


# -- iterators that stop reading ------------------------------------------------------------------


class _Churn:
    """A pool driven by random requests with shared prefixes: plenty of stores and evictions."""

    def __init__(self, pub: KvEventPublisher, seed: int) -> None:
        self.pub, self.rnd = pub, random.Random(seed)
        self.manager = KVCacheManager(num_blocks=64, block_size=4)
        pub.attach(self.manager)
        self.n = 0

    def step(self) -> int:
        rnd = self.rnd
        with self.pub.lock:
            rid = f"r{self.n}"
            self.n += 1
            tokens = [rnd.randrange(8) for _ in range(rnd.randrange(4, 40))]
            if self.manager.allocate(rid, tokens) is not None:
                self.manager.free(rid)
        return self.pub.step()


async def _churn(engines: list[_Churn], n_events: int) -> None:
    done = 0
    while done < n_events:
        for e in engines:
            done += e.step()
        await asyncio.sleep(0)


async def test_break_out_of_async_for_then_20k_events(nats_server):
    cfg = Config(servers=nats_server.url, subject_prefix="brk", model=MODEL)
    sub = await KvEventSubscriber(cfg.replace(worker_id="sub")).start()
    pubs = [await KvEventPublisher(cfg.replace(worker_id=f"w{i}")).start() for i in range(2)]
    engines = [_Churn(p, seed=i) for i, p in enumerate(pubs)]
    churn = asyncio.create_task(_churn(engines, 100_000))
    n = 0
    async for _ in sub:
        n += 1
        if n == 10:
            break
    await asyncio.sleep(0)
    churn.cancel()
    await asyncio.gather(churn, return_exceptions=True)
    received = sub.stats["messages"]
    await _churn(engines, 20_000)  # nobody reads the iterator any more
    await wait_until(lambda: all(views_equal(sub, e.pub, e.manager) for e in engines), 60, "views == pools")
    # The iterator detached: more updates than its queue holds (1024) went by unread, yet it
    # never fell behind, as an attached iterator nobody reads would have.
    assert sub.stats["messages"] - received > 1024, sub.stats
    assert sub.stats["iterator_behind"] == 0
    await sub.close()  # never raises
    for p in pubs:
        await p.close()


async def test_a_stalled_iterator_is_told_it_fell_behind_and_stays_exact(nats_server):
    cfg = Config(servers=nats_server.url, subject_prefix="stall", model=MODEL)
    sub = await KvEventSubscriber(cfg.replace(worker_id="sub"), queue_size=64).start()
    it = sub.__aiter__()
    pubs = [await KvEventPublisher(cfg.replace(worker_id=f"w{i}")).start() for i in range(2)]
    engines = [_Churn(p, seed=10 + i) for i, p in enumerate(pubs)]
    state: dict[tuple[str, str], set] = {}

    def apply(u) -> None:  # a consumer that rebuilds each worker's blocks from the updates alone
        blocks = state.setdefault((u.model, u.worker), set())
        if u.reset:
            blocks.clear()
        for ev in u.batch.events:
            if isinstance(ev, BlockStored):
                blocks.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                blocks.difference_update(ev.block_hashes)
            else:
                blocks.clear()

    apply(await it.__anext__())  # reads one, then stalls while the workers keep going
    await _churn(engines, 5_000)
    # The views do not wait for the stalled iterator.
    await wait_until(lambda: all(views_equal(sub, e.pub, e.manager) for e in engines), 60, "views == pools")
    assert sub.stats["iterator_behind"] >= 1
    # Reading again: the catch-up resets come first and carry each worker's view.
    first = await it.__anext__()
    assert first.reset and first.source == "behind"
    apply(first)
    # Read on until the iterator has handed over each worker's last message as of now (the engines
    # are idle: later ones are heartbeats, which change nothing). Heartbeats arrive every second,
    # so the iterator is never silent for long: the end is this state, not a pause.
    last = {(MODEL, e.pub.config.worker_id): (e.pub.epoch, e.pub.stats["last_seq"]) for e in engines}
    seen = {(first.model, first.worker): (first.epoch, first.seq)}

    def caught_up() -> bool:
        return all(key in seen and seen[key][0] == epoch and seen[key][1] >= seq for key, (epoch, seq) in last.items())

    while not caught_up():
        u = await asyncio.wait_for(it.__anext__(), 30)
        apply(u)
        seen[(u.model, u.worker)] = (u.epoch, u.seq)
    for e in engines:
        with e.pub.lock:
            assert state[(MODEL, e.pub.config.worker_id)] == pool_hashes(e.manager)
    await sub.close()
    for p in pubs:
        await p.close()


# -- workers that go away, and subjects nobody serves ---------------------------------------------


async def test_made_up_workers_cost_a_few_requests_then_expire(nats_server):
    cfg = Config(servers=nats_server.url, subject_prefix="fake", model=MODEL, worker_timeout_s=3.0)
    requests = {"n": 0, "probe": 0}
    monitor = await nats_connect(nats_server.url)

    async def count(msg) -> None:  # sees every replay/snapshot request; never answers
        requests["n"] += 1
        requests["probe"] += msg.subject.endswith(".probe")

    # The monitor sees every request as a worker would (it turns "no responders" into time-outs).
    watched = [await monitor.subscribe("fake.snapshot.>", cb=count), await monitor.subscribe("fake.replay.>", cb=count)]
    await monitor.flush()
    sub = await KvEventSubscriber(cfg.replace(worker_id="sub", request_timeout_s=0.5)).start()
    real = await KvEventPublisher(cfg.replace(worker_id="real")).start()
    churn = _Churn(real, seed=3)
    forger = await nats_connect(nats_server.url)
    for i in range(1000):
        hdr = {"Kv-Seq": "0", "Kv-Epoch": f"e{i}", "Content-Type": "application/msgpack"}
        await forger.publish(f"fake.events.{MODEL}.ghost-{i}", msgspec.msgpack.encode([time.time(), [], None]), headers=hdr)
    await forger.flush()
    await wait_until(lambda: sub.stats["workers"] >= 1001, 20, "the made-up workers seen")
    while sub.stats["expired"] < 1000:  # the real worker keeps flowing meanwhile
        churn.step()
        await asyncio.sleep(0.01)
        assert sub.stats["workers"] >= 1
    # Every request sent before the expiry counted: the server has read them (kvbridge's flush),
    # has passed them on ahead of the monitor's PONG, and the monitor's callbacks have run.
    await sub._nc.flush()
    await monitor.flush()
    await wait_until(lambda: all(s.pending_msgs == 0 for s in watched), 10, "the monitor to count what it was sent")
    settled = requests["n"]
    # Gone: no more requests for them. The window is measured by the subscriber's own retry clock:
    # one more made-up worker appears, and once its request has gone unanswered and been retried
    # (a request_timeout_s later) any retry for the others would have been sent too.
    await forger.publish(f"fake.events.{MODEL}.probe", msgspec.msgpack.encode([time.time(), [], None]),
                         headers={"Kv-Seq": "0", "Kv-Epoch": "pr0be", "Content-Type": "application/msgpack"})  # fmt: skip
    await wait_until(lambda: requests["probe"] >= 2, 20, "two requests for the probe worker")
    assert requests["n"] - requests["probe"] - settled <= 2  # (the real one may resync)
    assert settled <= 1000 * 8, settled  # a bounded, small number each
    assert set(sub.views) - {(MODEL, "probe")} == {(MODEL, "real")}
    await wait_until(lambda: views_equal(sub, real, churn.manager), 30, "the real worker's view")
    print(f"1000 made-up workers: {settled} requests in all, {sub.stats}")
    for c in (sub, real, forger, monitor):
        await c.close()


async def _worker_process(
    server: NatsServer, prefix: str, worker: str, blocks: int, jetstream: bool = False
) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).with_name("worker_process.py")), "--servers", server.url, "--prefix", prefix,
        "--worker", worker, "--blocks", str(blocks), *(["--jetstream"] if jetstream else []), stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "KVBRIDGE_STREAM_NAME": "RST_FAULTS"},
    )  # fmt: skip
    try:
        epoch = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()  # type: ignore[union-attr]
        assert epoch, "the worker process did not start"
    except BaseException:  # a process that never said it started is not left running
        await _kill(proc)
        raise
    return proc, epoch


async def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()  # SIGKILL: no close(), no goodbye
    await proc.wait()


@pytest.mark.parametrize("jetstream", [False, True], ids=["core", "jetstream"])
async def test_a_killed_worker_restarted_empty_and_idle_shows_its_new_epoch(nats_server, jetstream):
    prefix = "rstjs" if jetstream else "rst"
    cfg = Config(servers=nats_server.url, subject_prefix=prefix, model=MODEL, jetstream=jetstream,
                 stream_name="RST_FAULTS")  # fmt: skip
    sub = await KvEventSubscriber(cfg.replace(worker_id="router")).start()
    proc, epoch = await _worker_process(nats_server, prefix, "w", blocks=12, jetstream=jetstream)
    try:
        await wait_until(lambda: sub.views.get((MODEL, "w")) is not None and len(sub.views[(MODEL, "w")].blocks) == 12,
                         20, "the first incarnation's 12 blocks")  # fmt: skip
        await _kill(proc)
        proc, new_epoch = await _worker_process(nats_server, prefix, "w", blocks=0, jetstream=jetstream)  # empty, idle
        assert new_epoch != epoch
        await wait_until(lambda: sub.views[(MODEL, "w")].epoch == new_epoch and not sub.views[(MODEL, "w")].blocks
                         and sub.in_sync(), 20, "the new, empty epoch")  # fmt: skip
        assert sub.stats["epoch_changes"] == 1
    finally:
        await _kill(proc)
        await sub.close()


async def test_an_expired_worker_is_dropped_with_an_update_saying_so(nats_server):
    updates: list = []
    sub = await KvEventSubscriber(servers=[nats_server.url], subject_prefix="exp", model=MODEL, worker_timeout_s=2.0,
                                  on_update=updates.append).start()  # fmt: skip
    proc, _ = await _worker_process(nats_server, "exp", "gone", blocks=3)
    try:
        await wait_until(lambda: sub.views.get((MODEL, "gone")) is not None and len(sub.views[(MODEL, "gone")].blocks) == 3,
                         20, "the worker's view")  # fmt: skip
    finally:
        await _kill(proc)  # decommissioned without a word: heartbeats stop
    # Never sooner than 3 of its 1 s heartbeats, nor than worker_timeout_s.
    await wait_until(lambda: (MODEL, "gone") not in sub.views, 20, "expiry")
    last = updates[-1]
    assert last.reset and last.source == "expired" and last.worker == "gone" and last.n_events == 0
    assert sub.stats["expired"] == 1
    await sub.close()


# -- permissions and worker ids -------------------------------------------------------------------


def _auth_conf(tmp_path) -> str:
    conf = tmp_path / "auth.conf"
    conf.write_text(
        """
authorization {
  users = [
    {user: w1, password: p1, permissions: {
      publish: ["perm.events.m.w1", "_INBOX.>"],
      subscribe: ["perm.replay.m.w1", "perm.snapshot.m.w1", "_INBOX.>"]}}
    {user: router, password: r1, permissions: {
      publish: ["_INBOX.>"],
      subscribe: ["perm.events.>", "perm.load.>", "_INBOX.>"]}}
    {user: mute, password: m1, permissions: {publish: ["_INBOX.>"], subscribe: [">"]}}
    {user: admin, password: a1}
  ]
}
"""
    )
    return str(conf)


async def test_permission_refusals_fail_start_and_are_logged(tmp_path, caplog):
    with NatsServer(config_file=_auth_conf(tmp_path)) as server:
        base = Config(servers=server.url, subject_prefix="perm", model=MODEL)
        # w1's credentials may publish only w1's events subject: starting as w2 fails, naming it.
        with pytest.raises(PermissionDeniedError, match=r"perm\.events\.m\.w2"):
            await KvEventPublisher(base.replace(worker_id="w2", user="w1", password="p1")).start()
        pub = await KvEventPublisher(base.replace(worker_id="w1", user="w1", password="p1")).start()
        pub.attach(_FlakyPool(fails=0))  # its pool holds block 77
        # A router that may read events but not request replays/snapshots: it says why.
        caplog.set_level(logging.WARNING, logger="kvbridge")
        sub = await KvEventSubscriber(base.replace(user="router", password="r1", request_timeout_s=0.5)).start()
        await wait_until(lambda: sub.stats["permission_errors"] >= 1, 15, "the refusal reported")
        assert any("refused" in r.getMessage() and "perm.snapshot.m.w1" in r.getMessage() for r in caplog.records)
        # A full-rights router syncs the worker.
        admin = await KvEventSubscriber(base.replace(user="admin", password="a1")).start()
        await wait_until(lambda: admin.views.get((MODEL, "w1")) is not None and admin.views[(MODEL, "w1")].blocks == {77},
                         15, "admin view")  # fmt: skip
        assert pub.stats["refused"] == 0 and pub.stats["permission_errors"] == 0
        # Without heartbeats nothing probes at start: refusals show at run time, counted as
        # refused, not sent.
        mute = await KvEventPublisher(base.replace(worker_id="mute", user="mute", password="m1", heartbeat_s=0)).start()
        mute.publish([stored(5)])
        await wait_until(lambda: mute.stats["refused"] == 1, 15, "a refusal")
        mute.publish([stored(6)])
        await wait_until(lambda: mute.stats["refused"] == 2, 15, "two refusals")
        assert mute.stats["messages"] == 0 and mute.stats["permission_errors"] == 2
        await mute.close()
        for c in (admin, sub, pub):
            await c.close()


async def test_a_second_publisher_with_the_same_worker_id_is_refused(nats_server):
    cfg = Config(servers=nats_server.url, subject_prefix="dup", model=MODEL, worker_id="same")
    first = await KvEventPublisher(cfg).start()
    with pytest.raises(WorkerIdInUseError, match="already served"):
        await KvEventPublisher(cfg).start()
    await first.close()
    again = await KvEventPublisher(cfg).start()  # free once the first one is gone
    await again.close()


async def test_two_epochs_alternating_on_one_subject_are_warned_about_once(nats_server, caplog):
    cfg = Config(servers=nats_server.url, subject_prefix="alt", model=MODEL, worker_id="twin", heartbeat_s=0.2)
    caplog.set_level(logging.WARNING, logger="kvbridge")
    sub = await KvEventSubscriber(cfg.replace(worker_id="sub")).start()
    pub = await KvEventPublisher(cfg).start()
    await wait_until(lambda: (MODEL, "twin") in sub.views and sub.in_sync(), 10, "first contact")
    # A second engine configured with the same id (its own start probe bypassed: it runs elsewhere
    # with an account that may not probe) keeps publishing its own incarnation.
    other = await nats_connect(nats_server.url)

    async def keep_speaking() -> None:
        for seq in range(10_000):
            hdr = {"Kv-Seq": str(seq), "Kv-Epoch": "0ther0ther0ther0", "Content-Type": "application/msgpack"}
            await other.publish(pub.subjects.events, msgspec.msgpack.encode([time.time(), [], None]), headers=hdr)
            await asyncio.sleep(0.1)  # paces the twin; nothing is decided by it

    # Its first messages after being given up could be a dead incarnation's late ones: conflicts
    # are counted once it has kept speaking past the grace (1 s; its heartbeat 0.2 s is shorter).
    twin = asyncio.create_task(keep_speaking())
    try:
        await wait_until(lambda: sub.stats["epoch_conflicts"] >= 2, 15, "conflicts counted")
    finally:
        twin.cancel()
        await asyncio.gather(twin, return_exceptions=True)
    warnings = [r for r in caplog.records if "two live publishers" in r.getMessage()]
    assert len(warnings) == 1
    assert pub.epoch in warnings[0].getMessage() and "0ther0ther0ther0" in warnings[0].getMessage()
    for c in (other, sub, pub):
        await c.close()


async def test_a_dead_incarnations_messages_arriving_after_its_successor_are_not_a_second_publisher(
    nats_server, caplog
):
    """A restart in a cluster: incarnation A's last messages, routed through another node, arrive
    after its successor B was adopted. Newer than anything seen from A, they are duplicates, not
    evidence of two live publishers (no WARNING, ``epoch_conflicts`` stays 0)."""
    cfg = Config(servers=nats_server.url, subject_prefix="late", model=MODEL, worker_id="w", heartbeat_s=0.2)
    caplog.set_level(logging.WARNING, logger="kvbridge")
    sub = await KvEventSubscriber(cfg.replace(worker_id="sub")).start()
    a = await KvEventPublisher(cfg).start()
    await wait_until(lambda: sub.worker_states().get((MODEL, "w")) == ("exact", a.epoch), 10, "A followed")
    epoch_a = a.epoch
    await a.close()
    b = await KvEventPublisher(cfg).start()
    await wait_until(lambda: sub.worker_states().get((MODEL, "w")) == ("exact", b.epoch), 10, "B followed")
    late = await nats_connect(nats_server.url)
    dups = sub.stats["duplicates"]
    for seq in (5_000, 5_001, 5_002):  # newer than anything A sent before it was given up
        hdr = {HDR_SEQ: str(seq), HDR_EPOCH: epoch_a, HDR_CONTENT_TYPE: "application/msgpack", HDR_HEARTBEAT: "0.2"}
        await late.publish(a.subjects.events, msgspec.msgpack.encode([time.time(), [], None]), headers=hdr)
    await wait_until(lambda: sub.stats["duplicates"] >= dups + 3, 10, "A's late messages dropped")
    assert sub.stats["epoch_conflicts"] == 0
    assert not [r for r in caplog.records if "two live publishers" in r.getMessage()]
    assert sub.worker_states().get((MODEL, "w")) == ("exact", b.epoch)
    for c in (late, sub, b):
        await c.close()


async def test_a_snapshot_answered_by_a_dying_incarnation_does_not_wedge_its_successor(nats_server, caplog):
    """Incarnation A answers the subscriber's snapshot request and dies; its successor B spoke
    before A's answer was read, so the resync adopted A and gave B up (sequencer ``adopt``).
    Once A has been silent past the worker's timeout while B speaks, B is resynced and followed."""
    caplog.set_level(logging.WARNING, logger="kvbridge")
    cfg = Config(servers=nats_server.url, subject_prefix="wedge", model=MODEL, worker_id="w", heartbeat_s=0.2)
    sub = await KvEventSubscriber(cfg.replace(worker_id="sub", worker_timeout_s=1.0)).start()
    dying = await nats_connect(nats_server.url)
    epoch_a = "deaddeaddeaddead"
    subjects = WorkerSubjects.build("wedge", MODEL, "w")
    successor: list[KvEventPublisher] = []
    b_pool = KVCacheManager(num_blocks=16, block_size=4)

    async def answer_then_die(msg) -> None:
        # B starts (an empty pool's snapshot to give, its first heartbeat out at once) and is
        # read by the subscriber before A's answer.
        heard = sub.stats["messages"]
        b = await KvEventPublisher(cfg).start()
        with b.lock:
            b.attach(b_pool)
            b_pool.allocate(1, list(range(8)))
        successor.append(b)
        await wait_until(lambda: sub.stats["messages"] > heard, 10, "B heard before A's answer")
        end = {HDR_REPLY: REPLY_SNAPSHOT_END, HDR_EPOCH: epoch_a, HDR_SEQ: "0", HDR_COUNT: "0"}
        await dying.publish(msg.reply, b"", headers=end)
        await answering.unsubscribe()  # A is gone

    answering = await dying.subscribe(subjects.snapshot, cb=answer_then_die)
    await dying.publish(subjects.events, msgspec.msgpack.encode([time.time(), [], None]),
                        headers={HDR_SEQ: "0", HDR_EPOCH: epoch_a, HDR_CONTENT_TYPE: "application/msgpack",
                                 HDR_HEARTBEAT: "0.2"})  # fmt: skip
    # The wedge happens: A adopted, B's messages from a given-up epoch.
    await wait_until(lambda: successor and sub.worker_states().get((MODEL, "w")) == ("exact", epoch_a)
                     and sub.stats["duplicates"] + sub.stats["epoch_conflicts"] >= 1, 10, "A adopted, B given up")  # fmt: skip
    b = successor[0]
    await wait_until(lambda: sub.worker_states().get((MODEL, "w")) == ("exact", b.epoch), 15, "B followed")
    with b.lock:
        b_pool.allocate(2, list(range(100, 108)))
        want = pool_hashes(b_pool)
    b.step()
    await wait_until(lambda: sub.views[(MODEL, "w")].blocks == want, 10, "B's blocks in the view")
    assert sub.stats["epoch_changes"] >= 1
    assert any("silent" in r.getMessage() and epoch_a in r.getMessage() for r in caplog.records)
    await b.close()
    await dying.close()
    await sub.close()


async def test_a_reconnect_gives_the_followed_epoch_a_full_timeout_again(nats_server):
    """After the subscriber's own outage, nobody's silence counts (expiry), nor the followed
    epoch's against a given-up one that speaks first (the revival rule above)."""
    sub = KvEventSubscriber(Config(servers=nats_server.url, worker_timeout_s=1.0))
    w = Worker("kv", MODEL, "w", track_view=False)
    w.seq.snapshot_taken("A", 0)
    w.last_heard = w.followed_heard = time.monotonic() - 60
    sub._workers[(MODEL, "w")] = w
    reconnected = time.monotonic()
    await sub._on_reconnected()
    w.heard("B", None)  # a given-up epoch's message, first after the reconnect
    assert not sub._outlived(w) and w.followed_heard >= reconnected  # its timeout starts again


# -- a pool that fails a snapshot -----------------------------------------------------------------


class _FlakyPool:
    def __init__(self, fails: int) -> None:
        self.fails = fails

    def take_events(self) -> list:
        return []

    def snapshot(self) -> list:
        if self.fails:
            self.fails -= 1
            raise RuntimeError("pool busy")
        return [stored(77)]


async def test_a_failing_snapshot_is_an_error_reply_and_the_subscriber_retries(nats_server):
    cfg = Config(servers=nats_server.url, subject_prefix="flaky", model=MODEL, worker_id="w")
    pub = await KvEventPublisher(cfg).start()
    pub.attach(_FlakyPool(fails=2))
    sub = await KvEventSubscriber(cfg.replace(worker_id="sub", request_timeout_s=5.0)).start()
    await wait_until(lambda: sub.views.get((MODEL, "w")) is not None and sub.views[(MODEL, "w")].blocks == {77}, 20,
                     "the snapshot after two failures")  # fmt: skip
    assert pub.stats["snapshot_errors"] == 2
    assert sub.stats["request_errors"] == 2 and sub.stats["request_timeouts"] == 0  # answered, never silent
    await sub.close()
    await pub.close()


# -- the broker dies, the engines go idle ---------------------------------------------------------


@pytest.mark.timeout(240)
async def test_broker_killed_engines_go_idle_every_subscriber_converges(own_nats_server):
    server = own_nats_server
    base = Config(servers=server.url, subject_prefix="idle", model=MODEL, reconnect_wait_s=0.2)
    fast = await KvEventSubscriber(base.replace(worker_id="fast")).start()
    # Reconnects well after the publishers have: whatever they re-sent on reconnect, it missed.
    slow = await KvEventSubscriber(base.replace(worker_id="slow", reconnect_wait_s=4.0)).start()
    pubs = [await KvEventPublisher(base.replace(worker_id=f"w{i}")).start() for i in range(3)]
    engines = [_Churn(p, seed=20 + i) for i, p in enumerate(pubs)]
    await _churn(engines, 3_000)
    clients = [fast, slow, *pubs]
    await asyncio.to_thread(server.kill)
    await _churn(engines, 3_000)  # handed over while the broker is dead; then idle for good
    # The fault happened: every client lost its connection before the broker is back.
    await wait_until(lambda: not any(c._nc.is_connected for c in clients), 30, "every client disconnected")
    await asyncio.to_thread(server.start)  # same port
    for sub in (fast, slow):
        await wait_until(lambda: all(views_equal(sub, e.pub, e.manager) for e in engines), 60,
                         f"{sub.config.worker_id} subscriber: views == pools")  # fmt: skip
    print(f"fast {fast.stats}\nslow {slow.stats}")
    assert all(c.stats["reconnects"] >= 1 for c in clients), [c.stats["reconnects"] for c in clients]
    for c in (fast, slow, *pubs):
        await c.close()


@pytest.mark.timeout(240)
async def test_a_late_subscriber_finds_200_idle_workers(nats_server):
    base = Config(servers=nats_server.url, subject_prefix="late200", model=MODEL)
    pubs = await asyncio.gather(*(KvEventPublisher(base.replace(worker_id=f"w{i}")).start() for i in range(200)))
    managers = []
    for i, p in enumerate(pubs):
        m = KVCacheManager(num_blocks=16, block_size=4)
        p.attach(m)
        with p.lock:
            m.allocate("r", [i, i + 1, i + 2, i + 3, 7, 7, 7, 7])
        p.step()
        managers.append(m)
    # Every worker idle: its events sent, and a heartbeat after them; nothing but heartbeats from here on.
    beats = [p.stats["heartbeats"] for p in pubs]
    await wait_until(lambda: all(p.stats["unsent"] == 0 and p.stats["events"] > 0 and p.stats["heartbeats"] > n
                                 for p, n in zip(pubs, beats)), 30, "every worker idle")  # fmt: skip
    sub = await KvEventSubscriber(base.replace(worker_id="router")).start()
    await wait_until(lambda: all(views_equal(sub, p, m) for p, m in zip(pubs, managers)), 60, "all 200 views")
    assert len(sub.views) == 200
    await sub.close()
    await asyncio.gather(*(p.close() for p in pubs))
