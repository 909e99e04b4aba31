"""Generated table schemas, end to end against PostgreSQL itself.

Hypothesis draws a table: up to a dozen columns (and, as an explicit example, one column of each
type, EVERY; in the nightly profile also 1,000 columns, WIDE), names from the whole identifier space
(unicode, spaces, dots, quotes, upper case: the strategy of tests/unit/test_adversarial_names.py), a
type for each column from every type this server's pg_type offers a table column (base types, arrays
of them, domains including one over an array, an enum, a composite, ranges and multiranges; each
probed for the values PostgreSQL accepts), an identity column
(the key, or a table without a key under REPLICA IDENTITY FULL) and a ``GENERATED ALWAYS AS (...)
STORED`` column. Each example: rows, `stream apply` (which must name the generated column as not
captured), snapshot, changes, drain, consolidate, lake == source; then ADD COLUMN and DROP COLUMN,
changes, drain, consolidate, lake == source again. "lake == source" is the multiset of rows of
``SELECT`` from PostgreSQL in lake types (`tests/oracle.py`) and `tidemark.parity.parity_report`
(equal on the captured columns, the generated column reported as not captured).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

import psycopg2
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from psycopg2 import sql

from oracle import consolidate, drain_until_current, rows, source_table
from tidemark.capture.snapshot import snapshot_stream
from tidemark.capture.source import apply_stream, connect_source, drop_slot
from tidemark.config import TableRef
from tidemark.lake import read_table
from tidemark.parity import held_as_text, parity_report
from tidemark.pgtypes import arrow_schema, lake_name_problem, table_schema_from_catalog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from test_adversarial_names import _PART  # noqa: E402  (the identifier strategy, reused)

pytestmark = [pytest.mark.spark, pytest.mark.slow]


# -- the types this server offers a table column, and values PostgreSQL accepts for each -------------------

SETUP = """
CREATE TYPE gs_mood AS ENUM ('sad', 'ok', 'happy', 'with space', 'Ünï');
CREATE TYPE gs_pair AS (a int, b text);
CREATE DOMAIN gs_posint AS integer CHECK (VALUE > 0);
CREATE DOMAIN gs_label AS text CHECK (VALUE <> 'forbidden');
CREATE DOMAIN gs_intlist AS integer[] CHECK (cardinality(VALUE) < 10);
"""

# every type a column can have: base types (not pseudo-types), arrays of them, domains, enums,
# ranges, multiranges, and composite types that are not a table's row type (ours: gs_pair)
TYPES_SQL = """
SELECT t.oid, format_type(t.oid, NULL), t.typtype, t.typcategory,
       COALESCE(b.typcategory, e.typcategory, t.typcategory) AS base_category,
       CASE WHEN t.typcategory = 'A' THEN format_type(COALESCE(NULLIF(t.typelem, 0), b.typelem), NULL) END AS elem,
       t.typname
  FROM pg_type t
  LEFT JOIN pg_type b ON t.typtype = 'd' AND b.oid = t.typbasetype
  LEFT JOIN pg_type e ON t.typcategory = 'A' AND e.oid = t.typelem
 WHERE t.typisdefined AND t.typtype IN ('b', 'd', 'e', 'r', 'm', 'c')
   AND NOT (t.typtype = 'c' AND COALESCE((SELECT relkind FROM pg_class WHERE oid = t.typrelid) <> 'c', false))
   AND NOT (t.typcategory = 'A' AND COALESCE(e.typtype = 'c'
            AND (SELECT relkind FROM pg_class WHERE oid = e.typrelid) <> 'c', false))
   AND t.typnamespace <> 'pg_toast'::regnamespace
 ORDER BY t.oid
"""

POOLS = {
    "N": ["0", "1", "-1", "7", "32767", "-32768", "2147483647", "-2147483648", "9223372036854775807", "3.5",
          "-0", "NaN", "Infinity", "-Infinity", "1e-300", "-1.7976931348623157e308",
          "123456789012345678901234567890.123456789", "12.34", "-0.01", "4294967295", "pg_class", "integer",
          "pg_catalog.now", "now()", "+(integer,integer)", "public", "english", "simple", '"C"', "pg_type"],
    "S": ["", "a", "YES", "héllo wörld ✓", 'q"uote', "back\\slash", "NULL", " spaced ", "a,b;c{d}(e)=f",
          "x" * 3000],
    "B": ["t", "f"],
    "D": ["infinity", "-infinity", "2024-02-29", "0044-03-15 BC", "2024-02-29 13:14:15.123456",
          "2024-02-29 13:14:15.123456+02", "1970-01-01 00:00:00+00", "0001-01-01 00:00:00 BC", "13:14:15.5",
          "24:00:00", "00:00:00", "10:00:00+05:30", "23:59:59.999999+14", "294247-01-09 23:59:59.999999", "4714-11-24 00:00:00 BC"],
    "T": ["1 year 2 mons -3 days 04:05:06.789", "-178000000 years", "00:00:00.000001", "0"],
    "U": ["\\x00ff7f", "\\x", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", '{"a": [1, null], "b": "é"}', "[]", "null",
          '"s"', "08:00:2b:01:02:03", "08:00:2b:01:02:03:04:05", "0/16B3748", "FFFFFFFF/FFFFFFFF", "10:20:10,14",
          "10:20:", "a fat cat sat", "fat & rat", "<a>1 &amp; ü</a>", "$.a[*] ? (@ > 1)", "(0,1)", "42",
          "my_cursor", "=r/{role}"],
    "G": ["(1.5,2)", "(-1e300,1e-300)", "((0,0),(1,1))", "[(0,0),(1,1),(2,0)]", "((0,0),(1,1),(2,0))",
          "<(1,1),2>", "{1,2,3}", "[(0,0),(1,1)]"],
    "I": ["192.168.0.1/24", "::1", "10.0.0.0/8", "2001:db8::/32"],
    "V": ["1", "0", "101", ""],
    "R": ["[1,5)", "empty", "(,)", "[2024-01-01,2024-02-01)", "[1.5,2.5]", '["2024-01-01 00:00:00","2024-01-02 00:00:00")',
          '["2024-01-01 00:00:00+00",infinity)', "{}", "{[1,5), [7,9)}", "{[2024-01-01,2024-02-01)}", "{[1.5,2.5]}",
          '{["2024-01-01 00:00:00","2024-01-02 00:00:00")}', '{["2024-01-01 00:00:00+00",infinity)}'],
    "E": ["sad", "ok", "happy", "with space", "Ünï"],
    "C": ["(1,x)", "(,)", '(2,"a ""q"" b")'],
    "Z": ["a", "", "Z"],
}

# types whose input function takes no text at all (PostgreSQL builds their values itself): their
# columns hold NULL only; any other type without a value means the pools above miss it
NO_INPUT = {"pg_node_tree", "pg_ndistinct", "pg_dependencies", "pg_mcv_list", "pg_brin_bloom_summary",
            "pg_brin_minmax_multi_summary", "gtsvector", "_gtsvector", "_pg_brin_bloom_summary",
            "_pg_brin_minmax_multi_summary", "_pg_node_tree", "_pg_ndistinct", "_pg_dependencies", "_pg_mcv_list"}


@dataclass(frozen=True)
class PgType:
    name: str            # as format_type prints it (valid in DDL)
    typname: str
    values: tuple[str, ...]   # SQL expressions PostgreSQL accepts for a column of this type


def _probe_types(conn) -> list[PgType]:
    """Every column type of the server with the values (SQL expressions) a column of it accepts."""
    with conn.cursor() as cur:
        cur.execute(SETUP)
        cur.execute("SELECT current_user")
        role = cur.fetchone()[0]
        cur.execute(TYPES_SQL)
        found = cur.fetchall()
    conn.autocommit = False
    out, refused = [], []
    scalar: dict[str, list[str]] = {}
    with conn.cursor() as cur:
        def accepted(tname: str, exprs: list[str]) -> list[str] | None:
            """The expressions a column of the type takes; None: PostgreSQL refuses such a column."""
            ok = []
            cur.execute("SAVEPOINT t")
            try:
                cur.execute(sql.SQL("CREATE TEMP TABLE gs_probe (c {})").format(sql.SQL(tname)))
            except psycopg2.Error:
                cur.execute("ROLLBACK TO SAVEPOINT t")
                return None
            for e in exprs:
                cur.execute("SAVEPOINT v")
                try:
                    cur.execute(sql.SQL("INSERT INTO gs_probe VALUES ({})").format(sql.SQL(e)))
                    cur.execute("RELEASE SAVEPOINT v")
                    ok.append(e)
                except psycopg2.Error:
                    cur.execute("ROLLBACK TO SAVEPOINT v")
            cur.execute("ROLLBACK TO SAVEPOINT t")
            return ok

        def lit(s: str) -> str:
            return sql.Literal(s).as_string(conn)

        for _, tname, typtype, cat, base_cat, elem, typname in found:
            if cat == "A":
                continue
            pool = POOLS.get(base_cat, []) + POOLS["S"][:2]
            got = accepted(tname, [lit(v.replace("{role}", role)) for v in pool])
            if got is not None:
                scalar[tname] = got
                out.append(PgType(tname, typname, tuple(got)))
            else:
                refused.append(typname)
        for _, tname, typtype, cat, base_cat, elem, typname in found:
            if cat != "A" and base_cat != "A":
                continue
            el = scalar.get(elem, [])     # (a domain over an array: its base type's elements)
            cands = ["'{}'", "'{NULL}'"]
            if el:
                a, b = el[0], el[-1]
                cands += [f"ARRAY[{a}::{elem}, NULL, {b}::{elem}]", f"ARRAY[[{a}::{elem}, {b}::{elem}], [{b}::{elem}, NULL]]",
                          f"('[0:1]=' || ARRAY[{a}::{elem}, {b}::{elem}]::text)::{tname}",
                          f"ARRAY[[[{a}::{elem}]], [[{b}::{elem}]]]"]
            if typname in ("int2vector", "oidvector"):
                cands += ["'1 2'", "''"]
            got = accepted(tname, cands)
            if got is not None:
                out.append(PgType(tname, typname, tuple(got)))
            else:
                refused.append(typname)
    conn.rollback()
    conn.autocommit = True
    assert set(refused) <= {"_cstring"}, refused      # PostgreSQL refuses only pseudo-type arrays as columns
    return out


@pytest.fixture(scope="module")
def catalog_types(pg_cluster):
    """The probed types (in a scratch database; each test's source database gets the same SETUP)."""
    dsn = pg_cluster.ensure_database("gs_probe")
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        return _probe_types(conn)
    finally:
        conn.close()


def test_every_column_type_of_the_server_has_values(catalog_types):
    """No type is left out silently: every type a column can have is in the pool, with values unless
    PostgreSQL itself takes no text for it (`NO_INPUT`: NULL only)."""
    names = {t.typname for t in catalog_types}
    assert {"int4", "_int4", "gs_mood", "gs_pair", "_gs_pair", "gs_intlist", "int4multirange", "cardinal_number",
            "xml", "regclass", "money", "tsvector"} <= names
    empty = {t.typname for t in catalog_types if not t.values}
    assert empty <= NO_INPUT, sorted(empty - NO_INPUT)
    assert len(catalog_types) > 150
    # the EVERY example gives each of them a column of its own (its columns take the types in order)
    assert len(catalog_types) <= len(EVERY.types) - 1, f"EVERY needs {len(catalog_types)} columns"


# -- generated tables -----------------------------------------------------------------------------------

_NAME = _PART.filter(lambda s: len(s.encode()) <= 63 and not s.lower().startswith("pg_")
                     and lake_name_problem([s]) is None)


@dataclass(frozen=True)
class Spec:
    schema: str
    table: str
    names: tuple[str, ...]    # identity, generated, the columns..., the added column
    types: tuple[int, ...]    # per column and the added one: an index into the types (modulo their count)
    keyed: bool               # identity column as primary key, else no key and REPLICA IDENTITY FULL
    seed: int
    density: float = 0.7      # share of non-null values


@st.composite
def specs(draw):
    n = draw(st.integers(2, 12))
    names = draw(st.lists(_NAME, min_size=n + 3, max_size=n + 3, unique_by=str.lower))
    types = draw(st.lists(st.integers(0, 10_000), min_size=n + 1, max_size=n + 1))
    return Spec(schema=draw(_NAME), table=draw(_NAME), names=tuple(names), types=tuple(types),
                keyed=draw(st.booleans()), seed=draw(st.integers(0, 2**31)))


# one column of each type the server offers (178 on PostgreSQL 15; the test above checks there are no
# more), most of them with values (density 0.7: a value in about half the rows), under a key
EVERY = Spec(schema="Every Schema", table="Ωvery.type", names=("id", "Generated \"total\"",
             *(f"c{i} Ünï.{'X' if i % 2 else 'y'}" for i in range(178)), "added"),
             types=tuple(range(179)), keyed=True, seed=7)


# the same as a 1,000-column table with few values (each type five or six times): the nightly profile
# (~3 minutes; EVERY takes each type in CI, and test_consolidate_schema a 150-column table past Delta's
# description and Spark's codegen limits)
WIDE = Spec(schema="Wide Schema", table="Ωide.table", names=("id", "Generated \"total\"",
            *(f"c{i} Ünï.{'X' if i % 2 else 'y'}" for i in range(1000)), "added"),
            types=tuple(range(1001)), keyed=True, seed=7, density=0.08)


# found by this test: a column named '...' in a table without a key (its rows sorted by every column)
# failed the merge, Arrow reading a name that starts with '.' or '[' as a path of nested fields
DOTS = Spec(schema="s.x", table="[t]", names=("|id", "ge.n", "...", ".a", "[x]", "add.ed"), types=(305, 952, 667, 4108),
            keyed=False, seed=9998)


class Table:
    """The generated table in the source: its DDL, rows and changes."""

    def __init__(self, conn, spec: Spec, types: list[PgType]):
        self.conn, self.spec = conn, spec
        self.rng = random.Random(spec.seed)
        self.id, self.gen = spec.names[0], spec.names[1]
        self.cols = list(zip(spec.names[2:-1], [types[i % len(types)] for i in spec.types[:-1]]))
        self.added = (spec.names[-1], types[spec.types[-1] % len(types)])
        self.ident = sql.Identifier(spec.schema, spec.table)

    def run(self, query):
        """Run one statement (no parameters: a '%' in a name is not a placeholder then)."""
        with self.conn.cursor() as cur:
            cur.execute(query)

    def create(self) -> None:
        cols = [sql.SQL("{} int8 GENERATED ALWAYS AS IDENTITY{}").format(
                    sql.Identifier(self.id), sql.SQL(" PRIMARY KEY" if self.spec.keyed else "")),
                sql.SQL("{} int8 GENERATED ALWAYS AS ({} * 2) STORED").format(sql.Identifier(self.gen),
                                                                              sql.Identifier(self.id))]
        cols += [sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(t.name)) for n, t in self.cols]
        self.run(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.spec.schema)))
        self.run(sql.SQL("CREATE TABLE {} ({})").format(self.ident, sql.SQL(", ").join(cols)))
        if not self.spec.keyed:
            self.run(sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(self.ident))

    def _value(self, t: PgType) -> str:
        if not t.values or self.rng.random() > self.spec.density:
            return "NULL"
        return self.rng.choice(t.values)

    def insert(self, n: int) -> None:
        for _ in range(n):
            cols = [c for c in self.cols if self.rng.random() < self.spec.density]
            if not cols:
                self.run(sql.SQL("INSERT INTO {} DEFAULT VALUES").format(self.ident))
                continue
            self.run(sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                self.ident, sql.SQL(", ").join(sql.Identifier(c) for c, _ in cols),
                sql.SQL(", ").join(sql.SQL(self._value(t)) for _, t in cols)))

    def ids(self) -> list[int]:
        with self.conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT {} FROM {} ORDER BY 1").format(sql.Identifier(self.id), self.ident))
            return [r[0] for r in cur.fetchall()]

    def change(self) -> None:
        """Updates of a few columns of some rows (one touching none but the key's neighbours), deletes, inserts."""
        ids = self.ids()
        for row in self.rng.sample(ids, min(len(ids), 3)):
            cols = self.rng.sample(self.cols, min(len(self.cols), 3))
            self.run(sql.SQL("UPDATE {} SET {} WHERE {} = {}").format(
                self.ident, sql.SQL(", ").join(sql.SQL("{} = {}").format(sql.Identifier(c), sql.SQL(self._value(t)))
                                               for c, t in cols), sql.Identifier(self.id), sql.Literal(row)))
        for row in self.rng.sample(ids, min(len(ids), 1)):
            self.run(sql.SQL("DELETE FROM {} WHERE {} = {}").format(self.ident, sql.Identifier(self.id), sql.Literal(row)))
        self.insert(2)

    def add_column(self) -> None:
        """ADD COLUMN (no default: existing rows read null), then changes that use it."""
        name, t = self.added
        self.run(sql.SQL("ALTER TABLE {} ADD COLUMN {} {}").format(self.ident, sql.Identifier(name), sql.SQL(t.name)))
        self.cols.append(self.added)
        self.change()
        for row in self.ids()[:2]:
            self.run(sql.SQL("UPDATE {} SET {} = {} WHERE {} = {}").format(
                self.ident, sql.Identifier(name), sql.SQL(self._value(t)), sql.Identifier(self.id), sql.Literal(row)))

    def drop_column(self) -> None:
        """DROP COLUMN (one of the generated columns), then changes."""
        dropped = self.cols.pop(self.rng.randrange(len(self.cols) - 1))
        self.run(sql.SQL("ALTER TABLE {} DROP COLUMN {}").format(self.ident, sql.Identifier(dropped[0])))
        self.change()


def consolidate_like_the_dag(cfg, spark, rounds: int = 4) -> None:
    """Consolidate as the consolidate DAG does: an array value its column's lists cannot hold asks
    for a re-snapshot of the table (the column becomes PostgreSQL's text), which its resend step takes."""
    from tidemark import gaps
    from tidemark.consolidate import ConsolidateError

    for _ in range(rounds):
        drain_until_current(cfg)
        try:
            consolidate(cfg, spark)
            return
        except ConsolidateError:
            report = gaps.detect(cfg)
            assert report.action == "resend" and report.resnapshot, report
            gaps.resend(cfg)
    raise AssertionError(f"still asking for re-snapshots after {rounds} rounds")


def assert_lake_equals_source(cfg, ref: TableRef, generated: str) -> None:
    conn = connect_source(cfg)
    try:
        # array columns a value their lists cannot hold ('[0:1]={..}', 3-D) reached are PostgreSQL's text
        shape = table_schema_from_catalog(conn, ref.schema, ref.name).with_text(held_as_text(cfg, ref.qualified))
        assert generated not in [c.name for c in shape.columns]
        lake = read_table(cfg, ref)
        assert lake.schema == arrow_schema(shape), (ref, lake.schema.names[:5], arrow_schema(shape).names[:5])
        want, got = rows(source_table(conn, shape)), rows(lake)
        assert got == want, (ref, "missing:", list((want - got).items())[:3], "extra:", list((got - want).items())[:3])
    finally:
        conn.close()
    report = parity_report(cfg)[ref.qualified]
    assert report["equal"] and report["not_captured"] == [generated], report


@pytest.fixture
def gen_source(source_conn):
    with source_conn.cursor() as cur:
        cur.execute(SETUP)
    return source_conn


# no shrinking: each example costs three Spark consolidations; a failure prints its example whole
@settings(max_examples=3, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate], report_multiple_bugs=False,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.large_base_example])
@example(spec=EVERY)
@example(spec=DOTS)
@given(spec=specs())
def test_generated_schemas_snapshot_stream_and_alter_equal_the_source(spec, catalog_types, gen_source, make_stream,
                                                                      spark):
    round_trip(spec, catalog_types, gen_source, make_stream, spark)


@pytest.mark.nightly        # each type in CI: the EVERY example above
def test_a_thousand_columns_snapshot_stream_and_alter_equal_the_source(catalog_types, gen_source, make_stream, spark):
    round_trip(WIDE, catalog_types, gen_source, make_stream, spark)


def round_trip(spec: Spec, catalog_types, gen_source, make_stream, spark) -> None:
    """The table of ``spec``: rows, `stream apply`, snapshot, changes, consolidation, lake == source;
    then ADD COLUMN and DROP COLUMN, each followed by the same."""
    table = Table(gen_source, spec, catalog_types)
    table.create()
    table.insert(4)
    ref = TableRef(spec.schema, spec.table)
    cfg = make_stream([ref.qualified], consolidate={"buckets": 2})
    try:
        notes: list[str] = []
        apply_stream(cfg, notes=notes)
        assert any(table.gen in n and "generated" in n for n in notes), notes     # named as not captured
        snapshot_stream(cfg)
        table.change()
        consolidate_like_the_dag(cfg, spark)
        assert_lake_equals_source(cfg, ref, table.gen)
        # one round each (a DROP and an ADD COLUMN in one batch are told from a RENAME COLUMN by the
        # columns' attnums: `test_schema_changes_online`, `test_adversarial_schema`)
        for alter in (table.add_column, table.drop_column):
            alter()
            consolidate_like_the_dag(cfg, spark)
            assert_lake_equals_source(cfg, ref, table.gen)
    finally:
        drop_slot(cfg)
        table.run(sql.SQL("DROP TABLE IF EXISTS {}").format(table.ident))

