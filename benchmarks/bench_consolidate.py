"""Benchmark: consolidating the same batch of changes into a 1 M-row and a 10 M-row table.

Starts its own PostgreSQL cluster for the control database, builds each table's first version
directly as snapshot Parquet files (loaded by the consolidation as the table's first version), then
lands the same batch of ``--changes`` changes as segments written with `SegmentBuilder`:

* 60 % updates and 20 % deletes of random existing keys in ``1..1M`` (keys both tables hold),
* 20 % inserts of new keys above both tables' ranges,

in transactions of 100 changes. Both tables use the same bucket-count policy (``--buckets``) and file
size. Each timed run restores the table's first version and the frontier, then runs
`consolidate_stream`; runs alternate between the two sizes. Prints the medians, their ratio
(target: large <= 1.5 x small) and changes/s.

The batch's keys lie in the range both tables share, so in the 10 M table they touch about a tenth
of each bucket's files; a batch spread uniformly over all 10 M keys would touch every file of a
copy-on-write table (``--spread all`` measures that case too).
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
import tempfile
import time
from pathlib import Path

from tidemark.config import parse_config
from tidemark.control import Control
from tidemark.local.localpg import LocalCluster
from tidemark.pgtypes import Column, TableSchema
from tidemark.landing.segments import SegmentBuilder, Update, checksum, segment_name
from tidemark.landing.store import open_store, stream_keys

SHAPE = TableSchema(schema="public", name="accounts", oid=1, columns=(
    Column("id", "int64", "int8", 20, key=True, nullable=False), Column("a", "int32", "int4", 23),
    Column("b", "text", "text", 25), Column("c", "float64", "float8", 701)))
L0 = 1_000_000


def write_snapshot(cfg, ctl: Control, rows: int, chunk: int = 1_000_000) -> None:
    """The table's first version as snapshot files + manifest + a 'complete' snapshot row."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tidemark.pgtypes import arrow_schema

    store = open_store(cfg.landing.url)
    rng = np.random.default_rng(1)
    files = []
    for n, lo in enumerate(range(0, rows, chunk)):
        ids = np.arange(lo + 1, min(rows, lo + chunk) + 1, dtype=np.int64)
        t = pa.Table.from_arrays([pa.array(ids), pa.array(rng.integers(0, 1 << 30, len(ids)).astype(np.int32)),
                                  pa.array(np.char.add("acct-", ids.astype(str)).astype(object)),
                                  pa.array(rng.random(len(ids)))], schema=arrow_schema(SHAPE))
        buf = io.BytesIO()
        pq.write_table(t, buf)
        key = f"{stream_keys(cfg.stream)['snapshots']}s1/public.accounts/chunk-{n:06d}.parquet"
        store.put(key, buf.getvalue())
        files.append(key)
    entry = {"public.accounts": {"rows": rows, "files": files, "table_schema": SHAPE.to_json()}}
    with ctl.tx() as cur:
        cur.execute("""INSERT INTO tidemark.snapshots (stream, snapshot_id, lsn, mode, status, tables, finished_at)
                       VALUES (%s, 's1', %s, 'initial', 'complete', %s, now())""", (cfg.stream, L0, json.dumps(entry)))
    ctl.update_stream(cfg.stream, consistent_lsn=L0, landed_upper=L0)


def land_batch(cfg, ctl: Control, changes: int, key_range: int, new_from: int, seed: int = 7) -> int:
    """Land the batch as segments of ~10k changes; return the upper."""
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
        builder.add_transaction(ups)
        in_seg += 100
        if in_seg >= 10_000 or start + 100 >= len(ops):
            upper = time_ + 1
            data = builder.build(upper)
            name = segment_name(seq, lower, upper)
            uri = store.put(stream_keys(cfg.stream)["segments"] + name, data)
            from tidemark.control import Segment

            ctl.register_segment(Segment(cfg.stream, seq, lower, upper, uri, builder.record_count, builder.txn_count,
                                         len(data), checksum(data)))
            seq, lower, in_seg = seq + 1, upper, 0
            builder = SegmentBuilder(cfg.stream, seq, lower)
    return lower


def make_cfg(cluster: LocalCluster, work: Path, rows: int, buckets: int):
    stream = f"bench_{rows}_{secrets.token_hex(2)}"
    os.environ["AIRFLOW_CONN_BENCH_SOURCE"] = cluster.uri("bench_source")
    os.environ["AIRFLOW_CONN_BENCH_CONTROL"] = cluster.uri("tidemark_control")
    return parse_config({
        "stream": stream,
        "source": {"connection": "bench_source", "publication": "bench_pub", "slot": f"slot_{stream}",
                   "tables": ["public.accounts"]},
        "control": {"connection": "bench_control"},
        "landing": {"url": str(work / stream / "landing")},
        "lake": {"path": str(work / stream / "lake")},
        "consolidate": {"buckets": buckets},
    })


def restore(cfg, ctl: Control, pristine: Path) -> None:
    from tidemark.lake import changelog_uri, table_uri

    table = Path(table_uri(cfg, "public.accounts"))
    shutil.rmtree(table, ignore_errors=True)
    shutil.copytree(pristine, table)
    shutil.rmtree(changelog_uri(cfg, "public.accounts"), ignore_errors=True)
    ctl.reset_frontier(cfg.stream, L0)
    with ctl.tx() as cur:
        cur.execute("UPDATE tidemark.streams SET frontier = %s WHERE name = %s", (L0, cfg.stream))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=1_000_000)
    parser.add_argument("--large", type=int, default=10_000_000)
    parser.add_argument("--changes", type=int, default=100_000)
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--spread", choices=["shared", "all"], default="shared",
                        help="keys of the batch: in 1..small (shared, default) or over each whole table")
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from tidemark.consolidate import consolidate_stream
    from tidemark.lake import read_table, table_uri

    spark = (SparkSession.builder.master(args.master).appName("bench-consolidate")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", str(args.buckets))
             .config("spark.sql.session.timeZone", "UTC").config("spark.driver.memory", "6g")
             .config("spark.sql.execution.arrow.pyspark.enabled", "true").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    work = Path(tempfile.mkdtemp(prefix="tidemark-bench-consolidate-"))
    os.chmod(work, 0o755)
    cluster = LocalCluster(work / "pg", settings={"fsync": "off", "synchronous_commit": "off"})
    cluster.start()
    try:
        cluster.ensure_database("tidemark_control")
        cluster.ensure_database("bench_source")
        setups = {}
        for rows in (args.small, args.large):
            cfg = make_cfg(cluster, work, rows, args.buckets)
            ctl = Control(cluster.dsn("tidemark_control"))
            ctl.migrate()
            ctl.upsert_stream(cfg)
            t0 = time.perf_counter()
            write_snapshot(cfg, ctl, rows)
            consolidate_stream(cfg, spark=spark)        # loads the first version
            print(f"{rows:>11,} rows: first version written and loaded in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            pristine = work / f"pristine-{rows}"
            shutil.copytree(table_uri(cfg, "public.accounts"), pristine)
            key_range = args.small if args.spread == "shared" else rows
            upper = land_batch(cfg, ctl, args.changes, key_range, new_from=args.large + 1)
            setups[rows] = (cfg, ctl, pristine, upper)
        times: dict[int, list[float]] = {args.small: [], args.large: []}
        for run in range(args.runs):
            for rows in (args.small, args.large):
                cfg, ctl, pristine, upper = setups[rows]
                restore(cfg, ctl, pristine)
                t0 = time.perf_counter()
                res = consolidate_stream(cfg, spark=spark)
                times[rows].append(time.perf_counter() - t0)
                assert res.frontier_after == upper, res
                print(f"  run {run + 1}: {rows:>11,} rows: {times[rows][-1]:.2f} s", flush=True)
        expected = args.small - args.changes * 2 // 10 + (args.changes - args.changes * 8 // 10)
        got = read_table(setups[args.small][0], "public.accounts").num_rows
        assert got == expected, (got, expected)
        small, large = statistics.median(times[args.small]), statistics.median(times[args.large])
        print(f"batch of {args.changes:,} changes ({args.spread} keys), {args.buckets} buckets, medians of {args.runs}:")
        print(f"  {args.small:>11,} rows: {small:7.2f} s  {args.changes / small:10,.0f} changes/s")
        print(f"  {args.large:>11,} rows: {large:7.2f} s  {args.changes / large:10,.0f} changes/s")
        print(f"  ratio large/small: {large / small:.2f}  (target <= 1.5)")
    finally:
        spark.stop()
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
