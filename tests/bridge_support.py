"""Helpers for the bridge tests: an engine thread running a random pool workload, and bounded waits."""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from typing import Any, Callable

from kvbridge.bus.subscriber import Update
from kvbridge.wire.subjects import HDR_SEQ


def pool_hashes(manager: Any) -> set:
    return {h for ev in manager.snapshot() for h in ev.block_hashes}


class Engine(threading.Thread):
    """Drives a KVCacheManager with random requests sharing prefixes, publishing every few ops.

    Pool mutations and the hand-off of their events hold ``publisher.lock`` (the threading
    contract); the hand-off itself is timed so the tests can report the slowest ``publish()`` call.
    """

    def __init__(self, publisher: Any, n_events: int, seed: int, *, num_blocks: int = 256, block_size: int = 4,
                 ops_per_step: int = 8, step_sleep: float = 0.0, manager: Any = None) -> None:
        super().__init__(name=f"engine-{seed}", daemon=True)
        from kvbridge.engine.pool import KVCacheManager

        self.publisher = publisher
        self.manager = manager or KVCacheManager(num_blocks, block_size)
        publisher.attach(self.manager)
        self.n_events = n_events
        self.rnd = random.Random(seed)
        self.block_size = block_size
        self.ops_per_step = ops_per_step
        self.step_sleep = step_sleep
        self.published = 0
        self.max_publish_s = 0.0
        self.publish_calls = 0
        self.call_times: list[float] = []
        self.error: BaseException | None = None
        self.stop_flag = threading.Event()
        # A few shared prefixes so requests hit (and evict) each other's blocks.
        self.prefixes = [[self.rnd.randrange(1000) for _ in range(block_size * 8)] for _ in range(16)]
        self.live: list[str] = []
        self.next_id = 0

    def _op(self) -> None:
        m, rnd = self.manager, self.rnd
        r = rnd.random()
        if r < 0.45 or not self.live:
            prefix = rnd.choice(self.prefixes)[: self.block_size * rnd.randrange(1, 9)]
            tail = [rnd.randrange(1000) for _ in range(rnd.randrange(0, self.block_size * 4))]
            rid = f"r{self.next_id}"
            self.next_id += 1
            if m.allocate(rid, prefix + tail) is not None:
                self.live.append(rid)
        elif r < 0.7:
            rid = rnd.choice(self.live)
            if not m.append(rid, [rnd.randrange(1000) for _ in range(rnd.randrange(1, self.block_size * 2))]):
                self.live.remove(rid)
                m.free(rid)
        elif r < 0.9995:
            rid = self.live.pop(rnd.randrange(len(self.live)))
            m.free(rid)
        else:
            for rid in self.live:
                m.free(rid)
            self.live.clear()
            m.reset()

    def step(self) -> int:
        pub = self.publisher
        # Handed over before the lock goes, as publisher.step() does: a snapshot taken between
        # take_events() and publish() already holds these events, and they would come after its
        # seq and be applied a second time (a block stored twice is two copies to an index or a
        # view, so one removal leaves it there: the index stays off the pool for good).
        with pub.lock:
            for _ in range(self.ops_per_step):
                self._op()
            events = self.manager.take_events()
            if events:
                t0 = time.perf_counter()
                pub.publish(events)
                dt = time.perf_counter() - t0
        if events:
            self.publish_calls += 1
            self.call_times.append(dt)
            if dt > self.max_publish_s:
                self.max_publish_s = dt
        return len(events)

    def publish_summary(self) -> str:
        """publish() wall time: p50 / p99 / max. The max includes GIL preemption by other threads."""
        t = sorted(self.call_times) or [0.0]
        return (f"publish() p50 {t[len(t) // 2] * 1e6:.1f} us, p99 {t[int(len(t) * 0.99)] * 1e6:.1f} us, "
                f"max {t[-1] * 1e6:.1f} us over {len(t)} calls")

    def run(self) -> None:
        try:
            while self.published < self.n_events and not self.stop_flag.is_set():
                self.published += self.step()
                if self.step_sleep:
                    time.sleep(self.step_sleep)
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def finish(self, timeout: float = 120) -> None:
        self.join(timeout)
        assert not self.is_alive(), "engine thread did not finish"
        if self.error is not None:
            raise self.error


async def wait_until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll ``cond`` until true; fail after ``timeout`` seconds naming ``what``. Returns the time waited."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)
    return time.monotonic() - start


def prefix_scores(cached: dict[str, set], hashes: list) -> dict[str, int]:
    """Brute force find_matches: per worker, how many leading ``hashes`` its cached set holds
    (workers holding none left out)."""
    out = {}
    for worker, held in cached.items():
        n = 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        if n:
            out[worker] = n
    return out


def views_match(subscriber: Any, engines: dict) -> bool:
    """engines: {(model, worker): Engine}. True when every view equals its pool and nothing resyncs."""
    if not subscriber.in_sync():
        return False
    views = subscriber.views
    for key, eng in engines.items():
        view = views.get(key)
        if view is None or view.epoch != eng.publisher.epoch:
            return False
        with eng.publisher.lock:
            expected = pool_hashes(eng.manager)
        if view.blocks != expected:
            return False
    return True


class Collector:
    """The raw event messages as `nats sub` shows them."""

    def __init__(self) -> None:
        self.msgs: list = []

    async def on_msg(self, msg: Any) -> None:
        self.msgs.append(msg)

    def seqs(self) -> list[int]:
        return [int(m.headers[HDR_SEQ]) for m in self.msgs]


class Recorder:
    """on_update callback recording (epoch, seq, reset) per worker to check order and exactly-once."""

    def __init__(self) -> None:
        self.by_worker: dict[tuple[str, str], list[tuple[str, int, bool]]] = {}

    def __call__(self, u: Update) -> None:
        self.by_worker.setdefault((u.model, u.worker), []).append((u.epoch, u.seq, u.reset))

    def check(self, key: tuple[str, str]) -> dict:
        """Asserts: after each reset, seqs run +1 without holes or repeats, within one epoch; no
        (epoch, seq) delivered twice outside a reset. Returns counts for the test output."""
        seen: set[tuple[str, int]] = set()
        prev: tuple[str, int] | None = None
        resets = 0
        for epoch, seq, reset in self.by_worker.get(key, []):
            if reset:
                resets += 1
                prev = (epoch, seq)
                continue
            assert prev is not None, f"{key}: delivery before the first snapshot"
            assert epoch == prev[0] and seq == prev[1] + 1, f"{key}: {prev} followed by {(epoch, seq)}"
            assert (epoch, seq) not in seen, f"{key}: {(epoch, seq)} delivered twice"
            seen.add((epoch, seq))
            prev = (epoch, seq)
        return {"deliveries": len(seen), "resets": resets}


async def stop_process(proc: asyncio.subprocess.Process, timeout: float) -> bytes:
    """SIGTERM a kvbridge command run as ``proc`` and wait for it to exit (killed if it does not
    within ``timeout``); its stderr (empty unless piped). Call it from a ``finally``: a failing
    test leaves no process behind either."""
    try:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
        return err or b""
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def nats_connect(*args: Any, **options: Any) -> Any:
    """A test's own NATS connection (``nats.connect``'s arguments): kvbridge's client, whose
    ``flush()`` returns only after the server read what was sent before it. nats-py's writes its
    PING ahead of a SUB still waiting for the flusher task, so a message published right after
    ``subscribe(); flush()`` could miss the subscription (kvbridge.bus.natsclient.Client.flush)."""
    from kvbridge.bus.natsclient import Client

    nc = Client()
    await nc.connect(*args, **options)
    return nc
