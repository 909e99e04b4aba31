"""The real deployment, end to end: does the embedded Airflow keep up with the demo workload?

Runs what a new user runs, each as its own process with default settings (no memory flags):

1. ``tidemark demo`` — the embedded PostgreSQL, the demo stream snapshotted, then Airflow 3 with the
   stream's DAGs unpaused (drain every minute, consolidation on new segments);
2. **burst**: ``tidemark workload demo --seconds N`` while the scheduler drains and consolidates;
3. **outage**: the drain DAG paused while the workload runs for N more seconds, then unpaused, so
   the whole backlog lands at once (how a 117 MB segment once arose).

Every 30 s it prints the landed upper minus the frontier (bytes of WAL the lake is behind what has
landed), the source's position minus the landed upper, the segment count and the open incidents.
After each phase it waits (at most ``--catch-up`` seconds) for the frontier to pass the source's
position at the workload's end (every change of the workload consolidated: the landed upper itself
keeps moving, since the drain DAG lands the embedded Airflow's own WAL every minute), then runs
``tidemark parity demo`` and lists the incidents opened during the phase. Exit status 1 when a phase did not
catch up in time, parity failed or an incident was opened.

    python benchmarks/bench_deployment.py [--seconds 300] [--outage-seconds 300] [--catch-up 300]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import work_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_EVERY = 30.0


def tidemark_bin() -> list[str]:
    venv = ROOT / ".venv" / "bin" / "tidemark"
    return [str(venv)] if venv.exists() else [sys.executable, "-m", "tidemark.cli"]


class Deployment:
    def __init__(self, home: Path):
        self.home = home
        self.env = dict(os.environ, TIDEMARK_HOME=str(home))

    def run(self, *args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([*tidemark_bin(), *args], env=self.env, cwd=ROOT, text=True,
                              capture_output=capture)
        if check and proc.returncode != 0:
            raise SystemExit(f"tidemark {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def status(self) -> dict:
        return json.loads(self.run("status", "demo", "--json").stdout)

    def segments(self) -> int:
        out = self.run("segments", "demo", "--json", check=False)
        try:
            return len(json.loads(out.stdout))
        except ValueError:
            return -1

    def workload(self, seconds: int) -> subprocess.Popen:
        return subprocess.Popen([*tidemark_bin(), "workload", "demo", "--seconds", str(seconds)], env=self.env,
                                cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def lsn_int(text: str | None) -> int | None:
    if not text:
        return None
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def as_int(value) -> int | None:
    """A status position is a number (bytes) or 'X/Y' text."""
    if value is None:
        return None
    return value if isinstance(value, int) else lsn_int(str(value))


def sample(dep: Deployment, t0: float, phase: str, quiet: bool = False) -> dict:
    s = dep.status()
    landed, frontier = as_int(s["landed_upper"]), as_int(s["frontier"])
    source = as_int(s.get("source_current_lsn"))
    row = {"t": round(time.monotonic() - t0), "phase": phase,
           "behind_landed": None if landed is None or frontier is None else landed - frontier,
           "source_minus_landed": None if source is None or landed is None else source - landed,
           "incidents": s["open_incidents"], "landed": landed, "frontier": frontier}
    if quiet:
        return row
    print(f"  t={row['t']:>5}s {phase:<8} landed-frontier={row['behind_landed']!s:>12} B   "
          f"source-landed={row['source_minus_landed']!s:>12} B   open incidents={row['incidents']}", flush=True)
    return row


def phase(dep: Deployment, name: str, seconds: int, catch_up: float, t0: float, *, outage: bool) -> dict:
    before = {i["id"] for i in dep.status()["incidents"]}
    if outage:
        dep.run("airflow", "dags", "pause", "tidemark_demo_drain")
        print("  drain DAG paused", flush=True)
    work = dep.workload(seconds)
    next_at = time.monotonic()
    while work.poll() is None:
        if time.monotonic() >= next_at:
            sample(dep, t0, name)
            next_at += SAMPLE_EVERY
        time.sleep(1)
    print("  workload: " + (work.stdout.read() or "").strip().splitlines()[-1], flush=True)
    if work.returncode != 0:
        raise SystemExit(f"the workload exited {work.returncode}")
    end_lsn = as_int(dep.status().get("source_current_lsn"))
    stopped = time.monotonic()
    if outage:
        dep.run("airflow", "dags", "unpause", "tidemark_demo_drain")
        print("  drain DAG unpaused: the backlog lands at once", flush=True)
    caught_up_after = None
    next_at = time.monotonic()
    while time.monotonic() - stopped < catch_up:
        quiet = time.monotonic() < next_at
        row = sample(dep, t0, name + "+", quiet=quiet)
        if not quiet:
            next_at += SAMPLE_EVERY
        if row["frontier"] is not None and end_lsn is not None and row["frontier"] >= end_lsn:
            caught_up_after = time.monotonic() - stopped
            sample(dep, t0, name + "+")
            break
        time.sleep(2)
    parity = dep.run("parity", "demo", check=False)
    after = dep.status()
    new = [i for i in after["incidents"] if i["id"] not in before]
    result = {"phase": name, "workload_seconds": seconds, "caught_up_after_s": caught_up_after,
              "parity_ok": parity.returncode == 0, "new_incidents": new, "segments": dep.segments()}
    print(f"  {name}: caught up {'after %.0f s' % caught_up_after if caught_up_after is not None else 'NOT within %d s' % catch_up}"
          f" of the workload's end; parity {'ok' if result['parity_ok'] else 'FAILED'}; "
          f"{len(new)} new incident(s); {result['segments']} segments", flush=True)
    if not result["parity_ok"]:
        print(parity.stdout + parity.stderr, flush=True)
    for i in new:
        print(f"    incident {i['kind']} {i['table']}: {i['detail'][:300]}", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=300, help="workload seconds of the burst phase")
    ap.add_argument("--outage-seconds", type=int, default=300, help="workload seconds with the drain DAG paused")
    ap.add_argument("--catch-up", type=float, default=300, help="seconds allowed after each workload to catch up")
    ap.add_argument("--keep", action="store_true", help="keep the embedded home (printed) for inspection")
    args = ap.parse_args()

    home = work_dir("tidemark-deploy-")
    dep = Deployment(home)
    t0 = time.monotonic()
    results = []
    try:
        print(f"tidemark demo (home {home}) ...", flush=True)
        out = dep.run("demo")
        print("\n".join("  " + line for line in out.stdout.strip().splitlines()[-4:]), flush=True)
        print(f"demo up after {time.monotonic() - t0:.0f} s", flush=True)
        results.append(phase(dep, "burst", args.seconds, args.catch_up, t0, outage=False))
        if args.outage_seconds:
            results.append(phase(dep, "outage", args.outage_seconds, args.catch_up, t0, outage=True))
    finally:
        dep.run("demo", "--stop", check=False)
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(results, indent=2, default=str))
    ok = all(r["caught_up_after_s"] is not None and r["parity_ok"] and not r["new_incidents"] for r in results)
    print("deployment: " + ("kept up" if ok else "did NOT keep up"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
