"""Commit -> lake lag under the embedded Airflow, and what an idle stream costs: the figures of issue 38.

Starts the embedded default from a checkout (``--checkout``: this one, or another, e.g. the cron design
of an older commit, for the comparison) with ``tidemark demo``, runs ``tidemark workload demo`` for
``--seconds``, and meanwhile samples, as a user would: every 5 s the source's ``pg_current_wal_lsn()``,
every second the consolidated frontier in the control database; a sample's lag is how long after it the
frontier passed its position. Prints per-minute median / p95 / max lag, then waits for the frontier to
pass the workload's end, runs ``tidemark parity demo`` and counts the open incidents. Then, with
``--idle-seconds``, no source writes at all: how many consolidate tasks ran Spark (succeeded, not
skipped) and how many CPU-seconds the deployment's processes used (Airflow's components with their
reaped task processes, the Spark Connect server; the PostgreSQL cluster not included), per hour.

    python benchmarks/bench_commit_lag.py --seconds 240 --idle-seconds 600 [--checkout /path/to/old]
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
    """Resident memory of the embedded Spark Connect server's process group (its JVM and Python
    workers), None when the deployment has none."""
    try:
        pid = json.loads((home / "airflow" / "pids.json").read_text())["pids"].get("spark-connect")
    except (OSError, ValueError, KeyError):
        return None
    if pid is None:
        return None
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return round(total / 1024, 1)


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
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="tidemark-fresh-"))
    home.chmod(0o755)          # the local PostgreSQL runs as the postgres user
    checkout = args.checkout.resolve()
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
    result: dict = {"checkout": str(checkout), "seconds": args.seconds}
    try:
        time.sleep(30)          # the first runs after the snapshot settle
        env = dict(os.environ, TIDEMARK_HOME=str(home),
                   PYTHONPATH=os.pathsep.join([str(checkout / "include"), os.environ.get("PYTHONPATH", "")]))
        work = subprocess.Popen([sys.executable, "-m", "tidemark.cli", "--home", str(home), "workload", "demo",
                                 "--seconds", str(args.seconds)], cwd=checkout, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        pending: list[tuple[float, int]] = []     # (sampled at, source position)
        lags: list[tuple[float, float]] = []      # (sampled at, lag)
        next_sample = t0
        with src.cursor() as scur, ctl.cursor() as ccur:
            while work.poll() is None or (pending and time.monotonic() - t0 < args.seconds + args.catch_up):
                now = time.monotonic()
                if work.poll() is None and now >= next_sample:
                    pending.append((now, lsn(scur)))
                    next_sample += 5.0
                f = frontier(ccur)
                if f is not None:
                    done = [(t, p) for t, p in pending if f >= p]
                    for t, p in done:
                        lags.append((t - t0, now - t))
                    pending = [(t, p) for t, p in pending if f < p]
                time.sleep(0.5)
        out = work.stdout.read() or ""
        print("workload: " + (out.strip().splitlines() or ["?"])[-1], flush=True)
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
