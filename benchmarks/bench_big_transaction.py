"""Benchmark: peak memory of the drain, the consolidation and `tidemark parity` against the size of ONE
transaction (issue 34, point 5), with default settings, in a real PostgreSQL.

Starts a private PostgreSQL cluster; for each size N, creates a pgbench-like table (``pgbench_accounts``:
an int key, two ints and an 84-character ``filler``; ``--wide`` adds a ~200-byte text), snapshots it
empty (`snapshot_stream`), commits ONE transaction inserting N rows, then runs, each in a fresh process
whose tree's RSS is sampled every 0.2 s (`bench_consolidate_memory.peak_rss`):

* ``tidemark drain`` (one Python process: its peak);
* ``tidemark consolidate`` with default settings (peaks of the driver JVM, the Python workers
  together, the largest single Python worker, and the CLI process);
* ``tidemark parity`` (one Python process: its peak), which must say the lake equals the source.

``--big-value`` instead commits one row holding a 64 MB ``bytea`` and a 22 MB ``text`` (the issue's
second case). Memory must follow configuration (``consolidate.max_batch_records`` /
``max_batch_bytes``), not the transaction's size. Not a test.

    .venv/bin/python benchmarks/bench_big_transaction.py --rows 300000 1000000 3000000
    .venv/bin/python benchmarks/bench_big_transaction.py --big-value
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg2
import yaml

from tidemark.config import parse_config
from tidemark.control import Control

from benchkit import BIG_WAL_PG, TreePeaks, drain_databases, teardown, work_dir
from tidemark.local.localpg import LocalCluster

KINDS = ("drain", "consolidate: driver JVM", "consolidate: Python workers", "consolidate: largest worker",
         "consolidate: CLI", "parity")


def sampled(cmd: list[str], env: dict) -> tuple[int, str, str, dict[str, float], float]:
    """Run ``cmd``; (returncode, stdout, stderr, peaks in MB, seconds). Peaks: ``jvm`` (java processes
    under it), ``workers`` (the Python processes under the JVM, together), ``worker`` (the largest one),
    ``root`` (the command's own process)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = TreePeaks(proc)
    out, err = proc.communicate()
    peaks = sampler.join()
    return proc.returncode, out, err, peaks, time.perf_counter() - t0


def one_case(home: Path, cluster: LocalCluster, ctl_dsn: str, i: int, rows: int, wide: bool, big_value: bool,
             env: dict) -> dict:
    from tidemark.capture.snapshot import snapshot_stream
    from tidemark.capture.source import apply_stream

    table = f"pgbench_accounts_{i}"
    stream = f"big_{i}"
    doc = {"stream": stream, "source": {"connection": "bench_src", "publication": f"big_pub_{i}", "slot": f"big_{i}",
                                        "tables": [f"public.{table}"]},
           "control": {"connection": "bench_ctl"}, "landing": {"url": str(home / stream / "landing")},
           "lake": {"path": str(home / stream / "lake")}}
    streams = home / stream / "streams"
    streams.mkdir(parents=True)
    (streams / f"{stream}.yaml").write_text(yaml.safe_dump(doc))
    conn = psycopg2.connect(cluster.dsn("bench_src"))
    conn.autocommit = True
    with conn.cursor() as cur:
        if big_value:
            cur.execute(f"CREATE TABLE {table} (aid int PRIMARY KEY, b bytea, t text)")
        else:
            cur.execute(f"CREATE TABLE {table} (aid int PRIMARY KEY, bid int, abalance int, filler char(84)"
                        + (", note text" if wide else "") + ")")
    cfg = parse_config(doc)
    apply_stream(cfg)
    snapshot_stream(cfg)
    t0 = time.perf_counter()
    with conn.cursor() as cur:
        if big_value:       # 64 MB of random-ish bytes (incompressible) and 22 MB of text, in one row
            cur.execute(f"""INSERT INTO {table} SELECT 1,
                              (SELECT string_agg(decode(md5(g::text) || md5((g + 1)::text), 'hex'), ''::bytea)
                                 FROM generate_series(1, (64 << 20) / 32) g),
                              (SELECT string_agg(md5(g::text), '') FROM generate_series(1, (22 << 20) / 32) g)""")
            rows = 1
        else:
            cur.execute(f"""INSERT INTO {table} SELECT g, mod(g, 100), 0, 'x'
                              {", repeat(md5(g::text), 6)" if wide else ""} FROM generate_series(1, %s) g""",
                        (rows,))
    conn.close()
    print(f"  {rows:,} rows inserted in one transaction in {time.perf_counter() - t0:.1f} s", flush=True)
    cli = [sys.executable, "-m", "tidemark.cli", "--streams", str(streams)]
    res = {"rows": rows}
    rc, out, err, peaks, took = sampled(cli + ["drain", stream], env)
    if rc:
        raise SystemExit(f"drain failed: {err[-3000:]}")
    res["drain"], res["drain s"] = peaks["root"], took
    seg = sum(f.stat().st_size for f in (home / stream / "landing").rglob("*.avro"))
    res["segments MB"] = seg / 2**20
    print(f"  drain: {took:.1f} s, {seg / 2**20:,.0f} MB of segments, peak RSS {peaks['root']:,.0f} MB", flush=True)
    rc, out, err, peaks, took = sampled(cli + ["consolidate", stream], env)
    if rc:
        raise SystemExit(f"consolidate failed: {err[-3000:]}")
    with Control(ctl_dsn) as ctl:
        st = ctl.stream(stream)
        ok = st.frontier == st.landed_upper
    res.update({"consolidate: driver JVM": peaks["jvm"], "consolidate: Python workers": peaks["workers"],
                "consolidate: largest worker": peaks["worker"], "consolidate: CLI": peaks["root"],
                "consolidate s": took, "frontier ok": ok})
    print(f"  consolidate: {took:.1f} s, frontier {'= landed upper' if ok else 'BEHIND'}; peak RSS JVM "
          f"{peaks['jvm']:,.0f} MB, workers {peaks['workers']:,.0f} MB (largest {peaks['worker']:,.0f} MB), "
          f"CLI {peaks['root']:,.0f} MB", flush=True)
    rc, out, err, peaks, took = sampled(cli + ["parity", stream], env)
    res["parity"], res["parity s"], res["parity ok"] = peaks["root"], took, rc == 0
    print(f"  parity: {took:.1f} s, {'ok' if rc == 0 else 'MISMATCH'}, peak RSS {peaks['root']:,.0f} MB", flush=True)
    if rc:
        print(out[-2000:], err[-2000:], file=sys.stderr)
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[300_000, 1_000_000, 3_000_000])
    parser.add_argument("--wide", action="store_true", help="add a ~200-byte text column")
    parser.add_argument("--big-value", action="store_true", help="one row of a 64 MB bytea and a 22 MB text")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    home = work_dir("tidemark-bench-big-txn-")
    cluster = LocalCluster(home / "pg", settings=BIG_WAL_PG)
    env = dict(os.environ, TIDEMARK_SPARK_LOG_LEVEL="ERROR")
    env.pop("TIDEMARK_SPARK_REMOTE", None)
    results = []
    try:
        cluster.start()
        _, _, ctl_dsn = drain_databases(cluster)
        with Control(ctl_dsn) as ctl:
            ctl.migrate()
        env.update({k: v for k, v in os.environ.items() if k.startswith("AIRFLOW_CONN_")})
        sizes = [1] if args.big_value else args.rows
        for i, n in enumerate(sizes):
            print(f"case {i}: " + ("one 64 MB bytea + 22 MB text row" if args.big_value else f"{n:,} rows"),
                  flush=True)
            results.append(one_case(home, cluster, ctl_dsn, i, n, args.wide, args.big_value, env))
        print("\npeak RSS (MB) against the transaction's size, default settings:")
        print(f"  {'rows':>10} {'seg MB':>7} " + " ".join(f"{k.replace('consolidate: ', 'cons. '):>14}"
                                                            for k in KINDS) + "  cons. s  ok")
        for r in results:
            print(f"  {r['rows']:>10,} {r['segments MB']:>7,.0f} " + " ".join(f"{r[k]:>14,.0f}" for k in KINDS)
                  + f"  {r['consolidate s']:>7.1f}  {r['frontier ok'] and r['parity ok']}")
        if len(results) > 1:
            a, b = results[0], results[-1]
            print(f"  {b['rows'] / a['rows']:.0f}x the rows: " + ", ".join(
                f"{k} {b[k] / a[k]:.2f}x" for k in KINDS if a[k]))
    finally:
        teardown(cluster, home, keep=args.keep)
    return 0 if all(r["frontier ok"] and r["parity ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
