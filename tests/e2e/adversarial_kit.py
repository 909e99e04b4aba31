"""Helpers for the adversarial end-to-end tests: drain to the source's current position,
consolidate, and compare every lake table with ``SELECT *`` of the source (exact lake types)."""

from __future__ import annotations

from tidemark.capture.snapshot import snapshot_stream
from tidemark.lake import read_table
from tidemark.parity import held_as_text
from tidemark.pgtypes import arrow_schema, table_schema_from_catalog
from tidemark.capture.source import connect_source

from oracle import consolidate, drain_until_current, rows, source_table  # noqa: F401  (re-exported)


def assert_lake_equals_source(cfg, tables=None) -> None:
    """Every (or the given) captured table: lake schema and rows equal the source's."""
    conn = connect_source(cfg)
    try:
        for ref in tables or cfg.source.tables:
            # array columns the lake holds as PostgreSQL's text (a value their lists cannot hold came)
            shape = table_schema_from_catalog(conn, ref.schema, ref.name).with_text(held_as_text(cfg, ref.qualified))
            lake = read_table(cfg, ref)
            assert lake.schema == arrow_schema(shape), ref
            want = rows(source_table(conn, shape))
            got = rows(lake)
            assert got == want, (ref, "missing:", list((want - got).items())[:5], "extra:",
                                 list((got - want).items())[:5])
    finally:
        conn.close()


def snapshotted_t(make_stream, conn, fill: str, table: str = "public.t"):
    """A stream over a new table ``t (id int PRIMARY KEY, v text)`` filled by the statement ``fill``,
    its snapshot taken."""
    with conn.cursor() as cur:
        for s in ("CREATE TABLE t (id int PRIMARY KEY, v text)", fill):
            cur.execute(s)
    cfg = make_stream([table])
    snapshot_stream(cfg)
    return cfg


def cycle(cfg, spark, *, max_changes: int | None = None):
    """Drain to current, consolidate, compare."""
    drain_until_current(cfg, max_changes=max_changes)
    res = consolidate(cfg, spark)
    assert_lake_equals_source(cfg)
    return res
