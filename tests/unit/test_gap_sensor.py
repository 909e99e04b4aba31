"""The gap sensor's outcomes at the unit level (Airflow's own `BaseSensorOperator.execute`, no scheduler):
only "nothing to do" skips; a deterministic library error fails the task (red, not retried), a
transient one is re-raised for the retries. The live-scheduler side is in tests/dags/test_gap_sensor_live.py.

On the code before this test, the sensor had ``soft_fail=True``: Airflow's sensor turned the
`AirflowFailException` of a broken stream into `AirflowSkipException`, and this test failed."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.airflow
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))   # as Airflow puts it


def _sensor(monkeypatch, decide):
    from tidemark_airflow import sensors

    monkeypatch.setattr(sensors.TidemarkHook, "decide", lambda self: decide())
    return sensors.TidemarkGapSensor(task_id="wait_for_segments", stream_file="/nowhere/s.yaml")


def _context(task=None):
    ti = SimpleNamespace(get_first_reschedule_date=lambda context: None, task=task)
    return {"ti": ti}


def test_a_broken_stream_fails_red_not_skipped(monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException
    from tidemark.errors import TidemarkError

    def broken():
        raise TidemarkError("stream 's' is not registered; run: tidemark stream apply FILE")

    sensor = _sensor(monkeypatch, broken)
    assert sensor.mode == "reschedule" and not sensor.soft_fail and not sensor.never_fail
    with pytest.raises(AirflowFailException, match="not registered"):
        sensor.execute(_context())


def test_a_transient_error_is_reraised_for_the_retries(monkeypatch):
    def lost():
        raise ConnectionResetError("connection reset by peer")

    with pytest.raises(ConnectionResetError):
        _sensor(monkeypatch, lost).execute(_context())


def test_only_nothing_to_do_skips(monkeypatch):
    from airflow.sdk.exceptions import AirflowSkipException

    sensor = _sensor(monkeypatch, lambda: ("wait", {"decision": "ok", "frontier": 100, "reasons": []}))
    with pytest.raises(AirflowSkipException, match="nothing to consolidate"):
        sensor.execute(_context())

@pytest.mark.parametrize("action", ["consolidate", "repair", "resend"])
def test_the_sensor_branches_to_the_step_it_decided(monkeypatch, action):
    """The sensor is the branch: the decided task runs, the other direct downstream ones are skipped
    (Airflow's `skip_all_except`; consolidate, downstream of repair and resend too, runs after them)."""
    from airflow.sdk import DAG
    from airflow.providers.standard.operators.empty import EmptyOperator

    report = {"decision": "ok" if action == "consolidate" else action, "frontier": 100, "reasons": []}
    with DAG("d", schedule=None):
        sensor = _sensor(monkeypatch, lambda: (action, report))
        sensor >> [EmptyOperator(task_id="consolidate"), EmptyOperator(task_id="repair"),
                   EmptyOperator(task_id="resend")]
    followed = []
    monkeypatch.setattr(type(sensor), "skip_all_except", lambda self, ti, ids: followed.append(list(ids)))
    assert sensor.execute(_context(sensor)) == {"action": action, "report": report}
    assert followed == [[action]]


def test_a_step_with_no_task_downstream_fails_named(monkeypatch):
    from airflow.sdk import DAG
    from airflow.sdk.exceptions import AirflowFailException
    from airflow.providers.standard.operators.empty import EmptyOperator

    with DAG("d", schedule=None):
        sensor = _sensor(monkeypatch, lambda: ("repair", {"decision": "repair", "reasons": []}))
        sensor >> EmptyOperator(task_id="consolidate")
    with pytest.raises(AirflowFailException, match="'repair' is not downstream"):
        sensor.execute(_context())


@pytest.mark.parametrize("flag", ["soft_fail", "never_fail"])
def test_flags_that_turn_failures_into_skips_are_refused(flag):
    from tidemark_airflow.sensors import TidemarkGapSensor

    with pytest.raises(ValueError, match=flag):
        TidemarkGapSensor(task_id="w", stream_file="s.yaml", **{flag: True})
