"""Rows cut again by the lake table's buckets (`cut_partition`): a table's parts decoded and cut otherwise
than its lake table cuts rows now, and a re-snapshot's rows (`reload_rows`); also the snapshot files'
rows in the lake schema (`snapshot_rows`) and a part conformed to a table's schema now
(`conform_payload`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from tidemark.consolidate.bucket_parts import by_bucket, data_row
from tidemark.consolidate.work_area import (META_COLUMNS, META_CTS, META_DIFF, META_FULL, META_POS, META_TIME,
                                            META_UNKNOWN, META_XID, Work, add_rows, decoded_arrow_schema,
                                            decoded_columns, put_parts, read_parts)
from tidemark.errors import TidemarkError
from tidemark.lake.delta import conform
from tidemark.lake.layout import with_renames
from tidemark.landing.store import read_uri


@dataclass(frozen=True)
class Cut:
    """How `cut_partition` cuts one table's rows: its schema now (meta columns + the table's, ``full``;
    JSON ``shape``), the hashed columns (its key, or every column), the number of buckets, and what
    its older rows need (``fill``: ADD COLUMN ... DEFAULT; ``renames``: RENAME COLUMN)."""

    full: Any
    shape: str
    hashed: tuple
    buckets: int
    fill: dict
    renames: dict


def cut_partition(batches: Iterator, units: list, cuts: dict[str, Cut], work: Work, endpoint: str | None
                  ) -> Iterator:
    """``mapInArrow`` body over a ``spark.range``: unit ids in; each unit's rows in their table's
    schema now, cut by its lake buckets (`Cut`), written as one object of the work area, and their
    ``data`` rows (`decoded_arrow_schema`) out. A unit is ``("parts", name, [(table, seg, offset,
    size)])``, parts decoded and cut otherwise than the lake table cuts now, or ``("reload", name,
    table, uri, lsn, position, cts)``, a re-snapshot's file: its rows as inserts at ``(lsn,
    position)`` with commit time ``cts`` (`reload_rows`)."""
    schema = decoded_arrow_schema()
    store = work.open()
    for batch in batches:
        for unit in [units[i] for i in batch.column("id").to_pylist()]:
            rows: dict[str, list] = {}
            if unit[0] == "parts":
                _, name, parts = unit
                payloads = read_parts(store, work, [(seg, off, size) for _, seg, off, size in parts])
                for (table, *_), payload in zip(parts, payloads):
                    c = cuts[table]
                    rows.setdefault(table, []).append(conform_payload(pa.ipc.open_stream(payload).read_all(), c.full,
                                                                      table, c.fill, c.renames))
            else:
                _, name, table, uri, lsn, position, cts = unit
                c = cuts[table]
                rows[table] = list(reload_rows(uri, c.full, endpoint, lsn, position, cts, c.renames, c.fill))
            out = decoded_columns()
            for table, tables in rows.items():
                c = cuts[table]
                t = pa.concat_tables(tables) if tables else c.full.empty_table()
                if not t.num_rows:
                    continue
                for bucket, part in by_bucket(t, c.buckets, list(c.hashed), [])[0]:
                    add_rows(out, 1, "data", name, **data_row(table, part, c.shape, bucket))
            put_parts(store, work.key(name), out)
            yield pa.RecordBatch.from_pydict(out, schema=schema)


def snapshot_rows(batches, target, endpoint: str | None, renames: dict | None = None,
                  fill: dict | None = None) -> Iterator:
    """``mapInArrow`` body: snapshot file URIs in, their rows (the lake schema ``target``; columns
    renamed since the copy, ``renames``, under their new names; columns added since, ``fill``'s
    value or null) out."""
    for batch in batches:
        for uri in batch.column("uri").to_pylist():
            rows = pq.read_table(pa.BufferReader(read_uri(uri, endpoint_url=endpoint)))
            yield from conform(with_renames(rows, renames), target, fill).to_batches()


def reload_rows(uri: str, full, endpoint: str | None, lsn: int, position: int, cts: int, renames: dict,
                fill: dict) -> Iterator:
    """A re-snapshot's Parquet file's rows (tables) as whole-row inserts at ``(lsn, position)`` in the
    ``full`` schema (meta columns + the table's; ``renames``: columns renamed since the copy;
    ``fill``: the missing value of columns added after it, a DEFAULT's, which its rows hold as every
    row that existed then does)."""
    target = pa.schema([f for f in full if f.name not in META_COLUMNS])
    for t in snapshot_rows([pa.record_batch({"uri": [uri]})], target, endpoint, renames, fill):
        n = t.num_rows
        meta = {META_TIME: pa.array([lsn] * n, pa.int64()), META_POS: pa.array([position] * n, pa.int32()),
                META_DIFF: pa.array([1] * n, pa.int64()), META_FULL: pa.array([True] * n, pa.bool_()),
                META_UNKNOWN: pa.array([[]] * n, pa.list_(pa.string())), META_XID: pa.array([0] * n, pa.int64()),
                META_CTS: pa.array([cts] * n, pa.int64())}
        yield pa.Table.from_arrays([meta[f.name] if f.name in meta else t.column(f.name) for f in full], schema=full)


def conform_payload(part, target, table: str, fill: dict | None = None, renames: dict | None = None):
    """One ``data`` payload's changes in the ``target`` schema (meta + the table's columns now).

    Columns the target has and a payload lacks (added later) are null, or hold ``fill``'s value (a
    column added with a DEFAULT: every row that lacks it holds it, as in PostgreSQL); columns a
    payload has and the target lacks (dropped since) are left out; a payload from before a RENAME
    COLUMN has the column under its old name (``renames``: old -> new)."""
    part = with_renames(part, renames)
    try:
        return conform(part, target, fill)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        for field in target:        # the column whose values do not cast, named
            col = part.column(field.name) if field.name in part.column_names else None
            try:
                col is None or col.type == field.type or col.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise TidemarkError(f"table {table} column {field.name}: type changed from {col.type} "
                                    f"to {field.type} ({exc}); re-snapshot the table (resend)") from exc
        raise
