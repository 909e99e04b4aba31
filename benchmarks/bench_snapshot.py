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
    parser.add_argument("--mode", choices=["initial", "table"], default="initial",
                        help="initial: a new stream's snapshot; table: the online re-snapshot of the table")
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


if __name__ == "__main__":
    sys.exit(main())
