"""Benchmark: the drain's peak memory (RSS) for one huge transaction, at two transaction sizes.

Starts a private PostgreSQL cluster; for each size, commits ONE transaction inserting rows of about
1 kB until it holds that many bytes of row data, then drains it in a fresh Python process (so the
peak is the drain's own) into a local landing directory and prints that process's peak RSS
(``ru_maxrss``) beside the segment's size. The segment is spilled to disk as it is built and landed
from the file, so the peak should not grow with the transaction (target: under 300 MB for 1 GB).
Not a test.

    .venv/bin/python benchmarks/bench_drain_memory.py --sizes-mb 256 1024
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import psycopg2

from tidemark.config import parse_config
from tidemark.control import Control
from tidemark.local.localpg import LocalCluster
from tidemark.lsn import parse_lsn
from tidemark.capture.source import apply_stream

from benchkit import BIG_WAL_PG, drain_databases, teardown, work_dir

ROW_BYTES = 1024

CHILD = r"""
import json, resource, sys, time
from tidemark.config import parse_config
from tidemark.capture.drain import drain_stream
cfg = parse_config(json.loads(sys.argv[1]))
t = time.perf_counter()
res = drain_stream(cfg, max_changes=1 << 40, max_bytes=1 << 40)
print(json.dumps({"seconds": time.perf_counter() - t, "records": res.records, "bytes": res.byte_size,
                  "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--keep", action="store_true", help="keep the temporary cluster directory")
    args = ap.parse_args()

    home = work_dir("tidemark-bench-mem-")
    cluster = LocalCluster(home / "pg", settings=BIG_WAL_PG)
    rows_out = []
    try:
        cluster.start()
        src, ctl_db, ctl_dsn = drain_databases(cluster)
        with Control(ctl_dsn) as ctl:
            ctl.migrate()
        conn = psycopg2.connect(cluster.dsn(src))
        conn.autocommit = True
        for i, mb in enumerate(args.sizes_mb):
            table = f"big_{i}"
            doc = {"stream": f"mem_{i}", "source": {"connection": "bench_src", "publication": f"mem_pub_{i}",
                                                   "slot": f"mem_{i}", "tables": [f"public.{table}"]},
                   "control": {"connection": "bench_ctl"}, "landing": {"url": str(home / "landing")},
                   "lake": {"path": str(home / "lake")}}
            with conn.cursor() as cur:
                cur.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, pad text)")
            cfg = parse_config(doc)
            apply_stream(cfg)
            with conn.cursor() as cur, Control(ctl_dsn) as ctl:
                cur.execute("SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')",
                            (cfg.source.slot,))
                lsn = parse_lsn(cur.fetchone()[0])
                ctl.update_stream(cfg.stream, consistent_lsn=lsn, landed_upper=lsn)
                rows = mb * 1024 * 1024 // ROW_BYTES
                t = time.perf_counter()
                cur.execute(f"""INSERT INTO {table} SELECT g, repeat(md5(g::text), {ROW_BYTES // 32})
                                 FROM generate_series(1, %s) g""", (rows,))
                print(f"{mb} MB: one transaction of {rows:,} rows inserted in {time.perf_counter() - t:.1f}s",
                      flush=True)
            child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(doc)], capture_output=True, text=True,
                                   env=os.environ.copy())
            if child.returncode != 0:
                raise SystemExit(child.stderr[-3000:])
            out = json.loads(child.stdout.strip().splitlines()[-1])
            if out["records"] != rows:
                raise SystemExit(f"drain landed {out['records']} records, expected {rows}")
            rows_out.append((mb, out))
            print(f"{mb} MB: drained {out['records']:,} records into a {out['bytes'] / 2**20:,.0f} MiB segment in "
                  f"{out['seconds']:.1f}s; peak RSS {out['peak_rss_kb'] / 1024:,.0f} MiB", flush=True)
            with conn.cursor() as cur:          # free the disk before the next size
                cur.execute("SELECT pg_drop_replication_slot(%s)", (cfg.source.slot,))
                cur.execute(f"DROP TABLE {table}")
            shutil.rmtree(home / "landing", ignore_errors=True)
        print()
        print(f"{'transaction':>12} {'segment':>10} {'records':>11} {'seconds':>8} {'peak RSS':>9}")
        for mb, out in rows_out:
            print(f"{mb:>9} MB {out['bytes'] / 2**20:>7,.0f} MiB {out['records']:>11,} {out['seconds']:>8.1f} "
                  f"{out['peak_rss_kb'] / 1024:>5,.0f} MiB")
        print("target: peak RSS under 300 MiB for 1 GB, independent of the transaction's size")
    finally:
        teardown(cluster, home, keep=args.keep)


if __name__ == "__main__":
    main()
