"""Benchmark: micro-batches. About 10 changes in each of 8 tables, and in each of 32 tables.

Starts its own PostgreSQL cluster for the control database, loads each table's first version from
snapshot files (1,000 rows per table), then lands one segment holding ``--changes`` changes per
table (updates, key-only deletes and inserts, in transactions spanning all tables). Each timed run
restores the lake and the frontier, then consolidates:

* **warm**: `consolidate_stream` in this process with a SparkSession that is already running;
* **cold**: ``tidemark consolidate STREAM`` as a whole new process (new JVM, new SparkSession), with
  the JVM's class-data-sharing archive (`tidemark.cds`, built first if missing) and, side
  by side, **cold, no CDS** without it (``TIDEMARK_SPARK_CDS=off``);
* with ``--connect``, also against a long-running local Spark Connect server
  (`tidemark.local.sparkconnect`): **connect-warm** (a Connect session in this process) and
  **connect-cold** (``tidemark consolidate`` as a new process with ``TIDEMARK_SPARK_REMOTE``: no JVM
  of its own).

Prints medians side by side with the targets: cold <= 15 s, warm <= 3 s, 32 tables <= 2 x 8 tables.

With ``--connect --server-batches N``, then N more batches on the server as the consolidate task
runs them (a new client process each, the lake and frontier restored between), the server's resident
memory (its process group: the JVM and its Python workers) printed every ``N // 12`` batches: a
server lives for days, and its memory must stay bounded. The server gets the settings the embedded
default gives it (`tidemark.local.embedded.spark_connect_command`: the machine's defaults).

``--mixed`` gives the tables the shapes real tables have, in turn: updates that leave the TOASTed
``b`` unchanged; updates that change the key and leave ``b`` unchanged; a table without a key
(REPLICA IDENTITY FULL) with whole-row deletes and inserts; a table truncated in the middle of the
batch. ``--tables 4 --changes 325 --mixed`` is a micro-batch of ~1,300 records over 4 tables
(target: <= 5 s warm).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tidemark.config import parse_config
from tidemark.control import Control, Segment
from tidemark.landing.segments import SegmentBuilder, Update, checksum
from tidemark.landing.store import open_store, segment_key, stream_keys
from tidemark.pgtypes import Column, TableSchema, arrow_schema

from benchkit import consolidate_databases, local_spark, started_cluster, teardown, tree_rss_mb

L0 = 1_000_000
ROWS = 1000


MIXED = False       # --mixed: table i has shape kind i % 4 (module doc)


def shape(i: int) -> TableSchema:
    keyless = MIXED and i % 4 == 2
    return TableSchema(schema="public", name=f"t{i:02d}", oid=1000 + i, replica_identity="f" if keyless else "d",
                       columns=(Column("id", "int64", "int8", 20, key=not keyless, nullable=False),
                                Column("a", "int32", "int4", 23), Column("b", "text", "text", 25)))


def setup_stream(cluster, work: Path, tables: int):
    import pyarrow as pa
    import pyarrow.parquet as pq

    stream = f"small_{tables}_{secrets.token_hex(2)}"
    os.environ["AIRFLOW_CONN_BENCH_SOURCE"] = cluster.uri("bench_source")
    os.environ["AIRFLOW_CONN_BENCH_CONTROL"] = cluster.uri("tidemark_control")
    cfg = parse_config({
        "stream": stream,
        "source": {"connection": "bench_source", "publication": "bench_pub", "slot": f"slot_{stream}",
                   "tables": [f"public.t{i:02d}" for i in range(tables)]},
        "control": {"connection": "bench_control"},
        "landing": {"url": str(work / stream / "landing")},
        "lake": {"path": str(work / stream / "lake")},
        "consolidate": {"buckets": 4},
    })
    ctl = Control(cluster.dsn("tidemark_control"))
    ctl.migrate()
    ctl.upsert_stream(cfg)
    store = open_store(cfg.landing.url)
    entry = {}
    for i in range(tables):
        sh = shape(i)
        ids = list(range(1, ROWS + 1))
        t = pa.Table.from_pydict({"id": ids, "a": [k % 97 for k in ids], "b": [f"row-{k}" for k in ids]},
                                 schema=arrow_schema(sh))
        buf = io.BytesIO()
        pq.write_table(t, buf)
        key = f"{stream_keys(cfg.stream)['snapshots']}s1/{sh.qualified}/chunk-000000.parquet"
        store.put(key, buf.getvalue())
        entry[sh.qualified] = {"rows": ROWS, "files": [key], "table_schema": sh.to_json()}
    with ctl.tx() as cur:
        cur.execute("""INSERT INTO tidemark.snapshots (stream, snapshot_id, lsn, mode, status, tables, finished_at)
                       VALUES (%s, 's1', %s, 'initial', 'complete', %s, now())""", (cfg.stream, L0, json.dumps(entry)))
    ctl.update_stream(cfg.stream, consistent_lsn=L0, landed_upper=L0)
    return cfg, ctl


def land_micro_batch(cfg, ctl: Control, tables: int, changes: int, seed: int = 3) -> int:
    """One segment: ``changes`` changes per table in transactions of one change per table."""
    rng = random.Random(seed)
    store = open_store(cfg.landing.url)
    b = SegmentBuilder(cfg.stream, 0, L0)
    t = L0
    picks = {i: rng.sample(range(1, ROWS + 1), min(changes, ROWS)) for i in range(tables)}   # distinct keys per table
    moved = {i: ROWS * 10 for i in range(tables)}
    for n in range(changes):
        t += 10
        ups, pos, events = [], 0, []
        for i in range(tables):
            sh = shape(i)
            if MIXED:
                pos = _mixed_change(ups, events, sh, i, n, changes, picks[i][n % len(picks[i])], moved, t, pos, rng)
                continue
            kind = n % 3
            if kind == 0:       # update
                k = picks[i][n]
                ups.append(Update(sh, {"id": k}, t, -1, t, pos, 0, image="key"))
                ups.append(Update(sh, {"id": k, "a": rng.randrange(1000), "b": f"u-{k}"}, t, 1, t, pos + 1, 0))
                pos += 2
            elif kind == 1:     # delete
                ups.append(Update(sh, {"id": picks[i][n]}, t, -1, t, pos, 0, image="key"))
                pos += 1
            else:               # insert
                k = ROWS + 1 + n
                ups.append(Update(sh, {"id": k, "a": 1, "b": f"i-{k}"}, t, 1, t, pos, 0))
                pos += 1
        b.add_transaction(ups, events)
    upper = t + 1
    data = b.build(upper)
    uri = store.put(segment_key(cfg.stream, 0, L0, upper), data)
    ctl.register_segment(Segment(cfg.stream, 0, L0, upper, uri, b.records, b.txns, len(data),
                                 checksum(data)))
    return upper


def _mixed_change(ups, events, sh, i, n, changes, k, moved, t, pos, rng) -> int:
    """One change of table ``i`` in the mixed micro-batch (module doc); return the next position."""
    from tidemark.landing.segments import Event

    kind = i % 4
    if kind == 0:           # an update leaving the TOASTed b unchanged
        ups.append(Update(sh, {"id": k}, t, -1, t, pos, 0, image="key"))
        ups.append(Update(sh, {"id": k, "a": rng.randrange(1000), "b": None}, t, 1, t, pos + 1, 0,
                          unchanged_toast=("b",)))
        return pos + 2
    if kind == 1:           # the key changes, b unchanged
        moved[i] += 1
        ups.append(Update(sh, {"id": k}, t, -1, t, pos, 0, image="key"))
        ups.append(Update(sh, {"id": moved[i], "a": rng.randrange(1000), "b": None}, t, 1, t, pos + 1, 0,
                          unchanged_toast=("b",)))
        return pos + 2
    if kind == 2:           # no key: whole-row deletes and inserts
        if n % 2:
            ups.append(Update(sh, {"id": k, "a": k % 97, "b": f"row-{k}"}, t, -1, t, pos, 0))
        else:
            ups.append(Update(sh, {"id": ROWS + 1 + n, "a": 1, "b": f"i-{n}"}, t, 1, t, pos, 0))
        return pos + 1
    if n == changes // 2:   # a truncate in the middle of the batch, then inserts
        events.append(Event("truncate", sh.qualified, t, 0, pos, t))
        pos += 1
    ups.append(Update(sh, {"id": ROWS * 20 + n, "a": 2, "b": f"t-{n}"}, t, 1, t, pos, 0))
    return pos + 1


def spark_jobs(spark) -> int:
    """Spark jobs started so far in this application (the status tracker keeps the recent ones)."""
    try:
        return max(spark.sparkContext.statusTracker().getJobIdsForGroup(None) or [-1]) + 1
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext
        return 0


def client(url: str) -> int:
    """``--client URL``: a warm Spark Connect client; for each stream file read from stdin,
    consolidate and print {"seconds", "frontier", "versions"} as one JSON line."""
    from tidemark.config import load_config
    from tidemark.consolidate import consolidate_stream, spark_session

    spark = spark_session("bench-small-batches-connect")
    for line in sys.stdin:
        cfg = load_config(line.strip())
        t0 = time.perf_counter()
        res = consolidate_stream(cfg, spark=spark)
        print(json.dumps({"seconds": time.perf_counter() - t0, "frontier": res.frontier_after,
                          "versions": len(res.versions)}), flush=True)
    spark.stop()
    return 0


def group_rss_mb(pid: int) -> tuple[float, int]:
    """(resident memory in MB, processes) of the process group ``pid`` leads (a server started by
    `sparkconnect.start`) and of all their descendants."""
    import psutil

    def in_group(p) -> bool:
        try:
            return os.getpgid(p.pid) == pid
        except ProcessLookupError:
            return False

    return tree_rss_mb([p for p in psutil.process_iter(["pid"]) if in_group(p)])


def server_memory(server, batches: int, n: int, cold_process, url: str) -> None:
    """``batches`` client runs of ``n`` tables on the server; its memory every ``batches // 12``."""
    every = max(1, batches // 12)
    mb, count = group_rss_mb(server.pid)
    samples = [(0, mb)]
    print(f"\nSpark Connect server memory over {batches} more batches of {n} tables (a client process each):",
          flush=True)
    print(f"  after the runs above: {mb:.0f} MB in {count} processes", flush=True)
    t0 = time.perf_counter()
    for i in range(1, batches + 1):
        cold_process(n, "server-memory", {"TIDEMARK_SPARK_REMOTE": url}, quiet=True)
        if i % every == 0 or i == batches:
            mb, count = group_rss_mb(server.pid)
            samples.append((i, mb))
            print(f"  batch {i}: {mb:.0f} MB in {count} processes ({time.perf_counter() - t0:.0f} s)", flush=True)
    half = [mb for i, mb in samples if i >= batches // 2]
    print(f"  server RSS: first {samples[0][1]:.0f} MB, max {max(mb for _, mb in samples):.0f} MB, last "
          f"{samples[-1][1]:.0f} MB; second half min/max {min(half):.0f}/{max(half):.0f} MB", flush=True)


def main() -> int:
    if sys.argv[1:2] == ["--client"]:
        return client(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default="8,32")
    parser.add_argument("--changes", type=int, default=10, help="changes per table")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mixed", action="store_true", help="tables of the shapes real tables have (module doc)")
    parser.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                        help="also time `tidemark consolidate` as a new process")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--connect", action="store_true",
                        help="also time both against a local Spark Connect server (started by the benchmark)")
    parser.add_argument("--server-batches", type=int, default=0,
                        help="with --connect: this many more client runs, the server's memory sampled (module doc)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the last warm run of each table count; print the top functions")
    args = parser.parse_args()
    counts = [int(x) for x in args.tables.split(",")]
    global MIXED
    MIXED = args.mixed

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from tidemark.consolidate import consolidate_stream, plan as _plan
    from tidemark.lake import read_table

    spark = local_spark(args.master, "bench-small-batches")
    work, cluster = started_cluster("tidemark-bench-small-")
    server = remote = None
    try:
        consolidate_databases(cluster)
        setups = {}
        for n in counts:
            cfg, ctl = setup_stream(cluster, work, n)
            t0 = time.perf_counter()
            consolidate_stream(cfg, spark=spark)        # loads the first versions
            print(f"{n} tables: first versions loaded in {time.perf_counter() - t0:.1f} s", flush=True)
            lake = Path(cfg.lake_path) / cfg.stream
            pristine = work / f"pristine-{n}"
            shutil.copytree(lake, pristine)
            upper = land_micro_batch(cfg, ctl, n, args.changes)
            streams = work / f"streams-{n}"
            streams.mkdir()
            (streams / f"{cfg.stream}.yaml").write_text(yaml.safe_dump(cfg.as_dict()))
            setups[n] = (cfg, ctl, lake, pristine, upper, streams)

        if args.connect:
            from tidemark.local import sparkconnect

            t0 = time.perf_counter()
            conf = None
            if args.server_batches:     # as deployed: the embedded default's server settings
                from tidemark.local.embedded import spark_connect_command

                cmd = spark_connect_command(0)
                conf = {c.split("=", 1)[0]: c.split("=", 1)[1] for c in cmd[cmd.index("--conf") + 1::2]
                        if "=" in c and not c.startswith("spark.connect.grpc.binding")}
            server, url = sparkconnect.start(work / "spark-connect.log", master=args.master, conf=conf)
            print(f"Spark Connect server at {url} up in {time.perf_counter() - t0:.1f} s", flush=True)
            # a Connect session cannot share a process with the classic one (PySpark switches the
            # whole process to Connect): the warm Connect client is a child process run by run
            remote = subprocess.Popen([sys.executable, __file__, "--client", url], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env={**os.environ, "TIDEMARK_SPARK_REMOTE": url})

        def restore(n):
            cfg, ctl, lake, pristine, upper, _ = setups[n]
            shutil.rmtree(lake, ignore_errors=True)
            shutil.copytree(pristine, lake)
            ctl.reset_frontier(cfg.stream, L0)

        times: dict[tuple, list[float]] = {}
        breakdown: dict[int, list[tuple[dict, int]]] = {}
        tidemark = [sys.executable, "-m", "tidemark.cli"]
        cold_modes = [("cold", {})]
        if args.cold:
            from tidemark import cds

            built = cds.build()     # the JVM's class-data-sharing archive (scripts/setup.sh builds it)
            if built["path"]:
                print(f"Spark class-data-sharing archive: {built['path']} ({built['bytes'] / 1e6:.0f} MB"
                      + (f", built in {built['seconds']:.0f} s)" if built["built"] else ")"), flush=True)
                cold_modes.append(("cold, no CDS", {cds.ENV: "off"}))

        def cold_process(n, mode, extra, quiet=False):
            """``tidemark consolidate`` as a new process (its own JVM unless Spark Connect)."""
            cfg, ctl, _, _, upper, streams = setups[n]
            restore(n)
            t0 = time.perf_counter()
            proc = subprocess.run([*tidemark, "--streams", str(streams), "consolidate", cfg.stream],
                                  capture_output=True, text=True, env={**os.environ, **extra})
            times.setdefault((n, mode), []).append(time.perf_counter() - t0)
            assert proc.returncode == 0, proc.stderr[-2000:]
            assert ctl.stream(cfg.stream).frontier == upper
            if not quiet:
                print(f"  run {run + 1}: {n:>3} tables, {mode} process: {times[(n, mode)][-1]:.2f} s", flush=True)
        for run in range(args.runs):
            for n in counts:
                cfg, ctl, lake, pristine, upper, streams = setups[n]
                restore(n)
                _plan.PHASES.clear()
                jobs0 = spark_jobs(spark)
                prof = cProfile.Profile() if args.profile and run == args.runs - 1 else None
                t0 = time.perf_counter()
                if prof is not None:
                    prof.enable()
                res = consolidate_stream(cfg, spark=spark)
                if prof is not None:
                    prof.disable()
                times.setdefault((n, "warm"), []).append(time.perf_counter() - t0)
                breakdown.setdefault(n, []).append((dict(_plan.PHASES), spark_jobs(spark) - jobs0))
                if prof is not None:
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(35)
                    print(f"--- profile, {n} tables, warm run ---\n{out.getvalue()}", flush=True)
                assert res.frontier_after == upper and len(res.versions) == n, res
                if run == 0:
                    deletes, inserts = len(range(1, args.changes, 3)), len(range(2, args.changes, 3))
                    assert read_table(cfg, "public.t00").num_rows == ROWS - deletes + inserts
                print(f"  run {run + 1}: {n:>3} tables, warm: {times[(n, 'warm')][-1]:.2f} s", flush=True)
                if args.cold:
                    for mode, extra in cold_modes:
                        cold_process(n, mode, extra)
                if remote is not None:
                    restore(n)
                    t0 = time.perf_counter()
                    remote.stdin.write(str(streams / f"{cfg.stream}.yaml") + "\n")
                    remote.stdin.flush()
                    reply = json.loads(remote.stdout.readline())
                    times.setdefault((n, "connect-warm"), []).append(reply["seconds"])
                    assert reply["frontier"] == upper and reply["versions"] == n, reply
                    print(f"  run {run + 1}: {n:>3} tables, connect-warm: {times[(n, 'connect-warm')][-1]:.2f} s",
                          flush=True)
                    if args.cold:
                        cold_process(n, "connect-cold", {"TIDEMARK_SPARK_REMOTE": url})
        if server is not None and args.server_batches:
            server_memory(server, args.server_batches, counts[0], cold_process, url)
        med = {k: statistics.median(v) for k, v in times.items()}
        print("\nwarm runs, where the time goes (medians, seconds; Spark jobs per run):")
        for n in counts:
            phases = sorted({p for ph, _ in breakdown[n] for p in ph})
            cells = ", ".join(f"{p}: {statistics.median(ph.get(p, 0.0) for ph, _ in breakdown[n]):.2f}"
                              for p in phases)
            print(f"  {n:>3} tables: {statistics.median(j for _, j in breakdown[n]):.0f} Spark jobs; {cells}")
        print(f"\nmicro-batch of {args.changes} changes per table, medians of {args.runs} ({args.master}):")
        for mode, target in (("warm", 3.0), ("cold", 15.0), ("cold, no CDS", 15.0), ("connect-warm", 3.0),
                             ("connect-cold", 15.0)):
            if (counts[0], mode) not in med:
                continue
            cells = "  ".join(f"{n:>3} tables: {med[(n, mode)]:6.2f} s" for n in counts)
            print(f"  {mode:>12}: {cells}   (target <= {target:.0f} s for 8 tables)")
            if len(counts) > 1:
                print(f"                {counts[-1]} vs {counts[0]} tables: {med[(counts[-1], mode)] / med[(counts[0], mode)]:.2f}x"
                      "  (target <= 2)")
    finally:
        if remote is not None:
            remote.stdin.close()
            remote.wait(60)
        if server is not None:
            sparkconnect.stop(server)
        teardown(cluster, work, spark)
    return 0


if __name__ == "__main__":
    sys.exit(main())
