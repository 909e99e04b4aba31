"""Resend: forget what cannot be replayed, re-snapshot at a new consistent point (real snapshot)."""

from __future__ import annotations

import pytest

from test_gaps_kit import (create_items, delete_row, items_schema, land_chain, landing_files, manifest_state,
                           start_stream)
from tidemark.control import Control
from tidemark.gaps import detect, landing_store, resend
from tidemark.capture.snapshot import load_manifest, read_snapshot_table
from tidemark.control import control_dsn
from tidemark.capture.source import drop_slot, slot_info

from refapply import arrow_rows, source_rows


@pytest.fixture
def stream(make_stream, source_conn):
    create_items(source_conn)
    with source_conn.cursor() as cur:
        cur.execute("INSERT INTO public.items SELECT g, 'v' || g FROM generate_series(1, 300) g")
    cfg = make_stream(["public.items"])
    start = start_stream(cfg)
    return cfg, start, items_schema(cfg)


def _statuses(cfg) -> list[str]:
    with Control(control_dsn(cfg)) as ctl:
        return [s.status for s in ctl.segments(cfg.stream, status=None)]


def test_dropped_slot_resend_takes_a_new_consistent_point_and_a_second_run_changes_nothing(stream, source_conn):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 3)
    drop_slot(cfg)
    with source_conn.cursor() as cur:                        # changes while the slot is gone
        cur.execute("UPDATE public.items SET v = 'changed' WHERE id <= 50")
        cur.execute("DELETE FROM public.items WHERE id > 250")
    assert detect(cfg).decision == "resend"
    result = resend(cfg)
    assert not result.skipped and result.forgotten == ()     # the landed segments were fine: nothing lost there
    info = slot_info(cfg)
    with Control(control_dsn(cfg)) as ctl:
        state = ctl.stream(cfg.stream)
        assert ctl.incidents(cfg.stream) == []
        [inc] = ctl.incidents(cfg.stream, open_only=False)
    assert inc["kind"] == "slot_lost" and result.snapshot_id in inc["resolution"]
    assert result.lsn > chain[-1].upper
    assert state.consistent_lsn == state.landed_upper == result.lsn == info.confirmed_flush_lsn
    # the new snapshot holds the source as of the new consistent point
    manifest = load_manifest(landing_store(cfg), cfg.stream, result.snapshot_id)
    assert manifest["mode"] == "resend" and manifest["lsn"] == result.lsn
    snap = read_snapshot_table(landing_store(cfg), manifest, "public.items")
    assert sorted(arrow_rows(snap)) == sorted(source_rows(source_conn, table))
    report = detect(cfg)
    assert (report.decision, report.action) == ("ok", "consolidate")   # the snapshot waits to be loaded
    state_before, files_before = manifest_state(cfg), landing_files(cfg)
    again = resend(cfg)
    assert again.skipped
    assert (manifest_state(cfg), landing_files(cfg)) == (state_before, files_before)


def test_resend_forgets_everything_from_the_first_unreplayable_gap_and_keeps_files(stream, source_conn):
    cfg, start, table = stream
    with source_conn.cursor() as cur:
        cur.execute("SET synchronous_commit = on")
        cur.execute("UPDATE public.items SET v = 'x' WHERE id < 100")
        cur.execute("SELECT (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::numeric::bigint")
        flushed = cur.fetchone()[0]
        width = (flushed - start) // 3 + 1
        land_chain(cfg, table, start, 5, width=width)
        delete_row(cfg, 1)                                   # lost; the slot is confirmed past it
        cur.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_flush_lsn())", (cfg.source.slot,))
    assert detect(cfg).decision == "resend"
    files = landing_files(cfg)
    result = resend(cfg, tables=["public.items"])
    assert result.forgotten == (2, 3, 4)
    assert _statuses(cfg) == ["landed", "forgotten", "forgotten", "forgotten"]
    assert landing_files(cfg).items() >= files.items()       # every segment file is still there
    assert result.tables == {"public.items": 300}
    report = detect(cfg)
    assert report.decision == "ok", report.reasons
    assert report.consistent_lsn == result.lsn > flushed


def test_resend_of_a_healthy_stream_is_skipped_unless_forced(stream):
    cfg, start, table = stream
    land_chain(cfg, table, start, 2)
    before = manifest_state(cfg)
    assert resend(cfg).skipped
    assert manifest_state(cfg) == before
    forced = resend(cfg, force=True)
    assert not forced.skipped and forced.forgotten == () and forced.lsn > start
