"""Helpers for the adversarial end-to-end tests: drain to the source's current position,
consolidate, and compare every lake table with ``SELECT *`` of the source (exact lake types)."""

from __future__ import annotations

from collections import Counter

from psycopg2 import sql

from tidemark.consolidate import consolidate_stream
from tidemark.consolidate.layout import plain
from tidemark.control import Control
from tidemark.drain import drain_stream
from tidemark.lake import read_table
from tidemark.pgtypes import arrow_schema, lake_array, table_schema_from_catalog, text_parser
from tidemark.source import connect_source, control_dsn


def insert_lsn(cfg) -> int:
    """The source's WAL insert position (the flush position lags behind with synchronous_commit=off)."""
    conn = connect_source(cfg)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
            return int(cur.fetchone()[0])
    finally:
        conn.close()


def drain_until_current(cfg, *, max_changes: int | None = None, rounds: int = 200) -> int:
    """Drain segments until the landed upper reaches the source's current position; return how many."""
    target = insert_lsn(cfg)
    with Control(control_dsn(cfg)) as ctl:
        for n in range(1, rounds + 1):
            drain_stream(cfg, max_changes=max_changes)
            if ctl.stream(cfg.stream).landed_upper >= target:
                return n
    raise AssertionError("the drain did not reach the source's flush position")


def consolidate(cfg, spark):
    """Consolidate and check the frontier reached everything landed."""
    res = consolidate_stream(cfg, spark=spark)
    with Control(control_dsn(cfg)) as ctl:
        state = ctl.stream(cfg.stream)
    assert state.frontier == state.landed_upper, (res, state)
    return res


def _norm(v):
    if isinstance(v, float) and v != v:
        return "NaN"
    if isinstance(v, list):
        return tuple(_norm(x) for x in v)
    return v


def rows(table) -> Counter:
    """Rows of an Arrow table (temporal values as integers, NaN comparable) as a Counter."""
    view = plain(table)
    cols = [[_norm(v) for v in view.column(i).to_pylist()] for i in range(view.num_columns)]
    return Counter(zip(*cols))


def source_table(conn, shape):
    """``SELECT *`` of the source (text output, canonical parse) in lake types: the oracle."""
    import pyarrow as pa

    # each value's output-function text (what pgoutput sends): ``::text`` differs for bool, inet, char(n)
    cols = sql.SQL(", ").join(sql.SQL("CASE WHEN {0} IS NULL THEN NULL ELSE format('%s', {0}) END")
                              .format(sql.Identifier(c.name)) for c in shape.columns)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT {} FROM {}").format(cols, sql.Identifier(shape.schema, shape.name)))
        raw = cur.fetchall()
    arrays = []
    for i, c in enumerate(shape.columns):
        parse = text_parser(c)
        arrays.append(lake_array(c, [None if r[i] is None else parse(r[i]) for r in raw]))
    return pa.Table.from_arrays(arrays, schema=arrow_schema(shape))


def assert_lake_equals_source(cfg, tables=None) -> None:
    """Every (or the given) captured table: lake schema and rows equal the source's."""
    conn = connect_source(cfg)
    try:
        for ref in tables or cfg.source.tables:
            shape = table_schema_from_catalog(conn, ref.schema, ref.name)
            lake = read_table(cfg, ref)
            assert lake.schema == arrow_schema(shape), ref
            want = rows(source_table(conn, shape))
            got = rows(lake)
            assert got == want, (ref, "missing:", list((want - got).items())[:5], "extra:",
                                 list((got - want).items())[:5])
    finally:
        conn.close()


def cycle(cfg, spark, *, max_changes: int | None = None):
    """Drain to current, consolidate, compare."""
    drain_until_current(cfg, max_changes=max_changes)
    res = consolidate(cfg, spark)
    assert_lake_equals_source(cfg)
    return res
