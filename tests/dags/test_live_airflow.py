"""Every DAG of a stream under a live Airflow: the embedded api-server, scheduler, dag-processor and
triggerer (LocalExecutor) run on the test cluster, and everything goes through the REST API
(``/api/v2``, JWT login), as a user would drive it:

- the stream's connections exist only in Airflow's metadata database (created through the API);
  every task, and the spark-submit job, reaches them through Airflow; the password never shows in a log;
- snapshot ``initial``; ``resend`` without a gap is *skipped* with its reason in the log; a second
  ``initial`` fails at once (a deterministic error: no retries); ``resend`` with ``force`` re-snapshots;
- a landed segment's file is deleted; the next drain's Asset event ``{segments, records, upper}``
  starts the consolidation, which takes the *repair* branch; the slot is dropped: a manual
  consolidation takes the *resend* branch;
- changelog: the interval holding the commits (its rebuild equals what the consolidation wrote), the
  scheduled run, and a backfill of the 6 hours before it (``POST /api/v2/backfills``): every run succeeds;
- after each consolidation the lake equals ``SELECT *`` of the source (tests/oracle.py).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path

import psycopg2
import pytest
import requests
import yaml

from airflow_env import ROOT
from dag_workload import SCHEMA, TABLES, workload
from tidemark.config import parse_config
from tidemark.connections import set_resolver
from tidemark.local import embedded

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.spark]
TERMINAL = ("success", "failed")
# the changelog backfill's hours: its runs queue one by one for the task (max_active_tis_per_dag=1), a few
# seconds each, so a handful shows the queueing and every run's success as well as 48 did (2 days: ~2 minutes)
BACKFILL_HOURS = 6


class Api:
    """The REST API with a JWT from the auth manager's login."""

    def __init__(self, info: dict):
        self.base = info["api_url"]
        resp = requests.post(info["ui_url"] + "/auth/token",
                             json={"username": info["username"], "password": info["password"]}, timeout=30)
        assert resp.status_code in (200, 201), resp.text
        self.headers = {"Authorization": f"Bearer {resp.json()['access_token']}"}

    def call(self, method: str, path: str, expect=(200, 201), headers: dict | None = None, **kwargs) -> dict:
        resp = requests.request(method, self.base + path, headers={**self.headers, **(headers or {})}, timeout=60,
                                **kwargs)
        assert resp.status_code in expect, f"{method} {path}: {resp.status_code} {resp.text[:2000]}"
        return resp.json() if resp.content else {}

    def pause(self, dag_id: str, paused: bool) -> None:
        self.call("PATCH", f"/dags/{dag_id}", json={"is_paused": paused})

    def trigger(self, dag_id: str, **body) -> str:
        body.setdefault("logical_date", None)
        return self.call("POST", f"/dags/{dag_id}/dagRuns", json=body)["dag_run_id"]

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}")
            if run["state"] in TERMINAL:
                run["tasks"] = self.tasks(dag_id, run_id)
                return run
            time.sleep(2)
        raise AssertionError(f"{dag_id} run {run_id} did not finish in {timeout:.0f}s: {self.tasks(dag_id, run_id)}")

    def tasks(self, dag_id: str, run_id: str) -> dict:
        tis = self.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
        return {ti["task_id"]: {"state": ti["state"], "try_number": ti["try_number"]} for ti in tis}

    def log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        doc = self.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
                        params={"full_content": "true"}, headers={"Accept": "application/json"})
        content = doc.get("content")
        if isinstance(content, list):
            return "\n".join(f"{c.get('event', '')} {json.dumps({k: v for k, v in c.items() if k != 'event'}, default=str)}"
                             if isinstance(c, dict) else str(c) for c in content)
        return str(content)

    def log_with(self, dag_id: str, run_id: str, task_id: str, try_number: int, pattern: str,
                 timeout: float = 30.0) -> str:
        """The task's log once ``pattern`` is in it (or the last one fetched after ``timeout``): the task
        reports its state before its supervisor has written the log's last lines."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.log(dag_id, run_id, task_id, try_number)
            if re.search(pattern, text) or time.monotonic() > deadline:
                return text
            time.sleep(1)

    def runs(self, dag_id: str, **params) -> list[dict]:
        return self.call("GET", f"/dags/{dag_id}/dagRuns", params={"limit": 100, **params})["dag_runs"]

    def queued_events(self, dag_id: str) -> list[dict]:
        """Asset events the scheduler has queued for ``dag_id`` but not yet turned into a run."""
        return self.call("GET", f"/dags/{dag_id}/assets/queuedEvents", expect=(200, 404)).get("queued_events", [])


def _wait(fn, timeout: float, what: str, explain=None):
    """Poll ``fn`` until it returns something true; on timeout, fail with ``explain()`` (what the
    scheduler was doing) in the message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}" + (f": {explain()}" if explain else ""))


def _working(tasks: dict) -> bool:
    """Whether a run has a task that will still run while its DAG is paused. The scheduler does not
    schedule the tasks of a paused DAG: a cron run created just before the pause stays ``running``
    with tasks not yet queued until the DAG is unpaused (it is then no different from the next cron
    run), so only tasks already handed to the executor count."""
    return any(t["state"] in ("queued", "running", "restarting", "deferred") for t in tasks.values())


def _states(run: dict) -> dict:
    return {t: v["state"] for t, v in run["tasks"].items()}


def _assert_states(api: Api, dag_id: str, run: dict, expected: dict) -> None:
    """The run's task states are ``expected``; if not, the message carries the gap sensor's log (why a
    run skipped or took another branch is there)."""
    if _states(run) != expected:
        why = api.log(dag_id, run["dag_run_id"], "wait_for_segments", 1) if "wait_for_segments" in run["tasks"] else ""
        raise AssertionError(f"{dag_id} {run['dag_run_id']}: {_states(run)} != {expected}\n{why[-3000:]}")


@pytest.fixture
def live(request, pg_cluster, source_db, control_dsn, airflow_streams_dir, tmp_path):
    """A stream over a fresh source database and the session's embedded Airflow on the test cluster
    (tests/dags/conftest.py), with the stream's connections defined only in Airflow's metadata database."""
    stream = f"live_{secrets.token_hex(3)}"
    src_id, ctl_id = f"{stream}_src", f"{stream}_ctl"
    password = pg_cluster.password  # the cluster's scram password: it must never appear in a log
    doc = {"stream": stream,
           "source": {"connection": src_id, "publication": f"pub_{stream}", "slot": f"slot_{stream}",
                      "tables": TABLES},
           "control": {"connection": ctl_id},
           "landing": {"url": str(tmp_path / "landing")},
           # maintenance every minute, unpaused for the unattended phase: it runs on its schedule beside
           # the drains, consolidations and the resend there
           "lake": {"path": str(tmp_path / "lake"), "maintain": "* * * * *"},
           "snapshot": {"chunk_pages": 2, "parallelism": 2},
           # no timed consolidation runs until the unattended phase turns them on (each earlier step
           # checks the runs a drain's Asset event starts)
           "consolidate": {"buckets": 2, "check_every_minutes": 0}}
    stream_file = airflow_streams_dir / f"{stream}.yaml"   # before the Airflow starts: its first parse has the DAGs
    stream_file.write_text(yaml.safe_dump(doc))
    cfg = parse_config(doc, origin=str(stream_file))
    dsns = {src_id: source_db, ctl_id: control_dsn}
    set_resolver(dsns.get)  # this process only: the Airflow components get nothing but the metadata DB
    with psycopg2.connect(source_db) as conn, conn.cursor() as cur:
        cur.execute(SCHEMA)
    assert not [k for k in os.environ if k.endswith((src_id.upper(), ctl_id.upper()))]
    airflow = None
    try:
        airflow = request.getfixturevalue("embedded_airflow")
        info, home = airflow.info, airflow.home
        api = Api(info)
        for conn_id, dbname in ((src_id, source_db), (ctl_id, control_dsn)):
            parts = dict(p.split("=", 1) for p in dbname.split())
            api.call("POST", "/connections", json={
                "connection_id": conn_id, "conn_type": "postgres", "host": parts["host"], "port": int(parts["port"]),
                "login": parts["user"], "password": password, "schema": parts["dbname"]})
        yield {"cfg": cfg, "api": api, "info": info, "password": password, "home": home, "source_dsn": source_db,
               "cluster": pg_cluster}
        for dag_id in (f"tidemark_{stream}_{k}" for k in ("snapshot", "drain", "consolidate", "changelog")):
            api.pause(dag_id, True)          # the shared Airflow runs on: nothing of this stream may run later
    finally:
        set_resolver(None)
        stream_file.unlink()
        if airflow is not None:
            shutil.copytree(embedded.airflow_home(airflow.home) / "logs", tmp_path / "airflow-logs",
                            dirs_exist_ok=True)


def _workload(dsn: str, round_: int) -> None:
    """Inserts, updates (TOAST left unchanged), deletes and multiset changes in several transactions."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    workload(conn, round_)
    conn.close()


def _assert_lake_equals_source(cfg) -> None:
    from tidemark.capture.source import connect_source
    from tidemark.lake import read_table
    from tidemark.pgtypes import arrow_schema, table_schema_from_catalog

    from oracle import rows, source_table

    conn = connect_source(cfg)
    try:
        for ref in cfg.source.tables:
            shape = table_schema_from_catalog(conn, ref.schema, ref.name)
            lake = read_table(cfg, ref)
            assert lake.schema == arrow_schema(shape), ref
            want, got = rows(source_table(conn, shape)), rows(lake)
            assert got == want, (ref, "missing:", list((want - got).items())[:3], "extra:",
                                 list((got - want).items())[:3])
    finally:
        conn.close()


def _frontier_is_landed_upper(cfg) -> None:
    from tidemark.control import open_control

    with open_control(cfg) as ctl:
        state = ctl.stream(cfg.stream)
    assert state.frontier is not None and state.frontier == state.landed_upper, state


def test_every_dag_of_a_stream_under_a_live_scheduler(live):
    t0 = time.monotonic()
    timings = {}
    cfg, api, password = live["cfg"], live["api"], live["password"]
    dag = {k: f"tidemark_{cfg.stream}_{k}" for k in ("snapshot", "drain", "consolidate", "changelog", "maintain")}
    src = live["source_dsn"]
    assert embedded.airflow_env(live["home"], live["cluster"], port=1)[
        "AIRFLOW__CORE__DAGS_FOLDER"] == str(ROOT / "dags"), "the embedded Airflow must run this checkout's DAGs"
    assert requests.get(live["info"]["api_url"] + "/dags", timeout=30).status_code in (401, 403)

    for dag_id in dag.values():
        _wait(lambda d=dag_id: requests.get(f"{api.base}/dags/{d}", headers=api.headers, timeout=30).status_code == 200,
              240, f"the dag-processor to parse {dag_id}")
    assert api.call("GET", "/importErrors")["import_errors"] == []
    api.pause(dag["snapshot"], False)
    timings["airflow up, DAGs parsed"] = time.monotonic() - t0

    def run(kind: str, expect: str = "success", **body) -> dict:
        r = api.wait_run(dag[kind], api.trigger(dag[kind], **body))
        assert r["state"] == expect, f"{kind}: {r['state']} {r['tasks']}"
        return r

    def drain_then_consolidate() -> dict:
        """A manual drain; its Asset event makes the scheduler start the consolidation. Waits until
        every consolidation it started has finished (a cron drain may slip in while unpaused)."""
        api.pause(dag["consolidate"], False)
        api.pause(dag["drain"], False)
        before = {r["dag_run_id"] for r in api.runs(dag["consolidate"])}
        drained = run("drain")
        api.pause(dag["drain"], True)
        assert _states(drained) == {"drain": "success"}

        def settled():
            """Every drain finished, every consolidation they started finished, and no Asset event is
            still queued for a run not yet created (a consolidation already running holds it back, and
            a slow scheduler turns it into a run seconds later: left queued, it would start when the
            DAG is next unpaused and take that step's work)."""
            if any(r["state"] not in TERMINAL and _working(api.tasks(dag["drain"], r["dag_run_id"]))
                   for r in api.runs(dag["drain"])):
                return None
            new = [r for r in api.runs(dag["consolidate"]) if r["dag_run_id"] not in before]
            if not new or any(r["state"] not in TERMINAL for r in new) or api.queued_events(dag["consolidate"]):
                return None
            return new
        _wait(lambda: [r for r in api.runs(dag["consolidate"]) if r["dag_run_id"] not in before], 120,
              "the Asset-triggered consolidation")
        def explain():
            return {"drain": [(r["dag_run_id"], r["state"]) for r in api.runs(dag["drain"])],
                    "consolidate": {r["dag_run_id"]: (r["state"], api.tasks(dag["consolidate"], r["dag_run_id"]))
                                    for r in api.runs(dag["consolidate"]) if r["dag_run_id"] not in before},
                    "queued": api.queued_events(dag["consolidate"])}
        new = _wait(settled, 420, "the consolidations to finish", explain)
        api.pause(dag["consolidate"], True)
        assert {r["run_type"] for r in new} == {"asset_triggered"}, new
        assert {r["state"] for r in new} == {"success"}, [api.tasks(dag["consolidate"], r["dag_run_id"]) for r in new]
        consolidated = api.wait_run(dag["consolidate"], min(new, key=lambda r: r["run_after"])["dag_run_id"])
        return {"drain": drained, "consolidate": consolidated}

    # -- snapshot: initial; resend without a gap is skipped; a second initial fails at once ------------
    _workload(src, 0)
    snap = run("snapshot", conf={"mode": "initial", "tables": TABLES, "chunk_pages": 2})
    assert _states(snap) == {"register": "success", "snapshot_copy": "success", "record_metrics": "success"}
    idle = run("snapshot", conf={"mode": "resend"})
    assert _states(idle)["snapshot_copy"] == "skipped"
    assert "no gaps: nothing to resend" in api.log_with(dag["snapshot"], idle["dag_run_id"], "snapshot_copy", 1,
                                                         "no gaps: nothing to resend")
    again = run("snapshot", expect="failed", conf={"mode": "initial"})
    assert again["tasks"]["snapshot_copy"] == {"state": "failed", "try_number": 1}, "a state conflict is not retried"
    assert "already has its initial snapshot" in api.log_with(dag["snapshot"], again["dag_run_id"], "snapshot_copy", 1,
                                                                "already has its initial snapshot")
    timings["snapshots"] = time.monotonic() - t0

    # -- repair: a landed segment's file is deleted; the next drain's Asset event starts the ---------
    # -- consolidation, which re-drains the hole; connections from the metadata DB reach spark-submit --
    from tidemark.control import open_control

    committed_at = dt.datetime.now(dt.timezone.utc)
    _workload(src, 1)
    api.pause(dag["drain"], False)
    run("drain")
    api.pause(dag["drain"], True)
    with open_control(cfg) as ctl:  # the segment holding workload 1 (a cron drain may add empty ones)
        lost = max((s for s in ctl.segments(cfg.stream) if s.record_count > 0), key=lambda s: s.seq)
    Path(lost.uri.removeprefix("file://")).unlink()
    _workload(src, 2)
    first = drain_then_consolidate()
    _assert_states(api, dag["consolidate"], first["consolidate"], {
        "wait_for_segments": "success", "repair": "success", "resend": "skipped", "consolidate": "success"})
    assert Path(lost.uri.removeprefix("file://")).exists(), "the repair re-drains the lost segment"
    events = api.call("GET", "/assets/events", params={"source_dag_id": dag["drain"], "limit": 100})["asset_events"]
    assert first["drain"]["dag_run_id"] in {e["source_run_id"] for e in events}
    for event in events:  # one per drain run (a cron drain may have taken a workload first)
        assert set(event["extra"]) >= {"segments", "records", "upper"}, event
        assert event["extra"]["segments"] >= 1
        assert re.fullmatch(r"[0-9A-F]+/[0-9A-F]+", event["extra"]["upper"])
    assert sum(e["extra"]["records"] for e in events) > 0
    upper = r"'upper': '[0-9A-F]+/[0-9A-F]+'"
    # the try that succeeded: a cron drain holding the slot makes the first one retry (StreamBusy)
    drain_log = api.log_with(dag["drain"], first["drain"]["dag_run_id"], "drain",
                             first["drain"]["tasks"]["drain"]["try_number"], upper)
    assert re.search(upper, drain_log), "\n".join(line[:300] for line in drain_log.splitlines())[-8000:]
    advanced = rf"stream {cfg.stream}: frontier (-|[0-9A-F]+/[0-9A-F]+) -> [0-9A-F]+/[0-9A-F]+"
    spark_log = api.log_with(dag["consolidate"], first["consolidate"]["dag_run_id"], "consolidate",
                             first["consolidate"]["tasks"]["consolidate"]["try_number"], advanced)
    assert re.search(advanced, spark_log)
    assert " INFO SparkContext" not in spark_log and "INFO Executor" not in spark_log, "Spark's console noise"
    for log in (drain_log, spark_log):
        assert password not in log
    _frontier_is_landed_upper(cfg)
    _assert_lake_equals_source(cfg)
    timings["drain, repair, consolidate"] = time.monotonic() - t0

    # -- changelog: the interval with the commits, the scheduled run, a backfill of past hours ----------
    api.pause(dag["changelog"], False)
    now = dt.datetime.now(dt.timezone.utc)
    hour = now.replace(minute=0, second=0, microsecond=0)
    iso = lambda t: t.isoformat()  # noqa: E731
    # unpaused, the scheduler runs the latest complete interval; wait for that run before the backfill
    # below, which would otherwise take its logical date first (a race a slow scheduler loses)
    scheduled = _wait(lambda: [r for r in api.runs(dag["changelog"]) if r["run_type"] == "scheduled"], 300,
                      "the scheduled changelog run of the latest interval")
    cl = run("changelog", logical_date=iso(hour), data_interval_start=iso(hour),
             data_interval_end=iso(hour + dt.timedelta(hours=1)))
    result = api.call("GET", f"/dags/{dag['changelog']}/dagRuns/{cl['dag_run_id']}/taskInstances/write_changelog"
                             "/xcomEntries/return_value")["value"]
    result = json.loads(result) if isinstance(result, str) else result
    assert result["replaced"] == [], "rebuilding an interval must give what the consolidation wrote"
    assert sum(result["tables"].values()) > 0 or committed_at < hour, result   # unless the hour just turned
    backfill = api.call("POST", "/backfills", json={
        "dag_id": dag["changelog"], "from_date": iso(hour - dt.timedelta(hours=BACKFILL_HOURS)),
        "to_date": iso(hour - dt.timedelta(hours=1)), "max_active_runs": 8, "reprocess_behavior": "none"})
    timings["changelog"] = time.monotonic() - t0

    # -- unattended: the slot is lost while the schedule runs; nothing is touched ----------------------
    # A lost slot stops the drains (each fails red: SlotLost) and so their Asset events; the consolidation's
    # timed runs (consolidate.check_every_minutes, 5 by default, 1 here) find it and resend on their own.
    from tidemark.capture.source import drop_slot

    doc = yaml.safe_load(Path(cfg.origin).read_text())
    doc["consolidate"]["check_every_minutes"] = 1
    Path(cfg.origin).write_text(yaml.safe_dump(doc))
    _wait(lambda: "*/1 * * * *" in str(api.call("GET", f"/dags/{dag['consolidate']}/details")["timetable_summary"]),
          240, "the dag-processor to parse the consolidation's timed schedule")
    before = {r["dag_run_id"] for r in api.runs(dag["consolidate"])}
    drains_before = {r["dag_run_id"] for r in api.runs(dag["drain"])}
    with open_control(cfg) as ctl:
        consistent_before = ctl.stream(cfg.stream).consistent_lsn
    assert drop_slot(cfg)
    _workload(src, 4)
    assert api.queued_events(dag["consolidate"]) == [], "a queued Asset event would start a run of its own"
    api.pause(dag["drain"], False)
    api.pause(dag["consolidate"], False)
    api.pause(dag["maintain"], False)
    maintains_before = {r["dag_run_id"] for r in api.runs(dag["maintain"])}

    def recovered():
        """A consolidation resent and loaded the new snapshot, and the lake equals the source again."""
        runs = [r for r in api.runs(dag["consolidate"]) if r["dag_run_id"] not in before and r["state"] in TERMINAL]
        resent = [dict(r, tasks=api.tasks(dag["consolidate"], r["dag_run_id"])) for r in runs]
        resent = [r for r in resent if r["tasks"].get("resend", {}).get("state") == "success"]
        with open_control(cfg) as ctl:
            state = ctl.stream(cfg.stream)
        if not resent or state.consistent_lsn == consistent_before or (state.frontier or 0) < state.consistent_lsn:
            return None
        try:
            _assert_lake_equals_source(cfg)
        except AssertionError:
            return None
        return resent

    def doing():
        return {"consolidate": {r["dag_run_id"]: (r["run_type"], r["state"], api.tasks(dag["consolidate"], r["dag_run_id"]))
                                for r in api.runs(dag["consolidate"]) if r["dag_run_id"] not in before},
                "drain": [(r["dag_run_id"], r["state"]) for r in api.runs(dag["drain"])
                          if r["dag_run_id"] not in drains_before]}
    resent = _wait(recovered, 600, "the schedule alone to resend and load the lake", doing)
    api.pause(dag["drain"], True)
    api.pause(dag["consolidate"], True)

    def maintained():
        """The maintain DAG's scheduled runs of this phase: at least one, each finished."""
        runs = [r for r in api.runs(dag["maintain"]) if r["dag_run_id"] not in maintains_before]
        return runs if runs and all(r["state"] in TERMINAL for r in runs) else None
    maintains = _wait(maintained, 180, "a scheduled maintenance run")
    api.pause(dag["maintain"], True)
    assert {r["run_type"] for r in maintains} == {"scheduled"}, maintains
    assert {r["state"] for r in maintains} == {"success"}, [api.tasks(dag["maintain"], r["dag_run_id"]) for r in maintains]
    _assert_lake_equals_source(cfg)
    assert {r["run_type"] for r in resent} == {"scheduled"}, "the timed run found the lost slot, not an event"
    _assert_states(api, dag["consolidate"], resent[0], {
        "wait_for_segments": "success", "repair": "skipped", "resend": "success", "consolidate": "success"})
    # the drains that met the lost slot failed red, at once, with the line that says what happens
    lost = [r for r in api.runs(dag["drain"]) if r["dag_run_id"] not in drains_before and r["state"] == "failed"]
    for r in lost[:1]:
        assert api.tasks(dag["drain"], r["dag_run_id"])["drain"] == {"state": "failed", "try_number": 1}
        assert re.search("replication slot .* does not exist", api.log_with(
            dag["drain"], r["dag_run_id"], "drain", 1, "does not exist"))
    timings["unattended resend"] = time.monotonic() - t0

    # -- snapshot resend with force (no gap): a new consistent point ---------------------------------
    with open_control(cfg) as ctl:
        consistent_before = ctl.stream(cfg.stream).consistent_lsn
    forced = run("snapshot", conf={"mode": "resend", "force": True})
    assert _states(forced) == {"register": "success", "snapshot_copy": "success", "record_metrics": "success"}
    assert "forced" in api.log_with(dag["snapshot"], forced["dag_run_id"], "snapshot_copy", 1, "forced")
    with open_control(cfg) as ctl:
        assert ctl.stream(cfg.stream).consistent_lsn > consistent_before
    timings["forced resend"] = time.monotonic() - t0

    # -- every changelog run (scheduled, manual, backfill) succeeded ----------------------------------
    def backfill_done():
        doc = api.call("GET", f"/backfills/{backfill['id']}")
        return doc if doc.get("completed_at") else None
    _wait(backfill_done, 300, "the changelog backfill")
    # runs up to the interval holding the commits; a later hour's scheduled run would hold the commits
    # forgotten by the resend above and must fail naming them (docs/segment-format.md), so it is not counted here
    runs = [r for r in api.runs(dag["changelog"])
            if dt.datetime.fromisoformat(r["data_interval_end"]) <= hour + dt.timedelta(hours=1)]
    filled = [r for r in runs if r["run_type"] == "backfill"]
    assert {r["dag_run_id"] for r in scheduled} <= {r["dag_run_id"] for r in runs}, (scheduled, runs)
    # every hour of the range but the latest, which the scheduled run took (reprocess_behavior "none")
    assert len(filled) >= BACKFILL_HOURS - 1, [(r["run_type"], r["logical_date"]) for r in runs]
    assert {r["state"] for r in runs} == {"success"}, [(r["run_type"], r["logical_date"], r["state"]) for r in runs
                                                       if r["state"] != "success"]
    timings["changelog backfill"] = time.monotonic() - t0

    # -- a broken stream fails red, at once; it is never skipped ---------------------------------------
    # (a gap sensor with soft_fail turned a deterministic error into SKIPPED: a skipped run alerts nobody)
    ctl_conn = cfg.control_connection
    api.call("PATCH", f"/connections/{ctl_conn}", json={"connection_id": ctl_conn, "conn_type": "postgres",
                                                        "password": "not-the-password"},
             params={"update_mask": "password"})
    try:
        api.pause(dag["consolidate"], False)
        broken = run("consolidate", expect="failed")
    finally:
        api.pause(dag["consolidate"], True)
        api.call("PATCH", f"/connections/{ctl_conn}", json={"connection_id": ctl_conn, "conn_type": "postgres",
                                                            "password": password}, params={"update_mask": "password"})
    assert broken["tasks"]["wait_for_segments"] == {"state": "failed", "try_number": 1}, broken["tasks"]
    assert "password authentication failed" in api.log_with(dag["consolidate"], broken["dag_run_id"],
                                                            "wait_for_segments", 1, "password authentication failed")
    timings["broken stream"] = time.monotonic() - t0
    print("live-scheduler phases (cumulative seconds):", {k: round(v) for k, v in timings.items()})
