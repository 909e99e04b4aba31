"""`TidemarkSparkSubmitOperator` carries the consolidation job's failure class across spark-submit: a
deterministic failure fails the task at once (`AirflowFailException`: no retries), a transient one is
a plain failure (retried). spark-submit here is a stand-in on PATH that runs the application with this
Python and exits with its code, as spark-submit does in client deploy mode (no Spark: the job's
``_run`` is replaced by what the test makes it raise). The last test runs the same failure twice
against a real control database: one incident, count 2, its reason one line."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

FAKE_SPARK_SUBMIT = f"""#!{sys.executable}
# spark-submit in client mode, reduced to what the test needs: run the .py application with its
# arguments and exit with the driver's code
import os, subprocess, sys
args = sys.argv[1:]
takes_value = {{"--master", "--conf", "--name", "--files", "--py-files", "--deploy-mode", "--queue", "--jars",
                "--driver-memory", "--executor-memory", "--num-executors", "--executor-cores", "--keytab",
                "--principal", "--proxy-user", "--properties-file", "--packages", "--archives",
                "--total-executor-cores", "--driver-class-path", "--exclude-packages", "--repositories"}}
i = 0
while i < len(args) and args[i].startswith("--"):
    i += 2 if args[i] in takes_value else 1
app, rest = args[i], args[i + 1:]
print("fake spark-submit: running", app, flush=True)
if os.environ.get("FAKE_CLUSTER_MODE"):
    # cluster deploy mode: the driver runs elsewhere (no result file reaches it) and spark-submit
    # reports only that the application failed
    env = {{k: v for k, v in os.environ.items() if k != "TIDEMARK_RESULT_FILE"}}
    sys.exit(1 if subprocess.call([sys.executable, app, *rest], env=env) else 0)
sys.exit(subprocess.call([sys.executable, app, *rest]))
"""

# the application: jobs/consolidate.py with its work replaced by the failure the test asks for
APP = """
import os, sys
sys.path.insert(0, {jobs!r})
import consolidate as job
import tidemark.errors
from tidemark.errors import TidemarkError
TransientError = getattr(tidemark.errors, "TransientError", TidemarkError)   # (the old library had none)

def run(stream_file, follow=False):
    how = os.environ["TEST_FAILURE"]
    if how == "exit2-no-file":                  # an old job: only its exit code says deterministic
        os.environ.pop("TIDEMARK_RESULT_FILE", None)
        raise TidemarkError("segment 4 is malformed")
    if how == "transient":
        raise TransientError("replication connection lost: server closed the connection unexpectedly")
    if how == "deterministic":
        raise TidemarkError("stream s: segment 4 is malformed")
    if how.startswith("incident"):              # what the consolidation does on failure: an incident, then raise
        import secrets
        from tidemark.config import load_config
        from tidemark.control import open_control
        cfg = load_config(stream_file)
        tid = secrets.randbelow(10**6)
        dump = (f"An error occurred while calling o{{tid}}.save.\\n: org.apache.spark.SparkException: Job aborted "
                f"due to stage failure: Lost task 0.0 in stage {{tid % 97}}.0 (TID {{tid}}): "
                "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\\n"
                '  File "worker.py", line 1, in main\\nModuleNotFoundError: No module named \\'tidemark\\'\\n'
                "\\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(PythonRunner.scala:572)\\n")
        with open_control(cfg) as ctl:
            incident = ctl.open_incident(cfg.stream, "consolidate_failed", {{
                "stream": cfg.stream, "table": "public.items", "step": "decoding the segments (Spark job)",
                "segment": {{"seq": 4}}, "position": "0/16B3748", "reason": dump, "attempt": tid % 3}})
        err = TidemarkError(f"consolidation failed (incident {{incident}}): while decoding: {{dump.splitlines()[0]}}")
        err.incident = incident
        if how == "incident-transient":         # e.g. a lost executor: raised from a transient cause
            try:
                raise ConnectionResetError("executor lost")
            except ConnectionResetError as cause:
                raise err from cause
        raise err
    raise SystemExit(int(how))                  # any other exit code (spark-submit's own, a killed driver)

job._run = run
sys.exit(job.main())
"""


@pytest.fixture
def fake_spark(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "spark-submit"
    tool.write_text(FAKE_SPARK_SUBMIT)
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(APP.format(jobs=str(ROOT / "jobs"))))
    for folder in ("plugins", "dags"):
        if str(ROOT / folder) not in sys.path:
            monkeypatch.syspath_prepend(str(ROOT / folder))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"}))
    monkeypatch.delenv("TIDEMARK_SPARK_CONF", raising=False)
    # the fake app and the job import tidemark from this checkout
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "include"), os.environ.get("PYTHONPATH", "")]))
    return app


def _task(tmp_path, app, stream_file=None):
    from tidemark_airflow.operators import TidemarkSparkSubmitOperator

    if stream_file is None:
        os.environ.setdefault("AIRFLOW_CONN_SRC", "postgresql://u:x@db.example/src")
        os.environ.setdefault("AIRFLOW_CONN_CTL", "postgresql://u:x@db.example/ctl")
        stream_file = tmp_path / "s.yaml"
        stream_file.write_text(yaml.safe_dump({
            "stream": "s", "source": {"connection": "src", "tables": ["public.a"]}, "control": {"connection": "ctl"},
            "landing": {"url": str(tmp_path / "land")}, "lake": {"path": str(tmp_path / "lake")}}))
    # the job's outcomes are under test: it runs whatever landed (the DAG's task first skips an idle stream)
    return TidemarkSparkSubmitOperator(task_id="consolidate", stream_file=str(stream_file), conn_id="spark_default",
                                       application=str(app), name="tidemark-s", skip_if_idle=False,
                                       application_args=["--stream-file", str(stream_file)])


@pytest.mark.parametrize("failure, retried", [
    ("deterministic", False),      # the result file says so
    ("exit2-no-file", False),      # no file: the driver's exit code (2) says so
    ("transient", True),
    ("1", True),                   # spark-submit's own failure, or cluster mode: unknown, so retried
])
def test_the_job_class_decides_retry_or_not(tmp_path, monkeypatch, fake_spark, failure, retried):
    """Before: every failure was the provider's plain AirflowException (retried twice)."""
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    monkeypatch.setenv("TEST_FAILURE", failure)
    task = _task(tmp_path, fake_spark)
    with pytest.raises(AirflowException) as caught:
        task.execute({})
    assert isinstance(caught.value, AirflowFailException) is (not retried), caught.value
    if not retried:
        assert "deterministic: not retried" in str(caught.value) and "\n" not in str(caught.value)
    assert not os.path.exists(task._result_file)       # the result file is removed after the run


def test_the_same_failure_twice_is_one_incident_with_count_2(tmp_path, monkeypatch, fake_spark, make_stream,
                                                             control):
    """Two runs of the task that fail the same way (their Spark texts differ in object, stage and task ids
    and the attempt): each fails at once (no retry), and the control database holds one incident whose
    count is 2 and whose reason is the executor's error on one line. Before: two incidents, each reason a
    whole Py4J dump with its Java frames."""
    from airflow.sdk.exceptions import AirflowFailException

    cfg = make_stream(["public.items"])
    control.upsert_stream(cfg)
    path = tmp_path / f"{cfg.stream}.yaml"
    path.write_text(yaml.safe_dump(cfg.as_dict()))
    monkeypatch.setenv("TEST_FAILURE", "incident")
    for _ in range(2):
        with pytest.raises(AirflowFailException) as caught:
            _task(tmp_path, fake_spark, path).execute({})
    [inc] = control.incidents(cfg.stream)
    assert f"(incident {inc['id']})" in str(caught.value)
    assert inc["count"] == 2 and inc["kind"] == "consolidate_failed"
    assert inc["reason"] == "ModuleNotFoundError: No module named 'tidemark'" == inc["detail"]["reason"]
    assert inc["step"] == "decoding the segments (Spark job)"


@pytest.mark.parametrize("failure, retried", [("incident", False), ("incident-transient", True)])
def test_cluster_mode_reads_the_class_the_job_recorded_on_its_incident(tmp_path, monkeypatch, fake_spark,
                                                                        make_stream, control, failure, retried):
    """Cluster deploy mode: no result file and spark-submit's code is 1 whatever the driver's; the job
    recorded its failure's class on its incident in the control database, and the task reads it there."""
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    cfg = make_stream(["public.items"])
    control.upsert_stream(cfg)
    path = tmp_path / f"{cfg.stream}.yaml"
    path.write_text(yaml.safe_dump(cfg.as_dict()))
    monkeypatch.setenv("TEST_FAILURE", failure)
    monkeypatch.setenv("FAKE_CLUSTER_MODE", "1")
    with pytest.raises(AirflowException) as caught:
        _task(tmp_path, fake_spark, path).execute({})
    assert isinstance(caught.value, AirflowFailException) is (not retried), caught.value
    [inc] = control.incidents(cfg.stream)
    if not retried:
        assert f"(incident {inc['id']})" in str(caught.value) and "ModuleNotFoundError" in str(caught.value)


@pytest.mark.parametrize("failure, retried", [("exit2-no-file", False), ("transient", True)])
def test_a_real_spark_submit_in_client_mode_carries_the_drivers_exit_code(tmp_path, monkeypatch, fake_spark,
                                                                          failure, retried):
    """The real spark-submit (local master, client deploy mode) exits with the Python driver's own code,
    so a job that could not write its result file is still classified by its code."""
    import shutil

    import pyspark
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    real = Path(sys.executable).parent / "spark-submit"
    if not real.is_file() and shutil.which("spark-submit") is None:
        pytest.skip("spark-submit is not installed")
    bin_dir = real.parent if real.is_file() else Path(shutil.which("spark-submit")).parent
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH'].split(os.pathsep, 1)[1]}")  # not the fake
    monkeypatch.setenv("SPARK_HOME", os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__))
    monkeypatch.setenv("TEST_FAILURE", failure)
    task = _task(tmp_path, fake_spark)
    task.conf = {"spark.ui.enabled": "false"}
    with pytest.raises(AirflowException) as caught:
        task.execute({})
    assert isinstance(caught.value, AirflowFailException) is (not retried), caught.value
    assert task._hook._submit_sp.returncode == (75 if retried else 2)
