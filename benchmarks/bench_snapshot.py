"""Benchmark: snapshot-copy rows/s against raw ``COPY ... TO STDOUT`` into /dev/null.

Starts its own PostgreSQL cluster (`LocalCluster`), loads ``pgbench -i -s SCALE`` (5 million rows in
``pgbench_accounts`` at scale 50), then times, alternately and ``--runs`` times each:

* raw:      ``psql -c "COPY pgbench_accounts TO STDOUT" > /dev/null``
* snapshot: ``snapshot_stream`` of ``pgbench_accounts`` (new slot with an exported snapshot, parallel
            ctid chunks, COPY CSV -> Arrow -> Parquet files in a local landing directory)

and prints the medians and their ratio. Target: snapshot >= 0.25x raw COPY.

``--mode table``: the online re-snapshot of that one table on a running stream (its initial
snapshot taken once, its slot kept; each run copies the table alone at its own consistent LSN
through a temporary slot, ``snapshot_stream(..., mode="table")``), against the same raw COPY.
``--scale 10`` is the issue's 1 M-row table.

``--mode lost-slot``: a running stream whose lake holds the table (initial snapshot, consolidated
once with local Spark); each run changes ``--changed`` (default 1 %) of the rows at random keys,
drops the slot and times a resend twice: as before (every row copied) and by key-range checksums
(``mode="resend"``: checksums in PostgreSQL and over the lake's files, then only the ranges that
differ copied), each followed by the consolidation that loads it (timed), printing rows re-copied
against rows in the table beside raw COPY; the lake's row count is checked against the source's.

``--mode rename``: a running stream whose lake holds the table; each run renames one of its columns
twice, with 2,000 rows updated around each rename (each time after a batch of the same updates without
a rename, consolidated untimed): once followed in place (drain, then the
consolidation that renames the column in the lake, its changelog and history: timed), once the way a
rename had to be taken before (a re-snapshot of the table, then the consolidation that loads it:
both timed), beside raw COPY; the lake is checked against the source (names and rows) after each.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tidemark.config import parse_config
from tidemark.control import Control
from tidemark.local.localpg import LocalCluster, pg_bin_dir
from tidemark.capture.snapshot import snapshot_stream
from tidemark.capture.source import drop_slot


def _uri(cluster: LocalCluster, db: str) -> str:
    return cluster.uri(db)


def load_pgbench(cluster: LocalCluster, scale: int) -> int:
    """Initialise pgbench tables at ``scale``; return the number of rows in pgbench_accounts."""
    env = dict(os.environ, **cluster.libpq_env())
    cluster.ensure_database("bench")
    subprocess.run([str(pg_bin_dir() / "pgbench"), "-i", "-q", "-s", str(scale), "bench"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run(["psql", "-X", "-q", "-d", "bench", "-c", "VACUUM ANALYZE pgbench_accounts"], env=env, check=True)
    out = subprocess.run(["psql", "-X", "-At", "-d", "bench", "-c", "SELECT count(*) FROM pgbench_accounts"],
                         env=env, check=True, capture_output=True, text=True)
    return int(out.stdout.strip())


def time_raw_copy(cluster: LocalCluster) -> float:
    env = dict(os.environ, **cluster.libpq_env())
    start = time.perf_counter()
    with open(os.devnull, "wb") as null:
        subprocess.run(["psql", "-X", "-q", "-d", "bench", "-c", "COPY pgbench_accounts TO STDOUT"], env=env,
                       check=True, stdout=null)
    return time.perf_counter() - start


def _config(cluster: LocalCluster, landing: Path, stream: str, *, parallelism: int, chunk_pages: int):
    os.environ["AIRFLOW_CONN_BENCH_SOURCE"] = _uri(cluster, "bench")
    os.environ["AIRFLOW_CONN_BENCH_CONTROL"] = _uri(cluster, "tidemark_control")
    return parse_config({
        "stream": stream,
        "source": {"connection": "bench_source", "publication": f"pub_{stream}", "slot": f"slot_{stream}",
                   "tables": ["public.pgbench_accounts", "public.pgbench_branches"]},
        "control": {"connection": "bench_control"},
        "landing": {"url": str(landing)},
        "lake": {"path": str(landing / "lake")},
        "snapshot": {"parallelism": parallelism, "chunk_pages": chunk_pages},
    })


def time_table_snapshot(cfg) -> tuple[float, int]:
    """One online re-snapshot of pgbench_accounts on the running stream ``cfg``; the snapshot is then
    marked loaded (what the consolidation does) so the next run is a fresh one."""
    start = time.perf_counter()
    result = snapshot_stream(cfg, tables=["public.pgbench_accounts"], mode="table")
    elapsed = time.perf_counter() - start
    with Control(_uri_dsn(cfg)) as ctl:
        ctl.mark_snapshots_loaded(cfg.stream, [result.snapshot_id])
    return elapsed, result.tables["public.pgbench_accounts"]


def lost_slot_run(cfg, cluster: LocalCluster, spark, rows: int, changed: float, seed: int, *,
                  by_ranges: bool = True) -> dict:
    """Change ``changed`` of the rows at random keys, drop the slot, resend, consolidate; timings.
    ``by_ranges=False``: the resend as it was before, every row copied (the comparison left out)."""
    import random
    from unittest import mock

    import psycopg2

    from tidemark.capture import ranges
    from tidemark.consolidate import consolidate_stream
    from tidemark.lake import read_table

    ids = random.Random(seed).sample(range(1, rows + 1), max(1, int(rows * changed)))
    drop_slot(cfg)
    with psycopg2.connect(_uri(cluster, "bench")) as conn, conn.cursor() as cur:
        cur.execute("UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = ANY(%s)", (ids,))
    start = time.perf_counter()
    with mock.patch.object(ranges, "compare", ranges.compare if by_ranges else (lambda *a, **k: None)):
        result = snapshot_stream(cfg, mode="resend")
    resend_s = time.perf_counter() - start
    start = time.perf_counter()
    consolidate_stream(cfg, spark=spark)
    load_s = time.perf_counter() - start
    lake_rows = read_table(cfg, "public.pgbench_accounts").num_rows
    from tidemark.capture.snapshot import load_manifest
    from tidemark.landing.store import open_store

    copy = result.copies["public.pgbench_accounts"]
    store = open_store(cfg.landing.url)
    found = load_manifest(store, cfg.stream, result.snapshot_id)["tables"]["public.pgbench_accounts"].get("ranges", {})
    return {"changed": len(ids), "resend_s": resend_s, "load_s": load_s, "lake_rows": lake_rows, **copy,
            "lake_s": found.get("lake_s"), "source_s": found.get("source_s")}


def _uri_dsn(cfg) -> str:
    from tidemark.control import control_dsn

    return control_dsn(cfg)


def time_snapshot(cluster: LocalCluster, landing: Path, *, parallelism: int, chunk_pages: int) -> tuple[float, int]:
    stream = f"bench_{secrets.token_hex(3)}"
    os.environ["AIRFLOW_CONN_BENCH_SOURCE"] = _uri(cluster, "bench")
    os.environ["AIRFLOW_CONN_BENCH_CONTROL"] = _uri(cluster, "tidemark_control")
    cfg = parse_config({
        "stream": stream,
        "source": {"connection": "bench_source", "publication": "bench_pub", "slot": f"slot_{stream}",
                   "tables": ["public.pgbench_accounts"]},
        "control": {"connection": "bench_control"},
        "landing": {"url": str(landing)},
        "lake": {"path": str(landing / "lake")},
        "snapshot": {"parallelism": parallelism, "chunk_pages": chunk_pages},
    })
    start = time.perf_counter()
    result = snapshot_stream(cfg)
    elapsed = time.perf_counter() - start
    drop_slot(cfg)
    shutil.rmtree(landing / stream, ignore_errors=True)
    return elapsed, result.tables["public.pgbench_accounts"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=50, help="pgbench scale (100k rows each; default 50)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--chunk-pages", type=int, default=2000)
    parser.add_argument("--home", help="directory for the cluster and landing files (default: a temp dir)")
    parser.add_argument("--mode", choices=["initial", "table", "lost-slot", "rename"], default="initial",
                        help="initial: a new stream's snapshot; table: the online re-snapshot of the table; "
                             "lost-slot: a resend by key-range checksums after the slot was lost; "
                             "rename: RENAME COLUMN followed in place against a re-snapshot of the table")
    parser.add_argument("--changed", type=float, default=0.01, help="lost-slot: share of rows changed (0.01)")
    args, _ = parser.parse_known_args()

    home = Path(args.home or tempfile.mkdtemp(prefix="tidemark-bench-snapshot-"))
    home.mkdir(parents=True, exist_ok=True)
    os.chmod(home, 0o755)
    cluster = LocalCluster(home / "cluster", settings={"fsync": "off", "synchronous_commit": "off",
                                                       "full_page_writes": "off", "shared_buffers": "1GB"})
    cluster.start()
    try:
        with Control(cluster.ensure_database("tidemark_control")) as ctl:
            ctl.migrate()
        print(f"loading pgbench -i -s {args.scale} ...", flush=True)
        rows = load_pgbench(cluster, args.scale)
        print(f"pgbench_accounts: {rows} rows; {args.runs} runs each, parallelism {args.parallelism}, "
              f"chunk_pages {args.chunk_pages}", flush=True)
        time_raw_copy(cluster)  # warm the cache once
        if args.mode == "lost-slot":
            return _lost_slot(args, cluster, home, rows)
        if args.mode == "rename":
            return _rename(args, cluster, home, rows)
        running = None
        if args.mode == "table":   # a running stream: its initial snapshot once, its slot kept
            running = _config(cluster, home / "landing", f"bench_{secrets.token_hex(3)}",
                              parallelism=args.parallelism, chunk_pages=args.chunk_pages)
            snapshot_stream(running)
        raw_times, snap_times = [], []
        for i in range(args.runs):
            raw_times.append(time_raw_copy(cluster))
            if running is not None:
                elapsed, copied = time_table_snapshot(running)
            else:
                elapsed, copied = time_snapshot(cluster, home / "landing", parallelism=args.parallelism,
                                                chunk_pages=args.chunk_pages)
            if copied != rows:
                print(f"ERROR: snapshot copied {copied} rows, table has {rows}")
                return 1
            snap_times.append(elapsed)
            print(f"run {i + 1}: raw COPY {raw_times[-1]:.2f}s ({rows / raw_times[-1]:,.0f} rows/s)   "
                  f"snapshot {elapsed:.2f}s ({rows / elapsed:,.0f} rows/s)", flush=True)
        raw_rate = rows / statistics.median(raw_times)
        snap_rate = rows / statistics.median(snap_times)
        print()
        print(f"{'':24}{'median s':>10}{'rows/s':>14}")
        print(f"{'raw COPY to /dev/null':24}{statistics.median(raw_times):>10.2f}{raw_rate:>14,.0f}")
        label = "tidemark snapshot" if running is None else "online table re-snapshot"
        print(f"{label:24}{statistics.median(snap_times):>10.2f}{snap_rate:>14,.0f}")
        ratio = snap_rate / raw_rate
        print(f"ratio snapshot/raw: {ratio:.2f}x (target >= 0.25x) -> {'OK' if ratio >= 0.25 else 'BELOW TARGET'}")
        return 0
    finally:
        cluster.stop()
        if not args.home:
            shutil.rmtree(home, ignore_errors=True)


def _running_stream(args, cluster: LocalCluster, home: Path, app: str):
    """(a local Spark session, a stream whose lake holds pgbench_accounts: snapshotted, consolidated)."""
    from benchkit import local_spark
    from tidemark.consolidate import consolidate_stream

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)      # the executors' Python has pyarrow
    spark = local_spark("local[2]", app, ("spark.sql.shuffle.partitions", "4"), ("spark.driver.memory", "2g"))
    cfg = _config(cluster, home / "landing", f"bench_{secrets.token_hex(3)}", parallelism=args.parallelism,
                  chunk_pages=args.chunk_pages)
    snapshot_stream(cfg)
    consolidate_stream(cfg, spark=spark)      # the lake holds the table
    return spark, cfg


def _lost_slot(args, cluster: LocalCluster, home: Path, rows: int) -> int:
    spark, cfg = _running_stream(args, cluster, home, "bench-lost-slot")
    try:
        out = []
        for i in range(args.runs):
            raw = time_raw_copy(cluster)
            whole = lost_slot_run(cfg, cluster, spark, rows, args.changed, seed=1000 + i, by_ranges=False)
            r = lost_slot_run(cfg, cluster, spark, rows, args.changed, seed=i)
            for x in (whole, r):
                if x["lake_rows"] != rows:
                    print(f"ERROR: the lake holds {x['lake_rows']} rows, the source {rows} ({x})")
                    return 1
            out.append((raw, whole, r))
            print(f"run {i + 1}: {r['changed']:,} rows changed; resend by ranges re-copied {r['rows_copied']:,} rows "
                  f"of {r['rows']:,} ({r['ranges_copied']:,} of {r['ranges']:,} key ranges) in {r['resend_s']:.2f}s "
                  f"(checksums: lake {r['lake_s']:.2f}s, source {r['source_s']:.2f}s), loaded in {r['load_s']:.2f}s; "
                  f"full resend {whole['resend_s']:.2f}s, loaded in {whole['load_s']:.2f}s; raw COPY {raw:.2f}s",
                  flush=True)
        med = lambda xs: statistics.median(xs)  # noqa: E731
        print()
        print(f"{'':34}{'snapshot s':>11}{'load s':>9}{'rows copied':>14}")
        print(f"{'raw COPY to /dev/null':34}{med([o[0] for o in out]):>11.2f}{'':>9}{rows:>14,}")
        print(f"{'full resend (every row)':34}{med([o[1]['resend_s'] for o in out]):>11.2f}"
              f"{med([o[1]['load_s'] for o in out]):>9.2f}{rows:>14,}")
        print(f"{'resend by key-range checksums':34}{med([o[2]['resend_s'] for o in out]):>11.2f}"
              f"{med([o[2]['load_s'] for o in out]):>9.2f}{int(med([o[2]['rows_copied'] for o in out])):>14,}")
        return 0
    finally:
        spark.stop()




def _rename(args, cluster: LocalCluster, home: Path, rows: int) -> int:
    import psycopg2
    from psycopg2 import sql

    from tidemark.capture.drain import drain_stream
    from tidemark.consolidate import consolidate_stream
    from tidemark.lake import read_table

    spark, cfg = _running_stream(args, cluster, home, "bench-rename")
    names = ["filler", "note"]

    def rename(i: int, ddl: bool = True) -> None:
        with psycopg2.connect(_uri(cluster, "bench")) as conn, conn.cursor() as cur:
            cur.execute("UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid %% 1000 = %s", (i % 1000,))
            if ddl:
                cur.execute(sql.SQL("ALTER TABLE pgbench_accounts RENAME COLUMN {} TO {}").format(
                    sql.Identifier(names[i % 2]), sql.Identifier(names[(i + 1) % 2])))
            cur.execute("UPDATE pgbench_accounts SET abalance = abalance - 1 WHERE aid %% 997 = %s", (i % 997,))
        drain_stream(cfg)

    def settle(i: int) -> None:
        """The same changes without the rename, consolidated untimed: each timed run starts from a
        lake that a small batch merged last (the first batch after a load also writes the changelog
        feed's base and reads every file: it would be counted to whichever came first)."""
        rename(i, ddl=False)
        consolidate_stream(cfg, spark=spark)

    def check(i: int) -> None:
        lake = read_table(cfg, "public.pgbench_accounts")
        if lake.num_rows != rows or names[(i + 1) % 2] not in lake.column_names:
            raise SystemExit(f"ERROR: the lake holds {lake.num_rows} rows, columns {lake.column_names}")

    try:
        out = []
        for i in range(args.runs):
            raw = time_raw_copy(cluster)
            settle(500 + 2 * i)
            rename(2 * i)
            start = time.perf_counter()
            consolidate_stream(cfg, spark=spark)
            in_place = time.perf_counter() - start
            check(2 * i)
            settle(501 + 2 * i)
            rename(2 * i + 1)
            start = time.perf_counter()
            snapshot_stream(cfg, tables=["public.pgbench_accounts"], mode="table")
            copy_s = time.perf_counter() - start
            start = time.perf_counter()
            consolidate_stream(cfg, spark=spark)
            load_s = time.perf_counter() - start
            check(2 * i + 1)
            out.append((raw, in_place, copy_s, load_s))
            print(f"run {i + 1}: renamed in place {in_place:.2f}s; by a re-snapshot: copy {copy_s:.2f}s + "
                  f"load {load_s:.2f}s = {copy_s + load_s:.2f}s; raw COPY {raw:.2f}s", flush=True)
        med = lambda k: statistics.median(o[k] for o in out)  # noqa: E731
        print()
        print(f"{'':36}{'median s':>10}")
        print(f"{'raw COPY to /dev/null':36}{med(0):>10.2f}")
        print(f"{'RENAME COLUMN followed in place':36}{med(1):>10.2f}")
        print(f"{'RENAME COLUMN by a re-snapshot':36}{statistics.median(o[2] + o[3] for o in out):>10.2f}"
              f"  (copy {med(2):.2f} + load {med(3):.2f})")
        print(f"ratio in place / re-snapshot: {med(1) / statistics.median(o[2] + o[3] for o in out):.2f}x")
        return 0
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
