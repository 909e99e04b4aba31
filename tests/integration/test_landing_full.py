"""The landing store fills up during a drain (a real tmpfs of 1 MiB): the drain stops with one line
naming the store, the segment and the space it needs; nothing is registered or half-written, the
slot is not acknowledged; once space returns the next drain lands everything and the lake equals
the source."""

from __future__ import annotations

import subprocess

import pytest

from tidemark.capture.drain import drain_stream
from tidemark.capture.snapshot import snapshot_stream
from tidemark.capture.source import slot_info
from tidemark.control import Control, control_dsn
from tidemark.landing.store import StoreFull

from oracle import consolidate, drain_until_current, rows, source_table


@pytest.fixture
def small_fs(tmp_path):
    from dbkit import small_tmpfs

    with small_tmpfs(tmp_path / "landing") as where:
        yield where


def test_a_full_landing_store_stops_the_drain_cleanly_and_the_next_drain_lands_everything(
        small_fs, make_stream, source_conn, spark):
    from tidemark.lake import read_table
    from tidemark.pgtypes.catalog import table_schema_from_catalog

    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.f (id int PRIMARY KEY, v text)")
        cur.execute("INSERT INTO public.f SELECT g, 'v' || g FROM generate_series(1, 100) g")
    cfg = make_stream(["public.f"], landing={"url": str(small_fs)})
    snapshot_stream(cfg)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    with Control(control_dsn(cfg)) as ctl:
        before = [s.seq for s in ctl.segments(cfg.stream, status=None)]
    confirmed = slot_info(cfg).confirmed_flush_lsn
    with source_conn.cursor() as cur:     # random text does not compress: more than the store holds
        cur.execute("INSERT INTO public.f SELECT g, string_agg(md5(random()::text), '') FROM "
                    "generate_series(1000, 5000) g, generate_series(1, 40) GROUP BY g")

    with pytest.raises(StoreFull) as err:
        drain_stream(cfg)
    line = str(err.value)
    assert "\n" not in line and str(small_fs) in line and "no space left" in line and "needs at least" in line
    with Control(control_dsn(cfg)) as ctl:
        assert [s.seq for s in ctl.segments(cfg.stream, status=None)] == before      # nothing registered
    assert not [p for p in small_fs.rglob("*") if p.name.startswith(".tmp-")]       # nothing half-written
    assert slot_info(cfg).confirmed_flush_lsn == confirmed                         # nothing acknowledged
    # it waits for a human: an incident (what the status page lists) says so in the same line, and the
    # next scheduled drain that meets it counts one more instead of opening another
    with pytest.raises(StoreFull):
        drain_stream(cfg)
    with Control(control_dsn(cfg)) as ctl:
        [incident] = [i for i in ctl.incidents(cfg.stream) if i["kind"] == "drain_failed"]
    assert incident["step"] == "drain" and incident["count"] == 2
    assert incident["reason"].startswith("StoreFull: ") and str(small_fs) in incident["reason"]

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_fs)], check=True)  # space returns
    drain_until_current(cfg)
    with Control(control_dsn(cfg)) as ctl:   # the drain that landed resolved it
        assert not [i for i in ctl.incidents(cfg.stream) if i["kind"] == "drain_failed"]
        assert [i for i in ctl.incidents(cfg.stream, open_only=False) if i["kind"] == "drain_failed"]
    consolidate(cfg, spark)
    expected = rows(source_table(source_conn, table_schema_from_catalog(source_conn, "public", "f")))
    assert rows(read_table(cfg, "public.f")) == expected
