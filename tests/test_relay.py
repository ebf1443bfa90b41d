"""The relay against real sockets: a pyzmq XPUB + ROUTER playing the engine with the bytes vLLM 0.33
itself published (vllm_zmq_frames.json), and a real nats-server.

The fake engine uses XPUB (a PUB that also reports subscriptions) to beat ZMQ's slow joiner
without sleeps: it sends only once the relay's subscription has reached it.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys

import msgspec
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from bridge_support import Collector, nats_connect, stop_process, wait_until
from hybrid_support import Stream
from engine_shapes import (
    SglAllBlocksCleared,
    SglBatch,
    SglBlockRemoved,
    SglBlockStored,
    VllmBatch,
    VllmBlockRemoved,
    VllmBlockStored,
)
from kvbridge import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Config,
    KVEventBatch,
    KvEventSubscriber,
    decode_batch,
    encode_batch,
)
from kvbridge.config import ConfigError
from kvbridge.tools.cli import build_parser
from kvbridge.bus.subscriber import WorkerView
from kvbridge.engine.relay import Relay, RelayView, engine_endpoint
from kvbridge.tools.server import NatsServer
from kvbridge.wire.subjects import HDR_CONTENT_TYPE, HDR_EPOCH, HDR_MSG_ID, HDR_SEQ

END = b"\xff" * 8
WAIT = 45.0  # upper bound of every wait (generous for a loaded CI box); none is a timing assertion


@pytest.fixture(scope="module")
def vllm_frames(load_vectors):
    v = load_vectors("vllm_zmq_frames.json")
    frames = [(f["topic"].encode(), f["seq"], bytes.fromhex(f["payload_hex"])) for f in v["frames"]]
    replay_from_2 = [[bytes.fromhex(x) for x in msg] for msg in v["replay_from_2_raw_frames_hex"]]
    return frames, replay_from_2


class FakeEngine:
    """vLLM's ZmqEventPublisher on the wire: PUB frames, and a ROUTER answering replay requests
    from what it "published" (including what it dropped, as vLLM's buffer holds those too)."""

    def __init__(self, ctx: zmq.asyncio.Context, *, replay: bool = True, replay_topic: bool = True,
                 host: str = "127.0.0.1") -> None:  # fmt: skip
        self.host = host  # "[::1]": bound as vLLM binds on an IPv6 node (zmq.IPV6 set)
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.linger = 0
        self.pub.ipv6 = host.startswith("[")
        self.port = self.pub.bind_to_random_port(f"tcp://{host}")
        self.router = None
        self.replay_port = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.linger = 0
            self.router.ipv6 = host.startswith("[")
            self.replay_port = self.router.bind_to_random_port(f"tcp://{host}")
        self.replay_topic = replay_topic  # vLLM 0.33 puts the topic in replies; older vLLM/SGLang do not
        self.held: list[tuple[bytes, int, bytes]] = []
        self.replay_requests: list[int] = []
        self._server = asyncio.ensure_future(self._serve()) if replay else None

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://{self.host}:{self.replay_port}" if self.replay_port else None

    async def wait_subscribed(self) -> bytes:
        assert await self.pub.poll(WAIT * 1000), "the relay never subscribed"
        return (await self.pub.recv())[1:]

    async def send(self, topic: bytes, seq: int, payload: bytes, *, drop: bool = False) -> None:
        self.held.append((topic, seq, payload))
        if not drop:
            await self.pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])

    def restart(self) -> None:
        self.held.clear()

    async def _serve(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            for topic, seq, payload in list(self.held):
                if seq >= start_seq:
                    head = [topic] if self.replay_topic else []
                    await self.router.send_multipart([ident, b"", *head, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([ident, b"", *([b""] if self.replay_topic else []), END, b""])

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.cancel()
            await asyncio.gather(self._server, return_exceptions=True)
            self.router.close(0)
        self.pub.close(0)


@pytest_asyncio.fixture(loop_scope="function")
async def zctx():
    ctx = zmq.asyncio.Context()
    engines: list[FakeEngine] = []

    def make(**kw) -> FakeEngine:
        engines.append(FakeEngine(ctx, **kw))
        return engines[-1]

    yield make
    for e in engines:
        await e.aclose()
    ctx.term()


def relay_config(server, worker: str, **kw) -> Config:
    return Config(servers=[server.url], model="m-relay", worker_id=worker, heartbeat_s=0, **kw)


def hashes_after(payloads: list[bytes]) -> set:
    view = WorkerView()
    for p in payloads:
        view.apply_events(decode_batch(p).events)
    return view.blocks


def assert_one_hole(col: Collector, before: list[bytes], after: list[bytes]) -> None:
    """A hole in Kv-Seq where batches were lost, ``after`` intact behind it. The publisher drops what
    it had not sent yet when it makes a hole (consumers behind it resync by snapshot, which covers
    those), so of ``before`` a prefix arrives, depending on timing."""
    data = [m.data for m in col.msgs]
    k = len(data) - len(after)
    assert data == before[:k] + after
    hole = len(before)
    assert col.seqs() == list(range(k)) + list(range(hole + 1, hole + 1 + len(after)))


def relay_hashes(relay: Relay) -> set:
    return relay.view.blocks


# --- the wire ------------------------------------------------------------------------------------


async def test_fake_engine_replays_exactly_as_vllm(zctx, vllm_frames):
    frames, replay_from_2 = vllm_frames
    engine = zctx()
    for f in frames:
        await engine.send(*f, drop=True)
    dealer = engine.pub.context.socket(zmq.DEALER)
    dealer.linger = 0
    try:
        dealer.connect(engine.replay_endpoint)
        await dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        got = []
        while not got or got[-1][-2] != END:
            assert await dealer.poll(WAIT * 1000)
            got.append(await dealer.recv_multipart())
    finally:
        dealer.close(0)
    assert got == replay_from_2


def test_engine_endpoint_follows_the_engines_dp_port_offset():
    """vLLM 0.33's ZmqEventPublisher.offset_endpoint_port, plus ``*`` read as this host."""
    assert engine_endpoint("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert engine_endpoint("tcp://10.0.0.2:5557", 2) == "tcp://10.0.0.2:5559"
    assert engine_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert engine_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert engine_endpoint("ipc:///tmp/kv") == engine_endpoint("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
    # Port 0 is left to the OS, for every rank.
    assert engine_endpoint("tcp://*:0", 3) == "tcp://127.0.0.1:0"
    assert engine_endpoint("tcp://10.0.0.2:0", 1) == "tcp://10.0.0.2:0"
    with pytest.raises(ValueError, match="dp rank"):
        engine_endpoint("ipc:///tmp/kv", 1)
    with pytest.raises(ValueError, match="tcp://host:port"):
        engine_endpoint("tcp://10.0.0.2", 1)


def test_a_port_0_endpoint_cannot_be_connected_to():
    with pytest.raises(ConfigError, match="port 0"):
        Relay(Config(worker_id="w"), endpoint="tcp://*:0")
    with pytest.raises(ConfigError, match="port 0"):
        Relay(Config(worker_id="w"), endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://*:0", dp_rank=1)


@pytest.mark.parametrize("kw, words", [({"idle_probe_s": -1}, "idle_probe_s must be a finite number of seconds >= 0"),
                                       ({"topic": None}, "topic must be a str")])  # fmt: skip
def test_relay_arguments_are_checked_by_name(kw, words):
    with pytest.raises(ConfigError, match=words):
        Relay(Config(worker_id="w"), endpoint="tcp://127.0.0.1:5557", **kw)


# --- relaying --------------------------------------------------------------------------------------


async def test_frames_arrive_on_nats_byte_identical_with_headers(zctx, nats_sub, nats_server, vllm_frames):
    frames, _ = vllm_frames
    engine = zctx()
    col = await nats_sub("kv.events.m-relay.w-bytes")
    async with Relay(relay_config(nats_server, "w-bytes"), endpoint=engine.endpoint, topic="kv") as relay:
        assert await engine.wait_subscribed() == b"kv"
        for f in frames:
            await engine.send(*f)
        await wait_until(lambda: len(col.msgs) == len(frames), WAIT, "every frame on NATS")
        epoch = relay.publisher.epoch
    assert [m.data for m in col.msgs] == [p for _, _, p in frames]  # the empty batch too
    assert col.seqs() == list(range(len(frames)))
    for m in col.msgs:
        assert m.headers[HDR_EPOCH] == epoch
        assert m.headers[HDR_MSG_ID] == f"w-bytes:{epoch}:{m.headers[HDR_SEQ]}"
        assert m.headers[HDR_CONTENT_TYPE] == "application/msgpack"
    assert relay.stats["forwarded"] == len(frames) and relay.stats["lost_batches"] == 0
    assert relay.stats["replay_requests"] == 0


@pytest.mark.parametrize("replay_topic", [True, False], ids=["vllm-0.33-replies", "replies-without-topic"])
async def test_a_gap_is_repaired_through_the_engines_replay(zctx, nats_sub, nats_server, vllm_frames, replay_topic):
    frames, _ = vllm_frames
    engine = zctx(replay_topic=replay_topic)
    col = await nats_sub("kv.events.m-relay.w-gap")
    cfg = relay_config(nats_server, "w-gap")
    async with Relay(cfg, endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint) as relay:
        await engine.wait_subscribed()
        for topic, seq, payload in frames:
            await engine.send(topic, seq, payload, drop=seq in (2, 3))  # lost at the PUB's high-water mark
        await wait_until(lambda: len(col.msgs) == len(frames), WAIT, "every frame on NATS")
    # The gap's request; after it, at most an idle probe from the next seq (a slow close).
    assert engine.replay_requests[0] == 2 and set(engine.replay_requests[1:]) <= {len(frames)}
    assert [m.data for m in col.msgs] == [p for _, _, p in frames]
    assert col.seqs() == list(range(len(frames)))
    assert relay.stats["replayed"] == 2 and relay.stats["lost_batches"] == 0
    assert relay.stats["replay_requests"] == 1


async def test_an_engine_on_ipv6_is_relayed_and_its_gaps_replayed(zctx, nats_sub, nats_server, vllm_frames):
    """vLLM on an IPv6 node binds and lists tcp://[addr]:port; a relay without zmq.IPV6 connected
    to nothing and said nothing."""
    frames, _ = vllm_frames
    engine = zctx(host="[::1]")
    col = await nats_sub("kv.events.m-relay.w-v6")
    async with Relay(relay_config(nats_server, "w-v6"), endpoint=engine.endpoint,
                     replay_endpoint=engine.replay_endpoint) as relay:  # fmt: skip
        await engine.wait_subscribed()
        for topic, seq, payload in frames:
            await engine.send(topic, seq, payload, drop=seq == 2)
        await wait_until(lambda: len(col.msgs) == len(frames), WAIT, "every frame on NATS")
    assert engine.endpoint.startswith("tcp://[::1]:")
    assert [m.data for m in col.msgs] == [p for _, _, p in frames] and relay.stats["replayed"] == 1


async def test_a_relay_started_late_recovers_the_engines_history(zctx, nats_sub, nats_server, vllm_frames):
    frames, _ = vllm_frames
    engine = zctx()
    for f in frames[:3]:
        await engine.send(*f, drop=True)  # published before anyone listened
    col = await nats_sub("kv.events.m-relay.w-late")
    async with Relay(relay_config(nats_server, "w-late"), endpoint=engine.endpoint,
                     replay_endpoint=engine.replay_endpoint) as relay:
        await engine.wait_subscribed()
        for f in frames[3:]:
            await engine.send(*f)
        await wait_until(lambda: len(col.msgs) == len(frames), WAIT, "history and live frames on NATS")
    assert [m.data for m in col.msgs] == [p for _, _, p in frames]
    assert relay.stats["replayed"] == 3


async def test_an_unrecoverable_gap_is_a_hole_and_consumers_converge_on_the_relays_view(
    zctx, nats_sub, nats_server, vllm_frames
):
    frames, _ = vllm_frames
    engine = zctx(replay=False)
    col = await nats_sub("kv.events.m-relay.w-hole")
    cfg = relay_config(nats_server, "w-hole")
    async with Relay(cfg, endpoint=engine.endpoint) as relay:
        async with KvEventSubscriber(cfg, model="m-relay", worker="w-hole") as sub:
            await engine.wait_subscribed()
            for topic, seq, payload in frames:
                await engine.send(topic, seq, payload, drop=seq == 1)
            await wait_until(lambda: col.msgs and col.msgs[-1].data == frames[-1][2], WAIT, "the last frame on NATS")
            expected = hashes_after([p for _, s, p in frames if s != 1])
            key = ("m-relay", "w-hole")
            await wait_until(
                lambda: sub.in_sync() and key in sub.views and sub.views[key].blocks == expected
                and sub.views[key].seq == int(col.msgs[-1].headers[HDR_SEQ]),
                WAIT, "the subscriber's view to equal the relay's",
            )  # fmt: skip
            assert relay_hashes(relay) == expected
    assert_one_hole(col, [frames[0][2]], [p for _, _, p in frames[2:]])
    assert relay.stats["lost_batches"] == 1


async def test_a_late_nats_subscriber_converges_through_the_relays_snapshot(zctx, nats_sub, nats_server, vllm_frames):
    frames, _ = vllm_frames
    engine = zctx()
    col = await nats_sub("kv.events.m-relay.w-snap")
    cfg = relay_config(nats_server, "w-snap")
    async with Relay(cfg, endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint) as relay:
        await engine.wait_subscribed()
        for f in frames[:5]:
            await engine.send(*f)
        await wait_until(lambda: len(col.msgs) == 5, WAIT, "the frames on NATS")
        expected = hashes_after([p for _, _, p in frames[:5]])
        assert expected and relay_hashes(relay) == expected
        key = ("m-relay", "w-snap")
        # A request timeout far above any load-induced delay: one snapshot is what is asserted,
        # and a retried request on a busy machine would be a second one.
        late_cfg = cfg.replace(request_timeout_s=WAIT)
        async with KvEventSubscriber(late_cfg, model="m-relay", worker="w-snap") as sub:
            await engine.send(*frames[5])  # a live message makes the late subscriber ask for a snapshot
            await wait_until(lambda: sub.in_sync() and key in sub.views and sub.views[key].seq == 5, WAIT,
                             "the late subscriber to sync")
            assert sub.views[key].blocks == expected
            assert sub.stats["snapshots"] == 1
            assert relay.publisher.stats["snapshots"] == 1


async def test_malformed_frames_are_counted_and_skipped(zctx, nats_sub, nats_server, vllm_frames):
    frames, _ = vllm_frames
    engine = zctx()
    col = await nats_sub("kv.events.m-relay.w-bad")
    async with Relay(relay_config(nats_server, "w-bad"), endpoint=engine.endpoint,
                     replay_endpoint=engine.replay_endpoint) as relay:
        await engine.wait_subscribed()
        topic = frames[0][0]
        await engine.pub.send_multipart([topic, b"\x00\x01", frames[0][2]])  # seq not 8 bytes
        await engine.pub.send_multipart([topic, frames[0][2]])  # no seq frame
        await engine.send(*frames[0])
        await engine.send(topic, 1, b"\xc1 not msgpack")  # a seq whose batch cannot be read
        for f in frames[2:]:
            await engine.send(*f)
        await wait_until(lambda: col.msgs and col.msgs[-1].data == frames[-1][2], WAIT, "the last frame on NATS")
        assert not relay._task.done()
    assert relay.stats["malformed"] == 3
    assert relay.stats["lost_batches"] == 1  # the unreadable batch: a hole, not a replay that fails the same way
    assert relay.stats["replay_requests"] == 0
    assert set(engine.replay_requests) <= {len(frames)}  # at most an idle probe after the last frame
    assert_one_hole(col, [frames[0][2]], [p for _, _, p in frames[2:]])


async def test_an_engine_restart_starts_a_new_epoch(zctx, nats_sub, nats_server, vllm_frames):
    frames, _ = vllm_frames
    engine = zctx()
    col = await nats_sub("kv.events.m-relay.w-epoch")
    cfg = relay_config(nats_server, "w-epoch")
    key = ("m-relay", "w-epoch")
    async with Relay(cfg, endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint) as relay:
        async with KvEventSubscriber(cfg, model="m-relay", worker="w-epoch") as sub:
            await engine.wait_subscribed()
            for f in frames:
                await engine.send(*f)
            await wait_until(lambda: len(col.msgs) == len(frames), WAIT, "the first incarnation on NATS")
            first_epoch = relay.publisher.epoch
            engine.restart()
            for f in frames[:3]:  # the engine counts from 0 again
                await engine.send(*f)
            await wait_until(lambda: len(col.msgs) == len(frames) + 3, WAIT, "the second incarnation on NATS")
            second_epoch = relay.publisher.epoch
            expected = hashes_after([p for _, _, p in frames[:3]])
            await wait_until(lambda: sub.in_sync() and key in sub.views and sub.views[key].epoch == second_epoch
                             and sub.views[key].blocks == expected, WAIT, "the subscriber to follow the restart")
    assert second_epoch != first_epoch
    assert [m.headers[HDR_EPOCH] for m in col.msgs] == [first_epoch] * len(frames) + [second_epoch] * 3
    assert col.seqs() == list(range(len(frames))) + [0, 1, 2]
    assert relay.stats["engine_restarts"] == 1 and relay.stats["lost_batches"] == 0
    assert relay_hashes(relay) == expected


async def test_an_engine_restart_while_nats_is_down_waits_for_nats(zctx, own_nats_server, vllm_frames):
    """The engine restarts while the broker is dead: the new epoch's publisher cannot connect, so
    the relay retries (counted) instead of ending, and once NATS is back the new incarnation's
    batches reach a subscriber, its view equal to the engine's cache."""
    frames, _ = vllm_frames
    server = own_nats_server
    engine = zctx()
    cfg = relay_config(server, "w-down", connect_timeout_s=0.5, max_reconnect_attempts=-1, reconnect_wait_s=0.1)
    key = ("m-relay", "w-down")
    async with Relay(cfg, endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint) as relay:
        await engine.wait_subscribed()
        for f in frames:
            await engine.send(*f)
        await wait_until(lambda: relay.stats["forwarded"] == len(frames), WAIT, "the first incarnation relayed")
        first_epoch = relay.publisher.epoch
        server.kill()
        assert not server.running  # kill -9: the broker is gone
        engine.restart()
        for f in frames[:3]:  # the engine counts from 0 again
            await engine.send(*f)
        await wait_until(lambda: relay.stats["epoch_start_failures"] >= 2, WAIT, "the new epoch waiting for NATS")
        assert relay.stats["engine_restarts"] == 1 and not relay._task.done()
        server.start()
        async with KvEventSubscriber(cfg, model="m-relay", worker="w-down") as sub:
            expected = hashes_after([p for _, _, p in frames[:3]])
            await wait_until(lambda: key in sub.views and sub.views[key].epoch not in (None, first_epoch)
                             and sub.views[key].blocks == expected, WAIT, "the new incarnation on NATS")  # fmt: skip
        assert relay.publisher.epoch != first_epoch and relay.stats["lost_batches"] == 0
        assert relay_hashes(relay) == expected


# --- payloads unchanged ------------------------------------------------------------------------------

TOPIC = b"kv@127.0.0.1@model-x"


def vllm_payloads() -> list[bytes]:
    """Batches as vLLM 0.33 writes them, larger than the publisher's own batch limit (1024 events):
    vLLM writes one BlockRemoved per evicted block, so a long prefill makes such batches."""
    stored = VllmBlockStored(list(range(1, 65)), None, list(range(64 * 16)), 16, None, "GPU", None)
    removals = [VllmBlockRemoved([h], "GPU") for h in range(10_000, 16_500)]
    lookahead = VllmBlockStored(
        [2**63 + 5, 2**64 - 1], 64, list(range(32)), 16, None, "GPU", None, [None, ("lora-a",)],
        session_id="s-1", lookahead_token_ids=[[70_000, 1], [2]],
    )  # fmt: skip
    return [
        msgspec.msgpack.encode(VllmBatch(1.0, [stored, *removals[:1500]], 0)),  # 1 stored + 1500 removed
        msgspec.msgpack.encode(VllmBatch(2.0, removals[1500:], 0)),  # 5000 removals
        msgspec.msgpack.encode(VllmBatch(3.0, [lookahead], 0)),
    ]


def sglang_payloads() -> list[bytes]:
    """Batches as SGLang 0.5 writes them: the batch's rank written even when None, ``medium`` left
    out when None, ``cache_salt``/``session_id``/``lora_name`` where SGLang puts them."""
    return [
        msgspec.msgpack.encode(SglBatch(1.0, [SglBlockStored([1, 2], None, list(range(8)), 4, None)])),
        msgspec.msgpack.encode(SglBatch(2.0, [
            SglBlockStored([3], 2, [8, 9, 10, 11], 4, 7, "GPU", cache_salt="salt", session_id="s", lora_name="l"),
            SglBlockStored([4], None, [1, 2, 3, 4], 4, None, "CPU_PINNED", cache_salt="x"),
            SglBlockRemoved([1]),
            SglBlockRemoved([4], "CPU_PINNED"),
        ], 1)),  # fmt: skip
        msgspec.msgpack.encode(SglBatch(3.0, [SglAllBlocksCleared(), SglBlockStored([5], None, [0] * 4, 4, None)], 0)),
        msgspec.msgpack.encode(SglBatch(4.0, [*(SglBlockRemoved([h]) for h in range(100, 2100))], 0)),
    ]


@pytest.mark.parametrize("engine_shape", ["vllm", "sglang"])
async def test_each_engine_batch_is_one_nats_message_byte_identical(zctx, nats_sub, nats_server, engine_shape):
    payloads = vllm_payloads() if engine_shape == "vllm" else sglang_payloads()
    engine = zctx()
    worker = f"w-same-{engine_shape}"
    col = await nats_sub(f"kv.events.m-relay.{worker}")
    async with Relay(relay_config(nats_server, worker), endpoint=engine.endpoint,
                     replay_endpoint=engine.replay_endpoint) as relay:
        await engine.wait_subscribed()
        for seq, payload in enumerate(payloads):
            await engine.send(TOPIC, seq, payload)
        await wait_until(lambda: len(col.msgs) >= len(payloads), WAIT, "the batches on NATS")
        expected = hashes_after(payloads)
        assert relay_hashes(relay) == expected
    assert [m.data for m in col.msgs] == payloads  # one message per engine batch, the engine's bytes
    assert col.seqs() == list(range(len(payloads)))
    assert relay.stats["split_batches"] == 0 and relay.stats["lost_batches"] == 0
    if engine_shape == "vllm":
        got = decode_batch(col.msgs[2].data).events[0]
        assert got.lookahead_token_ids == [[70_000, 1], [2]] and got.session_id == "s-1"


async def test_a_batch_the_view_cannot_read_is_still_forwarded_and_counted(zctx, nats_sub, nats_server):
    # An extra key nested 40 deep: msgspec decodes it, the view's reader stops at 32 levels.
    deep: tuple = ("x",)
    for _ in range(40):
        deep = (deep,)
    payloads = [
        msgspec.msgpack.encode(VllmBatch(1.0, [VllmBlockStored([1], None, [0] * 4, 4, None, "GPU", None)], 0)),
        msgspec.msgpack.encode(VllmBatch(2.0, [VllmBlockStored([2], 1, [0] * 4, 4, None, "GPU", None, [deep])], 0)),
        msgspec.msgpack.encode(VllmBatch(3.0, [VllmBlockStored([3], 1, [0] * 4, 4, None, "GPU", None)], 0)),
    ]
    assert decode_batch(payloads[1]).events[0].extra_keys is not None  # consumers can read it
    engine = zctx()
    col = await nats_sub("kv.events.m-relay.w-deep")
    async with Relay(relay_config(nats_server, "w-deep"), endpoint=engine.endpoint) as relay:
        await engine.wait_subscribed()
        for seq, payload in enumerate(payloads):
            await engine.send(TOPIC, seq, payload)
        await wait_until(lambda: len(col.msgs) >= len(payloads), WAIT, "the batches on NATS")
        assert relay_hashes(relay) == {1, 3}  # the unreadable batch is left out of the view only
        assert relay.stats["view_unread_batches"] == 1 and relay.stats["malformed"] == 0
    assert [m.data for m in col.msgs] == payloads


async def test_a_batch_over_max_payload_is_split_and_counted(zctx, tmp_path):
    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 65536\n")
    removals = [VllmBlockRemoved([h], "GPU") for h in range(1, 6001)]  # ~160 KB of msgpack
    big = msgspec.msgpack.encode(VllmBatch(1.0, removals, 0))
    small = msgspec.msgpack.encode(VllmBatch(2.0, [VllmBlockStored([7], None, [1] * 4, 4, None, "GPU", None)], 0))
    engine = zctx()
    with NatsServer(config_file=str(conf)) as server:
        nc = await nats_connect(server.url)
        col = Collector()
        try:
            await nc.subscribe("kv.events.m-relay.w-split", cb=col.on_msg)
            await nc.flush()
            assert nc.max_payload == 65536
            async with Relay(relay_config(server, "w-split"), endpoint=engine.endpoint) as relay:
                await engine.wait_subscribed()
                await engine.send(TOPIC, 0, big)
                await engine.send(TOPIC, 1, small)
                await wait_until(lambda: col.msgs and col.msgs[-1].data == small, WAIT, "both batches on NATS")
        finally:
            await nc.close()
    parts = [decode_batch(m.data) for m in col.msgs[:-1]]
    assert len(parts) > 1 and all(len(m.data) <= 65536 for m in col.msgs)
    assert [ev for p in parts for ev in p.events] == decode_batch(big).events  # in order, nothing lost
    assert col.seqs() == list(range(len(col.msgs)))
    assert relay.stats["split_batches"] == 1 and relay.stats["lost_batches"] == 0


async def test_hybrid_frames_a_late_subscriber_gets_every_group_from_the_relays_snapshot(zctx, nats_sub, nats_server):
    """An engine with three KV-cache groups and two media (copies, re-announces, evictions in one
    group only): its frames go out byte-identical, and a subscriber that joins late rebuilds, from
    the relay's snapshot, the engine's residency per (medium, group)."""
    stream = Stream(random.Random(7), n_groups=3)
    payloads = [encode_batch(KVEventBatch(float(i), events, 0)) for i, events in enumerate(stream.batches(120))]
    held, kinds = stream.model.residency(), stream.model.kinds
    assert len({g for _, g in held}) == 3 and any(c > 1 for blocks in held.values() for c in blocks.values())
    engine = zctx()
    col = await nats_sub("kv.events.m-relay.w-hybrid")
    cfg = relay_config(nats_server, "w-hybrid")
    key = ("m-relay", "w-hybrid")
    async with Relay(cfg, endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint) as relay:
        await engine.wait_subscribed()
        for seq, payload in enumerate(payloads[:-1]):
            await engine.send(TOPIC, seq, payload)
        await wait_until(lambda: len(col.msgs) == len(payloads) - 1, WAIT, "the frames on NATS")
        async with KvEventSubscriber(cfg.replace(request_timeout_s=WAIT), model="m-relay", worker="w-hybrid") as sub:
            await engine.send(TOPIC, len(payloads) - 1, payloads[-1])  # a live message: the late subscriber asks
            await wait_until(lambda: sub.in_sync() and key in sub.views and sub.views[key].seq == len(payloads) - 1,
                             WAIT, "the late subscriber to sync")  # fmt: skip
            view = sub.views[key]
            assert (view.held, view.residency.kinds) == (held, kinds)
            assert sub.stats["snapshots"] == 1 and relay.publisher.stats["snapshots"] == 1
        assert (relay.view.residency.held, relay.view.residency.kinds) == (held, kinds)
        assert relay.stats["view_skipped_events"] > 0  # the stream's bad events, counted and skipped
    assert [m.data for m in col.msgs] == payloads


# --- a quiet tail --------------------------------------------------------------------------------------


async def test_a_tail_dropped_before_the_engine_goes_idle_is_fetched_by_the_idle_probe(
    zctx, nats_sub, nats_server, vllm_frames
):
    frames, _ = vllm_frames
    n = len(frames)
    engine = zctx()
    col = await nats_sub("kv.events.m-relay.w-tail")
    async with Relay(relay_config(nats_server, "w-tail"), endpoint=engine.endpoint,
                     replay_endpoint=engine.replay_endpoint) as relay:
        await engine.wait_subscribed()
        for topic, seq, payload in frames:
            await engine.send(topic, seq, payload, drop=seq >= n - 2)  # the burst's end, dropped; then idle
        await wait_until(lambda: len(col.msgs) == n, WAIT, "the dropped tail on NATS, with no new engine frame")
        assert n - 2 in engine.replay_requests
        # One probe per quiet spell: the next comes only after a new frame and a new quiet spell.
        await engine.send(frames[0][0], n, frames[-1][2])
        await wait_until(lambda: n + 1 in engine.replay_requests, WAIT, "a probe after the next quiet spell")
        assert engine.replay_requests == [n - 2, n + 1]
    assert [m.data for m in col.msgs] == [p for _, _, p in frames] + [frames[-1][2]]
    assert col.seqs() == list(range(n + 1))
    assert relay.stats["replay_requests"] == 0  # no gap ever showed: the probes fetched the tail
    assert relay.stats["idle_probes"] == 2 and relay.stats["replayed"] == 2 and relay.stats["lost_batches"] == 0


async def test_a_live_twin_of_a_probed_batch_is_skipped_not_taken_for_a_restart(
    zctx, nats_sub, nats_server, vllm_frames
):
    frames, _ = vllm_frames
    n = len(frames)
    engine = zctx()
    col = await nats_sub("kv.events.m-relay.w-twin")
    async with Relay(relay_config(nats_server, "w-twin"), endpoint=engine.endpoint,
                     replay_endpoint=engine.replay_endpoint) as relay:
        await engine.wait_subscribed()
        for topic, seq, payload in frames:
            await engine.send(topic, seq, payload, drop=seq == n - 1)
        await wait_until(lambda: len(col.msgs) == n, WAIT, "the probed last batch on NATS")
        # The same frame arrives late on the PUB socket (it was only delayed), then the next one.
        await engine.pub.send_multipart([frames[-1][0], (n - 1).to_bytes(8, "big"), frames[-1][2]])
        await engine.send(frames[0][0], n, frames[0][2])
        await wait_until(lambda: len(col.msgs) == n + 1, WAIT, "the next batch on NATS")
        epoch = relay.publisher.epoch
    assert [m.data for m in col.msgs] == [p for _, _, p in frames] + [frames[0][2]]
    assert [m.headers[HDR_EPOCH] for m in col.msgs] == [epoch] * (n + 1)
    assert relay.stats["duplicates"] == 1 and relay.stats["engine_restarts"] == 0


# --- the view ------------------------------------------------------------------------------------


def test_view_snapshot_puts_parents_first_and_keeps_chains_whole():
    view = RelayView()
    chain = BlockStored([1, 2, 3], None, list(range(12)), 4, None, "GPU", None, [("a",), None, ("c",)])
    view.apply([chain, BlockRemoved([1], "GPU")])
    view.apply([BlockStored([1], None, list(range(4)), 4, None, "GPU", None)])  # parent stored again, after its child
    view.apply([BlockStored([9], None, [7] * 4, 4, None, "CPU", None), BlockRemoved([3], "CPU")])  # other medium
    snap = view.snapshot()
    assert [(ev.block_hashes, ev.parent_block_hash, ev.medium) for ev in snap] == [
        ([1], None, "GPU"), ([2, 3], 1, "GPU"), ([9], None, "CPU"),
    ]  # fmt: skip
    assert snap[1].token_ids == list(range(4, 12)) and snap[1].extra_keys == [None, ("c",)]
    replayed = RelayView()
    replayed.apply(snap)
    assert replayed.residency == view.residency
    view.apply([AllBlocksCleared()])
    assert view.snapshot() == [] and view.take_events() == []


def test_view_snapshot_slices_lookahead_token_ids_per_block():
    view = RelayView()
    view.apply([BlockStored([1, 2, 3], None, list(range(12)), 4, None, "GPU", None,
                            lookahead_token_ids=[[12], [13], [14]]), BlockRemoved([1], "GPU")])  # fmt: skip
    (rest,) = view.snapshot()
    assert (rest.block_hashes, rest.parent_block_hash, rest.lookahead_token_ids) == ([2, 3], 1, [[13], [14]])


# --- the command line ------------------------------------------------------------------------------


def test_help_lists_relay_and_its_options():
    parser = build_parser()
    assert "relay" in parser.format_help()
    args = parser.parse_args(["relay", "--endpoint", "tcp://127.0.0.1:5557", "--replay-endpoint", "tcp://127.0.0.1:5558",
                              "--topic", "kv", "--model", "M", "--worker", "W"])
    assert (args.endpoint, args.replay_endpoint, args.topic, args.model, args.worker) == (
        "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv", "M", "W")


async def test_cli_relays_and_exits_cleanly_on_sigterm(zctx, nats_sub, nats_server, vllm_frames):
    frames, _ = vllm_frames
    engine = zctx()
    col = await nats_sub("kv.events.M.W")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    env["KVBRIDGE_HEARTBEAT_S"] = "0"  # engine frames only, one NATS message each
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvbridge", "relay", "--endpoint", engine.endpoint, "--replay-endpoint",
        engine.replay_endpoint, "--topic", "kv", "--model", "M", "--worker", "W", "--servers", nats_server.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        await engine.wait_subscribed()
        for topic, seq, payload in frames:
            await engine.send(topic, seq, payload, drop=seq == 2)
        await wait_until(lambda: len(col.msgs) == len(frames), WAIT, "the CLI's messages on NATS")
    finally:
        err = await stop_process(proc, WAIT)
    assert proc.returncode == 0, err.decode()
    assert [m.data for m in col.msgs] == [p for _, _, p in frames]
    text = err.decode()
    assert "relaying tcp://127.0.0.1:" in text and "relay stopped" in text and "'replayed': 1" in text


def test_cli_bad_endpoint_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "kvbridge", "relay", "--endpoint", "ipc:///tmp/kv", "--dp-rank", "1"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2 and "configuration error" in proc.stderr and "dp rank" in proc.stderr


async def test_an_endpoint_zmq_refuses_is_named_as_typed_before_anything_starts():
    # The engine's bind address ("*") is rewritten to connect; the error names both, and which one.
    with pytest.raises(ConfigError, match=r"relay endpoint 'tcp://\*:notaport' \(connecting to 'tcp://127.0.0.1:notaport'\)"):
        await Relay(Config(worker_id="w"), endpoint="tcp://*:notaport").start()
    with pytest.raises(ConfigError, match=r"relay replay_endpoint 'nonsense://x'"):
        await Relay(Config(worker_id="w"), endpoint="tcp://127.0.0.1:5557", replay_endpoint="nonsense://x").start()
    with pytest.raises(ConfigError, match=r"relay replay_endpoint 'tcp://\*:0' \(connecting to 'tcp://127.0.0.1:0'\): port 0"):
        Relay(Config(worker_id="w"), endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://*:0", dp_rank=1)
    # A dp rank's offset that cannot be made names the endpoint it was asked of.
    with pytest.raises(ConfigError, match=r"relay replay_endpoint 'ipc:///tmp/kv': a dp rank offsets only"):
        Relay(Config(worker_id="w"), endpoint="tcp://127.0.0.1:5557", replay_endpoint="ipc:///tmp/kv", dp_rank=1)
    with pytest.raises(ConfigError, match=r"relay endpoint 'tcp://127.0.0.1:15557': port 15557 \+ dp rank 70000 is past 65535"):
        Relay(Config(worker_id="w"), endpoint="tcp://127.0.0.1:15557", dp_rank=70000)
