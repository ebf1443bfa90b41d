"""How a subscriber combines workers' load reports (kvbridge.bus.loads), without a broker."""

from __future__ import annotations

import pytest

from kvbridge.bus.loads import LoadReports, parse_load_msg
from kvbridge.wire.events import DecodeError, LoadReport, decode_load_report, encode_load_report
from kvbridge.wire.subjects import CONTENT_TYPES, HDR_CONTENT_TYPE


def report(api: int, ts: float, *, running: int = 0, queries: int = 0, hits: int = 0, interval: float = 1.0,
           read: float | None = None) -> LoadReport:  # fmt: skip
    return LoadReport(ts=ts, running=running, prefix_cache_queries=queries, prefix_cache_hits=hits,
                      interval_s=interval, api_rank=api, gauges_ts=read)  # fmt: skip


def test_one_api_server_the_latest_report_and_its_age():
    loads = LoadReports()
    loads.add(("m", "w"), report(0, 1.0, running=3), heard=10.0)
    loads.add(("m", "w"), report(0, 2.0, running=5), heard=11.0)
    assert loads.latest(now=11.5) == {("m", "w"): (report(0, 2.0, running=5), 0.5)}


def test_several_api_servers_newest_gauges_counters_added_while_current():
    loads = LoadReports()
    loads.add(("m", "w"), report(0, 1.0, running=9, queries=100, hits=10), heard=10.0)
    loads.add(("m", "w"), report(1, 2.0, running=4, queries=50, hits=5), heard=11.5)
    loads.add(("m", "w"), report(2, 0.5, running=1, queries=7, hits=7, interval=1.0), heard=9.0)  # 2.5 s old: stale
    (got, age), = loads.latest(now=12.0).values()
    assert (got.api_rank, got.running, got.ts, age) == (1, 4, 2.0, 0.5)  # the newest report's gauges
    assert (got.prefix_cache_queries, got.prefix_cache_hits) == (150, 15)  # api 2 is older than 2 intervals


def test_the_freshest_gauges_win_not_the_newest_report():
    # With --api-server-count 2, the steps' stats went to API server 0 lately: API server 1 still
    # reports (its URL matters) the gauges of the last step it saw, in a newer report.
    loads = LoadReports()
    loads.add(("m", "w"), report(0, 1.0, running=2, queries=30, read=0.9), heard=10.0)
    loads.add(("m", "w"), report(1, 1.5, running=9, queries=0, read=0.2), heard=10.5)
    (got, age), = loads.latest(now=11.0).values()
    assert (got.api_rank, got.running, got.ts, age) == (0, 2, 1.0, 0.5)  # API server 0's gauges; heard 0.5 s ago
    assert got.prefix_cache_queries == 30
    # The engine went idle: both report again, neither had a step; API server 0's last step is
    # still the latest, so its gauges stand (not the newest report's).
    loads.add(("m", "w"), report(0, 4.0, running=2, read=0.9), heard=13.0)
    loads.add(("m", "w"), report(1, 4.5, running=9, read=0.2), heard=13.5)
    (got, _), = loads.latest(now=14.0).values()
    assert (got.api_rank, got.running) == (0, 2)
    # A report without gauges_ts (an older producer) read them at its ts.
    loads.add(("m", "w"), report(0, 5.0, running=3), heard=14.0)
    loads.add(("m", "w"), report(1, 5.5, running=9, read=0.2), heard=14.5)
    (got, _), = loads.latest(now=14.6).values()
    assert (got.api_rank, got.running) == (0, 3)


def test_fresh_gauges_of_a_report_no_longer_current_do_not_count():
    # API server 0 stopped reporting (gone) right after a step: its last report is older than two
    # of its intervals, so API server 1's gauges stand however old they are.
    loads = LoadReports()
    loads.add(("m", "w"), report(0, 1.0, running=2, read=0.99), heard=10.0)
    loads.add(("m", "w"), report(1, 4.0, running=5, read=0.5), heard=13.0)
    (got, _), = loads.latest(now=13.1).values()
    assert (got.api_rank, got.running) == (1, 5)


def test_a_forgotten_worker_has_no_load():
    loads = LoadReports()
    loads.add(("m", "w"), report(0, 1.0), heard=1.0)
    loads.add(("m", "v"), report(0, 1.0), heard=1.0)
    loads.forget(("m", "w"))
    loads.forget(("m", "gone"))  # never heard: nothing to do
    assert list(loads.latest(now=2.0)) == [("m", "v")]


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_a_load_message_is_parsed_by_subject_and_content_type(fmt):
    r = report(1, 3.0, running=2)
    headers = {HDR_CONTENT_TYPE: CONTENT_TYPES[fmt]}
    assert parse_load_msg("kv.load.m.w", headers, encode_load_report(r, fmt), "kv") == (("m", "w"), r)
    with pytest.raises(DecodeError):
        parse_load_msg("kv.events.m.w", headers, encode_load_report(r, fmt), "kv")
    with pytest.raises(DecodeError):
        parse_load_msg("kv.load.m.w", {HDR_CONTENT_TYPE: "text/plain"}, encode_load_report(r, fmt), "kv")
    with pytest.raises(DecodeError):
        parse_load_msg("kv.load.m.w", headers, b"\xc1 not a report", "kv")


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_reports_of_older_and_newer_producers_decode(fmt):
    import msgspec

    enc = msgspec.msgpack.encode if fmt == "msgpack" else msgspec.json.encode
    # An older producer: no url, no gauges_ts (read as "at ts").
    old = decode_load_report(enc({"ts": 2.0, "running": 4, "api_rank": 1}), fmt)
    assert (old.running, old.url, old.gauges_ts) == (4, None, None)
    # A newer one: a field this version does not know is left out, not an error.
    new = decode_load_report(enc({"ts": 2.0, "running": 4, "gauges_ts": 1.5, "future_field": [1, 2]}), fmt)
    assert (new.running, new.gauges_ts) == (4, 1.5)
