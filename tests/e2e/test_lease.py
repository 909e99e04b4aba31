"""The stream lock is a lease: when its connection is terminated from PostgreSQL
(``pg_terminate_backend``) another job could take the stream, so the job that lost it stops before
its next position-moving commit (segment registration, frontier, slot) and commits nothing."""

from __future__ import annotations

import psycopg2
import pytest

import tidemark.capture.drain as drain_mod
from adversarial_kit import assert_lake_equals_source, consolidate, drain_until_current
from tidemark.capture.drain import drain_stream
from tidemark.capture.snapshot import snapshot_stream
from tidemark.capture.source import slot_info
from tidemark.control import Control, control_dsn
from tidemark.errors import LeaseLost


def _exec(conn, *stmts):
    with conn.cursor() as cur:
        for s in stmts:
            cur.execute(s)


def terminate_lock(cfg, purpose: str) -> None:
    """Terminate the backend holding the stream's lock, then show another job can now take it."""
    conn = psycopg2.connect(control_dsn(cfg))
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("""SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                            WHERE application_name = %s""", (f"tidemark-lock:{cfg.stream}:{purpose}",))
            assert [r[0] for r in cur.fetchall()] == [True]
    finally:
        conn.close()
    import time

    deadline = time.monotonic() + 10
    while True:       # the terminated backend releases the lock as it exits
        try:
            with Control(control_dsn(cfg)) as other, other.stream_lock(cfg.stream, purpose):
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def stream(make_stream, source_conn):
    _exec(source_conn, "CREATE TABLE t (id int PRIMARY KEY, v text)",
          "INSERT INTO t SELECT i, 'v' FROM generate_series(1, 50) i")
    cfg = make_stream(["public.t"], drain={"ack_policy": "landed"})
    snapshot_stream(cfg)
    _exec(source_conn, "INSERT INTO t VALUES (100, 'new')", "UPDATE t SET v = 'u' WHERE id < 10")
    return cfg


def test_drain_that_lost_its_lock_registers_nothing(stream, monkeypatch):
    real = drain_mod.put_stream_if_absent

    def put_then_lose_lock(*args, **kwargs):
        out = real(*args, **kwargs)
        terminate_lock(stream, "drain")
        return out

    monkeypatch.setattr(drain_mod, "put_stream_if_absent", put_then_lose_lock)
    with Control(control_dsn(stream)) as ctl:
        before = ctl.stream(stream.stream)
    confirmed = slot_info(stream).confirmed_flush_lsn
    with pytest.raises(LeaseLost, match="drain lock .* was lost; stopped before: register segment 0"):
        drain_stream(stream)
    with Control(control_dsn(stream)) as ctl:
        assert ctl.segments(stream.stream, status=None) == []
        after = ctl.stream(stream.stream)
    assert (after.landed_upper, after.next_seq) == (before.landed_upper, before.next_seq)
    assert slot_info(stream).confirmed_flush_lsn == confirmed      # the slot was not acknowledged either
    monkeypatch.setattr(drain_mod, "put_stream_if_absent", real)
    res = drain_stream(stream)         # the same range again: the same file, now registered
    assert res.registered and res.records == 1 + 9 * 2     # one insert, nine updates (-1, +1)


@pytest.mark.spark
@pytest.mark.slow
def test_consolidation_that_lost_its_lock_does_not_move_the_frontier(stream, spark, monkeypatch):
    from tidemark.consolidate import committed as committed_mod, job as job_mod

    drain_until_current(stream)
    real = committed_mod.commit_tables

    def commit_then_lose_lock(*args, **kwargs):
        out = real(*args, **kwargs)
        terminate_lock(stream, "consolidate")
        return out

    monkeypatch.setattr(committed_mod, "commit_tables", commit_then_lose_lock)
    with pytest.raises(LeaseLost, match="consolidate lock .* was lost; stopped before: advance the frontier"):
        job_mod.consolidate_stream(stream, spark=spark)
    with Control(control_dsn(stream)) as ctl:
        assert ctl.stream(stream.stream).frontier is None
    monkeypatch.setattr(committed_mod, "commit_tables", real)
    consolidate(stream, spark)          # the lake commit is already there: applied once, not twice
    assert_lake_equals_source(stream)
