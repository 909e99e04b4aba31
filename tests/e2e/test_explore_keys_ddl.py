"""Keys and schema changes a new user's database has that the other tests may not: keys PostgreSQL
compares otherwise than by their bytes (floats, numerics, intervals, citext, jsonb, an array in a
primary key), a key long enough to be stored out of line, a DEFERRABLE primary key, key swaps and
re-inserts inside one transaction, TRUNCATE beside inserts and CASCADE, a table without a key whose
TOASTed values stay unchanged, a table renamed while the stream runs, and DDL on a running stream
(ALTER COLUMN TYPE within one lake type and across, SET NOT NULL, a renamed column's name given to a
new column, a column dropped and added again with another type). Each lands its changes through the
real pipeline (drain, consolidate) and compares the lake with PostgreSQL (`tidemark.parity` and the
oracle's multiset of rows); where the stream must stop, the message names what and where, and the
remedy it names (or the consolidate DAG's own, `gaps.detect` then `gaps.resend`) brings the lake back."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tidemark import gaps
from tidemark.capture.snapshot import snapshot_stream
from tidemark.capture.source import apply_stream
from tidemark.config import TableRef
from tidemark.consolidate import consolidate_stream
from tidemark.errors import ConsolidateError, TidemarkError
from tidemark.lake import read_changelog, read_table
from tidemark.parity import parity_report

from adversarial_kit import assert_lake_equals_source, consolidate, drain_until_current

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _exec(conn, *stmts):
    with conn.cursor() as cur:
        for s in stmts:
            cur.execute(s)


def _equal(cfg, spark) -> None:
    """Drain to the source's position, consolidate, and the lake equals the source by both oracles."""
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg)
    report = parity_report(cfg)
    assert all(r["equal"] for r in report.values()), report


def _refused_then_mended(cfg, spark, refusal: str, table: str) -> None:
    """The consolidation stops with ``refusal``; the consolidate DAG's gap sensor asks for a re-snapshot
    of ``table`` alone, its resend step takes it, and the next consolidation brings the lake back."""
    drain_until_current(cfg)
    with pytest.raises(ConsolidateError, match=refusal):
        consolidate_stream(cfg, spark=spark)
    report = gaps.detect(cfg)
    assert (report.action, report.resnapshot) == ("resend", (table,)), report
    assert not gaps.resend(cfg).skipped
    _equal(cfg, spark)


def test_keys_postgresql_compares_otherwise_than_by_their_bytes(make_stream, source_conn, spark):
    """A float8/float4 key holds NaN, ±Infinity, -0.0 and subnormals; a numeric key changes its scale;
    interval, timetz, citext and jsonb keys change to values PostgreSQL calls equal."""
    _exec(source_conn,
          "CREATE EXTENSION IF NOT EXISTS citext",
          "CREATE TABLE kf (id float8 PRIMARY KEY, v text)",
          "CREATE TABLE kf4 (id real PRIMARY KEY, v text)",
          "CREATE TABLE kn (id numeric PRIMARY KEY, v text)",
          "CREATE TABLE ko (iv interval, tt timetz, c citext, j jsonb, a int[], v text, PRIMARY KEY (iv, tt, c, j))",
          "INSERT INTO kf VALUES ('NaN', 'nan'), ('Infinity', 'inf'), ('-Infinity', '-inf'), ('-0', 'negzero'), "
          "(5e-324, 'sub'), (1.7976931348623157e308, 'max'), (0.1, 'tenth')",
          "INSERT INTO kf4 VALUES ('NaN', 'nan'), ('-0', 'negzero'), (1e-45, 'sub'), (0.1, 'tenth')",
          "INSERT INTO kn VALUES (1.0, 'one'), ('NaN', 'nan'), (0.000000000000000000000000000001, 'tiny'), "
          "(123456789012345678901234567890123456789012345, 'big')",
          "INSERT INTO ko VALUES ('1 day', '12:00+01', 'Abc', '{\"b\": 1, \"a\": [null]}', '{1,NULL}', 'x'), "
          "('1 mon', '24:00-15:59', 'é', '\"\\u00e9\"', '{}', 'y'), "
          "('1 mon', '24:00-15:59', 'é', 'null', '{2}', 'z')")
    cfg = make_stream(["public.kf", "public.kf4", "public.kn", "public.ko"], consolidate={"buckets": 3})
    snapshot_stream(cfg)
    _exec(source_conn,
          "UPDATE kf SET v = v || '+' WHERE id = 'NaN' OR id = '-Infinity' OR id = 0",
          "DELETE FROM kf WHERE id = 'Infinity'",
          "INSERT INTO kf VALUES ('Infinity', 'back')",
          "UPDATE kf4 SET v = 'u' WHERE id = 'NaN'",
          "UPDATE kn SET id = 1.00 WHERE id = 1",
          "UPDATE kn SET v = 'n' WHERE id = 'NaN'",
          "DELETE FROM kn WHERE id = 0.000000000000000000000000000001",
          "UPDATE ko SET iv = '24 hours', c = 'ABC' WHERE v = 'x'",
          "UPDATE ko SET v = 'y+' WHERE v = 'y'",
          "UPDATE ko SET a = '{3,NULL,4}' WHERE v = 'z'",
          "UPDATE ko SET tt = '11:00+00' WHERE v = 'x'")
    _equal(cfg, spark)
    # -0.0 to 0.0 and back: PostgreSQL's one key, sent as a key change (its bits differ); the lake
    # kept the row under both keys (the merge grouped the records by value, looked the lake up by bits)
    _exec(source_conn, "UPDATE kf SET id = 0 WHERE id = 0", "UPDATE kf4 SET id = 0 WHERE id = 0",
          "UPDATE kf4 SET id = '-0', v = 'back' WHERE id = 0")
    _equal(cfg, spark)
    log = read_changelog(cfg, "public.kf").to_pylist()
    last = max(r["_time"] for r in log)
    assert sorted((math.copysign(1, r["id"]), r["v"], r["_diff"]) for r in log if r["_time"] == last) == \
        [(-1.0, "negzero+", -1), (1.0, "negzero+", 1)]       # the changelog has the key change too


def test_an_array_in_the_key_is_refused_by_the_snapshot_naming_it(make_stream, source_conn, spark):
    """An array in a primary key failed every consolidation with "ArrowTypeError: Unsupported type for
    RecordBatch sorting: list<element: int32>" (the lake sorts and merges rows by their key), naming no
    column; the snapshot now refuses it naming the column and the remedies, and REPLICA IDENTITY FULL
    (one of them) carries the table."""
    from tidemark.capture.chunks import SnapshotError

    _exec(source_conn, "CREATE TABLE ka (a int[], b text, v int, PRIMARY KEY (a, b))",
          "INSERT INTO ka VALUES ('{1,NULL}', 'x', 1), ('{}', 'x', 2), ('{{1,2},{3,4}}', 'y', 3)")
    cfg = make_stream(["public.ka"])
    with pytest.raises(SnapshotError, match=r"table public\.ka: its key \(replica identity\) holds the array "
                                            r"column\(s\) a, .*REPLICA IDENTITY FULL"):
        snapshot_stream(cfg)
    _exec(source_conn, "ALTER TABLE ka REPLICA IDENTITY FULL")
    snapshot_stream(cfg, mode="resend")
    _exec(source_conn, "UPDATE ka SET v = v + 1", "UPDATE ka SET a = '{5}' WHERE v = 3", "DELETE FROM ka WHERE v = 2")
    _equal(cfg, spark)


def test_a_key_stored_out_of_line_keeps_its_rows(make_stream, source_conn, spark):
    """A text key long enough to be TOASTed out of line (compressed beyond TOAST's threshold, within
    the btree's limit): an update of another column sends the old key whole and 'unchanged' for the
    new row's key. The drain landed the new row with a null key: the lake lost every such row and
    held one with a null key instead."""
    _exec(source_conn, "CREATE TABLE tk (k text PRIMARY KEY, v int)")
    for n in range(1900, 2800, 50):
        try:
            _exec(source_conn, f"INSERT INTO tk SELECT left(string_agg(md5(g::text), ''), {n}) "
                               f"|| repeat('ab', 3000), {n} FROM generate_series(1, 100) g")
        except Exception:     # too long for the btree once compressed: the lengths that fit are enough
            pass
    with source_conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM tk WHERE pg_column_size(k) > 2000")
        assert cur.fetchone()[0] > 0
    cfg = make_stream(["public.tk"])
    snapshot_stream(cfg)
    _exec(source_conn, "UPDATE tk SET v = v + 1", "DELETE FROM tk WHERE v % 2 = 0")
    _equal(cfg, spark)
    assert None not in read_table(cfg, "public.tk").column("k").to_pylist()


def test_a_deferrable_primary_key_is_not_the_key_pgoutput_sends(make_stream, source_conn, spark):
    """PostgreSQL does not take a DEFERRABLE primary key for the replica identity (pgoutput's Relation
    message names no key column); the snapshot's shape took it for the key, so the first change
    drained looked like a change of row identity and asked for a re-snapshot that took it again. (Under
    REPLICA IDENTITY DEFAULT such a table has no identity at all: `stream apply` refuses it,
    tests/integration/test_replica_identity_index.py.)"""
    _exec(source_conn, "CREATE TABLE dk (id int PRIMARY KEY DEFERRABLE, v text)",
          "ALTER TABLE dk REPLICA IDENTITY FULL",
          "INSERT INTO dk SELECT g, 'v' FROM generate_series(1, 5) g")
    cfg = make_stream(["public.dk"])
    snapshot_stream(cfg)
    _exec(source_conn, "UPDATE dk SET id = 3 - id WHERE id IN (1, 2)", "INSERT INTO dk VALUES (6, 'new')")
    _equal(cfg, spark)


def test_key_swaps_reinserts_and_truncates_in_one_transaction(make_stream, source_conn, spark):
    _exec(source_conn,
          "CREATE TABLE sw (id int PRIMARY KEY, v text)",
          "CREATE TABLE ev (name text, at timestamptz, v int, PRIMARY KEY (name, at))",
          "CREATE TABLE ui (a int NOT NULL, b text NOT NULL, v text)",
          "CREATE UNIQUE INDEX ui_ab ON ui (b, a)",
          "ALTER TABLE ui REPLICA IDENTITY USING INDEX ui_ab",
          "CREATE TABLE tr (id int PRIMARY KEY, v text)",
          "INSERT INTO sw SELECT g, 'v' || g FROM generate_series(1, 20) g",
          "INSERT INTO ev SELECT 'n' || (g % 4), timestamptz '2020-01-01 00:00+00' + g * interval '1 hour', g "
          "FROM generate_series(1, 20) g",
          "INSERT INTO ev VALUES ('é✓', '-infinity', 1), ('é✓', 'infinity', 2), "
          "('bc', '0044-03-15 12:00+00 BC', 3)",
          "INSERT INTO ui SELECT g, 'b' || g, 'v' FROM generate_series(1, 10) g",
          "INSERT INTO tr SELECT g, 'old' FROM generate_series(1, 10) g")
    cfg = make_stream(["public.sw", "public.ev", "public.ui", "public.tr"], consolidate={"buckets": 4})
    snapshot_stream(cfg)
    _exec(source_conn,
          "BEGIN",
          "UPDATE sw SET id = 1000 WHERE id = 3", "UPDATE sw SET id = 3 WHERE id = 4",
          "UPDATE sw SET id = 4 WHERE id = 1000",                                          # a swap in three
          "DELETE FROM sw WHERE id = 5", "INSERT INTO sw VALUES (5, 'reinserted')",
          "INSERT INTO sw VALUES (100, 'x')", "UPDATE sw SET v = 'y' WHERE id = 100", "DELETE FROM sw WHERE id = 100",
          "UPDATE sw SET id = id + 100 WHERE id BETWEEN 10 AND 15",
          "UPDATE ev SET at = 'infinity' WHERE name = 'bc'",
          "UPDATE ev SET at = '2000-01-01 00:00+00' WHERE name = 'é✓' AND v = 1",     # ±infinity keys swapped
          "UPDATE ev SET at = '-infinity' WHERE name = 'é✓' AND v = 2",
          "UPDATE ev SET at = 'infinity' WHERE name = 'é✓' AND v = 1",
          "UPDATE ev SET name = 'n9' WHERE name = 'n1'",
          "UPDATE ui SET b = 'b2', a = 99 WHERE a = 2", "UPDATE ui SET a = 2 WHERE a = 99",
          "UPDATE ui SET v = 'kept key' WHERE a = 3",
          "DELETE FROM ui WHERE a = 4", "INSERT INTO ui VALUES (4, 'b4', 'again')",
          "INSERT INTO tr VALUES (11, 'before truncate')",
          "TRUNCATE tr",
          "INSERT INTO tr VALUES (1, 'after'), (12, 'after')",
          "UPDATE tr SET v = 'after+' WHERE id = 1",
          "COMMIT")
    _equal(cfg, spark)
    _exec(source_conn,
          "BEGIN", "DELETE FROM tr", "INSERT INTO tr VALUES (1, 'one')", "TRUNCATE tr, sw",
          "INSERT INTO sw VALUES (1, 'only')", "COMMIT")
    _equal(cfg, spark)


def test_truncate_cascade_with_and_without_the_child_in_the_stream(make_stream, source_conn, spark):
    _exec(source_conn,
          "CREATE TABLE parent (id int PRIMARY KEY, v text)",
          "CREATE TABLE child (id int PRIMARY KEY, p int REFERENCES parent, v text)",
          "CREATE TABLE other_child (id int PRIMARY KEY, p int REFERENCES parent)",
          "INSERT INTO parent SELECT g, 'p' FROM generate_series(1, 10) g",
          "INSERT INTO child SELECT g, g, 'c' FROM generate_series(1, 10) g",
          "INSERT INTO other_child SELECT g, g FROM generate_series(1, 10) g")
    cfg = make_stream(["public.parent", "public.child"])
    snapshot_stream(cfg)
    _exec(source_conn, "BEGIN", "INSERT INTO parent VALUES (11, 'new')", "INSERT INTO child VALUES (11, 11, 'new')",
          "TRUNCATE parent CASCADE", "INSERT INTO parent VALUES (1, 'after')", "COMMIT")
    _equal(cfg, spark)


def test_a_table_without_a_key_keeps_unchanged_toast_and_duplicates(make_stream, source_conn, spark):
    _exec(source_conn,
          "CREATE TABLE bag (g int, big text, b bytea)",
          "ALTER TABLE bag ALTER COLUMN big SET STORAGE EXTERNAL",
          "ALTER TABLE bag REPLICA IDENTITY FULL",
          "INSERT INTO bag SELECT g % 3, repeat('x', 5000), NULL FROM generate_series(1, 9) g",
          "INSERT INTO bag VALUES (7, repeat('y', 5000), decode(repeat('00ff', 400000), 'hex')), "
          "(7, repeat('y', 5000), ''::bytea)")
    cfg = make_stream(["public.bag"])
    snapshot_stream(cfg)
    _exec(source_conn,
          "UPDATE bag SET g = g + 10 WHERE g = 1",                       # big left unchanged (TOAST)
          "UPDATE bag SET g = 70 WHERE ctid = (SELECT ctid FROM bag WHERE g = 7 LIMIT 1)",
          "DELETE FROM bag WHERE ctid = (SELECT ctid FROM bag WHERE g = 0 LIMIT 1)",
          "INSERT INTO bag SELECT * FROM bag WHERE g = 2")
    _equal(cfg, spark)


def _renamed_in_the_stream_file(cfg, old: str, new: str):
    """The stream file naming ``new`` in place of ``old``, applied (the remedy the messages name)."""
    tables = tuple(TableRef.parse(new) if t.qualified == old else t for t in cfg.source.tables)
    cfg2 = dataclasses.replace(cfg, source=dataclasses.replace(cfg.source, tables=tables))
    apply_stream(cfg2)
    return cfg2


def _r_table(make_stream, source_conn):
    _exec(source_conn, "CREATE TABLE r (id int PRIMARY KEY, v text)", "CREATE TABLE o (id int PRIMARY KEY)",
          "INSERT INTO r SELECT g, 'v' FROM generate_series(1, 10) g", "INSERT INTO o VALUES (1)")
    cfg = make_stream(["public.r", "public.o"])
    snapshot_stream(cfg)
    _exec(source_conn, "UPDATE r SET v = 'before' WHERE id = 1")
    return cfg


def _remedy_brings_it_back(cfg, spark, source_conn):
    cfg2 = _renamed_in_the_stream_file(cfg, "public.r", "public.r2")
    snapshot_stream(cfg2, tables=["public.r2"], mode="add")
    _exec(source_conn, "UPDATE r2 SET v = 'later' WHERE id = 3", "INSERT INTO o VALUES (2)")
    drain_until_current(cfg2)
    consolidate(cfg2, spark)
    assert_lake_equals_source(cfg2)


def test_a_table_renamed_while_streaming_stops_the_drain_naming_it(make_stream, source_conn, spark):
    """ALTER TABLE ... RENAME keeps the table in the publication; its changes come under the new name.
    The drain said only "publication p lacks public.r; ... also publishes public.r2 ...; run: tidemark
    stream apply FILE ... then tidemark gaps --resend (changes written while the publication was so
    were not published)": apply then refuses the file (public.r does not exist), and nothing was lost."""
    cfg = _r_table(make_stream, source_conn)
    _equal(cfg, spark)
    _exec(source_conn, "ALTER TABLE r RENAME TO r2", "UPDATE r2 SET v = 'after' WHERE id = 2",
          "INSERT INTO r2 VALUES (11, 'new')")
    with pytest.raises(TidemarkError, match=r"table\(s\) public\.r of the stream do not exist in the source any "
                                            r"more \(renamed or dropped\); publication \S+ publishes public\.r2 in "
                                            r"its place.*--mode add --tables NEW_NAME"):
        drain_until_current(cfg)
    _remedy_brings_it_back(cfg, spark, source_conn)


def test_a_table_renamed_during_a_drain_stops_the_consolidation_naming_it(make_stream, source_conn, spark,
                                                                          monkeypatch):
    """A rename after the drain checked the publication: its changes landed under the new name, and
    the consolidation took them for a table of their own, public.r2, with no rows yet: it stopped on
    the first update with "a delete or update of a row whose previous image is neither earlier in the
    batch nor in the lake", naming neither the rename nor a remedy (an insert alone would have made a
    lake table public.r2 of it while public.r stopped changing)."""
    from tidemark.capture import drain as _drain

    cfg = _r_table(make_stream, source_conn)
    _equal(cfg, spark)
    real = _drain.check_publication

    def check_then_rename(c, conn=None):
        real(c, conn)
        _exec(source_conn, "ALTER TABLE IF EXISTS r RENAME TO r2", "UPDATE r2 SET v = 'after' WHERE id = 2")

    monkeypatch.setattr(_drain, "check_publication", check_then_rename)
    _drain.drain_stream(cfg)
    monkeypatch.setattr(_drain, "check_publication", real)
    with pytest.raises(ConsolidateError, match=r"changes of table public\.r2 from \S+, which is not a table of the "
                                               r"stream: it is public\.r \(relation OID \d+\) renamed in the source"):
        consolidate_stream(cfg, spark=spark)
    assert read_table(cfg, "public.r").num_rows == 10
    _remedy_brings_it_back(cfg, spark, source_conn)


def test_ddl_on_a_running_stream(make_stream, source_conn, spark):
    """ALTER COLUMN TYPE varchar(10) to text and SET NOT NULL change nothing the lake holds; a column
    renamed and a new one given its old name is named as that (it read "column(s) a were dropped and
    added again"); a column dropped, then added again under its name with another type stopped every
    consolidation for good ("column keep has type int32 now but string in the changelog"; the gap
    sensor saw nothing to do: a plain ChangelogError) and now takes the per-table re-snapshot, which
    replaces the table and restarts its changelog; int to bigint takes it too."""
    _exec(source_conn, "CREATE TABLE w (id int PRIMARY KEY, n int, s varchar(10), a text, keep text)",
          "INSERT INTO w SELECT g, g, 's' || g, 'a' || g, 'k' FROM generate_series(1, 10) g")
    cfg = make_stream(["public.w"])
    snapshot_stream(cfg)
    _exec(source_conn, "ALTER TABLE w ALTER COLUMN s TYPE text", "ALTER TABLE w ALTER COLUMN keep SET NOT NULL",
          "UPDATE w SET s = repeat('long', 10) WHERE id = 1")
    _equal(cfg, spark)
    _exec(source_conn, "BEGIN", "ALTER TABLE w RENAME COLUMN a TO b", "ALTER TABLE w ADD COLUMN a text",
          "UPDATE w SET a = 'new a' WHERE id = 2", "COMMIT")
    _refused_then_mended(cfg, spark, r"public\.w: column a was renamed b and a new column a added", "public.w")
    _exec(source_conn, "ALTER TABLE w DROP COLUMN keep", "UPDATE w SET s = 'd' WHERE id = 3")
    _equal(cfg, spark)
    _exec(source_conn, "ALTER TABLE w ADD COLUMN keep int", "UPDATE w SET keep = id WHERE id < 5")
    _refused_then_mended(cfg, spark, r"public\.w: column keep has type int32 now but .*string.* in the changelog "
                                     r".*dropped earlier", "public.w")
    _exec(source_conn, "UPDATE w SET keep = -1 WHERE id = 9")
    _equal(cfg, spark)
    _exec(source_conn, "ALTER TABLE w ALTER COLUMN n TYPE bigint", "UPDATE w SET n = 5000000000 WHERE id = 4")
    _refused_then_mended(cfg, spark, r"public\.w: column n changed type from int4 to int8", "public.w")


def test_a_type_change_that_rewrites_values_within_one_lake_type(make_stream, source_conn, spark):
    """json to jsonb (keys sorted, blanks dropped), varchar(6) to char(6) (padded), timestamptz to
    timestamptz(0) (rounded): PostgreSQL rewrites every row and sends nothing; the lake type stays
    string or timestamp, so the lake kept the old values for good. Now each takes the per-table
    re-snapshot; varchar(4) to varchar(8) to text keeps the values and needs none."""
    _exec(source_conn, "CREATE TABLE vc (id int PRIMARY KEY, j json, c varchar(6), t timestamptz, "
                       "b varchar(4), u text)",
          "INSERT INTO vc SELECT g, '{\"b\": 1,  \"a\": 2}', 'ab', '2020-01-01 00:00:00.654321+00', 'x', 'u' "
          "FROM generate_series(1, 5) g")
    cfg = make_stream(["public.vc"])
    snapshot_stream(cfg)
    _equal(cfg, spark)
    for ddl, refusal in (("ALTER COLUMN j TYPE jsonb", r"column j changed type from json to jsonb, which rewrote"),
                         ("ALTER COLUMN c TYPE char(6)", r"column c changed type from varchar to bpchar"),
                         ("ALTER COLUMN t TYPE timestamptz(0)",
                          r"column t changed type from timestamptz to timestamptz \(type modifier -1 to 0\)")):
        _exec(source_conn, f"ALTER TABLE vc {ddl}", "UPDATE vc SET u = 'j' WHERE id = 1")
        _refused_then_mended(cfg, spark, refusal, "public.vc")
    _exec(source_conn, "ALTER TABLE vc ALTER COLUMN b TYPE varchar(8)", "ALTER TABLE vc ALTER COLUMN b TYPE text",
          "UPDATE vc SET u = 'b' WHERE id = 1")
    _equal(cfg, spark)
