"""Adversarial end-to-end oracles for schema changes mid-stream, values the lake type cannot hold,
many segments and several consolidations, two streams over one database."""

from __future__ import annotations

import pytest

from adversarial_kit import consolidate, cycle, drain_until_current
from tidemark.capture.snapshot import snapshot_stream
from tidemark.control import Control, control_dsn

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _exec(conn, *stmts):
    with conn.cursor() as cur:
        for s in stmts:
            cur.execute(s)


def test_add_column_without_default_and_drop_column(make_stream, source_conn, spark):
    _exec(source_conn, "CREATE TABLE t (id int PRIMARY KEY, a text, b text)",
          "INSERT INTO t SELECT i, 'a' || i, 'b' || i FROM generate_series(1, 6) i")
    cfg = make_stream(["t"])
    snapshot_stream(cfg)
    _exec(source_conn, "ALTER TABLE t ADD COLUMN c int", "INSERT INTO t VALUES (7, 'a7', 'b7', 7)",
          "UPDATE t SET c = 1 WHERE id = 2")
    cycle(cfg, spark)
    _exec(source_conn, "ALTER TABLE t DROP COLUMN a", "UPDATE t SET b = 'x' WHERE id = 3")
    cycle(cfg, spark)


def _table_t(source_conn, make_stream):
    _exec(source_conn, "CREATE TABLE t (id int PRIMARY KEY, a text)",
          "INSERT INTO t SELECT i, 'a' || i FROM generate_series(1, 6) i")
    cfg = make_stream(["t"])
    snapshot_stream(cfg)
    return cfg


ADD_DEFAULT = ("ALTER TABLE t ADD COLUMN d text NOT NULL DEFAULT 'dflt'", "UPDATE t SET a = 'x' WHERE id = 1")
RENAME = ("ALTER TABLE t RENAME COLUMN a TO renamed", "UPDATE t SET renamed = 'x' WHERE id = 1")


def test_add_column_with_a_default_is_followed_without_a_resend(make_stream, source_conn, spark):
    """The rows that existed take PostgreSQL's recorded DEFAULT (attmissingval): no NULLs, no resend."""
    cfg = _table_t(source_conn, make_stream)
    _exec(source_conn, *ADD_DEFAULT)
    cycle(cfg, spark)


def test_rename_column_is_followed_in_place_without_a_copy(make_stream, source_conn, spark):
    """PostgreSQL sends no change for the existing rows on RENAME COLUMN: the lake column is renamed
    in place (its attnum tells it from a DROP and an ADD), no re-snapshot, never NULLs in the lake;
    a later DROP and ADD of other columns in one batch is told apart the same way."""
    from tidemark.lake import read_table

    from oracle import snapshots_taken

    cfg = _table_t(source_conn, make_stream)
    copies = snapshots_taken(cfg)
    _exec(source_conn, *RENAME)
    cycle(cfg, spark)
    assert read_table(cfg, "public.t").column_names == ["id", "renamed"]
    _exec(source_conn, "ALTER TABLE t DROP COLUMN renamed", "ALTER TABLE t ADD COLUMN b text DEFAULT 'bee'",
          "UPDATE t SET id = 100 WHERE id = 2")
    cycle(cfg, spark)
    assert read_table(cfg, "public.t").column_names == ["id", "b"]
    assert snapshots_taken(cfg) == copies == 1


def test_alter_column_type_stops_with_a_clear_error(make_stream, source_conn, spark):
    from tidemark.consolidate.job import ConsolidateError

    _exec(source_conn, "CREATE TABLE t (id int PRIMARY KEY, a int)", "INSERT INTO t VALUES (1, 1)")
    cfg = make_stream(["t"])
    snapshot_stream(cfg)
    _exec(source_conn, "INSERT INTO t VALUES (3, 3)")
    cycle(cfg, spark)                                             # the changelog holds a's int values
    _exec(source_conn, "ALTER TABLE t ALTER COLUMN a TYPE bigint", "INSERT INTO t VALUES (2, 2)")
    drain_until_current(cfg)
    with pytest.raises(ConsolidateError, match=r"public\.t: column a changed type .*resend"):
        consolidate(cfg, spark)
    from tidemark.gaps import resend

    resend(cfg, force=True)                                       # the remedy it names
    _exec(source_conn, "UPDATE t SET a = 5000000000 WHERE id = 2")
    cycle(cfg, spark)


def test_multi_dimensional_arrays_are_kept_as_their_text(make_stream, source_conn, spark):
    """PostgreSQL's int[] and text[] take values of any dimensionality and bounds: a column whose
    values do not fit its declared dimensions before the snapshot is held as PostgreSQL's text from
    the snapshot on (the table's shape says so), and while streaming 1-D, 2-D, 3-D and
    non-default-bounds values all reach the lake as the source has them (tests/e2e/test_arrays.py: the
    columns whose values fit are lists). Failed before: the 2-D value stopped the consolidation."""
    from tidemark.lake import read_table

    _exec(source_conn, "CREATE TABLE m (id int PRIMARY KEY, arr int[], tags text[], grid int[][])",
          "INSERT INTO m VALUES (1, '{1,2}', '{a,\"b c\"}', '{{1}}'), (2, '{{1,2},{3,4}}', '{{x,NULL},{\"y,z\",w}}', NULL),"
          " (3, '[0:1]={5,6}', '{}', '{{{1,2}},{{3,4}}}')")
    cfg = make_stream(["m"])
    snapshot_stream(cfg)
    _exec(source_conn, "INSERT INTO m VALUES (4, '{{7,8},{9,NULL}}', '{{\"q\\\"\",r}}', '{1,2,3}')",
          "UPDATE m SET arr = '{{0}}', grid = '{{5,6},{7,8}}' WHERE id = 1", "UPDATE m SET tags = '{{a},{b}}' WHERE id = 3")
    cycle(cfg, spark)
    lake = {r["id"]: r for r in read_table(cfg, "public.m").to_pylist()}
    assert lake[2]["arr"] == "{{1,2},{3,4}}" and lake[3]["arr"] == "[0:1]={5,6}" and lake[4]["arr"] == "{{7,8},{9,NULL}}"
    assert lake[1]["arr"] == "{{0}}" and lake[3]["tags"] == "{{a},{b}}"


def test_a_value_the_lake_type_cannot_hold_names_where_and_a_resend_mends(make_stream, source_conn, spark):
    """NaN in numeric(10,2) (lake decimal(10,2)) while streaming: the first line names the stream,
    table, column, segment, LSN and a remedy that works (the incident names the table too); the
    remedy, correcting the value and resending the table, makes the lake equal the source again.
    Failed before: the table and column only inside a flattened traceback, incident table null,
    remedy "run again"."""
    from tidemark.consolidate.job import ConsolidateFailed

    _exec(source_conn, "CREATE TABLE m (id int PRIMARY KEY, n numeric(10, 2))", "INSERT INTO m VALUES (1, 1.5)",
          "CREATE TABLE ok (id int PRIMARY KEY)")
    cfg = make_stream(["m", "ok"])
    snapshot_stream(cfg)
    _exec(source_conn, "INSERT INTO m VALUES (2, 'NaN')", "INSERT INTO ok VALUES (1)")
    drain_until_current(cfg)
    with pytest.raises(ConsolidateFailed) as err:
        consolidate(cfg, spark)
    first = str(err.value).splitlines()[0]
    assert first.startswith(f"consolidation failed (incident {err.value.incident}): stream {cfg.stream}, "
                            "table public.m, column n, segment "), first
    assert " LSN " in first and "'NaN'" in first and "numeric(10,2)" in first, first
    assert f"`tidemark snapshot {cfg.stream} --mode table --tables public.m`" in first, first
    assert len(first) < 1000 and "Traceback" not in first, first
    with Control(control_dsn(cfg)) as ctl:
        inc = [i for i in ctl.incidents(cfg.stream) if i["id"] == err.value.incident][0]
    detail = inc["detail"]
    assert inc["table"] == "public.m" and detail["table"] == "public.m" and detail["column"] == "n" and detail["value"] == "NaN", detail
    assert detail["position"] in first and "--mode table --tables public.m" in detail["remedy"], detail
    with pytest.raises(ConsolidateFailed, match="table public.m, column n, segment "):   # running again: the same
        consolidate(cfg, spark)
    # the remedy: correct the value at the source, resend the table
    _exec(source_conn, "UPDATE m SET n = 0 WHERE id = 2")
    snapshot_stream(cfg, tables=["public.m"], mode="table")
    cycle(cfg, spark)


def test_a_timestamp_beyond_the_lake_range_names_its_column(make_stream, source_conn, spark):
    """PostgreSQL's timestamps reach the year 294276, the lake's (64-bit microseconds since 1970)
    294247. Found by test_generated_schemas: the snapshot failed with "bigint out of range" after
    three attempts, naming no column, and the drain landed such a value wrapped around (an Avro long
    of more than 64 bits, read back as a timestamp in 1940: the lake silently wrong). Now the drain
    stops naming the table, column and value with its remedy, and so does a snapshot; the edges the
    lake holds (294247, 4713 BC) arrive exactly."""
    from tidemark.capture.snapshot import SnapshotError
    from tidemark.errors import DecodeError

    _exec(source_conn, "CREATE TABLE ts (id int PRIMARY KEY, t timestamp, tz timestamptz)",
          "INSERT INTO ts VALUES (1, '294247-01-09 23:59:59.999999', '4713-01-01 00:00:00+00 BC')")
    cfg = make_stream(["ts"])
    snapshot_stream(cfg)
    _exec(source_conn, "INSERT INTO ts VALUES (2, '294276-12-31 23:59:59.999999', 'infinity')")
    with pytest.raises(DecodeError, match=r"public\.ts column t: .*294276-12-31.*beyond the lake's range.*resend"):
        drain_until_current(cfg)
    with pytest.raises(SnapshotError, match=r"column t \(timestamp.*beyond the lake's range.*294276-12-31"):
        snapshot_stream(cfg, mode="resend")
    _exec(source_conn, "UPDATE ts SET t = '294247-01-09 23:59:59' WHERE id = 2")     # the remedy
    snapshot_stream(cfg, mode="resend")
    cycle(cfg, spark)


def test_many_segments_and_several_consolidations(make_stream, source_conn, spark):
    _exec(source_conn, "CREATE TABLE t (id int PRIMARY KEY, v int)", "INSERT INTO t SELECT i, 0 FROM generate_series(1, 50) i")
    cfg = make_stream(["t"], consolidate={"buckets": 2})
    snapshot_stream(cfg)
    for round_ in range(2):
        with source_conn.cursor() as cur:
            for i in range(40):                         # many small transactions
                cur.execute("UPDATE t SET v = v + 1 WHERE id = %s", (1 + (i * 7 + round_) % 50,))
                if i % 10 == 0:
                    cur.execute("DELETE FROM t WHERE id = (SELECT min(id) FROM t)")
                    cur.execute("INSERT INTO t VALUES (%s, -1)", (1000 + round_ * 100 + i,))
        n = drain_until_current(cfg, max_changes=7)
        with Control(control_dsn(cfg)) as ctl:
            segs = ctl.segments(cfg.stream, status="landed")
        assert n >= 1 and len(segs) > 5 * (round_ + 1)    # one drain lands many segments of <= 7 changes
        cycle(cfg, spark)
    res = consolidate(cfg, spark)
    assert res.skipped


def test_two_streams_on_one_database_and_a_shared_table(make_stream, source_conn, spark):
    _exec(source_conn, "CREATE TABLE a (id int PRIMARY KEY, v text)", "CREATE TABLE b (id int PRIMARY KEY, v text)",
          "CREATE TABLE shared (id int PRIMARY KEY, v text)",
          "INSERT INTO a VALUES (1, 'a')", "INSERT INTO b VALUES (1, 'b')", "INSERT INTO shared VALUES (1, 's')")
    one = make_stream(["a", "shared"])
    two = make_stream(["b", "shared"])
    snapshot_stream(one)
    _exec(source_conn, "INSERT INTO shared VALUES (2, 's2')", "INSERT INTO a VALUES (2, 'a2')")
    snapshot_stream(two)
    _exec(source_conn, "UPDATE shared SET v = 'both'", "INSERT INTO b VALUES (2, 'b2')", "DELETE FROM a WHERE id = 1")
    cycle(one, spark)
    _exec(source_conn, "INSERT INTO shared VALUES (3, 's3')")
    cycle(two, spark)
    cycle(one, spark)


def test_large_transaction(make_stream, source_conn, spark):
    _exec(source_conn, "CREATE TABLE big (id int PRIMARY KEY, v text, n numeric)")
    cfg = make_stream(["big"], drain={"max_changes": 50_000}, consolidate={"buckets": 4})
    snapshot_stream(cfg)
    _exec(source_conn, "INSERT INTO big SELECT i, md5(i::text), i / 3.0 FROM generate_series(1, 200000) i")
    _exec(source_conn, "BEGIN", "UPDATE big SET v = 'u' WHERE id % 10 = 0", "DELETE FROM big WHERE id % 10 = 1",
          "COMMIT")
    cycle(cfg, spark)
