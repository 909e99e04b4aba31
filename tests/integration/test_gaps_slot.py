"""A slot invalidated by ``max_slot_wal_keep_size`` leads to a resend, and status survives a stopped
source. Uses a dedicated PostgreSQL cluster so that the shared one keeps its settings."""

from __future__ import annotations

import psycopg2
import pytest

from dbkit import destroy_own_cluster, start_own_cluster
from test_gaps_kit import create_items, items_schema, land_chain, start_stream
from tidemark.gaps import detect, repair
from tidemark.errors import GapError
from tidemark.capture.source import slot_info
from tidemark.status import stream_status


@pytest.fixture
def own_cluster():
    home, cluster = start_own_cluster("tidemark-gaps-pg-", {"fsync": "off", "max_slot_wal_keep_size": "1MB",
                                                            "shared_buffers": "32MB"})
    try:
        yield cluster
    finally:
        destroy_own_cluster(home, cluster)


def _invalidate(conn, cfg) -> None:
    """Write WAL and checkpoint until the slot's WAL is gone."""
    with conn.cursor() as cur:
        for _ in range(20):
            cur.execute("INSERT INTO public.items SELECT g, 'x' FROM generate_series(1, 2000) g "
                        "ON CONFLICT (id) DO UPDATE SET v = EXCLUDED.v || 'y'")
            cur.execute("SELECT pg_switch_wal()")
            cur.execute("CHECKPOINT")
            info = slot_info(cfg, conn)
            if info.wal_status == "lost":
                return
    raise AssertionError(f"slot was not invalidated: {slot_info(cfg, conn)}")


def test_invalidated_slot_chooses_resend_and_status_survives_a_stopped_source(own_cluster, make_stream, monkeypatch):
    own_cluster.ensure_database("src")
    cfg = make_stream(["public.items"])
    monkeypatch.setenv(f"AIRFLOW_CONN_{cfg.source.connection.upper()}", own_cluster.uri("src"))
    conn = psycopg2.connect(own_cluster.dsn("src"))
    conn.autocommit = True
    try:
        create_items(conn)
        start = start_stream(cfg)
        land_chain(cfg, items_schema(cfg), start, 2)
        assert detect(cfg).decision == "ok"
        _invalidate(conn, cfg)
    finally:
        conn.close()
    report = detect(cfg)
    assert [g.kind for g in report.gaps] == ["slot_lost"] and "wal_status=lost" in report.gaps[0].reason
    assert report.decision == report.action == "resend"
    with pytest.raises(GapError, match="resend is needed"):
        repair(cfg, report)
    status = stream_status(cfg)
    assert status["slot_wal_status"] == "lost" and "invalidated" in status["slot_error"]

    own_cluster.stop()
    status = stream_status(cfg)                               # the source is down: reported, not raised
    assert "cannot connect to the source" in status["slot_error"]
    assert status["current_segment"] == 1 and status["slot_lag_bytes"] is None
