"""The index service over a real nats-server: scores equal brute force over the workers' pools,
JSON and msgpack, malformed queries answered with errors, and replicas in a queue group."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sys

import msgspec
import pytest
from prometheus_client import REGISTRY, generate_latest

from bridge_support import nats_connect, pool_hashes, prefix_scores, stop_process
from kvbridge import Config, Index, KvEventPublisher, hash_blocks
from kvbridge.engine.pool import KVCacheManager
from kvbridge.routing.service import IndexClient, IndexQueryError, IndexService, IndexUnavailableError
from kvbridge.wire.subjects import query_subject


BS = 16
LORA = "ad-1"


def cfg(server, model, worker="w0", **kw) -> Config:
    return Config(servers=server.url, model=model, worker_id=worker, reconnect_wait_s=0.2, heartbeat_s=0.5, **kw)


def _tokens(rng, n):
    return [rng.randrange(50_000) for _ in range(n)]


class Fleet:
    """Three workers (pools publishing through KvEventPublisher) filled with requests sharing a few
    system prompts, some under a LoRA; small pools so blocks are evicted too. Then idle."""

    def __init__(self, server, model, seed=0):
        self.server, self.model = server, model
        self.rng = random.Random(seed)
        self.system = [_tokens(self.rng, self.rng.randrange(3, 10) * BS + 5) for _ in range(4)]
        self.managers = {f"w{i}": KVCacheManager(48, BS) for i in range(3)}
        self.publishers: dict[str, KvEventPublisher] = {}
        self.prompts: list[tuple[list[int], str | None]] = []

    async def start(self):
        for name, manager in self.managers.items():
            pub = await KvEventPublisher(cfg(self.server, self.model, name)).start()
            pub.attach(manager)
            self.publishers[name] = pub
        rng = self.rng
        for i in range(60):
            name = rng.choice(list(self.managers))
            manager, pub = self.managers[name], self.publishers[name]
            lora = LORA if rng.random() < 0.25 else None
            prompt = rng.choice(self.system) + _tokens(rng, rng.randrange(0, 4 * BS))
            with pub.lock:
                if manager.allocate(f"r{i}", prompt, lora_name=lora) is not None:
                    manager.append(f"r{i}", _tokens(rng, rng.randrange(1, 2 * BS)))
                    manager.free(f"r{i}")
            pub.step()
            self.prompts.append((prompt, lora))
        # probes: what was sent, its system prompt alone, the other LoRA, and nobody's prompt
        self.probes = [(p, lo) for p, lo in self.prompts[-20:]] + [(s, None) for s in self.system]
        self.probes += [(p, LORA if lo is None else None) for p, lo in self.prompts[-6:]] + [(_tokens(rng, 70), None)]
        return self

    def expected(self, tokens, lora=None, without=()) -> dict[str, int]:
        """Brute force: per worker, how many leading blocks of ``tokens`` its pool holds."""
        cached = {}
        for name, manager in self.managers.items():
            if name not in without:
                with self.publishers[name].lock:
                    cached[name] = pool_hashes(manager)
        return prefix_scores(cached, self.block_hashes(tokens, lora))

    def block_hashes(self, tokens, lora=None):
        n = len(tokens) // BS
        return hash_blocks(tokens, BS, extra_keys=[(lora,)] * n if lora else None)

    async def close(self):
        for pub in self.publishers.values():
            await pub.close()


async def _all_correct(client: IndexClient, fleet: Fleet) -> bool:
    for tokens, lora in fleet.probes:
        if await client.find_matches(tokens, lora_name=lora) != fleet.expected(tokens, lora):
            return False
    return True


async def _eventually(check, what: str, timeout: float = 30) -> None:
    """Await ``check()`` until it is true; fail after ``timeout`` seconds naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        assert loop.time() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.1)


async def _eventually_correct(client, fleet, what="the service's scores == brute force"):
    await _eventually(lambda: _all_correct(client, fleet), what)


@pytest.mark.timeout(120)
async def test_scores_over_nats_equal_brute_force_json_and_msgpack(nats_server):
    model = "svc-scores"
    fleet = await Fleet(nats_server, model, seed=1).start()
    service = await IndexService(cfg(nats_server, model, "svc"), index=Index(BS)).start()
    try:
        async with IndexClient(cfg(nats_server, model, "client"), timeout=5) as client:
            await _eventually_correct(client, fleet)
            assert client.workers == 3
            assert any(len(fleet.expected(p, lo)) >= 2 for p, lo in fleet.probes), "no prefix shared by two workers"
            assert any(fleet.expected(p, LORA) for p, lo in fleet.probes if lo == LORA), "no LoRA hit"
        # JSON without a Content-Type (what `nats req` sends), and msgpack with one, on the raw subject
        nc = await nats_connect(nats_server.url)
        try:
            subject = query_subject("kv", model)
            assert subject == f"kv.query.{model}"
            for tokens, lora in fleet.probes:
                want = {"scores": fleet.expected(tokens, lora), "workers": 3}
                body = {"tokens": tokens} | ({"lora_name": lora} if lora else {})
                msg = await nc.request(subject, json.dumps(body).encode(), timeout=5)
                assert msg.headers["Content-Type"] == "application/json"
                assert json.loads(msg.data) == want
                msg = await nc.request(
                    subject, msgspec.msgpack.encode(body), timeout=5, headers={"Content-Type": "application/msgpack"}
                )
                assert msg.headers["Content-Type"] == "application/msgpack"
                assert msgspec.msgpack.decode(msg.data) == want
        finally:
            await nc.close()
        stats = service.stats
        assert stats["workers"] == 3 and stats["blocks"] > 0 and stats["errors"] == 0
        assert stats["queries"] >= 3 * len(fleet.probes)
        text = generate_latest(REGISTRY).decode()
        assert f'kvbridge_index_queries_total{{subject="kv.query.{model}"}} {float(stats["queries"])}' in text
        assert f'kvbridge_index_query_seconds_count{{subject="kv.query.{model}"}} {float(stats["queries"])}' in text
        assert f'kvbridge_index_workers{{subject="kv.query.{model}"}} 3.0' in text
    finally:
        await service.close()
        await fleet.close()


@pytest.mark.timeout(120)
async def test_block_hash_queries_on_an_engine_keyed_index(nats_server):
    model = "svc-engine"
    fleet = await Fleet(nats_server, model, seed=2).start()
    service = IndexService(cfg(nats_server, model, "svc"), index=Index(BS, key="engine"))
    async with service, IndexClient(cfg(nats_server, model, "client"), timeout=5) as client:

        async def correct():
            for tokens, lora in fleet.probes:
                got = await client.find_matches(block_hashes=fleet.block_hashes(tokens, lora))
                if got != fleet.expected(tokens, lora):
                    return False
            return True

        await _eventually(correct, "engine-keyed scores == brute force")
        assert sum(bool(fleet.expected(t, lo)) for t, lo in fleet.probes) >= 10
    await fleet.close()


MSGPACK = {"Content-Type": "application/msgpack"}


@pytest.mark.timeout(120)
async def test_malformed_queries_get_errors_and_the_service_carries_on(nats_server):
    model = "svc-bad"
    fleet = await Fleet(nats_server, model, seed=3).start()
    service = await IndexService(cfg(nats_server, model, "svc"), index=Index(BS)).start()
    nc = await nats_connect(nats_server.url)
    subject = query_subject("kv", model)
    good_tokens, good_lora = fleet.probes[0]
    try:
        async with IndexClient(cfg(nats_server, model, "client"), timeout=5) as client:
            await _eventually_correct(client, fleet)
            bad = [
                (b"not json at all", None, "malformed query: not json"),
                (b'{"tokens": "abc"}', None, "Expected `array | null`, got `str` - at `$.tokens`"),
                (b'{"tokens": [1, 2, "x"]}', None, "Expected `int`, got `str` - at `$.tokens[2]`"),
                (b'{"tokens": [1, 4294967296]}', None, "Expected `int` <= 4294967295 - at `$.tokens[1]`"),
                (b'{"tokens": [1, -1]}', None, "Expected `int` >= 0 - at `$.tokens[1]`"),
                (b'{"tokens": [1], "block_hashes": [2]}', None, "exactly one of 'tokens' and 'block_hashes'"),
                (b"{}", None, "exactly one of 'tokens' and 'block_hashes'"),
                (b"[1, 2, 3]", None, "Expected `object`, got `array`"),
                (b'{"tokens": [1], "colour": "red"}', None, "unknown field `colour`"),
                (b'{"tokens": [1], "lora_name": 5}', None, "Expected `str | null`, got `int` - at `$.lora_name`"),
                (b"\xc1\xff", {"Content-Type": "application/msgpack"}, "malformed query: not msgpack"),
                # msgpack's ints are read natively: the same words as msgspec's
                (msgspec.msgpack.encode({"tokens": [1, 2**32]}), MSGPACK, "Expected `int` <= 4294967295 - at `$.tokens[1]`"),
                (msgspec.msgpack.encode({"tokens": "abc"}), MSGPACK, "Expected `array | null`, got `str` - at `$.tokens`"),
                (msgspec.msgpack.encode({"block_hashes": [1, -1]}), MSGPACK, "Expected `int` >= 0 - at `$.block_hashes[1]`"),
                (msgspec.msgpack.encode({"block_hashes": [1.5]}), MSGPACK, "Expected `int`, got `float` - at `$.block_hashes[0]`"),
                (msgspec.msgpack.encode({"tokens": [1], "colour": 1}), MSGPACK, "unknown field `colour`"),
                (b'{"tokens": [1]}', {"Content-Type": "text/plain"}, "unknown Content-Type 'text/plain'"),
            ]
            for payload, headers, why in bad:
                msg = await nc.request(subject, payload, timeout=5, headers=headers)
                fmt = "msgpack" if msg.headers["Content-Type"] == "application/msgpack" else "json"
                reply = msgspec.msgpack.decode(msg.data) if fmt == "msgpack" else json.loads(msg.data)
                assert list(reply) == ["error"] and why in reply["error"], (payload, reply)
                # ... and the next good query is answered as before
                assert await client.find_matches(good_tokens, lora_name=good_lora) == fleet.expected(good_tokens, good_lora)
            assert service.stats["errors"] == len(bad)
            with pytest.raises(IndexQueryError, match=r"index service on kv\.query\.svc-bad: .*tokens\[0\]"):
                await client.find_matches([2**32])
            with pytest.raises(ValueError, match="exactly one of tokens and block_hashes"):
                await client.find_matches()
            assert await _all_correct(client, fleet)
    finally:
        await nc.close()
        await service.close()
        await fleet.close()


@pytest.mark.timeout(60)
async def test_client_retries_once_when_a_replica_dies_with_the_query(nats_server):
    """The only replica takes the first query and dies without answering; the client's retry
    reaches the replica that replaced it."""
    model = "svc-retry"
    fleet = await Fleet(nats_server, model, seed=4).start()
    subject = query_subject("kv", model)
    nc = await nats_connect(nats_server.url)
    started: list[IndexService] = []
    taken = asyncio.Event()

    async def replace():
        started.append(await IndexService(cfg(nats_server, model, "svc"), index=Index(BS)).start())

    async def dying_replica(msg):
        taken.set()
        # (unsubscribing ends this callback's task: the replacement starts in a task of its own)
        replacing.append(asyncio.create_task(replace()))
        await sub.unsubscribe()

    replacing: list[asyncio.Task] = []

    sub = await nc.subscribe(subject, queue="kvbridge-index", cb=dying_replica)
    await nc.flush()
    tokens, lora = fleet.probes[0]
    try:
        async with IndexClient(cfg(nats_server, model, "client"), timeout=3) as client:
            first = await client.find_matches(tokens, lora_name=lora)
            assert taken.is_set() and client.stats["retries"] == 1
            assert client.stats["failures"] == 0
            # the new replica may still have been catching up for that answer; it converges
            assert set(first) <= set(fleet.expected(tokens, lora))
            await _eventually_correct(client, fleet)
    finally:
        await asyncio.gather(*replacing)
        for s in started:
            await s.close()
        await nc.close()
        await fleet.close()


@pytest.mark.timeout(120)
async def test_a_worker_that_goes_silent_leaves_the_index(nats_server):
    model = "svc-expiry"
    fleet = await Fleet(nats_server, model, seed=6).start()
    service = IndexService(cfg(nats_server, model, "svc", worker_timeout_s=1.0), index=Index(BS))
    async with service, IndexClient(cfg(nats_server, model, "client"), timeout=5) as client:
        await _eventually_correct(client, fleet)
        assert client.workers == 3
        assert any("w2" in fleet.expected(t, lo) for t, lo in fleet.probes)
        await fleet.publishers.pop("w2").close()  # no more heartbeats from w2

        async def w2_gone():
            for tokens, lora in fleet.probes:
                if await client.find_matches(tokens, lora_name=lora) != fleet.expected(tokens, lora, without={"w2"}):
                    return False
            return client.workers == 2

        await _eventually(w2_gone, "the silent worker to leave the scores")
        assert service.subscriber.stats["expired"] == 1
    await fleet.close()


async def test_client_without_any_service_is_a_clear_error(nats_server):
    async with IndexClient(cfg(nats_server, "svc-nobody", "client"), timeout=0.5) as client:
        with pytest.raises(IndexUnavailableError, match=r"no index service is subscribed on kv\.query\.svc-nobody"):
            await client.find_matches([1] * 16)
        assert client.stats == {"queries": 1, "retries": 1, "failures": 1}
    with pytest.raises(RuntimeError, match="not started"):
        await IndexClient(cfg(nats_server, "svc-nobody")).find_matches([1])


# --- `kvbridge index` replicas, one SIGKILLed mid-stream --------------------------------------------

async def _start_replica(url: str, model: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvbridge", "index", "--servers", url, "--model", model, "--block-size", str(BS),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(proc.stderr.readline(), 60)
        assert f"answering kv.query.{model} (queue group kvbridge-index)".encode() in line, line
    except BaseException:  # a replica that did not say it serves is not left running
        await stop_process(proc, 20)
        raise
    return proc


@pytest.mark.timeout(180)
async def test_two_replicas_one_killed_mid_stream_no_query_lost(nats_server):
    model = "svc-replicas"
    fleet = await Fleet(nats_server, model, seed=5).start()
    first = second = None
    try:
        async with IndexClient(cfg(nats_server, model, "client"), timeout=2) as client:
            first = await _start_replica(nats_server.url, model)
            await _eventually_correct(client, fleet, "replica 1 alone to be correct")  # it serves
            second = await _start_replica(nats_server.url, model)
            # Both serve (a queue group spreads queries at random): many correct answers in a row.
            streak = 0
            deadline = asyncio.get_running_loop().time() + 30
            while streak < 40:
                assert asyncio.get_running_loop().time() < deadline, "replica 2 never caught up"
                tokens, lora = fleet.probes[streak % len(fleet.probes)]
                ok = await client.find_matches(tokens, lora_name=lora) == fleet.expected(tokens, lora)
                streak = streak + 1 if ok else 0
            expected = [fleet.expected(t, lo) for t, lo in fleet.probes]
            answers: list[bool] = []
            killed = asyncio.Event()

            async def stream(k: int):
                for i in range(60):
                    j = (k * 7 + i) % len(fleet.probes)
                    tokens, lora = fleet.probes[j]
                    answers.append(await client.find_matches(tokens, lora_name=lora) == expected[j])
                    if len(answers) >= 120 and not killed.is_set():
                        killed.set()
                        first.kill()  # SIGKILL: queries it holds die with it

            await asyncio.gather(*(stream(k) for k in range(8)))
            assert killed.is_set() and await first.wait() == -signal.SIGKILL
            assert len(answers) == 8 * 60 and all(answers), f"{answers.count(False)} wrong answers"
            print(f"480 queries, replica 1 SIGKILLed after 120: all answered; client stats {client.stats}")
            assert client.stats["failures"] == 0
            # the survivor alone answers everything
            assert await _all_correct(client, fleet)
    finally:
        for proc in (first, second):
            if proc is not None:
                await stop_process(proc, 20)
        await fleet.close()


async def test_per_medium_answers_and_remote_blocks_over_nats(nats_server):
    """Tiers through the service: a worker's GPU and CPU copies answered per medium (what the
    router weighs), a block on another node (locality REMOTE) credited only when asked, a block
    without a medium (SGLang's events) answered as None, which the router weighs as GPU."""
    from kvbridge import BlockStored
    from kvbridge.routing.router import Router

    model = "svc-tiers"
    tokens = list(range(8 * BS))
    hashes = list(range(1, 9))
    ev = lambda blocks, medium, **kw: BlockStored(  # noqa: E731
        hashes[:blocks], None, tokens[: blocks * BS], BS, None, medium, None, **kw
    )
    service = IndexService(cfg(nats_server, model, "svc"))
    async with service, IndexClient(cfg(nats_server, model, "client"), timeout=5) as client:
        async with KvEventPublisher(cfg(nats_server, model, "gpu-cpu")) as a, \
                KvEventPublisher(cfg(nats_server, model, "far")) as b, \
                KvEventPublisher(cfg(nats_server, model, "plain")) as c:  # fmt: skip
            a.publish([ev(2, "GPU"), ev(6, "CPU")])
            b.publish([ev(8, "GPU", locality="REMOTE")])
            c.publish([ev(4, None)])

            async def arrived() -> bool:
                return await client.find_matches(tokens, remote=True) == {"gpu-cpu": 6, "far": 8, "plain": 4}

            await _eventually(arrived, "the workers' events at the service")
            assert await client.find_matches(tokens) == {"gpu-cpu": 6, "plain": 4}
            assert await client.find_matches(tokens, medium="GPU") == {"gpu-cpu": 2}
            media = await client.find_matches(tokens, by_medium=True)
            assert media == {"gpu-cpu": {"GPU": 2, "CPU": 6}, "plain": {None: 4}}
            assert await client.find_matches(tokens, by_medium=True, remote=True) == {
                "gpu-cpu": {"GPU": 2, "CPU": 6}, "far": {"GPU": 8}, "plain": {None: 4},
            }  # fmt: skip
            # a router weighing the service's per-medium answer: 2 blocks at 1.0 + 4 at 0.75; no
            # medium counts as GPU
            router = Router(block_size=BS, workers=["gpu-cpu", "plain", "other"], provisional_ttl_s=0, cost="blocks")
            costs = router.costs_from_scores(media, 8)
            assert costs["gpu-cpu"] == 8 - (2 + 4 * 0.75) and costs["plain"] == 8 - 4


async def test_lifecycle_and_argument_mistakes_get_clear_errors(own_nats_server):
    """What a router author gets wrong: a service or subscriber started again after close (it
    answered nothing, or kept a live connection), iterating a subscriber never started (it waited
    forever), a queue group NATS refuses (a traceback from deep in nats-py), numpy hashes (an
    ambiguous truth value), a client or a RouteSync closed with the broker gone (they raised)."""
    import numpy as np

    from kvbridge import KvEventSubscriber, Router
    from kvbridge.routing.sync import RouteSync

    url = own_nats_server.url
    with pytest.raises(Exception, match="queue_group must be a NATS queue name"):
        IndexService(servers=[url], model="life", queue_group="a b")
    service = await IndexService(servers=[url], model="life").start()
    await service.close()
    with pytest.raises(RuntimeError, match="a closed IndexService cannot be started again"):
        await service.start()
    sub = KvEventSubscriber(servers=[url], model="life")
    with pytest.raises(RuntimeError, match="start\\(\\) the KvEventSubscriber first"):
        aiter(sub)
    await sub.start()
    await sub.close()
    with pytest.raises(RuntimeError, match="a closed KvEventSubscriber cannot be started again"):
        await sub.start()
    with pytest.raises(TypeError, match="on_update must be a callable"):
        KvEventSubscriber(servers=[url], model="life", on_update=5)
    with pytest.raises(TypeError, match="index must be a kvbridge.Index"):
        KvEventSubscriber(servers=[url], model="life", index=5)
    with pytest.raises(TypeError, match="config must be a kvbridge.Config, got dict"):
        KvEventSubscriber({"servers": [url]})

    async with IndexService(servers=[url], model="life", block_size=4):
        client = await IndexClient(servers=[url], model="life", timeout=0.5).start()
        for hashes in (np.array([1, 2, 3], dtype=np.uint64), np.array([7], dtype=np.int64), np.array([], dtype=np.uint64)):
            assert await client.find_matches(block_hashes=hashes) == {}
        assert await client.find_matches(np.array([1, 2, 3, 4, 5], dtype=np.int64)) == {}
        with pytest.raises(TypeError, match=r"block_hashes\[1\] must be an int, got 2.5"):
            await client.find_matches(block_hashes=[1, 2.5])
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            await client.find_matches([1, 2], timeout=-1)
        sync = await RouteSync(Router(block_size=4, workers=["a"]), servers=[url]).start()
        own_nats_server.kill()
        with pytest.raises(IndexUnavailableError):  # the fault: no broker to carry the query
            await client.find_matches([1, 2, 3, 4])
        await client.close()  # raised ConnectionResetError
        await sync.close()  # raised ConnectionReconnectingError
        with pytest.raises(RuntimeError, match="a closed RouteSync cannot be started again"):
            await sync.start()
