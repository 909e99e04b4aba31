"""The oracle of the end-to-end tests: PostgreSQL's own rows, in lake types, compared as multisets;
and the two steps every such test repeats: drain to the source's current position, consolidate."""

from __future__ import annotations

from collections import Counter

from psycopg2 import sql

from tidemark.consolidate.preconsolidate import plain
from tidemark.control import Control
from tidemark.pgtypes import arrow_schema, lake_array, text_parser
from tidemark.control import control_dsn
from tidemark.capture.source import apply_stream, connect_source
from tidemark.lsn import parse_lsn


def norm(v):
    """Make a value comparable in a tuple: NaN equals NaN, lists become tuples."""
    if isinstance(v, float) and v != v:
        return "NaN"
    if isinstance(v, list):
        return tuple(norm(x) for x in v)
    return v


def row_tuples(table) -> list[tuple]:
    """Rows of an Arrow table as tuples (temporal values as integers, NaN comparable)."""
    view = plain(table)
    cols = [[norm(v) for v in view.column(i).to_pylist()] for i in range(view.num_columns)]
    return list(zip(*cols))


def rows(table) -> Counter:
    """Rows of an Arrow table as a multiset."""
    return Counter(row_tuples(table))


def source_table(conn, shape, where: str | None = None):
    """``SELECT *`` of the source in lake types: each value's output-function text (what pgoutput
    sends; ``::text`` differs for bool, inet, char(n)) parsed the canonical way (``where``: only the
    rows for which that SQL condition is true)."""
    import pyarrow as pa

    # num_nulls, not IS NULL: a composite value whose fields are all null ('(,)') IS NULL in SQL
    cols = sql.SQL(", ").join(sql.SQL("CASE WHEN num_nulls({0}) = 1 THEN NULL ELSE format('%s', {0}) END")
                              .format(sql.Identifier(c.name)) for c in shape.columns)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT {} FROM {}{}").format(
            cols, sql.Identifier(shape.schema, shape.name),
            sql.SQL("") if where is None else sql.SQL(" WHERE ({}) IS TRUE").format(sql.SQL(where))))
        raw = cur.fetchall()
    arrays = []
    for i, c in enumerate(shape.columns):
        parse = text_parser(c)
        arrays.append(lake_array(c, [None if r[i] is None else parse(r[i]) for r in raw]))
    return pa.Table.from_arrays(arrays, schema=arrow_schema(shape))


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
    from tidemark.capture.drain import drain_stream

    target = insert_lsn(cfg)
    with Control(control_dsn(cfg)) as ctl:
        for n in range(1, rounds + 1):
            drain_stream(cfg, max_changes=max_changes)
            if ctl.stream(cfg.stream).landed_upper >= target:
                return n
    raise AssertionError("the drain did not reach the source's current position")


def consolidate(cfg, spark):
    """Consolidate and check the frontier reached everything landed."""
    from tidemark.consolidate import consolidate_stream

    res = consolidate_stream(cfg, spark=spark)
    with Control(control_dsn(cfg)) as ctl:
        state = ctl.stream(cfg.stream)
    assert state.frontier == state.landed_upper, (res, state)
    return res


def snapshots_taken(cfg) -> int:
    """How many snapshots (copies from the source, of any mode) the stream has taken."""
    import psycopg2

    with psycopg2.connect(control_dsn(cfg)) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM tidemark.snapshots WHERE stream = %s", (cfg.stream,))
        return int(cur.fetchone()[0])


def start_at_new_slot(cfg, source_conn, control) -> int:
    """Register the stream, create its slot and start the stream at the slot's consistent point."""
    apply_stream(cfg)
    with source_conn.cursor() as cur:
        cur.execute("SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (cfg.source.slot,))
        lsn = parse_lsn(cur.fetchone()[0])
    control.update_stream(cfg.stream, consistent_lsn=lsn, landed_upper=lsn)
    return lsn


def assert_lake_equals_source(cfg, table: str, columns: list[str] | None = None, where: str | None = None) -> None:
    """The lake's ``table`` holds exactly the rows PostgreSQL holds now (as a multiset); ``columns``
    and ``where``: only those columns (the lake has no other) of the rows where that is true."""
    from tidemark.lake import read_table
    from tidemark.parity import held_as_text
    from tidemark.pgtypes.catalog import table_schema_from_catalog

    conn = connect_source(cfg)
    try:
        schema, name = table.split(".")
        shape = table_schema_from_catalog(conn, schema, name, columns=columns)
        # array columns the lake holds as PostgreSQL's text (a value their lists cannot hold came)
        expected = source_table(conn, shape.with_text(held_as_text(cfg, table)), where)
    finally:
        conn.close()
    lake = read_table(cfg, table)
    assert lake.schema.names == expected.schema.names, (table, lake.schema.names, expected.schema.names)
    assert rows(lake) == rows(expected), table
