"""JetStream mode against a real nats-server with -js: the stream's settings, de-duplication of
re-sends, a subscriber that rebuilds every view from the stream after the workers are gone, and a
broker SIGKILL mid-stream that loses nothing and delivers nothing twice.

The block pool has not landed on main yet, so workers publish known random event sequences and the
reference is the block set those sequences leave (tracked independently of WorkerView)."""

from __future__ import annotations

import asyncio
import datetime
import random

import pytest
from nats.js import api

from bridge_support import Recorder, nats_connect, wait_until
from kvbridge import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Config,
    ConfigError,
    KvEventPublisher,
    KvEventSubscriber,
)
from kvbridge.bus.jetstream import JetStreamError

pytestmark = pytest.mark.timeout(60)
MODEL = "m"


def js_cfg(server, prefix: str, stream: str, **kw) -> Config:
    base = dict(
        servers=server.url, model=MODEL, subject_prefix=prefix, jetstream=True, stream_name=stream,
        max_batch_events=16, heartbeat_s=0.5, reconnect_wait_s=0.2, request_timeout_s=1.0,
    )  # fmt: skip
    base.update(kw)
    return Config(**base)


class Workload:
    """A random but reproducible event sequence for one worker incarnation, and the block set it
    leaves: stores (new hashes, sometimes chained to a held block), removals, a rare clear."""

    def __init__(self, seed: int) -> None:
        self.rnd = random.Random(seed)
        self.blocks: set[int] = set()
        self._held: list[int] = []  # self.blocks in a sample-able form, rebuilt lazily
        self.next_hash = seed << 32

    def step(self) -> list:
        rnd, events = self.rnd, []
        for _ in range(rnd.randrange(1, 6)):
            r = rnd.random()
            if r < 0.6 or not self.blocks:
                n = rnd.randrange(1, 5)
                hashes = list(range(self.next_hash, self.next_hash + n))
                self.next_hash += n
                parent = rnd.choice(self._sample_space()) if self.blocks and rnd.random() < 0.5 else None
                events.append(BlockStored(hashes, parent, [7] * 4 * n, 4, None, "GPU", None))
                self.blocks.update(hashes)
            elif r < 0.99:
                gone = rnd.sample(self._sample_space(), min(len(self.blocks), rnd.randrange(1, 4)))
                events.append(BlockRemoved(gone, "GPU"))
                self.blocks.difference_update(gone)
            else:
                events.append(AllBlocksCleared())
                self.blocks.clear()
            self._held = []
        return events

    def _sample_space(self) -> list[int]:
        if not self._held:
            self._held = list(self.blocks)
        return self._held


async def run_workload(pub: KvEventPublisher, wl: Workload, steps: int, pause_every: int = 5, pause: float = 0.0):
    for i in range(steps):
        pub.publish(wl.step())
        if i % pause_every == 0:
            await asyncio.sleep(pause)


def views_equal(sub: KvEventSubscriber, expected: dict) -> bool:
    """expected: {(model, worker): (epoch, blocks)}."""
    if not sub.in_sync():
        return False
    views = sub.views
    return all(
        key in views and views[key].epoch == epoch and views[key].blocks == blocks
        for key, (epoch, blocks) in expected.items()
    )


async def stream_messages(url: str | list[str], stream: str, subject: str) -> list[tuple[str, dict, int]]:
    """Everything the stream holds on ``subject``: (subject, headers, stream seq), in stream order."""
    nc = await nats_connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream, subjects_filter=subject)
        want = sum((info.state.subjects or {}).values())
        # One replica in memory: the count must not depend on placing a replicated consumer while
        # a cluster node is down.
        cc = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, num_replicas=1, mem_storage=True)
        psub = await js.pull_subscribe(subject, stream=stream, config=cc)
        out: list[tuple[str, dict, int]] = []
        while len(out) < want:
            for m in await psub.fetch(min(500, want - len(out)), timeout=5):
                out.append((m.subject, dict(m.headers or {}), m.metadata.sequence.stream))
        await psub.unsubscribe()
        return out
    finally:
        await nc.close()


def seqs_by_incarnation(messages) -> dict[tuple[str, str], list[int]]:
    by: dict[tuple[str, str], list[int]] = {}
    for subject, hdrs, _ in messages:
        by.setdefault((subject.rsplit(".", 1)[1], hdrs["Kv-Epoch"]), []).append(int(hdrs["Kv-Seq"]))
    return by


# -- the stream ---------------------------------------------------------------------------------


async def test_stream_created_with_config_and_updated_in_place(nats_server):
    cfg = js_cfg(nats_server, "jst1", "JST1", stream_max_age_s=600, stream_duplicate_window_s=30)
    # Many workers starting together race to create the one stream; all must succeed.
    pubs = await asyncio.gather(*(KvEventPublisher(cfg, worker_id=f"w{i}").start() for i in range(4)))
    nc = await nats_connect(nats_server.url)
    js = nc.jetstream()
    info = await js.stream_info("JST1")
    assert info.config.subjects == ["jst1.events.>"]
    assert info.config.max_age == pytest.approx(600) and info.config.duplicate_window == pytest.approx(30)
    assert info.config.storage == api.StorageType.FILE
    for p in pubs:
        p.publish([BlockStored([1], None, [1] * 4, 4, None, "GPU", None)])
    for p in pubs:
        await p.close()
    stored = (await js.stream_info("JST1")).state.messages
    # every message of every worker (its start heartbeat, the batch, heartbeats since) is stored
    assert stored == sum(p.stats["last_seq"] + 1 for p in pubs) >= 8

    # A worker with other limits updates the stream in place: what others stored stays.
    later = await KvEventPublisher(cfg, worker_id="w9", stream_max_age_s=900, stream_duplicate_window_s=60).start()
    info = await js.stream_info("JST1")
    assert info.config.max_age == pytest.approx(900) and info.config.duplicate_window == pytest.approx(60)
    assert info.state.messages >= stored and info.state.first_seq == 1
    await later.close()

    # An operator's stream over other subjects gets ours added, not replaced.
    await js.add_stream(name="JST1B", subjects=["other.>"], max_age=600, duplicate_window=30)
    p = await KvEventPublisher(js_cfg(nats_server, "jst1b", "JST1B", stream_max_age_s=600,
                                      stream_duplicate_window_s=30)).start()  # fmt: skip
    assert (await js.stream_info("JST1B")).config.subjects == ["other.>", "jst1b.events.>"]
    await p.close()
    await nc.close()

    with pytest.raises(ConfigError, match="stream_duplicate_window_s"):
        await KvEventPublisher(js_cfg(nats_server, "jst1c", "JST1C", stream_max_age_s=10,
                                      stream_duplicate_window_s=20)).start()  # fmt: skip


async def test_without_jetstream_on_the_server_start_fails_clearly(own_nats_server):
    with pytest.raises(JetStreamError, match="JetStream"):
        await KvEventPublisher(js_cfg(own_nats_server, "jst0", "JST0")).start()
    with pytest.raises(JetStreamError, match="JST0"):
        await KvEventSubscriber(js_cfg(own_nats_server, "jst0", "JST0")).start()


async def test_resent_msg_id_is_not_duplicated(nats_server):
    cfg = js_cfg(nats_server, "jst2", "JST2")
    pub = await KvEventPublisher(cfg, worker_id="w0").start()
    await run_workload(pub, Workload(2), 200, pause=0.001)
    assert await pub._js.wait_acked(10)
    last = pub.stats["last_seq"]
    info_before = await _info(nats_server, "JST2")
    assert info_before.state.messages == last + 1

    # The publisher's re-send path, as after a reconnect whose acks never came: everything again.
    pub._js.acked_below = 0
    pub._js.rewind()
    assert await pub._js.wait_acked(10)
    stats = pub.stats
    assert stats["js_resent"] == last + 1 and stats["js_duplicates"] == last + 1, stats

    # The same on the wire from another client: same Nats-Msg-Id, same answer.
    messages = await stream_messages(nats_server.url, "JST2", "jst2.events.>")
    nc = await nats_connect(nats_server.url)
    js = nc.jetstream()
    subject, hdrs, _ = messages[3]
    ack = await js.publish(subject, b"\x93\x00\x90\xc0", headers=hdrs)
    assert ack.duplicate and ack.seq == messages[3][2]
    await nc.close()

    info = await _info(nats_server, "JST2")
    assert info.state.messages == last + 1 and info.state.last_seq == info_before.state.last_seq
    await pub.close()


async def _info(server, stream: str) -> api.StreamInfo:
    nc = await nats_connect(server.url)
    try:
        return await nc.jetstream().stream_info(stream)
    finally:
        await nc.close()


# -- catching up ------------------------------------------------------------------------------------


async def test_late_subscriber_rebuilds_every_view_from_the_stream_alone(nats_server):
    cfg = js_cfg(nats_server, "jst3", "JST3")
    loads = {f"w{i}": Workload(30 + i) for i in range(3)}
    pubs = {w: await KvEventPublisher(cfg, worker_id=w).start() for w in loads}
    await asyncio.gather(*(run_workload(pubs[w], loads[w], 400) for w in loads))
    # w2 restarts: a new incarnation whose cache starts empty.
    await pubs["w2"].close()
    old_epoch = pubs["w2"].epoch
    loads["w2"] = Workload(99)
    pubs["w2"] = await KvEventPublisher(cfg, worker_id="w2").start()
    await asyncio.gather(*(run_workload(pubs[w], loads[w], 300) for w in loads))
    for p in pubs.values():
        await p.close()
    assert all(p.stats["js_unacked"] == 0 for p in pubs.values())
    expected = {(MODEL, w): (pubs[w].epoch, set(loads[w].blocks)) for w in loads}

    # Every worker is gone: nobody could answer a replay or snapshot request.
    rec = Recorder()
    sub = await KvEventSubscriber(cfg, on_update=rec).start()
    waited = await wait_until(lambda: views_equal(sub, expected), 20, "views == reference, from the stream")
    stats = sub.stats
    print(f"caught up in {waited:.2f}s: {stats}")
    assert stats["snapshots"] == stats["replays"] == stats["request_timeouts"] == stats["gaps"] == 0, stats
    assert stats["epoch_changes"] == 1
    for w in ("w0", "w1"):
        assert rec.check((MODEL, w))["resets"] == 1
    assert rec.check((MODEL, "w2"))["resets"] == 2
    await sub.close()

    # From a given stream sequence: w2's second incarnation only (its first message on).
    messages = await stream_messages(nats_server.url, "JST3", "jst3.events.m.w2")
    start = next(sseq for _, h, sseq in messages if h["Kv-Epoch"] == pubs["w2"].epoch and h["Kv-Seq"] == "0")
    rec2 = Recorder()
    sub2 = await KvEventSubscriber(cfg, worker="w2", stream_start=start, on_update=rec2).start()
    await wait_until(lambda: views_equal(sub2, {(MODEL, "w2"): expected[(MODEL, "w2")]}), 20, "w2 from its restart")
    assert set(sub2.views) == {(MODEL, "w2")}
    assert all(epoch != old_epoch for epoch, _, _ in rec2.by_worker[(MODEL, "w2")])
    assert rec2.check((MODEL, "w2"))["resets"] == 1 and sub2.stats["snapshots"] == 0
    await sub2.close()

    # From a time: nothing stored before it, then live from the stream (a worker that starts later).
    sub3 = await KvEventSubscriber(cfg, stream_start=datetime.datetime.now(datetime.timezone.utc)).start()
    newcomer, wl = await KvEventPublisher(cfg, worker_id="w3").start(), Workload(77)
    await run_workload(newcomer, wl, 100)
    await newcomer.close()
    await wait_until(lambda: views_equal(sub3, {(MODEL, "w3"): (newcomer.epoch, wl.blocks)}), 20, "w3 live")
    assert set(sub3.views) == {(MODEL, "w3")} and sub3.stats["snapshots"] == 0
    await sub3.close()


@pytest.mark.timeout(90)
async def test_broker_sigkill_mid_stream_loses_nothing_and_duplicates_nothing(own_js_server):
    server = own_js_server
    cfg = js_cfg(server, "jst4", "JST4")
    rec = Recorder()
    sub = await KvEventSubscriber(cfg, on_update=rec).start()
    loads = {f"w{i}": Workload(40 + i) for i in range(2)}
    pubs = {w: await KvEventPublisher(cfg, worker_id=w).start() for w in loads}
    stop = asyncio.Event()

    async def engine(w: str) -> None:
        while not stop.is_set():
            await run_workload(pubs[w], loads[w], 10, pause=0.001)

    engines = [asyncio.create_task(engine(w)) for w in loads]
    await wait_until(lambda: all(p.stats["last_seq"] > 50 for p in pubs.values()), 30, "traffic before the crash")
    at_kill = {w: p.stats["last_seq"] for w, p in pubs.items()}
    await asyncio.to_thread(server.kill)
    assert not server.running  # kill -9: the broker is gone
    # the engines keep publishing into the rings while it is down
    await wait_until(lambda: all(p.stats["last_seq"] > at_kill[w] + 20 for w, p in pubs.items()), 30,
                     "events published while the broker is down")  # fmt: skip
    await asyncio.to_thread(server.start)  # same port, same store dir
    await wait_until(lambda: all(p.stats["reconnects"] >= 1 for p in pubs.values()), 30, "the publishers back")
    restarted = {w: p.stats["last_seq"] for w, p in pubs.items()}
    await wait_until(lambda: all(p.stats["last_seq"] > restarted[w] + 20 for w, p in pubs.items()), 30,
                     "traffic after the restart")  # fmt: skip
    stop.set()
    await asyncio.gather(*engines)
    for p in pubs.values():
        await p.close(timeout=15)
    pstats = {w: p.stats for w, p in pubs.items()}
    print(f"killed at seqs {at_kill}; publishers: {pstats}")
    assert all(s["js_unacked"] == 0 and s["reconnects"] >= 1 for s in pstats.values()), pstats

    expected = {(MODEL, w): (pubs[w].epoch, set(loads[w].blocks)) for w in loads}
    waited = await wait_until(lambda: views_equal(sub, expected), 20, "views == reference after the broker crash")
    stats = sub.stats
    print(f"subscriber converged {waited:.2f}s after close: {stats}")
    for w in loads:
        assert rec.check((MODEL, w))["resets"] == 1  # exactly once, in order, no snapshot needed
    assert stats["snapshots"] == 0, stats
    await sub.close()

    # The stream itself: every message of every worker exactly once, re-sends de-duplicated. Not
    # necessarily in seq order: nats-py flushes its own reconnect buffer (messages after the lost
    # ones) before our re-send of the lost ones lands.
    by = seqs_by_incarnation(await stream_messages(server.url, "JST4", "jst4.events.>"))
    for w, p in pubs.items():
        seqs = by[(w, p.epoch)]
        assert sorted(seqs) == list(range(pstats[w]["last_seq"] + 1)), f"{w}: stream holds {len(seqs)} messages"
        print(f"{w}: {len(seqs)} messages in the stream, {sum(a > b for a, b in zip(seqs, seqs[1:]))} out of order")

    # A subscriber started now, with every worker gone, rebuilds the same views from that stream.
    late = await KvEventSubscriber(cfg).start()
    await wait_until(lambda: views_equal(late, expected), 20, "late views == reference after the crash")
    stats = late.stats
    print(f"late subscriber: {stats}")
    assert stats["snapshots"] == stats["request_timeouts"] == stats["duplicates"] == 0, stats
    await late.close()


async def test_publisher_recreates_a_deleted_stream(nats_server):
    cfg = js_cfg(nats_server, "jst5", "JST5", request_timeout_s=0.5)
    pub = await KvEventPublisher(cfg, worker_id="w0").start()
    await run_workload(pub, Workload(5), 50)
    assert await pub._js.wait_acked(10)
    nc = await nats_connect(nats_server.url)
    await nc.jetstream().delete_stream("JST5")
    await run_workload(pub, Workload(6), 50)
    assert await pub._js.wait_acked(15), pub.stats
    info = await nc.jetstream().stream_info("JST5")
    stats = pub.stats
    print(f"after deletion: {info.state.messages} messages in the new stream; {stats}")
    assert stats["js_ack_errors"] >= 1 and info.state.messages >= 1
    assert info.state.last_seq == info.state.messages  # a fresh stream, no holes
    await nc.close()
    await pub.close()
