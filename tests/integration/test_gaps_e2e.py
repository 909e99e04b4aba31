"""Gap handling end to end: after a repair or a resend, consolidation brings the lake back to the
source (compared with SELECT on the source, at a quiet frontier)."""

from __future__ import annotations

import pytest

from test_gaps_kit import create_items, items_schema
from tidemark.control import Control
from tidemark.gaps import detect, landing_store, repair, resend
from tidemark.capture.snapshot import snapshot_stream
from tidemark.control import control_dsn
from tidemark.capture.source import drop_slot

from refapply import arrow_rows, source_rows

from oracle import consolidate as consolidate_all, drain_until_current

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def lake_equals_source(cfg, conn) -> None:
    from tidemark.lake import read_table

    table = items_schema(cfg)
    assert sorted(arrow_rows(read_table(cfg, "public.items"))) == sorted(source_rows(conn, table))


def _stream_with_drains(make_stream, source_conn):
    create_items(source_conn)
    with source_conn.cursor() as cur:
        cur.execute("SET synchronous_commit = on")
        cur.execute("INSERT INTO public.items SELECT g, 'v' || g FROM generate_series(1, 200) g")
    cfg = make_stream(["public.items"], drain={"idle_timeout_seconds": 0.5})
    snapshot_stream(cfg)
    for step in range(2):
        with source_conn.cursor() as cur:
            cur.execute("UPDATE public.items SET v = v || %s WHERE id %% 5 = %s", (str(step), step))
            cur.execute("INSERT INTO public.items VALUES (%s, 'new')", (1000 + step,))
        drain_until_current(cfg)
    return cfg


def test_repair_brings_the_lake_back_to_the_source(make_stream, source_conn, spark):
    cfg = _stream_with_drains(make_stream, source_conn)
    with Control(control_dsn(cfg)) as ctl:                  # a landed file disappears before consolidation
        victim = ctl.segments(cfg.stream)[0]
    landing_store(cfg).delete(f"{cfg.stream}/segments/{victim.uri.rsplit('/', 1)[-1]}")
    report = detect(cfg)
    assert report.decision == "repair"
    repair(cfg, report)
    consolidate_all(cfg, spark)
    lake_equals_source(cfg, source_conn)
    assert detect(cfg).action == "wait"


def test_resend_brings_the_lake_back_to_the_source(make_stream, source_conn, spark):
    cfg = _stream_with_drains(make_stream, source_conn)
    consolidate_all(cfg, spark)
    drop_slot(cfg)                                          # the slot is lost; changes happen meanwhile
    with source_conn.cursor() as cur:
        cur.execute("UPDATE public.items SET v = 'lost' WHERE id BETWEEN 11 AND 40")
        cur.execute("DELETE FROM public.items WHERE id > 190")
    assert detect(cfg).decision == "resend"
    resend(cfg)
    with source_conn.cursor() as cur:
        cur.execute("UPDATE public.items SET v = 'after' WHERE id <= 3")
    drain_until_current(cfg)
    consolidate_all(cfg, spark)
    lake_equals_source(cfg, source_conn)
    assert detect(cfg).action == "wait"
