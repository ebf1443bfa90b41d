"""vLLM 0.33's KV-event shapes and its ``ZmqEventPublisher`` loop, rewritten for the benches.

Not vLLM's code: a copy of its behaviour (vllm/distributed/kv_events.py of the vllm==0.33.0 wheel),
so that the benches compare against what vLLM does without installing vLLM. What matters for a
cost comparison is kept exactly: the msgspec Struct options (``array_like`` batch, tagged events,
``omit_defaults``, ``gc=False``) and field order, which decide both the bytes and the decode
cost (the Structs are tests/engine_shapes.py's, plus the two it has no use for); and the
publisher's path per batch -- ``publish()`` puts the batch on a ``queue.Queue``, one
thread takes it (``get(timeout=0.1)``, after a ``poll(0)`` of the replay ROUTER), numbers it,
encodes it with a ``msgspec.msgpack.Encoder``, sends ``[topic, seq, payload]`` on a PUB socket,
keeps ``(seq, payload)`` in a bounded deque for replay, and calls ``task_done()``. Left out: the
endpoint arithmetic, vLLM's logging and config objects (not on the per-batch path).
"""

from __future__ import annotations

import queue
import sys
import threading
from collections import deque
from itertools import count
from pathlib import Path
from typing import Any

import msgspec
import zmq

# vLLM's Structs, as the tests copy them (field order and options are part of the bytes).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from engine_shapes import VllmBatch, VllmBlockRemoved, VllmBlockStored, VllmEvent  # noqa: E402

BlockStored, BlockRemoved, EventBatch = VllmBlockStored, VllmBlockRemoved, VllmBatch


class AllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(VllmBatch):
    """vLLM's typed batch: what its consumers decode with."""

    events: list[VllmBlockStored | VllmBlockRemoved | AllBlocksCleared]


def from_kvbridge(ev: Any) -> Any:
    """The same event as vLLM's class (kvbridge's carry the same fields, in the same order)."""
    name = type(ev).__name__
    cls = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}[name]
    return cls(**{f: getattr(ev, f) for f in cls.__struct_fields__})


class ZmqEventPublisher:
    """vLLM's publisher: ``publish(batch)`` from the engine thread, one daemon thread sending."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, data_parallel_rank: int, endpoint: str, replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000,
                 topic: str = "") -> None:  # fmt: skip
        self._dp_rank = data_parallel_rank
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            self._replay.bind(replay_endpoint)
        self._seq = count()
        self._topic = topic.encode()
        self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True, name="zmq-publisher")
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        if not self._running:
            raise RuntimeError("Publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._dp_rank
        self._queue.put(batch)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Sends what is queued, then stops (vLLM waits up to a second; a bench waits for all)."""
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while self._running or self._queue.qsize() > 0:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                break
            seq = next(self._seq)
            payload = encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self._queue.task_done()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))
