"""What a library error does to an Airflow task: deterministic errors fail at once
(`AirflowFailException`: no retries), transient ones are re-raised for the task's retries."""

from __future__ import annotations

import logging
import os
import socket

import psycopg2
import pytest

from tidemark.errors import ChangelogError, ConfigError, SegmentError, StreamBusy, TidemarkError
from tidemark.failures import is_transient


def _refused_connection() -> psycopg2.OperationalError:
    """A real 'connection refused' from libpq (a port nobody listens on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        psycopg2.connect(host="127.0.0.1", port=port, user="x", dbname="x", connect_timeout=3)
    except psycopg2.OperationalError as exc:
        return exc
    raise AssertionError("connected to a closed port")


def _chained(outer: Exception, cause: BaseException) -> Exception:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise outer from inner
    except Exception as exc:  # noqa: BLE001
        return exc


@pytest.mark.parametrize("exc, transient", [
    (ConfigError("source.tables", "must be a non-empty list", source="s.yaml"), False),
    (SegmentError("00000000000000000007_…", "bad checksum", record=3), False),
    (TidemarkError("stream s already has its initial snapshot; run a resend"), False),
    (ValueError("tables ['x'] are not in the stream"), False),
    (StreamBusy("another drain is already running (held by pid 4242)"), True),
    (ConnectionResetError("connection reset by peer"), True),
    (TimeoutError("timed out"), True),
    (RuntimeError("something unexpected"), True),                  # unknown: a retry is the safe default
])
def test_errors_are_classified(exc, transient):
    assert is_transient(exc) is transient


def test_a_lost_database_connection_is_transient_even_when_wrapped():
    lost = _refused_connection()
    assert is_transient(lost)
    assert is_transient(_chained(ChangelogError("interval [a, b): cannot read"), lost))
    assert not is_transient(_chained(ChangelogError("interval [a, b): bad"), ValueError("bad row")))


def test_operators_fail_deterministic_errors_and_reraise_transient_ones():
    import sys
    from pathlib import Path

    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))  # as Airflow puts it
    from tidemark_airflow.operators import library_errors

    log = logging.getLogger("test")
    with pytest.raises(AirflowFailException, match="source.tables: must be a non-empty list.*not retried"):
        with library_errors(log):
            raise ConfigError("source.tables", "must be a non-empty list", source="s.yaml")
    lost = _refused_connection()
    with pytest.raises(psycopg2.OperationalError):
        with library_errors(log):
            raise lost
    with pytest.raises(StreamBusy):
        with library_errors(log):
            raise StreamBusy("held by pid 1")
    with pytest.raises(AirflowSkipException, match="nothing to do"):
        with library_errors(log):
            raise AirflowSkipException("nothing to do")
    # a full disk (here the landing store's, raised from the OSError) fails at once, said without its facts'
    # JSON or a traceback: before, its OSError context made it transient, retried red every run
    from tidemark.errors import LakeFull
    from tidemark.landing.store import StoreFull

    with pytest.raises(AirflowFailException, match=r"^StoreFull: landing store /l: no space left .*; remedy: free "
                                                   r"space there .*not retried\)$"):
        with library_errors(log):
            try:
                raise OSError(28, "No space left on device")
            except OSError:
                raise StoreFull("landing store /l: no space left for k (it needs at least 5 bytes); "
                                f"{StoreFull.remedy}: nothing of it was published or registered")
    with pytest.raises(AirflowFailException) as caught:
        with library_errors(log):
            raise LakeFull({"path": "/lake/s/tables/public.t/_bucket=0/part-1.parquet", "needed": 10, "free": 0})
    assert "LakeFull: the lake is full: no space left" in str(caught.value) and "{" not in str(caught.value)


def test_a_task_waits_for_the_stream_lease_inside_the_library_call_only(monkeypatch):
    """The tasks' lease wait is set for the library call and taken back after it: a task run in-process
    (``dag.test``) must not make the CLI or a later call of the same process wait."""
    import logging
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
    from tidemark.control.db import LOCK_WAIT_ENV, lock_wait_seconds
    from tidemark_airflow.operators import TASK_LOCK_WAIT_SECONDS, library_errors

    monkeypatch.delenv(LOCK_WAIT_ENV, raising=False)
    assert lock_wait_seconds() == 0
    with pytest.raises(StreamBusy):
        with library_errors(logging.getLogger("test")):
            assert lock_wait_seconds() == TASK_LOCK_WAIT_SECONDS
            raise StreamBusy("held by pid 1")
    assert LOCK_WAIT_ENV not in os.environ
    monkeypatch.setenv(LOCK_WAIT_ENV, "7")        # the deployment's own setting wins, and stays
    with library_errors(logging.getLogger("test")):
        assert lock_wait_seconds() == 7
    assert os.environ[LOCK_WAIT_ENV] == "7"
