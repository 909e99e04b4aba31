"""Adversarial faults: a read-only landing directory, a segment truncated by hand, two
consolidations at once, a stream naming a missing table. Each must fail with a clear error that
names what is wrong, and lose nothing: once the fault is gone the lake equals the source."""

from __future__ import annotations

import os

import pytest

from adversarial_kit import consolidate, cycle, drain_until_current, snapshotted_t
from tidemark.control import Control
from tidemark.errors import ConfigError, StreamBusy
from tidemark.capture.snapshot import snapshot_stream
from tidemark.control import control_dsn
from tidemark.landing.store import file_uri_path

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _exec(conn, *stmts):
    with conn.cursor() as cur:
        for s in stmts:
            cur.execute(s)


@pytest.fixture
def stream(make_stream, source_conn):
    cfg = snapshotted_t(make_stream, source_conn, "INSERT INTO t SELECT i, 'v' FROM generate_series(1, 5) i", "t")
    _exec(source_conn, "INSERT INTO t VALUES (6, 'new')", "UPDATE t SET v = 'u' WHERE id = 1")
    return cfg


def test_missing_table_is_named(make_stream, source_conn):
    _exec(source_conn, "CREATE TABLE t (id int PRIMARY KEY)")
    cfg = make_stream(["t", "public.nope"])
    with pytest.raises(ConfigError, match=r"source\.tables\[1\].*public\.nope does not exist"):
        snapshot_stream(cfg)


def test_unwritable_landing_directory(stream, spark):
    """The segments directory cannot be written (a file stands where it should be: root ignores
    read-only modes): the drain fails naming the path, nothing is registered, and nothing is lost."""
    seg_dir = os.path.join(stream.landing.url, stream.stream, "segments")
    os.makedirs(os.path.dirname(seg_dir), exist_ok=True)
    open(seg_dir, "w").close()
    try:
        with pytest.raises(OSError, match="segments"):
            drain_until_current(stream)
        with Control(control_dsn(stream)) as ctl:
            assert ctl.segments(stream.stream) == []
    finally:
        os.unlink(seg_dir)
    cycle(stream, spark)


def test_truncated_segment_is_named_and_nothing_is_lost(stream, spark):
    drain_until_current(stream)
    with Control(control_dsn(stream)) as ctl:
        seg = ctl.segments(stream.stream)[-1]
        before = ctl.stream(stream.stream).frontier
    path = file_uri_path(seg.uri)
    data = open(path, "rb").read()
    with open(path, "wb") as fh:
        fh.write(data[: len(data) // 2])
    with pytest.raises(Exception) as err:
        consolidate(stream, spark)
    assert os.path.basename(path) in str(err.value), str(err.value)[-1500:]
    with Control(control_dsn(stream)) as ctl:
        assert ctl.stream(stream.stream).frontier == before      # nothing consolidated past the bad segment
    with open(path, "wb") as fh:
        fh.write(data)
    consolidate(stream, spark)
    cycle(stream, spark)


def test_second_concurrent_consolidation_is_refused(stream, spark):
    from tidemark.consolidate import consolidate_stream

    drain_until_current(stream)
    with Control(control_dsn(stream)) as ctl, ctl.stream_lock(stream.stream, "consolidate"):
        with pytest.raises(StreamBusy):
            consolidate_stream(stream, spark=spark)
    cycle(stream, spark)
