"""`tidemark parity`: each lake table against its source table, as an oracle.

The source is read the way the drain reads it: every value in its type's *output* text (what pgoutput
sends, under Tidemark's canonical session settings), parsed by the same per-type parsers into lake
types — never ``col::text`` (which prints ``true`` for a bool where the output function prints ``t``,
and trims ``char(n)``'s padding). Both sides are compared as multisets of rows whose temporal values
are integers (±infinity and BC dates survive) and whose floats keep NaN, ±Infinity and -0 apart.

`moved_since` answers whether a table changed after the frontier (so a mismatch may only mean "not
consolidated yet"): from the landed segments past the frontier and, only if those do not already
say so, the changes the slot still holds (peeked, never consumed).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

from tidemark.config import StreamConfig


def source_table(conn, schema):
    """``SELECT`` the table's columns as their output text (raw, not psycopg2's parsing) in lake types."""
    import psycopg2.extensions as ext
    import pyarrow as pa
    from psycopg2 import sql

    from tidemark.pgtypes import arrow_schema, lake_array, text_parser

    cols = sql.SQL(", ").join(sql.Identifier(c.name) for c in schema.columns)
    query = sql.SQL("SELECT {} FROM {}").format(cols, sql.Identifier(schema.schema, schema.name))
    with conn.cursor() as cur:
        cur.execute(sql.SQL("{} LIMIT 0").format(query))   # the result's type OIDs, then read them as text
        raw = ext.new_type(tuple({d.type_code for d in cur.description}), "TIDEMARK_PARITY_RAW", lambda v, c: v)
        ext.register_type(raw, cur)
        cur.execute(query)
        rows = cur.fetchall()
    arrays = []
    for i, col in enumerate(schema.columns):
        parse = text_parser(col)
        arrays.append(lake_array(col, [None if r[i] is None else parse(r[i]) for r in rows]))
    return pa.Table.from_arrays(arrays, schema=arrow_schema(schema))


def _canon(v: Any) -> Any:
    """A JSON-able form that keeps what equality must keep: NaN, ±Infinity, -0.0, bytes, lists."""
    if isinstance(v, float):
        if v != v:
            return ["f", "NaN"]
        return ["f", repr(v)]          # repr keeps -0.0 and inf apart
    if isinstance(v, (bytes, bytearray)):
        return ["b", bytes(v).hex()]
    if isinstance(v, list):
        return [_canon(x) for x in v]
    if isinstance(v, dict):
        return {k: _canon(x) for k, x in v.items()}
    if isinstance(v, (int, str, bool)) or v is None:
        return v
    return ["r", repr(v)]              # Decimal and the like: their exact repr


def table_checksum(table) -> tuple[int, str]:
    """Row count and an order-independent sha256 of the rows (a multiset: duplicates count), rows
    identified by value bits (`tidemark.rowid`: a NaN is its bits, -0.0 is not 0.0)."""
    from tidemark.rowid import row_keys

    rows = sorted(json.dumps([_canon(v) for v in k]) for k in row_keys(table)) if table.num_columns else []
    h = hashlib.sha256()
    for r in rows:
        h.update(r.encode())
        h.update(b"\n")
    return len(rows), h.hexdigest()


def parity_report(cfg: StreamConfig) -> dict[str, dict[str, Any]]:
    """Compare each lake table with its source table: row count and content checksum each side."""
    import pyarrow as pa

    from tidemark.capture.source import connect_source
    from tidemark.lake import read_table
    from tidemark.pgtypes import table_schema_from_catalog
    from tidemark.pgtypes.catalog import generated_columns

    out = {}
    conn = connect_source(cfg)
    try:
        for ref in cfg.source.tables:
            schema = table_schema_from_catalog(conn, ref.schema, ref.name)
            src = source_table(conn, schema)
            lake = read_table(cfg, ref.qualified)
            missing = [n for n in src.schema.names if n not in lake.schema.names]
            if missing or pa.schema([lake.schema.field(n) for n in src.schema.names]) != src.schema:
                lake_rows, lake_sum = lake.num_rows, "different columns: " + ", ".join(
                    missing or [f.name for f in lake.schema if f not in src.schema])
            else:
                lake_rows, lake_sum = table_checksum(lake.select(src.schema.names))
            source_rows, source_sum = table_checksum(src)
            # generated columns are not published by pgoutput: equal means equal on the captured columns,
            # and the report says which columns are not captured
            out[ref.qualified] = {"source_rows": source_rows, "lake_rows": lake_rows,
                                  "source_checksum": source_sum, "lake_checksum": lake_sum,
                                  "equal": (source_rows, source_sum) == (lake_rows, lake_sum),
                                  "not_captured": generated_columns(conn, ref.schema, ref.name)}
    finally:
        conn.close()
    return out


# -- did the tables move past the frontier? ------------------------------------------------------------------

def moved_since(cfg: StreamConfig, frontier: int | None, tables: list[str]) -> dict[str, bool | None]:
    """Per table: True if a change committed at or after ``frontier`` touched it, False if none did,
    None if that cannot be told (the slot is busy with a drain or gone)."""
    from tidemark.control import open_control
    from tidemark.landing.segments import read_segment
    from tidemark.landing.store import read_uri

    if frontier is None:
        return {t: True for t in tables}
    moved = {t: False for t in tables}
    with open_control(cfg) as ctl:
        state = ctl.stream(cfg.stream)
        segs = [s for s in ctl.segments(cfg.stream, status="landed") if s.upper > frontier]
    for s in segs:
        content = read_segment(read_uri(s.uri, endpoint_url=cfg.landing.endpoint_url), s.uri)
        for u in content.updates:
            if u.time >= frontier and u.table.qualified in moved:
                moved[u.table.qualified] = True
        for e in content.events:
            if e.time >= frontier and e.table in moved:
                moved[e.table] = True
    if all(moved.values()):
        return moved
    beyond = _slot_tables(cfg, max(frontier, state.landed_upper or frontier))
    if beyond is None:
        return {t: True if m else None for t, m in moved.items()}
    return {t: m or t in beyond for t, m in moved.items()}


def _slot_tables(cfg: StreamConfig, since: int) -> set[str] | None:
    """Tables touched by transactions committed at or after ``since`` that the slot still holds
    (``pg_logical_slot_peek_binary_changes``: read, not consumed); None if the slot cannot be peeked."""
    import psycopg2

    from tidemark.capture.source import connect_source

    conn = connect_source(cfg)
    try:
        with conn.cursor() as cur:
            cur.execute("""SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1',
                                                                                 'publication_names', %s)""",
                        (cfg.source.slot, cfg.source.publication))
            messages = [bytes(r[0]) for r in cur.fetchall()]
    except psycopg2.Error:
        return None
    finally:
        conn.close()
    names: dict[int, str] = {}
    touched: set[str] = set()
    commit = 0
    pending: set[int] = set()
    for m in messages:
        kind = m[:1]
        if kind == b"B":
            commit = struct.unpack_from(">Q", m, 1)[0]
            pending = set()
        elif kind == b"R":
            oid = struct.unpack_from(">I", m, 1)[0]
            nsp_end = m.index(b"\0", 5)
            rel_end = m.index(b"\0", nsp_end + 1)
            names[oid] = f"{m[5:nsp_end].decode()}.{m[nsp_end + 1:rel_end].decode()}"
        elif kind in (b"I", b"U", b"D"):
            pending.add(struct.unpack_from(">I", m, 1)[0])
        elif kind == b"T":
            n = struct.unpack_from(">I", m, 1)[0]
            pending.update(struct.unpack_from(f">{n}I", m, 6))
        elif kind == b"C" and commit >= since:
            touched |= {names.get(oid, str(oid)) for oid in pending}
    return touched
