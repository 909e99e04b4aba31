"""A dead component of the embedded Airflow does not stay dead.

On the session's embedded Airflow (tests/dags/conftest.py): the scheduler is SIGKILLed and the
supervisor starts a new one by itself, which heartbeats; then the supervisor and the triggerer are
SIGKILLed together (nothing restarts the triggerer now), and running ``tidemark demo`` again starts
what is missing: a new supervisor, which restarts the triggerer at once.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from airflow_env import ROOT
from tidemark.local import embedded

pytestmark = [pytest.mark.airflow, pytest.mark.slow]
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")


def _wait(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _heartbeat_after(info: dict, component: str, since: dt.datetime) -> bool:
    """Whether ``component`` (scheduler, triggerer) heartbeat after ``since`` (a killed one cannot)."""
    try:
        health = requests.get(info["api_url"] + "/monitor/health", timeout=10).json()
    except (requests.RequestException, ValueError):
        return False
    beat = (health.get(component) or {}).get(f"latest_{component}_heartbeat")
    return beat is not None and dt.datetime.fromisoformat(beat) > since


def _restarted(home, name: str, old: int):
    pid = embedded.running(home).get(name)
    return pid if pid not in (None, old) else None


def test_a_killed_component_comes_back_and_demo_starts_what_is_missing(embedded_airflow):
    home, info = embedded_airflow.home, embedded_airflow.info
    before = embedded.running(home)
    assert set(COMPONENTS) <= set(before), before

    killed_at = dt.datetime.now(dt.timezone.utc)
    t0 = time.monotonic()
    os.kill(before["scheduler"], signal.SIGKILL)
    _wait(lambda: _restarted(home, "scheduler", before["scheduler"]), 60, "the scheduler to be restarted")
    restarted = time.monotonic() - t0
    _wait(lambda: _heartbeat_after(info, "scheduler", killed_at), 120, "the new scheduler's heartbeat")
    print(f"scheduler SIGKILLed: restarted after {restarted:.1f}s, heartbeating after {time.monotonic() - t0:.1f}s")
    log = (embedded.airflow_home(home) / "logs" / "supervisor.log").read_text()
    assert f"scheduler (pid {before['scheduler']}) " in log and "restarting it now" in log

    now = embedded.running(home)
    supervisor, triggerer = now["supervisor"], now["triggerer"]
    os.kill(supervisor, signal.SIGKILL)
    os.kill(triggerer, signal.SIGKILL)
    time.sleep(4)
    assert {"supervisor", "triggerer"}.isdisjoint(embedded.running(home))     # nothing restarts it now

    killed_at = dt.datetime.now(dt.timezone.utc)
    t0 = time.monotonic()
    demo = subprocess.run([sys.executable, "-m", "tidemark.cli", "--home", str(home), "demo"], cwd=str(ROOT),
                          capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert f"Airflow UI: {info['ui_url']}" in demo.stdout
    after = embedded.running(home)
    assert set(after) == {*embedded.components(embedded.read_info(home)), "supervisor"}, after
    assert after["supervisor"] != supervisor and after["triggerer"] != triggerer
    assert all(after[n] == now[n] for n in ("api-server", "scheduler", "dag-processor"))   # the live ones kept
    _wait(lambda: _heartbeat_after(info, "triggerer", killed_at), 120, "the new triggerer's heartbeat")
    print(f"supervisor and triggerer SIGKILLed: tidemark demo brought them back in {time.monotonic() - t0:.1f}s")
