"""A failure's class (retry or not) and its one-line reason, from the library to the Airflow task:
connection losses raised by the capture are retried while a wrong password is not, the consolidation
job carries its class across spark-submit (exit code and result file), and an error text holding a
Java stack trace or a Py4J dump becomes its first meaningful line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psycopg2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidemark.errors import TidemarkError, TransientError, normalize_reason, reason_line
from tidemark.failures import EXIT_DETERMINISTIC, EXIT_TRANSIENT, is_transient, job_failure_class, read_job_result

ROOT = Path(__file__).resolve().parents[2]

# -- texts as Spark and Py4J give them ----------------------------------------------------------------

EXECUTOR_IMPORT = """An error occurred while calling o{oid}.save.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage {stage}.0 failed 1 times, \
most recent failure: Lost task 0.0 in stage {stage}.0 (TID {tid}) (10.0.0.7 executor driver): \
org.apache.spark.api.python.PythonException: Traceback (most recent call last):
  File "/opt/spark/python/lib/pyspark.zip/pyspark/worker.py", line 1247, in main
    func, profiler, deserializer, serializer = read_command(pickleSer, infile)
ModuleNotFoundError: No module named 'tidemark'

\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(PythonRunner.scala:572)
\tat org.apache.spark.scheduler.Task.run(Task.scala:141)
\tat java.base/java.lang.Thread.run(Thread.java:840)
"""

JAVA_OOM = """An error occurred while calling o{oid}.collectToPython.
: java.lang.OutOfMemoryError: Java heap space
\tat java.base/java.util.Arrays.copyOf(Arrays.java:3537)
\tat org.apache.spark.sql.execution.SparkPlan.executeCollect(SparkPlan.scala:440)
"""

CAUSED_BY = """org.apache.spark.SparkException: Job aborted.
\tat org.apache.spark.sql.delta.files.DeltaFileFormatWriter$.write(DeltaFileFormatWriter.scala:300)
Caused by: java.io.IOException: No space left on device
\tat java.base/java.io.FileOutputStream.writeBytes(Native Method)
\t... 42 more
"""


def test_a_py4j_dump_of_an_executor_import_error_is_that_error():
    assert reason_line(EXECUTOR_IMPORT.format(oid=123, stage=3, tid=7)) == \
        "ModuleNotFoundError: No module named 'tidemark'"


def test_a_java_oom_is_shown_as_out_of_memory_not_as_the_lost_connection():
    assert reason_line(JAVA_OOM.format(oid=55)) == "java.lang.OutOfMemoryError: Java heap space"
    assert reason_line("ConnectionRefusedError: [Errno 111] Connection refused\n" + JAVA_OOM.format(oid=1)) \
        == "java.lang.OutOfMemoryError: Java heap space"


def test_the_deepest_java_cause_is_the_reason():
    assert reason_line(CAUSED_BY) == "java.io.IOException: No space left on device"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=80), min_size=0, max_size=30))
def test_a_reason_is_always_one_bounded_line(lines):
    out = reason_line("\n".join(lines))
    assert "\n" not in out and "\r" not in out and len(out) <= 500


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 10**6), st.integers(0, 10**4), st.integers(0, 10**6), st.integers(1, 10**6),
       st.integers(1, 10**6), st.integers(1, 10**6), st.integers(1, 10**6), st.integers(1, 10**6))
def test_what_changes_between_two_occurrences_is_not_part_of_the_cause(o1, s1, t1, o2, s2, t2, p1, p2):
    """Spark's object, stage and task ids, pids and attempt numbers differ on every retry; the cause does not."""
    a = EXECUTOR_IMPORT.format(oid=o1, stage=s1, tid=t1).replace("ModuleNotFoundError: No module named 'tidemark'",
                                                                  "ValueError: bad row")
    b = EXECUTOR_IMPORT.format(oid=o2, stage=s2, tid=t2).replace("ModuleNotFoundError: No module named 'tidemark'",
                                                                  "ValueError: bad row")
    assert normalize_reason(a) == normalize_reason(b)
    assert normalize_reason(f"lock (backend pid {p1}) lost, attempt {p1 % 5} of 3") == \
        normalize_reason(f"lock (backend pid {p2}) lost, attempt {p2 % 5} of 3")
    assert normalize_reason("ValueError: bad row") != normalize_reason("ValueError: another row")


# -- retry or not -----------------------------------------------------------------------------------

def _libpq_error(message: str) -> psycopg2.OperationalError:
    return psycopg2.OperationalError(message)


@pytest.mark.parametrize("exc, transient", [
    # what the capture raises when its connection goes (replication.py, drain.py): retried
    (TransientError("replication connection lost: server closed the connection unexpectedly"), True),
    (TransientError("cannot open a replication connection to the source: connection to server at \"127.0.0.1\", "
                    "port 5 failed: Connection refused"), True),
    # ... unless libpq says it will fail the same way again
    (TransientError("cannot open a replication connection to the source: connection to server at \"h\", port 5432 "
                    "failed: FATAL:  password authentication failed for user \"u\""), False),
    (_libpq_error("connection to server at \"h\" (10.0.0.1), port 5432 failed: Connection refused"), True),
    (_libpq_error("server closed the connection unexpectedly"), True),
    (_libpq_error("FATAL:  password authentication failed for user \"tidemark\""), False),
    (_libpq_error("invalid integer value \"54x32\" for connection option \"port\""), False),
    (_libpq_error("FATAL:  database \"nope\" does not exist"), False),
    (_libpq_error("connection to server at \"h\", port 5432 failed: SSL error: certificate verify failed"), False),
    (_libpq_error("could not translate host name \"no-such-host.invalid\" to address: Name or service not known"),
     False),
])
def test_connection_failures_are_classified_by_what_libpq_says(exc, transient):
    assert is_transient(exc) is transient


def test_the_drains_lost_connection_is_retried(monkeypatch):
    """Before, `_connection_errors_named` and the replication stream raised a plain `TidemarkError`."""
    from tidemark.capture import drain
    from tidemark.config import parse_config

    cfg = parse_config({"stream": "s", "source": {"connection": "src", "tables": ["public.a"]},
                        "control": {"connection": "ctl"}, "landing": {"url": "/tmp/l"}, "lake": {"path": "/tmp/k"}},
                       origin="<test>")
    with pytest.raises(TidemarkError) as caught:
        with drain._connection_errors_named(cfg):
            raise psycopg2.OperationalError("terminating connection due to administrator command")
    assert isinstance(caught.value, TransientError) and is_transient(caught.value)
    assert "\n" not in str(caught.value)


def test_the_replication_stream_raises_transient_errors_for_a_lost_connection():
    import inspect

    from tidemark.capture import replication

    source = inspect.getsource(replication.WalStream)
    # every connection failure of the walsender stream is a TransientError (is_transient reads libpq's message)
    for said in ("cannot open a replication connection", "replication connection lost"):
        at = source.index(said)
        assert "raise TransientError(" in source[source.rfind("raise", 0, at) - 1:at], said


# -- across spark-submit ------------------------------------------------------------------------------

@pytest.mark.parametrize("result, rc, expected", [
    ({"class": "deterministic"}, 1, "deterministic"),    # the file wins over spark-submit's code
    ({"class": "transient"}, EXIT_DETERMINISTIC, "transient"),
    (None, EXIT_DETERMINISTIC, "deterministic"),         # no file: the driver's code (client mode)
    (None, EXIT_TRANSIENT, "transient"),
    (None, 1, "transient"),                              # spark-submit's own failure, cluster mode: retry
    (None, None, "transient"),
])
def test_a_jobs_failure_class(result, rc, expected):
    assert job_failure_class(result, rc) == expected


def test_cluster_mode_falls_back_on_the_class_recorded_in_the_control_database():
    assert job_failure_class(None, 1, "deterministic") == "deterministic"
    assert job_failure_class(None, 1, "transient") == "transient"
    assert job_failure_class(None, EXIT_TRANSIENT, "deterministic") == "transient"     # the driver's own code first
    assert job_failure_class({"class": "transient"}, 1, "deterministic") == "transient"


def _job():
    sys.path.insert(0, str(ROOT / "jobs"))
    try:
        import consolidate as job
    finally:
        sys.path.pop(0)
    return job


def test_the_job_says_a_bad_stream_file_is_deterministic(tmp_path, monkeypatch, capsys):
    """Before: the stream file was read outside the job's error handling (a traceback, exit 1, retried)."""
    monkeypatch.setenv("TIDEMARK_RESULT_FILE", str(tmp_path / "result.json"))
    bad = tmp_path / "s.yaml"
    bad.write_text("stream: s\nsource: {connection: src}\n")
    assert _job().main(["--stream-file", str(bad)]) == EXIT_DETERMINISTIC
    result = read_job_result(str(tmp_path / "result.json"))
    assert result["class"] == "deterministic" and result["outcome"] == "failed"
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("tidemark: error: ") and err[0].endswith("[deterministic]"), err


@pytest.mark.parametrize("raised, rc, kind", [
    (TransientError("replication connection lost: server closed the connection"), EXIT_TRANSIENT, "transient"),
    (psycopg2.OperationalError("connection to server at \"h\", port 1 failed: Connection refused"), EXIT_TRANSIENT,
     "transient"),
    (TidemarkError("stream s: segment 4 is malformed"), EXIT_DETERMINISTIC, "deterministic"),
    (RuntimeError(JAVA_OOM.format(oid=3)), EXIT_DETERMINISTIC, "deterministic"),
])
def test_the_job_exits_with_its_failures_class(tmp_path, monkeypatch, capsys, raised, rc, kind):
    """Before: every TidemarkError exited 2 (a lost connection included) and anything else with a traceback
    and 1; spark-submit made both a plain failure."""
    job = _job()
    monkeypatch.setenv("TIDEMARK_RESULT_FILE", str(tmp_path / "result.json"))

    def run(stream_file, follow=False):
        raise raised

    monkeypatch.setattr(job, "_run", run)
    assert job.main(["--stream-file", "unused.yaml"]) == rc
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["class"] == kind and "\n" not in result["reason"]
    if isinstance(raised, RuntimeError):
        assert result["reason"] == "java.lang.OutOfMemoryError: Java heap space"
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if ln.startswith("tidemark: error: ")][0].endswith(f"[{kind}]")


def test_without_a_result_file_the_job_still_exits(tmp_path, monkeypatch):
    job = _job()
    monkeypatch.delenv("TIDEMARK_RESULT_FILE", raising=False)
    monkeypatch.setattr(job, "_run", lambda f, follow=False: (_ for _ in ()).throw(TidemarkError("bad")))
    assert job.main(["--stream-file", "x"]) == EXIT_DETERMINISTIC
    assert not os.path.exists(tmp_path / "result.json")


def test_a_refused_replication_connection_is_one_transient_line():
    """Before: opening the walsender connection failed with AttributeError ('str' object has no attribute
    'decode': psycopg 3's get_error_message returns text) instead of the message, and was not retried."""
    import socket

    from tidemark.capture.replication import WalStream

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransientError) as caught:
        WalStream(f"host=127.0.0.1 port={port} user=x dbname=x connect_timeout=3")
    assert "Connection refused" in str(caught.value) and "\n" not in str(caught.value)
    assert is_transient(caught.value)


def test_a_consolidation_failures_reason_is_the_executors_own_error():
    """Before: the Py4J dump's first exception line ("Job aborted due to stage failure: … PythonException:
    Traceback (most recent call last):"), or for another exception type its whole text, frames included."""
    from tidemark.failures import failure_reason

    dump = EXECUTOR_IMPORT.format(oid=9, stage=2, tid=4).replace("No module named 'tidemark'",
                                                                  "No module named 'numpy'")
    reason, fix = failure_reason(RuntimeError(dump))
    assert reason == "RuntimeError: ModuleNotFoundError: No module named 'numpy'" and fix is None
    reason, fix = failure_reason(RuntimeError(CAUSED_BY))     # a full disk says so, with where to free space
    assert reason == "a disk is full (java.io.IOException: No space left on device)" and "spark.local.dir" in fix
