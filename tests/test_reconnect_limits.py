"""The server's max_payload, learnt again on every reconnect: kill -9 a broker configured with
``max_payload: 4MB`` while batches of up to 512 KiB are held, restart it on the same port with
``max_payload: 64KB``, and every held message still reaches the subscriber (re-framed within the
new limit, behind a seq hole the subscriber repairs by snapshot), and later events after them, in
order. Before the fix the publisher kept trying to send its held messages as they were: NATS
refused each one, and nothing after them went out until the ring evicted them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bridge_support import Recorder, nats_connect, pool_hashes, wait_until
from kvbridge import Config, KvEventPublisher, KvEventSubscriber, encode_batch
from kvbridge.engine.pool import KVCacheManager
from kvbridge.tools.server import NatsServer
from kvbridge.wire.events import KVEventBatch

MODEL = "m"
BIG, SMALL = 4 << 20, 64 << 10
HEADER_ROOM = 1024  # kvbridge.bus.publisher._HEADER_ROOM


def _in_sync(sub: KvEventSubscriber, pub: KvEventPublisher, manager: KVCacheManager) -> bool:
    view = sub.views.get((MODEL, pub.config.worker_id))
    if view is None or view.epoch != pub.epoch or not sub.in_sync():
        return False
    with pub.lock:
        return view.blocks == pool_hashes(manager)


def _hand_over(pub: KvEventPublisher, manager: KVCacheManager, via: str) -> int:
    """The pool's new events to the publisher: as an engine does (``step``), or as a relay does
    (``publish_payload``: the batch's msgpack bytes as they came, one message of their own)."""
    if via == "step":
        return pub.step()
    with pub.lock:
        events = manager.take_events()
        if events:
            pub.publish_payload(encode_batch(KVEventBatch(0.0, events, None)), len(events))
    return len(events)


async def _server_max_payload(url: str) -> int:
    nc = await nats_connect(url)
    try:
        return nc.max_payload
    finally:
        await nc.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("via", ["step", "publish_payload"])
async def test_held_batches_over_the_new_max_payload_after_a_restart(tmp_path: Path, via: str) -> None:
    conf = tmp_path / "server.conf"
    conf.write_text("max_payload: 4MB\n")
    with NatsServer(config_file=str(conf)) as server:
        cfg = Config(servers=server.url, model=MODEL, worker_id="w", reconnect_wait_s=0.1, heartbeat_s=0.5,
                     max_batch_bytes=512 * 1024)  # fmt: skip
        rec = Recorder()
        sub = await KvEventSubscriber(cfg, on_update=rec).start()
        pub = await KvEventPublisher(cfg).start()
        manager = KVCacheManager(num_blocks=8192, block_size=16)
        pub.attach(manager)
        try:
            assert pub.max_payload == BIG - HEADER_ROOM
            with pub.lock:
                manager.allocate("warm", list(range(64)))
            _hand_over(pub, manager, via)
            await wait_until(lambda: _in_sync(sub, pub, manager), 20, "the view before the outage")
            pid = server.proc.pid  # type: ignore[union-attr]

            await asyncio.to_thread(server.kill)
            await wait_until(lambda: not pub._nc.is_connected, 20, "the publisher to see the broker gone")
            # Held while the broker is down: batches far over the limit the broker will come back with.
            for i in range(3):
                with pub.lock:
                    assert manager.allocate(f"long{i}", [((i + 1) << 20) + t for t in range(16 * 2048)]) == 0
                _hand_over(pub, manager, via)
            await wait_until(lambda: pub.stats["queue_depth"] == 0, 20, "the hand-offs to be numbered")
            held = pub._outbox.held(pub._outbox.cursor, pub._outbox.last_seq)
            assert max(len(payload) for _, payload in held) > SMALL  # messages the new limit refuses
            errors_before = pub.stats["publish_errors"]

            conf.write_text("max_payload: 64KB\n")
            await asyncio.to_thread(server.start)
            assert server.proc is not None and server.proc.pid != pid  # the broker did restart...
            assert await _server_max_payload(server.url) == SMALL  # ...with the smaller limit
            await wait_until(lambda: pub.stats["reconnects"] >= 1, 20, "the publisher to reconnect")
            assert pub.max_payload == SMALL - HEADER_ROOM  # learnt on the reconnect
            assert pub.stats["max_payload"] == SMALL - HEADER_ROOM

            # Events after the outage: they go out after the held ones, in order.
            with pub.lock:
                manager.free("warm")
                manager.allocate("after", list(range(1000, 1200)))
            _hand_over(pub, manager, via)
            await wait_until(lambda: _in_sync(sub, pub, manager), 30, "the view after the restart")
            stats = pub.stats
            assert stats["refitted"] >= 1  # the held messages over 64 KiB were re-framed...
            assert stats["unsent"] == 0 and stats["oversize_dropped"] == 0  # ...and all sent, none lost
            assert stats["publish_errors"] - errors_before <= 1  # not retried as they were
            assert sub.stats["gaps"] >= 1 and sub.stats["snapshots"] >= 2  # the hole seen, repaired
            counts = rec.check((MODEL, "w"))  # after each reset, seqs +1, nothing twice
            assert counts["resets"] >= 2
        finally:
            await pub.close()
            await sub.close()


# -- the rules of the refit, without a broker ---------------------------------------------------------


class _Limit:
    """Stands in for the connection: what the publisher reads of it here (the server's max_payload,
    and link_failures for its stats)."""

    link_failures = 0

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload


def _stored(i: int, n_blocks: int):
    from kvbridge.wire.events import BlockStored

    return BlockStored([(i << 20) + b for b in range(n_blocks)], None, list(range(16 * n_blocks)), 16, None, "GPU",
                       None)  # fmt: skip


def _events_in(outbox, fmt: str) -> list:
    from kvbridge import decode_batch

    return [ev for _, payload in outbox.held(outbox.first, outbox.last_seq) for ev in decode_batch(payload, fmt).events]


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
def test_unsent_messages_over_a_smaller_limit_go_behind_a_hole_re_framed(encoding: str) -> None:
    pub = KvEventPublisher(Config(model=MODEL, worker_id="u", encoding=encoding, max_batch_bytes=512 * 1024))
    pub._nc = _Limit(BIG)
    pub._learn_max_payload(at_start=True)
    assert pub.max_payload == BIG - HEADER_ROOM and pub.stats["max_payload_changes"] == 0  # start: no change
    ob = pub._outbox
    events = [_stored(i, n) for i, n in enumerate((4, 1500, 8, 1500))]
    for ev in events:
        pub._emit(1.0, [ev])
    ob.sent(0)  # the first went out before the broker died; the others are held
    sizes = [len(p) for _, p in ob.held(0, 3)]
    assert sizes[1] > SMALL and sizes[3] > SMALL and sizes[2] < SMALL

    pub._nc = _Limit(SMALL)
    pub._learn_max_payload()
    stats = pub.stats
    assert stats["max_payload"] == SMALL - HEADER_ROOM and stats["max_payload_changes"] == 1
    assert stats["refitted"] == 2 and stats["evicted_unsent"] == 0 and stats["oversize_dropped"] == 0
    assert ob.first == ob.cursor == 5  # seq 4 is the hole; nothing before it is held any more
    assert all(len(p) <= SMALL - HEADER_ROOM for _, p in ob.held(ob.first, ob.last_seq))
    held = _events_in(ob, encoding)
    # The unsent events, in order, whole again once each sliced chain is joined up.
    joined = [h for ev in held for h in ev.block_hashes]
    assert joined == [h for ev in events[1:] for h in ev.block_hashes]
    assert len(held) > 3  # the two large ones went in slices


def test_sent_messages_over_a_smaller_limit_are_let_go_without_a_hole() -> None:
    pub = KvEventPublisher(Config(model=MODEL, worker_id="s", max_batch_bytes=512 * 1024))
    pub._nc = _Limit(BIG)
    pub._learn_max_payload(at_start=True)
    ob = pub._outbox
    for i, n in enumerate((1500, 4, 1500, 4)):
        pub._emit(1.0, [_stored(i, n)])
        ob.sent(i)
    pub._emit(1.0, [_stored(9, 4)])  # held, unsent, small
    pub._nc = _Limit(SMALL)
    pub._learn_max_payload()
    # Replay can no longer send seqs 0..2 (2 is over the limit): they are gone; 3 and 4 are kept,
    # with their seqs, and no hole: every consumer already had them, or can replay them.
    assert (ob.first, ob.end, ob.cursor) == (3, 5, 4)
    assert pub.stats["refitted"] == 0 and pub.stats["evicted_unsent"] == 0


def test_a_larger_limit_changes_nothing_held() -> None:
    pub = KvEventPublisher(Config(model=MODEL, worker_id="l"))
    pub._nc = _Limit(SMALL)
    pub._learn_max_payload(at_start=True)
    pub._emit(1.0, [_stored(1, 4)])
    before = pub._outbox.held(0, 0)
    pub._nc = _Limit(BIG)
    pub._learn_max_payload()
    assert pub._outbox.held(0, 0) == before and pub.max_payload == BIG - HEADER_ROOM
    assert pub.stats["max_payload_changes"] == 1 and pub.stats["refitted"] == 0
