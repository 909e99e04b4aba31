"""Benchmark: drain-and-land throughput against pg_recvlogical on the same changes.

Starts a private PostgreSQL cluster, creates ``2 * runs`` logical slots at the same point (one per run
per tool, so every run decodes the identical WAL range), generates a mix of row changes (inserts,
updates, deletes in transactions of 500 rows), then, run by run and alternating which goes first:

* ``pg_recvlogical -o proto_version=1 -o publication_names=... -f /dev/null --endpos END --no-loop``
* ``tidemark.capture.drain.drain_stream``: decode, encode the Avro segment, write it to a local landing
  directory (fsync'd) and register it in the control database.

Prints each run, the medians (changes/s) and the ratio drain / pg_recvlogical. Not a test.

    .venv/bin/python benchmarks/bench_drain.py --changes 500000 --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import psycopg2

from tidemark.config import parse_config
from tidemark.control import Control
from tidemark.capture.drain import drain_stream
from tidemark.local.localpg import LocalCluster, pg_bin_dir
from tidemark.lsn import parse_lsn
from tidemark.capture.source import apply_stream

from benchkit import drain_databases, teardown, work_dir

TXN_ROWS = 500


def generate(conn, changes: int) -> tuple[int, int]:
    """Insert/update/delete ``changes`` rows in total; return (changes, expected records)."""
    inserts = int(changes * 0.6)
    updates = int(changes * 0.25)
    deletes = changes - inserts - updates
    with conn.cursor() as cur:
        for lo in range(0, inserts, TXN_ROWS):
            hi = min(lo + TXN_ROWS, inserts)
            cur.execute("""INSERT INTO bench SELECT g, g %% 1000, 'customer ' || g, (g * 1.25)::numeric(12,2),
                                  now(), g %% 2 = 0 FROM generate_series(%s, %s) g""", (lo, hi - 1))
        for lo in range(0, updates, TXN_ROWS):
            hi = min(lo + TXN_ROWS, updates)
            cur.execute("UPDATE bench SET qty = qty + 1, note = note || '!' WHERE id >= %s AND id < %s", (lo, hi))
        for lo in range(inserts - deletes, inserts, TXN_ROWS):
            hi = min(lo + TXN_ROWS, inserts)
            cur.execute("DELETE FROM bench WHERE id >= %s AND id < %s", (lo, hi))
    return inserts + updates + deletes, inserts + 2 * updates + deletes


def run_recvlogical(cluster: LocalCluster, db: str, slot: str, end: str) -> float:
    cmd = [str(pg_bin_dir() / "pg_recvlogical"), "-h", "127.0.0.1", "-p", str(cluster.port), "-U", "postgres",
           "-d", db, "--slot", slot, "--start", "-o", "proto_version=1", "-o", "publication_names=bench_pub",
           "-f", "/dev/null", "--endpos", end, "--no-loop"]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, **cluster.libpq_env()))
    return time.perf_counter() - t


def run_drain(cfg) -> tuple[float, float, int]:
    """Drain one slot; return (wall seconds, this process's CPU seconds, records landed)."""
    t, cpu = time.perf_counter(), time.process_time()
    res = drain_stream(cfg, max_changes=1 << 40, max_bytes=1 << 40)
    return time.perf_counter() - t, time.process_time() - cpu, res.records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--changes", type=int, default=500_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the temporary cluster directory")
    args = ap.parse_args()

    home = work_dir("tidemark-bench-")
    cluster = LocalCluster(home / "pg", settings={"fsync": "off", "synchronous_commit": "off",
                                                  "full_page_writes": "off", "max_wal_size": "4GB",
                                                  "max_replication_slots": "40", "max_wal_senders": "40"})
    try:
        cluster.start()
        src, ctl_db, ctl_dsn = drain_databases(cluster)
        conn = psycopg2.connect(cluster.dsn(src))
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("""CREATE TABLE bench (id bigint PRIMARY KEY, qty int, note text, amount numeric(12,2),
                                               created timestamptz, flag bool)""")
        with Control(ctl_dsn) as ctl:
            ctl.migrate()
        cfgs = []
        recv_slots = []
        with conn.cursor() as cur, Control(ctl_dsn) as ctl:
            for i in range(args.runs):
                cfg = parse_config({
                    "stream": f"bench_{i}", "source": {"connection": "bench_src", "publication": "bench_pub",
                                                       "slot": f"drain_{i}", "tables": ["public.bench"]},
                    "control": {"connection": "bench_ctl"}, "landing": {"url": str(home / "landing")},
                    "lake": {"path": str(home / "lake")}})
                apply_stream(cfg)
                cur.execute("SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')",
                            (cfg.source.slot,))
                lsn = parse_lsn(cur.fetchone()[0])
                ctl.update_stream(cfg.stream, consistent_lsn=lsn, landed_upper=lsn)
                cfgs.append(cfg)
                cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (f"recv_{i}",))
                recv_slots.append(f"recv_{i}")
        t = time.perf_counter()
        changes, records = generate(conn, args.changes)
        with conn.cursor() as cur:
            cur.execute("SET synchronous_commit = on")
            cur.execute("CREATE TABLE bench_end ()")      # a synchronously committed marker: all flushed
            cur.execute("SELECT pg_current_wal_flush_lsn()::text")
            end = cur.fetchone()[0]
        conn.close()
        print(f"generated {changes:,} changes ({records:,} records) in {time.perf_counter() - t:.1f}s; "
              f"end LSN {end}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")

        recv_rates, drain_rates = [], []
        for i in range(args.runs):
            order = ["recv", "drain"] if i % 2 == 0 else ["drain", "recv"]
            for tool in order:
                if tool == "recv":
                    secs = run_recvlogical(cluster, src, recv_slots[i], end)
                    recv_rates.append(changes / secs)
                    print(f"run {i + 1}: pg_recvlogical {secs:6.2f}s  {changes / secs:>10,.0f} changes/s")
                else:
                    secs, cpu, got = run_drain(cfgs[i])
                    if got != records:
                        raise SystemExit(f"drain landed {got} records, expected {records}")
                    drain_rates.append(changes / secs)
                    print(f"run {i + 1}: drain+land     {secs:6.2f}s  {changes / secs:>10,.0f} changes/s"
                          f"  (client CPU {cpu:.2f}s = {cpu / changes * 1e6:.1f} us/change)")
        recv_med, drain_med = statistics.median(recv_rates), statistics.median(drain_rates)
        print(f"median pg_recvlogical: {recv_med:,.0f} changes/s")
        print(f"median drain+land:     {drain_med:,.0f} changes/s")
        print(f"ratio drain/pg_recvlogical: {drain_med / recv_med:.2f}x (target >= 0.5x)")
    finally:
        teardown(cluster, home, keep=args.keep)


if __name__ == "__main__":
    main()
