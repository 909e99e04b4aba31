"""Benchmark: a long-running stream stays bounded with `tidemark maintain` (issue 36).

Starts its own PostgreSQL cluster (``wal_level=logical``), ``pgbench -i -s SCALE``, a stream over
the four pgbench tables (``pgbench_history`` as REPLICA IDENTITY FULL) with ``lake.retention`` set by
``--retention`` (default: the configuration's default), snapshots and loads them. Then ``--batches``
times: ``pgbench -R RATE -T BATCH_SECONDS`` (one batch, like one scheduled minute), drain,
consolidate (timed, warm SparkSession); every ``--maintain-every`` batches `tidemark.maintain`
(timed). Prints, at each maintenance and at the end:

* **lake bytes on disk ÷ live bytes**: every file under the lake path (data and log) against the
  data files the current versions of the lake, changelog and history tables reference (goal
  <= 1.5 + what the retention window holds: printed beside it, the bytes the versions inside the
  window reference beyond the live ones, ÷ live bytes);
* **Parquet files per table** (the lake tables' current versions): bounded, not growing with batches;
* **landing bytes** on disk (segments and the changelog feed): bounded by the retention;
* **consolidation time**, median of the first 10 batches against the last 10 (goal <= 1.1x);
* **bytes rewritten per byte changed**: per batch, the bytes of the data files the consolidation
  added to the lake tables ÷ the bytes it added to their changelogs (the changed rows, in Parquet),
  median over the batches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg2

from tidemark.config import parse_config
from tidemark.local.localpg import LocalCluster, pg_bin_dir

from benchkit import local_spark, teardown, work_dir

TABLES = ["public.pgbench_accounts", "public.pgbench_branches", "public.pgbench_tellers", "public.pgbench_history"]


def tree(path: str) -> dict[str, int]:
    """{file: bytes} of every file under ``path``."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            try:
                out[p] = os.path.getsize(p)
            except OSError:
                pass
    return out


def data_files(tables_dirs: list[str]) -> dict[str, int]:
    """{file: bytes} of the Parquet data files (not the log's checkpoints) under these table directories."""
    return {p: n for d in tables_dirs for p, n in tree(d).items()
            if p.endswith(".parquet") and "/_delta_log/" not in p}


def live(cfg) -> tuple[int, int, dict[str, int]]:
    """(bytes the current versions of every lake, changelog and history table reference, bytes any
    version inside the retention window references, {lake table: its current number of files})."""
    import pyarrow as pa

    from tidemark.lake import changelog_uri, history_uri, open_delta, storage_options, table_uri
    from tidemark.lake.delta import log_files
    from tidemark.lake.retention import table_window, window_start_ms

    opts, total, window, files = storage_options(cfg), 0, 0, {}
    for t in TABLES:
        for kind, uri in (("table", table_uri(cfg, t)), ("changelog", changelog_uri(cfg, t)),
                          ("history", history_uri(cfg, t))):
            dt = open_delta(uri, opts)
            if dt is None:
                continue
            adds = pa.table(dt.get_add_actions(flatten=True))
            total += sum(adds.column("size_bytes").to_pylist())
            if kind == "table":
                files[t] = adds.num_rows
            _, _, inside = table_window(dt, cfg.stream, window_start_ms(cfg))
            # the files of the first version inside the window, then every file a later one adds (from the
            # log's entries: loading each version of a days-long window would take minutes)
            dt.load_as_version(inside[0])
            a = pa.table(dt.get_add_actions(flatten=True))
            seen: dict[str, int] = dict(zip(a.column("path").to_pylist(), a.column("size_bytes").to_pylist()))
            for v in inside[1:]:
                seen.update((path, size) for op, path, size in log_files(uri, opts, v) if op == "add")
            window += sum(seen.values())
    return total, window, files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--rate", type=int, default=500, help="pgbench -R: transactions per second")
    parser.add_argument("--batch-seconds", type=float, default=60.0, help="pgbench -T of one batch")
    parser.add_argument("--maintain-every", type=int, default=10)
    parser.add_argument("--retention", default=None, help='lake.retention, e.g. "1 minute" (default: the default)')
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from tidemark.capture.drain import drain_stream
    from tidemark.capture.snapshot import snapshot_stream
    from tidemark.capture.source import apply_stream
    from tidemark.consolidate import consolidate_stream
    from tidemark.control import Control
    from tidemark.lake import changelog_uri, table_uri
    from tidemark.maintain import maintain

    work = work_dir("tidemark-bench-soak-")
    cluster = LocalCluster(work / "pg", settings={"fsync": "off", "synchronous_commit": "off",
                                                  "max_replication_slots": "10", "max_wal_senders": "10"})
    cluster.start()
    spark = None
    try:
        src = cluster.ensure_database("soak_source")
        cluster.ensure_database("tidemark_control")
        pgbench = str(Path(pg_bin_dir()) / "pgbench")
        subprocess.run([pgbench, "-i", "-s", str(args.scale), "-q", src], check=True, capture_output=True)
        with psycopg2.connect(src) as conn, conn.cursor() as cur:
            cur.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
        os.environ["AIRFLOW_CONN_SOAK_SOURCE"] = cluster.uri("soak_source")
        os.environ["AIRFLOW_CONN_SOAK_CONTROL"] = cluster.uri("tidemark_control")
        lake = {"path": str(work / "lake")}
        if args.retention:
            lake["retention"] = args.retention
        cfg = parse_config({
            "stream": "soak", "source": {"connection": "soak_source", "publication": "soak_pub",
                                         "slot": "soak_slot", "tables": TABLES},
            "control": {"connection": "soak_control"},
            "landing": {"url": str(work / "landing")}, "lake": lake,
            "drain": {"idle_timeout_seconds": 1}, "consolidate": {"buckets": args.buckets},
        })
        Control(cluster.dsn("tidemark_control")).migrate()
        apply_stream(cfg)
        snapshot_stream(cfg)
        spark = local_spark(args.master, "bench-soak", ("spark.sql.shuffle.partitions", "4"))
        consolidate_stream(cfg, spark=spark)
        print(f"pgbench -s {args.scale} loaded; {args.batches} batches of pgbench -R {args.rate} -T "
              f"{args.batch_seconds:g}; maintain every {args.maintain_every}; lake.retention "
              f"{cfg.lake_retention_seconds:g} s", flush=True)
        lake_dirs = [table_uri(cfg, t) for t in TABLES]
        log_dirs = [changelog_uri(cfg, t) for t in TABLES]
        times, amplification, maint = [], [], []
        # window/live: what the versions inside the retention window reference beyond the live files
        # log/live: the part of disk/live that is the tables' Delta logs (commits and checkpoints)
        print(f"{'batch':>5} {'consol s':>8} {'maint s':>7} {'disk/live':>9} {'log/live':>8} {'window/live':>10} "
              f"{'lake MB':>8} {'landing MB':>10} {'files per table':>16}", flush=True)

        def figures(batch: int, m: float | None) -> None:
            live_bytes, window_bytes, files = live(cfg)
            on_disk = tree(str(work / "lake"))
            disk = sum(on_disk.values())
            log = sum(n for p, n in on_disk.items() if f"{os.sep}_delta_log{os.sep}" in p)
            landing = sum(tree(str(work / "landing")).values())
            print(f"{batch:>5} {times[-1] if times else 0:8.1f} {'' if m is None else f'{m:7.1f}':>7} "
                  f"{disk / max(1, live_bytes):9.2f} {log / max(1, live_bytes):8.2f} "
                  f"{(window_bytes - live_bytes) / max(1, live_bytes):10.2f} "
                  f"{disk / 1e6:8.1f} {landing / 1e6:10.1f} "
                  f"{' '.join(str(files.get(t, 0)) for t in TABLES):>16}", flush=True)

        for b in range(1, args.batches + 1):
            subprocess.run([pgbench, "-n", "-c", "2", "-j", "1", "-R", str(args.rate), "-T",
                            str(max(1, int(args.batch_seconds))), src], check=True, capture_output=True)
            drain_stream(cfg)
            before_lake, before_log = data_files(lake_dirs), data_files(log_dirs)
            t0 = time.monotonic()
            consolidate_stream(cfg, spark=spark)
            times.append(time.monotonic() - t0)
            after_lake, after_log = data_files(lake_dirs), data_files(log_dirs)
            written = sum(n for p, n in after_lake.items() if p not in before_lake)
            changed = sum(n for p, n in after_log.items() if p not in before_log)
            if changed:
                amplification.append(written / changed)
            m = None
            if b % args.maintain_every == 0:
                t0 = time.monotonic()
                maintain(cfg)
                m = time.monotonic() - t0
                maint.append(m)
            if m is not None or b == args.batches:
                figures(b, m)
        first, last = statistics.median(times[:10]), statistics.median(times[-10:])
        print(f"consolidation median: first 10 {first:.2f} s, last 10 {last:.2f} s, ratio {last / first:.2f} "
              "(goal <= 1.1)")
        if amplification:
            print(f"bytes rewritten per byte changed (lake data files added / changelog bytes added), per batch: "
                  f"median {statistics.median(amplification):.1f}, max {max(amplification):.1f}")
        if maint:
            print(f"maintain: median {statistics.median(maint):.1f} s, max {max(maint):.1f} s")
        with Control(cluster.dsn("tidemark_control")) as ctl:      # as each batch recorded it (writecost)
            for t, rows in sorted(ctl.write_costs(cfg.stream, batches=args.batches).items()):
                amps = [r["added_bytes"] / r["change_bytes"] for r in rows if r["change_bytes"]]
                if amps:
                    print(f"{t}: recorded write amplification (lake bytes added / decoded change bytes) median "
                          f"{statistics.median(amps):.1f}, max {max(amps):.1f}; per batch median "
                          f"{statistics.median(r['added_bytes'] for r in rows) / 1e6:.2f} MB written, "
                          f"{statistics.median(r['change_records'] for r in rows):.0f} records changed, "
                          f"live {rows[-1]['live_bytes'] / 1e6:.2f} MB")
    finally:
        teardown(cluster, work, spark)
    return 0


if __name__ == "__main__":
    sys.exit(main())
