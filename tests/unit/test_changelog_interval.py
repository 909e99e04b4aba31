"""The changelog DAG's interval arithmetic with the objects Airflow really passes: pendulum
``DateTime``s from the DAG's own timetable (``data_interval_start`` / ``data_interval_end``)."""

from __future__ import annotations

import datetime as dt

import pendulum
from types import SimpleNamespace
import pytest

from tidemark.consolidate.interval import _us, _utc, write_changelog
from tidemark.errors import ChangelogError


def _airflow_interval():
    """A data interval exactly as the scheduler makes it for the changelog DAG's timetable."""
    from airflow.timetables.interval import CronDataIntervalTimetable

    timetable = CronDataIntervalTimetable("0 * * * *", timezone="UTC")
    return timetable.infer_manual_data_interval(run_after=pendulum.datetime(2026, 11, 20, 13, 25, 7, tz="UTC"))


def test_airflow_data_interval_bounds_become_utc_microseconds():
    interval = _airflow_interval()
    start, end = interval.start, interval.end
    assert isinstance(start, pendulum.DateTime)          # what the context hands the operator
    assert _us(start) == int(dt.datetime(2026, 11, 20, 12, tzinfo=dt.timezone.utc).timestamp()) * 1_000_000
    assert _us(end) - _us(start) == 3_600 * 1_000_000
    assert type(_utc(start)) is dt.datetime and _utc(start).tzinfo == dt.timezone.utc
    assert (_utc(end) - _utc(start)) / dt.timedelta(microseconds=1) == 3_600_000_000


@pytest.mark.parametrize("value, expected_us", [
    (pendulum.datetime(2026, 11, 20, 14, 0, 0, 123456, tz="Europe/Amsterdam"), 1_795_179_600_123_456),
    (dt.datetime(2026, 11, 20, 13, 0, 0, 123456), 1_795_179_600_123_456),            # naive = UTC
    (dt.datetime(2026, 11, 20, 13, 0, 0, 123456, tzinfo=dt.timezone.utc), 1_795_179_600_123_456),
    ("2026-11-20T13:00:00.123456Z", 1_795_179_600_123_456),
    (pendulum.datetime(1969, 12, 31, 23, 59, 59, 999999, tz="UTC"), -1),
])
def test_any_datetime_like_converts_exactly(value, expected_us):
    assert _us(value) == expected_us


def test_a_value_that_is_not_a_datetime_is_named():
    with pytest.raises(ChangelogError, match="'yesterday' is not an ISO 8601 date-time"):
        _utc("yesterday")
    with pytest.raises(ChangelogError, match="is not a date-time"):
        _utc(42)


def test_an_empty_airflow_interval_is_refused_before_touching_anything():
    interval = _airflow_interval()
    with pytest.raises(ChangelogError, match=r"empty interval \[2026-11-20T13:00:00\+00:00, 2026-11-20T12:00:00"):
        write_changelog(SimpleNamespace(stream="s"), start=interval.end, end=interval.start)
