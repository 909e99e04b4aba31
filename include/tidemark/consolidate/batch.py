"""The batch path: every ordinary table of a batch in ONE Spark job, merged bucket by bucket in Arrow.

The per-table path (`job._Job.consolidate_table`) builds each table's exact changelog, TOAST
resolution and net effect as DataFrame plans: a dozen Spark jobs and several shuffles per table,
whatever the batch's size. Most batches need none of that machinery: when a keyed table's changes
hold no truncate, keep the lake's shape and load no snapshot, and every ``+1`` either carries all its
values or leaves TOAST values unchanged in an update that kept its key, each key's records and its
lake row live in one bucket, so one pass per bucket gives everything:

1. each table's updates reach the merge as Arrow IPC parts per bucket (Spark's ``xxhash64`` of the
   key, computed in Arrow by `sparkhash`): as the decoding cut them (`splits`: the lake table's
   shape, key and buckets, given to the decoding; the shuffle then moves them as they are), else
   expanded and packed in a Python step (`pack_tables`; a segment of another shape, a table the
   stream does not list), else bucketed by Spark where `sparkhash` lacks the key's types;
2. the parts are grouped once by ``(table, bucket)``, or by table alone for a small table with few
   changes (`WHOLE_TABLE_RECORDS`: one Python call instead of one per bucket); `merge_bucket` (an
   ``applyInArrow`` body) keeps each part's records in ``[lower, frontier)`` in the table's schema,
   dedupes them, reads only each bucket's files that may hold the changed keys, gives every record
   its full image column by column (its own value, else the key's latest known value earlier in
   the batch, else the lake row's: unchanged TOAST values are filled so), pre-consolidates them per
   ``(data, time)`` into the exact changelog, writes each bucket's new files and returns their
   actions with the changelog rows;
3. the driver commits each table as the per-table path does (`changelog.commit_changelog`, then
   `commit.commit_files` with the app transaction ``(stream, F)``).

The semantics are the per-table path's: a group that meets a case it does not handle (a record
whose previous image is missing, an old image with unchanged TOAST values, unchanged TOAST values in
an update that changed the key) writes nothing and says so; its table's files from this attempt are
deleted and the table goes through the per-table path, which raises or handles it exactly as before.
"""

from __future__ import annotations

import json
import time as _time
from dataclasses import dataclass, field
from typing import Any

from tidemark.consolidate import layout, sparkhash
from tidemark.consolidate.changelog import _UNREAD
from tidemark.consolidate.decode import (META_CTS, META_DIFF, META_FULL, META_POS, META_TIME, META_UNKNOWN,
                                         meta_arrow_fields)

OUT_DDL = ("table string, target string, op string, path string, size long, rows long, stats string, "
           "partition string, bucket int, time long, count long, log binary, problem string, cdc binary")
PACK_DDL = "table string, bucket int, part binary"
META_BUCKET = "_tm_bucket"           # a record's bucket, beside the meta columns (`decode.META_COLUMNS`)

# seconds per phase of the last run, and Spark jobs started (benchmarks print them)
PHASES: dict[str, float] = {}


def enabled() -> bool:
    """The batch path is on unless ``TIDEMARK_CONSOLIDATE_PATH=table`` (benchmarks compare both)."""
    import os

    return os.environ.get("TIDEMARK_CONSOLIDATE_PATH", "batch") != "table"


def phase(name: str, seconds: float) -> None:
    PHASES[name] = PHASES.get(name, 0.0) + seconds


@dataclass
class TablePlan:
    """What the executors need to merge one table's buckets (picklable)."""

    table: str
    bucket_plan: layout.BucketPlan
    values: list[str]
    lower: int
    frontier: int
    full: Any = None                 # pyarrow schema: meta columns + the table's columns
    log: "LogPlan | None" = None     # where the executors write the table's changelog (None: committed already)


@dataclass
class LogPlan:
    """Where a merge group writes its changelog rows with ``time >= lo``: Parquet files into the
    changelog Delta table's directory, CDC updates as container blocks framed with ``sync`` into the
    landing store under ``parts`` (`changelog.Written`); the driver commits and frames them."""

    uri: str
    lo: int
    sync: bytes
    parts: str
    store: tuple                     # (url, endpoint_url, region) of the landing store


@dataclass
class Prepared:
    table: str
    uri: str
    dt: Any
    shape: Any
    target: Any
    keys: list[str]
    lower: int
    buckets: int
    lake_at: int | None = None       # the lake table's committed frontier for the stream, as read
    log_dt: Any = _UNREAD            # its changelog Delta table (None: none yet), once opened
    log_plan: Any = None             # `LogPlan`: where the executors write its changelog (None: committed)


@dataclass
class Outcome:
    done: dict[str, tuple[int, int | None]] = field(default_factory=dict)    # table -> (rows changed, version)
    fallback: list[str] = field(default_factory=list)


def splits(cfg, options) -> tuple[dict, dict]:
    """({table: `decode.Split`}, {table: its Delta table or None}) for the stream's tables: how the
    decoding cuts each table's updates by the lake's buckets (its shape, hashed columns and bucket
    count as `eligible` reads them), and the tables as opened, for `eligible` to reuse."""
    from tidemark.consolidate.decode import Split
    from tidemark.consolidate.job import effective_keys
    from tidemark.lake import table_info, table_uri
    from tidemark.pgtypes import TableSchema

    out = {}
    opened = _open_all({ref.qualified: table_uri(cfg, ref.qualified) for ref in cfg.source.tables}, options)
    for table, dt in opened.items():
        info = table_info(dt) if dt is not None else {}
        if not info.get("table_schema"):
            continue
        shape = TableSchema.from_json(info["table_schema"])
        out[table] = Split(json.dumps(shape.to_json(), sort_keys=True),
                           tuple(effective_keys(shape) or [c.name for c in shape.columns]),
                           int(info.get("buckets") or cfg.consolidate.buckets))
    return out, opened


def _open_all(uris: dict[str, str], options) -> dict:
    """{name: its Delta table or None} for ``{name: uri}``, opened a few at a time (``deltalake``
    reads each log without the GIL; on S3 each open is several requests)."""
    from concurrent.futures import ThreadPoolExecutor

    from tidemark.lake import open_delta

    if len(uris) < 2:
        return {name: open_delta(uri, options) for name, uri in uris.items()}
    with ThreadPoolExecutor(COMMIT_THREADS, thread_name_prefix="tidemark-open") as pool:
        return dict(zip(uris, pool.map(lambda uri: open_delta(uri, options), uris.values())))


def eligible(job, table: str, frontier: int, loadable) -> Prepared | None:
    """The table's batch-path preparation, or None when the per-table path must take it (snapshot to
    load, truncate, a new or changed shape, no lake table yet)."""
    from tidemark.consolidate.job import effective_keys
    from tidemark.lake import committed_frontier, open_delta, table_info, table_uri
    from tidemark.pgtypes import TableSchema, arrow_schema

    uri = table_uri(job.cfg, table)
    opened = getattr(job, "lake_tables", {})   # opened before decoding (`splits`); nothing committed since
    dt = opened.pop(table) if table in opened else open_delta(uri, job.options)
    if dt is None:
        return None
    info = table_info(dt)
    if not info.get("table_schema"):
        return None
    done = lake_at = committed_frontier(dt, job.cfg.stream)
    snap = next((s for s in reversed(loadable) if table in s.tables), None)
    if snap is not None:
        if done is None or done < snap.lsn:
            return None
        job._loaded[(table, snap.snapshot_id)] = True
        done = max(done, snap.lsn)
    lower = max(job.start, done or 0)
    if lower >= frontier:
        return Prepared(table, uri, dt, None, None, [], lower, 0)       # nothing to do
    shapes = [r for r in job.shapes if r["table"] == table and r["time"] >= lower]
    if any(e["table"] == table and lower <= e["time"] < frontier for e in job.events):
        return None
    if not shapes:
        return Prepared(table, uri, dt, None, None, [], lower, 0)
    lake_json = info["table_schema"]
    if any(TableSchema.from_json(json.loads(info)).to_json() != lake_json for info in {r["info"] for r in shapes}):
        return None
    shape = TableSchema.from_json(lake_json)
    keys = effective_keys(shape)
    buckets = int(info.get("buckets") or job.cfg.consolidate.buckets)
    return Prepared(table, uri, dt, shape, arrow_schema(shape), keys, lower, buckets, lake_at)


def consolidate_tables(job, tables: list[str], frontier: int, loadable) -> Outcome:
    """Bring ``tables`` to ``frontier``: the eligible ones in one Spark job, the rest listed in
    ``fallback`` for the per-table path."""
    out = Outcome()
    prepared: dict[str, Prepared] = {}
    t0 = _time.perf_counter()
    for table in tables:
        p = eligible(job, table, frontier, loadable)
        if p is None:
            out.fallback.append(table)
        elif p.shape is None:
            out.done[table] = (0, None)
        else:
            prepared[table] = p
    phase("plan tables (driver)", _time.perf_counter() - t0)
    if not prepared:
        return out
    t0 = _time.perf_counter()
    import uuid

    from tidemark.lake import changelog_uri

    # the changelog tables first: where each one's committed range ends says what the executors write
    logs = _open_all({t: changelog_uri(job.cfg, t) for t in prepared}, job.options)
    for table, p in prepared.items():
        p.log_dt = logs[table]
    phase("open changelogs (driver)", _time.perf_counter() - t0)
    t0 = _time.perf_counter()
    run = uuid.uuid4().hex[:12]
    acts = _merge(job, prepared, frontier, run)
    phase("merge buckets (Spark job)", _time.perf_counter() - t0)
    ready = {}
    for table, p in prepared.items():
        mine = [a for a in acts if a["table"] == table]
        if any(a["op"] == "problem" for a in mine):
            from tidemark.consolidate import commit as _commit
            from tidemark.consolidate.job import log

            log.info("table %s: %s; the per-table path takes it", table,
                     next(a["problem"] for a in mine if a["op"] == "problem"))

            _commit.discard_uncommitted(p.uri, job.options, [a for a in mine if a["target"] == "table"],
                                        stream=job.cfg.stream, frontier=frontier)
            _commit.discard_uncommitted(changelog_uri(job.cfg, table), job.options,
                                        [a for a in mine if a["target"] == "changelog"],
                                        stream=job.cfg.stream, frontier=frontier)
            out.fallback.append(table)
            continue
        ready[table] = mine
    out.done.update(_commit_tables(job, prepared, ready, frontier, run))
    return out


COMMIT_THREADS = 4
# a table with at most this many records in the batch and rows in the lake is merged in one group,
# not one per bucket
WHOLE_TABLE_RECORDS = 20_000
WHOLE_TABLE_LAKE_ROWS = 250_000


def _commit_tables(job, prepared: dict[str, Prepared], ready: dict[str, list[dict]], frontier: int,
                   run: str) -> dict:
    """Commit each merged table (`_commit_table`), several at once: a table's commits wait on storage
    and on ``deltalake`` (which releases the GIL), so a batch of many small tables costs a fraction of
    their sum. Every commit is let finish before a failure is raised: the one of the first failed
    table in batch order, named in ``job.committing`` (the tables committed meanwhile are ahead of
    the stream frontier, as after a failure on the sequential path; a retry skips them)."""
    from concurrent.futures import ThreadPoolExecutor

    from tidemark.landing.store import open_store

    if not ready:
        return {}
    cfg = job.cfg
    store = open_store(cfg.landing.url, endpoint_url=cfg.landing.endpoint_url, region=cfg.landing.region)
    if len(ready) == 1:
        (table, acts), = ready.items()
        job.committing = table        # a failure from here on names this table (`job._Where`)
        done = {table: _commit_table(job, prepared[table], acts, frontier, store, run)}
        job.committing = None
        return done
    t0 = _time.perf_counter()
    with ThreadPoolExecutor(min(COMMIT_THREADS, len(ready)), thread_name_prefix="tidemark-commit") as pool:
        futures = {t: pool.submit(_commit_table, job, prepared[t], acts, frontier, store, run, timed=False)
                   for t, acts in ready.items()}
    phase(f"commit tables (changelog + Delta, {min(COMMIT_THREADS, len(ready))} threads)",
          _time.perf_counter() - t0)
    for table, fut in futures.items():
        if fut.exception() is not None:
            job.committing = table
            raise fut.exception()
    return {t: fut.result() for t, fut in futures.items()}


def _merge(job, prepared: dict[str, Prepared], frontier: int, run: str) -> list[dict]:
    """The one Spark job: each table's parts per bucket (as decoded, else `pack_tables`, else bucketed
    by Spark), grouped by (table, bucket), merged; actions to the driver."""
    import pyarrow as pa
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    from tidemark.consolidate import transform as T
    from tidemark.consolidate.decode import expand_partition

    plans: dict[str, TablePlan] = {}
    specs: dict[str, PackSpec] = {}
    parts = []
    for table, p in prepared.items():
        full = pa.schema(meta_arrow_fields() + list(p.target))
        sort = layout.sort_columns(p.target, p.keys)
        bplan = layout.BucketPlan(table=table, uri=p.uri, options=job.options, schema=p.target, keys=p.keys,
                                  sort=sort, files=layout.file_index(p.dt, sort), target_rows=job.target_rows,
                                  tag=layout.plan_tag(frontier))
        p.log_plan = _log_plan(job, p, frontier, run)
        plans[table] = TablePlan(table, bplan, [c for c in p.target.names if c not in p.keys], p.lower, frontier,
                                 full, p.log_plan)
        hashed = p.keys or list(p.target.names)
        if sparkhash.supported(p.target, hashed):
            specs[table] = PackSpec(full, hashed, p.buckets, p.lower, frontier)
            continue
        # a key type the Arrow hash does not cover: Spark computes the bucket (a round trip through the JVM)
        rows = job.decoded.filter((F.col("kind") == "data") & (F.col("table") == table) & (F.col("time") >= p.lower))
        expanded = rows.select("payload").mapInArrow(lambda it, full=full, table=table:
                                                     expand_partition(it, full, table),
                                                     from_arrow_schema(full, prefer_timestamp_ntz=True))
        expanded = T.in_range(expanded, p.lower, frontier)
        bucketed = T.with_bucket(expanded, hashed, p.buckets)
        parts.append(bucketed.mapInArrow(lambda it, table=table: pack_partition(it, table), PACK_DDL))
    # tables whose updates the decoding already cut by bucket (`splits`): shuffled as they are
    cut = sorted(t for t in specs if _cut_by_bucket(job, prepared[t], specs[t]))
    if cut:
        rows = job.decoded.filter((F.col("kind") == "data") & F.col("table").isin(cut)
                                  & (F.col("time") >= min(specs[t].lower for t in cut)))
        parts.append(rows.select("table", "bucket", F.col("payload").alias("part")))
    specs = {t: s for t, s in specs.items() if t not in cut}
    if specs:
        rows = (job.decoded.filter((F.col("kind") == "data") & F.col("table").isin(sorted(specs))
                                   & (F.col("time") >= min(s.lower for s in specs.values())))
                .select("table", "time", "payload"))
        parts.append(rows.mapInArrow(lambda it: pack_tables(it, specs), PACK_DDL))
    packed = parts[0]
    for part in parts[1:]:
        packed = packed.unionByName(part)
    # an explicit partition count: adaptive execution would coalesce a small batch's shuffle into ONE task
    # (one core merging every bucket); a repartition by number is kept, and the grouping reuses it
    from tidemark.consolidate.job import default_parallelism

    n_parts = max(2, default_parallelism(job.spark))
    # a small table with few changes is merged in ONE group (its buckets' files are still written per
    # bucket): each group costs a Python call that sorts, joins, builds the changelog and encodes it,
    # whatever its size, so a batch of many small tables would otherwise pay that once per bucket. A
    # big table's buckets stay apart: rewriting their files is the work, and it is spread over the cores
    whole = sorted(t for t, p in prepared.items() if _records(job, p) <= WHOLE_TABLE_RECORDS
                   and sum(f["rows"] or 0 for fs in plans[t].bucket_plan.files.values() for f in fs)
                   <= WHOLE_TABLE_LAKE_ROWS)
    group = F.when(F.col("table").isin(whole), F.lit(0)).otherwise(F.col("bucket")) if whole else F.col("bucket")
    result = (packed.withColumn("group", group).repartition(n_parts, "table", "group").groupBy("table", "group")
              .applyInArrow(lambda t: merge_bucket(plans, t), OUT_DDL).toArrow())
    return result.to_pylist()


def _log_plan(job, p: Prepared, frontier: int, run: str) -> LogPlan | None:
    """Where the table's merge groups write its changelog (None: committed to ``frontier`` already)."""
    import os

    from tidemark.consolidate.changelog import parts_prefix
    from tidemark.lake import changelog_uri, committed_frontier

    done = committed_frontier(p.log_dt, job.cfg.stream)
    if done is not None and done >= frontier:
        return None
    land = job.cfg.landing
    return LogPlan(uri=changelog_uri(job.cfg, p.table), lo=p.lower if done is None else max(p.lower, done),
                   sync=os.urandom(16), parts=parts_prefix(job.cfg.stream, p.table, run),
                   store=(land.url, land.endpoint_url, land.region))


def _records(job, p: Prepared) -> int:
    """At most how many records of the table the batch merges (the decoded parts' rows at or after
    its lower bound; a part may also hold older ones)."""
    return sum(r["position"] or 0 for r in job.shapes if r["table"] == p.table and r["time"] >= p.lower)


def _cut_by_bucket(job, p: Prepared, spec) -> bool:
    """Whether every ``data`` row of the table at or after its lower bound was cut by its buckets
    while decoding (the same shape, hashed columns and bucket count as the merge's)."""
    split = getattr(job, "splits", {}).get(p.table)
    if split is None or split.buckets != spec.buckets or list(split.hashed) != list(spec.hashed) \
            or split.shape != json.dumps(p.shape.to_json(), sort_keys=True):
        return False
    return all(r["bucket"] is not None for r in job.shapes if r["table"] == p.table and r["time"] >= p.lower)


@dataclass
class PackSpec:
    """What `pack_tables` needs of one table (picklable)."""

    full: Any                 # pyarrow schema: meta columns + the table's columns
    hashed: list[str]         # the bucket's columns: the key, or every column of a table without one
    buckets: int
    lower: int
    frontier: int


def pack_tables(batches, specs: dict[str, PackSpec], flush_rows: int = 500_000):
    """``mapInArrow`` body: decoded ``data`` rows (table, time, payload) of any tables in; per table, its
    changes in ``[lower, frontier)``, given their bucket in Arrow (`sparkhash`, equal to Spark's) and
    packed as `pack_partition` does, out. One Python step for every table, and no changed row crosses
    into the JVM before the shuffle."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from tidemark.consolidate import sparkhash
    from tidemark.consolidate.decode import conform_payload

    pending: dict[str, list] = {}
    counts: dict[str, int] = {}
    for batch in batches:
        for table, newest, payload in zip(batch.column("table").to_pylist(), batch.column("time").to_pylist(),
                                          batch.column("payload").to_pylist()):
            spec = specs[table]
            if newest < spec.lower:
                continue
            part = conform_payload(pa.ipc.open_stream(payload).read_all(), spec.full, table)
            t = part.column(META_TIME)
            part = part.filter(pc.and_(pc.greater_equal(t, spec.lower), pc.less(t, spec.frontier)))
            if not part.num_rows:
                continue
            part = part.append_column("_bucket", pa.array(sparkhash.buckets(part, spec.hashed, spec.buckets)))
            pending.setdefault(table, []).extend(part.to_batches())
            counts[table] = counts.get(table, 0) + part.num_rows
            if counts[table] >= flush_rows:
                yield _pack(pending.pop(table), table)
                counts[table] = 0
    for table, held in pending.items():
        if held:
            yield _pack(held, table)


def pack_partition(batches, table: str, flush_rows: int = 500_000):
    """``mapInArrow`` body: typed rows with ``_bucket`` in, one Arrow IPC part per bucket out (per
    ``flush_rows`` rows of the partition, so a part is big and memory stays bounded)."""
    pending, n = [], 0
    for batch in batches:
        if batch.num_rows:
            pending.append(batch)
            n += batch.num_rows
        if n >= flush_rows:
            yield _pack(pending, table)
            pending, n = [], 0
    if pending:
        yield _pack(pending, table)


def _pack(batches, table: str):
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    t = pa.Table.from_batches(batches)
    t = t.take(pc.sort_indices(t.column("_bucket")))
    buckets = t.column("_bucket").to_numpy()
    data = t.drop_columns(["_bucket"])
    starts = np.r_[0, np.nonzero(np.diff(buckets))[0] + 1]
    ends = np.r_[starts[1:], len(buckets)]
    parts = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, data.schema) as w:
            w.write_table(data.slice(a, b - a))
        parts.append(sink.getvalue().to_pybytes())
    return pa.RecordBatch.from_pydict({"table": [table] * len(parts), "bucket": buckets[starts].tolist(),
                                       "part": parts},
                                      schema=pa.schema([("table", pa.string()), ("bucket", pa.int32()),
                                                        ("part", pa.binary())]))


def _out_schema():
    import pyarrow as pa

    return pa.schema([("table", pa.string()), ("target", pa.string()), ("op", pa.string()), ("path", pa.string()),
                      ("size", pa.int64()), ("rows", pa.int64()), ("stats", pa.string()), ("partition", pa.string()),
                      ("bucket", pa.int32()), ("time", pa.int64()), ("count", pa.int64()), ("log", pa.binary()),
                      ("problem", pa.string()), ("cdc", pa.binary())])


def _rows_out(table: str, actions: list[dict], log=None, problem: str | None = None, plan: TablePlan | None = None):
    """The group's result rows, file actions and counts only (never data): its table file actions,
    then, with ``log`` (its exact changelog rows), the actions of the changelog Parquet files it
    wrote for the times at or after ``plan.log.lo``, the key and size of its CDC part (the rows'
    Materialize CDC updates, `changelog.encode_updates`, as container blocks of the table's file,
    put in the landing store) and, in ``log``, the number of updates per time (int64 times, then
    int64 counts). Each group's rows hold whole keys (keyless: identical rows), so they are
    consolidated per ``(data, time)`` across the batch and the driver only frames the parts."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = [{**{k: a.get(k) for k in ("target", "op", "path", "size", "rows", "stats", "partition", "bucket",
                                       "time", "count")}, "table": table, "log": None, "problem": None}
            for a in actions]
    lp = plan.log if plan is not None else None
    if log is not None and lp is not None:
        log = log.filter(pc.greater_equal(log.column("_time"), lp.lo))
    if log is not None and lp is not None and log.num_rows:
        import uuid

        from tidemark.consolidate import avro_columns as AC
        from tidemark.consolidate.changelog import encode_updates, write_log_files
        from tidemark.landing.store import open_store

        tag = f"{plan.frontier:016X}-{uuid.uuid4().hex[:12]}"
        rows += [{**a, "table": table, "log": None, "problem": None, "bucket": None, "time": None, "count": None}
                 for a in write_log_files(lp.uri, plan.bucket_plan.options, log, tag=tag)]
        target = plan.bucket_plan.schema
        datums = encode_updates(target, log, log.column("_time"), log.column("_diff"))
        part = b"".join(AC.blocks(datums, lp.sync))
        url, endpoint, region = lp.store
        key = f"{lp.parts}{tag}.blocks"
        open_store(url, endpoint_url=endpoint, region=region).put(key, part)
        times, counts = np.unique(log.column("_time").to_numpy(), return_counts=True)
        rows.append({"table": table, "target": "cdc", "op": "part", "path": key, "size": len(part),
                     "count": len(datums), "log": times.astype(np.int64).tobytes() + counts.astype(np.int64).tobytes()})
    if problem is not None:
        rows.append({"table": table, "target": "table", "op": "problem", "problem": problem})
    return pa.Table.from_pylist(rows, schema=_out_schema())


def merge_bucket(plans: dict[str, TablePlan], group):
    """``applyInArrow`` body: one group of a table's buckets (`_merge`: one bucket, or all of a small
    table's) in as packed records; file actions and the group's exact changelog rows out (or a
    ``problem`` row and nothing written)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from tidemark.consolidate.decode import conform_payload

    table = group.column("table")[0].as_py()
    plan = plans[table]
    # a part is packed (`pack_tables`) or as decoded (`decode.Split`): in the table's schema now, and
    # only the records in [lower, frontier), each with its part's bucket
    parts = [conform_payload(pa.ipc.open_stream(b).read_all(), plan.full, table)
             for b in group.column("part").to_pylist()]
    recs = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    rb = np.repeat(group.column("bucket").to_numpy(zero_copy_only=False).astype(np.int32),
                   [part.num_rows for part in parts])
    t = recs.column(META_TIME)
    keep = pc.and_(pc.greater_equal(t, plan.lower), pc.less(t, plan.frontier))
    recs = recs.filter(keep)
    if not recs.num_rows:
        return _rows_out(table, [])
    try:
        actions, log = merge_records(plan, rb[keep.to_numpy(zero_copy_only=False)], recs)
    except _Unhandled as exc:
        return _rows_out(table, [], problem=str(exc))
    return _rows_out(table, actions, log, plan=plan)


class _Unhandled(Exception):
    """A case the batch path leaves to the per-table path."""


def merge_records(plan: TablePlan, bucket, recs):
    """Apply records (meta + table columns, any order, duplicates allowed) of one bucket (``bucket``
    an int) or of several (``bucket``: each record's, an int array): return (file actions, exact
    changelog rows in `changelog.log_schema`). Only the files are per bucket: a key's records are in
    one bucket, so the images, the changelog and the net effect are worked out for all at once."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from tidemark.consolidate.changelog import log_schema

    bp, keys = plan.bucket_plan, plan.bucket_plan.keys
    target = bp.schema
    recs = recs.append_column(META_BUCKET, pa.array(np.broadcast_to(np.asarray(bucket, np.int32), recs.num_rows)))
    if not keys:
        return _insert_only(plan, recs)
    # dedupe by record identity and order each key's records by (time, position)
    recs = recs.sort_by([(k, "ascending") for k in keys] + [(META_TIME, "ascending"), (META_POS, "ascending")])
    n = recs.num_rows
    t_np = recs.column(META_TIME).to_numpy()
    p_np = recs.column(META_POS).to_numpy()
    same_key = _same_as_previous(recs, keys)
    dup = same_key & np.r_[False, (t_np[1:] == t_np[:-1]) & (p_np[1:] == p_np[:-1])]
    if dup.any():
        recs = recs.filter(pa.array(~dup))
        t_np, p_np, same_key = t_np[~dup], p_np[~dup], same_key[~dup]
        same_key = _same_as_previous(recs, keys)
        n = recs.num_rows
    diff = recs.column(META_DIFF).to_numpy()
    full = recs.column(META_FULL).to_numpy(zero_copy_only=False)
    unknown = recs.column(META_UNKNOWN)
    unknown_len = pc.fill_null(pc.list_value_length(unknown), 0).to_numpy()
    if ((diff > 0) & ~full).any():
        raise _Unhandled("a +1 lacks values")
    if ((diff < 0) & full & (unknown_len > 0)).any():
        raise _Unhandled("an old image with unchanged TOAST values")
    # a +1 with unchanged TOAST values takes them from the row's previous image: only when the update
    # kept the key (its -1 is the record just before it, in this key's group); a key change is the
    # per-table path's (the previous image lives under another key, maybe in another bucket)
    toasted = (diff > 0) & (unknown_len > 0)
    if toasted.any():
        i = np.nonzero(toasted)[0]
        j = np.maximum(i - 1, 0)
        paired = (i > 0) & same_key[i] & (diff[j] < 0) & (t_np[j] == t_np[i]) & (p_np[j] == p_np[i] - 1)
        if not paired.all():
            raise _Unhandled("a +1 with unchanged TOAST values from an update that changed the key")
    # each bucket's files that may hold the changed keys, and the lake rows of those keys
    rb = recs.column(META_BUCKET).to_numpy()
    files, old, old_bucket = _bucket_files(bp, rb, recs.select(keys))
    # every record's image, column by column: its own value, else the key's latest known value earlier
    # in the batch, else the lake row's (a key image knows only the key; a +1 all but its unchanged TOAST)
    arange = np.arange(n)
    group_start = np.maximum.accumulate(np.where(~same_key, arange, 0))
    if unknown_len.any():
        flat = pc.list_flatten(unknown).to_numpy(zero_copy_only=False)
        parent = pc.list_parent_indices(unknown).to_numpy()
    sources = {}
    needs_lake = np.zeros(n, bool)
    for name in target.names:
        if name in keys:
            continue
        known = full.copy()
        if unknown_len.any():
            known[parent[flat == name]] = False
        src = np.maximum.accumulate(np.where(known, arange, -1))
        from_batch = src >= group_start
        sources[name] = (src, from_batch)
        needs_lake |= ~from_batch
    recs_keys = recs.select(keys)
    lake_idx = np.full(n, -1)
    if needs_lake.any() and old.num_rows:
        lake_idx[np.nonzero(needs_lake)[0]] = layout.key_lookup(recs_keys.filter(pa.array(needs_lake)),
                                                                old.select(keys), keys)
    if (needs_lake & (lake_idx < 0)).any():
        raise _Unhandled("a record's previous image is neither earlier in the batch nor in the lake")
    data = layout.conform(recs, target)
    lake_take = pa.array(np.where(needs_lake, lake_idx, 0), pa.int64())
    cols = []
    for f in target:
        if f.name in keys:          # a record's key is its own, wherever its other values come from
            cols.append(data.column(f.name))
            continue
        src, from_batch = sources[f.name]
        mine = data.column(f.name).take(pa.array(np.where(from_batch, src, 0), pa.int64()))
        if from_batch.all():
            cols.append(mine)
        else:
            cols.append(pc.if_else(pa.array(from_batch), mine, old.column(f.name).take(lake_take)))
    images = pa.Table.from_arrays(cols, schema=target)
    cts = recs.column(META_CTS).cast(pa.int64())
    log = images.append_column("_time", recs.column(META_TIME)).append_column("_diff", recs.column(META_DIFF)) \
                .append_column("_commit_ts", cts)
    log = _consolidate_log(log, keys, same_key, t_np)
    log = layout.conform(log.set_column(log.column_names.index("_commit_ts"), "_commit_ts",
                                        log.column("_commit_ts").cast(pa.timestamp("us", tz="UTC"))),
                         log_schema(target))
    # the net effect: each key's last record
    last = np.r_[~same_key[1:], True] if n else np.zeros(0, bool)
    final = images.filter(pa.array(last))
    up = diff[last] > 0
    old_hit = layout.key_lookup(old.select(keys), final.select(keys), keys)
    return _write_buckets(bp, files, old, old_bucket, old_hit < 0, final.filter(pa.array(up)), rb[last][up]), log


def _bucket_files(bp, rb, probe):
    """Per bucket of the records (``rb``, each record's): its (files to rewrite, all files), by the
    changed rows ``probe`` (None: a multiset's, whose small files are all rewritten); and the rows
    of the files to rewrite, with each row's bucket."""
    import numpy as np
    import pyarrow as pa

    buckets = np.unique(rb).tolist()
    files, olds = {}, []
    for b in buckets:
        mine = probe if probe is None or len(buckets) == 1 else probe.filter(pa.array(rb == b))
        files[b] = layout._touched(bp, b, mine)
        olds.append(layout.read_files(bp, [f["path"] for f in files[b][0]]))
    old = pa.concat_tables(olds) if len(olds) > 1 else olds[0]
    return files, old, np.repeat(np.array(buckets, np.int32), [t.num_rows for t in olds])


def _write_buckets(bp, files, old, old_bucket, keep_old, new, new_bucket) -> list[dict]:
    """Each bucket's new files: its rewritten files' rows still wanted (``keep_old``) and its ``new``
    rows (``new_bucket``: each one's bucket); the remove actions of the rewritten files first."""
    import pyarrow as pa

    names = bp.schema.names
    actions = []
    for b, (touched, all_files) in files.items():
        rows = pa.concat_tables([old.filter(pa.array(keep_old & (old_bucket == b))).select(names),
                                 new.filter(pa.array(new_bucket == b)).select(names)])
        actions += layout._removes(touched, b)
        actions += layout.write_sorted(bp, rows, b, layout._kept(bp, all_files, touched))
    return actions


def _insert_only(plan: TablePlan, recs):
    """A table without a key (a multiset) whose records in these buckets are all whole-row inserts:
    the changelog is the inserts, summed per identical (row, time); the bucket's small files are
    merged with the new rows as `layout.rewrite_multiset` does; nothing else is read."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from tidemark.consolidate.changelog import log_schema

    bp, target = plan.bucket_plan, plan.bucket_plan.schema
    recs = recs.sort_by([(META_TIME, "ascending"), (META_POS, "ascending")])
    t_np = recs.column(META_TIME).to_numpy()
    p_np = recs.column(META_POS).to_numpy()
    dup = np.r_[False, (t_np[1:] == t_np[:-1]) & (p_np[1:] == p_np[:-1])] if recs.num_rows else np.zeros(0, bool)
    if dup.any():
        recs = recs.filter(pa.array(~dup))
        t_np = t_np[~dup]
    diff = recs.column(META_DIFF).to_numpy()
    full = recs.column(META_FULL).to_numpy(zero_copy_only=False)
    unknown_len = pc.fill_null(pc.list_value_length(recs.column(META_UNKNOWN)), 0).to_numpy()
    if (diff < 0).any() or (~full).any() or (unknown_len > 0).any():
        raise _Unhandled("a table without a key has deletes or partial rows in this batch")
    added = layout.conform(recs, target)
    log = added.append_column("_time", recs.column(META_TIME)).append_column("_diff", recs.column(META_DIFF)) \
               .append_column("_commit_ts", recs.column(META_CTS).cast(pa.int64()))
    n = log.num_rows
    if n > 1:
        multi = t_np[1:] == t_np[:-1]
        if multi.any():
            flag = np.zeros(n, bool)
            flag[1:] |= multi
            flag[:-1] |= multi
            merged = layout._cancel_zero(log.take(pa.array(np.nonzero(flag)[0], pa.int64())))
            log = pa.concat_tables([log.filter(pa.array(~flag)), merged.select(log.column_names)])
    log = layout.conform(log.set_column(log.column_names.index("_commit_ts"), "_commit_ts",
                                        log.column("_commit_ts").cast(pa.timestamp("us", tz="UTC"))),
                         log_schema(target))
    files, old, old_bucket = _bucket_files(bp, recs.column(META_BUCKET).to_numpy(), None)
    keep_old = np.ones(old.num_rows, bool)
    return _write_buckets(bp, files, old, old_bucket, keep_old, added, recs.column(META_BUCKET).to_numpy()), log


def _same_as_previous(t, keys):
    """Whether each row's key equals the previous row's key (rows sorted by key)."""
    import numpy as np
    import pyarrow.compute as pc

    n = t.num_rows
    if n == 0:
        return np.zeros(0, bool)
    same = np.ones(n - 1, bool)
    for k in keys:
        c = t.column(k)
        eq = pc.fill_null(pc.equal(c.slice(1), c.slice(0, n - 1)), False)
        both_null = pc.and_(c.slice(1).is_null(), c.slice(0, n - 1).is_null())
        same &= pc.or_(eq, both_null).to_numpy(zero_copy_only=False)
    return np.r_[False, same]


def _consolidate_log(log, keys: list[str], same_key, times):
    """One diff per (data, time): rows of one key and time are summed as identical images and zero
    sums dropped (rows are ordered by key, time, position). Only keys with several records at one
    time are compared value by value."""
    import numpy as np
    import pyarrow as pa

    n = log.num_rows
    if n < 2:
        return log
    multi = same_key[1:] & (times[1:] == times[:-1])
    if not multi.any():
        return log
    flag = np.zeros(n, bool)
    flag[1:] |= multi
    flag[:-1] |= multi
    idx = np.nonzero(flag)[0]
    sub = log.take(pa.array(idx, pa.int64()))
    merged = layout._cancel_zero(sub)
    rest = log.filter(pa.array(~flag))
    return pa.concat_tables([rest, merged.select(rest.column_names)])


def _commit_table(job, p: Prepared, acts: list[dict], frontier: int, store, run: str, timed: bool = True
                  ) -> tuple[int, int | None]:
    """Commit one table's merged groups: its changelog (the files and CDC parts its executors wrote),
    then its files (app txn (stream, F)). Thread-safe (`_commit_tables`); ``timed``: record its
    phases (a table committed alone)."""
    import numpy as np

    from tidemark.consolidate import commit as _commit
    from tidemark.consolidate.changelog import Written, commit_changelog, log_schema
    from tidemark.consolidate.job import _discard_on_failure

    t0 = _time.perf_counter()
    table_acts = [a for a in acts if a["target"] == "table" and a["op"] in ("add", "remove")]
    desc = _commit.description(job.cfg.stream, p.table, p.buckets, p.shape.to_json())
    lp = p.log_plan
    written = None
    if lp is not None:
        parts = [a for a in acts if a["target"] == "cdc" and a["op"] == "part"]
        times, counts = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for a in parts:
            pair = np.frombuffer(a["log"], np.int64)
            times.append(pair[:len(pair) // 2])
            counts.append(pair[len(pair) // 2:])
        written = Written(lo=lp.lo, sync=lp.sync, files=[a for a in acts if a["target"] == "changelog"],
                          parts=[a["path"] for a in parts], times=np.concatenate(times),
                          counts=np.concatenate(counts))
    with _discard_on_failure(p.uri, job.options, table_acts, stream=job.cfg.stream, frontier=frontier):
        changed = commit_changelog(job.cfg, p.table, p.target, log_schema(p.target).empty_table(), p.lower,
                                   frontier, options=job.options, base=job._bases.get(p.table), store=store,
                                   lake_at=p.lake_at, dt=p.log_dt, written=written, run=run)
        if timed:
            phase("changelog commit (CDC file + Delta)", _time.perf_counter() - t0)
        t0 = _time.perf_counter()
        if not table_acts:
            return 0, None
        version = _commit.commit_files(p.uri, job.options, p.dt, p.target, table_acts, stream=job.cfg.stream,
                                       frontier=frontier, desc=desc)
        if timed:
            phase("table commit (Delta)", _time.perf_counter() - t0)
    return changed, version
