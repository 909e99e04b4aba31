"""Snapshot-copy: create the stream's slot with an exported snapshot and copy tables under it.

``CREATE_REPLICATION_SLOT ... LOGICAL pgoutput EXPORT_SNAPSHOT`` on a replication connection gives
the slot's *consistent point* and the name of a snapshot that sees exactly the transactions
committed before it. That connection is held, idle, until every chunk is copied; worker connections
``SET TRANSACTION SNAPSHOT`` to it and copy the tables in ctid (page) ranges, in parallel. Changes
with ``time >= lsn`` then come from the slot, so nothing is missed or doubled.

Each chunk is ``COPY (SELECT <expr per column> FROM ONLY t WHERE ctid >= '(lo,0)' AND ctid <
'(hi,0)') TO STDOUT (FORMAT csv)``; the expressions make PostgreSQL print what Arrow parses directly
(dates as day numbers, timestamps as microseconds, ``time`` as ``HH:MM:SS.ffffff``), the CSV is parsed
by ``pyarrow.csv`` and written as Parquet with the lake types (`tidemark.pgtypes.arrow_schema`), so
the values equal what the drain's canonical values become in the lake (`pgtypes.lake_array`).

Layout in the landing store::

    {stream}/snapshots/{snapshot_id}/{schema}.{table}/chunk-{n:06d}.parquet
    {stream}/snapshots/{snapshot_id}/manifest.json

The manifest (and the ``tidemark.snapshots`` row) gives each table's row count, files and shape. A
chunk that fails is retried alone (up to `MAX_ATTEMPTS`), on a fresh connection that imports the
same snapshot.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import secrets
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from psycopg2 import sql

from tidemark.config import NO_FILTER, StreamConfig, TableRef
from tidemark.control import Control, open_control
from tidemark.errors import TidemarkError
from tidemark.pgtypes import (DATE_NEG_INF, DATE_POS_INF, TS_NEG_INF, TS_POS_INF, Column, TableSchema,
                              TypeResolver, arrow_schema, arrow_type, column_attnums, lake_array, table_schema_for_oid)
from tidemark.pgtypes.catalog import published_filter
from tidemark.lsn import format_lsn, parse_lsn
from tidemark.capture.source import apply_stream, connect_replication, connect_source, drop_slot, slot_info
from tidemark.landing.store import Store, landing_store, put_if_absent, stream_keys

log = logging.getLogger(__name__)

MODES = ("initial", "resend", "add", "table")
MAX_ATTEMPTS = 3


class SnapshotError(TidemarkError):
    """A snapshot could not be taken or copied; names the stream, table and chunk."""


class ArrayTextFallback(TidemarkError):
    """A chunk met array values their columns' lists cannot hold (`pgtypes.ArrayMisfit`): the table's
    copy starts again with those columns held as PostgreSQL's text (`TableSchema.with_text`).
    ``misfits``: {column: why}."""

    def __init__(self, table: str, misfits: dict[str, str]):
        self.table, self.misfits = table, misfits
        super().__init__(f"table {table}: " + "; ".join(f"column {c}: {why}" for c, why in misfits.items()))


class SnapshotValueError(SnapshotError):
    """A value cannot be held by its column's lake type (not retried: a retry reads the same value)."""


@dataclass(frozen=True)
class SnapshotResult:
    snapshot_id: str
    lsn: int
    tables: dict[str, int]            # schema.table -> rows copied
    manifest_uri: str = ""           # the manifest lists each table's files and shape
    waiting: list[str] = field(default_factory=list)   # stream tables not copied: they wait for `--mode add`
    copies: dict[str, dict] = field(default_factory=dict)  # schema.table -> `ranges.summary`: rows copied of
                                                            # rows, key ranges compared/copied (a resend)


@dataclass(frozen=True)
class Chunk:
    """One page range of one relation (a table, or a leaf partition of a partitioned table)."""

    table: str                 # the stream's table, schema.name
    chunk_no: int
    rel_schema: str            # the relation actually scanned
    rel_name: str
    page_lo: int
    page_hi: int | None        # None: to the end of the relation


@dataclass
class _TablePlan:
    ref: TableRef
    schema: TableSchema
    chunks: list[Chunk]
    rows: int = 0
    done: int = 0
    files: dict[int, str] = field(default_factory=dict)
    where: Any = None          # the publication's row filter, AND (a resend by key ranges) the ranges copied
    published: dict = field(default_factory=dict)  # the stream file's column list and row filter it was copied with
    ranges: dict | None = None     # what the range comparison found (in the manifest's table entry)
    attnums: dict = field(default_factory=dict)    # {column: attnum} under the snapshot (`column_attnums`)
    gen: int = 0                   # times an array column went to its text form (`ArrayTextFallback`): chunks redone


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


def chunk_query(schema: TableSchema, chunk: Chunk, where: sql.Composable | None = None) -> sql.Composed:
    """The COPY statement of one chunk (``where``: only the rows of the key ranges a resend copies)."""
    exprs = sql.SQL(", ").join(column_expr(c) for c in schema.columns)
    cond = sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({chunk.page_lo},0)"))
    if chunk.page_hi is not None:
        cond = sql.SQL("{} AND ctid < {}::tid").format(cond, sql.Literal(f"({chunk.page_hi},0)"))
    if where is not None:
        cond = sql.SQL("{} AND {}").format(cond, where)
    return sql.SQL("COPY (SELECT {} FROM ONLY {} WHERE {}) TO STDOUT (FORMAT csv)").format(
        exprs, sql.Identifier(chunk.rel_schema, chunk.rel_name), cond)


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
    lut[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10, dtype=np.uint8)
    lut[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16, dtype=np.uint8)
    lut[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16, dtype=np.uint8)
    nib = lut[data[start:end]]
    if np.any(nib == 255):
        raise ValueError("bytea hex text has a non-hex digit")
    out = (nib[0::2] << 4) | nib[1::2]
    new_offsets = ((offsets - start) // 2).astype(np.int32)
    return pa.Array.from_buffers(pa.binary(), len(body),
                                 [body.buffers()[0], pa.py_buffer(new_offsets.tobytes()), pa.py_buffer(out.tobytes())],
                                 null_count=body.null_count)


def _to_lake(col: Column, chunked, misfits: dict | None = None):
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
        if errs and misfits is not None:
            misfits[col.name] = errs[0].why
        elif errs:
            raise errs[0]
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


# -- the copy ------------------------------------------------------------------------------------

class _Workers:
    """Per-thread source connections, each in a REPEATABLE READ transaction on the exported snapshot."""

    def __init__(self, cfg: StreamConfig, snapshot_name: str):
        self.cfg = cfg
        self.snapshot_name = snapshot_name
        self.local = threading.local()
        self.lock = threading.Lock()
        self.all: list[Any] = []

    def connection(self):
        conn = getattr(self.local, "conn", None)
        if conn is None or conn.closed:
            conn = open_snapshot_connection(self.cfg, self.snapshot_name)
            self.local.conn = conn
            with self.lock:
                self.all.append(conn)
        return conn

    def discard(self) -> None:
        """Close this thread's connection (after a failure); the next chunk opens a fresh one."""
        conn = getattr(self.local, "conn", None)
        self.local.conn = None
        if conn is not None and not conn.closed:
            conn.close()

    def close(self) -> None:
        with self.lock:
            for conn in self.all:
                if not conn.closed:
                    conn.close()
            self.all.clear()


def open_snapshot_connection(cfg: StreamConfig, snapshot_name: str):
    """A source connection in a read-only REPEATABLE READ transaction that sees ``snapshot_name``."""
    conn = connect_source(cfg, autocommit=True, application_name=f"tidemark-snapshot:{cfg.stream}")
    conn.set_client_encoding("UTF8")
    with conn.cursor() as cur:
        cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
    return conn


def _copy_chunk(workers: _Workers, store: Store, key: str, schema: TableSchema, chunk: Chunk,
                attempt: int, hook: Callable[[Chunk, int], None] | None, where=None) -> tuple[int, str]:
    """Copy one chunk into a Parquet file; return (rows, uri)."""
    try:
        conn = workers.connection()
        if hook is not None:
            hook(chunk, attempt)
        buf = io.BytesIO()
        with conn.cursor() as cur:
            cur.copy_expert(chunk_query(schema, chunk, where), buf)
        table = csv_to_table(schema, buf.getbuffer())
        uri = store.put(key, table_to_parquet(table))
        return table.num_rows, uri
    except BaseException:
        workers.discard()
        raise


def _chunk_key(stream: str, snapshot_id: str, table: str, chunk_no: int, gen: int = 0) -> str:
    again = f"-{gen}" if gen else ""      # a copy redone with a column as text (`ArrayTextFallback`)
    return f"{stream_keys(stream)['snapshots']}{snapshot_id}/{table}/chunk-{chunk_no:06d}{again}.parquet"


def manifest_key(stream: str, snapshot_id: str) -> str:
    return f"{stream_keys(stream)['snapshots']}{snapshot_id}/manifest.json"


# -- planning ------------------------------------------------------------------------------------

def _relation(conn, ref: TableRef) -> tuple[int, str]:
    with conn.cursor() as cur:
        cur.execute("""SELECT c.oid, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                        WHERE n.nspname = %s AND c.relname = %s""", (ref.schema, ref.name))
        row = cur.fetchone()
    if row is None:
        raise SnapshotError(f"table {ref} does not exist in the source database")
    return row


def _leaves(conn, oid: int, relkind: str) -> list[tuple[str, str, int]]:
    """The relations that hold the table's rows: itself, or the leaf partitions of a partitioned table,
    as (schema, name, pages)."""
    with conn.cursor() as cur:
        if relkind == "p":
            cur.execute("""SELECT n.nspname, c.relname,
                                  pg_relation_size(c.oid) / current_setting('block_size')::int
                             FROM pg_partition_tree(%s) t JOIN pg_class c ON c.oid = t.relid
                             JOIN pg_namespace n ON n.oid = c.relnamespace
                            WHERE t.isleaf ORDER BY n.nspname, c.relname""", (oid,))
        else:
            cur.execute("""SELECT n.nspname, c.relname,
                                  pg_relation_size(c.oid) / current_setting('block_size')::int
                             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                            WHERE c.oid = %s""", (oid,))
        return [(s, n, int(p)) for s, n, p in cur.fetchall()]


def plan_chunks(table: str, leaves: list[tuple[str, str, int]], chunk_pages: int) -> list[Chunk]:
    """Page ranges of ``chunk_pages`` per relation; each relation's last range is open-ended."""
    chunks: list[Chunk] = []
    for rel_schema, rel_name, pages in leaves:
        lo = 0
        while True:
            hi = lo + chunk_pages
            if hi >= pages:
                chunks.append(Chunk(table, len(chunks), rel_schema, rel_name, lo, None))
                break
            chunks.append(Chunk(table, len(chunks), rel_schema, rel_name, lo, hi))
            lo = hi
    return chunks


def _plan(cfg: StreamConfig, snapshot_name: str, refs: list[TableRef], chunk_pages: int) -> list[_TablePlan]:
    conn = open_snapshot_connection(cfg, snapshot_name)
    try:
        resolver = TypeResolver(conn)
        plans = []
        for ref in refs:
            oid, relkind = _relation(conn, ref)
            # the publication as of the exported snapshot: the columns and rows pgoutput sends from it on
            columns, where = published_filter(conn, cfg.source.publication, oid)
            schema = table_schema_for_oid(conn, oid, resolver, columns)
            if not schema.columns:
                raise SnapshotError(f"table {ref} has no columns to copy")
            plans.append(_TablePlan(ref, schema, plan_chunks(ref.qualified, _leaves(conn, oid, relkind), chunk_pages),
                                    where=row_filter_sql(where),
                                    published=cfg.source.filter_of(ref).as_dict(),
                                    attnums={n: a for n, a in column_attnums(conn, oid).items()
                                             if columns is None or n in columns}))
        return plans
    finally:
        conn.close()


def refiltered_tables(cfg: StreamConfig, ctl: Control) -> dict[str, str]:
    """{table: why} of the stream's captured tables whose column list or row filter in the stream file
    differs from the one their lake copy was taken with (the latest snapshot that copied them): the
    lake holds other columns or rows than the publication now sends, so that table is re-snapshotted
    alone while the stream runs (`stream apply` does it right away, the gap sensor's resend step
    finds any left)."""
    states = ctl.table_states(cfg.stream)
    entries = ctl.last_table_snapshots(cfg.stream)
    out = {}
    for ref in cfg.source.tables:
        entry = entries.get(ref.qualified)
        if entry is None or states.get(ref.qualified, ("capturing",))[0] in ("awaiting_snapshot", "frozen"):
            continue
        was = entry.get("published") or NO_FILTER.as_dict()
        now = cfg.source.filter_of(ref).as_dict()
        if was != now:
            changed = [f"{k} {was.get(k)!r} -> {now[k]!r}" for k in ("columns", "where") if was.get(k) != now[k]]
            out[ref.qualified] = f"its column list or row filter changed ({'; '.join(changed)})"
    return out


def resnapshot_refiltered(cfg: StreamConfig, **kwargs) -> SnapshotResult | None:
    """Re-snapshot (mode ``table``, online) the tables whose column list or row filter changed since
    their copy (`refiltered_tables`); None when none did or the stream is not capturing yet."""
    with open_control(cfg) as ctl:
        if ctl.stream(cfg.stream).consistent_lsn is None:
            return None
        tables = sorted(refiltered_tables(cfg, ctl))
    if not tables:
        return None
    return snapshot_stream(cfg, tables=tables, mode="table", **kwargs)


def _select_tables(cfg: StreamConfig, tables: Iterable[str | TableRef] | None) -> list[TableRef]:
    if tables is None:
        return list(cfg.source.tables)
    out = []
    for t in tables:
        ref = t if isinstance(t, TableRef) else TableRef.parse(t)
        if ref not in cfg.source.tables:
            raise SnapshotError(f"stream {cfg.stream}: table {ref} is not one of the stream's tables "
                                f"({', '.join(str(r) for r in cfg.source.tables)})")
        if ref not in out:
            out.append(ref)
    return out


# -- the public face -----------------------------------------------------------------------------

def snapshot_stream(cfg: StreamConfig, *, tables: Iterable[str | TableRef] | None = None, mode: str = "initial",
                    chunk_pages: int | None = None, parallelism: int | None = None,
                    progress: Callable[[dict], None] | None = None,
                    chunk_hook: Callable[[Chunk, int], None] | None = None) -> SnapshotResult:
    """Create the stream's slot at a new consistent point and copy ``tables`` as of that point.

    ``tables=None`` copies every table of the stream; ``tables=[]`` only creates the slot and records
    the consistent point. ``mode="initial"`` refuses a stream that already has a consistent point and
    a slot; ``mode="resend"`` drops the slot and starts over at a new consistent point (the frontier is
    left alone) and must copy every table of the stream (a subset is refused: the other tables would
    silently miss their changes between the last landed segment and the new point). ``chunk_hook(chunk, attempt)`` runs in the worker before each chunk is copied (tests
    use it to slow a copy or make one fail). Raises `StreamBusy` if another snapshot runs.
    """
    if mode not in MODES:
        raise SnapshotError(f"unknown snapshot mode {mode!r} (use one of {', '.join(MODES)})")
    refs = _select_tables(cfg, tables)
    if mode == "add" or (mode == "initial" and tables is not None and _awaiting(cfg, refs)):
        return add_tables(cfg, refs, chunk_pages=chunk_pages, parallelism=parallelism, progress=progress,
                          chunk_hook=chunk_hook)
    if mode == "table" or (mode == "resend" and set(refs) != set(cfg.source.tables) and slot_info(cfg) is not None):
        # one table again while the stream's slot is intact: online, the others go on
        return add_tables(cfg, refs, mode="table", chunk_pages=chunk_pages, parallelism=parallelism,
                          progress=progress, chunk_hook=chunk_hook)
    if mode == "resend" and set(refs) != set(cfg.source.tables):
        # The slot is recreated at a new consistent point: whatever the other tables changed since the
        # last landed segment would never be captured. Refuse rather than lose it silently.
        missing = sorted(t.qualified for t in set(cfg.source.tables) - set(refs))
        raise SnapshotError(f"stream {cfg.stream}: a resend recreates the slot at a new consistent point, so "
                            f"every table of the stream must be re-snapshotted; {', '.join(missing)} would "
                            "lose the changes made since the last landed segment. Run the resend with all "
                            "tables (tables=None)")
    chunk_pages = chunk_pages or cfg.snapshot.chunk_pages
    parallelism = parallelism or cfg.snapshot.parallelism
    if chunk_pages < 1 or parallelism < 1:
        raise SnapshotError("chunk_pages and parallelism must be >= 1")
    apply_stream(cfg)
    with open_control(cfg) as ctl:
        with contextlib.ExitStack() as locks:
            leases = [locks.enter_context(ctl.stream_lock(cfg.stream, "snapshot"))]
            if mode == "resend":   # the slot is replaced: no drain may hold it meanwhile
                leases.append(locks.enter_context(ctl.stream_lock(cfg.stream, "drain")))
            _prepare_slot(cfg, ctl, mode)
            return _run(cfg, ctl, refs, mode, chunk_pages, parallelism, progress, chunk_hook, leases)


def add_tables(cfg: StreamConfig, refs: list[TableRef], *, mode: str = "add", chunk_pages: int | None = None,
               parallelism: int | None = None, progress: Callable[[dict], None] | None = None,
               chunk_hook: Callable[[Chunk, int], None] | None = None) -> SnapshotResult:
    """Snapshot tables added to a running stream, each at ONE new consistent point ``L`` of its own,
    while the stream's slot, drains and consolidations go on: a TEMPORARY logical slot created with
    ``EXPORT_SNAPSHOT`` gives ``L`` and the snapshot the tables are copied under (the slot goes with
    its connection once the copy is done). The stream's positions do not move: the tables are
    ``capturing`` from ``L`` (`Control.snapshot_tables_complete`), the consolidation loads the
    snapshot once its frontier reaches ``L`` and takes the tables' changes from ``L`` on; until then
    their changes wait in the segments and every other table goes on. Refuses a table that is
    captured already (its lake would be replaced: a re-snapshot) and a stream without a running slot
    (the initial snapshot comes first).

    ``mode="table"``: re-snapshot tables the stream captures, online, the same way: the consolidation
    that reaches ``L`` merges the table's changes below ``L``, then at ``L`` takes every row out and
    the snapshot's rows in, in the same merge, so the lake holds the snapshot there and the changelog
    records only the difference (correction deltas: a subscriber that summed the diffs still holds
    the lake). The table waits from the snapshot until the frontier reaches ``L``; the others go on."""
    chunk_pages = chunk_pages or cfg.snapshot.chunk_pages
    parallelism = parallelism or cfg.snapshot.parallelism
    if not refs:
        raise SnapshotError(f"stream {cfg.stream}: snapshot mode '{mode}' needs its tables (--tables)")
    if chunk_pages < 1 or parallelism < 1:
        raise SnapshotError("chunk_pages and parallelism must be >= 1")
    apply_stream(cfg)       # the tables are in the publication before L: their changes from L on are captured
    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, "snapshot-add") as lease:
        state = ctl.stream(cfg.stream)
        if state.consistent_lsn is None or slot_info(cfg) is None:
            raise SnapshotError(f"stream {cfg.stream} is not capturing yet (no consistent point or no slot "
                                f"{cfg.source.slot}): take its initial snapshot first (tidemark snapshot "
                                f"{cfg.stream}), or a resend when the slot is lost")
        states = ctl.table_states(cfg.stream)
        captured = [r.qualified for r in refs if states.get(r.qualified, ("capturing",))[0] != "awaiting_snapshot"]
        if mode == "table" and not captured:
            mode = "add"        # every one of them waits for its first snapshot: that is an add
        elif mode == "table" and len(captured) < len(refs):
            waiting = sorted({r.qualified for r in refs} - set(captured))
            raise SnapshotError(f"stream {cfg.stream}: {', '.join(waiting)} wait(s) for a first snapshot: take it "
                                f"first (tidemark snapshot {cfg.stream} --mode add --tables {','.join(waiting)}), "
                                "then re-snapshot the others")
        if captured and mode == "add":
            raise SnapshotError(f"stream {cfg.stream}: {', '.join(captured)} is captured already (mode 'add' is for "
                                "tables added to the stream file and applied since its snapshot); to copy it "
                                f"again run a resend (tidemark snapshot {cfg.stream} --mode resend)")
        store = landing_store(cfg)
        _clear_dead(cfg, ctl, store)
        repl = connect_replication(cfg, application_name=f"tidemark-snapshot-add:{cfg.stream}")
        try:
            with repl.cursor() as cur:
                cur.execute(sql.SQL("CREATE_REPLICATION_SLOT {} TEMPORARY LOGICAL pgoutput EXPORT_SNAPSHOT")
                            .format(sql.Identifier(f"tm_add_{secrets.token_hex(6)}")))
                _, point, snapshot_name, _ = cur.fetchone()
            lsn = parse_lsn(point)
            snapshot_id = f"{lsn:016X}-{secrets.token_hex(3)}"
            ctl.snapshot_started(cfg.stream, snapshot_id, lsn, mode)
        except BaseException:
            repl.close()
            raise
        try:
            plans = _plan(cfg, snapshot_name, refs, chunk_pages)
            ctl.snapshot_chunks_planned(cfg.stream, snapshot_id, [(c.table, c.chunk_no, c.page_lo, c.page_hi)
                                                                 for p in plans for c in p.chunks])
            _copy_all(cfg, ctl, store, snapshot_id, snapshot_name, plans, parallelism, progress, chunk_hook)
            repl.close()      # every chunk is copied: the temporary slot and its exported snapshot go
            tables = {p.ref.qualified: {"rows": p.rows, "files": [k for _, k in sorted(p.files.items())],
                                        "table_schema": p.schema.to_json(), "attnums": p.attnums,
                                        "published": p.published} for p in plans}
            manifest = {"snapshot_id": snapshot_id, "stream": cfg.stream, "lsn": lsn, "mode": mode, "tables": tables}
            uri, _ = put_if_absent(store, manifest_key(cfg.stream, snapshot_id),
                                   json.dumps(manifest, indent=1, sort_keys=True).encode())
            lease.confirm(f"complete snapshot {snapshot_id}")
            ctl.snapshot_tables_complete(cfg.stream, snapshot_id, lsn, tables)
        except BaseException as exc:
            repl.close()
            reason = str(exc)
            for step in (lambda: ctl.snapshot_failed(cfg.stream, snapshot_id, reason),
                         lambda: _discard_files(store, cfg.stream, snapshot_id)):
                with contextlib.suppress(Exception):
                    step()
            raise
    return SnapshotResult(snapshot_id=snapshot_id, lsn=lsn, tables={t: d["rows"] for t, d in tables.items()},
                          manifest_uri=uri)


def _awaiting(cfg: StreamConfig, refs: list[TableRef]) -> bool:
    """Whether every one of ``refs`` was added to the running stream and waits for its snapshot."""
    with open_control(cfg) as ctl:
        try:
            states = ctl.table_states(cfg.stream)
        except Exception:  # noqa: BLE001 - not registered yet: an initial snapshot
            return False
    return bool(refs) and all(states.get(r.qualified, ("",))[0] == "awaiting_snapshot" for r in refs)


def _prepare_slot(cfg: StreamConfig, ctl: Control, mode: str) -> None:
    """Check the stream's state for ``mode`` and drop a slot that must be recreated."""
    state = ctl.stream(cfg.stream)
    info = slot_info(cfg)
    if mode == "initial" and state.consistent_lsn is not None:
        where = f"{format_lsn(state.consistent_lsn)}"
        if info is not None:
            raise SnapshotError(f"stream {cfg.stream} already has its initial snapshot (consistent point {where}) "
                                f"and slot {cfg.source.slot}; to copy tables again at a new consistent point "
                                "run a resend (snapshot mode 'resend')")
        raise SnapshotError(f"stream {cfg.stream} has a consistent point ({where}) but its slot "
                            f"{cfg.source.slot} is gone; run a resend (snapshot mode 'resend')")
    if info is not None:
        # resend: the old slot is replaced; initial: a leftover of a snapshot that did not finish
        drop_slot(cfg)


def _create_slot(cfg: StreamConfig):
    """Create the slot with an exported snapshot; return (replication connection, lsn, snapshot name)."""
    conn = connect_replication(cfg, application_name=f"tidemark-snapshot-slot:{cfg.stream}")
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE_REPLICATION_SLOT {} LOGICAL pgoutput EXPORT_SNAPSHOT")
                        .format(sql.Identifier(cfg.source.slot)))
            _, consistent_point, snapshot_name, _ = cur.fetchone()
    except BaseException:
        conn.close()
        raise
    return conn, parse_lsn(consistent_point), snapshot_name


def _run(cfg, ctl, refs, mode, chunk_pages, parallelism, progress, chunk_hook, leases=()) -> SnapshotResult:
    store = landing_store(cfg)
    _clear_dead(cfg, ctl, store)
    repl, lsn, snapshot_name = _create_slot(cfg)
    snapshot_id = f"{lsn:016X}-{secrets.token_hex(3)}"
    try:
        ctl.snapshot_started(cfg.stream, snapshot_id, lsn, mode)
    except BaseException:
        repl.close()
        drop_slot(cfg)
        raise
    try:
        plans = _plan(cfg, snapshot_name, refs, chunk_pages) if refs else []
        if mode == "resend":   # the lake is compared with the source by key ranges: only those that differ are copied
            from tidemark.capture import ranges

            ranges.compare(cfg, snapshot_name, plans, parallelism)
        ctl.snapshot_chunks_planned(cfg.stream, snapshot_id, [(c.table, c.chunk_no, c.page_lo, c.page_hi)
                                                             for p in plans for c in p.chunks])
        _copy_all(cfg, ctl, store, snapshot_id, snapshot_name, plans, parallelism, progress, chunk_hook)
        repl.close()   # every chunk is copied: the exported snapshot may go
        tables = {p.ref.qualified: {"rows": p.rows, "files": [k for _, k in sorted(p.files.items())],
                                    "table_schema": p.schema.to_json(), "attnums": p.attnums,
                                    "published": p.published, **({"ranges": p.ranges} if p.ranges else {})}
                  for p in plans}
        _check_range_copies(cfg, snapshot_id, tables)
        manifest = {"snapshot_id": snapshot_id, "stream": cfg.stream, "lsn": lsn, "mode": mode, "tables": tables}
        uri, _ = put_if_absent(store, manifest_key(cfg.stream, snapshot_id),
                               json.dumps(manifest, indent=1, sort_keys=True).encode())
        for lease in leases:     # the stream's positions move to the new consistent point
            lease.confirm(f"complete snapshot {snapshot_id}")
        ctl.snapshot_complete(cfg.stream, snapshot_id, lsn, tables)
        left_out = sorted(t.qualified for t in cfg.source.tables if t.qualified not in tables) if refs else []
        if left_out:      # their rows were not copied: they wait for their own snapshot (mode add)
            ctl.set_table_states(cfg.stream, left_out, "awaiting_snapshot")
    except BaseException as exc:
        repl.close()
        _abandon(cfg, ctl, store, snapshot_id, str(exc))
        raise
    from tidemark.capture.ranges import summary

    return SnapshotResult(snapshot_id=snapshot_id, lsn=lsn, tables={t: d["rows"] for t, d in tables.items()},
                          manifest_uri=uri, waiting=left_out, copies={t: summary(d) for t, d in tables.items()})


def _check_range_copies(cfg: StreamConfig, snapshot_id: str, tables: dict) -> None:
    """A table copied by key ranges must have copied exactly the rows its checksums counted there."""
    for table, entry in tables.items():
        r = entry.get("ranges") or {}
        if "copied" in r and r["rows_expected"] != entry["rows"]:
            raise SnapshotError(f"stream {cfg.stream}: snapshot {snapshot_id}: table {table}: the key ranges that "
                                f"differ hold {r['rows_expected']} rows by their checksums but {entry['rows']} were "
                                "copied")


def _abandon(cfg: StreamConfig, ctl: Control, store: Store, snapshot_id: str, reason: str) -> None:
    """After a failure: mark the snapshot failed, drop its slot, remove its files (best effort each, so
    that the original error is the one raised)."""
    for step in (lambda: ctl.snapshot_failed(cfg.stream, snapshot_id, reason), lambda: drop_slot(cfg),
                 lambda: _discard_files(store, cfg.stream, snapshot_id)):
        try:
            step()
        except Exception:  # noqa: BLE001
            pass


def _clear_dead(cfg: StreamConfig, ctl: Control, store: Store) -> list[str]:
    """Snapshots of the stream a killed process left ``running`` (the caller holds a snapshot lease,
    which excludes every other snapshot of the stream, so none of them is still copying): marked
    failed, their files removed, so the control database and the landing store say what happened."""
    dead = ctl.running_snapshots(cfg.stream)
    for snapshot_id in dead:
        ctl.snapshot_failed(cfg.stream, snapshot_id, "its process died before it finished (found by the next "
                                                     "snapshot, which starts over)")
        _discard_files(store, cfg.stream, snapshot_id)
        log.warning("stream %s: snapshot %s was left running by a process that died: marked failed, its files "
                    "removed", cfg.stream, snapshot_id)
    return dead


def _discard_files(store: Store, stream: str, snapshot_id: str) -> None:
    """Delete the files of a failed snapshot (its control row keeps the error)."""
    for key in list(store.list(f"{stream_keys(stream)['snapshots']}{snapshot_id}/")):
        store.delete(key)


def _copy_all(cfg, ctl, store, snapshot_id, snapshot_name, plans, parallelism, progress, chunk_hook) -> None:
    """Copy every chunk with ``parallelism`` workers; retry a failed chunk alone."""
    if not plans:
        return
    by_table = {p.ref.qualified: p for p in plans}
    workers = _Workers(cfg, snapshot_name)
    started = time.monotonic()
    total_rows = 0
    pending: dict[Future, tuple[Chunk, int, str, int]] = {}
    try:
        with ThreadPoolExecutor(max_workers=parallelism, thread_name_prefix="tidemark-snapshot") as pool:
            def submit(chunk: Chunk, attempt: int) -> None:
                plan = by_table[chunk.table]
                key = _chunk_key(cfg.stream, snapshot_id, chunk.table, chunk.chunk_no, plan.gen)
                fut = pool.submit(_copy_chunk, workers, store, key, plan.schema, chunk, attempt, chunk_hook, plan.where)
                pending[fut] = (chunk, attempt, key, plan.gen)

            for p in plans:
                for c in p.chunks:
                    submit(c, 1)
            while pending:
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for fut in done:
                    chunk, attempt, key, gen = pending.pop(fut)
                    plan = by_table[chunk.table]
                    exc = fut.exception()
                    if gen != plan.gen:        # copied before a column went to its text form: redone
                        if exc is None:
                            with contextlib.suppress(Exception):
                                store.delete(key)
                        continue
                    if isinstance(exc, ArrayTextFallback):
                        # an array value the column's lists cannot hold: that column is held as
                        # PostgreSQL's text (the table's shape says so), the table's chunks are redone
                        for column, why in exc.misfits.items():
                            log.warning("stream %s: snapshot %s: table %s column %s is held as PostgreSQL's text "
                                        "from its LSN %s on: %s", cfg.stream, snapshot_id, exc.table, column,
                                        format_lsn(int(snapshot_id.split("-")[0], 16)), why)
                        plan.schema = plan.schema.with_text(exc.misfits)
                        plan.gen += 1
                        for old in plan.files.values():
                            with contextlib.suppress(Exception):
                                store.delete(old)
                        total_rows -= plan.rows
                        plan.rows, plan.done, plan.files = 0, 0, {}
                        for c in plan.chunks:
                            submit(c, 1)
                        continue
                    if exc is not None:
                        reason = f"{type(exc).__name__}: {exc}".strip()
                        ctl.snapshot_chunk_done(cfg.stream, snapshot_id, chunk.table, chunk.chunk_no, status="failed", error=reason[:2000])
                        if attempt >= MAX_ATTEMPTS or isinstance(exc, SnapshotValueError) \
                                or not isinstance(exc, Exception):
                            for f in pending:
                                f.cancel()
                            raise SnapshotError(
                                f"stream {cfg.stream}: snapshot {snapshot_id}: table {chunk.table} chunk "
                                f"{chunk.chunk_no} (pages {chunk.page_lo}..{chunk.page_hi or 'end'} of "
                                f"{chunk.rel_schema}.{chunk.rel_name}) failed after {attempt} attempt(s); last error: "
                                f"{reason}") from exc
                        submit(chunk, attempt + 1)
                        continue
                    rows, uri = fut.result()
                    plan.rows += rows
                    plan.done += 1
                    plan.files[chunk.chunk_no] = key
                    total_rows += rows
                    ctl.snapshot_chunk_done(cfg.stream, snapshot_id, chunk.table, chunk.chunk_no, status="done", uri=uri, rows=rows)
                    if progress is not None:
                        elapsed = max(time.monotonic() - started, 1e-9)
                        progress({"snapshot_id": snapshot_id, "table": chunk.table, "chunk": chunk.chunk_no,
                                  "chunks_done": plan.done, "chunks_total": len(plan.chunks), "rows": plan.rows,
                                  "total_rows": total_rows, "rows_per_s": total_rows / elapsed})
    finally:
        workers.close()



# -- reading a snapshot back (consolidation, tests) ------------------------------------------------

def load_manifest(store: Store, stream: str, snapshot_id: str) -> dict:
    """The manifest of a landed snapshot."""
    return json.loads(store.get(manifest_key(stream, snapshot_id)))


def read_snapshot_table(store: Store, manifest: dict, table: str):
    """All rows of one table of a snapshot as one Arrow table (lake schema); checks the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    entry = manifest["tables"][table]
    schema = arrow_schema(TableSchema.from_json(entry["table_schema"]))
    parts = [pq.read_table(pa.BufferReader(store.get(k))) for k in entry["files"]]
    out = pa.concat_tables(parts).cast(schema) if parts else schema.empty_table()
    if out.num_rows != entry["rows"]:
        raise SnapshotError(f"snapshot {manifest['snapshot_id']}: table {table} has {out.num_rows} rows in its "
                            f"files but the manifest says {entry['rows']}")
    return out
