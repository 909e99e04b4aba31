"""Helpers for the adversarial end-to-end tests: drain to the source's current position,
consolidate, and compare every lake table with ``SELECT *`` of the source (exact lake types)."""

from __future__ import annotations



from tidemark.consolidate import consolidate_stream
from tidemark.control import Control
from tidemark.drain import drain_stream
from tidemark.lake import read_table
from tidemark.pgtypes import arrow_schema, table_schema_from_catalog
from tidemark.source import connect_source, control_dsn

from oracle import rows, source_table  # noqa: F401  (re-exported for the adversarial tests)


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
