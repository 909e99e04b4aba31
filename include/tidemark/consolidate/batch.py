"""Stage 4 of a batch (`MergeOutcome`, `merge_tables`): every prepared table (`prepare.TablePrep`)
merged in ONE Spark job, group by group in Arrow (`merge.merge_tasks`); nothing is committed here
(`committed`). Bad input stops the batch before any commit, its files deleted (`_refuse`). `replay`
runs the same merge over a past lake version, writing nothing (the interval changelog). The merge
job's plan: docs/internals/batch.md.
"""

from __future__ import annotations

import json
import os
import time as _time
import uuid
from dataclasses import dataclass, replace
from typing import Mapping

import pyarrow as pa

from tidemark.consolidate import history, merge, transform as T
from tidemark.consolidate.decoded import Decoded, open_all
from tidemark.consolidate.failure import for_table
from tidemark.consolidate.feed_files import parts_prefix
from tidemark.consolidate.merge import (CHANGE_COUNTS, MERGE_RECORDS, OUT_DDL, LogPlan, MergeError, RowImageUnknown,
                                        TablePlan)
from tidemark.consolidate.plan import phase
from tidemark.consolidate.prepare import Prepared, TablePrep
from tidemark.consolidate.recut import Cut, cut_partition
from tidemark.consolidate.work_area import DECODED_DDL, RELOAD_POSITION, meta_arrow_fields
from tidemark.errors import TableNeedsSnapshot
from tidemark.lake import changelog_uri, committed_frontier, layout, writer as _commit
from tidemark.lake.scd2 import log_schema
from tidemark.landing.store import landing_store
from tidemark.pgtypes import TableSchema, arrow_type
from tidemark.sparkconf import default_parallelism

@dataclass(frozen=True)
class MergeOutcome:
    """Stage 4's result: what the merge job wrote for each table with changes, nothing committed yet."""

    prep: TablePrep
    tables: Mapping[str, Prepared]            # each merged table with its changelog and history planned
    acts: Mapping[str, tuple]                 # table -> its file actions (`merge.OUT_DDL` rows)
    changes: Mapping[str, Mapping[str, int]]  # table -> its rows inserted, updated, deleted (`_changes`)
    problems: Mapping[str, str]               # table -> the bad input found (none: the batch goes on)
    run: str = ""                             # the run's id in the names of the files it wrote


def merge_tables(prep: TablePrep) -> MergeOutcome:
    """Merge the tables of ``prep`` with changes in one Spark job (`_merge`); their outcome. Bad input
    in any table: every file of the run is deleted and the first such table's error raised (`_refuse`)."""
    dec = prep.decoded
    if not prep.merging:
        return MergeOutcome(prep, {}, {}, {}, {})
    t0 = _time.perf_counter()
    # the changelog tables first: where each one's committed range ends says what the executors write
    logs = open_all({t: changelog_uri(dec.cfg, t) for t in prep.merging}, dec.options)
    phase("open changelogs (driver)", _time.perf_counter() - t0)
    run = uuid.uuid4().hex[:12]
    tables = {t: _planned(dec, replace(prep.tables[t], log_dt=logs[t]), run) for t in prep.merging}
    t0 = _time.perf_counter()
    acts = _merge(dec, tables, run)
    phase("merge buckets (Spark job)", _time.perf_counter() - t0)
    mine = {t: tuple(a for a in acts if a["table"] == t) for t in tables}
    outcome = MergeOutcome(
        prep, tables, mine,
        {t: _changes([a for a in mine[t] if a["target"] == "changes"], p.loaded) for t, p in tables.items()},
        {t: next(a["problem"] for a in mine[t] if a["op"] == "problem")
         for t in tables if any(a["op"] == "problem" for a in mine[t])}, run)
    if outcome.problems:
        _refuse(outcome)
    return outcome


def _planned(dec: Decoded, p: Prepared, run: str) -> Prepared:
    """``p`` with where the merge groups write its changelog (none: committed to its frontier already)
    and its history's plan (`history.in_merge`)."""
    done = committed_frontier(p.log_dt, dec.cfg.stream)
    if done is None or done < p.frontier:
        land = dec.cfg.landing
        p = replace(p, log_plan=LogPlan(uri=changelog_uri(dec.cfg, p.table), sync=os.urandom(16),
                                        lo=p.lower if done is None else max(p.lower, done),
                                        parts=parts_prefix(dec.cfg.stream, p.table, run),
                                        store=(land.url, land.endpoint_url, land.region), codec=land.codec))
    if dec.cfg.history:
        t0 = _time.perf_counter()
        p = replace(p, history=history.in_merge(dec.cfg, p, dec.options))
        phase("history: plan (driver: Delta logs, for the merge job)", _time.perf_counter() - t0)
    return p


def _refuse(outcome: MergeOutcome) -> None:
    """Bad input: nothing of this run is committed, every file it wrote goes; raise the first table's
    problem (a `merge.RowImageUnknown`: that table is re-snapshotted)."""
    dec = outcome.prep.decoded
    cfg, options = dec.cfg, dec.options
    for table, mine in outcome.acts.items():
        p = outcome.tables[table]
        targets = [(p.uri, "table"), (changelog_uri(cfg, table), "changelog")]
        if p.history is not None:
            targets.append((p.history[0].uri, "history"))
        for uri, target in targets:
            _commit.discard_uncommitted(uri, options, [a for a in mine if a["target"] == target],
                                        stream=cfg.stream, frontier=p.frontier)
    table, problem = next(iter(outcome.problems.items()))
    with for_table(table):
        if RowImageUnknown.MARK in problem:    # values only a copy has: that table is re-snapshotted
            raise TableNeedsSnapshot(f"stream {cfg.stream}: {problem.replace(RowImageUnknown.MARK, '')}", table=table)
        raise MergeError(f"stream {cfg.stream}: {problem}")


def _changes(rows: list[dict], loaded: tuple) -> dict[str, int]:
    """A table's rows inserted, updated and deleted (the sums of its groups' ``changes`` rows) and,
    after a snapshot load (``loaded``: `Prepared.loaded`), its rows as ``snapshot_rows``."""
    total = dict.fromkeys(CHANGE_COUNTS, 0)
    for r in rows:
        for k, n in json.loads(r["stats"]).items():
            total[k] += int(n)
    rows_loaded, version = loaded
    if version is not None:
        total["snapshot_rows"] = int(rows_loaded)
    return total


# a table with at most this many records in the batch and rows in the lake is merged in one group,
# not one per bucket
WHOLE_TABLE_RECORDS = 20_000
WHOLE_TABLE_LAKE_ROWS = 250_000


def _merge(dec: Decoded, prepared: dict[str, Prepared], run: str) -> list[dict]:
    """The one Spark job: each table's groups of buckets (`_groups`) spread over the cores (`_spread`)
    and merged (`merge.merge_tasks`), parts cut first where needed (`_cut`); the actions, as dicts."""
    plans: dict[str, TablePlan] = {}
    parts: dict[str, list[dict]] = {}
    cuts: dict[str, Cut] = {}
    for table, p in prepared.items():
        full = pa.schema(meta_arrow_fields() + list(p.target))
        sort = layout.sort_columns(p.target, p.keys)
        bplan = layout.BucketPlan(uri=p.uri, options=dec.options, schema=p.target, keys=p.keys, sort=sort,
                                  files=layout.file_index(p.dt, sort) if p.dt is not None else {},
                                  target_rows=dec.target_rows, tag=layout.plan_tag(p.frontier), fill=p.fill,
                                  renames=p.renames)
        plans[table] = TablePlan(table, bplan, lower=p.lower, frontier=p.frontier, full=full, log=p.log_plan,
                                 truncates=p.truncates, replay=p.replay,
                                 history=p.history[0] if p.history is not None else None,
                                 max_records=min(dec.cfg.consolidate.max_batch_records, MERGE_RECORDS))
        parts[table] = [r for r in dec.shapes if r["table"] == table and r["time"] >= p.lower]
        if p.reload is not None or not _cut_as_now(dec, p, parts[table]):
            cuts[table] = Cut(full, json.dumps(p.shape.to_json(), sort_keys=True), tuple(p.keys or p.target.names),
                              p.buckets, p.fill, p.renames)
    if cuts:
        parts.update(_cut(dec, prepared, cuts, parts))
    groups = _groups(dec, prepared, plans, parts, recut=set(cuts))
    tasks = _spread(groups, max(1, default_parallelism(dec.spark)))
    if not tasks:
        return []
    work = dec.work
    out = dec.spark.range(0, len(tasks), 1, len(tasks)).mapInArrow(
        lambda it: merge.merge_tasks(it, tasks, plans, work), T.schema(dec.spark, OUT_DDL))
    return out.toArrow().to_pylist()


def _cut_as_now(dec: Decoded, p: Prepared, rows: list[dict]) -> bool:
    """Whether the decoding cut every part of the table as its lake table cuts rows now: into as many
    buckets, by a hash of the same values in the same order (a column a part lacks is null, which
    changes no hash, unless rows lacking it hold a DEFAULT)."""
    if dec.buckets.get(p.table) != p.buckets:
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


def _cut(dec: Decoded, prepared: dict[str, Prepared], cuts: dict[str, Cut], parts: dict[str, list[dict]]) -> dict:
    """{table: its parts cut as its lake table cuts rows now} for the tables of ``cuts``: their decoded
    parts and a re-snapshot's files cut in one Spark job (`decode.cut_partition`)."""
    by_seg: dict[str, list] = {}
    for table in cuts:
        for r in parts[table]:
            by_seg.setdefault(r["seg"], []).append((table, r["seg"], r["offset"], r["size"]))
    units: list = [("parts", f"{seg}.cut", got) for seg, got in sorted(by_seg.items())]
    store = landing_store(dec.cfg)
    for table in cuts:
        p = prepared[table]
        if p.reload is not None:     # its rows, inserts at its LSN after a truncate there (`prepare`)
            for key in p.reload.tables[table].get("files", []):
                units.append(("reload", f"reload-{len(units)}", table, store.uri(key), p.reload.lsn,
                              RELOAD_POSITION, p.reload_cts))
    if not units:
        return {t: [] for t in cuts}
    work, endpoint = dec.work, dec.cfg.landing.endpoint_url
    src = dec.spark.range(0, len(units), 1, min(len(units), max(1, default_parallelism(dec.spark))))
    got = src.mapInArrow(lambda it: cut_partition(it, units, cuts, work, endpoint),
                         T.schema(dec.spark, DECODED_DDL)).toArrow().drop_columns(["payload"]).to_pylist()
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


def _groups(dec: Decoded, prepared: dict[str, Prepared], plans: dict[str, TablePlan], parts: dict[str, list[dict]],
            recut: set) -> list[Group]:
    """Each table's merge groups: one per bucket; linked buckets (`bucket_parts.links`) in one group
    (unknown links, or parts cut again: the whole table); a small table in ONE group
    (`WHOLE_TABLE_RECORDS`); under a truncate every bucket holding files, with or without parts."""
    out: dict[tuple, Group] = {}
    for table, p in prepared.items():
        files = plans[table].bucket_plan.files
        records = sum(r["position"] or 0 for r in parts[table])
        links = dec.links.get(table, set())
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


def _spread(groups: list[Group], n: int) -> list[list[Group]]:
    """The groups over ``n`` tasks (at most one per group), the costliest first, each to the task with
    the least so far (a group's cost: its records and a quarter of its buckets' lake rows)."""
    tasks: list[list[Group]] = [[] for _ in range(min(n, len(groups)))]
    load = [0] * len(tasks)
    for g in sorted(groups, key=lambda g: -g.cost):
        i = load.index(min(load))
        tasks[i].append(g)
        load[i] += g.cost + 1
    return tasks


def replay(dec: Decoded, p: Prepared):
    """The exact changelog rows of ``p.table``'s changes in ``[p.lower, p.frontier)`` over the lake
    state ``p.dt`` (a past version, or None: empty), by the same merge, writing nothing."""
    acts = _merge(dec, {p.table: p}, "replay")
    problem = next((a["problem"] for a in acts if a["op"] == "problem"), None)
    if problem is not None:
        raise MergeError(f"stream {dec.cfg.stream}: {problem}")
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

