"""Schema changes on a running stream without a full resend (real PostgreSQL, real slot, Spark).

ADD COLUMN with a non-volatile DEFAULT: the rows that existed take the value PostgreSQL records for
them (``attmissingval``), also the rows changed in the same batch before the ALTER, and the other
tables go on. RENAME COLUMN renames the lake column in place (told from a DROP and an ADD by the
column's attnum). What PostgreSQL records nothing for (a volatile DEFAULT, a column dropped and added
again) stops with one line naming the table and the per-table remedy, and that remedy — a
re-snapshot of the table while the stream runs, which the consolidate DAG's gap sensor and resend
step take by themselves — brings the lake back to the source.
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone

import psycopg2
import pytest

from tidemark import gaps
from tidemark.capture.snapshot import snapshot_stream
from tidemark.consolidate import ConsolidateError, consolidate_stream
from tidemark.consolidate.interval import write_changelog
from tidemark.control import open_control
from tidemark.lake import read_changelog, read_table

from oracle import assert_lake_equals_source, consolidate, drain_until_current, rows, snapshots_taken


def _sql(dsn: str, *statements) -> None:
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            for s in statements:
                cur.execute(s)
    finally:
        conn.close()


def _changelog_integral_is_the_lake(cfg, table: str, snapshot_lsn: int) -> None:
    """The snapshot's rows plus every change of the changelog equal the lake (what a subscriber
    reading the changelog from its start folds): no row taken out that was never put in."""
    from collections import Counter

    from oracle import row_tuples
    from tidemark.lake.history import read_table_at

    import pyarrow as pa

    from tidemark.lake import open_delta, table_info, table_uri
    from tidemark.lake.delta import missing_values

    lake = read_table(cfg, table)
    cols = lake.column_names
    base = read_table_at(cfg, table, snapshot_lsn - 1)
    fill = missing_values(table_info(open_delta(table_uri(cfg, table))))
    for f in lake.schema:        # columns added since: the DEFAULT the rows that existed took, else null
        if f.name not in base.column_names:
            base = base.append_column(f, pa.repeat(fill[f.name], base.num_rows) if f.name in fill
                                      else pa.nulls(base.num_rows, f.type))
    total = Counter(row_tuples(base.select(cols)))
    log = read_changelog(cfg, table)
    for row, diff in zip(row_tuples(log.select(cols)), log.column("_diff").to_pylist()):
        total[row] += diff
    assert all(n >= 0 for n in total.values()), "the changelog takes out a row it never put in"
    assert +total == rows(lake)


def _refused_then_re_snapshotted(cfg, spark, tables, refusal: str) -> None:
    """The consolidation of what was drained stops with ``refusal`` (naming public.d's per-table
    remedy); that remedy, a re-snapshot of public.d alone, brings every table back to the source."""
    drain_until_current(cfg)
    with pytest.raises(ConsolidateError, match=refusal):
        consolidate_stream(cfg, spark=spark)
    snapshot_stream(cfg, tables=["public.d"], mode="table")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    for t in tables:
        assert_lake_equals_source(cfg, t)


@pytest.fixture
def tables(source_conn):
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.d (id int PRIMARY KEY, v text, big text)")
        cur.execute("ALTER TABLE public.d ALTER COLUMN big SET STORAGE EXTERNAL")
        cur.execute("CREATE TABLE public.e (id int PRIMARY KEY, n int)")
        cur.execute("CREATE TABLE public.bag (g int, t text)")
        cur.execute("ALTER TABLE public.bag REPLICA IDENTITY FULL")
        cur.execute("INSERT INTO public.d SELECT g, 'v' || g, repeat('x', 3000) FROM generate_series(1, 300) g")
        cur.execute("INSERT INTO public.e SELECT g, g FROM generate_series(1, 50) g")
        cur.execute("INSERT INTO public.bag SELECT g % 5, 'b' FROM generate_series(1, 20) g")
    return ["public.d", "public.e", "public.bag"]


def test_add_column_with_a_default_takes_postgresqls_value_for_existing_rows_without_a_resend(
        make_stream, tables, source_db, spark):
    cfg = make_stream(tables)
    snap = snapshot_stream(cfg)
    _sql(source_db, "UPDATE public.d SET v = v || '+' WHERE id <= 20", "UPDATE public.e SET n = n + 1")
    drain_until_current(cfg)
    consolidate(cfg, spark)

    # one batch: changes before the ALTER (their images lack the new columns), the ALTER, changes after
    _sql(source_db, "UPDATE public.d SET v = 'before' WHERE id BETWEEN 21 AND 30",
         "INSERT INTO public.d VALUES (1001, 'new-before', repeat('y', 3000))")
    _sql(source_db, "ALTER TABLE public.d ADD COLUMN vip boolean NOT NULL DEFAULT false, "
                    "ADD COLUMN score numeric(6,2) DEFAULT 1.5, ADD COLUMN tag text DEFAULT 'a, \"b\" {c}', "
                    "ADD COLUMN since timestamptz DEFAULT '2026-01-02 03:04:05+00', ADD COLUMN plain int")
    _sql(source_db, "UPDATE public.d SET vip = true WHERE id BETWEEN 25 AND 35",
         "UPDATE public.d SET v = 'after' WHERE id BETWEEN 40 AND 45",        # TOAST left unchanged
         "UPDATE public.d SET id = id + 5000 WHERE id = 50",                  # a key change
         "DELETE FROM public.d WHERE id IN (60, 1001)",
         "INSERT INTO public.d (id, v, big, vip, score, tag) VALUES (2001, 'new', 'z', true, 9.25, 't')",
         "UPDATE public.e SET n = n * 2 WHERE id < 10")
    drain_until_current(cfg)
    res = consolidate(cfg, spark)
    assert not res.incident
    for t in tables:
        assert_lake_equals_source(cfg, t)
    _changelog_integral_is_the_lake(cfg, "public.d", snap.lsn)
    # a second run changes nothing (idempotent), and later batches keep the default for old images
    consolidate_stream(cfg, spark=spark)
    _sql(source_db, "UPDATE public.d SET v = 'later' WHERE id BETWEEN 100 AND 110")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    for t in tables:
        assert_lake_equals_source(cfg, t)
    _changelog_integral_is_the_lake(cfg, "public.d", snap.lsn)


def test_what_postgresql_records_nothing_for_names_the_per_table_remedy_which_works(
        make_stream, tables, source_db, spark):
    cfg = make_stream(tables)
    snapshot_stream(cfg)
    drain_until_current(cfg)
    consolidate(cfg, spark)

    # a volatile DEFAULT: PostgreSQL rewrites the rows and sends nothing for them
    _sql(source_db, "ALTER TABLE public.d ADD COLUMN r double precision DEFAULT random()",
         "UPDATE public.d SET v = 'after' WHERE id < 10", "UPDATE public.e SET n = 0 WHERE id = 1")
    drain_until_current(cfg)
    with pytest.raises(ConsolidateError) as err:
        consolidate_stream(cfg, spark=spark)
    first, remedy = str(err.value).splitlines()      # what and where; the remedy on a line of its own
    assert "public.d" in first and "column r added with DEFAULT random()" in first
    assert f"tidemark snapshot {cfg.stream} --mode table --tables public.d" in remedy
    # what the consolidate DAG does next by itself: the gap sensor finds no gap but the incident's
    # per-table cause, so its resend step re-snapshots that one table, not the stream
    report = gaps.detect(cfg)
    assert (report.decision, report.action, report.resnapshot) == ("ok", "resend", ("public.d",)), report
    _sql(source_db, "UPDATE public.e SET n = n + 100 WHERE id < 5")     # other tables keep changing
    done = gaps.resend(cfg)
    assert not done.skipped and set(done.tables) == {"public.d"} and "public.d" in done.reason, done
    again = gaps.detect(cfg)           # its snapshot waits to be loaded: not asked for twice
    assert (again.action, again.resnapshot) == ("consolidate", ()), again
    _sql(source_db, "UPDATE public.d SET v = 'then' WHERE id BETWEEN 10 AND 20")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    for t in tables:
        assert_lake_equals_source(cfg, t)
    with open_control(cfg) as ctl:     # the consolidation that loaded it closed the incident
        assert not [i for i in ctl.incidents(cfg.stream) if i["kind"] == "consolidate_failed"]
    assert gaps.detect(cfg).action in ("wait", "consolidate")

    # DROP COLUMN and ADD COLUMN of the same name in one batch (the names are the same, the order is
    # not): the catalog gives it a new attnum, and PostgreSQL sends nothing for the rows that
    # existed: the same remedy
    _sql(source_db, "ALTER TABLE public.d DROP COLUMN v", "ALTER TABLE public.d ADD COLUMN v text DEFAULT 'again'",
         "UPDATE public.d SET big = 'b' WHERE id = 2")
    _refused_then_re_snapshotted(cfg, spark, tables, r"column\(s\) v were dropped and added again.*--tables public\.d")

    # a table without a key: its rows are its identity, a DEFAULT changes them all: a resend, said so
    _sql(source_db, "ALTER TABLE public.bag ADD COLUMN k int DEFAULT 7", "INSERT INTO public.bag VALUES (1, 'n', 8)")
    drain_until_current(cfg)
    with pytest.raises(ConsolidateError, match=r"public\.bag: column\(s\) k .*without a key.*--mode resend"):
        consolidate_stream(cfg, spark=spark)


def _source_columns(dsn: str, table: str) -> list[str]:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                    "AND NOT attisdropped ORDER BY attnum", (table,))
        return [r[0] for r in cur.fetchall()]


def _subscriber_holds_the_lake(cfg, table: str) -> None:
    """What subscriber ``watcher`` (added right after the first snapshot) folds from every change it
    reads equals the lake table, column by column under the names the lake has now."""
    from collections import Counter

    from oracle import row_tuples
    from tidemark.subscribers import read_changes

    lake = read_table(cfg, table)
    changes = read_changes(cfg, "watcher").tables[table]
    held = Counter()
    for row, diff in zip(row_tuples(changes.select(lake.column_names)), changes.column("_diff").to_pylist()):
        held[row] += diff
    assert all(n >= 0 for n in held.values()), f"{table}: the changelog takes out a row it never put in"
    assert +held == rows(lake), table


def _writes(dsn: str, stop: threading.Event) -> None:
    """Changes on every table, naming no column that is renamed, until ``stop`` (each statement its
    own transaction: the renames take their tables' locks in one transaction)."""
    me = threading.current_thread()
    me.done = 0
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        while not stop.is_set():
            i = me.done
            with conn.cursor() as cur:
                cur.execute("INSERT INTO public.bag VALUES (%s, %s)", (100 + i % 3, f"w{i}"))
                cur.execute("UPDATE public.e SET n = n + 1 WHERE n %% 7 = %s", (i % 7,))
                cur.execute("UPDATE public.d SET big = big || 'w' WHERE id = %s", (200 + i % 50,))
            me.done += 1
            stop.wait(0.05)
    finally:
        conn.close()


def _all_follow(cfg, source_db, tables) -> None:
    """Every table equals the source under the source's column names, subscriber ``watcher`` folds
    to it, and the history tables' current versions are the lake's rows."""
    from tidemark.lake.history import read_history

    for t in tables:
        assert_lake_equals_source(cfg, t)
        lake = read_table(cfg, t)
        assert lake.column_names == _source_columns(source_db, t), t
        _subscriber_holds_the_lake(cfg, t)
        if t != "public.bag":       # no key: no history
            assert rows(read_history(cfg, t, current=True).select(lake.column_names)) == rows(lake), t


def test_rename_column_renames_the_lake_column_in_place_and_the_changelog_and_history_follow(
        make_stream, tables, source_db, spark):
    """RENAME COLUMN on a running stream — a column beside a TOASTed one, a key column, a keyless
    table's column — in one batch with changes before and after it (TOAST left unchanged, a key
    change, deletes, inserts): the lake column is renamed where it is, nothing is copied from the
    source (no snapshot), the changelog and the SCD2 history take the new name (the rename in their
    commit metadata), a subscriber reading from 0 still folds to the lake, and a second rename later
    (back and forth) works the same. Failed before: 'column(s) v disappeared and w appeared in one
    batch (RENAME COLUMN, or DROP and ADD COLUMN) ... re-snapshot that table'."""
    from tidemark.lake import changelog_uri, open_delta, storage_options
    from tidemark.subscribers import add_subscriber

    cfg = make_stream(tables, history="all")
    snapshot_stream(cfg)

    add_subscriber(cfg, "watcher")
    _sql(source_db, "UPDATE public.d SET v = v || '+' WHERE id <= 20", "UPDATE public.e SET n = n + 1")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    copies = snapshots_taken(cfg)
    start = datetime.now(timezone.utc)

    stop = threading.Event()
    writer = threading.Thread(target=_writes, args=(source_db, stop))    # a workload through the rename
    writer.start()
    _sql(source_db, "UPDATE public.d SET v = 'before' WHERE id BETWEEN 21 AND 30",
         "INSERT INTO public.bag VALUES (7, 'before')", "UPDATE public.e SET n = -n WHERE id < 5")
    _sql(source_db, "ALTER TABLE public.d RENAME COLUMN v TO w", "ALTER TABLE public.e RENAME COLUMN id TO eid",
         "ALTER TABLE public.bag RENAME COLUMN t TO label")
    _sql(source_db, "UPDATE public.d SET w = 'after' WHERE id BETWEEN 25 AND 35",       # TOAST left unchanged
         "UPDATE public.d SET id = id + 5000 WHERE id = 40", "DELETE FROM public.d WHERE id = 41",
         "INSERT INTO public.d (id, w, big) VALUES (3001, 'new', 'z')",
         "UPDATE public.e SET n = n * 2 WHERE eid BETWEEN 3 AND 9", "UPDATE public.e SET eid = eid + 100 WHERE eid = 10",
         "DELETE FROM public.bag WHERE g = 1", "INSERT INTO public.bag VALUES (8, 'after')")
    drain_until_current(cfg)
    res = consolidate(cfg, spark)      # the workload goes on meanwhile
    assert not res.incident
    stop.set()
    writer.join()
    assert writer.done > 5, writer.done
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert snapshots_taken(cfg) == copies == 1, "a snapshot was taken: a table was copied"
    _all_follow(cfg, source_db, tables)
    log = open_delta(changelog_uri(cfg, "public.d"), storage_options(cfg))
    names = [f.name for f in log.schema().fields]
    assert "w" in names and "v" not in names, names
    said = [h.get("tidemark") for h in log.history() if "rename" in str(h.get("tidemark"))]
    assert said and "'v': 'w'" in str(said[0]).replace('"', "'"), said
    # and so does the CDC feed: the first file whose fields have the new name says it in its header
    import io
    import json

    import fastavro

    from tidemark.consolidate.feed_files import changelog_key
    from tidemark.landing.store import open_store

    store = open_store(cfg.landing.url)
    prefix = changelog_key(cfg.stream, "public.d", 0, 0).rsplit("/", 1)[0] + "/"
    heads = [fastavro.reader(io.BytesIO(store.get(k))).metadata for k in sorted(store.list(prefix))
             if k.endswith(".avro")]
    assert [json.loads(h["tidemark.renamed"]) for h in heads if "tidemark.renamed" in h] == [{"v": "w"}], heads
    # the interval changelog (the changelog DAG), rebuilt from the segments across the rename over the
    # lake version before it: the same rows as the consolidation wrote
    out = write_changelog(cfg, start=start, end=datetime.now(timezone.utc), spark=spark)
    assert out["replaced"] == [] and out["tables"]["public.d"] > 0, out

    # back again, and a later batch: the same, and a re-run changes nothing
    _sql(source_db, "UPDATE public.d SET w = 'x' WHERE id = 1", "ALTER TABLE public.d RENAME COLUMN w TO v",
         "UPDATE public.d SET v = 'y' WHERE id = 2", "UPDATE public.e SET n = 0 WHERE eid = 3")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    consolidate_stream(cfg, spark=spark)
    _all_follow(cfg, source_db, tables)
    assert snapshots_taken(cfg) == 1

    # the source's catalog moved on after the drain (renamed again before the consolidation): not
    # trusted; the table's own re-snapshot (what the consolidate DAG does by itself) takes it, its
    # copy's attnums say which lake column it holds under the newest name
    _sql(source_db, "UPDATE public.d SET v = 'p' WHERE id = 3", "ALTER TABLE public.d RENAME COLUMN v TO w")
    _sql(source_db, "UPDATE public.d SET w = 'q' WHERE id = 4")
    drain_until_current(cfg)
    _sql(source_db, "ALTER TABLE public.d RENAME COLUMN w TO z")
    with pytest.raises(ConsolidateError, match=r"disappeared and .* appeared .*--mode table --tables public\.d"):
        consolidate_stream(cfg, spark=spark)
    report = gaps.detect(cfg)
    assert (report.action, report.resnapshot) == ("resend", ("public.d",)), report
    gaps.resend(cfg)
    _sql(source_db, "UPDATE public.d SET z = 'r' WHERE id = 5", "UPDATE public.e SET n = 7 WHERE eid = 4")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    _all_follow(cfg, source_db, tables)


def test_a_rename_whose_batch_failed_after_the_lake_was_renamed_resumes_without_a_copy(
        make_stream, tables, source_db, spark, monkeypatch):
    """The lake (its changelog, history and table) is renamed before the batch's merge; if the merge
    then fails, the re-run finds the lake renamed already while the batch's older changes still
    have the old name: the rename the lake's rewrite recorded maps them. Failed before: the re-run
    asked for a re-snapshot ('came and went within one batch')."""
    from tidemark.consolidate import batch as batch_mod

    cfg = make_stream(tables, history="all")
    snapshot_stream(cfg)
    _sql(source_db, "UPDATE public.d SET v = 'before' WHERE id < 10")
    _sql(source_db, "ALTER TABLE public.d RENAME COLUMN v TO w")
    _sql(source_db, "UPDATE public.d SET w = 'after' WHERE id BETWEEN 5 AND 15", "UPDATE public.e SET n = 0")
    drain_until_current(cfg)
    real = batch_mod._merge

    def failing(*a, **k):
        raise RuntimeError("injected: the merge job died")

    monkeypatch.setattr(batch_mod, "_merge", failing)
    with pytest.raises(ConsolidateError, match="injected"):
        consolidate_stream(cfg, spark=spark)
    monkeypatch.setattr(batch_mod, "_merge", real)
    assert "w" in read_table(cfg, "public.d").column_names          # renamed before the merge failed
    consolidate(cfg, spark)
    for t in tables:
        assert_lake_equals_source(cfg, t)
    assert snapshots_taken(cfg) == 1


def test_renames_around_a_re_snapshot_of_the_table_that_waits_to_be_loaded(make_stream, tables, source_db, spark):
    """A rename, then a re-snapshot of that table, then another rename before the copy is loaded (the
    copy waits for the frontier to reach its LSN): the copy's attnums map the lake's columns to its
    names, the catalog maps its names to the newest. Found by bench_snapshot --mode rename: the second
    rename's column was left null in the loaded copy."""
    cfg = make_stream(tables)
    snapshot_stream(cfg)
    _sql(source_db, "UPDATE public.d SET v = 'a' WHERE id < 5", "ALTER TABLE public.d RENAME COLUMN v TO w",
         "UPDATE public.d SET w = 'b' WHERE id BETWEEN 5 AND 9")
    drain_until_current(cfg)
    snapshot_stream(cfg, tables=["public.d"], mode="table")
    consolidate(cfg, spark)
    _sql(source_db, "UPDATE public.d SET w = 'c' WHERE id < 3", "ALTER TABLE public.d RENAME COLUMN w TO z",
         "UPDATE public.d SET z = 'd' WHERE id BETWEEN 3 AND 6", "UPDATE public.e SET n = 1")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    for t in tables:
        assert_lake_equals_source(cfg, t)
        assert read_table(cfg, t).column_names == _source_columns(source_db, t), t
    assert snapshots_taken(cfg) == 2


def test_a_name_in_place_of_a_column_within_one_batch_asks_for_the_re_snapshot_and_added_then_dropped_does_not(
        make_stream, tables, source_db, spark):
    """A column renamed and renamed back within one batch, changed meanwhile: by name its changes then
    hold a column that is in neither the lake nor the source (nor its attnum known): the table's
    re-snapshot, said so. A column added and dropped within one batch is harmless (its values go)."""
    cfg = make_stream(tables)
    snapshot_stream(cfg)
    _sql(source_db, "ALTER TABLE public.d ADD COLUMN tmp int", "UPDATE public.d SET tmp = 1, v = 'a' WHERE id < 5")
    _sql(source_db, "ALTER TABLE public.d DROP COLUMN tmp", "UPDATE public.d SET v = 'b' WHERE id = 7")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg, "public.d")
    _sql(source_db, "ALTER TABLE public.d RENAME COLUMN v TO tmp", "UPDATE public.d SET tmp = 'during' WHERE id < 5")
    _sql(source_db, "ALTER TABLE public.d RENAME COLUMN tmp TO v", "UPDATE public.d SET v = 'after' WHERE id = 9")
    _refused_then_re_snapshotted(cfg, spark, tables,
                                 r"column\(s\) tmp came and went .*--mode table --tables public\.d")


def _like_the_dag(cfg, spark, source_db, rounds: int = 4) -> list[str]:
    """What the consolidate DAG does on its own: consolidate; on a failure the gap sensor's branch
    chooses, and the resend step re-snapshots the table it names, while other sessions keep
    changing the source; return the tables re-snapshotted."""
    done = []
    for n in range(rounds):
        drain_until_current(cfg)
        try:
            consolidate(cfg, spark)
            return done
        except ConsolidateError:
            report = gaps.detect(cfg)
            assert (report.decision, report.action) == ("ok", "resend") and len(report.resnapshot) == 1, report
            result = gaps.resend(cfg)
            assert not result.skipped and list(result.tables) == list(report.resnapshot), result
            done += list(result.tables)
            _sql(source_db, f"UPDATE public.e SET n = n + 1 WHERE id = {n + 1}",
                 f"UPDATE public.d SET v = v || 'r{n}' WHERE id = {n + 1}")
    raise AssertionError(f"still failing after {rounds} re-snapshots: {done}")


def test_a_type_or_identity_change_replaces_that_table_alone_while_the_stream_runs(
        make_stream, tables, source_db, spark):
    """ALTER COLUMN TYPE (widening int to bigint, and text to int, whose old values no cast
    carries) and a primary-key change, on tables whose changelog already holds rows: the
    consolidation names the table; the re-snapshot of that table alone replaces it in the lake at
    its own LSN (its changelog restarts there when a type changed: the old rows stay readable as of
    before), the other tables flow on, and every table equals the source. Failed before: 'resend
    the stream', and that resend then failed too ('the changelog cannot hold both')."""
    from tidemark.lake.history import read_history, read_table_at
    from tidemark.subscribers import add_subscriber, read_changes

    cfg = make_stream(tables, history="all")       # SCD2 history tables of d and e (bag has no key)
    snapshot_stream(cfg)
    add_subscriber(cfg, "watcher")
    _sql(source_db, "UPDATE public.e SET n = n + 1000 WHERE id < 3")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    with psycopg2.connect(source_db) as conn, conn.cursor() as cur:
        cur.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
        before_alter = int(cur.fetchone()[0])
    e_then = rows(read_table(cfg, "public.e"))

    _sql(source_db, "UPDATE public.e SET n = n + 10 WHERE id < 5", "ALTER TABLE public.e ALTER COLUMN n TYPE bigint",
         "UPDATE public.e SET n = n * 3000000000 WHERE id BETWEEN 5 AND 8", "UPDATE public.d SET v = 'x' WHERE id < 4")
    assert _like_the_dag(cfg, spark, source_db) == ["public.e"]
    for t in tables:
        assert_lake_equals_source(cfg, t)
    # the changelog restarted with bigint; the table as of before the ALTER still reads (old rows, old type)
    assert rows(read_table_at(cfg, "public.e", before_alter)) == e_then
    # a subscriber reading from 0 across the restart folds to the lake (int values widen to bigint)
    from collections import Counter

    from oracle import row_tuples

    changes = read_changes(cfg, "watcher").tables["public.e"]
    held = Counter()
    for row, diff in zip(row_tuples(changes.drop_columns(["_time", "_diff", "_commit_ts"])),
                         changes.column("_diff").to_pylist()):
        held[row] += diff
    assert all(n >= 0 for n in held.values()) and +held == rows(read_table(cfg, "public.e"))

    _sql(source_db, "UPDATE public.d SET v = 'before' WHERE id BETWEEN 5 AND 9",
         "ALTER TABLE public.d DROP CONSTRAINT d_pkey", "ALTER TABLE public.d ADD PRIMARY KEY (id, v)",
         "UPDATE public.d SET big = 'changed' WHERE id BETWEEN 10 AND 12",
         "ALTER TABLE public.bag ALTER COLUMN t TYPE int USING length(t)", "INSERT INTO public.bag VALUES (9, 99)",
         "DELETE FROM public.e WHERE id = 50")
    assert sorted(_like_the_dag(cfg, spark, source_db)) == ["public.bag", "public.d"]
    for t in tables:
        assert_lake_equals_source(cfg, t)
    # later changes flow into the replaced tables as into any other
    _sql(source_db, "UPDATE public.d SET big = 'later' WHERE id = 20", "INSERT INTO public.bag VALUES (1, 1)",
         "UPDATE public.e SET n = -1 WHERE id = 9")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    for t in tables:
        assert_lake_equals_source(cfg, t)
    with open_control(cfg) as ctl:
        assert not [i for i in ctl.incidents(cfg.stream) if i["kind"] == "consolidate_failed"]
    for t in ("public.d", "public.e"):    # the history tables restarted with the new types and key: current = lake
        lake = read_table(cfg, t)
        assert rows(read_history(cfg, t, current=True).select(lake.column_names)) == rows(lake), t
