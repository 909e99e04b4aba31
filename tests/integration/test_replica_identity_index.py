"""REPLICA IDENTITY USING INDEX: the unique index on NOT NULL columns is the table's key (real
PostgreSQL, real slot, Spark).

pgoutput's old-key images carry exactly the replica identity's columns, so that is the lake's key,
with or without a primary key beside it: a table without a primary key is captured like a keyed
one (snapshot, inserts, updates of other columns leaving TOAST values unchanged, updates that move
the index's columns, deletes), and a table with a primary key and REPLICA IDENTITY USING INDEX on
another unique index is keyed by that index's columns (its INCLUDE columns are not part of it, as in
pgoutput's Relation message). A replica identity that names no row (DEFAULT without a primary key,
NOTHING, USING INDEX of a dropped index) is refused with the commands that give it one; one that
changes on a running stream is a change of the row identity: the table is re-snapshotted alone.
"""

from __future__ import annotations

import psycopg2
import pytest

from tidemark.capture.snapshot import snapshot_stream
from tidemark.config import validate_against_source
from tidemark.consolidate import ConsolidateError, consolidate_stream
from tidemark.errors import ConfigError, TableNeedsSnapshot
from tidemark.lake import open_delta, table_info, table_uri
from tidemark.pgtypes import TableSchema

from oracle import assert_lake_equals_source, consolidate, drain_until_current

NOPK, COMPOSITE, PKIDX = "fam3.ri_nopk", "fam3.ri_composite", "fam3.ri_pk_index"


def _sql(dsn: str, *statements) -> None:
    """Each statement in its own transaction, except a list: one transaction."""
    conn = psycopg2.connect(dsn)
    try:
        for s in statements:
            with conn, conn.cursor() as cur:
                for part in (s if isinstance(s, list) else [s]):
                    cur.execute(part)
    finally:
        conn.close()


def _lake_key(cfg, table: str) -> tuple[str, ...]:
    """The key the lake table was written with (its stored shape)."""
    info = table_info(open_delta(table_uri(cfg, table)))
    return TableSchema.from_json(info["table_schema"]).key_columns


@pytest.fixture
def ri_tables(source_conn):
    """Three tables keyed by REPLICA IDENTITY USING INDEX, each with a TOASTed (EXTERNAL) column:
    no primary key and a one-column index; no primary key and a composite index (a text column in
    it); a primary key beside a composite unique index with an INCLUDE column."""
    with source_conn.cursor() as cur:
        cur.execute("CREATE SCHEMA fam3")
        cur.execute("CREATE TABLE fam3.ri_nopk (k int NOT NULL, v text, n int, big text)")
        cur.execute("CREATE UNIQUE INDEX ri_nopk_k ON fam3.ri_nopk (k)")
        cur.execute("ALTER TABLE fam3.ri_nopk REPLICA IDENTITY USING INDEX ri_nopk_k")
        cur.execute("CREATE TABLE fam3.ri_composite (a int NOT NULL, b text NOT NULL, v text, big text)")
        cur.execute("CREATE UNIQUE INDEX ri_composite_ab ON fam3.ri_composite (b, a)")
        cur.execute("ALTER TABLE fam3.ri_composite REPLICA IDENTITY USING INDEX ri_composite_ab")
        cur.execute("CREATE TABLE fam3.ri_pk_index (id int PRIMARY KEY, code text NOT NULL, region int NOT NULL, "
                    "extra int, v text, big text)")
        cur.execute("CREATE UNIQUE INDEX ri_pk_index_cr ON fam3.ri_pk_index (code, region) INCLUDE (extra)")
        cur.execute("ALTER TABLE fam3.ri_pk_index REPLICA IDENTITY USING INDEX ri_pk_index_cr")
        for t in ("ri_nopk", "ri_composite", "ri_pk_index"):
            cur.execute(f"ALTER TABLE fam3.{t} ALTER COLUMN big SET STORAGE EXTERNAL")
        cur.execute("INSERT INTO fam3.ri_nopk SELECT g, 'v' || g, g, repeat(md5(g::text), 100) "
                    "FROM generate_series(1, 200) g")
        cur.execute("INSERT INTO fam3.ri_composite SELECT g % 20, 'b' || (g / 20), 'v' || g, repeat(md5(g::text), 100) "
                    "FROM generate_series(1, 200) g")
        cur.execute("INSERT INTO fam3.ri_pk_index SELECT g, 'c' || (g % 10), g / 10, g, 'v' || g, "
                    "repeat(md5(g::text), 100) FROM generate_series(1, 200) g")
    return [NOPK, COMPOSITE, PKIDX]


def _workload(dsn: str, round_no: int) -> None:
    """Inserts, updates of non-key columns (the TOASTed one left unchanged), updates that move the
    replica identity's columns (TOAST unchanged: the new row takes it from the old key's row), a
    cycle of keys in one transaction, deletes, new TOAST values."""
    r = round_no * 1000
    _sql(dsn,
         # fam3.ri_nopk: key k
         f"INSERT INTO fam3.ri_nopk SELECT g, 'new', g, repeat('n', 5000) FROM generate_series({r + 300}, {r + 320}) g",
         "UPDATE fam3.ri_nopk SET v = v || '+', n = n + 1 WHERE k % 7 = 0",
         f"UPDATE fam3.ri_nopk SET k = k + {r + 10000} WHERE k % 11 = 0 AND k < 1000",
         f"UPDATE fam3.ri_nopk SET k = {r + 400}, v = 'moved' WHERE k = {r + 310}",   # the insert's row moves on
         ["UPDATE fam3.ri_nopk SET k = -1 WHERE k = 2", "UPDATE fam3.ri_nopk SET k = 2 WHERE k = 3",
          "UPDATE fam3.ri_nopk SET k = 3 WHERE k = -1"],                              # 2 and 3 swap rows
         "DELETE FROM fam3.ri_nopk WHERE k % 13 = 0",
         f"UPDATE fam3.ri_nopk SET big = repeat('r{round_no}', 3000) WHERE k % 17 = 1",
         f"INSERT INTO fam3.ri_nopk VALUES ({13 * round_no}, 'again', 0, repeat('a', 4000))",  # a deleted key again
         # fam3.ri_composite: key (a, b)
         f"INSERT INTO fam3.ri_composite SELECT g, 'ins{round_no}', 'new', repeat('n', 5000) "
         "FROM generate_series(1, 15) g",
         "UPDATE fam3.ri_composite SET v = v || '+' WHERE a % 3 = 0",
         f"UPDATE fam3.ri_composite SET b = b || '-m{round_no}' WHERE a = 4",            # one key column moves
         f"UPDATE fam3.ri_composite SET a = a + 100, b = 'both{round_no}' WHERE a = 5 AND b = 'b{round_no}'",
         ["UPDATE fam3.ri_composite SET a = -1 WHERE a = 6 AND b = 'b2'",
          "UPDATE fam3.ri_composite SET a = 6 WHERE a = 7 AND b = 'b2'",
          "UPDATE fam3.ri_composite SET a = 7 WHERE a = -1 AND b = 'b2'"],
         "DELETE FROM fam3.ri_composite WHERE a = 8",
         # fam3.ri_pk_index: key (code, region), the primary key is just a column
         f"INSERT INTO fam3.ri_pk_index SELECT g, 'ins', g, g, 'new', repeat('n', 5000) "
         f"FROM generate_series({r + 500}, {r + 510}) g",
         "UPDATE fam3.ri_pk_index SET v = v || '+', extra = extra + 1 WHERE id % 5 = 0",   # INCLUDE column too
         f"UPDATE fam3.ri_pk_index SET id = id + {r + 50000} WHERE id % 9 = 0 AND id < 1000",  # not the key
         f"UPDATE fam3.ri_pk_index SET code = code || '-m{round_no}' WHERE region = 3",
         f"UPDATE fam3.ri_pk_index SET region = region + {r + 100} WHERE code = 'c7'",
         "DELETE FROM fam3.ri_pk_index WHERE id % 8 = 0")


def test_validation_takes_using_index_as_the_key_and_refuses_what_names_no_row(source_conn, make_stream):
    with source_conn.cursor() as cur:
        cur.execute("CREATE SCHEMA fam3")
        cur.execute("CREATE TABLE fam3.ri_ok (a int NOT NULL, b int NOT NULL, v text)")
        cur.execute("CREATE UNIQUE INDEX ri_ok_ab ON fam3.ri_ok (a, b)")
        cur.execute("ALTER TABLE fam3.ri_ok REPLICA IDENTITY USING INDEX ri_ok_ab")
        cur.execute("CREATE TABLE fam3.ri_plain (a int NOT NULL, b int, v text)")      # DEFAULT, no primary key
        cur.execute("CREATE UNIQUE INDEX ri_plain_b ON fam3.ri_plain (b)")                 # b is nullable
        cur.execute('CREATE UNIQUE INDEX "Ri Plain A" ON fam3.ri_plain (a)')
        cur.execute("CREATE TABLE fam3.ri_nothing (id int PRIMARY KEY, v text)")
        cur.execute("ALTER TABLE fam3.ri_nothing REPLICA IDENTITY NOTHING")
        cur.execute("CREATE TABLE fam3.ri_dropped (a int NOT NULL, v text)")
        cur.execute("CREATE UNIQUE INDEX ri_dropped_a ON fam3.ri_dropped (a)")
        cur.execute("ALTER TABLE fam3.ri_dropped REPLICA IDENTITY USING INDEX ri_dropped_a")
        cur.execute("DROP INDEX fam3.ri_dropped_a")
        cur.execute("CREATE TABLE fam3.ri_bare (v text)")
        cur.execute("CREATE TABLE fam3.ri_deferred (id int PRIMARY KEY DEFERRABLE, v text)")

    assert validate_against_source(make_stream(["fam3.ri_ok"], history=["fam3.ri_ok"]), source_conn) == []
    cases = {
        "fam3.ri_plain": ["fam3.ri_plain has no primary key and is REPLICA IDENTITY DEFAULT",
                          "ALTER TABLE fam3.ri_plain ADD PRIMARY KEY (...)",
                          'ALTER TABLE fam3.ri_plain REPLICA IDENTITY USING INDEX "Ri Plain A" (its unique index '
                          "on NOT NULL columns a)", "ALTER TABLE fam3.ri_plain REPLICA IDENTITY FULL"],
        "fam3.ri_nothing": ["fam3.ri_nothing is REPLICA IDENTITY NOTHING",
                            "ALTER TABLE fam3.ri_nothing REPLICA IDENTITY DEFAULT (its primary key)",
                            "ALTER TABLE fam3.ri_nothing REPLICA IDENTITY USING INDEX <a unique index",
                            "ALTER TABLE fam3.ri_nothing REPLICA IDENTITY FULL"],
        "fam3.ri_dropped": ["fam3.ri_dropped is REPLICA IDENTITY USING INDEX, but that index no longer exists",
                            "ALTER TABLE fam3.ri_dropped REPLICA IDENTITY USING INDEX <a unique index on NOT NULL "
                            "columns>", "ALTER TABLE fam3.ri_dropped REPLICA IDENTITY FULL"],
        "fam3.ri_bare": ["fam3.ri_bare has no primary key", "REPLICA IDENTITY USING INDEX <a unique index",
                         "ALTER TABLE fam3.ri_bare REPLICA IDENTITY FULL"],
        # PostgreSQL takes no DEFERRABLE key as a replica identity: published, UPDATE and DELETE fail
        "fam3.ri_deferred": ["fam3.ri_deferred's primary key is DEFERRABLE",
                             "re-create fam3.ri_deferred's primary key NOT DEFERRABLE",
                             "ALTER TABLE fam3.ri_deferred REPLICA IDENTITY FULL"],
    }
    for table, parts in cases.items():
        with pytest.raises(ConfigError) as err:
            validate_against_source(make_stream(["fam3.ri_ok", table]), source_conn)
        assert err.value.key == "source.tables[1]"
        for part in parts:
            assert part in str(err.value), (part, str(err.value))
        assert "\n" not in str(err.value)
    with source_conn.cursor() as cur:     # what the refusal spares the user's application
        cur.execute("INSERT INTO fam3.ri_deferred VALUES (1, 'a')")
        cur.execute("CREATE PUBLICATION ri_deferred_pub FOR TABLE fam3.ri_deferred")
        with pytest.raises(Exception, match="does not have a replica identity"):
            cur.execute("UPDATE fam3.ri_deferred SET v = 'b'")


def test_the_catalogs_key_is_pgoutputs_key(source_conn):
    """The key a snapshot reads from the catalog is the one pgoutput's Relation message flags (the
    drain's), for every kind of replica identity: an index's INCLUDE columns are in neither."""
    from tidemark.capture.pgoutput import Relation, decode_message
    from tidemark.pgtypes import table_schema_from_catalog

    tables = {
        "pk": ("CREATE TABLE fam3.pk (id int PRIMARY KEY, v text)", ("id",)),
        "pk_inc": ("CREATE TABLE fam3.pk_inc (a int, b int, v text, PRIMARY KEY (b, a) INCLUDE (v))", ("a", "b")),
        "ri": ("CREATE TABLE fam3.ri (a int NOT NULL, b text NOT NULL, v text); "
               "CREATE UNIQUE INDEX ri_ba ON fam3.ri (b, a); ALTER TABLE fam3.ri REPLICA IDENTITY USING INDEX ri_ba",
               ("a", "b")),
        "ri_inc": ("CREATE TABLE fam3.ri_inc (a int NOT NULL, n int, v text); "
                   "CREATE UNIQUE INDEX ri_inc_a ON fam3.ri_inc (a) INCLUDE (n); "
                   "ALTER TABLE fam3.ri_inc REPLICA IDENTITY USING INDEX ri_inc_a", ("a",)),
        "pk_ri": ("CREATE TABLE fam3.pk_ri (id int PRIMARY KEY, code text NOT NULL, v text); "
                  "CREATE UNIQUE INDEX pk_ri_code ON fam3.pk_ri (code) INCLUDE (id); "
                  "ALTER TABLE fam3.pk_ri REPLICA IDENTITY USING INDEX pk_ri_code", ("code",)),
        "full": ("CREATE TABLE fam3.full (id int PRIMARY KEY, v text); ALTER TABLE fam3.full REPLICA IDENTITY FULL",
                 ("id", "v")),
    }
    with source_conn.cursor() as cur:
        cur.execute("CREATE SCHEMA fam3")
        for ddl, _ in tables.values():
            cur.execute(ddl)
        cur.execute("CREATE PUBLICATION ri_keys FOR TABLES IN SCHEMA fam3")
        cur.execute("SELECT pg_create_logical_replication_slot('ri_keys', 'pgoutput')")
        cur.execute("SET synchronous_commit = on")      # the slot's SQL functions read up to the flushed WAL
        for t in tables:
            cur.execute(f"INSERT INTO fam3.{t} VALUES (1, " + {"pk": "'x'", "pk_inc": "1, 'x'", "ri": "'b', 'x'",
                        "ri_inc": "1, 'x'", "pk_ri": "'c', 'x'", "full": "'x'"}[t] + ")")
        cur.execute("SELECT data FROM pg_logical_slot_get_binary_changes('ri_keys', NULL, NULL, 'proto_version', "
                    "'1', 'publication_names', 'ri_keys')")
        messages = [decode_message(r[0]) for r in cur.fetchall()]
        relations = [m for m in messages if isinstance(m, Relation)]
        cur.execute("SELECT pg_drop_replication_slot('ri_keys')")
    wire = {r.name: tuple(c.name for c in r.columns if c.flags & 1) for r in relations}
    catalog = {t: table_schema_from_catalog(source_conn, "fam3", t).key_columns for t in tables}
    assert wire == catalog == {t: key for t, (_, key) in tables.items()}


def test_a_unique_index_is_the_key_of_a_table_with_or_without_a_primary_key(make_stream, ri_tables, source_db,
                                                                          spark):
    cfg = make_stream(ri_tables, history=[NOPK])
    snapshot_stream(cfg)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    for t in ri_tables:
        assert_lake_equals_source(cfg, t)
    assert {t: _lake_key(cfg, t) for t in ri_tables} == {NOPK: ("k",), COMPOSITE: ("a", "b"),
                                                          PKIDX: ("code", "region")}
    # round 1: rows that are in the lake move keys, their TOAST values unchanged (taken from the lake)
    _workload(source_db, 1)
    drain_until_current(cfg)
    res = consolidate(cfg, spark)
    assert not res.incident
    for t in ri_tables:
        assert_lake_equals_source(cfg, t)
    # rounds 2 and 3 in one batch: rows inserted and moved in it (TOAST taken from the batch's own -1)
    _workload(source_db, 2)
    _workload(source_db, 3)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    for t in ri_tables:
        assert_lake_equals_source(cfg, t)
    consolidate_stream(cfg, spark=spark)       # idempotent
    for t in ri_tables:
        assert_lake_equals_source(cfg, t)


def test_a_replica_identity_changed_on_a_running_stream_is_a_per_table_re_snapshot(make_stream, ri_tables,
                                                                                     source_db, spark):
    cfg = make_stream([NOPK, COMPOSITE])
    snapshot_stream(cfg)
    _workload(source_db, 1)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    # another unique index becomes the identity: the rows' identity changes from (k) to (n)
    _sql(source_db, "UPDATE fam3.ri_nopk SET v = 'before' WHERE k % 3 = 0", "UPDATE fam3.ri_nopk SET n = k",
         "ALTER TABLE fam3.ri_nopk ALTER COLUMN n SET NOT NULL", "CREATE UNIQUE INDEX ri_nopk_n ON fam3.ri_nopk (n)",
         "ALTER TABLE fam3.ri_nopk REPLICA IDENTITY USING INDEX ri_nopk_n",
         "UPDATE fam3.ri_nopk SET v = 'after' WHERE k % 5 = 0", "UPDATE fam3.ri_nopk SET n = -n WHERE k % 4 = 0",
         "UPDATE fam3.ri_nopk SET k = k + 100000 WHERE k % 6 = 0",
         "INSERT INTO fam3.ri_nopk SELECT g, 'new', -g, repeat('n', 5000) FROM generate_series(200001, 200010) g",
         "DELETE FROM fam3.ri_nopk WHERE k % 9 = 0", "UPDATE fam3.ri_composite SET v = 'later' WHERE a % 2 = 0")
    drain_until_current(cfg)
    with pytest.raises(ConsolidateError, match=r"table fam3.ri_nopk: the row identity changed from \['k'\] to "
                                               r"\['n'\].*--mode table --tables fam3.ri_nopk") as err:
        consolidate_stream(cfg, spark=spark)
    assert isinstance(err.value.__cause__, TableNeedsSnapshot)     # what the DAG's resend step takes by itself
    snapshot_stream(cfg, tables=[NOPK], mode="table")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    for t in (NOPK, COMPOSITE):
        assert_lake_equals_source(cfg, t)
    assert _lake_key(cfg, NOPK) == ("n",)
    # its index dropped, the table names no row (PostgreSQL refuses its updates): a re-snapshot is refused,
    # naming what to run
    _sql(source_db, "DROP INDEX fam3.ri_nopk_n")
    with pytest.raises(ConfigError, match=r"source.tables\[0\]: fam3.ri_nopk is REPLICA IDENTITY USING INDEX, but "
                                          r"that index no longer exists.*REPLICA IDENTITY USING INDEX ri_nopk_k"):
        snapshot_stream(cfg, tables=[NOPK], mode="table")
