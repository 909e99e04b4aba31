"""Idle streams are free: progress-only segments move the frontier without any Spark job."""

from __future__ import annotations

from collections import Counter

import pytest

import tidemark.consolidate.job as job_mod
from consolidate_kit import Lander, rows_counter, shape, up
from tidemark.consolidate import consolidate_stream
from tidemark.consolidate.job import advance_if_idle
from tidemark.consolidate.job import ConsolidateFailed
from tidemark.lake import open_delta, read_table, table_uri

T = shape("t", [("k", "int32", True), ("v", "text")], oid=3)


def _stream(make_stream, control, lsn=100):
    cfg = make_stream(["public.t"], consolidate={"buckets": 2})
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=lsn, landed_upper=lsn)
    return cfg


def _no_spark(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a SparkSession was requested for an idle batch")

    monkeypatch.setattr(job_mod, "spark_session", refuse)


def test_progress_only_moves_frontier_without_spark(make_stream, control, monkeypatch):
    _no_spark(monkeypatch)
    cfg = _stream(make_stream, control)
    lander = Lander(cfg, control)
    lander.land(100, 200, [])
    lander.land(200, 300, [])
    res = consolidate_stream(cfg)               # no spark given, and none may be created
    assert res.spark is False and not res.skipped
    assert (res.frontier_before, res.frontier_after, res.segments) == (None, 300, [0, 1])
    assert control.stream(cfg.stream).frontier == 300
    assert control.subscriber_checkpoint(cfg.stream, "consolidate") == 300
    again = consolidate_stream(cfg)             # nothing new: skipped, still without Spark
    assert again.skipped and again.frontier_after == 300


def test_promised_counts_are_not_idle(make_stream, control, monkeypatch):
    """A progress-only segment that promises records it does not hold goes to Spark (which holds the
    frontier below the unmet time): the idle path never skips the completeness check."""
    _no_spark(monkeypatch)
    cfg = _stream(make_stream, control)
    lander = Lander(cfg, control)
    lander.land(100, 200, [], extra_counts={150: 1})
    assert advance_if_idle(cfg) is None
    with pytest.raises(ConsolidateFailed, match="SparkSession was requested"):
        consolidate_stream(cfg)
    assert control.stream(cfg.stream).frontier is None


def test_manifest_lying_about_records_is_not_idle(make_stream, control, monkeypatch):
    """The manifest says no records but the file holds one: the driver reads the file and hands the
    batch to Spark."""
    _no_spark(monkeypatch)
    cfg = _stream(make_stream, control)
    lander = Lander(cfg, control)
    data = lander.build(100, 200, [([up(T, {"k": 1, "v": "a"}, 110, 1, 0)], [])], seq=0)
    seg = lander.land(100, 200, [], data=data)
    assert seg.record_count == 0
    assert advance_if_idle(cfg) is None
    assert control.stream(cfg.stream).frontier is None


@pytest.mark.spark
def test_idle_after_data_keeps_the_lake(spark, make_stream, control, monkeypatch):
    cfg = _stream(make_stream, control)
    lander = Lander(cfg, control)
    lander.land(100, 200, [([up(T, {"k": 1, "v": "a"}, 110, 1, 0), up(T, {"k": 2, "v": "b"}, 110, 1, 1)], [])])
    assert consolidate_stream(cfg, spark=spark).frontier_after == 200
    version = open_delta(table_uri(cfg, "public.t")).version()
    lander.land(200, 300, [])
    real = job_mod.spark_session
    _no_spark(monkeypatch)
    res = advance_if_idle(cfg)
    assert res is not None and res.spark is False and res.frontier_after == 300
    assert open_delta(table_uri(cfg, "public.t")).version() == version
    assert rows_counter(read_table(cfg, "public.t")) == Counter({(1, "a"): 1, (2, "b"): 1})
    monkeypatch.setattr(job_mod, "spark_session", real)
    lander.land(300, 400, [([up(T, {"k": 1}, 310, -1, 0, image="key")], [])])
    res = consolidate_stream(cfg, spark=spark)
    assert res.spark is True and res.frontier_after == 400
    assert rows_counter(read_table(cfg, "public.t")) == Counter({(2, "b"): 1})
