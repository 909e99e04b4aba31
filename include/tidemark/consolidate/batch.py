"""One batch: every table of the stream's slice in ONE Spark job, merged group by group in Arrow.

1. `prepare.prepare` each table (driver): its pending snapshot is loaded (the table's state at the
   snapshot's LSN), its shape brought to the batch's newest (ADD / DROP COLUMN), its truncates listed;
2. each table's updates reach the merge as Arrow IPC parts per bucket (Spark's ``xxhash64`` of the
   key, or of every column of a table without one, computed in Arrow by `sparkhash`): as the
   decoding cut them (`prepare.splits`: the lake table's shape, key and buckets, given to the decoding),
   else expanded and packed in a Python step (`pack_tables`; a segment of another shape, an external
   feed), else bucketed by Spark where `sparkhash` lacks the key's types; a truncated table's
   buckets without records get an empty part;
3. the parts are grouped once: by ``(table, bucket)``, buckets linked by an update whose ``+1``
   needs its old image from another bucket (`decode._links`) as one group, a small table with few
   changes as one group (`WHOLE_TABLE_RECORDS`); `merge.merge_bucket` merges each group: every change
   shape, the exact changelog, the new files, the changelog's Parquet files and CDC parts, written
   in the executors; file actions and counts come back, never rows;
4. the driver commits each table (`_commit_tables`: `changelog.commit_changelog`, then
   `commit.commit_files` with the app transaction ``(stream, F)``), a few at a time.

Bad input (a delete of a row the lake does not hold, a ``+1`` without its values) stops the batch
before any commit, its files deleted, with a `merge.MergeError` naming the table, key and time.
`replay` runs the same merge over a past lake version, writing nothing (the interval changelog).
"""

from __future__ import annotations

import json
import time as _time
from dataclasses import dataclass, field
from typing import Any

from tidemark.consolidate import history, layout, sparkhash
from tidemark.consolidate.prepare import Prepared, _open_all, prepare
from tidemark.consolidate.decode import META_TIME, _ipc, meta_arrow_fields
from tidemark.consolidate import merge
from tidemark.consolidate.merge import OUT_DDL, LogPlan, TablePlan, merge_bucket

PACK_DDL = "table string, bucket int, part binary"

# seconds per phase of the last run, and Spark jobs started (benchmarks print them)
PHASES: dict[str, float] = {}


HISTORY_PLAN = "history: plan (driver: Delta logs, for the merge job)"


def phase(name: str, seconds: float) -> None:
    PHASES[name] = PHASES.get(name, 0.0) + seconds


def consolidate_tables(job, tables: list[str], frontier: int, loadable,
                       frontiers: dict[str, int] | None = None) -> dict[str, tuple[int, int | None]]:
    """Bring ``tables`` to ``frontier`` (an external feed's: each to its own, ``frontiers``) in one
    Spark job; {table: (rows changed, its new version or None)}."""
    done: dict[str, tuple[int, int | None]] = {}
    prepared: dict[str, Prepared] = {}
    t0 = _time.perf_counter()
    for table in tables:
        job.committing = table         # a failure while preparing names this table (`job._Where`)
        p = prepare(job, table, (frontiers or {}).get(table, frontier), loadable)
        job.committing = None
        if p.shape is None:
            done[table] = p.loaded
        else:
            prepared[table] = p
    phase("plan tables (driver)", _time.perf_counter() - t0)
    job.merged = sorted(prepared)      # their changelogs are committed here; the others' by `advance_feeds`
    if not prepared:
        return done
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
    planned = PHASES.get(HISTORY_PLAN, 0.0)
    acts = _merge(job, prepared, run)
    phase("merge buckets (Spark job)", _time.perf_counter() - t0 - (PHASES.get(HISTORY_PLAN, 0.0) - planned))
    ready, problems = {}, {}
    for table, p in prepared.items():
        mine = [a for a in acts if a["table"] == table]
        if any(a["op"] == "problem" for a in mine):
            problems[table] = next(a["problem"] for a in mine if a["op"] == "problem")
        ready[table] = mine
    if problems:               # bad input: nothing of this run is committed, every file it wrote goes
        from tidemark.consolidate import commit as _commit
        from tidemark.consolidate.merge import MergeError

        for table, mine in ready.items():
            f = prepared[table].frontier
            _commit.discard_uncommitted(prepared[table].uri, job.options, [a for a in mine if a["target"] == "table"],
                                        stream=job.cfg.stream, frontier=f)
            _commit.discard_uncommitted(changelog_uri(job.cfg, table), job.options,
                                        [a for a in mine if a["target"] == "changelog"],
                                        stream=job.cfg.stream, frontier=f)
            if prepared[table].history is not None:
                _commit.discard_uncommitted(prepared[table].history[0].uri, job.options,
                                            [a for a in mine if a["target"] == "history"],
                                            stream=job.cfg.stream, frontier=f)
        table = next(iter(problems))
        job.committing = table
        raise MergeError(f"stream {job.cfg.stream}: {problems[table]}")
    for table, (changed, version) in _commit_tables(job, prepared, ready, run).items():
        rows, loaded_version = prepared[table].loaded
        done[table] = (changed + rows, version if version is not None else loaded_version)
    return done


COMMIT_THREADS = 4
# a table with at most this many records in the batch and rows in the lake is merged in one group,
# not one per bucket
WHOLE_TABLE_RECORDS = 20_000
WHOLE_TABLE_LAKE_ROWS = 250_000


def _commit_tables(job, prepared: dict[str, Prepared], ready: dict[str, list[dict]], run: str) -> dict:
    """Commit each merged table (`_commit_table`), several at once: a table's commits wait on storage
    and on ``deltalake`` (which releases the GIL), so a batch of many small tables costs a fraction of
    their sum. Every commit is let finish before a failure is raised: the one of the first failed
    table in batch order, named in ``job.committing`` (the tables committed meanwhile are ahead of
    the stream frontier; a retry skips them)."""
    from concurrent.futures import ThreadPoolExecutor

    from tidemark.landing.store import open_store

    if not ready:
        return {}
    cfg = job.cfg
    store = open_store(cfg.landing.url, endpoint_url=cfg.landing.endpoint_url, region=cfg.landing.region)
    if len(ready) == 1:
        (table, acts), = ready.items()
        job.committing = table        # a failure from here on names this table (`job._Where`)
        done = {table: _commit_table(job, prepared[table], acts, store, run)}
        job.committing = None
        return done
    t0 = _time.perf_counter()
    with ThreadPoolExecutor(min(COMMIT_THREADS, len(ready)), thread_name_prefix="tidemark-commit") as pool:
        futures = {t: pool.submit(_commit_table, job, prepared[t], acts, store, run, timed=False)
                   for t, acts in ready.items()}
    phase(f"commit tables (changelog + Delta, {min(COMMIT_THREADS, len(ready))} threads)",
          _time.perf_counter() - t0)
    for table, fut in futures.items():
        if fut.exception() is not None:
            job.committing = table
            raise fut.exception()
    return {t: fut.result() for t, fut in futures.items()}


def _merge(job, prepared: dict[str, Prepared], run: str) -> list[dict]:
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
                                  sort=sort, files=layout.file_index(p.dt, sort) if p.dt is not None else {},
                                  target_rows=job.target_rows, tag=layout.plan_tag(p.frontier), fill=p.fill,
                                  renames=p.renames)
        p.log_plan = None if p.replay else _log_plan(job, p, run)
        if job.cfg.history and not p.replay:
            t0 = _time.perf_counter()
            p.history = history.in_merge(job.cfg, p, job.options)
            phase(HISTORY_PLAN, _time.perf_counter() - t0)
        plans[table] = TablePlan(table, bplan, [c for c in p.target.names if c not in p.keys], p.lower, p.frontier,
                                 full, p.log_plan, p.truncates, p.replay, fill=p.fill,
                                 history=p.history[0] if p.history is not None else None)
        hashed = p.keys or list(p.target.names)
        if sparkhash.supported(p.target, hashed):
            specs[table] = PackSpec(full, hashed, p.buckets, p.lower, p.frontier, p.fill, p.renames)
            continue
        # a key type the Arrow hash does not cover: Spark computes the bucket (a round trip through the JVM)
        rows = job.decoded.filter((F.col("kind") == "data") & (F.col("table") == table) & (F.col("time") >= p.lower))
        expanded = rows.select("payload").mapInArrow(lambda it, full=full, table=table, fill=p.fill, ren=p.renames:
                                                     expand_partition(it, full, table, fill, ren),
                                                     from_arrow_schema(full, prefer_timestamp_ntz=True))
        expanded = T.in_range(expanded, p.lower, p.frontier)
        bucketed, names = T.plain_names(T.with_bucket(expanded, hashed, p.buckets))
        parts.append(bucketed.mapInArrow(lambda it, table=table, names=names: pack_partition(T.named(it, names), table),
                                         T.schema(job.spark, PACK_DDL)))
    # a re-snapshot's rows: read from its files, as inserts at its LSN, bucketed by Spark
    for table, p in prepared.items():
        if p.reload is not None:
            parts.append(_reload_parts(job, p, plans[table].full))
    # tables whose updates the decoding already cut by bucket (`splits`): shuffled as they are
    cut = sorted(t for t in specs if _cut_by_bucket(job, prepared[t], specs[t]))
    if cut:
        # one filter and one projection in SQL (each Column built in Python costs calls into the JVM);
        # a part wholly below its table's lower bound (a table ahead of the stream) is left out, and
        # only then is a time in the query (a new literal compiles new code in every run)
        where = f"`kind` = 'data' AND `table` IN ({', '.join(T.sql_string(t) for t in cut)})"
        if any(r["time"] < prepared[r["table"]].lower for r in job.shapes if r["table"] in cut):
            where += f" AND `time` >= {int(min(specs[t].lower for t in cut))}"
        parts.append(job.decoded.where(where).selectExpr("`table`", "`bucket`", "`payload` AS `part`"))
    specs = {t: s for t, s in specs.items() if t not in cut}
    if specs:
        rows = (job.decoded.filter((F.col("kind") == "data") & F.col("table").isin(sorted(specs))
                                   & (F.col("time") >= min(s.lower for s in specs.values())))
                .select("table", "time", "payload"))
        parts.append(rows.mapInArrow(lambda it: pack_tables(it, specs), T.schema(job.spark, PACK_DDL)))
    # a truncate takes out every row of every bucket: each bucket holding files gets a group, an
    # empty part if none of its records is in the batch
    empty = [(t, b, _ipc(plans[t].full.empty_table())) for t in sorted(plans) if plans[t].truncates
             for b in sorted(plans[t].bucket_plan.files)]
    if empty:
        parts.append(job.spark.createDataFrame(empty, PACK_DDL))
    packed = parts[0]
    for part in parts[1:]:
        packed = packed.unionByName(part)
    # an explicit partition count: adaptive execution would coalesce a small batch's shuffle into ONE task
    # (one core merging every bucket); a repartition by number is kept, and the grouping reuses it
    from tidemark.sparkconf import default_parallelism

    n_parts = max(2, default_parallelism(job.spark))
    # a small table with few changes is merged in ONE group (its buckets' files are still written per
    # bucket): each group costs a Python call that sorts, joins, builds the changelog and encodes it,
    # whatever its size, so a batch of many small tables would otherwise pay that once per bucket. A
    # big table's buckets stay apart: rewriting their files is the work, and it is spread over the cores
    whole = sorted(t for t, p in prepared.items() if _records(job, p) <= WHOLE_TABLE_RECORDS
                   and sum(f["rows"] or 0 for fs in plans[t].bucket_plan.files.values() for f in fs)
                   <= WHOLE_TABLE_LAKE_ROWS)
    # an update whose +1 takes unchanged TOAST values from a -1 in another bucket links the two
    # buckets (`decode._links`): linked buckets are one group; unknown links, the whole table
    links = {t: getattr(job, "links", {}).get(t, set()) for t in prepared}
    whole += [t for t in prepared if (-1, -1) in links[t] and t not in whole]
    linked = sorted(t for t in prepared if links[t] and t not in whole)
    by = ["table", "bucket"]          # each bucket its own group, unless linked or whole
    if linked or whole:
        group = F.col("bucket")
        for t in linked:
            rep = _link_groups(links[t])
            mapped = F.create_map(*[F.lit(x) for kv in sorted(rep.items()) for x in kv])
            group = F.when(F.col("table") == t, F.coalesce(F.element_at(mapped, F.col("bucket")), F.col("bucket"))
                           ).otherwise(group)
        if whole:
            group = F.when(F.col("table").isin(whole), F.lit(0)).otherwise(group)
        packed, by = packed.withColumn("group", group), ["table", "group"]
    merged = (packed.repartition(n_parts, *by).groupBy(*by)
              .applyInArrow(lambda t: merge_bucket(plans, t), T.schema(job.spark, OUT_DDL)))
    # without adaptive execution the shuffle and the merge are ONE Spark job (adaptive execution runs
    # the shuffle's map stage as a job of its own, then plans the rest again); it has nothing to adapt
    # here: the partition count is explicit, and there is no join to split a skewed partition for
    with T.session_conf(job.spark, {"spark.sql.adaptive.enabled": "false"}):
        result = merged.toArrow()
    return result.to_pylist()


def replay(job, p: Prepared):
    """The exact changelog rows of ``p.table``'s changes in ``[p.lower, p.frontier)`` over the lake
    state ``p.dt`` (a past version, or None: empty), by the same merge in the same one Spark job,
    writing nothing: the interval changelog (`interval`) rebuilds a day's rows so."""
    import pyarrow as pa

    from tidemark.consolidate.changelog import log_schema
    from tidemark.consolidate.merge import MergeError

    acts = _merge(job, {p.table: p}, "replay")
    problem = next((a["problem"] for a in acts if a["op"] == "problem"), None)
    if problem is not None:
        raise MergeError(f"stream {job.cfg.stream}: {problem}")
    logs = [pa.ipc.open_stream(a["log"]).read_all() for a in acts if a["op"] == "log"]
    return pa.concat_tables(logs) if logs else log_schema(p.target).empty_table()


def _reload_parts(job, p: Prepared, full):
    """The re-snapshot ``p.reload``'s rows as packed parts per bucket (`PACK_DDL`): read from its
    Parquet files in the executors, given the meta columns of inserts at its LSN (`decode.reload_rows`)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    from tidemark.consolidate import transform as T
    from tidemark.consolidate.decode import reload_rows
    from tidemark.sparkconf import default_parallelism
    from tidemark.landing.store import open_store

    land = job.cfg.landing
    store = open_store(land.url, endpoint_url=land.endpoint_url, region=land.region)
    uris = [store.uri(k) for k in p.reload.tables[p.table].get("files", [])]
    table, lsn, endpoint, cts = p.table, p.reload.lsn, land.endpoint_url, p.reload_cts
    if not uris:
        return job.spark.createDataFrame([], PACK_DDL)
    src = job.spark.createDataFrame([(u,) for u in uris], "uri string").repartition(
        min(len(uris), max(1, default_parallelism(job.spark))))
    renames = p.renames      # a RENAME COLUMN after the copy: its files have the names of then
    rows = src.mapInArrow(lambda it: reload_rows(it, full, endpoint, lsn, merge.RELOAD_POSITION, cts, renames),
                          from_arrow_schema(full, prefer_timestamp_ntz=True))
    bucketed, names = T.plain_names(T.with_bucket(rows, p.keys or list(p.target.names), p.buckets))
    return bucketed.mapInArrow(lambda it: pack_partition(T.named(it, names), table), PACK_DDL)


def _link_groups(pairs) -> dict[int, int]:
    """{bucket: its group's smallest bucket} for the buckets the pairs link (union-find)."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        ra, rb = find(int(a)), find(int(b))
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {x: find(x) for x in list(parent)}


def _log_plan(job, p: Prepared, run: str) -> LogPlan | None:
    """Where the table's merge groups write its changelog (None: committed to its frontier already)."""
    import os

    from tidemark.consolidate.changelog import parts_prefix
    from tidemark.lake import changelog_uri, committed_frontier

    done = committed_frontier(p.log_dt, job.cfg.stream)
    if done is not None and done >= p.frontier:
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
    fill: dict = field(default_factory=dict)    # column -> the value rows lacking it hold (ADD ... DEFAULT)
    renames: dict = field(default_factory=dict)  # old name -> new name (RENAME COLUMN)


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
            part = conform_payload(pa.ipc.open_stream(payload).read_all(), spec.full, table, spec.fill, spec.renames)
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


def _commit_table(job, p: Prepared, acts: list[dict], store, run: str, timed: bool = True
                  ) -> tuple[int, int | None]:
    """Commit one table's merged groups: its changelog (the files and CDC parts its executors wrote),
    then its files (app txn (stream, F)). Thread-safe (`_commit_tables`); ``timed``: record its
    phases (a table committed alone)."""
    import numpy as np

    from tidemark.consolidate import commit as _commit
    from tidemark.consolidate.changelog import Written, commit_changelog, log_schema
    from tidemark.lake import table_info

    t0 = _time.perf_counter()
    table_acts = [a for a in acts if a["target"] == "table" and a["op"] in ("add", "remove")]
    desc = _commit.description(p.uri, job.options, job.cfg.stream, p.table, p.buckets, p.shape.to_json(),
                               missing=p.missing, attnums=p.attnums)
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
    hist_acts = [a for a in acts if a["target"] == "history"]
    try:
        with _commit.discard_on_failure(p.uri, job.options, table_acts, stream=job.cfg.stream,
                                        frontier=p.frontier):
            changed = commit_changelog(job.cfg, p.table, p.target, log_schema(p.target).empty_table(), p.lower,
                                       p.frontier, options=job.options, base=job.bases.get(p.table), store=store,
                                       lake_at=p.lake_at, dt=p.log_dt, written=written, run=run,
                                       renamed=p.renames)
            if timed:
                phase("changelog commit (CDC file + Delta)", _time.perf_counter() - t0)
            t0 = _time.perf_counter()
            version = None
            if table_acts or p.dt is None or table_info(p.dt).get("table_schema") != p.shape.to_json() \
                    or table_info(p.dt).get("missing_values", {}) != p.missing:
                version = _commit.commit_files(p.uri, job.options, p.dt, p.target, table_acts,
                                               stream=job.cfg.stream, frontier=p.frontier, desc=desc)
                if timed:
                    phase("table commit (Delta)", _time.perf_counter() - t0)
    except BaseException:
        if p.history is not None:     # the history files the merge wrote go with the table's
            _commit.discard_uncommitted(p.history[0].uri, job.options, hist_acts, stream=job.cfg.stream,
                                        frontier=p.frontier)
        raise
    if p.history is not None:
        # after the table's and changelog's commits, as `history.keep_histories` (which catches the
        # history up from the changelog if this commit does not happen)
        t0 = _time.perf_counter()
        spec, hdt = p.history
        got = history.commit_merged(job.cfg, spec, hdt, hist_acts, job.options)
        if got is not None:           # (tables commit in threads: one item set each)
            job.history_versions[p.table] = got
        if timed:
            phase("history: commit (Delta, folded in the merge job)", _time.perf_counter() - t0)
    return changed, version
