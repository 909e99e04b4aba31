"""Commit -> lake lag under the embedded Airflow, and what an idle stream costs: the figures of issue 38.

Starts the embedded default from a checkout (``--checkout``: this one, or another, e.g. the cron design
of an older commit, for the comparison) with ``tidemark demo``, runs ``tidemark workload demo`` for
``--seconds`` (or, with ``--pgbench-scale``, adds pgbench's four tables at that scale to the running demo
stream, ``snapshot --mode add``, and runs ``pgbench -R --rate -c --clients`` instead), and meanwhile samples, as a user would: every 5 s the source's ``pg_current_wal_lsn()``,
every second the consolidated frontier in the control database; a sample's lag is how long after it the
frontier passed its position. Prints per-minute median / p95 / max lag, then waits for the frontier to
pass the workload's end, runs ``tidemark parity demo`` and counts the open incidents. Then, with
``--idle-seconds``, no source writes at all: how many consolidate tasks ran Spark (succeeded, not
skipped) and how many CPU-seconds the deployment's processes used (Airflow's components with their
reaped task processes, the Spark Connect server; the PostgreSQL cluster not included), per hour.
It also prints where a change's time went: per task of the drain and consolidate DAGs, the median time
from queued to start and from start to end, and how long after the previous DAG's run a run started.

    python benchmarks/bench_commit_lag.py --seconds 240 --idle-seconds 600 [--checkout /path/to/old]
    python benchmarks/bench_commit_lag.py --pgbench-scale 10 --rate 1000 --seconds 900
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import shutil

import psycopg2

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


def cli(checkout: Path, home: Path, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, TIDEMARK_HOME=str(home),
               PYTHONPATH=os.pathsep.join([str(checkout / "include"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "tidemark.cli", "--home", str(home), *args], cwd=checkout, env=env,
                          text=True, capture_output=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise SystemExit(f"tidemark {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def lsn(cur) -> int:
    cur.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
    return int(cur.fetchone()[0])


def frontier(cur) -> int | None:
    cur.execute("SELECT frontier FROM tidemark.streams WHERE name = 'demo'")
    row = cur.fetchone()
    return row[0] if row else None


def quantiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    v = sorted(values)
    return {"n": len(v), "median": round(statistics.median(v), 1), "p95": round(v[min(len(v) - 1, int(0.95 * len(v)))], 1),
            "max": round(v[-1], 1)}


def cpu_seconds(home: Path) -> float:
    """User+system CPU of every process of this embedded home (by AIRFLOW_HOME in its environment),
    with the children each has reaped (the LocalExecutor's task processes)."""
    marker = f"AIRFLOW_HOME={home.resolve() / 'airflow'}".encode()
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(fields[i]) for i in (11, 12, 13, 14))    # utime stime cutime cstime
    return total / TICKS


def connect_server_rss_mb(home: Path) -> float | None:
    """Resident memory of the embedded Spark Connect server and all its descendants (its JVM, the
    Python worker daemons and their workers), None when the deployment has none."""
    import psutil

    from benchkit import tree_rss_mb     # (imports the library: after main() chose the checkout's)

    try:
        pid = json.loads((home / "airflow" / "pids.json").read_text())["pids"].get("spark-connect")
        mb, count = tree_rss_mb([psutil.Process(pid)]) if pid else (0.0, 0)
    except (OSError, ValueError, KeyError, psutil.Error):
        return None
    return round(mb, 1) if count else None


PGBENCH_TABLES = ["public.pgbench_accounts", "public.pgbench_branches", "public.pgbench_tellers",
                  "public.pgbench_history"]


def add_pgbench(checkout: Path, home: Path, streams: Path, cluster, scale: int) -> None:
    """pgbench's tables at ``scale`` in the demo's source, added to the running stream as a user would:
    the stream file gains them, ``tidemark snapshot demo --mode add`` copies them."""
    from tidemark.local.localpg import pg_bin_dir

    src = cluster.dsn("demo")
    subprocess.run([str(pg_bin_dir() / "pgbench"), "-i", "-s", str(scale), "-q", src], check=True, capture_output=True)
    with psycopg2.connect(src) as conn, conn.cursor() as cur:
        cur.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
    stream = streams / "demo.yaml"
    text = stream.read_text()
    anchor = "    - public.audit_log"
    stream.write_text(text.replace(anchor, anchor + "".join(f"\n    - {t}" for t in PGBENCH_TABLES), 1))
    t = time.monotonic()
    # (waiting for the stream's lease: the maintain DAG's first run may hold it just after the start)
    os.environ["TIDEMARK_LOCK_WAIT_SECONDS"] = "600"
    try:
        cli(checkout, home, "snapshot", "demo", "--mode", "add", "--tables", ",".join(PGBENCH_TABLES), timeout=1800)
    finally:
        os.environ.pop("TIDEMARK_LOCK_WAIT_SECONDS")
    print(f"pgbench -s {scale} added to the stream in {time.monotonic() - t:.0f} s", flush=True)


def task_times(air, since: float) -> dict:
    """Median seconds per task of the drain and consolidate DAGs since ``since``: queued -> start
    (the executor's pick-up), start -> end (the task itself), for the runs that succeeded or skipped."""
    with air.cursor() as cur:
        cur.execute("""SELECT dag_id, task_id, EXTRACT(EPOCH FROM start_date - queued_dttm),
                              EXTRACT(EPOCH FROM end_date - start_date)
                         FROM task_instance
                        WHERE start_date > to_timestamp(%s) AND state IN ('success', 'skipped')
                          AND (dag_id LIKE '%%_drain' OR dag_id LIKE '%%_consolidate')""", (since,))
        rows = cur.fetchall()
        cur.execute("""SELECT dag_id, EXTRACT(EPOCH FROM end_date - start_date), EXTRACT(EPOCH FROM start_date - queued_at)
                         FROM dag_run WHERE start_date > to_timestamp(%s) AND end_date IS NOT NULL
                          AND (dag_id LIKE '%%_drain' OR dag_id LIKE '%%_consolidate')""", (since,))
        runs = cur.fetchall()
    out: dict = {}
    for dag, task, wait, took in rows:
        entry = out.setdefault(f"{dag.rsplit('_', 1)[1]}.{task}", {"queued": [], "ran": []})
        if wait is not None:
            entry["queued"].append(float(wait))
        if took is not None:
            entry["ran"].append(float(took))
    for dag, took, wait in runs:
        entry = out.setdefault(f"{dag.rsplit('_', 1)[1]} run", {"queued": [], "ran": []})
        entry["ran"].append(float(took))
        if wait is not None:
            entry["queued"].append(float(wait))
    return {k: {"n": len(v["ran"]), "queued_median": round(statistics.median(v["queued"]), 1) if v["queued"] else None,
                "ran_median": round(statistics.median(v["ran"]), 1) if v["ran"] else None}
            for k, v in sorted(out.items())}


def spark_runs_since(air, since: float) -> int:
    with air.cursor() as cur:
        cur.execute("""SELECT count(*) FROM task_instance WHERE task_id = 'consolidate' AND state = 'success'
                        AND start_date > to_timestamp(%s)""", (since,))
        return int(cur.fetchone()[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", type=Path, default=ROOT, help="the checkout whose deployment is measured")
    ap.add_argument("--seconds", type=int, default=240, help="workload seconds")
    ap.add_argument("--catch-up", type=float, default=300)
    ap.add_argument("--idle-seconds", type=int, default=0, help="then this long without source writes")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--pgbench-scale", type=int, default=0, help="add pgbench's tables at this scale; 0: the demo workload")
    ap.add_argument("--rate", type=int, default=1000, help="with --pgbench-scale: pgbench -R (transactions per second)")
    ap.add_argument("--clients", type=int, default=4, help="with --pgbench-scale: pgbench -c")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="tidemark-fresh-"))
    home.chmod(0o755)          # the local PostgreSQL runs as the postgres user
    checkout = args.checkout.resolve()
    # a streams directory of the run's own (a copy of the demo's): pgbench's tables are added to it
    streams = home / "streams"
    streams.mkdir()
    shutil.copy(checkout / "include" / "streams" / "demo.yaml", streams / "demo.yaml")
    os.environ["TIDEMARK_STREAMS_DIR"] = str(streams)
    print(f"checkout {checkout}, home {home}", flush=True)
    t_start = time.monotonic()
    cli(checkout, home, "demo")
    print(f"demo up in {time.monotonic() - t_start:.0f} s", flush=True)
    sys.path.insert(0, str(checkout / "include"))
    from tidemark.local.localpg import LocalCluster

    cluster = LocalCluster(home / "pg")
    src, ctl, air = (psycopg2.connect(cluster.dsn(db)) for db in ("demo", "tidemark", "airflow"))
    for c in (src, ctl, air):
        c.autocommit = True
    result: dict = {"checkout": str(checkout), "seconds": args.seconds, "pgbench_scale": args.pgbench_scale,
                    "rate": args.rate if args.pgbench_scale else None}
    try:
        if args.pgbench_scale:
            add_pgbench(checkout, home, streams, cluster, args.pgbench_scale)
        time.sleep(30)          # the first runs after the snapshot settle
        env = dict(os.environ, TIDEMARK_HOME=str(home),
                   PYTHONPATH=os.pathsep.join([str(checkout / "include"), os.environ.get("PYTHONPATH", "")]))
        if args.pgbench_scale:
            from tidemark.local.localpg import pg_bin_dir

            work = subprocess.Popen([str(pg_bin_dir() / "pgbench"), "-n", "-c", str(args.clients), "-j", "2", "-R",
                                     str(args.rate), "-T", str(args.seconds), "-P", "60", cluster.dsn("demo")],
                                    text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        else:
            work = subprocess.Popen([sys.executable, "-m", "tidemark.cli", "--home", str(home), "workload", "demo",
                                     "--seconds", str(args.seconds)], cwd=checkout, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        t0, since = time.monotonic(), time.time()
        pending: list[tuple[float, int]] = []     # (sampled at, source position)
        lags: list[tuple[float, float]] = []      # (sampled at, lag)
        next_sample, ended = t0, None
        with src.cursor() as scur, ctl.cursor() as ccur:
            while work.poll() is None or (pending and time.monotonic() - t0 < args.seconds + args.catch_up):
                now = time.monotonic()
                if work.poll() is None and now >= next_sample:
                    pending.append((now, lsn(scur)))
                    next_sample += 5.0
                elif work.poll() is not None and ended is None:
                    # the workload's end: parity is run once the frontier passed it (a lag sample too)
                    ended = (now, lsn(scur))
                    pending.append(ended)
                f = frontier(ccur)
                if f is not None:
                    done = [(t, p) for t, p in pending if f >= p]
                    for t, p in done:
                        lags.append((t - t0, now - t))
                    pending = [(t, p) for t, p in pending if f < p]
                time.sleep(0.5)
        out = work.stdout.read() or ""
        print("workload: " + " | ".join((out.strip().splitlines() or ["?"])[-4:]), flush=True)
        result["task_times"] = task_times(air, since)
        for name, q in result["task_times"].items():
            print(f"  {name}: {q['n']} ran, median queued {q['queued_median']} s, ran {q['ran_median']} s", flush=True)
        per_minute = {}
        for t, lag in lags:
            per_minute.setdefault(int(t // 60), []).append(lag)
        result["per_minute"] = {m: quantiles(v) for m, v in sorted(per_minute.items())}
        result["overall"] = quantiles([lag for _, lag in lags])
        result["unresolved_samples"] = len(pending)
        for m, q in result["per_minute"].items():
            print(f"  minute {m}: lag median {q.get('median')} s, p95 {q.get('p95')} s, max {q.get('max')} s "
                  f"({q['n']} samples)", flush=True)
        print(f"  overall: {result['overall']}; samples never consolidated: {len(pending)}", flush=True)
        parity = cli(checkout, home, "parity", "demo", check=False)
        result["parity_ok"] = parity.returncode == 0
        status = json.loads(cli(checkout, home, "status", "demo", "--json").stdout)
        result["open_incidents"] = status.get("open_incidents")
        result["status_commit_lag"] = status.get("commit_lag")
        result["spark_connect_rss_mb"] = connect_server_rss_mb(home)
        result["spark_runs"] = spark_runs_since(air, 0)
        print(f"  Spark Connect server resident memory {result['spark_connect_rss_mb']} MB after "
              f"{result['spark_runs']} Spark consolidations", flush=True)
        print(f"  parity {'ok' if result['parity_ok'] else 'FAILED'}; open incidents {result['open_incidents']}; "
              f"status page commit lag {result['status_commit_lag']}", flush=True)
        if args.idle_seconds:
            time.sleep(60)      # the last runs finish
            since, cpu0, m0 = time.time(), cpu_seconds(home), time.monotonic()
            time.sleep(args.idle_seconds)
            cpu = cpu_seconds(home) - cpu0
            hours = (time.monotonic() - m0) / 3600
            result["idle"] = {"seconds": args.idle_seconds, "spark_runs": spark_runs_since(air, since),
                              "cpu_seconds_per_hour": round(cpu / hours, 1),
                              "spark_connect_rss_mb": connect_server_rss_mb(home)}
            print(f"  idle {args.idle_seconds} s: {result['idle']['spark_runs']} consolidate task(s) ran Spark; "
                  f"{result['idle']['cpu_seconds_per_hour']} CPU-s per hour (Airflow, tasks, Spark Connect server)",
                  flush=True)
    finally:
        for c in (src, ctl, air):
            c.close()
        cli(checkout, home, "demo", "--stop", check=False)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1, default=str))
    return 0 if result.get("parity_ok") and not result.get("open_incidents") else 1


if __name__ == "__main__":
    sys.exit(main())
