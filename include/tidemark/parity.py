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
from typing import Any

from tidemark.config import StreamConfig
from tidemark.lake.delta import (data_files, exact_schema, filesystem, open_delta, open_lake_table, storage_options,
                                 table_info, table_uri)
from tidemark.pgtypes import TableSchema, arrow_schema, lake_array, table_schema_from_catalog, text_parser
from tidemark.pgtypes.catalog import generated_columns, published_filter
from tidemark.rowid import row_keys


CHUNK_ROWS = 50_000     # rows read, parsed and hashed at a time on each side: memory follows this, not the table


def source_chunks(conn, schema, where: str | None = None):
    """The table's rows as Arrow tables of at most `CHUNK_ROWS` rows (lake types, each value parsed
    from its output text, raw, not psycopg2's parsing), read through a server-side cursor so that
    neither side holds the whole table. ``conn`` must not be in autocommit mode (a named cursor
    lives in a transaction). ``where``: the publication's row filter (`published_filter`): only the
    rows it publishes, as the snapshot copies them."""
    import psycopg2.extensions as ext
    import pyarrow as pa
    from psycopg2 import sql

    target = arrow_schema(schema)
    parsers = [text_parser(col) for col in schema.columns]
    cols = sql.SQL(", ").join(sql.Identifier(c.name) for c in schema.columns)
    query = sql.SQL("SELECT {} FROM {}").format(cols, sql.Identifier(schema.schema, schema.name))
    if where is not None:
        # deferred: psycopg2 (via capture.snapshot): `import tidemark.parity` (local.embedded's) does not load it
        from tidemark.capture.snapshot import row_filter_sql

        query = sql.SQL("{} WHERE {}").format(query, row_filter_sql(where))
    with conn.cursor() as cur:
        cur.execute(sql.SQL("{} LIMIT 0").format(query))   # the result's type OIDs, then read them as text
        raw = ext.new_type(tuple({d.type_code for d in cur.description}), "TIDEMARK_PARITY_RAW", lambda v, c: v)
    with conn.cursor(name="tidemark_parity") as cur:
        ext.register_type(raw, cur)
        cur.itersize = CHUNK_ROWS
        cur.execute(query)
        while rows := cur.fetchmany(CHUNK_ROWS):
            arrays = [lake_array(col, [None if r[i] is None else parse(r[i]) for r in rows])
                      for i, (col, parse) in enumerate(zip(schema.columns, parsers))]
            del rows
            yield pa.Table.from_arrays(arrays, schema=target)


def source_table(conn, schema):
    """``SELECT`` the table's columns as their output text (raw, not psycopg2's parsing) in lake types
    (`source_chunks`, concatenated: for small tables)."""
    import pyarrow as pa

    chunks = list(source_chunks(conn, schema))
    return pa.concat_tables(chunks) if chunks else arrow_schema(schema).empty_table()


LONG_VALUE = 4096       # a longer text or bytea value is canonical as its sha256, not its hex or JSON text


def _canon(v: Any) -> Any:
    """A JSON-able form that keeps what equality must keep: NaN, ±Infinity, -0.0, bytes, lists (a long
    text or bytea value as its sha256: a huge value is not copied into hex and JSON)."""
    if isinstance(v, float):
        if v != v:
            return ["f", "NaN"]
        return ["f", repr(v)]          # repr keeps -0.0 and inf apart
    if isinstance(v, (bytes, bytearray)):
        if len(v) > LONG_VALUE:
            return ["B", hashlib.sha256(v).hexdigest()]
        return ["b", bytes(v).hex()]
    if isinstance(v, str) and len(v) > LONG_VALUE:
        return ["S", hashlib.sha256(v.encode()).hexdigest()]
    if isinstance(v, list):
        return [_canon(x) for x in v]
    if isinstance(v, dict):
        return {k: _canon(x) for k, x in v.items()}
    if isinstance(v, (int, str, bool)) or v is None:
        return v
    return ["r", repr(v)]              # Decimal and the like: their exact repr


def table_checksum(table) -> tuple[int, str]:
    """Row count and the checksum (`_chunks_checksum`) of ``table``'s rows."""
    return _chunks_checksum(table.to_batches(CHUNK_ROWS))


def _chunks_checksum(chunks) -> tuple[int, str]:
    """Row count and an order-independent checksum of the rows of ``chunks`` (Arrow tables or record
    batches): the sum modulo 2^256 of each row's sha256 (duplicates count; rows identified by value
    bits, `tidemark.rowid`: a NaN is its bits, -0.0 is not 0.0). Nothing is kept per row, so its memory
    is one chunk's."""
    rows, total = 0, 0
    for chunk in chunks:
        if not chunk.num_columns:
            continue
        for k in row_keys(chunk):
            total += int.from_bytes(hashlib.sha256(json.dumps([_canon(v) for v in k]).encode()).digest(), "big")
            rows += 1
        total %= 1 << 256
    return rows, f"{total:064x}"


def lake_chunks(cfg: StreamConfig, table: str):
    """(schema, chunks): the lake table's source columns (`tidemark.lake.delta.exact_schema`) and its
    current rows as record batches of at most `CHUNK_ROWS` rows, read file by file."""
    import pyarrow.dataset as ds

    uri, opts, dt = open_lake_table(cfg, table)
    schema = exact_schema(dt)
    files = data_files(dt, uri)

    def chunks(columns):
        if not files:
            return
        dataset = ds.dataset(files, format="parquet", schema=schema, filesystem=filesystem(uri, opts))
        yield from dataset.to_batches(columns=columns, batch_size=CHUNK_ROWS, batch_readahead=1,
                                      fragment_readahead=1, use_threads=False)
    return schema, chunks


def held_as_text(cfg: StreamConfig, table: str) -> list[str]:
    """The array columns the lake table holds as PostgreSQL's text, as its recorded shape says
    (`TableSchema.held_as_text`); the others are lists, as the catalog gives them."""
    dt = open_delta(table_uri(cfg, table), storage_options(cfg))
    doc = table_info(dt).get("table_schema") if dt is not None else None
    return TableSchema.from_json(doc).held_as_text if doc else []


def parity_report(cfg: StreamConfig) -> dict[str, dict[str, Any]]:
    """Compare each lake table with its source table: row count and content checksum each side, both
    read and hashed in chunks of `CHUNK_ROWS` rows (memory follows that, not the table's size)."""
    import pyarrow as pa

    # deferred: psycopg2 (via capture.source): `import tidemark.parity` (local.embedded's) does not load it
    from tidemark.capture.source import connect_source

    out = {}
    conn = connect_source(cfg, autocommit=False)        # the server-side cursors live in a transaction
    try:
        for ref in cfg.source.tables:
            schema = table_schema_from_catalog(conn, ref.schema, ref.name)
            # the columns and rows the stream's publication publishes (its column list and row filter)
            columns, where = published_filter(conn, cfg.source.publication, schema.oid)
            if columns is not None:
                schema = table_schema_from_catalog(conn, ref.schema, ref.name, columns=columns)
            # array columns the lake holds as PostgreSQL's text (a value their lists could not hold came)
            schema = schema.with_text(held_as_text(cfg, ref.qualified))
            src_schema = arrow_schema(schema)
            lake_schema, lake = lake_chunks(cfg, ref.qualified)
            missing = [n for n in src_schema.names if n not in lake_schema.names]
            if missing or pa.schema([lake_schema.field(n) for n in src_schema.names]) != src_schema:
                lake_rows = sum(b.num_rows for b in lake([]))
                lake_sum = "different columns: " + ", ".join(missing or [f.name for f in lake_schema
                                                                         if f not in src_schema])
            else:
                lake_rows, lake_sum = _chunks_checksum(lake(src_schema.names))
            source_rows, source_sum = _chunks_checksum(source_chunks(conn, schema, where=where))
            # generated columns are not published by pgoutput: equal means equal on the captured columns,
            # and the report says which columns are not captured
            out[ref.qualified] = {"source_rows": source_rows, "lake_rows": lake_rows,
                                  "source_checksum": source_sum, "lake_checksum": lake_sum,
                                  "equal": (source_rows, source_sum) == (lake_rows, lake_sum),
                                  "not_captured": generated_columns(conn, ref.schema, ref.name),
                                  **({"columns": columns} if columns is not None else {}),
                                  **({"where": where} if where is not None else {})}
            conn.rollback()             # read only: end the snapshot before the next table
    finally:
        conn.close()
    return out


# -- did the tables move past the frontier? ------------------------------------------------------------------

def moved_since(cfg: StreamConfig, frontier: int | None, tables: list[str]) -> dict[str, bool | None]:
    """Per table: True if a change committed at or after ``frontier`` touched it, False if none did,
    None if that cannot be told (the slot is busy with a drain or gone)."""
    # deferred: psycopg2 and fastavro (via control, landing.segments), which `import tidemark.parity` does not load
    from tidemark.control import open_control
    from tidemark.landing.segments import read_segment_at

    if frontier is None:
        return {t: True for t in tables}
    moved = {t: False for t in tables}
    with open_control(cfg) as ctl:
        state = ctl.stream(cfg.stream)
        segs = [s for s in ctl.segments(cfg.stream, status="landed") if s.upper > frontier]
    for s in segs:
        content = read_segment_at(s.uri, cfg.landing.endpoint_url)
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

    # deferred: psycopg2 and fastavro (via capture.source, capture.pgoutput): `import tidemark.parity`
    # (local.embedded's) does not load them
    from tidemark.capture import pgoutput as pgo
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
    for m in map(pgo.decode_message, messages):
        if isinstance(m, pgo.Begin):
            commit, pending = m.final_lsn, set()
        elif isinstance(m, pgo.Relation):
            names[m.oid] = f"{m.namespace}.{m.name}"
        elif isinstance(m, (pgo.Insert, pgo.Update, pgo.Delete)):
            pending.add(m.oid)
        elif isinstance(m, pgo.Truncate):
            pending.update(m.oids)
        elif isinstance(m, pgo.Commit) and commit >= since:
            touched |= {names.get(oid, str(oid)) for oid in pending}
    return touched
