"""The fault matrix under the live scheduler, with nobody at the keyboard (nightly profile).

The embedded Airflow runs a stream's DAGs on their schedules (a drain on every change the source
watcher sees and every 5 minutes, the consolidation on every landing, as a client of the embedded
Spark Connect server, and every minute besides: ``consolidate.check_every_minutes: 1``) while a
workload writes to the source. Each fault is injected into that running system, then nothing is touched: the
task retries, the cron runs and the gap sensor's branches alone must bring the lake back to the source
(PostgreSQL itself is the oracle) with no incident left open.

It takes 10–20 minutes, so it runs in the nightly profile (``TIDEMARK_NIGHTLY=1``); CI's live test
(`test_live_airflow.py`) injects the lost slot, a deleted segment, a lock held by a backfill and a
broken connection."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psycopg2
import pytest
import yaml

from dag_workload import workload
from test_live_airflow import _assert_lake_equals_source, _wait, live  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.spark,
              pytest.mark.skipif(os.environ.get("TIDEMARK_NIGHTLY") != "1",
                                 reason="the nightly profile (TIDEMARK_NIGHTLY=1): 10-20 minutes of live faults")]


class Workload:
    """Rounds of the DAG tests' workload in a thread, one every ``pause`` seconds, until stopped."""

    def __init__(self, dsn: str, first_round: int, pause: float = 1.0):
        self.dsn, self.round, self.pause = dsn, first_round, pause
        self.stop, self.error = threading.Event(), None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            conn = psycopg2.connect(self.dsn)
            conn.autocommit = True
            while not self.stop.is_set():
                workload(conn, self.round)
                self.round += 1
                self.stop.wait(self.pause)
            conn.close()
        except Exception as exc:   # noqa: BLE001 - reported by __exit__
            self.error = exc

    def __enter__(self) -> "Workload":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)
        assert self.error is None, f"the workload failed: {self.error!r}"


def _source_lsn(dsn: str) -> int:
    from tidemark.lsn import parse_lsn

    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT pg_current_wal_lsn()::text")
        return parse_lsn(cur.fetchone()[0])


def _poll(fn, timeout: float, what: str, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


# -- the faults: each returns a line saying what it did ----------------------------------------------

def terminate_walsender(cfg, src: str, home: Path) -> str:
    """The network drops under a drain: its walsender is terminated mid-run (a transient error: the
    task's retry, or the next cron drain, goes on from the landed upper)."""
    def active():
        with psycopg2.connect(src) as conn, conn.cursor() as cur:
            cur.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s AND active_pid IS NOT NULL",
                        (cfg.source.slot,))
            row = cur.fetchone()
            if row:
                cur.execute("SELECT pg_terminate_backend(%s)", row)
                return row[0]
            return None
    pid = _poll(active, 180, "a drain's walsender")
    return f"walsender {pid} terminated"


def _consolidations(cfg) -> list[int]:
    """The running consolidation jobs of the stream: a Spark Connect client (the embedded default) or a
    spark-submit and its driver (``tidemark-<stream>``), by their command lines."""
    pids = set()
    for pattern in (f"consolidate.py --stream-file {cfg.origin}", f"tidemark-{cfg.stream}"):
        out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        pids |= {int(p) for p in out if int(p) != os.getpid()}
    return sorted(pids)


def kill_the_consolidation(cfg, src: str, home: Path) -> str:
    """SIGKILL of a running consolidation's job process (the task fails, its retry runs the job again; a
    commit that went through is not repeated)."""
    pids = _poll(lambda: _consolidations(cfg), 240, "a running consolidation")
    time.sleep(3)     # into the job, not its start-up
    for pid in _consolidations(cfg) or pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return f"consolidation processes {pids} killed"


def kill_the_spark_connect_server(cfg, src: str, home: Path) -> str:
    """``kill -9`` of the warm engine, the embedded Spark Connect server, in the middle of a batch: the
    consolidate task sees it go, runs the batch again with spark-submit (the job is idempotent), and the
    supervisor starts the server again; nobody does anything."""
    from tidemark.local import embedded, processes

    server = embedded.read_info(home)["pids"].get("spark-connect")
    assert server, "the embedded default runs a Spark Connect server"
    _poll(lambda: _consolidations(cfg), 240, "a running consolidation")
    time.sleep(2)
    members = processes.group_members(server)
    for pid in members:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def restarted():
        now = embedded.read_info(home)["pids"].get("spark-connect")
        return now if now and now != server and processes.alive(now) else None
    again = _poll(restarted, 180, "the supervisor to start the Spark Connect server again")
    return f"Spark Connect server {server} (processes {members}) killed with SIGKILL; restarted as {again}"


def delete_landed_segment(cfg, src: str, home: Path) -> str:
    """The file of a segment landed above the frontier is deleted before a consolidation reads it (the
    gap sensor repairs it from the slot; if a consolidation took it first, nothing was lost)."""
    from tidemark.control import open_control

    def pending():
        with open_control(cfg) as ctl:
            frontier = ctl.stream(cfg.stream).frontier or 0
            return [s for s in ctl.segments(cfg.stream) if s.status == "landed" and s.upper > frontier
                    and s.record_count > 0]
    seg = _poll(pending, 240, "a landed segment above the frontier")[-1]
    Path(seg.uri.removeprefix("file://")).unlink(missing_ok=True)   # the live stream lands in a directory
    return f"segment {seg.seq} deleted"


def drop_the_slot(cfg, src: str, home: Path) -> str:
    """The slot is dropped (the drains fail red; the consolidation's timed run resends)."""
    from tidemark.capture.source import drop_slot

    def dropped():
        try:
            return drop_slot(cfg)
        except Exception:      # noqa: BLE001 - a drain holds it this moment: try again
            return False
    _poll(dropped, 120, "the slot to be free to drop", every=0.5)
    return f"slot {cfg.source.slot} dropped"


def change_a_column_type(cfg, src: str, home: Path) -> str:
    """A column's type changes on one table (that table alone is re-snapshotted by the resend step)."""
    with psycopg2.connect(src) as conn, conn.cursor() as cur:
        cur.execute("ALTER TABLE items ALTER COLUMN qty TYPE bigint")
    return "items.qty int -> bigint"


FAULTS = [terminate_walsender, kill_the_consolidation, kill_the_spark_connect_server, delete_landed_segment,
          drop_the_slot, change_a_column_type]


def test_the_schedule_alone_recovers_from_each_fault(live):
    from tidemark.control import open_control

    cfg, api, src = live["cfg"], live["api"], live["source_dsn"]
    dag = {k: f"tidemark_{cfg.stream}_{k}" for k in ("snapshot", "drain", "consolidate")}
    doc = yaml.safe_load(Path(cfg.origin).read_text())
    doc["consolidate"]["check_every_minutes"] = 1
    Path(cfg.origin).write_text(yaml.safe_dump(doc))
    _wait(lambda: "*/1 * * * *" in str(api.call("GET", f"/dags/{dag['consolidate']}/details")["timetable_summary"]),
          300, "the consolidation's timed schedule")
    api.pause(dag["snapshot"], False)
    snap = api.wait_run(dag["snapshot"], api.trigger(dag["snapshot"], conf={"mode": "initial"}))
    assert snap["state"] == "success", snap
    api.pause(dag["drain"], False)
    api.pause(dag["consolidate"], False)
    report, rounds = {}, 100
    try:
        for fault in FAULTS:
            t0 = time.monotonic()
            with Workload(src, rounds) as w:
                did = fault(cfg, src, live["home"])
                time.sleep(15)
            rounds = w.round + 1
            end = _source_lsn(src)

            def converged():
                with open_control(cfg) as ctl:
                    state = ctl.stream(cfg.stream)
                    open_incidents = ctl.incidents(cfg.stream)
                if (state.frontier or 0) < end or open_incidents:
                    return None
                try:
                    _assert_lake_equals_source(cfg)
                except AssertionError:
                    return None
                return state

            def doing():
                with open_control(cfg) as ctl:
                    state = ctl.stream(cfg.stream)
                    incidents = [(i["kind"], i["count"], i["reason"] or i["detail"]) for i in ctl.incidents(cfg.stream)]
                runs = {k: [(r["run_type"], r["state"]) for r in api.runs(dag[k], order_by="-run_after")[:5]]
                        for k in ("drain", "consolidate")}
                return {"fault": did, "frontier": state.frontier, "target": end, "incidents": incidents, "runs": runs}
            _wait(converged, 900, f"the schedule to recover from: {did}", doing)
            report[fault.__name__] = (did, round(time.monotonic() - t0))
    finally:
        api.pause(dag["drain"], True)
        api.pause(dag["consolidate"], True)
        print("unattended recoveries (fault: what was done, seconds to lake = source):", report)
    with open_control(cfg) as ctl:
        kinds = {i["kind"] for i in ctl.incidents(cfg.stream, open_only=False)}
    assert "slot_lost" in kinds, f"the dropped slot was found by the gap sensor: {kinds}"
