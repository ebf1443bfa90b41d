"""A sidecar that carries a stock vLLM or SGLang engine's ZMQ KV events to NATS.

The engine publishes on a ZMQ PUB socket (``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5567", "topic":
"kv"}'``) multipart frames ``[topic, seq (u64 big-endian), msgpack KVEventBatch]``, and keeps its
last batches (10,000 by default) for a DEALER that sends ``[b"", start_seq]`` to its ROUTER replay
endpoint: the answer is ``[b"", (topic,) seq, payload]`` per held batch with seq >= start, then
an end marker whose seq is -1 and payload empty. vLLM 0.33 puts the topic in the replies, older
vLLM and SGLang do not: only the last two frames are read.

The relay forwards each engine batch's payload bytes unchanged as one NATS message, through a
:class:`KvEventPublisher` (``publish_payload``; in JSON mode it is re-encoded). Only a batch larger
than the server's ``max_payload`` is split by the publisher, at event boundaries (``split_batches``
counts those). It reads each batch only to keep its own view (below), from the bytes, in Rust: no
Python event is built for a batch in vLLM 0.33's shape (other engines' shapes are decoded first).
It keeps the engine's seq:

* **gap** (ZMQ PUB drops at its high-water mark, the relay joined late or its connection dropped):
  the missing range is asked of the replay endpoint and forwarded in order before the frame that
  revealed it. Each reply may take ``request_timeout_s``; whatever does not come (no replay
  endpoint, timeout, the engine's buffer moved on) is lost: counted, logged, and marked on NATS
  as a hole in the publisher's seq (``mark_loss``; messages before it not yet sent go with it),
  so consumers resync by snapshot.
* **quiet tail**: the engine's PUB may drop the last batches of a burst, and vLLM sends nothing
  while idle, so no later frame reveals that gap. After ``idle_probe_s`` (1 s) without frames
  following traffic, the relay asks the replay endpoint for everything from the next expected seq
  -- the engine answers with its end marker alone when nothing is missing -- and forwards what
  comes; live twins of those batches, should the SUB socket deliver them too, are skipped
  (``duplicates``). One probe per quiet spell; no timer runs while the engine is idle after it.
* **snapshot**: the relay has no block pool, so it keeps a view built from the events it
  forwarded -- per medium and KV-cache group, each cached block's copies, each with the
  ``BlockStored`` it came in (:class:`RelayView`) -- and attaches it as the
  publisher's pool. A consumer that lost messages gets that view, parents before children. After
  a loss the view is only as good as what arrived: blocks stored in lost batches are missing
  until stored again, blocks removed in them linger until removed again.
* **engine restart** (a seq lower than expected: the engine counts from 0 again): a new epoch.
  The publisher is closed (what it holds is sent) and a new one starts, with a new ``Kv-Epoch``
  and an empty view; consumers drop the worker's old view, as for any restarted worker. A
  restart cannot be told from a gap when the new engine has already published more batches than
  the relay had seen from the old one by the time its frames reach the relay.
* **malformed** frames (wrong frame count, a seq that is not 8 bytes, a payload that is not a
  batch) are counted, logged and skipped; a batch that cannot be decoded is a loss too.

Everything runs on one asyncio loop, the publisher's: the view changes and the batch is handed
over in one step under ``publisher.lock``, so a snapshot always matches a seq (the threading
contract of :mod:`kvbridge.bus.handoff`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

import zmq
import zmq.asyncio

import msgspec

from kvbridge._native import ResidencyView
from kvbridge.metrics import register, tally
from kvbridge.config import Config, ConfigError
from kvbridge.wire.events import (
    BlockStored,
    DecodeError,
    decode_batch,
    merge_runs,
    slice_event,
)
from kvbridge.wire.residency import WINDOW_KINDS, kind_event, view_payload
from kvbridge.bus.connection import ConnectError
from kvbridge.bus.publisher import KvEventPublisher

__all__ = ["Relay", "RelayView", "engine_endpoint", "snapshot_events"]

log = logging.getLogger("kvbridge.relay")

_END_SEQ = 0xFFFF_FFFF_FFFF_FFFF  # (-1).to_bytes(8, "big", signed=True), vLLM's END_SEQ
# The engine's PUB keeps up to 100k batches per subscriber; ours should not be the tighter bound
# while a replay keeps the loop from reading.
_RCVHWM = 100_000
# Pauses between a new epoch's tries to connect (an engine restart while NATS is down).
_EPOCH_RETRY_FIRST_S = 0.2
_EPOCH_RETRY_MAX_S = 5.0
# Frames taken without yielding to the loop while the engine's are queued (see Relay._run).
_BURST = 8
# A plain int: pyzmq's flag enums cost an enum operation per use.
_NOBLOCK = int(zmq.NOBLOCK)


def engine_endpoint(endpoint: str, dp_rank: int | None = None, *, what: str = "relay endpoint") -> str:
    """Where to connect for an engine configured with ``endpoint``, as data-parallel rank
    ``dp_rank``, by vLLM 0.33's rules (``ZmqEventPublisher.offset_endpoint_port``): rank 0 binds
    ``endpoint`` itself; rank r, for an endpoint containing ``inproc``, the name with a ``_dp<r>``
    suffix, for one containing ``tcp``, the port + r -- except port 0, which is left to the OS
    (so the engine binds a port of its choosing, and that port is what to connect to). Anything
    else (``ipc://``) cannot be offset: vLLM refuses it too. A bind address ``*`` means this host.
    Errors name the endpoint as ``what`` and as typed."""
    given = endpoint
    endpoint = endpoint.replace("://*:", "://127.0.0.1:")
    if not dp_rank:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        try:
            number = int(port)
        except ValueError:
            raise ConfigError(
                f"{what} {given!r}: expected tcp://host:port to offset by the dp rank {dp_rank}"
            ) from None
        if number != 0 and number + dp_rank > 65535:  # vLLM would fail to bind it
            raise ConfigError(f"{what} {given!r}: port {number} + dp rank {dp_rank} is past 65535")
        return endpoint if number == 0 else f"{base}:{number + dp_rank}"
    raise ConfigError(f"{what} {given!r}: a dp rank offsets only tcp:// ports and inproc:// names")


def _named(what: str, given: str, resolved: str) -> str:
    """How an error names an endpoint: as typed, and where that led if it was rewritten."""
    return f"{what} {given!r}" + (f" (connecting to {resolved!r})" if resolved != given else "")


def _connectable(what: str, given: str, dp_rank: int | None) -> str:
    resolved = engine_endpoint(given, dp_rank, what=what)
    if resolved.startswith("tcp://") and resolved.endswith(":0"):
        raise ConfigError(
            f"{_named(what, given, resolved)}: port 0 lets the engine's OS pick its port; pass the port it bound"
        )
    return resolved


_stored_decoder = msgspec.msgpack.Decoder(BlockStored)


def snapshot_events(
    groups: Iterable[dict[Any, list[tuple[BlockStored, int]]]], kinds: dict[int, tuple[str, int | None]],
    sizes: dict[int, int],
) -> list[BlockStored]:
    """:meth:`RelayView.snapshot` of a view that holds, per ``(medium, group)``, ``{hash: [(event,
    index), ...]}`` (each copy's ``BlockStored`` and the block's index in it, oldest first, hashes in
    the order they came), ``kinds`` (``{group: (kind, window)}``) and ``sizes`` (``{group: largest
    block_size}``)."""
    out: list[BlockStored] = []
    for by_hash in groups:
        order: list[Any] = []
        placed: set[Any] = set()
        for h in by_hash:
            chain = []
            k = h
            while k in by_hash and k not in placed:
                placed.add(k)
                chain.append(k)
                ev, i = by_hash[k][0]
                k = ev.block_hashes[i - 1] if i else ev.parent_block_hash
                if k is None:
                    break
            order.extend(reversed(chain))
        out += merge_runs((by_hash[h][0] for h in order), slice_event)
        out += merge_runs((copy for h in order for copy in by_hash[h][1:]), slice_event)
    said: dict[int, tuple[str, int | None]] = {}
    sized: dict[int, int] = {}
    for ev in out:
        g = ev.group_idx or 0
        if ev.kv_cache_spec_kind is not None:
            kind = ev.kv_cache_spec_kind
            said[g] = (kind, ev.kv_cache_spec_sliding_window if kind in WINDOW_KINDS else None)
        sized[g] = max(sized.get(g, 0), ev.block_size)
    for g in sorted(kinds.keys() | sizes.keys()):
        size = sizes.get(g, 0)
        size = size if sized.get(g, 0) < size else 0  # 0: a placeholder's, which says no size
        known = kinds.get(g)
        if known is not None and (said.get(g) != known or size):
            out.append(kind_event(g, known[0], known[1], size))
        elif known is None and size:
            out.append(BlockStored([], None, [], size, None, None, None, group_idx=g))
    return out


class RelayView:
    """The blocks an engine holds, as the forwarded events say: the relay's stand-in for a pool
    (``take_events`` / ``snapshot``, for :meth:`KvEventPublisher.attach`). ``residency`` follows the
    events by the one rule every view shares (:mod:`kvbridge.wire.residency`: per ``(medium,
    group)``, each block's copies), kept in Rust from the payload bytes
    (:class:`kvbridge._native.ResidencyView`, which reads like a ``Residency``); each copy keeps the
    ``BlockStored`` it came in as that event's bytes, so a snapshot keeps every field of it."""

    __slots__ = ("residency",)

    def __init__(self) -> None:
        self.residency = ResidencyView()

    def apply_payload(self, payload: bytes) -> tuple[int, int] | None:
        """Applies a msgpack batch as received, whole: ``(events, block hashes)``, or None (nothing
        applied) when it is not in vLLM 0.33's shape -- :meth:`apply` its decoded events then."""
        return self.residency.apply(payload)

    def apply(self, events: list[Any]) -> None:
        """Applies decoded (or hand-built) events: encoded in vLLM 0.33's shape, then read as any
        payload. ValueError, applying none, for events whose bytes the view cannot read."""
        if self.residency.apply(view_payload(events)) is None:
            # The one case: an extra key nested deeper than the reader goes (rust/reader.rs).
            raise ValueError("events the view cannot read (values nested too deep)")

    @property
    def blocks(self) -> set[Any]:
        """The hashes held in some medium and group."""
        return self.residency.blocks()

    def take_events(self) -> list[Any]:
        return []  # the relay hands each batch over itself, to keep the engine's batch boundaries

    def snapshot(self) -> list[BlockStored]:
        """Every block copy as ``BlockStored`` events, per ``(medium, group)``: first each block once,
        parents before children (a parent stored again after its child is still placed first),
        consecutive blocks of one stored chain as one event; then each further copy, cut from the
        event it came in (so with its real parent, and counted again by a view that applies it);
        last, a :func:`~kvbridge.wire.residency.kind_event` for a group whose kind or largest block
        size (the size an index reads the group at: a group holding only smaller partial-tail
        blocks, or nothing, would lose it) the events before would not leave as it is here."""
        groups, raws = self.residency.sources()
        events = {src: _stored_decoder.decode(raw) for src, raw in raws.items()}
        by_group = ({h: [(events[src], i) for src, i in copies] for h, copies in blocks} for _, _, blocks in groups)
        return snapshot_events(by_group, self.residency.kinds, self.residency.sizes)

    def __len__(self) -> int:
        """Blocks held, counted once per ``(medium, group)`` that holds them."""
        return len(self.residency)


class _Malformed(Exception):
    pass


def _seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise _Malformed(f"seq frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


class Relay:
    """Relays one engine's (one dp rank's) ZMQ KV events to ``<prefix>.events.<model>.<worker>``.

    ``endpoint`` / ``replay_endpoint``: the engine's PUB and ROUTER addresses as configured in the
    engine (``tcp://*:5557`` is read as this host); ``dp_rank`` offsets both as the engine does
    (:func:`engine_endpoint`) and becomes the publisher's ``dp_rank`` unless the config has one. A
    tcp port 0 is refused: the engine's OS picked the port, pass that one. ``idle_probe_s``: how
    long without frames after traffic before the replay endpoint is asked for a dropped tail (0:
    never). ``topic``: the
    subscription prefix (vLLM's ``topic``; "" takes everything). ``await start()`` connects to
    NATS (failing fast like the publisher) and to the engine (ZMQ connects in the background),
    ``await close()`` forwards what has already arrived, sends it and disconnects; also an async
    context manager. ``await wait()`` returns when the relay stops, raising what stopped it.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        dp_rank: int | None = None,
        idle_probe_s: float = 1.0,
        **options: Any,
    ) -> None:
        config = Config.resolve(config, **options)
        if isinstance(idle_probe_s, bool) or not isinstance(idle_probe_s, (int, float)) or not 0 <= idle_probe_s < float("inf"):
            raise ConfigError(f"idle_probe_s must be a finite number of seconds >= 0 (0: never), got {idle_probe_s!r}")
        if not isinstance(topic, str):
            raise ConfigError(f"topic must be a str (\"\" takes everything), got {topic!r}")
        if dp_rank is not None and config.dp_rank is None:
            config = config.replace(dp_rank=dp_rank)
        self.config = config
        self._given, self._given_replay = endpoint, replay_endpoint
        self.endpoint = _connectable("relay endpoint", endpoint, dp_rank)
        self.replay_endpoint = _connectable("relay replay_endpoint", replay_endpoint, dp_rank) if replay_endpoint else None
        self._idle_probe_ms = int(idle_probe_s * 1000) if self.replay_endpoint else 0
        self._probe_due = False  # a frame came since the last probe: probe after the next quiet spell
        self._probed: dict[int, bytes] = {}  # what the last probe forwarded, until live frames pass it
        self.topic = topic
        self.metric_labels = {"model": config.model, "worker": config.worker_id}
        self.view = RelayView()
        self._publisher: KvEventPublisher | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._reading = False  # awaiting a frame: the only point where close() may cancel the loop
        self._stopping = False
        self._expected: int | None = None  # the engine seq that should come next; None: any
        self._counts = dict.fromkeys(
            ("frames", "forwarded", "replayed", "malformed", "lost_batches", "replay_requests", "replay_failures",
             "engine_restarts", "split_batches", "idle_probes", "duplicates", "view_unread_batches",
             "epoch_start_failures"),
            0,
        )  # fmt: skip
        register("relay", self)

    @property
    def publisher(self) -> KvEventPublisher:
        """The current epoch's publisher (a new one after each engine restart)."""
        assert self._publisher is not None, "start() first"
        return self._publisher

    @property
    def stats(self) -> dict[str, int]:
        s = dict(self._counts)
        s["view_blocks"] = len(self.view)
        # An engine whose events a view cannot read (a new kind, a group beyond 63) shows here.
        view = self.view.residency.stats
        s["view_skipped_events"] = view["bad_groups"] + view["bad_windows"] + view["unknown_kinds"]
        s["view_unknown_removes"] = view["unknown_removes"]
        s["last_engine_seq"] = -1 if self._expected is None else self._expected - 1
        return s

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> Relay:
        if self._task is not None:
            return self
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        # An engine on an IPv6 node binds and lists tcp://[addr]:port (vLLM sets IPV6 on its
        # socket then): without it ZMQ connects to nothing, and says nothing. Harmless for IPv4.
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, _RCVHWM)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        what = _named("relay endpoint", self._given, self.endpoint)
        try:
            sub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                # Checked now, not at the first gap: a typo there would only ever show as loss.
                what = _named("relay replay_endpoint", self._given_replay or "", self.replay_endpoint)
                with ctx.socket(zmq.DEALER) as probe:
                    probe.setsockopt(zmq.IPV6, 1)
                    probe.setsockopt(zmq.LINGER, 0)
                    probe.connect(self.replay_endpoint)
                what = "relay"
            await self._start_publisher()
        except BaseException as exc:
            sub.close(linger=0)
            ctx.term()
            if isinstance(exc, zmq.ZMQError):
                raise ConfigError(f"{what}: {exc}") from None
            raise
        self._ctx, self._sub = ctx, sub
        self._task = asyncio.create_task(self._run(), name=f"kvbridge-relay-{self.config.worker_id}")
        log.info("relaying %s (replay: %s) to %s", self.endpoint, self.replay_endpoint, self.publisher.subjects.events)
        return self

    async def close(self) -> None:
        task = self._task
        if task is None or self._stopping:
            return
        self._stopping = True
        if self._reading:
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception:
            pass  # already reported by _run
        try:
            await self._drain_socket()
        finally:
            self._sub.close(linger=0)  # type: ignore[union-attr]
            self._ctx.term()  # type: ignore[union-attr]
            await self.publisher.close()

    async def wait(self) -> None:
        assert self._task is not None, "start() first"
        await asyncio.shield(self._task)

    async def __aenter__(self) -> Relay:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _start_publisher(self) -> None:
        pub = KvEventPublisher(self.config)
        await pub.start()
        self.view = RelayView()
        pub.attach(self.view)
        self._publisher = pub

    # -- frames in --------------------------------------------------------------------------------

    async def _run(self) -> None:
        sub = self._sub
        assert sub is not None
        # The same socket without asyncio's wrapper (it owns nothing: closing is sub's).
        now: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        # A frame already queued is taken as it is, from the socket itself: waiting for one
        # registers with the poller (and, with the idle probe on, starts a timer), which costs a
        # busy relay more than the frame's own handling, and even pyzmq's asyncio receive of a
        # queued frame makes and awaits a future for it. No receive through ``sub`` is pending
        # here (``_next_frames`` awaits its own to the end or cancels it), so none is bypassed.
        recv_now, on_frames = now.recv_multipart, self._on_frames
        burst = 0
        try:
            while not self._stopping:
                try:
                    frames = recv_now(_NOBLOCK)
                except zmq.Again:
                    burst = 0
                    got = await self._next_frames(sub)
                    if got is None:
                        await self._probe()
                        continue
                    frames = got
                else:
                    burst += 1
                    if burst == _BURST:
                        burst = 0
                        await asyncio.sleep(0)  # the publisher sends from this loop: let it between bursts
                await on_frames(frames)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kvbridge relay stopped")
            raise
        finally:
            self._reading = False

    async def _next_frames(self, sub: zmq.asyncio.Socket) -> list[bytes] | None:
        """The next frames; None when a probe is due and ``idle_probe_s`` pass without any. Each
        frame starts the quiet spell again. A timer handle that cancels the receive, not pyzmq's
        asyncio ``poll`` with a timeout: that cost the relay ~0.4 ms of CPU per frame at vLLM's
        step rates (a cancelled receive takes no message: pyzmq skips cancelled futures)."""
        fut = asyncio.ensure_future(sub.recv_multipart(copy=True))  # pyzmq's Future itself, no task
        quiet = False
        timer = None
        if self._probe_due:

            def on_quiet() -> None:
                nonlocal quiet
                if not fut.done():
                    quiet = True
                    fut.cancel()

            timer = asyncio.get_running_loop().call_later(self._idle_probe_ms / 1000, on_quiet)
        self._reading = True  # close() may cancel the task here
        try:
            return await fut
        except asyncio.CancelledError:
            if quiet:
                return None
            raise
        finally:
            self._reading = False
            if timer is not None:
                timer.cancel()

    async def _drain_socket(self) -> None:
        """Frames that arrived before close(): forward them rather than drop them (a bounded number:
        an engine that keeps publishing would keep this going)."""
        sub = self._sub
        assert sub is not None
        for _ in range(_RCVHWM):
            try:
                frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            await self._on_frames(frames)

    async def _on_frames(self, frames: list[bytes]) -> None:
        self._counts["frames"] += 1
        self._probe_due = self._idle_probe_ms > 0
        try:
            if len(frames) != 3:
                raise _Malformed(f"{len(frames)} frames, expected [topic, seq, payload]")
            seq = _seq(frames[1])
        except _Malformed as exc:
            self._malformed(exc)
            return
        if self._expected is not None and seq < self._expected:
            if self._probed.get(seq) == frames[2]:
                self._counts["duplicates"] += 1  # live twin of a batch an idle probe already forwarded
                return
            await self._new_epoch(seq)
        self._probed = {}
        start = self._expected or 0
        if seq > start:
            await self._recover(start, seq)
        self._forward(frames[2])
        self._expected = seq + 1

    def _forward(self, payload: bytes) -> bool:
        view, pub = self.view, self.publisher
        if len(payload) > pub.max_payload:
            self._counts["split_batches"] += 1  # the publisher splits it: more than the server takes at once
        with pub.lock:  # the view and the hand-off change together, as a snapshot sees them
            # vLLM 0.33's shape: the view reads the bytes in Rust, the bytes go out as they came.
            got = view.apply_payload(payload)
            if got is None:
                # Another engine's shape (older vLLM, SGLang): decoded, then read as vLLM's.
                try:
                    batch = decode_batch(payload)
                except DecodeError as exc:
                    self._malformed(exc)
                    self._lose(1, "undecodable")
                    return False
                try:
                    view.apply(batch.events)
                except ValueError as exc:
                    # Decodable, yet not readable by the view even re-encoded (an extra key nested
                    # deeper than its reader goes): consumers can read it, so it is forwarded.
                    self._view_unread(exc)
                pub.publish_batch(batch, payload)
            else:
                pub.publish_payload(payload, got[0])
        self._counts["forwarded"] += 1
        return True

    def _view_unread(self, why: Exception) -> None:
        if (n := tally(self._counts, "view_unread_batches")) is not None:
            log.warning("kvbridge relay: a batch from %s forwarded but left out of the view (%d so far): %s",
                        self.endpoint, n, why)  # fmt: skip

    def _malformed(self, why: Exception) -> None:
        if (n := tally(self._counts, "malformed")) is not None:
            log.warning("kvbridge relay: malformed frame from %s skipped (%d so far): %s", self.endpoint, n, why)

    def _lose(self, n: int, why: str) -> None:
        self._counts["lost_batches"] += n
        self.publisher.mark_loss()
        log.warning("kvbridge relay: %d engine batch(es) lost (%s); consumers resync from the relay's view", n, why)

    # -- gaps and restarts ---------------------------------------------------------------------------

    async def _recover(self, start: int, stop: int) -> None:
        """Forward engine batches [start, stop) from the replay endpoint, in order; the rest is lost."""
        if self.replay_endpoint is not None:
            self._counts["replay_requests"] += 1
        nxt = self._forward_replayed(start, await self._replay(start, stop))
        if nxt < stop:
            why = "no replay endpoint" if self.replay_endpoint is None else "replay incomplete"
            self._lose(stop - nxt, f"seqs {nxt}..{stop - 1}: {why}")

    async def _probe(self) -> None:
        """After a quiet spell, ask the replay endpoint for whatever follows the last batch seen:
        a tail the engine's PUB dropped would otherwise wait for the engine's next step (vLLM sends
        nothing while idle). When nothing is missing the engine answers with its end marker alone.
        What comes is forwarded; its live twins, if the SUB socket gets them too, are skipped."""
        self._probe_due = False
        self._counts["idle_probes"] += 1
        start = self._expected or 0
        got = await self._replay(start, None)
        if got:
            self._expected = self._forward_replayed(start, got)
            self._probed = got

    def _forward_replayed(self, start: int, got: dict[int, bytes]) -> int:
        """Forward replayed batches in seq order from ``start``, counting a gap before one as
        lost (no longer in the engine's buffer); returns the seq expected next."""
        nxt = start
        for seq in sorted(got):
            if seq > nxt:
                self._lose(seq - nxt, f"seqs {nxt}..{seq - 1} not in the engine's replay buffer")
            if self._forward(got[seq]):
                self._counts["replayed"] += 1
            nxt = seq + 1
        return nxt

    async def _replay(self, start: int, stop: int | None) -> dict[int, bytes]:
        """Engine batches with ``start <= seq < stop`` (``stop`` None: all the engine holds from
        ``start``) from the replay endpoint, by seq; what does not come in time is missing."""
        if self.replay_endpoint is None:
            return {}
        timeout_ms = int(self.config.request_timeout_s * 1000)
        got: dict[int, bytes] = {}
        # A socket per request: a late answer to an abandoned request cannot be mistaken for this one.
        sock = self._ctx.socket(zmq.DEALER)  # type: ignore[union-attr]
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            await asyncio.wait_for(sock.send_multipart([b"", start.to_bytes(8, "big")]), self.config.request_timeout_s)
            while await sock.poll(timeout_ms):  # POLLIN
                frames = await sock.recv_multipart()
                if len(frames) < 3 or frames[0] != b"":
                    raise _Malformed(f"replay reply of {len(frames)} frames")
                seq = _seq(frames[-2])
                if seq == _END_SEQ:
                    return got
                if seq >= start and (stop is None or seq < stop):
                    got[seq] = frames[-1]
                if stop is not None and seq >= stop - 1:
                    return got  # the rest is live traffic the SUB socket holds
            why = f"no answer within {self.config.request_timeout_s:g}s after {len(got)} batches"
        except (_Malformed, zmq.ZMQError, asyncio.TimeoutError) as exc:
            why = str(exc) or f"no answer within {self.config.request_timeout_s:g}s"
        finally:
            sock.close(linger=0)
        # 1st, 2nd, 4th...: a wrong or absent replay endpoint cannot fill the log
        if (n := tally(self._counts, "replay_failures")) is not None:
            log.warning("kvbridge relay: replay from %s failed (%d so far): %s", self.replay_endpoint, n, why)
        return got

    async def _new_epoch(self, seq: int) -> None:
        log.warning(
            "kvbridge relay: engine seq went back from %d to %d: engine restarted, starting a new epoch",
            self._expected - 1, seq,  # type: ignore[operator]
        )  # fmt: skip
        self._counts["engine_restarts"] += 1
        self._expected = None
        self._probed = {}
        old = self.publisher
        await old.close()  # the old epoch's tail goes out before the new epoch's first message
        # The new epoch's publisher connects: with NATS down it waits for it, the engine's frames
        # queued in the SUB socket meanwhile (a gap past its high-water mark is replayed).
        pause = _EPOCH_RETRY_FIRST_S
        while True:
            try:
                await self._start_publisher()
                return
            except ConnectError as exc:
                if (n := tally(self._counts, "epoch_start_failures")) is not None:
                    log.warning("kvbridge relay: the new epoch cannot start yet (%d tries so far), retrying: %s", n, exc)
            self._reading = True  # close() may cancel the wait
            try:
                await asyncio.sleep(pause)
            finally:
                self._reading = False
            pause = min(pause * 2, _EPOCH_RETRY_MAX_S)
