"""Benchmark: consolidation memory as the backlog grows (100 MB, 500 MB, 2 GB of the demo's rows, landed as segments).

Starts a private PostgreSQL cluster for the control database; for each size, lands a backlog of
that many bytes of segments holding rows shaped like the demo workload's (a keyed ``orders`` table
with a text note, updated, deleted and inserted; a keyless ``audit_log`` of inserts), snapshots it
empty, and consolidates it in a fresh ``tidemark consolidate`` process with
``spark.driver.memory=1g`` (the driver JVM, its Python workers and the CLI are one process tree).
Prints, per size, the number of slices (`consolidate.max_batch_bytes` and `max_batch_records`), the wall time and the peak
RSS of the driver JVM, of the Python workers together and of the CLI process, sampled every 0.2 s;
beside them, from the JVM's GC log (``-Xlog:gc``), the Java heap's largest committed size and the
largest heap left after a collection (the JVM's RSS follows the committed size, which G1 grows
towards ``spark.driver.memory`` when collections take a larger share of the time, whatever the
data left after them).
Memory must stay flat as the backlog grows: the driver receives file actions and counts only, and a
backlog is worked off in bounded slices. Not a test.

    .venv/bin/python benchmarks/bench_consolidate_memory.py --sizes-mb 100 500 2048
"""

from __future__ import annotations

import argparse
import os
import random
import re
import secrets
import subprocess
import sys
import time

import yaml

from tidemark.config import parse_config
from tidemark.control import Control
from tidemark.landing.segments import SegmentBuilder, Update
from tidemark.landing.store import open_store
from tidemark.pgtypes import Column, TableSchema

from benchkit import TreePeaks, consolidate_databases, land_segment, started_cluster, teardown

ORDERS = TableSchema(schema="public", name="orders", oid=1, columns=(
    Column("id", "int64", "int8", 20, key=True, nullable=False), Column("customer", "int64", "int8", 20),
    Column("status", "text", "text", 25), Column("total_cents", "int64", "int8", 20),
    Column("note", "text", "text", 25)))
AUDIT = TableSchema(schema="public", name="audit_log", oid=2, replica_identity="f", columns=(
    Column("kind", "text", "text", 25), Column("payload", "text", "text", 25)))
L0 = 1_000
SEGMENT_BYTES = 32 << 20


def land(cfg, ctl: Control, megabytes: int, seed: int = 3) -> tuple[int, int, int]:
    """Land about ``megabytes`` MB of rows (their columns' bytes, as the demo's: segments of ~32 MB of
    rows each, compressed as the drain writes them); return (upper, records, segment bytes)."""
    rng = random.Random(seed)
    store = open_store(cfg.landing.url)
    time_, seq, lower, total, records = L0, 0, L0, 0, 0
    builder = SegmentBuilder(cfg.stream, seq, lower)
    live: list[int] = []
    next_id, built, raw = 1, 0, 0
    while raw + built < megabytes << 20:
        time_ += 10
        ups = []

        def add(table, row, diff, **kw):
            ups.append(Update(table, row, time_, diff, 0, len(ups), time_, **kw))

        for _ in range(rng.randint(2, 6)):
            r = rng.random()
            if r < 0.45 or len(live) < 100:
                add(ORDERS, {"id": next_id, "customer": rng.randrange(10_000), "status": "new",
                             "total_cents": rng.randrange(100_000), "note": "n" * rng.randint(50, 400)}, 1)
                live.append(next_id)
                next_id += 1
            elif r < 0.85:
                k = live[rng.randrange(len(live))]
                add(ORDERS, {"id": k}, -1, image="key")
                add(ORDERS, {"id": k, "customer": rng.randrange(10_000), "status": "paid",
                             "total_cents": rng.randrange(100_000), "note": None}, 1, unchanged_toast=("note",))
            else:
                k = live.pop(rng.randrange(len(live)))
                add(ORDERS, {"id": k}, -1, image="key")
            add(AUDIT, {"kind": "change", "payload": f'{{"order": {next_id}, "at": {time_}}}'}, 1)
        builder.add_transaction(ups)
        records += len(ups)
        built += sum(120 + len(u.row.get("note") or "") for u in ups)
        if built >= SEGMENT_BYTES:
            raw += built
            total += land_segment(cfg, ctl, store, builder, seq, lower, time_ + 1)
            lower, seq = time_ + 1, seq + 1
            builder, built = SegmentBuilder(cfg.stream, seq, lower), 0
    upper = time_ + 1
    total += land_segment(cfg, ctl, store, builder, seq, lower, upper)
    ctl.update_stream(cfg.stream, landed_upper=upper)
    return upper, records, total


def heap_figures(gc_log) -> dict[str, float]:
    """From a ``-Xlog:gc`` file: the Java heap's largest committed size and the largest heap left
    after a collection (live data plus the old garbage a young collection leaves), in MB."""
    committed, after = 0.0, 0.0
    try:
        text = gc_log.read_text()
    except OSError:
        return {}
    for m in re.finditer(r"Pause (?:Young|Full)[^\n]*? (\d+)M->(\d+)M\((\d+)M\)", text):
        after = max(after, int(m.group(2)))
        committed = max(committed, int(m.group(3)))
    return {"heap committed": committed, "heap after GC": after}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 500, 2048])
    parser.add_argument("--driver-memory", default="1g")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    work, cluster = started_cluster("tidemark-bench-consolidate-memory-")
    rows = []
    try:
        consolidate_databases(cluster)
        os.environ["AIRFLOW_CONN_BENCH_SOURCE"] = cluster.uri("bench_source")
        os.environ["AIRFLOW_CONN_BENCH_CONTROL"] = cluster.uri("tidemark_control")
        for mb in args.sizes_mb:
            stream = f"mem_{mb}_{secrets.token_hex(2)}"
            doc = {"stream": stream,
                   "source": {"connection": "bench_source", "publication": "bench_pub", "slot": f"slot_{stream}",
                              "tables": ["public.orders", "public.audit_log"]},
                   "control": {"connection": "bench_control"},
                   "landing": {"url": str(work / stream / "landing")}, "lake": {"path": str(work / stream / "lake")}}
            cfg = parse_config(doc)
            ctl = Control(cluster.dsn("tidemark_control"))
            ctl.migrate()
            ctl.upsert_stream(cfg)
            ctl.update_stream(cfg.stream, consistent_lsn=L0, landed_upper=L0)
            t0 = time.perf_counter()
            upper, records, total = land(cfg, ctl, mb)
            print(f"{mb:>6} MB of rows: landed {total / 2**20:,.0f} MB of segments, {records:,} records in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            streams = work / stream / "streams"
            streams.mkdir(parents=True)
            (streams / f"{stream}.yaml").write_text(yaml.safe_dump(doc))
            gc_log = work / stream / "gc.log"
            env = dict(os.environ, PYSPARK_SUBMIT_ARGS=f'--driver-memory {args.driver_memory} '
                                                       f'--driver-java-options "-Xlog:gc:file={gc_log}" pyspark-shell',
                       TIDEMARK_SPARK_LOG_LEVEL="ERROR")
            env.pop("TIDEMARK_SPARK_REMOTE", None)
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-m", "tidemark.cli", "--streams", str(streams), "consolidate",
                                     stream], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            sampler = TreePeaks(proc)
            out, err = proc.communicate()
            tree = sampler.join()
            peaks = {"driver JVM": tree["jvm"], "Python workers": tree["workers"], "CLI (Python)": tree["root"]}
            took = time.perf_counter() - t0
            frontier = ctl.stream(stream).frontier
            slices = next((line.split('"slices": ')[1].split(",")[0] for line in out.splitlines()
                           if '"slices": ' in line), "?")
            ok = proc.returncode == 0 and frontier == upper
            heap = heap_figures(gc_log)
            print(f"{mb:>6} MB: rc {proc.returncode}, frontier {'= landed upper' if frontier == upper else frontier}, "
                  f"{slices} slices, {took:.0f} s; peak RSS: " + ", ".join(f"{k} {v:,.0f} MB" for k, v in peaks.items())
                  + "; Java " + ", ".join(f"{k} {v:,.0f} MB" for k, v in heap.items()), flush=True)
            if not ok:
                print(err[-3000:], file=sys.stderr)
            rows.append((mb, total, slices, took, {**peaks, **heap}, ok))
        print(f"\nbacklog vs peak memory, spark.driver.memory={args.driver_memory} "
              f"(consolidate.max_batch_bytes default):")
        print(f"  {'rows':>7}  {'segments':>8}  {'slices':>6}  {'time':>6}  {'driver JVM':>10}  {'heap comm.':>10}  "
              f"{'after GC':>8}  {'Py workers':>10}  {'CLI':>6}  ok")
        for mb, total, slices, took, peaks, ok in rows:
            print(f"  {mb:5,}MB  {total / 2**20:6,.0f}MB  {slices:>6}  {took:5.0f}s  {peaks['driver JVM']:8,.0f}MB  "
                  f"{peaks.get('heap committed', 0):8,.0f}MB  {peaks.get('heap after GC', 0):6,.0f}MB  "
                  f"{peaks['Python workers']:8,.0f}MB  {peaks['CLI (Python)']:4,.0f}MB  {ok}")
        if len(rows) > 1:
            first = rows[0]
            for row in rows[1:]:
                print(f"  {row[0]:,} MB vs {first[0]:,} MB of rows ({row[0] / first[0]:.1f}x): " + ", ".join(
                    f"{k} {row[4][k] / first[4][k]:.2f}x" for k in ("driver JVM", "heap committed", "heap after GC",
                                                                      "Python workers", "CLI (Python)")
                    if first[4].get(k) and k in row[4]))
    finally:
        teardown(cluster, work, keep=args.keep)
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
