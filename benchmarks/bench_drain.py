"""Benchmark: drain-and-land throughput against pg_recvlogical on the same changes, and what the
segments cost in bytes under each codec.

Starts a private PostgreSQL cluster, creates one logical slot per run per tool (pg_recvlogical, and
the drain once per codec) at the same point, so every run decodes the identical WAL range; generates
a mix of row changes (inserts, updates, deletes in transactions of 500 rows), then, run by run and
rotating which goes first:

* ``pg_recvlogical -o proto_version=1 -o publication_names=... -f /dev/null --endpos END --no-loop``
(``--workload demo``: the demo stream's tables and business transactions, `tidemark.local.demo`,
instead: TOASTed text, a keyless table, rollbacks.)

* ``tidemark.capture.drain.drain_stream`` with ``landing.codec`` = each of ``--codecs``: decode, encode
  the Avro segments (one run: as many segments as ``--max-changes`` makes), write them to a local
  landing directory (fsync'd) and register them in the control database.

Prints each run, then per tool the medians: changes/s, the ratio drain / pg_recvlogical, segment bytes
per change and per WAL byte (the WAL range a run covers: its last upper minus its first lower). Not a
test.

    .venv/bin/python benchmarks/bench_drain.py --changes 500000 --runs 3 --codecs zstandard,null
    .venv/bin/python benchmarks/bench_drain.py --workload demo --transactions 25000 --runs 3
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
from tidemark.local import demo
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


def run_drain(cfg, max_changes: int | None) -> tuple[float, float, object]:
    """Drain one slot in one run; return (wall seconds, this process's CPU seconds, the drain's result)."""
    t, cpu = time.perf_counter(), time.process_time()
    res = drain_stream(cfg, max_changes=max_changes, max_bytes=1 << 40)
    return time.perf_counter() - t, time.process_time() - cpu, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["plain", "demo"], default="plain")
    ap.add_argument("--changes", type=int, default=500_000, help="plain workload: row changes")
    ap.add_argument("--transactions", type=int, default=25_000, help="demo workload: business transactions")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--codecs", default="zstandard,null", help="comma-separated landing.codec values to drain with")
    ap.add_argument("--max-changes", type=int, default=None,
                    help="the drain's segment size (default: the stream's drain.max_changes)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary cluster directory")
    args = ap.parse_args()
    codecs = [c for c in args.codecs.split(",") if c]

    home = work_dir("tidemark-bench-")
    slots = args.runs * (len(codecs) + 1) + 5
    cluster = LocalCluster(home / "pg", settings={"fsync": "off", "synchronous_commit": "off",
                                                  "full_page_writes": "off", "max_wal_size": "4GB",
                                                  "max_replication_slots": str(slots), "max_wal_senders": str(slots)})
    try:
        cluster.start()
        src, ctl_db, ctl_dsn = drain_databases(cluster)
        conn = psycopg2.connect(cluster.dsn(src))
        conn.autocommit = True
        tables = ["public.bench"]
        if args.workload == "demo":
            demo.load_demo_schema(cluster.dsn(src))
            tables = demo.DEMO_TABLES
        else:
            with conn.cursor() as cur:
                cur.execute("""CREATE TABLE bench (id bigint PRIMARY KEY, qty int, note text,
                                                   amount numeric(12,2), created timestamptz, flag bool)""")
        with Control(ctl_dsn) as ctl:
            ctl.migrate()
        cfgs: dict[tuple[int, str], object] = {}
        recv_slots = []
        with conn.cursor() as cur, Control(ctl_dsn) as ctl:
            for i in range(-1 if args.workload == "demo" else 0, args.runs):      # -1: the demo's probe
                for codec in (codecs if i >= 0 else codecs[:1]):
                    name = f"bench_{codec}_{i + 1}"
                    cfg = parse_config({
                        "stream": name, "source": {"connection": "bench_src", "publication": "bench_pub",
                                                   "slot": f"drain_{codec}_{i + 1}", "tables": tables},
                        "control": {"connection": "bench_ctl"},
                        "landing": {"url": str(home / "landing"), "codec": codec},
                        "lake": {"path": str(home / "lake")}})
                    apply_stream(cfg)
                    cur.execute("SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')",
                                (cfg.source.slot,))
                    lsn = parse_lsn(cur.fetchone()[0])
                    ctl.update_stream(cfg.stream, consistent_lsn=lsn, landed_upper=lsn)
                    cfgs[i, codec] = cfg
                if i >= 0:
                    cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (f"recv_{i}",))
                    recv_slots.append(f"recv_{i}")
        t = time.perf_counter()
        if args.workload == "demo":
            done = demo.run_workload(cluster.dsn(src), transactions=args.transactions, seed=11)
            changes = records = None          # known from the first drain; every other drain must agree
            print("demo workload: " + ", ".join(f"{v} {k}" for k, v in sorted(done.items())))
        else:
            changes, records = generate(conn, args.changes)
        with conn.cursor() as cur:
            cur.execute("SET synchronous_commit = on")
            cur.execute("CREATE TABLE bench_end ()")      # a synchronously committed marker: all flushed
            cur.execute("SELECT pg_current_wal_flush_lsn()::text")
            end = cur.fetchone()[0]
        conn.close()
        print(f"generated {'' if changes is None else f'{changes:,} changes ({records:,} records) '}"
              f"in {time.perf_counter() - t:.1f}s; end LSN {end}; {os.cpu_count()} CPUs, "
              f"load {os.getloadavg()[0]:.2f}")
        if changes is None:         # a first drain (not timed) says how many changes the demo made
            first = drain_stream(cfgs[-1, codecs[0]], max_changes=args.max_changes, max_bytes=1 << 40)
            changes, records = first.changes, first.records
            print(f"the demo made {changes:,} changes ({records:,} records)")

        tools = ["pg_recvlogical", *codecs]
        rates: dict[str, list[float]] = {t: [] for t in tools}
        per_change: dict[str, list[float]] = {c: [] for c in codecs}
        per_wal: dict[str, list[float]] = {c: [] for c in codecs}
        nsegs: dict[str, list[int]] = {c: [] for c in codecs}
        for i in range(args.runs):
            for tool in tools[i % len(tools):] + tools[:i % len(tools)]:
                if tool == "pg_recvlogical":
                    secs = run_recvlogical(cluster, src, recv_slots[i], end)
                    rates[tool].append(changes / secs)
                    print(f"run {i + 1}: pg_recvlogical    {secs:6.2f}s  {changes / secs:>10,.0f} changes/s")
                    continue
                secs, cpu, res = run_drain(cfgs[i, tool], args.max_changes)
                if (res.records, res.changes) != (records, changes):
                    raise SystemExit(f"drain landed {res.records} records of {res.changes} changes, "
                                     f"expected {records} of {changes}")
                wal = res.upper - res.lower
                rates[tool].append(changes / secs)
                per_change[tool].append(res.byte_size / changes)
                per_wal[tool].append(res.byte_size / wal)
                nsegs[tool].append(len(res.segments))
                print(f"run {i + 1}: drain {tool:11s} {secs:6.2f}s  {changes / secs:>10,.0f} changes/s"
                      f"  (client CPU {cpu:.2f}s = {cpu / changes * 1e6:.1f} us/change; {len(res.segments)} "
                      f"segments, {res.byte_size / 1e6:,.1f} MB for {wal / 1e6:,.1f} MB of WAL)")
        recv_med = statistics.median(rates["pg_recvlogical"])
        print(f"\nmedians of {args.runs} runs, {changes:,} changes ({records:,} records):")
        print(f"{'tool':22s} {'changes/s':>11s} {'vs recv':>8s} {'segments':>9s} {'B/change':>9s} {'B/WAL byte':>11s}")
        print(f"{'pg_recvlogical':22s} {recv_med:>11,.0f} {1:>7.2f}x {'-':>9s} {'-':>9s} {'-':>11s}")
        for c in codecs:
            med = statistics.median(rates[c])
            print(f"{'drain+land ' + c:22s} {med:>11,.0f} {med / recv_med:>7.2f}x {statistics.median(nsegs[c]):>9.0f} "
                  f"{statistics.median(per_change[c]):>9.1f} {statistics.median(per_wal[c]):>11.3f}")
        print("target: drain >= 0.5x pg_recvlogical")
    finally:
        teardown(cluster, home, keep=args.keep)


if __name__ == "__main__":
    main()
