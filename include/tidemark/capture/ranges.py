"""Key-range checksums: after a lost slot, a resend copies only the key ranges of a table where the lake
differs from the source. A range is the top bits of the MD5 of the key's canonical text; a range's
checksum is (rows, two 64-bit sums of the rows' MD5s). Design: docs/internals/capture.md.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from psycopg2 import sql

from tidemark.capture.chunks import and_where, column_expr, pages_where
from tidemark.capture.table_copy import Workers
from tidemark.lake import open_delta, storage_options, table_info, table_uri
from tidemark.lake.delta import missing_values
from tidemark.pgtypes import arrow_schema, arrow_type, Column, TableSchema

log = logging.getLogger(__name__)

RANGE_ROWS = 4            # rows per range aimed at: a changed row re-copies about this many
MAX_BITS = 20             # at most 2**20 ranges per table (3 x 8 MB of sums on each side)
FULL_COPY_SHARE = 0.5     # more ranges than this differ: the table is copied whole (no filter)
_U64 = 2**64
_SUPPORTED = {"int16", "int32", "int64", "float32", "float64", "bool", "numeric", "text", "bytes", "date", "time",
              "timetz", "timestamp", "timestamptz", "interval", "uuid", "json", "jsonb"}


# -- PostgreSQL side --------------------------------------------------------------------------------

def _value_text(col: Column) -> sql.Composable:
    """The SQL text of a non-null value of ``col`` that `_lake_texts` reproduces from its lake value."""
    c = sql.Identifier(col.name)
    if col.kind in ("int16", "int32", "int64"):
        return sql.SQL("{}::text").format(c)
    if col.kind in ("float32", "float64"):
        send = sql.SQL("float4send" if col.kind == "float32" else "float8send")
        return sql.SQL("CASE WHEN {c} = 'NaN' THEN 'NaN' ELSE encode({send}({c}), 'hex') END").format(c=c, send=send)
    if col.kind == "bool":
        return sql.SQL("CASE WHEN {} THEN 't' ELSE 'f' END").format(c)
    if col.kind == "bytes":
        return sql.SQL("encode({}, 'hex')").format(c)
    if col.kind in ("date", "timestamp", "timestamptz"):
        return sql.SQL("({})::text").format(column_expr(col))
    if col.kind == "time":
        return column_expr(col)
    return sql.SQL("format('%s', {})").format(c)      # the output text: what the lake's string holds


def _piece(col: Column) -> sql.Composable:
    t = _value_text(col)
    # num_nulls, not IS NULL: a composite value whose fields are all null ('(,)') IS NULL in SQL, but
    # it is a value (pgoutput and COPY send its text)
    return sql.SQL("CASE WHEN num_nulls({c}) = 1 THEN 'N' ELSE 'V' || length({t})::text || ':' || {t} END").format(
        c=sql.Identifier(col.name), t=t)


def row_text_sql(columns) -> sql.Composable:
    return sql.SQL(" || ").join(_piece(c) for c in columns)


def range_sql(shape: TableSchema, keys: list[str], bits: int) -> sql.Composable:
    """The SQL expression of a row's range (an int8 in ``[0, 2**bits)``)."""
    by_name = {c.name: c for c in shape.columns}
    return sql.SQL("(('x' || substr(md5({}), 1, 8))::bit(32)::int8 >> {})").format(
        row_text_sql([by_name[k] for k in keys]), sql.Literal(32 - bits))


def checksum_query(shape: TableSchema, keys: list[str], bits: int, chunk, where: sql.Composable | None) -> sql.Composed:
    """Per range of one page chunk: (range, rows, sum of the MD5s' first 64 bits, of the next 64);
    ``where``: the publication's row filter (the rows the copy would take)."""
    return sql.SQL("""SELECT r, count(*), sum(('x' || substr(d, 1, 16))::bit(64)::int8)::text,
                             sum(('x' || substr(d, 17, 16))::bit(64)::int8)::text
                        FROM (SELECT {rng} AS r, md5({row}) AS d FROM ONLY {rel} WHERE {cond}) s
                       GROUP BY r""").format(
        rng=range_sql(shape, keys, bits), row=row_text_sql(shape.columns),
        rel=sql.Identifier(chunk.rel_schema, chunk.rel_name), cond=pages_where(chunk.page_lo, chunk.page_hi, where))


def copy_filter(shape: TableSchema, keys: list[str], bits: int, ranges) -> sql.Composable:
    """The WHERE condition that keeps the rows of ``ranges`` only."""
    return sql.SQL("{} = ANY({}::int8[])").format(range_sql(shape, keys, bits),
                                                sql.Literal([int(r) for r in ranges]))


# -- lake side ----------------------------------------------------------------------------------------

def _lake_texts(col: Column, arr) -> list:
    """The canonical value texts (None for null) of one lake column, as `_value_text` prints them."""
    import pyarrow as pa

    k = col.kind
    if k in ("date", "timestamp", "timestamptz"):
        arr = arr.cast(pa.int32() if k == "date" else pa.int64())
    values = arr.to_pylist()
    if k in ("int16", "int32", "int64", "date", "timestamp", "timestamptz"):
        return [None if v is None else str(v) for v in values]
    if k in ("float32", "float64"):
        fmt = ">f" if k == "float32" else ">d"
        return [None if v is None else "NaN" if v != v else struct.pack(fmt, v).hex() for v in values]
    if k == "bool":
        return [None if v is None else ("t" if v else "f") for v in values]
    if k == "bytes":
        return [None if v is None else v.hex() for v in values]
    if k == "numeric" and pa.types.is_decimal(arr.type):
        return [None if v is None else format(v, "f") for v in values]
    return values      # strings: the output text itself


def _pieces(columns, table) -> dict[str, list[str]]:
    """Each column's canonical pieces (``N``, or ``V<length>:<text>``), one per row."""
    return {c.name: [("N" if v is None else f"V{len(v)}:{v}") for v in _lake_texts(c, table.column(c.name))]
            for c in columns}


def _joined(pieces: dict[str, list[str]], names) -> list[str]:
    """Each row's canonical text over the columns ``names``."""
    return ["".join(parts) for parts in zip(*(pieces[n] for n in names))] if names else []


def _texts(columns, table) -> list[str]:
    """Each row's canonical text."""
    return _joined(_pieces(columns, table), [c.name for c in columns])


def _ranges_of(key_text: list[str], bits: int):
    """The range of each key text: the top ``bits`` bits of its MD5."""
    import numpy as np

    kd = b"".join(hashlib.md5(t.encode()).digest()[:4] for t in key_text)
    return (np.frombuffer(kd, dtype=">u4").astype(np.int64) >> (32 - bits)) if key_text else np.zeros(0, np.int64)


def lake_ranges(shape: TableSchema, keys: list[str], table, bits: int):
    """(ranges, md5 digests as (n, 2) uint64) of a lake table's rows (an Arrow table, lake schema);
    each value's text is made once, for the row's text and the key's."""
    import numpy as np

    pieces = _pieces(shape.columns, table)
    row_text = _joined(pieces, [c.name for c in shape.columns])
    n = len(row_text)
    rd = b"".join(hashlib.md5(t.encode()).digest() for t in row_text)
    sums = np.frombuffer(rd, dtype=">u8").astype(np.uint64).reshape(n, 2) if n else np.zeros((0, 2), np.uint64)
    return _ranges_of(_joined(pieces, keys), bits), sums


@dataclass
class Sums:
    """Per range: row count and the two 64-bit sums (wrapping)."""

    count: Any
    h1: Any
    h2: Any

    @classmethod
    def zeros(cls, bits: int) -> "Sums":
        import numpy as np

        n = 1 << bits
        return cls(np.zeros(n, np.int64), np.zeros(n, np.uint64), np.zeros(n, np.uint64))

    def add_rows(self, rng, digests) -> None:
        import numpy as np

        np.add.at(self.count, rng, 1)
        np.add.at(self.h1, rng, digests[:, 0])
        np.add.at(self.h2, rng, digests[:, 1])

    def fold(self, bits: int) -> "Sums":
        """The same sums over ``2**bits`` ranges (a range of ``bits`` bits is a prefix of finer ones)."""
        n = 1 << bits
        return Sums(self.count.reshape(n, -1).sum(axis=1), self.h1.reshape(n, -1).sum(axis=1),
                    self.h2.reshape(n, -1).sum(axis=1))

    def differing(self, other: "Sums"):
        return (self.count != other.count) | (self.h1 != other.h1) | (self.h2 != other.h2)


def lake_sums(uri: str, options, shape: TableSchema, keys: list[str], fill: dict, bits: int) -> Sums:
    """The lake table's checksums per range, one file at a time (memory: one file and the sums)."""
    # deferred: lake.layout imports pyarrow and numpy at its top; importing capture or gaps does not load them
    from tidemark.lake.layout import BucketPlan, file_index, read_files

    target = arrow_schema(shape)
    plan = BucketPlan(uri=uri, options=options, schema=target, keys=keys, sort=[], fill=fill)
    out = Sums.zeros(bits)
    dt = open_delta(uri, options)
    for files in file_index(dt, []).values():
        for f in files:
            rows = read_files(plan, [f["path"]])
            if rows.num_rows:
                out.add_rows(*lake_ranges(shape, keys, rows, bits))
    return out


def kept_rows(plan, shape_json: dict, keys: list[str], bits: int, copied: str, batches):
    """``mapInArrow`` body: lake files in (`layout.FILES_DDL`), their rows whose range was NOT copied
    out (the lake schema ``plan.schema``): what the load keeps of the lake."""
    import pyarrow as pa

    # deferred: lake.layout imports pyarrow and numpy at its top; importing capture or gaps does not load them
    from tidemark.lake.layout import read_files

    shape = TableSchema.from_json(shape_json)
    mask = unpack_ranges(copied, bits)
    for batch in batches:
        for f in batch.to_pylist():
            rows = read_files(plan, [f["path"]])
            if rows.num_rows:
                yield from rows.filter(pa.array(~mask[key_ranges(shape, keys, rows, bits)])).to_batches()


def key_ranges(shape: TableSchema, keys: list[str], table, bits: int):
    """The range of each row of ``table`` (lake schema)."""
    by_name = {c.name: c for c in shape.columns}
    return _ranges_of(_texts([by_name[k] for k in keys], table), bits)


def pack_ranges(mask) -> str:
    import numpy as np

    return base64.b64encode(zlib.compress(np.packbits(mask).tobytes(), 9)).decode()


def unpack_ranges(packed: str | bytes, bits: int):
    import numpy as np

    raw = zlib.decompress(base64.b64decode(packed))
    return np.unpackbits(np.frombuffer(raw, np.uint8))[: 1 << bits].astype(bool)


# -- the comparison --------------------------------------------------------------------------------

def why_full(shape: TableSchema, keys: list[str], lake_shape: TableSchema | None) -> str | None:
    """Why ``shape`` is copied whole instead of by ranges, or None."""
    if not keys:
        return "no key (REPLICA IDENTITY FULL or no primary key): every row is its own identity"
    if lake_shape is None:
        return "the lake does not hold it yet"
    bad = [c.name for c in shape.columns if c.kind not in _SUPPORTED]
    if bad:
        return f"column(s) {', '.join(bad)} have no canonical text for a checksum"
    mine = {c.name: str(arrow_type(c)) for c in shape.columns}
    theirs = {c.name: str(arrow_type(c)) for c in lake_shape.columns}
    if mine != theirs:
        return "its shape differs from the lake table's"
    # deferred: lake.layout imports pyarrow and numpy at its top; importing capture or gaps does not load them
    from tidemark.lake.layout import effective_keys

    if effective_keys(lake_shape) != keys:
        return "its key differs from the lake table's"
    return None


def choose_bits(rows: int) -> int:
    """Range bits for a table of about ``rows`` rows: about `RANGE_ROWS` rows a range."""
    bits = 0
    while bits < MAX_BITS and (rows >> bits) > RANGE_ROWS:
        bits += 1
    return bits


def source_sums(connection, shape: TableSchema, keys: list[str], bits: int, chunks, parallelism: int,
                where: sql.Composable | None = None) -> Sums:
    """PostgreSQL's checksums per range, one query per page chunk (``connection()``: a worker's
    connection on the exported snapshot), added up; ``where``: the publication's row filter."""
    out = Sums.zeros(bits)
    lock = threading.Lock()

    def one(chunk) -> None:
        import numpy as np

        with connection().cursor() as cur:
            cur.execute(checksum_query(shape, keys, bits, chunk, where))
            got = cur.fetchall()
        if not got:
            return
        rng = np.array([int(r[0]) for r in got], np.int64)
        with lock:
            out.count[rng] += np.array([int(r[1]) for r in got], np.int64)
            out.h1[rng] += np.array([int(r[2]) % _U64 for r in got], np.uint64)
            out.h2[rng] += np.array([int(r[3]) % _U64 for r in got], np.uint64)

    with ThreadPoolExecutor(max_workers=max(1, parallelism), thread_name_prefix="tidemark-checksum") as pool:
        list(pool.map(one, chunks))
    return out


def _estimated_rows(conn, chunks) -> int:
    rels = sorted({(c.rel_schema, c.rel_name) for c in chunks})
    if not rels:
        return 0
    with conn.cursor() as cur:
        cur.execute("""SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::int8 FROM pg_class c
                         JOIN pg_namespace n ON n.oid = c.relnamespace
                        WHERE (n.nspname, c.relname) IN %s""", (tuple(rels),))
        return int(cur.fetchone()[0])


def compare(cfg, snapshot_name: str, plans, parallelism: int) -> None:
    """Compare each planned table (`table_copy.TablePlan`) of a resend with the lake, range by range,
    under the exported snapshot; a table whose ranges can be compared copies only those that differ
    (``plan.where``; no chunk at all when none differs). ``plan.ranges`` records what was found (the
    manifest's table entry carries it to the load): ``full`` (the reason) for a table copied whole,
    else the range bits, ranges, ranges differing, the packed set of ranges copied, the lake's Delta
    version compared (the load refuses another) and its rows, the source's rows."""
    import numpy as np

    # deferred: lake.layout imports pyarrow and numpy at its top; importing capture or gaps does not load them
    from tidemark.lake.layout import effective_keys

    with contextlib.closing(Workers(cfg, snapshot_name)) as workers:
        with workers.connection().cursor() as cur:
            cur.execute("SHOW server_encoding")
            utf8 = cur.fetchone()[0].upper() in ("UTF8", "UTF-8")
        options = storage_options(cfg)
        for plan in plans:
            started = time.monotonic()
            table = plan.ref.qualified
            keys = effective_keys(plan.schema)
            uri = table_uri(cfg, table)
            dt = open_delta(uri, options) if keys else None
            info = table_info(dt) if dt is not None else {}
            lake_shape = TableSchema.from_json(info["table_schema"]) if info.get("table_schema") else None
            why = why_full(plan.schema, keys, lake_shape) or (None if utf8 else "the source's encoding is not UTF8")
            if why is not None:
                plan.ranges = {"full": why}
                log.info("stream %s: resend of %s: copied whole: %s", cfg.stream, table, why)
                continue
            fine = lake_sums(uri, options, plan.schema, keys, missing_values(info), MAX_BITS)
            lake_s = time.monotonic() - started
            lake_rows = int(fine.count.sum())
            bits = choose_bits(max(lake_rows, _estimated_rows(workers.connection(), plan.chunks)))
            lake = fine.fold(bits)
            src = source_sums(workers.connection, plan.schema, keys, bits, plan.chunks, parallelism, plan.where)
            source_s = time.monotonic() - started - lake_s
            diff = src.differing(lake)
            n = int(diff.sum())
            found = {"bits": bits, "ranges": 1 << bits, "ranges_differing": n, "lake_version": int(dt.version()),
                     "lake_rows": lake_rows, "source_rows": int(src.count.sum()),
                     "lake_s": round(lake_s, 3), "source_s": round(source_s, 3),
                     "compare_s": round(time.monotonic() - started, 3)}
            if n > FULL_COPY_SHARE * (1 << bits):
                plan.ranges = {"full": f"{n} of {1 << bits} key ranges differ", **found}
            else:
                plan.ranges = {**found, "copied": pack_ranges(diff), "rows_expected": int(src.count[diff].sum())}
                if n == 0:
                    plan.chunks = []
                else:
                    plan.where = and_where(plan.where, copy_filter(plan.schema, keys, bits, np.flatnonzero(diff)))
            log.info("stream %s: resend of %s: %d of %d key ranges differ from the lake (%d source rows, %d lake "
                     "rows; compared in %.1f s)", cfg.stream, table, n, 1 << bits, found["source_rows"], lake_rows,
                     found["compare_s"])


def summary(entry: dict) -> dict:
    """What a snapshot's table entry says about its copy: rows copied, rows in the table, key ranges
    compared and copied (None: not a resend), or why the table was copied whole."""
    rows = entry.get("rows", 0)
    r = entry.get("ranges") or {}
    out = {"rows_copied": rows, "rows": r.get("source_rows", rows) if "copied" in r else rows}
    if "ranges" in r:
        out.update(ranges=r["ranges"], ranges_copied=r["ranges_differing"] if "copied" in r else r["ranges"])
    if "full" in r:
        out["full_copy"] = r["full"]
    return out


def describe_copy(copy: dict | None, rows: int) -> str:
    """How a snapshot copied one table: its rows, or (a resend by key ranges) the rows re-copied of
    the rows in the table and the key ranges that differed."""
    if not copy or ("ranges" not in copy and "full_copy" not in copy):
        return f"{rows:,} rows"
    if "full_copy" in copy:
        return f"{rows:,} rows (copied whole: {copy['full_copy']})"
    return (f"{copy['rows_copied']:,} rows re-copied of {copy['rows']:,} ({copy['ranges_copied']:,} of "
            f"{copy['ranges']:,} key ranges differed from the lake)")
