"""Tables added to and removed from a running stream (real PostgreSQL, real slot, real Spark).

A table added to the stream file waits (its changes land, nothing fails, every other table goes on);
`snapshot --mode add` copies it at a consistent point of its own under a temporary slot while writes
continue on every table; the lake then equals the source for every table. A table removed from the
file is frozen: the others go on, its lake table stays as it was.
"""

from __future__ import annotations

import threading

import psycopg2
import pytest

from tidemark.capture.snapshot import SnapshotError, snapshot_stream
from tidemark.capture.source import apply_stream, slot_info
from tidemark.config import parse_config
from tidemark.control import Control, control_dsn
from tidemark.status import stream_status
from tidemark.lake import read_table

from oracle import assert_lake_equals_source, consolidate, drain_until_current, rows


def _with_tables(cfg, tables):
    doc = cfg.as_dict()
    doc["source"]["tables"] = list(tables)
    return parse_config(doc, origin="<test>")


def _work(dsn: str, rounds: int, seed: int) -> None:
    """Transactions on both tables: inserts, updates that leave the TOASTed ``big`` alone, key
    changes, deletes."""
    conn = psycopg2.connect(dsn)
    try:
        for i in range(rounds):
            k = seed * 10_000 + i
            with conn, conn.cursor() as cur:
                cur.execute("INSERT INTO public.a VALUES (%s, 'a-new')", (k,))
                cur.execute("UPDATE public.a SET v = v || '+' WHERE id = %s", (i % 150 + 1,))
                cur.execute("INSERT INTO public.b VALUES (%s, 'b-new', repeat('y', 4000))", (k,))
                cur.execute("UPDATE public.b SET v = 'u' || %s WHERE id = %s", (i, i % 250 + 1))
                cur.execute("UPDATE public.b SET id = id + 500000 WHERE id = %s", (i % 250 + 20,))
                cur.execute("DELETE FROM public.b WHERE id = %s", (i % 250 + 40,))
    finally:
        conn.close()


def test_a_table_added_to_a_running_stream_is_snapshotted_alone_while_the_stream_goes_on(
        make_stream, source_conn, source_db, spark):
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.a (id int PRIMARY KEY, v text)")
        cur.execute("CREATE TABLE public.b (id int PRIMARY KEY, v text, big text)")
        cur.execute("ALTER TABLE public.b ALTER COLUMN big SET STORAGE EXTERNAL")
        cur.execute("INSERT INTO public.a SELECT g, 'a' || g FROM generate_series(1, 200) g")
        cur.execute("INSERT INTO public.b SELECT g, 'b' || g, repeat('x', 3000) FROM generate_series(1, 300) g")
    only_a = make_stream(["public.a"])
    snapshot_stream(only_a)
    drain_until_current(only_a)
    consolidate(only_a, spark)
    slot_before = slot_info(only_a)
    with Control(control_dsn(only_a)) as ctl:
        consistent_before = ctl.stream(only_a.stream).consistent_lsn

    # b joins the stream file: applied, its changes land, and they wait; a goes on
    both = _with_tables(only_a, ["public.a", "public.b"])
    apply_stream(both)
    with Control(control_dsn(both)) as ctl:
        assert ctl.table_states(both.stream) == {"public.b": ("awaiting_snapshot", None)}
    _work(source_db, 20, 1)
    drain_until_current(both)
    res = consolidate(both, spark)
    assert "public.b" in res.waiting and "--mode add --tables public.b" in res.waiting["public.b"]
    from tidemark.status import overview

    (page,) = overview([both])
    assert {t["table"]: (t["state"], t["position"]) for t in page["tables"]}["public.b"] == ("awaiting_snapshot", None)
    assert_lake_equals_source(both, "public.a")
    assert not res.incident

    # the snapshot of b alone, while both tables take writes
    writer = threading.Thread(target=_work, args=(source_db, 40, 2))
    writer.start()
    result = snapshot_stream(both, tables=["public.b"], mode="add")
    writer.join()
    assert set(result.tables) == {"public.b"}
    info = slot_info(both)
    assert info.name == slot_before.name                     # the stream's own slot was never touched
    with Control(control_dsn(both)) as ctl:
        assert ctl.table_states(both.stream)["public.b"] == ("capturing", result.lsn)
        assert ctl.stream(both.stream).consistent_lsn == consistent_before    # the stream's positions stay
    _work(source_db, 10, 3)
    drain_until_current(both)
    res = consolidate(both, spark)
    assert res.waiting == {} and res.snapshots_loaded == [result.snapshot_id]
    assert_lake_equals_source(both, "public.a")
    assert_lake_equals_source(both, "public.b")
    with pytest.raises(SnapshotError, match=r"public.b is captured already .*--mode table --tables public.b$"):
        snapshot_stream(both, tables=["public.b"], mode="add")

    # b leaves the stream file: frozen where it was; a goes on
    frozen = rows(read_table(both, "public.b"))
    apply_stream(only_a)
    _work(source_db, 10, 4)
    drain_until_current(only_a)
    res = consolidate(only_a, spark)
    assert_lake_equals_source(only_a, "public.a")
    assert rows(read_table(only_a, "public.b")) == frozen
    status = stream_status(only_a)
    assert status["table_states"]["public.b"]["state"] == "frozen"
    from tidemark.status import overview

    (page,) = overview([only_a])       # the status page: each table's own state and position
    by_table = {t["table"]: t for t in page["tables"]}
    assert by_table["public.b"]["state"] == "frozen" and by_table["public.a"]["state"] == "captured"
    assert by_table["public.a"]["position"] == page["frontier"]


def test_add_needs_a_running_stream_and_a_table_added_to_it(make_stream, source_conn):
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.c (id int PRIMARY KEY)")
    cfg = make_stream(["public.c"])
    apply_stream(cfg)
    with pytest.raises(SnapshotError, match="is not capturing yet"):
        snapshot_stream(cfg, tables=["public.c"], mode="add")
    snapshot_stream(cfg)
    with pytest.raises(SnapshotError, match="public.c is captured already"):
        snapshot_stream(cfg, tables=["public.c"], mode="add")


def test_an_initial_snapshot_of_some_tables_leaves_the_others_waiting_not_diverging(make_stream, source_conn, spark):
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.d (id int PRIMARY KEY, v text)")
        cur.execute("CREATE TABLE public.e (id int PRIMARY KEY, v text)")
        cur.execute("INSERT INTO public.d SELECT g, 'd' FROM generate_series(1, 50) g")
        cur.execute("INSERT INTO public.e SELECT g, 'e' FROM generate_series(1, 50) g")
    cfg = make_stream(["public.d", "public.e"])
    first = snapshot_stream(cfg, tables=["public.d"])
    assert first.waiting == ["public.e"]
    with source_conn.cursor() as cur:               # e's rows were never copied: an update of one of them
        cur.execute("UPDATE public.e SET v = 'changed' WHERE id <= 10")
        cur.execute("UPDATE public.d SET v = 'changed' WHERE id <= 10")
    drain_until_current(cfg)
    res = consolidate(cfg, spark)                   # d goes on; e waits instead of stopping the stream
    assert set(res.waiting) == {"public.e"} and not res.incident
    assert_lake_equals_source(cfg, "public.d")
    snapshot_stream(cfg, tables=["public.e"])       # initial on a running stream: e is taken as with add
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg, "public.d")
    assert_lake_equals_source(cfg, "public.e")


def test_generated_columns_are_named_as_not_captured_by_apply_and_parity(make_stream, source_conn, spark):
    from tidemark.parity import parity_report

    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.g (id int PRIMARY KEY, price int, qty int, "
                    "total int GENERATED ALWAYS AS (price * qty) STORED)")
        cur.execute("INSERT INTO public.g (id, price, qty) SELECT g, g, 2 FROM generate_series(1, 20) g")
    cfg = make_stream(["public.g"])
    notes: list[str] = []
    apply_stream(cfg, notes=notes)
    assert len(notes) == 1 and "public.g column(s) total are GENERATED" in notes[0] and "not captured" in notes[0]
    snapshot_stream(cfg)
    with source_conn.cursor() as cur:
        cur.execute("UPDATE public.g SET qty = 3 WHERE id <= 5")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert read_table(cfg, "public.g").column_names == ["id", "price", "qty"]
    report = parity_report(cfg)["public.g"]
    assert report["equal"] and report["not_captured"] == ["total"]


def test_one_table_re_snapshotted_online_is_corrected_and_its_changelog_holds_only_the_difference(
        make_stream, source_conn, source_db, spark):
    from deltalake import DeltaTable

    from tidemark.lake import read_changelog, table_uri

    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.r (id int PRIMARY KEY, v text, big text)")
        cur.execute("ALTER TABLE public.r ALTER COLUMN big SET STORAGE EXTERNAL")
        cur.execute("CREATE TABLE public.m (x int, s text)")
        cur.execute("ALTER TABLE public.m REPLICA IDENTITY FULL")
        cur.execute("INSERT INTO public.r SELECT g, 'r' || g, repeat('z', 3000) FROM generate_series(1, 200) g")
        cur.execute("INSERT INTO public.m SELECT g % 7, 'm' FROM generate_series(1, 100) g")
    cfg = make_stream(["public.r", "public.m"])
    snapshot_stream(cfg)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    # the lake of r goes wrong behind Tidemark's back (a bad restore, a manual fix gone wrong)
    DeltaTable(table_uri(cfg, "public.r")).delete("id <= 3")
    DeltaTable(table_uri(cfg, "public.m")).delete("x = 1")

    def writes():
        conn = psycopg2.connect(source_db)
        try:
            for i in range(30):
                with conn, conn.cursor() as cur:
                    cur.execute("UPDATE public.r SET v = 'w' || %s WHERE id = %s", (i, 100 + i))
                    cur.execute("UPDATE public.r SET id = id + 1000 WHERE id = %s", (150 + i,))
                    cur.execute("INSERT INTO public.m VALUES (%s, 'n')", (i % 5,))
                    cur.execute("DELETE FROM public.m WHERE ctid IN (SELECT ctid FROM public.m WHERE x = 3 LIMIT 1)")
        finally:
            conn.close()

    writer = threading.Thread(target=writes)
    writer.start()
    fixed = snapshot_stream(cfg, tables=["public.r", "public.m"], mode="table")
    writer.join()
    drain_until_current(cfg)
    res = consolidate(cfg, spark)
    assert res.snapshots_loaded == [fixed.snapshot_id]
    assert_lake_equals_source(cfg, "public.r")
    assert_lake_equals_source(cfg, "public.m")
    at = [r for r in read_changelog(cfg, "public.r").to_pylist() if r["_time"] == fixed.lsn]
    assert sorted((r["id"], r["_diff"]) for r in at) == [(1, 1), (2, 1), (3, 1)]      # exactly the correction
    at = [r for r in read_changelog(cfg, "public.m").to_pylist() if r["_time"] == fixed.lsn]
    with source_conn.cursor() as cur:            # the rows taken out behind Tidemark's back come back
        cur.execute("SELECT count(*) FROM public.m WHERE x = 1 AND s = 'm'")
        ones = cur.fetchone()[0]
    assert [(r["x"], r["s"], r["_diff"]) for r in at] == [(1, "m", ones)]
    # the same through a resend of one table while the slot is intact: nothing to correct, nothing logged
    again = snapshot_stream(cfg, tables=["public.r"], mode="resend")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg, "public.r")
    assert [r for r in read_changelog(cfg, "public.r").to_pylist() if r["_time"] == again.lsn] == []
