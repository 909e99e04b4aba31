"""Benchmark: freshness under load. pgbench at ~``--tps`` for ``--minutes`` while drain and
consolidate run every minute, through the library, the way the DAGs schedule them.

Starts its own PostgreSQL cluster (``wal_level=logical``), ``pgbench -i -s 10``, a stream over the
four pgbench tables (``pgbench_history`` as REPLICA IDENTITY FULL), snapshots and loads them, then
runs ``pgbench -R TPS -c 4`` in the background. A sampler records ``(now, pg_current_wal_insert_lsn())``
every second: a transaction committed at that moment is in the lake once the consolidated frontier
passes that LSN, so each sample's **commit→lake lag** is the wall time from the sample to the end of
the consolidation whose frontier passed it. Every minute (like the drain DAG's cron) the loop drains,
then consolidates with a warm SparkSession. Prints, per minute, the lag p50 / p95 / max of the samples
the lake caught up with in that minute, and the backlog of samples still waiting; the target is a
p50 <= 2 minutes that does not grow.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg2

from tidemark.config import parse_config
from tidemark.local.localpg import LocalCluster, pg_bin_dir

from benchkit import local_spark, teardown, work_dir

TABLES = ["public.pgbench_accounts", "public.pgbench_branches", "public.pgbench_tellers", "public.pgbench_history"]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tps", type=int, default=1000)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--every", type=float, default=60.0, help="seconds between drain+consolidate starts")
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from tidemark.capture.drain import drain_stream
    from tidemark.capture.snapshot import snapshot_stream
    from tidemark.capture.source import apply_stream
    from tidemark.consolidate import consolidate_stream
    from tidemark.control import Control

    work = work_dir("tidemark-bench-freshness-")
    cluster = LocalCluster(work / "pg", settings={"fsync": "off", "max_replication_slots": "10",
                                                  "max_wal_senders": "10", "max_connections": "100"})
    cluster.start()
    spark = None
    bench = None
    try:
        src = cluster.ensure_database("fresh_source")
        cluster.ensure_database("tidemark_control")
        pgbench = str(Path(pg_bin_dir()) / "pgbench")
        subprocess.run([pgbench, "-i", "-s", str(args.scale), "-q", src], check=True, capture_output=True)
        conn = psycopg2.connect(src)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
        os.environ["AIRFLOW_CONN_FRESH_SOURCE"] = cluster.uri("fresh_source")
        os.environ["AIRFLOW_CONN_FRESH_CONTROL"] = cluster.uri("tidemark_control")
        cfg = parse_config({
            "stream": "fresh", "source": {"connection": "fresh_source", "publication": "fresh_pub",
                                          "slot": "fresh_slot", "tables": TABLES},
            "control": {"connection": "fresh_control"},
            "landing": {"url": str(work / "landing")}, "lake": {"path": str(work / "lake")},
            "drain": {"idle_timeout_seconds": 1}, "consolidate": {"buckets": 8},
        })
        Control(cluster.dsn("tidemark_control")).migrate()
        apply_stream(cfg)
        snapshot_stream(cfg)
        spark = local_spark(args.master, "bench-freshness", ("spark.sql.shuffle.partitions", "8"))
        consolidate_stream(cfg, spark=spark)           # loads the snapshot
        print(f"pgbench -s {args.scale} loaded; pgbench -R {args.tps} -c 4 for {args.minutes} min, "
              f"drain + consolidate every {args.every:.0f} s", flush=True)

        samples: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample():
            c = psycopg2.connect(src)
            c.autocommit = True
            with c.cursor() as cur:
                while not stop.is_set():
                    cur.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
                    samples.append((time.time(), int(cur.fetchone()[0])))
                    stop.wait(1.0)
            c.close()

        seconds = int(args.minutes * 60)
        bench = subprocess.Popen([pgbench, "-n", "-c", "4", "-j", "2", "-R", str(args.tps), "-T", str(seconds), src],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t_start = time.time()
        done_upto = 0                  # samples[:done_upto] are in the lake
        print(f"{'minute':>6} {'drain s':>8} {'consol s':>9} {'changes':>9} {'caught':>7} {'p50 lag':>8} "
              f"{'p95 lag':>8} {'max lag':>8} {'waiting':>8}", flush=True)
        per_minute = []
        tick = 0
        while True:
            tick += 1
            t0 = time.time()
            drained = [drain_stream(cfg)]      # one run lands everything committed before it, in segments
            t1 = time.time()
            res = consolidate_stream(cfg, spark=spark)
            t2 = time.time()
            frontier = res.frontier_after or 0
            lags = []
            while done_upto < len(samples) and samples[done_upto][1] < frontier:
                lags.append(t2 - samples[done_upto][0])
                done_upto += 1
            n = sum(d.records for d in drained)
            waiting = len(samples) - done_upto
            row = (tick, t1 - t0, t2 - t1, n, len(lags), statistics.median(lags) if lags else float("nan"),
                   pct(lags, 0.95) if lags else float("nan"), max(lags) if lags else float("nan"), waiting)
            per_minute.append(row)
            print(f"{row[0]:>6} {row[1]:8.1f} {row[2]:9.1f} {row[3]:>9,} {row[4]:>7} {row[5]:7.1f}s {row[6]:7.1f}s "
                  f"{row[7]:7.1f}s {row[8]:>8}", flush=True)
            if bench.poll() is not None and done_upto >= len(samples) - 2:
                break
            if time.time() - t_start > seconds + 15 * args.every:
                print("the lake did not catch up within 15 rounds after the load ended", flush=True)
                break
            time.sleep(max(0.0, args.every - (time.time() - t0)))
        stop.set()
        out = bench.communicate()[0] if bench.poll() is not None else ""
        tps = [line for line in out.splitlines() if line.startswith("tps")]
        all_lags = [r[5] for r in per_minute if r[4]]
        print(f"pgbench: {tps[0] if tps else '?'}")
        if all_lags:
            print(f"per-minute p50 lag: first {all_lags[0]:.1f} s, median {statistics.median(all_lags):.1f} s, "
                  f"last under load {all_lags[min(len(all_lags), int(args.minutes)) - 1]:.1f} s (target p50 <= 120 s)")
    finally:
        if bench is not None and bench.poll() is None:
            bench.kill()
        teardown(cluster, work, spark)
    return 0


if __name__ == "__main__":
    sys.exit(main())
