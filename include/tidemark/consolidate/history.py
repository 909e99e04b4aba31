"""SCD type 2 history tables, kept by the consolidation from each table's changelog (how and at what
cost: docs/reading-the-lake.md).

A table named in ``history:`` gets a Delta table `lake.history_uri` with one row per version of a key
(`lake.scd2`), partitioned by ``_bucket``: in each bucket the current versions are in ``open-*`` files,
the closed ones in ``closed-*`` files that are only ever added (small ones merged, `COMPACT_FILES`).
The merge job folds a batch into it when it is at the changelog's committed frontier (`in_merge`,
`fold_merged`, `commit_merged`); else `keep_histories` catches it up from the changelog. Either way
the history commits after the table, with ``(stream, L)`` (``L``: the changelog's frontier): a
failure between them leaves it behind, the next run catches up, a re-run at ``L`` does nothing.
"""

from __future__ import annotations

import json
import time as _time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tidemark.consolidate import sparkhash
from tidemark.consolidate.log_evolution import UNREAD, evolve_log_schema, log_type_change
from tidemark.consolidate.plan import phase
from tidemark.errors import ConsolidateError
from tidemark.lake import (changelog_uri, committed_frontier, data_files, exact_schema, filesystem, history_uri,
                           lake_schema, open_delta, strip_scheme, table_info, table_uri, writer as _commit)
from tidemark.lake.delta import conform, log_files, missing_values, tidemark_meta
from tidemark.lake.history import last_load
from tidemark.lake.layout import ddl_schema, effective_keys, file_stats, write_parquet
from tidemark.lake.scd2 import LOG_META, fold, history_schema, log_schema
from tidemark.pgtypes import TableSchema

GROUPS_DDL = "table string, bucket int"
# a bucket's closed-* files under this many rows are merged into one once there are COMPACT_FILES of
# them (with the batch's closed versions): a bucket holds few small files however many batches ran
COMPACT_ROWS = 262_144
COMPACT_FILES = 16
# a bucket's current versions (with a one-column integer key) are in open-* files of at most this many
# rows, each a range of keys: a batch rewrites only the files whose range its keys reach
OPEN_ROWS = 16_384
ACTIONS_DDL = ("table string, op string, path string, size long, rows long, stats string, partition string, "
               "problem string")


class HistoryError(ConsolidateError):
    """A history table cannot be kept (a keyless table, a changelog that contradicts it); names the table."""


@dataclass
class HistorySpec:
    """What the executors need of one table's history step (picklable)."""

    table: str
    uri: str                   # the history table
    options: Any
    data: Any                  # pyarrow schema: the data columns (the changelog's)
    keys: list[str]
    buckets: int
    lo: int                    # changelog rows with _time in [lo, hi)
    hi: int
    reset: int | None = None   # a full load at this LSN (its rows are the "base" sources)
    fill: dict = field(default_factory=dict)
    open_files: dict = field(default_factory=dict)   # bucket -> [relative paths of its open-* files]
    small_closed: dict = field(default_factory=dict)  # bucket -> [(path, size)] of its small closed-* files
    open_ranges: dict = field(default_factory=dict)   # bucket -> {path: (min key, max key)} of its open-* files
    open_counts: dict = field(default_factory=dict)   # bucket -> {path: rows} of its open-* files
    open_rows: int = OPEN_ROWS                        # `OPEN_ROWS` as the driver read it
    compact_files: int = 16                           # `COMPACT_FILES` as the driver read it
    load_version: int | None = None                   # the table version of the last full load applied
    tag: str = ""
    restart: bool = False      # a column changed type at the load ``reset``: the history starts again there


# the key types whose history rows have been bucketed by Spark's hash since histories began (the others
# by CRC-32: `_bucket_of`); kept so, so that every history table keeps its rows where it put them
SPARK_HASHED_KINDS = ("int", "long", "decimal", "string", "binary")


def _spark_hashed(schema, keys: list[str]) -> bool:
    return bool(keys) and all(sparkhash.kind(schema.field(k).type) in SPARK_HASHED_KINDS for k in keys)


def _bucket_of(t, keys: list[str], n: int):
    """The bucket of each row: Spark's ``pmod(xxhash64(keys), n)`` for the key types of
    `SPARK_HASHED_KINDS`, else a CRC-32 of the keys' text (stable across runs: the history only
    needs one rule)."""
    if _spark_hashed(t.schema, keys):
        return sparkhash.buckets(t, keys, n)
    cols = [t.column(k).to_pylist() for k in keys]
    return np.array([zlib.crc32(repr(tuple(c[i] for c in cols)).encode()) % n for i in range(t.num_rows)],
                    np.int32)


def _read_sources(spec: HistorySpec, sources: list[tuple[str, str]], mine: set[int]):
    """{bucket: (changelog rows, loaded rows)} of the buckets in ``mine``: the table's changelog
    files (``log``: their rows with ``_time`` in ``[lo, hi)``) and, at a full load, the loaded
    version's files (``base``), conformed to the data columns and hashed to their buckets."""
    fs = filesystem(spec.uri, spec.options)
    logs_schema = log_schema(spec.data)
    got: dict[str, dict[int, list]] = {"log": {}, "base": {}}
    for kind, path in sources:
        with fs.open_input_file(path) as f:
            t = pq.ParquetFile(f, pre_buffer=True).read()
        if kind == "log":
            t = t.filter(pc.and_(pc.greater_equal(t.column("_time"), spec.lo), pc.less(t.column("_time"), spec.hi)))
        if not t.num_rows:
            continue
        t = conform(t, logs_schema if kind == "log" else spec.data, spec.fill)
        b = _bucket_of(t, spec.keys, spec.buckets)
        for bucket in np.unique(b).tolist():
            if bucket in mine:
                got[kind].setdefault(bucket, []).append(t.filter(pa.array(b == bucket)))
    out = {}
    for bucket in mine:
        logs, bases = got["log"].get(bucket, []), got["base"].get(bucket, [])
        out[bucket] = (pa.concat_tables(logs) if logs else logs_schema.empty_table(),
                       (pa.concat_tables(bases) if bases else spec.data.empty_table())
                       if spec.reset is not None else None)
    return out


def run_buckets(batches, specs: dict[str, HistorySpec], sources: dict[str, list[tuple[str, str]]]):
    """``mapInArrow`` body: (table, bucket) rows in; for each table, its sources read once
    (`_read_sources`: a batch's changelog is small, each task reads it and keeps its own buckets'
    rows), then each bucket folded and written (`merge_bucket`); file actions out. One stage, no
    shuffle."""

    todo: dict[str, set[int]] = {}
    for batch in batches:
        for table, bucket in zip(batch.column("table").to_pylist(), batch.column("bucket").to_pylist()):
            todo.setdefault(table, set()).add(int(bucket))
    for table, mine in todo.items():
        spec = specs[table]
        rows = _read_sources(spec, sources.get(table, []), mine)
        for bucket in sorted(mine):
            log, base = rows[bucket]
            if not log.num_rows and base is None:
                continue          # nothing of the batch in this bucket: its files stay as they are
            out = merge_bucket(spec, bucket, log, base)
            if out.num_rows:
                yield from out.to_batches()


def merge_bucket(spec: HistorySpec, bucket: int, log, base):
    """One bucket of one table: fold its changelog rows (and loaded rows) with its open versions
    (`scd2.fold`), write its new open file and its closed file into the history table; return the
    file actions (an Arrow table, `ACTIONS_DDL`)."""
    hs = history_schema(spec.data)
    fs = filesystem(spec.uri, spec.options)
    root = strip_scheme(spec.uri).rstrip("/")

    def read(path):
        with fs.open_input_file(root + "/" + path) as f:
            return conform(pq.ParquetFile(f, pre_buffer=True).read(), hs, spec.fill)

    def act(op, path=None, size=None, rows=None, stats=None, problem=None):
        return {"table": spec.table, "op": op, "path": path, "size": size, "rows": rows, "stats": stats,
                "partition": None if problem else str(bucket), "problem": problem}

    old = spec.open_files.get(bucket, [])
    if base is None:          # the open files the batch's keys reach (a load compares every version)
        old = _reached(spec, bucket, old, log)
    open_rows = pa.concat_tables([read(p) for p in old]) if old else hs.empty_table()
    kept, opened, new_closed, problem = fold(open_rows, log, spec.keys, hs, base=base, reset=spec.reset)
    if problem is not None:
        return pa.Table.from_pylist([act("problem", problem=problem)], schema=ddl_schema(ACTIONS_DDL))
    if not opened.num_rows and not new_closed.num_rows and kept.num_rows == open_rows.num_rows:
        return ddl_schema(ACTIONS_DDL).empty_table()
    rows = [act("remove", p) for p in old]
    new_open = pa.concat_tables([kept, opened]) if opened.num_rows else kept
    small = spec.small_closed.get(bucket, [])
    if new_closed.num_rows and len(small) + 1 >= spec.compact_files:
        new_closed = pa.concat_tables([new_closed] + [read(p) for p, _ in small])
        rows += [act("remove", p, size) for p, size in small]
    kept_files = [p for p in spec.open_files.get(bucket, []) if p not in old]
    outs = [("open", t) for t in _open_chunks(spec, new_open, [spec.open_ranges.get(bucket, {}).get(p)
                                                                for p in kept_files])]
    fs.create_dir(root + f"/_bucket={bucket}", recursive=True)
    for prefix, t in outs + [("closed", new_closed)]:
        if not t.num_rows:
            continue
        rel = f"_bucket={bucket}/{prefix}-{spec.tag}-{uuid.uuid4().hex[:12]}.parquet"
        size = write_parquet(t, root + "/" + rel, fs)
        stats = file_stats(t, spec.keys) if prefix == "open" and _ranged(spec) else \
            json.dumps({"numRecords": t.num_rows})
        rows.append(act("add", rel, size, t.num_rows, stats))
    return pa.Table.from_pylist(rows, schema=ddl_schema(ACTIONS_DDL))


def _ranged(spec: HistorySpec) -> bool:
    """Whether the table's open files are kept as key ranges (a one-column integer key)."""
    return len(spec.keys) == 1 and spec.keys[0] in spec.data.names \
        and pa.types.is_signed_integer(spec.data.field(spec.keys[0]).type)


def _reached(spec: HistorySpec, bucket: int, paths: list[str], log) -> list[str]:
    """The bucket's open files that the changelog rows ``log`` reach: each file whose key range holds
    one of their keys (a key's open version is in such a file) and, for a key no file's range holds
    (a new key), the file of the range just below it (the lowest one if none) when that file is
    small (under a quarter of ``spec.open_rows``): new keys fill a small file instead of adding one
    each batch, and never make a batch rewrite a full file (keys appended past the top of a table's
    range cost a small file's rewrite, not its last full one's). Every file when the ranges are
    not known (other keys, files written before they were kept)."""
    ranges = spec.open_ranges.get(bucket, {})
    if not paths or not _ranged(spec) or any(p not in ranges for p in paths):
        return paths
    keys = np.unique(log.column(spec.keys[0]).drop_null().to_numpy())
    if not len(keys):
        return []
    lo = np.array([ranges[p][0] for p in paths], np.int64)
    hi = np.array([ranges[p][1] for p in paths], np.int64)
    keys = keys.astype(np.int64)
    reached = (np.searchsorted(keys, hi, side="right") - np.searchsorted(keys, lo, side="left")) > 0
    inside = np.zeros(len(keys), bool)
    for a, b in zip(lo.tolist(), hi.tolist()):
        inside |= (keys >= a) & (keys <= b)
    if not inside.all():
        counts = spec.open_counts.get(bucket, {})
        small = np.array([(counts.get(p) or spec.open_rows) < spec.open_rows // 4 for p in paths], bool)
        order = np.argsort(lo, kind="stable")
        near = order[np.maximum(np.searchsorted(lo[order], keys[~inside], side="right") - 1, 0)]
        reached[near[small[near]]] = True
    return [p for p, r in zip(paths, reached.tolist()) if r]


def _open_chunks(spec: HistorySpec, rows, kept: list) -> list:
    """A bucket's new open versions as the open files to write: with key ranges (`_ranged`), sorted
    by the key, cut at the bounds of the open files left in place (``kept``: their (min, max)) so no
    new file's range straddles theirs, and into files of at most ``spec.open_rows`` rows (rows that
    fit in one file as they are: that file, unsorted); else one file."""
    if not _ranged(spec) or not rows.num_rows:
        return [rows]
    key = spec.keys[0]
    bounds = np.array(sorted({v for r in kept if r is not None for v in r}), np.int64)
    if rows.num_rows <= spec.open_rows:
        values = rows.column(key).to_numpy().astype(np.int64)
        if not len(bounds) or len(np.unique(np.searchsorted(bounds, values, side="right"))) == 1:
            return [rows]          # one file: its range is its rows' (no need to sort them)
    rows = rows.sort_by([(key, "ascending")])
    values = rows.column(key).to_numpy().astype(np.int64)
    run = np.searchsorted(bounds, values, side="right") if len(bounds) else np.zeros(len(values), np.int64)
    cuts = np.r_[0, np.nonzero(np.diff(run))[0] + 1, len(values)]
    out = []
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        n = -(-(b - a) // spec.open_rows)
        size = -(-(b - a) // n)
        out += [rows.slice(a + i * size, min(size, b - a - i * size)) for i in range(n)]
    return out


# -- the driver ---------------------------------------------------------------------------------------

def _log_files(log_dt, log_uri: str, options, stream: str, lo: int | None) -> list[str]:
    """The changelog's data files (filesystem paths) that may hold rows at or past ``lo``: those its
    commits with a frontier past ``lo`` added (read from their Delta log entries), when every one of
    them is still current; else (or ``lo`` None) every current file (the executors filter by time)."""
    current = data_files(log_dt, log_uri)
    if lo is None:
        return current
    root = strip_scheme(log_uri).rstrip("/")
    versions = [h["version"] for h in _newer(log_dt, stream, lo)
                if (m := tidemark_meta(h, stream)) is not None and int(m["frontier"]) > lo]
    try:
        added = [root + "/" + unquote(path) for v in versions for kind, path, _ in log_files(log_uri, options, v)
                 if kind == "add"]
    except OSError:
        return current
    have = set(current) | {unquote(c) for c in current}
    if log_uri.startswith("s3://"):
        have |= {root + "/" + c.split(root + "/", 1)[-1] for c in current}
    if any(a not in have for a in added):
        return current
    return added


def _newer(dt, stream: str, lo: int) -> list[dict]:
    """The table's commits from the newest back to the first whose ``(stream, frontier)`` is at most
    ``lo`` (read a few at a time: a batch reads the last few commits, not the table's whole log)."""
    limit = 8
    while True:
        hist = sorted(dt.history(limit=limit), key=lambda h: -h["version"])
        for i, h in enumerate(hist):
            m = tidemark_meta(h, stream)
            if m is not None and int(m["frontier"]) <= lo:
                return hist[:i + 1]
        if len(hist) < limit:
            return hist
        limit *= 4


def _load_after(dt, stream: str, done: int | None, applied: int | None) -> tuple[int, int] | None:
    """(version, frontier) of the table's newest full load (a snapshot, a resend) that the history
    has not applied yet: ``done`` is the history's frontier (None: no history yet, so the newest
    load, or else the table's first Tidemark version), ``applied`` the table version of the last load
    it applied (its description's ``load_version``). A load at the history's own frontier counts."""
    if done is None:
        return last_load(dt, stream)
    for h in _newer(dt, stream, done - 1):
        m = tidemark_meta(h, stream)
        if m is not None and m.get("operation") == "snapshot" and int(m["frontier"]) >= done:
            if applied is None or h["version"] > applied:
                return h["version"], int(m["frontier"])
            return None
    return None


def _plan(cfg, table: str, options, *, upto: int | None = None, dt=None, log_dt=None
          ) -> tuple[HistorySpec, list[tuple[str, str]], Any] | None:
    """The history step of one table: (its spec, its source files, the history table as opened), or
    None when the history is at the changelog's frontier already (or there is nothing to keep yet).
    ``upto`` (the merge job's, `in_merge`): the changelog's rows up to ``upto`` are the batch's, not
    written yet: a spec for them (no source files) only when the history is at the changelog's
    committed frontier, else None; ``dt``/``log_dt``: the table and its changelog as opened."""
    from deltalake import DeltaTable

    stream = cfg.stream
    dt = dt if dt is not None else open_delta(table_uri(cfg, table), options)
    log_uri = changelog_uri(cfg, table)
    log_dt = log_dt if log_dt is not None else open_delta(log_uri, options)
    if dt is None or log_dt is None:
        return None
    hi = committed_frontier(log_dt, stream)
    uri = history_uri(cfg, table)
    hdt = open_delta(uri, options)
    done = committed_frontier(hdt, stream)
    if upto is not None:
        if hdt is None or hi is None or done != hi or upto <= hi:
            return None
        hi = upto
    if hi is None or (done is not None and done >= hi):
        return None
    info = table_info(dt)
    shape = TableSchema.from_json(info["table_schema"]) if info.get("table_schema") else None
    keys = effective_keys(shape) if shape is not None else []
    if not keys and cfg.history_all:
        return None          # ``history: all`` keeps the tables with a key
    if not keys:
        raise HistoryError(f"stream {stream} table {table}: it has no key (no primary key, or REPLICA IDENTITY "
                           "FULL), so it cannot have a history table; take it out of history: in the stream file")
    hdesc = json.loads(hdt.metadata().description or "{}") if hdt is not None else {}
    load = _load_after(dt, stream, done, hdesc.get("load_version"))
    load_version, reset = load if load is not None else (hdesc.get("load_version"), None)
    if reset is not None and reset > hi:
        return None          # the load's changelog commit is not there yet: the next run takes both
    exact = {f.name: f for f in exact_schema(dt)}
    logged = pa.schema(log_dt.schema().to_arrow())
    data = pa.schema([exact.get(f.name, f.with_nullable(True)) for f in logged if f.name not in LOG_META])
    buckets = int(hdesc.get("buckets") or cfg.consolidate.buckets)
    # a column whose type changed reached the history at a load that replaced the table (its changelog
    # restarted there, `log_evolution.log_type_change`): the history restarts at that load too (its Delta
    # table overwritten; the versions before stay in the Delta versions before it)
    restart = hdt is not None and reset is not None and log_type_change(hdt, history_schema(data)) is not None
    lo = done if done is not None and not restart else reset
    spec = HistorySpec(table=table, uri=uri, options=options, data=data, keys=keys, buckets=buckets, lo=lo, hi=hi,
                       reset=reset, fill=missing_values(info), tag=f"{hi:016X}", compact_files=COMPACT_FILES,
                       load_version=load_version, restart=restart, open_rows=OPEN_ROWS)
    ranged = _ranged(spec)
    if hdt is not None and not restart:
        for a in pa.table(hdt.get_add_actions(flatten=True)).to_pylist():
            b = int(a["partition._bucket"])
            if a["path"].rsplit("/", 1)[-1].startswith("open-"):
                spec.open_files.setdefault(b, []).append(a["path"])
                kmin, kmax = a.get(f"min.{keys[0]}"), a.get(f"max.{keys[0]}")
                if ranged and isinstance(kmin, int) and isinstance(kmax, int):
                    spec.open_ranges.setdefault(b, {})[a["path"]] = (kmin, kmax)
                    spec.open_counts.setdefault(b, {})[a["path"]] = a.get("num_records")
            elif (a.get("num_records") or 0) < COMPACT_ROWS:
                spec.small_closed.setdefault(b, []).append((a["path"], a["size_bytes"]))
    if upto is not None:
        return spec, [], hdt
    sources = [("log", p) for p in _log_files(log_dt, log_uri, options, stream, lo)]
    if reset is not None:
        sources += [("base", p) for p in data_files(DeltaTable(table_uri(cfg, table), version=load_version,
                                                                      storage_options=options),
                                                           table_uri(cfg, table))]
    return spec, sources, hdt


def keep_histories(cfg, spark, *, options=None, tables: list[str] | None = None,
                   start_spark=None) -> dict[str, int | None]:
    """Bring the history table of every table in ``cfg.history`` (or ``tables``) to its changelog's
    committed frontier, in one Spark job (see the module doc); {table: its new version} of those it
    committed. Idempotent: a re-run commits nothing. ``spark`` None: only the tables that need no
    Spark job (their changelog advanced without rows), unless ``start_spark`` (a callable returning a
    SparkSession) is given: it is called when a table needs Spark; else such a table waits for a run
    with Spark."""
    names = tables if tables is not None else [t.qualified for t in cfg.history]
    t0 = _time.perf_counter()
    planned = {}
    for table in names:
        got = _plan(cfg, table, options)
        if got is not None:
            planned[table] = got
    if not planned:
        return {}
    def needs_spark(p) -> bool:          # rows to read, or a load to compare with open versions
        return bool(p[1] or (p[0].reset is not None and p[0].open_files))

    if spark is None and start_spark is not None and any(needs_spark(p) for p in planned.values()):
        spark = start_spark()
    if spark is None:        # no Spark at hand: only the tables whose changelog advanced without rows
        planned = {t: p for t, p in planned.items() if not needs_spark(p)}
        if not planned:
            return {}
    phase("history: plan (driver: Delta logs)", _time.perf_counter() - t0)
    t0 = _time.perf_counter()
    specs = {t: p[0] for t, p in planned.items()}
    sources = {t: p[1] for t, p in planned.items()}
    # every bucket a change may reach (a load's: every bucket); tasks take a share of them each
    groups = [(t, b) for t, p in planned.items() if needs_spark(p) for b in range(p[0].buckets)]
    acts: list[dict] = []
    if groups:
        # a local relation is already cut into the default parallelism's partitions: no shuffle
        acts = (spark.createDataFrame(groups, GROUPS_DDL)
                .mapInArrow(lambda it: run_buckets(it, specs, sources), ACTIONS_DDL).toArrow().to_pylist())
    phase("history: fold buckets (Spark job)", _time.perf_counter() - t0)
    t0 = _time.perf_counter()
    problems = {a["table"]: a["problem"] for a in acts if a["op"] == "problem"}
    out: dict[str, int | None] = {}
    for table, (spec, _, hdt) in planned.items():
        mine = [a for a in acts if a["table"] == table and a["op"] in ("add", "remove")]
        if problems:
            _commit.discard_uncommitted(spec.uri, options, mine, stream=cfg.stream, frontier=spec.hi)
            continue
        out[table] = _commit_history(cfg, spec, hdt, mine, options)
    phase("history: commit (Delta)", _time.perf_counter() - t0)
    if problems:
        table = next(iter(problems))
        raise HistoryError(f"stream {cfg.stream} table {table}: history: {problems[table]}")
    return out


def _commit_history(cfg, spec: HistorySpec, hdt, mine: list[dict], options) -> int:
    """Commit one history table's file actions as one Delta version with ``(stream, spec.hi)`` (its
    schema extended first by the columns the changelog gained); the files go on a failure."""
    hs = history_schema(spec.data)
    if hdt is not None and not spec.restart:   # a column added to the changelog: added to the history too
        hdt = evolve_log_schema(spec.uri, options, hdt, hs, spec.table)
        hs = lake_schema(hdt)
    desc = json.dumps({"tidemark_history": spec.table, "stream": cfg.stream, "keys": spec.keys,
                       "buckets": spec.buckets, "load_version": spec.load_version}, sort_keys=True)
    with _commit.discard_on_failure(spec.uri, options, mine, stream=cfg.stream, frontier=spec.hi):
        return _commit.commit_files(spec.uri, options, hdt, hs, mine, stream=cfg.stream, frontier=spec.hi,
                                    desc=desc, overwrite=spec.restart,
                                    operation="history_restart" if spec.restart else "history")


# -- in the merge job ------------------------------------------------------------------------------------

def in_merge(cfg, p, options) -> tuple[HistorySpec, Any] | None:
    """(the spec, the history table as opened) when the merge job can fold the batch's changelog
    rows of table ``p`` (`prepare.Prepared`) into its history in the same tasks (`fold_merged`): the
    history is at the changelog's committed frontier, which is the batch's lower bound, no full load
    is waiting for it, its buckets are the table's (same hash, same key, as many buckets) and each
    column of the table is in it at the same type. Else None (`keep_histories` catches it up)."""
    if p.replay or p.log_plan is None or p.log_plan.lo != p.lower or not p.keys \
            or not any(ref.qualified == p.table for ref in cfg.history):     # its history is not kept
        return None
    log_dt = p.log_dt if p.log_dt is not UNREAD else None
    got = _plan(cfg, p.table, options, upto=p.frontier, dt=p.dt, log_dt=log_dt)
    if got is None:
        return None
    spec, _, hdt = got
    if spec.reset is not None or spec.restart or spec.lo != p.lower or spec.buckets != p.buckets \
            or list(spec.keys) != list(p.keys) or not _spark_hashed(p.target, list(p.keys)):
        return None
    data = {f.name: f.type for f in spec.data}
    if any(data.get(f.name) != f.type for f in p.target):
        return None
    return spec, hdt


def fold_merged(spec: HistorySpec, log) -> list[dict]:
    """In a merge task: fold the group's exact changelog rows (every change of its buckets in the
    batch, in `scd2.log_schema`) into the history buckets they reach (`merge_bucket`); file actions out
    (``op`` "history_problem" when the changelog contradicts the history: then nothing is committed)."""
    if log is None or not log.num_rows:
        return []
    log = conform(log, log_schema(spec.data), spec.fill)
    b = _bucket_of(log, spec.keys, spec.buckets)
    out = []
    for bucket in np.unique(b).tolist():
        got = merge_bucket(spec, int(bucket), log.filter(pa.array(b == bucket)), None)
        out += [{**a, "op": "history_problem" if a["op"] == "problem" else a["op"]} for a in got.to_pylist()]
    return out


def commit_merged(cfg, spec: HistorySpec, hdt, acts: list[dict], options) -> int | None:
    """After the table's commit: commit the history files its merge tasks wrote (`fold_merged`) with
    ``(stream, F)``; a problem they met commits nothing and removes the files (None: `keep_histories`
    then reads the changelog and names it)."""
    mine = [a for a in acts if a["op"] in ("add", "remove")]
    if any(a["op"] == "history_problem" for a in acts):
        _commit.discard_uncommitted(spec.uri, options, mine, stream=cfg.stream, frontier=spec.hi)
        return None
    return _commit_history(cfg, spec, hdt, mine, options)
