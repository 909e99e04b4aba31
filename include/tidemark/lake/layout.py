"""The physical layout of a lake table: its buckets, its files and their statistics, and the tools
the merge (`tidemark.consolidate.merge.merge_group`, in Spark executors), the compaction
(`tidemark.maintain`) and a resend's key-range checksums (`tidemark.capture.ranges`) read and write
them with.

A table is partitioned by ``_bucket``; inside a bucket, files hold rows sorted by the key (all
columns for tables without a key), at most ``target_rows`` rows each, their add actions carrying
min/max statistics of the sort columns (integers and short strings). `touched` and `kept` pick a
bucket's files to rewrite, `SortedWriter` writes its new files; nothing here commits: the executors
return file actions for the driver to commit (docs/internals/merge.md).
"""
from __future__ import annotations

import contextlib
import json
import os
import uuid
import zlib
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow.fs import LocalFileSystem

from tidemark.errors import LakeFull, NoSpace
from tidemark.lake.delta import conform, filesystem
from tidemark.lake.delta import strip_scheme as fs_path

TARGET_ROWS = 65_536
ACTIONS_DDL = ("target string, op string, path string, size long, rows long, stats string, partition string, "
               "bucket int, time long, count long")
STAT_STRING_MAX = 64


@dataclass
class BucketPlan:
    """Everything an executor needs to rewrite the buckets of one table (picklable)."""

    uri: str
    options: dict | None
    schema: Any                      # pyarrow.Schema of the source columns (lake types)
    keys: list[str]
    sort: list[str]
    files: dict[int, list[dict]] = field(default_factory=dict)
    target_rows: int = TARGET_ROWS
    tag: str = ""
    fill: dict = field(default_factory=dict)    # column -> pyarrow scalar: what a row lacking it holds
    renames: dict = field(default_factory=dict)  # old name -> new name: columns renamed in the source


def plan_tag(frontier: int) -> str:
    """A file-name tag unique to one attempt of one consolidation."""
    return f"{frontier:016X}-{uuid.uuid4().hex[:12]}"


def sort_columns(schema, keys: list[str]) -> list[str]:
    """The columns rows are sorted by inside a bucket: the key, or every sortable column."""
    if keys:
        return list(keys)
    return [f.name for f in schema
            if not (pa.types.is_list(f.type) or pa.types.is_struct(f.type) or pa.types.is_map(f.type))]


def _stat_ok(t) -> bool:
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)


def file_stats(table, sort: list[str]) -> str:
    """Delta statistics JSON: numRecords, and min/max/nullCount of the sort columns that have them."""
    mins, maxs, nulls = {}, {}, {}
    for name in sort:
        column = table.column(name)
        if not _stat_ok(column.type):
            continue
        nulls[name] = column.null_count
        if column.null_count == len(column):
            continue
        mm = pc.min_max(column)
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
        if isinstance(lo, str) and (len(lo) > STAT_STRING_MAX or len(hi) > STAT_STRING_MAX):
            continue
        mins[name], maxs[name] = lo, hi
    return json.dumps({"numRecords": table.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls})


def file_index(dt, sort: list[str]) -> dict[int, list[dict]]:
    """The files of a Delta table per bucket, with row counts and min/max and null counts of the sort
    columns."""
    actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    out: dict[int, list[dict]] = {}
    for a in actions:
        b = int(a["partition._bucket"])
        stats = {name: {c: a[f"{at}.{c}"] for c in sort if a.get(f"{at}.{c}") is not None}
                 for name, at in (("min", "min"), ("max", "max"), ("nulls", "null_count"))}
        out.setdefault(b, []).append({"path": a["path"], "size": a["size_bytes"], "rows": a["num_records"], **stats})
    return out


def _may_contain(f: dict, changes, sort: list[str]):
    """Whether file ``f`` may hold any of the changed rows (by its min/max statistics)."""
    mask = None
    for c in sort:
        if c not in f["min"] or c not in f["max"]:
            continue
        column = changes.column(c)
        lo, hi = pa.scalar(f["min"][c]).cast(column.type), pa.scalar(f["max"][c]).cast(column.type)
        m = pc.fill_null(pc.and_(pc.greater_equal(column, lo), pc.less_equal(column, hi)), True)
        mask = m if mask is None else pc.and_(mask, m)
    return True if mask is None else pc.any(mask).as_py() or False


def read_files(plan: BucketPlan, paths: list[str]):
    """The rows of some of the table's files, in the lake schema (absent columns are null)."""
    fs = filesystem(plan.uri, plan.options)
    parts = []
    for p in paths:
        # one file, not a dataset (``read_table`` sets up dataset discovery for each); ``pre_buffer``
        # coalesces the column chunks' reads (S3)
        with fs.open_input_file(fs_path(plan.uri) + "/" + p) as f:
            t = pq.ParquetFile(f, pre_buffer=True).read(use_threads=False)
        parts.append(conform(with_renames(t, plan.renames), plan.schema, plan.fill))
    return pa.concat_tables(parts) if parts else plan.schema.empty_table()


def with_renames(table, renames: dict | None):
    """``table`` with each column ``renames`` names (old -> new: RENAME COLUMN in the source) under its
    new name, where it has the old name and not the new one (rows written before the rename)."""
    if not renames:
        return table
    names = table.column_names
    if not any(old in names and new not in names for old, new in renames.items()):
        return table
    return table.rename_columns([renames[n] if n in renames and renames[n] not in names else n for n in names])


def _bounds(plan: BucketPlan, kept_files: list[dict]) -> list:
    """The first sort column's min and max values of the files that stay, in order."""
    first = plan.sort[0] if plan.sort else None
    return sorted({v for f in kept_files if first and first in f["min"] and first in f["max"]
                   for v in (f["min"][first], f["max"][first])})


def _runs(plan: BucketPlan, rows, bounds: list) -> list[tuple[int, int, int]]:
    """(offset, length, slot) runs of the sorted ``rows`` that do not straddle a kept file's key range
    (by the first sort column, ``bounds``: `_bounds`), so new files never overlap the files left in
    place; ``slot``: how many bounds lie at or before the run's rows."""
    if not bounds or rows.num_rows == 0:
        return [(0, rows.num_rows, 0)]
    values = rows.column(plan.sort[0]).to_numpy(zero_copy_only=False)
    slots = np.searchsorted(np.array(bounds, dtype=values.dtype if values.dtype != object else object), values,
                            side="right")
    cuts = np.nonzero(np.diff(slots))[0] + 1
    edges = [0, *cuts.tolist(), rows.num_rows]
    return [(a, b - a, int(slots[a])) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def ascending(names: list[str]) -> list:
    """Arrow sort keys for the columns ``names``, ascending, each a field reference: Arrow reads a
    name given as text that starts with '.' or '[' as a path of nested fields (``...``, ``.a``)."""
    return [(pc.field(n), "ascending") for n in names]


def write_sorted(plan: BucketPlan, rows, bucket: int) -> list[dict]:
    """Sort ``rows`` and write them as files of at most ``target_rows`` rows into the bucket."""
    writer = SortedWriter(plan, bucket)
    writer.add(rows)
    return writer.close()


class SortedWriter:
    """A bucket's new files, from rows given part by part in key order (each part sorted here, every
    row of a part after those of the parts before): files of at most ``target_rows`` rows that never
    span the key range of a file that stays (``kept_files``). A run of rows between two such ranges
    is written ``target_rows`` rows at a time while more than 1.5 times that wait, and what is left
    of it in equal files when it ends: fewer than ``1.5 * target_rows`` rows wait between parts, and
    no file of a run longer than ``target_rows`` has fewer than half that."""

    def __init__(self, plan: BucketPlan, bucket: int, kept_files: list[dict] | None = None):
        self.plan, self.bucket, self.bounds = plan, bucket, _bounds(plan, kept_files or [])
        self.run: list = []
        self.held, self.slot, self.actions = 0, None, []

    def add(self, rows) -> None:
        if rows.num_rows == 0:
            return
        sortable = [c for c in self.plan.sort if c in rows.column_names]
        if sortable:
            rows = _sorted(rows, sortable)
        target = self.plan.target_rows
        for offset, length, slot in _runs(self.plan, rows, self.bounds):
            if slot != self.slot:
                self._end_run()
                self.slot = slot
            self.run.append(rows.slice(offset, length))
            self.held += length
            cut = (self.held - target // 2) // target * target
            if cut > 0:                # more than 1.5 x target_rows wait: leave between a half and 1.5
                run = pa.concat_tables(self.run)
                self._write([run.slice(i, target) for i in range(0, cut, target)])
                self.run, self.held = [run.slice(cut)], self.held - cut

    def _end_run(self) -> None:
        if self.held:
            run = pa.concat_tables(self.run) if len(self.run) > 1 else self.run[0]
            n = max(1, -(-self.held // self.plan.target_rows))
            size = -(-self.held // n)
            self._write([run.slice(i * size, min(size, self.held - i * size)) for i in range(n)])
        self.run, self.held = [], 0

    def _write(self, chunks: list) -> None:
        self.actions += _write_chunks(self.plan, chunks, self.bucket, first=len(self.actions))

    def close(self) -> list[dict]:
        """The add actions of every file written (the rows still waiting written now)."""
        self._end_run()
        return self.actions


def _sorted(rows, columns: list[str]):
    """``rows`` sorted by ``columns`` (ascending, stable, nulls last: ``Table.sort_by``; by one integer
    column without nulls, numpy's stable sort, the same order); rows already in order are not copied."""
    if len(columns) == 1 and pa.types.is_integer(rows.schema.field(columns[0]).type) \
            and not rows.column(columns[0]).null_count:
        v = rows.column(columns[0]).to_numpy()
        if (v[1:] >= v[:-1]).all():
            return rows
        return rows.take(pa.array(np.argsort(v, kind="stable"), pa.int64()))
    return rows.sort_by(ascending(columns))


def dictionary_columns(table, sample: int = 2048) -> list[str]:
    """The columns worth Parquet's dictionary encoding: those whose values repeat (at most half as
    many distinct values as rows in an evenly spaced sample)."""
    n = table.num_rows
    if n == 0:
        return []
    idx = pa.array(np.arange(0, n, max(1, n // sample)))
    return [f.name for f in table.schema if not (pa.types.is_boolean(f.type) or pa.types.is_nested(f.type))
            and pc.count_distinct(table.column(f.name).take(idx), mode="all").as_py() * 2 <= len(idx)]


LONG_STATISTICS = 4096     # a text or binary column holding a longer value gets no Parquet min/max


def _statistics_columns(table):
    """True, or the columns to write Parquet statistics for: not a text or binary column holding a
    value longer than `LONG_STATISTICS` bytes (its min and max would be copies of huge values)."""
    long = [f.name for f in table.schema
            if (pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type) or pa.types.is_string(f.type)
                or pa.types.is_large_string(f.type))
            and table.num_rows and (pc.max(pc.binary_length(table.column(f.name))).as_py() or 0) > LONG_STATISTICS]
    return True if not long else [n for n in table.column_names if n not in long]


def write_parquet(table, path: str, fs) -> int:
    """Write one lake (or changelog) Parquet file (snappy, dictionaries where values repeat), encoded
    in memory and written with one call (on a local disk, its directory made first); return its size.
    A full disk is a `tidemark.errors.LakeFull` naming the file and its size."""
    if isinstance(fs, LocalFileSystem):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="snappy", use_dictionary=dictionary_columns(table),
                   write_statistics=_statistics_columns(table))
    data = sink.getvalue()
    try:
        with fs.open_output_stream(path) as out:
            out.write(data)
    except OSError as exc:
        if exc.errno not in NoSpace.ERRNOS:
            raise
        with contextlib.suppress(OSError):      # what part of it was written is no file of the lake
            fs.delete_file(path)
        raise LakeFull.at(path, data.size) from exc
    return data.size


def _write_chunks(plan: BucketPlan, chunks: list, bucket: int, first: int = 0) -> list[dict]:
    fs = filesystem(plan.uri, plan.options)
    base = fs_path(plan.uri)
    out = []
    for i, chunk in enumerate(chunks, start=first):
        rel = f"_bucket={bucket}/part-{plan.tag}-{bucket:05d}-{i:04d}.parquet"
        size = write_parquet(chunk, base + "/" + rel, fs)
        out.append({"target": "table", "op": "add", "path": rel, "size": size, "rows": chunk.num_rows,
                    "stats": file_stats(chunk, plan.sort), "partition": str(bucket), "bucket": bucket,
                    "time": None, "count": None})
    return out


def touched(plan: BucketPlan, bucket: int, probe, small: bool = True) -> list[dict]:
    """A bucket's files to rewrite for the changed rows ``probe``: those that may hold one by their
    statistics and, with ``small``, the bucket's small files (merged on the way)."""
    small = plan.target_rows // 2 if small else 0
    return [f for f in plan.files.get(bucket, []) if (f["rows"] or 0) < small
            or (probe is not None and probe.num_rows and _may_contain(f, probe, plan.sort))]


def kept(files: list[dict], touched: list[dict]) -> list[dict]:
    gone = {f["path"] for f in touched}
    return [f for f in files if f["path"] not in gone]


def removes(files: list[dict], bucket: int) -> list[dict]:
    return [{"target": "table", "op": "remove", "path": f["path"], "size": f["size"], "rows": f["rows"],
             "stats": None, "partition": str(bucket), "bucket": bucket, "time": None, "count": None}
            for f in files]


def ddl_schema(ddl: str):
    """The Arrow schema of a Spark DDL string of string, long, int and binary columns (`ACTIONS_DDL`)."""
    types = {"string": pa.string(), "long": pa.int64(), "int": pa.int32(), "binary": pa.binary()}
    return pa.schema([(name, types[t]) for name, t in map(str.split, ddl.split(", "))])


def _actions_table(rows: list[dict]):
    return pa.Table.from_pylist(rows, schema=ddl_schema(ACTIONS_DDL))


FILES_DDL = "path string, size long, rows long, bucket int"


def project_files(plan: BucketPlan, batches):
    """``mapInArrow`` body: files in, each rewritten with exactly the plan's columns (DROP COLUMN; ADD
    COLUMN with a DEFAULT: the plan's ``fill``)."""
    for batch in batches:
        for f in batch.to_pylist():
            rows = read_files(plan, [f["path"]])
            acts = removes([f], f["bucket"])
            chunk_plan = replace(plan, tag=f"{plan.tag}-{zlib.crc32(f['path'].encode()):08x}")
            acts += _write_chunks(chunk_plan, [rows], f["bucket"]) if rows.num_rows else []
            yield from _actions_table(acts).to_batches()


def projected_rows(plan: BucketPlan, batches):
    """``mapInArrow`` body: files in, their rows with exactly the plan's columns out (`project_files`'
    rows, for a table whose rows move between buckets)."""
    for batch in batches:
        for f in batch.to_pylist():
            yield from read_files(plan, [f["path"]]).to_batches()


def rename_files(uri: str, options: dict | None, renames: dict, stats: list[str], tag: str, batches):
    """``mapInArrow`` body: a Delta table's files in (``path string, partition string``), each written
    again beside itself with the columns ``renames`` names renamed (RENAME COLUMN in the source),
    keeping its name's prefix (``open``/``closed``/``part``); their add actions out (with min/max of
    ``stats``), for a commit that replaces every file of the table."""
    fs = filesystem(uri, options)
    base = fs_path(uri).rstrip("/")      # a Delta table's own URI ends with a slash
    for batch in batches:
        for f in batch.to_pylist():
            path = unquote(f["path"])     # the log's paths are percent-encoded
            with fs.open_input_file(base + "/" + path) as fh:
                t = with_renames(pq.ParquetFile(fh, pre_buffer=True).read(), renames)
            folder, _, name = path.rpartition("/")
            rel = f"{folder}/" if folder else ""
            rel += f"{name.split('-', 1)[0]}-{tag}-{zlib.crc32(f['path'].encode()):08x}.parquet"
            size = write_parquet(t, base + "/" + rel, fs)
            yield from _actions_table([{"target": "table", "op": "add", "path": rel, "size": size, "rows": t.num_rows,
                                        "stats": file_stats(t, [c for c in stats if c in t.column_names]),
                                        "partition": f["partition"]}]).to_batches()


def load_bucket(plan: BucketPlan, rows):
    """Write one bucket of a snapshot (``applyInArrow`` body)."""
    bucket = int(rows.column("_bucket")[0].as_py())
    return _actions_table(write_sorted(plan, conform(rows, plan.schema), bucket))


def effective_keys(shape) -> list[str]:
    """The columns that identify a row in the lake (a `TableSchema`'s): the replica identity key, or
    none (a multiset of whole rows) for REPLICA IDENTITY FULL tables, whose changes carry whole old rows."""
    return [] if shape.replica_identity == "f" else list(shape.key_columns)
