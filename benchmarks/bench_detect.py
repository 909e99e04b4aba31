"""Benchmark: gap detection with a long manifest (10,000 segments), as the sensor runs it every poke.

A private PostgreSQL cluster holds the source (a table, the stream's slot) and the control database.
Each of two streams gets N registered segments (small real files), all but the last 100 below the
frontier. Stream ``pruned`` is left to the retention floor (the frontier): its first detect archives
the rows below it. Stream ``held`` has a subscriber at checkpoint 0, which holds the retention floor
at the start, so its manifest keeps all N rows (what every detect read before archiving existed).
Prints the first detect (archiving, and decoding the 100 pending files once) and the median of the
next ones (the sensor's pokes: a verified file is only checked for existence), side by side.

    .venv/bin/python benchmarks/bench_detect.py [--segments 10000] [--pending 100] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import drain_databases, land_segment, started_cluster, teardown  # noqa: E402


def _stream(name: str, work: Path, src: str, ctl_db: str):
    from tidemark.capture.source import apply_stream, connect_source
    from tidemark.config import parse_config
    from tidemark.control import Control, control_dsn

    cfg = parse_config({"stream": name, "source": {"connection": "bench_src", "tables": ["public.items"],
                                                   "slot": f"slot_{name}", "publication": f"pub_{name}"},
                        "control": {"connection": "bench_ctl"}, "landing": {"url": str(work / "landing")},
                        "lake": {"path": str(work / "lake")}}, origin="<bench>")
    apply_stream(cfg)
    conn = connect_source(cfg)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT (lsn - '0/0'::pg_lsn)::numeric::bigint FROM "
                        "pg_create_logical_replication_slot(%s, 'pgoutput')", (cfg.source.slot,))
            lsn = int(cur.fetchone()[0])
    finally:
        conn.close()
    with Control(control_dsn(cfg)) as ctl:
        ctl.update_stream(cfg.stream, consistent_lsn=lsn, landed_upper=lsn, state="streaming")
    return cfg, lsn


def _land(cfg, start: int, n: int, pending: int) -> None:
    from tidemark.control import Control, control_dsn
    from tidemark.landing.segments import SegmentBuilder, Update
    from tidemark.landing.store import open_store
    from tidemark.pgtypes import Column, TableSchema

    items = TableSchema(schema="public", name="items", oid=1, columns=(
        Column("id", "int32", "int4", 23, key=True, nullable=False), Column("v", "text", "text", 25)))
    store = open_store(cfg.landing.url)
    width = 100
    with Control(control_dsn(cfg)) as ctl:
        for seq in range(n):
            lower = start + seq * width
            builder = SegmentBuilder(cfg.stream, seq, lower)
            builder.add_transaction([Update(items, {"id": seq, "v": "x"}, lower + 1, 1, 0, 0, lower + 1)])
            land_segment(cfg, ctl, store, builder, seq, lower, lower + width)
        ctl.update_stream(cfg.stream, landed_upper=start + n * width)
        ctl.advance_frontier(cfg.stream, start + (n - pending) * width, committed_segment=n - pending - 1)


def _time_detects(cfg, runs: int) -> tuple[float, list[float], int, int]:
    from tidemark.control import Control, control_dsn
    from tidemark.gaps import detect

    t0 = time.perf_counter()
    report = detect(cfg)
    first = time.perf_counter() - t0
    assert report.decision == "ok", report
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        report = detect(cfg)
        times.append(time.perf_counter() - t0)
        assert report.decision == "ok", report
    with Control(control_dsn(cfg)) as ctl:
        live = len(ctl.segments(cfg.stream, status=None, archived=False))
    return first, times, live, report.checked_segments


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--segments", type=int, default=10_000)
    ap.add_argument("--pending", type=int, default=100)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    work, cluster = started_cluster("tidemark-bench-detect-")
    try:
        src, ctl_db, _ = drain_databases(cluster)
        import psycopg2

        with psycopg2.connect(cluster.dsn(src)) as conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
        from tidemark.control import Control, control_dsn

        results = {}
        for name in ("pruned", "held"):
            cfg, start = _stream(name, work, src, ctl_db)
            t0 = time.perf_counter()
            _land(cfg, start, args.segments, args.pending)
            print(f"{name}: {args.segments:,} segments landed and registered in {time.perf_counter() - t0:.0f} s",
                  flush=True)
            if name == "held":
                with Control(control_dsn(cfg)) as ctl:
                    ctl.add_subscriber(cfg.stream, "reader", start)     # holds the retention floor at the start
            results[name] = _time_detects(cfg, args.runs)
        print(f"\ngap detection with {args.segments:,} segments in the manifest, {args.pending} pending "
              f"(medians of {args.runs}):")
        print(f"{'manifest':>10} {'rows read':>10} {'files checked':>14} {'first detect':>13} {'each poke':>10}")
        for name, (first, times, live, checked) in results.items():
            print(f"{name:>10} {live:>10,} {checked:>14,} {first:>12.3f}s {statistics.median(times):>9.3f}s")
        pruned, held = statistics.median(results["pruned"][1]), statistics.median(results["held"][1])
        print(f"each poke, pruned vs held manifest: {pruned / held:.2f}x; under a second: {pruned < 1.0}")
    finally:
        teardown(cluster, work, keep=args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
