"""The metrics history behind the status page: each `stream_status` appends a sample (slot lag in
bytes and time, changes landed), rates come out per second, the history is bounded, and `overview`
gives the page's data from the control database."""

from __future__ import annotations

import time

import pytest

from tidemark.capture.drain import drain_stream
from tidemark.control import Control, control_dsn
from tidemark.status import overview, stream_status


def test_samples_give_lag_in_time_and_changes_per_second(stream, source_conn, make_stream):
    cfg, start, _ = stream
    first = stream_status(cfg)
    time.sleep(0.5)
    with source_conn.cursor() as cur:
        cur.execute("INSERT INTO public.items SELECT g, 'v' || g FROM generate_series(1, 300) g")
    landed = drain_stream(cfg)
    assert landed.records == 300
    second = stream_status(cfg)

    with Control(control_dsn(cfg)) as ctl:
        history = ctl.metrics_history(cfg.stream)
        assert [h["landed_changes"] for h in history] == [0, 300]
        assert [h["landed_upper"] for h in history] == [first["landed_upper"], landed.upper]
        gap = (history[1]["at"] - history[0]["at"]).total_seconds()
        assert history[0]["changes_per_second"] is None                  # no earlier sample
        assert history[1]["changes_per_second"] == pytest.approx(300 / gap, rel=1e-6)
        # nothing is consolidated, so the slot is still confirmed at its consistent point: its WAL has been
        # waiting at least since the first sample, which already saw the source past that point
        assert history[1]["confirmed_lsn"] == start < history[1]["source_lsn"]
        assert second["slot_lag_seconds"] == history[1]["slot_lag_seconds"] >= gap
        assert history[1]["slot_lag_bytes"] == second["slot_lag_bytes"] > 0

        # bounded: a row cap prunes the oldest samples
        for _ in range(3):
            ctl.record_metrics_sample(cfg.stream, frontier=None, landed_upper=landed.upper, source_lsn=None,
                                      confirmed_lsn=None, slot_lag_bytes=None, current_segment=0,
                                      committed_segment=None, keep_rows=2)
        assert len(ctl.metrics_history(cfg.stream)) == 2
        ctl.open_incident(cfg.stream, "bad_segment", {"reason": "<b>checksum</b> mismatch"})

    unregistered = make_stream(["public.items"])
    page = {s["stream"]: s for s in overview([cfg, unregistered])}
    assert page[unregistered.stream]["registered"] is False and "not registered" in page[unregistered.stream]["error"]
    mine = page[cfg.stream]
    assert mine["landed_upper"] == landed.upper and mine["frontier"] is None   # nothing consolidated yet
    assert mine["current_segment"] == landed.seq and mine["committed_segment"] is None
    assert [s["seq"] for s in mine["segments"]] == [landed.seq]
    assert mine["segments"][0]["record_count"] == 300
    assert [i["detail"]["reason"] for i in mine["incidents"]] == ["<b>checksum</b> mismatch"]
    assert len(mine["history"]) == 2


def test_an_unreachable_control_database_is_reported_not_raised(make_stream, monkeypatch):
    cfg = make_stream(["public.items"])
    monkeypatch.setenv(f"AIRFLOW_CONN_{cfg.control_connection.upper()}", "postgresql://postgres@127.0.0.1:1/x")
    (entry,) = overview([cfg])
    assert entry["registered"] is False and entry["error"].startswith("control database unavailable")
