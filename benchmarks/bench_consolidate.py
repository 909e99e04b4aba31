"""Benchmark: consolidating the same batch of changes into a 1 M-row and a 10 M-row table.

Starts its own PostgreSQL cluster for the control database, builds each table's first version
directly as snapshot Parquet files (loaded by the consolidation as the table's first version), then
lands the same batch of ``--changes`` changes as segments written with `SegmentBuilder`:

* 60 % updates and 20 % deletes of random existing keys in ``1..1M`` (keys both tables hold),
* 20 % inserts of new keys above both tables' ranges,

in transactions of 100 changes. Both tables use the same bucket-count policy (``--buckets``) and file
size. Each timed run restores the table's first version, its changelog as that load left it (the
feed's base, the snapshot's rows, was written by the load: a timed run writes the batch's changes
only, as every batch after the first does) and the frontier, then runs `consolidate_stream`; runs
alternate between the two sizes. Prints the medians, their ratio
(target: large <= 1.5 x small) and changes/s.

The batch's keys lie in the range both tables share, so in the 10 M table they touch about a tenth
of each bucket's files; a batch spread uniformly over all 10 M keys would touch every file of a
copy-on-write table (``--spread all`` measures that case too).

``--shapes plain,mixed`` times a second, **mixed-shape** batch of the same number of changes beside
the plain one, in the same run: the same table where 85 % of the changes go, with updates that
leave the TOASTed ``b`` unchanged (not sent), updates that change the key and leave ``b`` unchanged
(chains of them too), deletes and inserts; a table without a key (REPLICA IDENTITY FULL, 100 k rows)
taking 10 % as whole-row deletes and inserts; and a small table truncated in the middle of the batch
taking 5 %. The target: mixed <= 2x plain.

``--history`` times the plain batch a second time on a stream that keeps the table's SCD type 2
history table (stream file ``history:``; `tidemark.consolidate.history`): the same batch, the merge
job's tasks also folding the changelog rows they work out into the history (restored with the table
to the state the first load left: every row a current version). The target: history <= 1.3x plain.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import secrets
import shutil
import statistics
import sys
import time
from pathlib import Path

from tidemark.config import parse_config
from tidemark.control import Control
from tidemark.local.localpg import LocalCluster
from tidemark.pgtypes import Column, TableSchema
from tidemark.landing.segments import SegmentBuilder, Update
from tidemark.landing.store import open_store, stream_keys

from benchkit import consolidate_databases, land_segment, local_spark, started_cluster, teardown

SHAPE = TableSchema(schema="public", name="accounts", oid=1, columns=(
    Column("id", "int64", "int8", 20, key=True, nullable=False), Column("a", "int32", "int4", 23),
    Column("b", "text", "text", 25), Column("c", "float64", "float8", 701)))
EVENTS = TableSchema(schema="public", name="events", oid=2, replica_identity="f", columns=(
    Column("x", "int32", "int4", 23), Column("s", "text", "text", 25)))
SCRATCH = TableSchema(schema="public", name="scratch", oid=3, columns=(
    Column("id", "int64", "int8", 20, key=True, nullable=False), Column("v", "text", "text", 25)))
EVENT_ROWS, SCRATCH_ROWS = 100_000, 1_000
L0 = 1_000_000


def write_snapshot(cfg, ctl: Control, rows: int, chunk: int = 1_000_000, mixed: bool = False) -> None:
    """The tables' first versions as snapshot files + manifest + a 'complete' snapshot row (with
    ``mixed``, also the table without a key and the small table)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tidemark.pgtypes import arrow_schema

    store = open_store(cfg.landing.url)
    rng = np.random.default_rng(1)

    def put(table: str, n: int, t) -> str:
        buf = io.BytesIO()
        pq.write_table(t, buf)
        key = f"{stream_keys(cfg.stream)['snapshots']}s1/{table}/chunk-{n:06d}.parquet"
        store.put(key, buf.getvalue())
        return key

    files = []
    for n, lo in enumerate(range(0, rows, chunk)):
        ids = np.arange(lo + 1, min(rows, lo + chunk) + 1, dtype=np.int64)
        files.append(put("public.accounts", n, pa.Table.from_arrays(
            [pa.array(ids), pa.array(rng.integers(0, 1 << 30, len(ids)).astype(np.int32)),
             pa.array(np.char.add("acct-", ids.astype(str)).astype(object)), pa.array(rng.random(len(ids)))],
            schema=arrow_schema(SHAPE))))
    entry = {"public.accounts": {"rows": rows, "files": files, "table_schema": SHAPE.to_json()}}
    if mixed:
        xs = np.arange(EVENT_ROWS, dtype=np.int32)
        entry["public.events"] = {"rows": EVENT_ROWS, "table_schema": EVENTS.to_json(), "files": [put(
            "public.events", 0, pa.Table.from_arrays([pa.array(xs), pa.array(np.char.add("e", xs.astype(str)).astype(object))],
                                                     schema=arrow_schema(EVENTS)))]}
        ids = np.arange(SCRATCH_ROWS, dtype=np.int64)
        entry["public.scratch"] = {"rows": SCRATCH_ROWS, "table_schema": SCRATCH.to_json(), "files": [put(
            "public.scratch", 0, pa.Table.from_arrays([pa.array(ids), pa.array(np.char.add("s", ids.astype(str)).astype(object))],
                                                      schema=arrow_schema(SCRATCH)))]}
    with ctl.tx() as cur:
        cur.execute("""INSERT INTO tidemark.snapshots (stream, snapshot_id, lsn, mode, status, tables, finished_at)
                       VALUES (%s, 's1', %s, 'initial', 'complete', %s, now())""", (cfg.stream, L0, json.dumps(entry)))
    ctl.update_stream(cfg.stream, consistent_lsn=L0, landed_upper=L0)


def land_batch(cfg, ctl: Control, changes: int, key_range: int, new_from: int, seed: int = 7):
    """Land the batch as segments of ~10k changes; return (upper, net effect): the net effect is one
    row per key with ``_op`` = d / u / i, what a MERGE applies."""
    rng = random.Random(seed)
    n_upd, n_del = changes * 6 // 10, changes * 2 // 10
    n_ins = changes - n_upd - n_del
    keys = rng.sample(range(1, key_range + 1), n_upd + n_del)
    ops = [("u", k) for k in keys[:n_upd]] + [("d", k) for k in keys[n_upd:]] + \
          [("i", new_from + i) for i in range(n_ins)]
    rng.shuffle(ops)
    store = open_store(cfg.landing.url)
    time_, seq, lower = L0, 0, L0
    builder = SegmentBuilder(cfg.stream, seq, lower)
    in_seg = 0
    net: dict[int, tuple] = {}
    for start in range(0, len(ops), 100):
        time_ += 10
        ups, pos = [], 0
        for op, k in ops[start:start + 100]:
            row = {"id": k, "a": rng.randrange(1 << 30), "b": f"acct-{k}", "c": rng.random()}
            if op in ("u", "d"):
                ups.append(Update(SHAPE, {"id": k}, time_, -1, time_, pos, 0, image="key"))
                pos += 1
            if op in ("u", "i"):
                ups.append(Update(SHAPE, row, time_, 1, time_, pos, 0))
                pos += 1
            net[k] = (op, row)
        builder.add_transaction(ups)
        in_seg += 100
        if in_seg >= 10_000 or start + 100 >= len(ops):
            land_segment(cfg, ctl, store, builder, seq, lower, time_ + 1)
            seq, lower, in_seg = seq + 1, time_ + 1, 0
            builder = SegmentBuilder(cfg.stream, seq, lower)
    return lower, net_table(net)


def land_mixed(cfg, ctl: Control, rows: int, changes: int, key_range: int, new_from: int,
               seed: int = 7) -> tuple[int, dict]:
    """Land the mixed-shape batch (module doc) as segments of ~10k changes; return (upper, the
    tables' row counts after it)."""
    rng = random.Random(seed)
    n_acc, n_evt = changes * 85 // 100, changes * 10 // 100
    n_scr = changes - n_acc - n_evt
    n_upd, n_move, n_del = n_acc * 50 // 100, n_acc * 10 // 100, n_acc * 15 // 100
    n_ins = n_acc - n_upd - n_move - n_del
    keys = rng.sample(range(1, key_range + 1), n_upd + n_move + n_del)
    ops = ([("u", k) for k in keys[:n_upd]] + [("m", k) for k in keys[n_upd:n_upd + n_move]]
           + [("d", k) for k in keys[n_upd + n_move:]] + [("i", None)] * n_ins)
    evt_dels = rng.sample(range(EVENT_ROWS), n_evt // 2)
    ops += [("ed", x) for x in evt_dels] + [("ei", EVENT_ROWS + i) for i in range(n_evt - n_evt // 2)]
    ops += [("si", SCRATCH_ROWS + i) for i in range(n_scr)]
    rng.shuffle(ops)
    truncate_at = len(ops) // 2
    store = open_store(cfg.landing.url)
    time_, seq, lower = L0, 0, L0
    builder = SegmentBuilder(cfg.stream, seq, lower)
    in_seg, fresh, moved = 0, new_from, []
    scratch = SCRATCH_ROWS
    for start in range(0, len(ops), 100):
        time_ += 10
        ups, events = [], []

        def add(table, row, diff, **kw):
            ups.append(Update(table, row, time_, diff, 0, len(ups) + len(events), time_, **kw))

        for n, (op, k) in enumerate(ops[start:start + 100], start):
            if n == truncate_at:
                from tidemark.landing.segments import Event

                events.append(Event("truncate", SCRATCH.qualified, time_, 0, len(ups) + len(events), time_))
                scratch = 0
            if op == "m" and moved and rng.random() < 0.3:
                k = moved.pop()                 # a row whose key moved earlier in the batch moves again: chains
            if op in ("u", "m", "d"):
                add(SHAPE, {"id": k}, -1, image="key")
            if op == "u":                       # the TOASTed b unchanged: not sent
                add(SHAPE, {"id": k, "a": rng.randrange(1 << 30), "b": None, "c": rng.random()}, 1,
                    unchanged_toast=("b",))
            elif op == "m":                     # the key changes, b unchanged
                new, fresh = fresh, fresh + 1
                add(SHAPE, {"id": new, "a": rng.randrange(1 << 30), "b": None, "c": rng.random()}, 1,
                    unchanged_toast=("b",))
                moved.append(new)
            elif op == "i":
                new, fresh = fresh, fresh + 1
                add(SHAPE, {"id": new, "a": 1, "b": f"acct-{new}", "c": 0.5}, 1)
            elif op in ("ed", "ei"):
                add(EVENTS, {"x": k, "s": f"e{k}"}, -1 if op == "ed" else 1)
            elif op == "si":
                add(SCRATCH, {"id": k, "v": f"s{k}"}, 1)
                scratch += 1
        builder.add_transaction(ups, events)
        in_seg += 100
        if in_seg >= 10_000 or start + 100 >= len(ops):
            land_segment(cfg, ctl, store, builder, seq, lower, time_ + 1)
            seq, lower, in_seg = seq + 1, time_ + 1, 0
            builder = SegmentBuilder(cfg.stream, seq, lower)
    return lower, {"public.accounts": rows - n_del + n_ins, "public.events": EVENT_ROWS - n_evt // 2 +
                   (n_evt - n_evt // 2), "public.scratch": scratch}


def net_table(net: dict):
    import pyarrow as pa

    items = sorted(net.items())
    return pa.table({"id": pa.array([k for k, _ in items], pa.int64()),
                     "a": pa.array([r["a"] for _, (_, r) in items], pa.int32()),
                     "b": pa.array([r["b"] for _, (_, r) in items], pa.string()),
                     "c": pa.array([r["c"] for _, (_, r) in items], pa.float64()),
                     "_op": pa.array([op for _, (op, _) in items], pa.string())})


def merge_peer(path: str, net, buckets: int) -> float:
    """``deltalake``'s own MERGE of the batch's net effect into a copy of the table; seconds."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    src = net.append_column("_bucket", pc.cast(pc.bit_wise_and(net.column("id"), buckets - 1), pa.int32()))
    t0 = time.perf_counter()
    dt = DeltaTable(path)
    (dt.merge(source=src, predicate="t.id = s.id", source_alias="s", target_alias="t")
       .when_matched_delete(predicate="s._op = 'd'")
       .when_matched_update(updates={"a": "s.a", "b": "s.b", "c": "s.c"}, predicate="s._op <> 'd'")
       .when_not_matched_insert(updates={"id": "s.id", "a": "s.a", "b": "s.b", "c": "s.c", "_bucket": "s._bucket"},
                                predicate="s._op <> 'd'")
       .execute())
    return time.perf_counter() - t0


def tree_cpu() -> float:
    """CPU seconds used so far by this process and its children (the JVM and its Python workers): a
    measure the machine's other load does not inflate the way it inflates wall time."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


class Phases:
    """Wall time per phase of a consolidation (wrapping the library's steps) and Spark jobs started."""

    def __init__(self, spark):
        from tidemark.consolidate import job, plan

        self.sc = spark.sparkContext
        self.seconds: dict[str, float] = {}
        # the library times its own phases (plan.PHASES: session, decode, batch merge, commits, per-table
        # path, frontier); only what it does not time is wrapped here
        self._wrap(plan, "completeness_rows", "completeness check (driver)")
        self._wrap(job, "_advance_idle", "idle advance (control DB)")
        plan.PHASES.clear()

    def _wrap(self, owner, name, label):
        real = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)

    def jobs(self) -> int:
        return len(self.sc.statusTracker().getJobIdsForGroup())

    def tasks(self) -> int:
        """Tasks of every stage Spark still knows (finished stages included, up to its retention)."""
        st = self.sc.statusTracker()
        return sum(info.numTasks for sid in set(self._stage_ids())
                   if (info := st.getStageInfo(sid)) is not None)

    def _stage_ids(self) -> list[int]:
        st = self.sc.statusTracker()
        out = []
        for job in st.getJobIdsForGroup():
            info = st.getJobInfo(job)
            if info is not None:
                out += list(info.stageIds)
        return out

    def take(self, total: float) -> dict[str, float]:
        from tidemark.consolidate import plan

        out = {**self.seconds, **plan.PHASES}
        out["other (control DB, slot, Delta log reads, driver)"] = total - sum(out.values())
        self.seconds.clear()
        plan.PHASES.clear()
        return out


def make_cfg(cluster: LocalCluster, work: Path, rows: int, buckets: int, mixed: bool = False,
             history: bool = False):
    stream = f"bench_{rows}_{secrets.token_hex(2)}"
    os.environ["AIRFLOW_CONN_BENCH_SOURCE"] = cluster.uri("bench_source")
    os.environ["AIRFLOW_CONN_BENCH_CONTROL"] = cluster.uri("tidemark_control")
    return parse_config({
        "stream": stream,
        "source": {"connection": "bench_source", "publication": "bench_pub", "slot": f"slot_{stream}",
                   "tables": ["public.accounts"] + (["public.events", "public.scratch"] if mixed else [])},
        "control": {"connection": "bench_control"},
        "landing": {"url": str(work / stream / "landing")},
        "lake": {"path": str(work / stream / "lake")},
        "consolidate": {"buckets": buckets},
        **({"history": ["public.accounts"]} if history else {}),
    })


def saved(cfg, pristine: Path):
    """(live, saved copy) of each table's and changelog's directory."""
    from tidemark.lake import changelog_uri, history_uri, table_uri

    for ref in cfg.source.tables:
        t = ref.qualified
        yield table_uri(cfg, t), pristine / t
        yield changelog_uri(cfg, t), pristine / f"{t}-changelog"
        if ref in cfg.history:
            yield history_uri(cfg, t), pristine / f"{t}-history"


def restore(cfg, ctl: Control, pristine: Path) -> None:
    """The tables and their changelogs as the first versions' load left them (the load wrote the
    feed's base, the snapshot's rows, into the changelog: a timed run writes only the batch's changes)."""
    for live, copy in saved(cfg, pristine):
        shutil.rmtree(live, ignore_errors=True)
        if copy.exists():
            shutil.copytree(copy, live)
    ctl.reset_frontier(cfg.stream, L0)
    with ctl.tx() as cur:
        cur.execute("UPDATE tidemark.streams SET frontier = %s WHERE name = %s", (L0, cfg.stream))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000000,10000000", help="table sizes, comma-separated")
    parser.add_argument("--changes", type=int, default=100_000)
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--spread", choices=["shared", "all"], default="shared",
                        help="keys of the batch: in 1..smallest size (shared, default) or over each whole table")
    parser.add_argument("--shapes", default="plain",
                        help="batches to time side by side: plain (default: updates, deletes and inserts of a "
                             "keyed table), mixed (module doc), or plain,mixed")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed runs of each size and path first (a warm session: the JVM's compiled "
                             "code and Python workers with their modules imported); 0 times a cold first run")
    parser.add_argument("--history", action="store_true",
                        help="also time the plain batch on a stream keeping the table's SCD2 history table")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    paths = args.shapes.split(",")
    if args.history:
        paths.append("hist")

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from tidemark.consolidate import consolidate_stream
    from tidemark.lake import read_table

    from tidemark.cds import jvm_options

    # the driver JVM gets the options the library gives every driver it starts (`cds.jvm_options`)
    spark = local_spark(args.master, "bench-consolidate", ("spark.sql.shuffle.partitions", str(args.buckets)),
                        ("spark.driver.memory", "6g"), ("spark.driver.defaultJavaOptions", jvm_options()))
    load_before = os.getloadavg()
    work, cluster = started_cluster("tidemark-bench-consolidate-")
    try:
        consolidate_databases(cluster)
        setups, nets = {}, {}
        for rows in sizes:
            for path in paths:
                mixed = path == "mixed"
                cfg = make_cfg(cluster, work, rows, args.buckets, mixed=mixed, history=path == "hist")
                ctl = Control(cluster.dsn("tidemark_control"))
                ctl.migrate()
                ctl.upsert_stream(cfg)
                t0 = time.perf_counter()
                write_snapshot(cfg, ctl, rows, mixed=mixed)
                consolidate_stream(cfg, spark=spark)        # loads the first version
                print(f"{rows:>11,} rows, {path}: first version written and loaded in "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
                pristine = work / f"pristine-{rows}-{path}"
                for live, copy in saved(cfg, pristine):
                    if Path(live).exists():
                        shutil.copytree(live, copy)
                key_range = min(sizes) if args.spread == "shared" else rows
                if mixed:
                    upper, counts = land_mixed(cfg, ctl, rows, args.changes, key_range, new_from=max(sizes) + 1)
                    setups[(rows, path)] = (cfg, ctl, pristine, upper, counts)
                else:
                    upper, net = land_batch(cfg, ctl, args.changes, key_range, new_from=max(sizes) + 1)
                    counts = {"public.accounts": rows - args.changes * 2 // 10 + (args.changes - args.changes * 8 // 10)}
                    setups[(rows, path)] = (cfg, ctl, pristine, upper, counts)
                    if path != "hist":
                        nets[rows] = net
        phases = Phases(spark)
        times: dict[tuple, list[float]] = {}
        breakdown: dict[tuple, list[dict]] = {}
        jobs: dict[tuple, list[int]] = {}
        tasks: dict[tuple, list[int]] = {}
        cpu: dict[tuple, list[float]] = {}
        for rows in sizes:
            for path in paths:
                cfg, ctl, pristine, upper, counts = setups[(rows, path)]
                for _ in range(args.warmup):
                    restore(cfg, ctl, pristine)
                    t0 = time.perf_counter()
                    consolidate_stream(cfg, spark=spark)
                    print(f"  warm-up: {rows:>11,} rows, {path:>5}: {time.perf_counter() - t0:.2f} s (not counted)",
                          flush=True)
        for run in range(args.runs):
            for rows in sizes:
                for path in paths:
                    cfg, ctl, pristine, upper, counts = setups[(rows, path)]
                    restore(cfg, ctl, pristine)
                    j0, k0 = phases.jobs(), phases.tasks()
                    phases.take(0.0)
                    c0, t0 = tree_cpu(), time.perf_counter()
                    res = consolidate_stream(cfg, spark=spark)
                    took = time.perf_counter() - t0
                    cpu.setdefault((rows, path), []).append(tree_cpu() - c0)
                    times.setdefault((rows, path), []).append(took)
                    breakdown.setdefault((rows, path), []).append(phases.take(took))
                    jobs.setdefault((rows, path), []).append(phases.jobs() - j0)
                    tasks.setdefault((rows, path), []).append(phases.tasks() - k0)
                    assert res.frontier_after == upper, res
                    if run == 0:
                        got = {t: read_table(cfg, t).num_rows for t in counts}
                        assert got == counts, (path, got, counts)
                        if path == "hist":     # every changed key: its old version closed, the new one current
                            from tidemark.lake import read_history

                            current = read_history(cfg, "public.accounts", current=True).num_rows
                            assert current == counts["public.accounts"], (current, counts)
                    print(f"  run {run + 1}: {rows:>11,} rows, {path:>5}: {took:.2f} s "
                          f"({jobs[(rows, path)][-1]} Spark jobs, {tasks[(rows, path)][-1]} tasks)", flush=True)
                if rows not in nets:
                    continue
                copy = work / f"merge-{rows}"
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(work / f"pristine-{rows}-plain" / "public.accounts", copy)
                c0 = tree_cpu()
                took = merge_peer(str(copy), nets[rows], args.buckets)
                cpu.setdefault((rows, "merge"), []).append(tree_cpu() - c0)
                times.setdefault((rows, "merge"), []).append(took)
                print(f"  run {run + 1}: {rows:>11,} rows, deltalake MERGE of the net effect: {took:.2f} s", flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\nbatch of {args.changes:,} changes ({args.spread} keys), {args.buckets} buckets, "
              f"medians of {args.runs} (after {args.warmup} untimed run(s) per size and shape, {args.master}; "
              f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after):")
        print(f"  {'table rows':>11}  {'shape':>6}  {'Tidemark':>9}  {'MERGE':>8}  {'ratio':>6}  {'changes/s':>10}  "
              "Spark jobs / tasks")
        for rows in sizes:
            for path in paths:
                t, m = med[(rows, path)], med.get((rows, "merge"))
                vs = f"{m:7.2f}s  {t / m:5.2f}x" if m and path in ("plain", "hist") else f"{'':>8}  {'':>6}"
                print(f"  {rows:>11,}  {path:>6}  {t:8.2f}s  {vs}  {args.changes / t:10,.0f}  "
                      f"{statistics.median(jobs[(rows, path)]):.0f} / {statistics.median(tasks[(rows, path)]):.0f}")
        if "plain" in paths and "hist" in paths:
            for rows in sizes:
                print(f"  history table kept vs plain, {rows:,} rows, same batch: "
                      f"{med[(rows, 'hist')] / med[(rows, 'plain')]:.2f}x wall, "
                      f"{statistics.median(cpu[(rows, 'hist')]) / statistics.median(cpu[(rows, 'plain')]):.2f}x CPU "
                      "(target <= 1.3x)")
        if "plain" in paths and "mixed" in paths:
            for rows in sizes:
                print(f"  mixed vs plain, {rows:,} rows, same number of changes: "
                      f"{med[(rows, 'mixed')] / med[(rows, 'plain')]:.2f}x (target <= 2x)")
        print("  CPU seconds (this process and its children: Spark's JVM and Python workers), medians:")
        for rows in sizes:
            for path in paths:
                t = statistics.median(cpu[(rows, path)])
                m = statistics.median(cpu[(rows, "merge")]) if (rows, "merge") in cpu else None
                print(f"  {rows:>11,}  {path:>6}  {t:8.2f}s" + (f"  {m:7.2f}s  {t / m:5.2f}x" if m and path == "plain" else ""))
        if len(sizes) > 1:
            for path in paths:
                print(f"  {path}, {sizes[-1]:,} vs {sizes[0]:,} rows: {med[(sizes[-1], path)] / med[(sizes[0], path)]:.2f}x")
        print("\nwhere the time goes (median seconds per phase):")
        for key, runs in breakdown.items():
            labels = sorted({l for r in runs for l in r})
            print(f"  {key[0]:,} rows, {key[1]}:")
            for label in labels:
                print(f"    {statistics.median([r.get(label, 0.0) for r in runs]):7.2f}  {label}")
    finally:
        teardown(cluster, work, spark)
    return 0


if __name__ == "__main__":
    sys.exit(main())
