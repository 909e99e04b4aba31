"""Stream status: Ignite's consumer metrics, slot lag, and robustness when the source is away."""

from __future__ import annotations


from test_gaps_kit import land_chain
from tidemark.control import Control, open_control
from tidemark.control import control_dsn
from tidemark.capture.source import drop_slot
from tidemark.status import stream_status



def _source_lag(conn, slot: str) -> tuple[int, int]:
    with conn.cursor() as cur:
        cur.execute("""SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::numeric::bigint,
                              (pg_current_wal_lsn() - '0/0'::pg_lsn)::numeric::bigint
                         FROM pg_replication_slots WHERE slot_name = %s""", (slot,))
        return cur.fetchone()


def test_status_reports_consumer_metrics_and_records_them(stream, source_conn):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 3)
    with Control(control_dsn(cfg)) as ctl:
        ctl.advance_frontier(cfg.stream, chain[1].upper)
        ctl.open_incident(cfg.stream, "gap", {"seq": 9})
    with source_conn.cursor() as cur:
        cur.execute("INSERT INTO public.items SELECT g, repeat('x', 100) FROM generate_series(1, 500) g")
    confirmed, before = _source_lag(source_conn, cfg.source.slot)
    status = stream_status(cfg)
    _, after = _source_lag(source_conn, cfg.source.slot)
    assert status["current_segment"] == 2                      # newest landed
    assert status["committed_segment"] == 1                    # newest with upper <= frontier
    assert status["committed_position"] == status["frontier"] == chain[1].upper
    assert status["landed_upper"] == chain[2].upper and status["consistent_lsn"] == start
    assert status["slot_confirmed_flush_lsn"] == confirmed == start
    assert before - confirmed <= status["slot_lag_bytes"] <= after - confirmed
    assert status["slot_lag_bytes"] > 500 * 100                # the insert's WAL is not confirmed
    assert status["slot_error"] is None and status["slot_exists"] is True
    assert status["open_incidents"] == 1 and status["incidents"][0]["kind"] == "gap"
    assert status["pending_segments"] == 1
    with Control(control_dsn(cfg)) as ctl:
        metrics = ctl.metrics(cfg.stream)
    assert metrics["current_segment"] == 2 and metrics["committed_segment"] == 1
    assert metrics["committed_position"] == chain[1].upper
    assert metrics["slot_lag_bytes"] == status["slot_lag_bytes"]
    assert metrics["last_segment_at"] == status["last_segment_at"] is not None


def test_status_of_a_new_stream_has_no_segments(stream):
    cfg, start, table = stream
    status = stream_status(cfg)
    assert (status["current_segment"], status["committed_segment"], status["last_segment_at"]) == (None, None, None)
    assert status["slot_lag_bytes"] >= 0


def test_status_survives_an_unreachable_source(stream, monkeypatch):
    cfg, start, table = stream
    land_chain(cfg, table, start, 2)
    monkeypatch.setenv(f"AIRFLOW_CONN_{cfg.source.connection.upper()}", "postgresql://postgres@127.0.0.1:1/nowhere")
    status = stream_status(cfg)
    assert "cannot connect to the source" in status["slot_error"]
    assert status["slot_lag_bytes"] is None and status["slot_exists"] is None
    assert status["current_segment"] == 1                      # the control side is still reported
    with Control(control_dsn(cfg)) as ctl:
        assert ctl.metrics(cfg.stream)["current_segment"] == 1


def test_status_reports_a_dropped_slot(stream):
    cfg, start, table = stream
    drop_slot(cfg)
    status = stream_status(cfg)
    assert status["slot_exists"] is False and "does not exist" in status["slot_error"]
    assert status["slot_lag_bytes"] is None


def test_tasks_measure_the_storage_at_most_every_max_age(stream, monkeypatch):
    """The drain and consolidate tasks record metrics on the way of every change: with ``storage_max_age``
    the storage (a walk of the lake and the landing store) is measured only when the recorded figures
    are older; the positions and slot lag are read fresh every time."""
    import tidemark.status as status_mod

    cfg, start, table = stream
    land_chain(cfg, table, start, 2)
    first = stream_status(cfg)                       # measures and records
    assert first["storage"] is not None and first["storage_error"] is None

    def walk(cfg):
        raise AssertionError("the storage was measured again inside max_age")
    monkeypatch.setattr(status_mod, "stream_storage", walk)
    again = stream_status(cfg, storage_max_age=600)
    assert again["storage"] == first["storage"] and again["storage_error"] is None
    assert again["landed_upper"] == first["landed_upper"]
    measured = []
    monkeypatch.setattr(status_mod, "stream_storage", lambda cfg: measured.append(1) or first["storage"])
    stream_status(cfg, storage_max_age=0)            # older than 0 s: measured again
    stream_status(cfg)                               # `tidemark status`: always measured
    assert measured == [1, 1]
    # the tasks' own call: records the positions and a metrics sample, the storage only when older
    with open_control(cfg) as ctl:
        samples = len(ctl.metrics_history(cfg.stream))
    recorded = status_mod.record_metrics(cfg)
    assert recorded["landed_upper"] == first["landed_upper"] and recorded["storage_error"] is None
    assert measured == [1, 1]
    status_mod.record_metrics(cfg, storage_max_age=0)
    assert measured == [1, 1, 1]
    with open_control(cfg) as ctl:
        assert len(ctl.metrics_history(cfg.stream)) == samples + 2
