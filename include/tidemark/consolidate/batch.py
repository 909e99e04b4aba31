"""One batch: every table of the stream's slice in ONE Spark job, merged group by group in Arrow.

1. `prepare.prepare` each table (driver): its pending snapshot is loaded (the table's state at the
   snapshot's LSN), its shape brought to the batch's newest (ADD / DROP COLUMN), its truncates listed;
2. each table's updates are Arrow IPC parts per bucket in the run's work area (Spark's ``xxhash64``
   of the key, or of every column of a table without one, computed in Arrow by `sparkhash`), as the
   decoding cut them; a table whose parts were cut otherwise than its lake table cuts rows now (a
   table without a key whose columns changed), and a re-snapshot's rows, are cut again first
   (`_cut`, one Spark job: `decode.cut_partition`);
3. the parts are grouped once (`_groups`): by ``(table, bucket)``, buckets linked by an update whose
   ``+1`` needs its old image from another bucket (`decode._links`) as one group, a small table with
   few changes as one group (`WHOLE_TABLE_RECORDS`), every bucket holding files of a truncated table;
   the groups are spread over the cores by their size (`_spread`) and ONE Spark job (a range, no
   shuffle) merges them: `merge.merge_tasks` reads each group's parts and `merge.merge_group` merges
   them — every change shape, the exact changelog, the new files, the changelog's Parquet files and
   CDC parts, written in the executors; file actions and counts come back, never rows;
4. the driver commits each table (`_commit_tables`: `changelog.commit_changelog`, then
   `lake.writer.commit_files` with the app transaction ``(stream, F)``), a few at a time.

Bad input (a delete of a row the lake does not hold, a ``+1`` without its values) stops the batch
before any commit, its files deleted, with a `merge.MergeError` naming the table, key and time.
`replay` runs the same merge over a past lake version, writing nothing (the interval changelog).
"""

from __future__ import annotations

import json
import time as _time
from dataclasses import dataclass

from tidemark.consolidate import history, layout, merge
from tidemark.consolidate.decode import DECODED_DDL, RELOAD_POSITION, Cut, meta_arrow_fields
from tidemark.consolidate.merge import MERGE_RECORDS, OUT_DDL, LogPlan, TablePlan
from tidemark.consolidate.plan import PHASES, phase
from tidemark.consolidate.prepare import Prepared, open_all, prepare

HISTORY_PLAN = "history: plan (driver: Delta logs, for the merge job)"


def consolidate_tables(job, tables: list[str], frontier: int, loadable,
                       frontiers: dict[str, int] | None = None) -> dict[str, tuple[int, int | None]]:
    """Bring ``tables`` to ``frontier`` (an external feed's: each to its own, ``frontiers``) in one
    Spark job; {table: (rows changed, its new version or None)}. What the merge did to each merged
    table, its rows inserted, updated and deleted (`merge.CHANGE_COUNTS`, summed over its groups), goes
    to ``job.changes`` (with a snapshot loaded first, its rows: `_changes`)."""
    done: dict[str, tuple[int, int | None]] = {}
    prepared: dict[str, Prepared] = {}
    t0 = _time.perf_counter()
    for table in tables:
        job.committing = table         # a failure while preparing names this table (`job._Where`)
        p = prepare(job, table, (frontiers or {}).get(table, frontier), loadable)
        job.committing = None
        job.changes[table] = _changes([], p.loaded)
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
    logs = open_all({t: changelog_uri(job.cfg, t) for t in prepared}, job.options)
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
        job.changes[table] = _changes([a for a in mine if a["target"] == "changes"], p.loaded)
        if any(a["op"] == "problem" for a in mine):
            problems[table] = next(a["problem"] for a in mine if a["op"] == "problem")
        ready[table] = mine
    if problems:               # bad input: nothing of this run is committed, every file it wrote goes
        from tidemark.lake import writer as _commit
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
        from tidemark.consolidate.merge import RowImageUnknown
        from tidemark.errors import TableNeedsSnapshot

        if RowImageUnknown.MARK in problems[table]:    # values only a copy has: that table is re-snapshotted
            raise TableNeedsSnapshot(f"stream {job.cfg.stream}: {problems[table].replace(RowImageUnknown.MARK, '')}",
                                     table=table)
        raise MergeError(f"stream {job.cfg.stream}: {problems[table]}")
    for table, (changed, version) in _commit_tables(job, prepared, ready, run).items():
        rows, loaded_version = prepared[table].loaded
        done[table] = (changed + rows, version if version is not None else loaded_version)
    return done


def _changes(rows: list[dict], loaded: tuple) -> dict[str, int]:
    """A table's rows inserted, updated and deleted: the sums of its groups' ``changes`` rows; and,
    when a snapshot was loaded as a version of its own before them (``loaded``: `Prepared.loaded`, its
    rows replacing the table's), its rows as ``snapshot_rows``."""
    from tidemark.consolidate.merge import CHANGE_COUNTS

    total = dict.fromkeys(CHANGE_COUNTS, 0)
    for r in rows:
        for k, n in json.loads(r["stats"]).items():
            total[k] += int(n)
    rows_loaded, version = loaded
    if version is not None:
        total["snapshot_rows"] = int(rows_loaded)
    return total


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

    from tidemark.landing.store import landing_store

    if not ready:
        return {}
    cfg = job.cfg
    store = landing_store(cfg)
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
    """The one Spark job: each table's groups of buckets (`_groups`) spread over the cores
    (`_spread`), each group's parts read from the work area and merged (`merge.merge_tasks`); file
    actions and counts to the driver. Parts cut otherwise than the lake table cuts rows now, and a
    re-snapshot's rows, are cut first (`_cut`)."""
    import pyarrow as pa

    from tidemark.consolidate import transform as T
    from tidemark.sparkconf import default_parallelism

    plans: dict[str, TablePlan] = {}
    parts: dict[str, list[dict]] = {}
    cuts: dict[str, Cut] = {}
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
                                 history=p.history[0] if p.history is not None else None,
                                 max_records=min(job.cfg.consolidate.max_batch_records, MERGE_RECORDS))
        parts[table] = [r for r in job.shapes if r["table"] == table and r["time"] >= p.lower]
        if p.reload is not None or not _cut_as_now(job, p, parts[table]):
            cuts[table] = Cut(full, json.dumps(p.shape.to_json(), sort_keys=True), tuple(p.keys or p.target.names),
                              p.buckets, p.fill, p.renames)
    if cuts:
        parts.update(_cut(job, prepared, cuts, parts))
    groups = _groups(job, prepared, plans, parts, recut=set(cuts))
    tasks = _spread(groups, plans, max(1, default_parallelism(job.spark)))
    if not tasks:
        return []
    work = job.work
    out = job.spark.range(0, len(tasks), 1, len(tasks)).mapInArrow(
        lambda it: merge.merge_tasks(it, tasks, plans, work), T.schema(job.spark, OUT_DDL))
    return out.toArrow().to_pylist()


def _cut_as_now(job, p: Prepared, rows: list[dict]) -> bool:
    """Whether the decoding cut every part of the table as its lake table cuts rows now: into its
    number of buckets, by a hash of the same values in the same order. A part's hash is of its own
    shape's key (every column of a table without one: `decode_segment`), under the names the table
    has now; a column a part lacks is null in it (a null changes no hash), unless rows lacking it hold
    a DEFAULT."""
    from tidemark.pgtypes import TableSchema, arrow_type

    if job.buckets.get(p.table) != p.buckets:
        return False
    want = list(p.keys or p.target.names)
    fits: dict[str, bool] = {}
    for r in rows:
        if r["bucket"] is None:
            return False
        if r["info"] not in fits:
            shape = TableSchema.from_json(json.loads(r["info"]))
            hashed = layout.effective_keys(shape) or [c.name for c in shape.columns]
            types = {p.renames.get(c.name, c.name): arrow_type(c) for c in shape.columns if c.name in hashed}
            names = [p.renames.get(n, n) for n in hashed]
            fits[r["info"]] = (names == [n for n in want if n in types]
                               and all(n in types or (not p.keys and n not in p.fill) for n in want)
                               and all(p.target.field(n).type == t for n, t in types.items()))
        if not fits[r["info"]]:
            return False
    return True


def _cut(job, prepared: dict[str, Prepared], cuts: dict[str, Cut], parts: dict[str, list[dict]]) -> dict:
    """{table: its parts cut as its lake table cuts rows now}, for the tables of ``cuts``: their decoded
    parts conformed and cut again, a re-snapshot's files read and cut, in one Spark job
    (`decode.cut_partition`), each segment's (or file's) parts one object of the work area."""
    from tidemark.consolidate import transform as T
    from tidemark.consolidate.decode import cut_partition
    from tidemark.landing.store import landing_store
    from tidemark.sparkconf import default_parallelism

    by_seg: dict[str, list] = {}
    for table in cuts:
        for r in parts[table]:
            by_seg.setdefault(r["seg"], []).append((table, r["seg"], r["offset"], r["size"]))
    units: list = [("parts", f"{seg}.cut", got) for seg, got in sorted(by_seg.items())]
    store = landing_store(job.cfg)
    for table in cuts:
        p = prepared[table]
        if p.reload is not None:     # its rows, inserts at its LSN after a truncate there (`prepare`)
            for key in p.reload.tables[table].get("files", []):
                units.append(("reload", f"reload-{len(units)}", table, store.uri(key), p.reload.lsn,
                              RELOAD_POSITION, p.reload_cts))
    if not units:
        return {t: [] for t in cuts}
    work, endpoint = job.work, job.cfg.landing.endpoint_url
    src = job.spark.range(0, len(units), 1, min(len(units), max(1, default_parallelism(job.spark))))
    got = src.mapInArrow(lambda it: cut_partition(it, units, cuts, work, endpoint),
                         T.schema(job.spark, DECODED_DDL)).toArrow().drop_columns(["payload"]).to_pylist()
    return {t: [r for r in got if r["table"] == t] for t in cuts}


@dataclass
class Group:
    """One merge group: a table's buckets merged together (`merge.merge_group`) and where their
    parts are in the work area (``(name, offset, size, bucket)``)."""

    table: str
    buckets: list
    parts: list
    cost: int = 0
    records: int = 0        # the records of its parts (a group of more than `merge.TablePlan.max_records`: in ranges)


def _groups(job, prepared: dict[str, Prepared], plans: dict[str, TablePlan], parts: dict[str, list[dict]],
            recut: set) -> list[Group]:
    """Each table's merge groups: one per bucket; the buckets an update's ``+1`` links to the bucket
    of its ``-1`` (it takes unchanged TOAST values from that image: `decode._links`) in one group
    (unknown links, or parts cut again: the whole table); a small table with few changes in ONE
    group (`WHOLE_TABLE_RECORDS`: each group costs a Python call, whatever its size, so a batch of
    many small tables would otherwise pay that once per bucket). A truncate takes out every row of
    every bucket: each bucket holding files is in a group, without parts if none of its records is."""
    out: dict[tuple, Group] = {}
    for table, p in prepared.items():
        files = plans[table].bucket_plan.files
        records = sum(r["position"] or 0 for r in parts[table])
        links = job.links.get(table, set())
        whole = ((records <= WHOLE_TABLE_RECORDS and sum(f["rows"] or 0 for fs in files.values() for f in fs)
                  <= WHOLE_TABLE_LAKE_ROWS) or (-1, -1) in links or (table in recut and bool(links)))
        rep = {} if whole else _link_groups(links)
        buckets = {r["bucket"] for r in parts[table]} | (set(files) if p.truncates else set())
        for b in sorted(buckets):
            g = out.setdefault((table, 0 if whole else rep.get(b, b)), Group(table, [], []))
            g.buckets.append(b)
            g.cost += sum(f["rows"] or 0 for f in files.get(b, [])) // 4
        for r in parts[table]:
            g = out[(table, 0 if whole else rep.get(r["bucket"], r["bucket"]))]
            g.parts.append((r["seg"], r["offset"], r["size"], r["bucket"]))
            g.cost += r["position"] or 0
            g.records += r["position"] or 0
    return list(out.values())


def _spread(groups: list[Group], plans, n: int) -> list[list[Group]]:
    """The groups over ``n`` tasks (at most one per group), the costliest first, each to the task with
    the least so far (a group's cost: its records and a quarter of its buckets' lake rows)."""
    tasks: list[list[Group]] = [[] for _ in range(min(n, len(groups)))]
    load = [0] * len(tasks)
    for g in sorted(groups, key=lambda g: -g.cost):
        i = load.index(min(load))
        tasks[i].append(g)
        load[i] += g.cost + 1
    return tasks


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
                   store=(land.url, land.endpoint_url, land.region), codec=land.codec)


def _commit_table(job, p: Prepared, acts: list[dict], store, run: str, timed: bool = True
                  ) -> tuple[int, int | None]:
    """Commit one table's merged groups: its changelog (the files and CDC parts its executors wrote),
    then its files (app txn (stream, F)). Thread-safe (`_commit_tables`); ``timed``: record its
    phases (a table committed alone)."""
    import numpy as np

    from tidemark.lake import writer as _commit
    from tidemark.consolidate.changelog import Written, commit_changelog, log_schema
    from tidemark.lake import table_info

    t0 = _time.perf_counter()
    table_acts = [a for a in acts if a["target"] == "table" and a["op"] in ("add", "remove", "cdc")]
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
        written = Written(lo=lp.lo, sync=lp.sync, codec=lp.codec, files=[a for a in acts if a["target"] == "changelog"],
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
                                               stream=job.cfg.stream, frontier=p.frontier, desc=desc,
                                               change_data=True)
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
