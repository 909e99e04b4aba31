"""The copy of a snapshot's tables: each table planned in page-range chunks under the exported snapshot
(`plan_tables`), the chunks copied by a pool of worker connections that import the snapshot (`copy_all`), a
chunk that fails retried alone (up to `MAX_ATTEMPTS`) on a fresh connection.

Layout in the landing store::

    {stream}/snapshots/{snapshot_id}/{schema}.{table}/chunk-{n:06d}.parquet
    {stream}/snapshots/{snapshot_id}/manifest.json
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from tidemark.capture.chunks import (ArrayTextFallback, Chunk, SnapshotError, SnapshotValueError, chunk_query,
                                     csv_to_table, plan_chunks, row_filter_sql, table_to_parquet)
from tidemark.capture.source import connect_source
from tidemark.config import StreamConfig, TableRef
from tidemark.lsn import format_lsn
from tidemark.landing.store import Store, stream_keys
from tidemark.pgtypes import TableSchema, TypeResolver, column_attnums, table_schema_for_oid
from tidemark.pgtypes.catalog import published_filter, relation

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3


@dataclass
class TablePlan:
    ref: TableRef
    schema: TableSchema
    chunks: list[Chunk]
    rows: int = 0
    files: dict[int, str] = field(default_factory=dict)     # chunk number -> key, of the chunks done
    where: Any = None          # the publication's row filter, AND (a resend by key ranges) the ranges copied
    published: dict = field(default_factory=dict)  # the stream file's column list and row filter it was copied with
    ranges: dict | None = None     # what the range comparison found (in the manifest's table entry)
    attnums: dict = field(default_factory=dict)    # {column: attnum} under the snapshot (`column_attnums`)
    gen: int = 0                   # times an array column went to its text form (`ArrayTextFallback`): chunks redone


class Workers:
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
            conn = self.local.conn = open_snapshot_connection(self.cfg, self.snapshot_name)
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
    conn = connect_source(cfg, application_name=f"tidemark-snapshot:{cfg.stream}")
    conn.set_client_encoding("UTF8")
    with conn.cursor() as cur:
        cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
    return conn


def _copy_chunk(workers: Workers, store: Store, key: str, schema: TableSchema, chunk: Chunk,
                attempt: int, hook: Callable[[Chunk, int], None] | None, where) -> tuple[int, str]:
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


def _chunk_key(stream: str, snapshot_id: str, table: str, chunk_no: int, gen: int) -> str:
    again = f"-{gen}" if gen else ""      # a copy redone with a column as text (`ArrayTextFallback`)
    return f"{stream_keys(stream)['snapshots']}{snapshot_id}/{table}/chunk-{chunk_no:06d}{again}.parquet"


def manifest_key(stream: str, snapshot_id: str) -> str:
    return f"{stream_keys(stream)['snapshots']}{snapshot_id}/manifest.json"


def discard_files(store: Store, stream: str, snapshot_id: str) -> None:
    """Delete the files of a failed snapshot (its control row keeps the error)."""
    for key in list(store.list(f"{stream_keys(stream)['snapshots']}{snapshot_id}/")):
        store.delete(key)


def copy_all(cfg, ctl, store, snapshot_id, snapshot_name, plans, parallelism, progress, chunk_hook) -> None:
    """Copy every chunk with ``parallelism`` workers; retry a failed chunk alone."""
    ctl.snapshot_chunks_planned(cfg.stream, snapshot_id, [(c.table, c.chunk_no, c.page_lo, c.page_hi)
                                                         for p in plans for c in p.chunks])
    if not plans:
        return
    by_table = {p.ref.qualified: p for p in plans}
    started = time.monotonic()
    pending: dict[Future, tuple[Chunk, int, str, int]] = {}
    with contextlib.closing(Workers(cfg, snapshot_name)) as workers, \
            ThreadPoolExecutor(max_workers=parallelism, thread_name_prefix="tidemark-snapshot") as pool:
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
                    plan.rows, plan.files = 0, {}
                    for c in plan.chunks:
                        submit(c, 1)
                    continue
                if exc is not None:
                    reason = f"{type(exc).__name__}: {exc}".strip()
                    ctl.snapshot_chunk_done(cfg.stream, snapshot_id, chunk.table, chunk.chunk_no, status="failed",
                                            error=reason[:2000])
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
                plan.files[chunk.chunk_no] = key
                ctl.snapshot_chunk_done(cfg.stream, snapshot_id, chunk.table, chunk.chunk_no, status="done",
                                        uri=uri, rows=rows)
                if progress is not None:
                    elapsed = max(time.monotonic() - started, 1e-9)
                    total_rows = sum(p.rows for p in plans)
                    progress({"snapshot_id": snapshot_id, "table": chunk.table, "chunk": chunk.chunk_no,
                              "chunks_done": len(plan.files), "chunks_total": len(plan.chunks), "rows": plan.rows,
                              "total_rows": total_rows, "rows_per_s": total_rows / elapsed})


# -- planning ------------------------------------------------------------------------------------

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


def plan_tables(cfg: StreamConfig, snapshot_name: str, refs: list[TableRef], chunk_pages: int) -> list[TablePlan]:
    with contextlib.closing(open_snapshot_connection(cfg, snapshot_name)) as conn:
        resolver = TypeResolver(conn)
        plans = []
        for ref in refs:
            found = relation(conn, ref.schema, ref.name)
            if found is None:
                raise SnapshotError(f"table {ref} does not exist in the source database")
            oid, relkind = found
            # the publication as of the exported snapshot: the columns and rows pgoutput sends from it on
            columns, where = published_filter(conn, cfg.source.publication, oid)
            schema = table_schema_for_oid(conn, oid, resolver, columns)
            if not schema.columns:
                raise SnapshotError(f"table {ref} has no columns to copy")
            lists = [c.name for c in schema.columns if c.key and c.kind == "array"] \
                if schema.replica_identity != "f" else []
            if lists:
                # the lake keys, sorts and merges rows by their key; Arrow neither sorts nor joins lists
                raise SnapshotError(f"table {ref}: its key (replica identity) holds the array column(s) "
                                    f"{', '.join(lists)}, and the lake cannot key rows by an array; give it a "
                                    f"key without them (ALTER TABLE {ref} REPLICA IDENTITY USING INDEX <a unique "
                                    f"index on other NOT NULL columns>) or ALTER TABLE {ref} REPLICA IDENTITY FULL "
                                    "(kept as a multiset of whole rows), then snapshot it again")
            plans.append(TablePlan(ref, schema, plan_chunks(ref.qualified, _leaves(conn, oid, relkind), chunk_pages),
                                    where=row_filter_sql(where),
                                    published=cfg.source.filter_of(ref).as_dict(),
                                    attnums={n: a for n, a in column_attnums(conn, oid).items()
                                             if columns is None or n in columns}))
        return plans
