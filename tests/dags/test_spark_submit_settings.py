"""The consolidate DAG's spark-submit carries the settings of `tidemark.sparkconf` (machine defaults
in local mode, the ``spark_default`` extras, the stream file's ``consolidate.spark_conf``; the task's
own ``conf`` wins) and, on a cluster, the library zip as ``--py-files`` (no Spark, no database)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_env_settings(monkeypatch):
    monkeypatch.delenv("TIDEMARK_SPARK_CONF", raising=False)


def _command(tmp_path, monkeypatch, conn: dict, **task_kw) -> list[str]:
    for folder in ("plugins", "dags"):
        if str(ROOT / folder) not in sys.path:
            monkeypatch.syspath_prepend(str(ROOT / folder))
    from tidemark_airflow.operators import TidemarkSparkSubmitOperator

    monkeypatch.setenv("AIRFLOW_CONN_SRC", "postgresql://u:secret-pw@db.example/src")
    monkeypatch.setenv("AIRFLOW_CONN_CTL", "postgresql://u:secret-pw@db.example/ctl")
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(conn))
    monkeypatch.setenv("TIDEMARK_DIST_DIR", str(tmp_path / "dist"))
    stream = tmp_path / "s.yaml"
    stream.write_text(yaml.safe_dump({
        "stream": "s", "source": {"connection": "src", "tables": ["public.a"]}, "control": {"connection": "ctl"},
        "landing": {"url": str(tmp_path / "land")}, "lake": {"path": str(tmp_path / "lake")},
        "consolidate": {"spark_conf": {"spark.driver.memory": "1500m", "spark.sql.shuffle.partitions": 3}}}))
    task = TidemarkSparkSubmitOperator(task_id="consolidate", stream_file=str(stream), conn_id="spark_default",
                                       application=str(ROOT / "jobs" / "consolidate.py"), name="tidemark-s",
                                       application_args=["--stream-file", str(stream)], **task_kw)
    task.prepare()
    cmd = task._get_hook()._build_spark_submit_command(task.application)
    assert not any("secret-pw" in c for c in cmd)          # never on the command line
    if "TIDEMARK_CONN_FILE" not in task.env_vars:           # client mode: in spark-submit's environment
        assert set(task.env_vars) >= {"TIDEMARK_CONN_SRC", "TIDEMARK_CONN_CTL"}
    task._cmd = cmd
    _command.last_task = task
    return cmd


def _confs(cmd: list[str]) -> dict[str, str]:
    return dict(cmd[i + 1].split("=", 1) for i, c in enumerate(cmd) if c == "--conf")


@pytest.mark.parametrize("installed", [False, True])
def test_cluster_gets_settings_node_python_and_the_library(tmp_path, monkeypatch, installed):
    extra = {"spark.executor.memory": "3g", "spark.pyspark.python": "/opt/node/bin/python3"}
    if installed:
        extra["tidemark_installed"] = True
    cmd = _command(tmp_path, monkeypatch, {"conn_type": "spark", "host": "spark://m.example", "port": 7077,
                                           "extra": extra}, conf={"spark.sql.shuffle.partitions": "7"})
    conf = _confs(cmd)
    assert cmd[:3] == ["spark-submit", "--master", "spark://m.example:7077"]
    assert conf["spark.executor.memory"] == "3g" and conf["spark.driver.memory"] == "1500m"
    assert conf["spark.sql.shuffle.partitions"] == "7"                  # the task's own conf wins
    assert conf["spark.pyspark.python"] == "/opt/node/bin/python3"       # the nodes' Python, not ours
    assert conf["spark.pyspark.driver.python"] == sys.executable         # client mode: the driver is here
    if installed:
        assert "--py-files" not in cmd
    else:
        zip_path = Path(cmd[cmd.index("--py-files") + 1])
        assert zip_path.parent == tmp_path / "dist" and zip_path.name.startswith("tidemark-") and zip_path.is_file()


def test_local_mode_uses_this_interpreter_and_machine_memory(tmp_path, monkeypatch):
    from tidemark import sparkconf

    cmd = _command(tmp_path, monkeypatch, {"conn_type": "spark", "host": "local[2]",
                                           "extra": {"spark.pyspark.python": "/opt/node/bin/python3"}})
    conf = _confs(cmd)
    assert cmd[:3] == ["spark-submit", "--master", "local[2]"] and "--py-files" not in cmd
    assert conf["spark.pyspark.python"] == sys.executable
    assert conf["spark.driver.memory"] == "1500m" and conf["spark.sql.shuffle.partitions"] == "3"
    # the driver's JVM and its Python workers get the allocators' settings (`sparkconf.MEMORY_ENV`) in
    # spark-submit's environment, unless the worker's own environment sets one
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    _command(tmp_path, monkeypatch, {"conn_type": "spark", "host": "local[2]"})
    env = _command.last_task.env_vars
    assert env["ARROW_DEFAULT_MEMORY_POOL"] == sparkconf.MEMORY_ENV["ARROW_DEFAULT_MEMORY_POOL"]
    assert "MALLOC_ARENA_MAX" not in env and env["MALLOC_TRIM_THRESHOLD_"] == sparkconf.MEMORY_ENV["MALLOC_TRIM_THRESHOLD_"]
    monkeypatch.setenv("TIDEMARK_SPARK_CONF", "spark.driver.memory=900m")
    assert _confs(_command(tmp_path, monkeypatch, {"conn_type": "spark", "host": "local[2]"}))[
        "spark.driver.memory"] == "900m"
    assert sparkconf.local_driver_memory().endswith("m")


@pytest.mark.parametrize("conn", [
    {"conn_type": "spark", "host": "yarn", "extra": {"deploy-mode": "cluster", "tidemark_installed": True}},
    {"conn_type": "spark", "host": "yarn", "extra": {"tidemark_installed": True}},
], ids=["yarn-cluster", "yarn-client"])
def test_no_password_on_the_command_line_where_environment_becomes_conf(tmp_path, monkeypatch, conn):
    """(Kubernetes takes the same path; its hook needs the kubernetes client, not installed here.)
    On YARN and Kubernetes the provider turns environment variables into --conf values (visible in
    ps, the Spark UI and event logs): the connections go in a 0600 file shipped with --files, the job
    reads them from there; Spark is told to redact our variables' names too."""
    import os
    import stat

    from tidemark.connections import resolve_dsn

    cmd = _command(tmp_path, monkeypatch, conn)
    assert not any("secret-pw" in c for c in cmd)
    files = cmd[cmd.index("--files") + 1].split(",")
    (path,) = [f for f in files if Path(f).name.startswith("tidemark-conns-")]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert "tidemark_conn" in _confs(cmd)["spark.redaction.regex"]
    # the job's side: no TIDEMARK_CONN_* in its environment, the file in its working directory
    monkeypatch.delenv("AIRFLOW_CONN_SRC")
    monkeypatch.setenv("TIDEMARK_CONN_FILE", Path(path).name)
    monkeypatch.chdir(Path(path).parent)
    dsn = resolve_dsn("src")
    assert "secret-pw" in dsn and "db.example" in dsn
    os.unlink(path)
