"""Workers' load reports as a subscriber has heard them, combined into one report per worker.

vLLM may run several API servers for one engine; each step's stats reach one of them, and each
publishes its own :class:`~kvbridge.wire.events.LoadReport` (``api_rank``). An API server's
report is current while it is at most two of its own intervals older than the newest (one that
stopped reporting stops counting). Per worker the combined report is the current one with the
freshest gauges (KV-cache usage, running, waiting: read last, by ``gauges_ts``; an API server the
steps have not reached lately still reports its last step's), its other fields that report's
too (``ts``, ``interval_s``, ``api_rank``), with the prefix-cache counters of all current ones
added up; its age is the newest's (how lately the worker was heard). No I/O: the
subscriber hands each report over as it arrives; ``routing.router.ReportLoads`` turns the result
into a router's load term.
"""

from __future__ import annotations

import time
from typing import Mapping

import msgspec

from kvbridge.wire.events import DecodeError, LoadReport, decode_load_report
from kvbridge.wire.subjects import FORMATS, HDR_CONTENT_TYPE, parse_load_subject

__all__ = ["LoadReports", "parse_load_msg"]

Key = tuple[str, str]  # (model, worker)


def parse_load_msg(subject: str, headers: Mapping[str, str] | None, data: bytes, prefix: str) -> tuple[Key, LoadReport]:
    """``((model, worker), report)`` of a load message; DecodeError for anything else."""
    key = parse_load_subject(subject, prefix)
    fmt = FORMATS.get((headers or {}).get(HDR_CONTENT_TYPE, "application/msgpack"))
    if key is None or fmt is None:
        raise DecodeError("not a load report subject or Content-Type")
    return key, decode_load_report(data, fmt)


class LoadReports:
    """The latest report of each ``(model, worker)`` per API server, and their combination."""

    __slots__ = ("_reports",)

    def __init__(self) -> None:
        # (model, worker) -> api_rank -> (report, monotonic time heard)
        self._reports: dict[Key, dict[int, tuple[LoadReport, float]]] = {}

    def add(self, key: Key, report: LoadReport, heard: float | None = None) -> None:
        """A report just heard (``heard``: its ``time.monotonic()``, now by default)."""
        self._reports.setdefault(key, {})[report.api_rank] = (report, time.monotonic() if heard is None else heard)

    def forget(self, key: Key) -> None:
        """A worker gone: its reports go with it."""
        self._reports.pop(key, None)

    def latest(self, now: float | None = None) -> dict[Key, tuple[LoadReport, float]]:
        """Each worker's combined report (module doc) and its age in seconds at ``now``
        (``time.monotonic()`` by default)."""
        if now is None:
            now = time.monotonic()
        out = {}
        for key, by_api in self._reports.items():
            newest, at = max(by_api.values(), key=lambda r: r[1])
            if len(by_api) > 1:
                current = [r for r, t in by_api.values() if at - t <= 2 * r.interval_s]
                freshest = max(current, key=lambda r: r.ts if r.gauges_ts is None else r.gauges_ts)
                newest = msgspec.structs.replace(
                    freshest,
                    prefix_cache_queries=sum(r.prefix_cache_queries for r in current),
                    prefix_cache_hits=sum(r.prefix_cache_hits for r in current),
                )
            out[key] = (newest, now - at)
        return out
