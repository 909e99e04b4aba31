"""One chunk of a snapshot: a page range of one relation, the COPY statement that reads it (each
column as text Arrow parses directly), and its CSV turned into the lake's values and written as
Parquet (the values equal what the drain's become in the lake; docs/internals/capture.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from psycopg2 import sql

from tidemark.errors import TidemarkError
from tidemark.pgtypes import (DATE_NEG_INF, DATE_POS_INF, TS_NEG_INF, TS_POS_INF, Column, TableSchema,
                              arrow_schema, arrow_type, lake_array)


class SnapshotError(TidemarkError):
    """A snapshot could not be taken or copied; names the stream, table and chunk."""


class ArrayTextFallback(TidemarkError):
    """A chunk met array values their columns' lists cannot hold (`pgtypes.text.ArrayMisfit`): the table's
    copy starts again with those columns held as PostgreSQL's text (`TableSchema.with_text`).
    ``misfits``: {column: why}."""

    def __init__(self, table: str, misfits: dict[str, str]):
        self.table, self.misfits = table, misfits
        super().__init__(f"table {table}: " + "; ".join(f"column {c}: {why}" for c, why in misfits.items()))


class SnapshotValueError(SnapshotError):
    """A value cannot be held by its column's lake type (not retried: a retry reads the same value)."""


@dataclass(frozen=True)
class Chunk:
    """One page range of one relation (a table, or a leaf partition of a partitioned table)."""

    table: str                 # the stream's table, schema.name
    chunk_no: int
    rel_schema: str            # the relation actually scanned
    rel_name: str
    page_lo: int
    page_hi: int | None        # None: to the end of the relation


def plan_chunks(table: str, leaves: list[tuple[str, str, int]], chunk_pages: int) -> list[Chunk]:
    """Page ranges of ``chunk_pages`` per relation; each relation's last range is open-ended."""
    chunks: list[Chunk] = []
    for rel_schema, rel_name, pages in leaves:
        for lo in range(0, max(pages, 1), chunk_pages):
            hi = lo + chunk_pages
            chunks.append(Chunk(table, len(chunks), rel_schema, rel_name, lo, hi if hi < pages else None))
    return chunks


# -- SQL per column -----------------------------------------------------------------------------

_EPOCH_DATE = sql.SQL("DATE '1970-01-01'")


def column_expr(col: Column) -> sql.Composable:
    """The SELECT expression whose CSV text Arrow parses into the column's lake value."""
    c = sql.Identifier(col.name)
    if col.kind == "date":
        return sql.SQL("CASE WHEN {c} IS NULL THEN NULL WHEN isfinite({c}) THEN {c} - {e} "
                       "WHEN {c} > {e} THEN {pos} ELSE {neg} END").format(
            c=c, e=_EPOCH_DATE, pos=sql.Literal(DATE_POS_INF), neg=sql.Literal(DATE_NEG_INF))
    if col.kind in ("timestamp", "timestamptz"):
        # PostgreSQL's timestamps reach the year 294276, 64-bit microseconds since 1970 the year
        # 294247: a value beyond prints a sentence the CSV reader refuses as int64, naming the column
        tz = col.kind == "timestamptz"
        epoch = sql.SQL("TIMESTAMPTZ 'epoch'" if tz else "TIMESTAMP 'epoch'")
        last = sql.SQL("TIMESTAMPTZ '294247-01-10 04:00:54.775807+00'" if tz else
                       "TIMESTAMP '294247-01-10 04:00:54.775807'")     # 2**63 - 1 µs since 1970: +infinity's
        return sql.SQL("CASE WHEN {c} IS NULL THEN NULL WHEN isfinite({c}) AND {c} < {last} "
                       "THEN (extract(epoch FROM {c}) * 1000000)::int8::text "
                       "WHEN isfinite({c}) THEN 'beyond the lake''s range (64-bit microseconds since 1970): ' || {c} "
                       "WHEN {c} > {e} THEN {post} ELSE {negt} END").format(
            c=c, e=epoch, last=last, post=sql.Literal(str(TS_POS_INF)), negt=sql.Literal(str(TS_NEG_INF)))
    if col.kind == "time":
        return sql.SQL("to_char({c}, 'HH24:MI:SS.US')").format(c=c)
    return c


def csv_type(col: Column):
    """The Arrow type the CSV reader parses a column's text into."""
    import pyarrow as pa

    if col.kind == "date":
        return pa.int32()
    if col.kind in ("timestamp", "timestamptz"):
        return pa.int64()
    if col.kind in ("bytes", "array"):
        return pa.string()
    return arrow_type(col)


def row_filter_sql(where: str | None) -> sql.Composable | None:
    """A publication's row filter (``pg_get_expr``'s text, `published_filter`) as a WHERE condition:
    rows for which it is not true are not published (as pgoutput: NULL is not true)."""
    return None if where is None else sql.SQL("({}) IS TRUE").format(sql.SQL(where))


def and_where(a: sql.Composable | None, b: sql.Composable | None) -> sql.Composable | None:
    """Both conditions (either may be None: no condition)."""
    return b if a is None else a if b is None else sql.SQL("{} AND {}").format(a, b)


def chunk_query(schema: TableSchema, chunk: Chunk, where: sql.Composable | None) -> sql.Composed:
    """The COPY statement of one chunk (``where``: only the rows of the key ranges a resend copies)."""
    exprs = sql.SQL(", ").join(column_expr(c) for c in schema.columns)
    return sql.SQL("COPY (SELECT {} FROM ONLY {} WHERE {}) TO STDOUT (FORMAT csv)").format(
        exprs, sql.Identifier(chunk.rel_schema, chunk.rel_name), pages_where(chunk.page_lo, chunk.page_hi, where))


def pages_where(page_lo: int, page_hi: int | None, where: sql.Composable | None) -> sql.Composable:
    """The rows of pages ``[page_lo, page_hi)`` (None: to the end) for which ``where`` holds."""
    return and_where(sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({page_lo},0)")), and_where(
        None if page_hi is None else sql.SQL("ctid < {}::tid").format(sql.Literal(f"({page_hi},0)")), where))


# -- CSV -> Arrow --------------------------------------------------------------------------------

def _hex_to_binary(arr):
    """Decode a string array of PostgreSQL hex bytea text (``\\x0a1b``) into a binary array."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if len(arr) == 0:
        return pa.array([], pa.binary())
    ok = pc.starts_with(arr, "\\x")
    if not pc.all(pc.or_kleene(ok, pc.is_null(arr))).as_py():
        bad = next(v for v in arr.to_pylist() if v is not None and not v.startswith("\\x"))
        raise ValueError(f"bytea value is not in hex format: {bad[:20]!r}")
    body = pc.utf8_slice_codeunits(arr, 2)
    body = pa.concat_arrays([body]) if body.offset else body
    offsets = np.frombuffer(body.buffers()[1], dtype=np.int32)[: len(body) + 1]
    data = np.frombuffer(body.buffers()[2], dtype=np.uint8) if body.buffers()[2] else np.zeros(0, np.uint8)
    start, end = int(offsets[0]), int(offsets[-1])
    if np.any(np.diff(offsets) % 2):
        raise ValueError("bytea hex text has an odd number of digits")
    lut = np.full(256, 255, dtype=np.uint8)
    lut[np.frombuffer(b"0123456789abcdefABCDEF", np.uint8)] = [*range(16), *range(10, 16)]
    nib = lut[data[start:end]]
    if np.any(nib == 255):
        raise ValueError("bytea hex text has a non-hex digit")
    out = (nib[0::2] << 4) | nib[1::2]
    new_offsets = ((offsets - start) // 2).astype(np.int32)
    return pa.Array.from_buffers(pa.binary(), len(body),
                                 [body.buffers()[0], pa.py_buffer(new_offsets.tobytes()), pa.py_buffer(out.tobytes())],
                                 null_count=body.null_count)


def _to_lake(col: Column, chunked, misfits: dict):
    """Turn one parsed CSV column into its lake array (an array column's text into its lists: a value
    they cannot hold is null, and why goes to ``misfits[column]``)."""
    import pyarrow as pa

    atype = arrow_type(col)
    if col.kind in ("date", "timestamp", "timestamptz"):
        return chunked.cast(atype)
    if col.kind == "bytes":
        return pa.chunked_array([_hex_to_binary(a) for a in chunked.chunks], atype)
    if col.kind == "array":
        errs: list = []
        out = pa.chunked_array([lake_array(col, a, unstorable=errs) for a in chunked.chunks], atype)
        if errs:
            misfits[col.name] = errs[0].why
        return out
    return chunked


def csv_to_table(schema: TableSchema, data: memoryview | bytes):
    """Parse a chunk's CSV (as COPY printed it) into an Arrow table with the lake schema."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    names = [c.name for c in schema.columns]   # Arrow's conversion errors then name the column
    target = arrow_schema(schema)
    if len(data) == 0:
        return target.empty_table()
    read = pcsv.ReadOptions(column_names=names, use_threads=False,
                            block_size=min(max(len(data) + 1, 1 << 20), 2**31 - 1))
    parse = pcsv.ParseOptions(newlines_in_values=True)
    convert = pcsv.ConvertOptions(column_types={n: csv_type(c) for n, c in zip(names, schema.columns)},
                                  null_values=[""], strings_can_be_null=True, quoted_strings_can_be_null=False,
                                  true_values=["t"], false_values=["f"])
    try:
        parsed = pcsv.read_csv(pa.BufferReader(pa.py_buffer(data)), read_options=read, parse_options=parse,
                               convert_options=convert)
    except pa.ArrowInvalid as exc:
        m = re.search(r"CSV column #(\d+)", str(exc))
        col = schema.columns[int(m.group(1))] if m else None
        where = f"column {col.name} ({col.type_name}, lake type {arrow_type(col)})" if col else "a column"
        raise SnapshotValueError(f"table {schema.qualified}: {where}: {exc}") from exc
    columns = []
    misfits: dict[str, str] = {}
    for i, col in enumerate(schema.columns):
        try:
            columns.append(_to_lake(col, parsed.column(i), misfits))
        except (ValueError, pa.ArrowInvalid) as exc:
            raise SnapshotValueError(f"table {schema.qualified}: column {col.name} ({col.type_name}): {exc}") from exc
    if misfits:          # every column of the chunk at once: the table's copy is redone once for them
        raise ArrayTextFallback(schema.qualified, misfits)
    return pa.Table.from_arrays(columns, schema=target)


def table_to_parquet(table) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="snappy")
    return sink.getvalue().to_pybytes()
