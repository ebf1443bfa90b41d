"""Prometheus metrics for publishers and subscribers.

The hot paths only bump plain integer attributes (``obj.stats``); a custom collector reads them at
scrape time. prometheus-client's own Counter takes a lock per ``inc()``, which would cost more than
the whole engine-side hand-off is allowed to.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvbridge.config import ConfigError

__all__ = ["INDEX_METRICS", "PUBLISHER_METRICS", "RELAY_METRICS", "SUBSCRIBER_METRICS", "register", "start_exporter"]

# stat key -> (metric name, help, kind)
_LINK_FAILURES = "Connections to NATS found dead by silence (PINGs unanswered) and replaced"
PUBLISHER_METRICS = {
    "messages": ("kvbridge_published_messages", "NATS messages published (live, not replays)", "counter"),
    "events": ("kvbridge_published_events", "Block events published", "counter"),
    "bytes": ("kvbridge_published_bytes", "Payload bytes published", "counter"),
    "dropped_batches": ("kvbridge_dropped_batches", "Engine hand-offs dropped because the queue was full", "counter"),
    "dropped_events": ("kvbridge_dropped_events", "Events in dropped hand-offs", "counter"),
    "evicted_unsent": (
        "kvbridge_evicted_unsent_messages",
        "Messages evicted from the ring buffer before they could be sent (broker down too long)",
        "counter",
    ),
    "publish_errors": ("kvbridge_publish_errors", "NATS publish calls that failed and will be retried", "counter"),
    "reconnects": ("kvbridge_reconnects", "Reconnections to NATS", "counter"),
    "max_payload": ("kvbridge_max_payload_bytes", "The largest payload a message may carry (the server's, less headers)",
                    "gauge"),
    "refitted": ("kvbridge_refitted_messages", "Held messages re-framed for a server's smaller max_payload", "counter"),
    "link_failures": ("kvbridge_link_failures", _LINK_FAILURES, "counter"),
    "replays": ("kvbridge_replays_served", "Replay requests answered", "counter"),
    "replays_gone": ("kvbridge_replays_gone", "Replay requests answered with 'gone'", "counter"),
    "snapshots": ("kvbridge_snapshots_served", "Snapshot requests answered", "counter"),
    "queue_depth": ("kvbridge_queue_depth", "Engine hand-offs waiting for the publisher loop", "gauge"),
    "ring_bytes": ("kvbridge_ring_buffer_bytes", "Bytes held in the replay ring buffer", "gauge"),
    "ring_messages": ("kvbridge_ring_buffer_messages", "Messages held in the replay ring buffer", "gauge"),
    "unsent": ("kvbridge_unsent_messages", "Messages in the ring not yet handed to NATS", "gauge"),
    # JetStream mode only
    "js_unacked": ("kvbridge_stream_unacked_messages", "Messages the stream has not acknowledged yet", "gauge"),
    "js_resent": ("kvbridge_stream_resent_messages", "Messages sent again because no ack came", "counter"),
    "js_duplicates": ("kvbridge_stream_duplicate_acks", "Re-sends the stream already had (de-duplicated)", "counter"),
    "js_ack_errors": ("kvbridge_stream_ack_errors", "Messages the stream refused or had no stream for", "counter"),
    "js_unacked_evicted": (
        "kvbridge_stream_unacked_evicted",
        "Unacknowledged messages the ring evicted before the stream confirmed them",
        "counter",
    ),
}

SUBSCRIBER_METRICS = {
    "messages": ("kvbridge_received_messages", "Event messages received", "counter"),
    "events": ("kvbridge_delivered_events", "Events delivered to the caller in order", "counter"),
    "bytes": ("kvbridge_received_bytes", "Payload bytes received", "counter"),
    "duplicates": ("kvbridge_duplicate_messages", "Messages dropped as already delivered", "counter"),
    "gaps": ("kvbridge_gaps", "Holes in a worker's sequence", "counter"),
    "replays": ("kvbridge_replays_requested", "Replay requests sent", "counter"),
    "replays_gone": ("kvbridge_replays_gone", "Replays answered with 'gone'", "counter"),
    "snapshots": ("kvbridge_snapshots_applied", "Snapshots applied", "counter"),
    "epoch_changes": ("kvbridge_epoch_changes", "Workers seen restarting (new epoch)", "counter"),
    "malformed": ("kvbridge_malformed_messages", "Messages that were not valid event messages", "counter"),
    "request_timeouts": ("kvbridge_request_timeouts", "Replay/snapshot requests that got no answer", "counter"),
    "workers": ("kvbridge_workers", "Workers tracked", "gauge"),
    "expired": ("kvbridge_expired_workers", "Workers dropped after a silence (our own link proven alive)", "counter"),
    "link_failures": ("kvbridge_subscriber_link_failures", _LINK_FAILURES, "counter"),
}


RELAY_METRICS = {
    "frames": ("kvbridge_relay_frames", "ZMQ messages received from the engine", "counter"),
    "forwarded": ("kvbridge_relay_forwarded_batches", "Engine batches handed to the publisher", "counter"),
    "replayed": ("kvbridge_relay_replayed_batches", "Of those, batches recovered from the engine's replay", "counter"),
    "malformed": ("kvbridge_relay_malformed_frames", "Engine frames that were not valid event frames", "counter"),
    "lost_batches": ("kvbridge_relay_lost_batches", "Engine batches neither received nor replayed", "counter"),
    "replay_requests": ("kvbridge_relay_replay_requests", "Replay requests sent to the engine for a gap", "counter"),
    "idle_probes": ("kvbridge_relay_idle_probes", "Replay requests after a quiet spell, for a dropped tail", "counter"),
    "duplicates": ("kvbridge_relay_duplicate_frames", "Live frames of batches an idle probe had forwarded", "counter"),
    "split_batches": ("kvbridge_relay_split_batches", "Engine batches over max_payload, sent split", "counter"),
    "replay_failures": ("kvbridge_relay_replay_failures", "Replay requests that failed or timed out", "counter"),
    "engine_restarts": ("kvbridge_relay_engine_restarts", "Engine restarts seen (each starts a new epoch)", "counter"),
    "epoch_start_failures": ("kvbridge_relay_epoch_start_failures",
                             "Tries to start a new epoch's publisher that NATS refused (retried)", "counter"),
    "view_blocks": ("kvbridge_relay_view_blocks", "Blocks in the relay's view of the engine's cache", "gauge"),
    "view_skipped_events": ("kvbridge_relay_view_skipped_events",
                            "Engine events the view skipped: a bad group_idx, an unknown kind, a bad window", "counter"),
    "view_unknown_removes": ("kvbridge_relay_view_unknown_removes", "Removals of blocks the view did not hold",
                             "counter"),
    "view_unread_batches": ("kvbridge_relay_view_unread_batches",
                            "Batches forwarded but left out of the view (values nested too deep for its reader)",
                            "counter"),
}


# The index service (kvbridge.routing.service). A "histogram" stat is ``(cumulative buckets [(le, count)],
# sum)``, built at scrape time from plain counters.
INDEX_METRICS = {
    "queries": ("kvbridge_index_queries", "Overlap queries answered (errors included)", "counter"),
    "errors": ("kvbridge_index_query_errors", "Queries answered with an error (malformed or refused)", "counter"),
    "latency": ("kvbridge_index_query_seconds", "Time from a query's arrival to its reply being sent", "histogram"),
    "blocks": ("kvbridge_index_blocks", "Distinct blocks in the index", "gauge"),
    "workers": ("kvbridge_index_workers", "Workers in the index", "gauge"),
    "memory_bytes": ("kvbridge_index_memory_bytes", "Memory the index holds", "gauge"),
}


def _family(name: str, doc: str, kind: str, labels: list[str]) -> Any:
    if kind == "counter":
        return CounterMetricFamily(name, doc, labels=labels)
    if kind == "histogram":
        return HistogramMetricFamily(name, doc, labels=labels)
    return GaugeMetricFamily(name, doc, labels=labels)


class _Collector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # role -> live objects with .stats (dict) and .metric_labels (dict)
        self._objects: dict[str, weakref.WeakSet] = {role: weakref.WeakSet() for role in _TABLES}

    def add(self, role: str, obj: Any) -> None:
        with self._lock:
            self._objects[role].add(obj)

    def collect(self) -> Iterable[Any]:
        with self._lock:
            groups = {role: list(objs) for role, objs in self._objects.items()}
        for role, table in _TABLES.items():
            objs = groups[role]
            if not objs:
                continue
            label_names = list(objs[0].metric_labels)
            for key, (name, doc, kind) in table.items():
                family = _family(name, doc, kind, label_names)
                for obj in objs:
                    stats = obj.stats
                    if key in stats:
                        labels = [obj.metric_labels[n] for n in label_names]
                        if kind == "histogram":
                            buckets, total = stats[key]
                            family.add_metric(labels, buckets, total)
                        else:
                            family.add_metric(labels, stats[key])
                yield family


_TABLES = {
    "publisher": PUBLISHER_METRICS,
    "subscriber": SUBSCRIBER_METRICS,
    "relay": RELAY_METRICS,
    "index": INDEX_METRICS,
}
_collector = _Collector()
_registered = False
_exporters: dict[tuple[str, int], Any] = {}
_module_lock = threading.Lock()


def tally(counts: dict[str, int], key: str, n: int = 1) -> int | None:
    """Adds ``n`` to ``counts[key]`` (a stats counter); the new total when it is worth a log line --
    the first, then each power of two (1, 2, 4, 8...): visible, but a flood cannot fill the log --
    else None."""
    total = counts[key] = counts[key] + n
    return total if total & (total - 1) == 0 else None


def register(role: str, obj: Any) -> None:
    """Expose ``obj.stats`` under ``role`` ('publisher', 'subscriber', 'relay' or 'index') in the default registry."""
    global _registered
    with _module_lock:
        if not _registered:
            REGISTRY.register(_collector)
            _registered = True
    _collector.add(role, obj)


def start_exporter(port: int, addr: str = "127.0.0.1") -> int:
    """Serve /metrics on ``addr:port`` once per process (port 0 picks one); returns the port.
    A port that cannot be bound is a :class:`~kvbridge.config.ConfigError` naming it."""
    with _module_lock:
        key = (addr, port)
        if key not in _exporters:
            try:
                server, thread = start_http_server(port, addr=addr)
            except (OSError, OverflowError) as exc:  # in use, no such address, out of range
                why = getattr(exc, "strerror", None) or exc
                raise ConfigError(f"metrics_port (--metrics-port, KVBRIDGE_METRICS_PORT) {addr}:{port}: {why}") from None
            _exporters[key] = (server, thread)
        return _exporters[key][0].server_port


def stop_exporters() -> None:
    with _module_lock:
        for server, thread in _exporters.values():
            server.shutdown()
            server.server_close()
            thread.join(5)
        _exporters.clear()
