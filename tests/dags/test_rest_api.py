"""The embedded Airflow end to end: `tidemark.local.embedded.up` starts the four components on a local
PostgreSQL; a snapshot run is triggered through the REST API (/api/v2) with Params and succeeds."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import psycopg2
import pytest
import requests

from tidemark.local import embedded

pytestmark = [pytest.mark.airflow, pytest.mark.slow]
DAG_ID = "tidemark_demo_snapshot"


@pytest.fixture(scope="module")
def airflow_up():
    """Start the embedded default in a temporary home; stop everything afterwards."""
    home = Path(tempfile.mkdtemp(prefix="tidemark-emb-"))
    os.chmod(home, 0o755)
    info = None
    try:
        info = embedded.up(home, unpause=False, timeout=300)
        yield home, info
    finally:
        embedded.down(home)
        embedded.cluster_for(home).stop()
        assert embedded.running(home) == {}
        assert embedded.leftovers(home) == [], "stopping the embedded Airflow must leave nothing running"
        shutil.rmtree(home, ignore_errors=True)


def _token(api: str, info: dict) -> dict:
    url = info["ui_url"] + "/auth/token"
    resp = requests.post(url, json={"username": info["username"], "password": info["password"]}, timeout=30)
    assert resp.status_code in (200, 201), resp.text
    return {"Authorization": f"Bearer {resp.json()['access_token']}"}


def _wait(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}")


def test_snapshot_run_triggered_through_the_rest_api_succeeds(airflow_up):
    home, info = airflow_up
    from tidemark.local.demo import load_demo_schema

    cluster = embedded.cluster_for(home)
    load_demo_schema(cluster.dsn("demo"), customers=40)
    api = info["api_url"]
    assert requests.get(f"{api}/dags", timeout=30).status_code in (401, 403)  # the API needs a token
    headers = _token(api, info)

    _wait(lambda: requests.get(f"{api}/dags/{DAG_ID}", headers=headers, timeout=30).status_code == 200, 180,
          "the dag-processor to parse the stream DAGs")
    resp = requests.patch(f"{api}/dags/{DAG_ID}", json={"is_paused": False}, headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    conf = {"tables": ["public.customers", "public.orders"], "chunk_pages": 1, "mode": "initial"}
    resp = requests.post(f"{api}/dags/{DAG_ID}/dagRuns", json={"logical_date": None, "conf": conf},
                         headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    run_id = resp.json()["dag_run_id"]
    assert resp.json()["conf"] == conf

    def finished():
        run = requests.get(f"{api}/dags/{DAG_ID}/dagRuns/{run_id}", headers=headers, timeout=30).json()
        return run if run["state"] in ("success", "failed") else None
    run = _wait(finished, 300, f"run {run_id}")
    tis = requests.get(f"{api}/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances", headers=headers, timeout=30).json()
    states = {ti["task_id"]: ti["state"] for ti in tis["task_instances"]}
    assert run["state"] == "success", f"{states}; logs in {info['logs']}"
    assert states == {"register": "success", "snapshot_copy": "success", "record_metrics": "success"}

    # the Params reached the library: exactly the two tables, with their source row counts
    with psycopg2.connect(cluster.dsn("tidemark")) as ctl, ctl.cursor() as cur:
        cur.execute("SELECT tables, status FROM tidemark.snapshots WHERE stream = 'demo'")
        (tables, status), = cur.fetchall()
    assert status in ("complete", "loaded")
    assert sorted(tables) == ["public.customers", "public.orders"]
    with psycopg2.connect(cluster.dsn("demo")) as src, src.cursor() as cur:
        for table in ("customers", "orders"):
            cur.execute(f"SELECT count(*) FROM public.{table}")
            assert tables[f"public.{table}"]["rows"] == cur.fetchone()[0]
