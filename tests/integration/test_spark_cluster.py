"""A Spark standalone cluster is a tested configuration.

A master and one worker (1 core, 2 GB) start on loopback from the pinned pyspark; the worker's
environment cannot import this checkout (no PYTHONPATH, another working directory, and a node Python
that has the pinned dependencies but not the editable install of the library). The consolidate DAG's
own spark-submit command line (built by `TidemarkSparkSubmitOperator` and the provider's
`SparkSubmitHook`, with ``spark_default`` pointing at the master and the node's Python in its extras)
consolidates a stream with unchanged TOAST values, key changes, a truncate and a keyless table over
two incremental rounds, with landing and lake on S3 (a moto server) and the credentials in the
environment, never on a command line; the master's JSON shows the application's executors ran on the
worker, and the lake equals the source (`tidemark.parity.parity_report`). The command of
docs/operations/cluster.md (no other flag) consolidates a stream with landing and lake on local paths.

The tests share one cluster and one node Python (module fixtures: starting them is ~15 s each time);
each test counts only the applications it submitted. Each spark-submit on the cluster costs ~20 s
(a driver and an executor JVM), so each path runs where it proves something the other does not.

``pytest -s`` prints each spark-submit's wall time beside the same batch in ``local[2]``.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import psycopg2
import pytest
import yaml

from tidemark.capture.drain import drain_stream
from tidemark.capture.snapshot import snapshot_stream
from tidemark.capture.source import current_lsn
from tidemark.control import open_control
from tidemark.parity import parity_report

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TABLES = ["public.acc", "public.bag", "public.small"]

SETUP = """
CREATE TABLE acc (id int PRIMARY KEY, v int NOT NULL, s text, doc text);
INSERT INTO acc SELECT g, g, 'row ' || g,
       CASE WHEN g % 50 = 0 THEN (SELECT string_agg(md5(g::text || i::text), '') FROM generate_series(1, 300) i) END
  FROM generate_series(1, 1000) g;
CREATE TABLE bag (a int, b text);
ALTER TABLE bag REPLICA IDENTITY FULL;
INSERT INTO bag SELECT g % 5, 'dup' FROM generate_series(1, 200) g;
CREATE TABLE small (k text PRIMARY KEY, v int);
INSERT INTO small VALUES ('a', 1), ('b', 2);
"""

ROUNDS = [
    """
    UPDATE acc SET v = v + 1 WHERE id % 50 = 0;                     -- doc is TOASTed and unchanged
    UPDATE acc SET id = id + 100000 WHERE id % 11 = 0;              -- key changes (TOAST unchanged for id 550)
    DELETE FROM acc WHERE id % 13 = 0;
    INSERT INTO acc SELECT g, 0, 'new', NULL FROM generate_series(5001, 5200) g;
    DELETE FROM bag WHERE ctid IN (SELECT ctid FROM bag WHERE a = 1 LIMIT 10);   -- keyless deletes
    INSERT INTO bag SELECT 7, 'more' FROM generate_series(1, 20);
    UPDATE small SET v = 10 WHERE k = 'a';
    """,
    """
    BEGIN;
    UPDATE acc SET s = 'again', v = v * 2 WHERE id % 5 = 0;          -- more unchanged TOAST
    UPDATE acc SET id = id + 200000 WHERE id % 100 = 0;             -- key changes of TOASTed rows
    INSERT INTO acc VALUES (9000, 1, 'x', NULL);
    UPDATE acc SET id = 9001 WHERE id = 9000;
    COMMIT;
    UPDATE bag SET b = 'after' WHERE a = 2;
    DELETE FROM bag WHERE a = 3;
    ALTER TABLE acc RENAME COLUMN s TO label;                       -- renamed in the lake where it is
    UPDATE acc SET label = 'renamed' WHERE id % 7 = 0;
    ALTER TABLE bag RENAME COLUMN b TO note;
    INSERT INTO bag VALUES (8, 'renamed');
    TRUNCATE small;
    INSERT INTO small VALUES ('c', 3);
    UPDATE small SET k = 'd' WHERE k = 'c';
    """,
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def node_python(where: Path) -> Path:
    """A Python with the pinned dependencies (this virtualenv's site-packages, added as a plain path,
    so the editable install's finder is not loaded) but not the library: as on a real node."""
    base = Path(sys._base_executable)
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    site = next((where / "lib").glob("python3*/site-packages"))
    (site / "pinned.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = where / "bin" / "python"
    clean = {"PATH": os.environ.get("PATH", "")}
    probe = subprocess.run([str(python), "-c", "import pyarrow, pyspark, deltalake, psycopg2; import tidemark"],
                           env=clean, cwd=str(where), capture_output=True, text=True, timeout=120)
    assert "No module named 'tidemark'" in probe.stderr, probe.stderr     # the node cannot import the checkout
    return python


class Cluster:
    """A standalone master and worker on loopback, started with ``spark-class`` from the pinned pyspark."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.port, self.ui, self.worker_ui = _port(), _port(), _port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        # the nodes' environment: no PYTHONPATH, no interpreter of ours, another working directory
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("PYTHON", "PYSPARK_", "TIDEMARK_", "AIRFLOW_CONN_", "AWS_"))}
        import pyspark

        self.env.update(SPARK_HOME=str(Path(pyspark.__file__).parent), SPARK_LOCAL_IP="127.0.0.1",
                        SPARK_LOG_DIR=str(tmp / "logs"), SPARK_WORKER_DIR=str(tmp / "work"))

    def start(self) -> None:
        spark_class = str(BIN / "spark-class")
        self._run([spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                   "--port", str(self.port), "--webui-port", str(self.ui)], "master")
        self._wait(lambda: _json(f"http://127.0.0.1:{self.ui}/json/")["status"] == "ALIVE")
        self._run([spark_class, "org.apache.spark.deploy.worker.Worker", self.url, "--host", "127.0.0.1",
                   "-c", "1", "-m", "2g", "--webui-port", str(self.worker_ui), "--work-dir", str(self.tmp / "work")],
                  "worker")
        self._wait(lambda: any(w["state"] == "ALIVE" for w in self.master()["workers"]))

    def _run(self, cmd: list[str], name: str) -> None:
        log = open(self.tmp / f"{name}.log", "w")
        self.procs.append(subprocess.Popen(cmd, env=self.env, cwd=str(self.tmp), stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))

    def _wait(self, ready, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and all(p.poll() is None for p in self.procs):
            try:
                if ready():
                    return
            except (OSError, ValueError):      # not listening yet; or its UI answered with an empty page
                pass
            time.sleep(0.5)
        logs = "\n".join((self.tmp / f"{n}.log").read_text()[-2000:] for n in ("master", "worker")
                         if (self.tmp / f"{n}.log").exists())
        raise AssertionError(f"the Spark cluster did not start:\n{logs}")

    def master(self) -> dict:
        return _json(f"http://127.0.0.1:{self.ui}/json/")

    def worker(self) -> dict:
        return _json(f"http://127.0.0.1:{self.worker_ui}/json/")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One master and worker for the module's tests (`_ran_on_worker` tells each test's applications)."""
    where = tmp_path_factory.mktemp("cluster")
    c = Cluster(where)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> tuple[Path, Path]:
    """A node's working directory and its Python (`node_python`), for the module's tests."""
    where = tmp_path_factory.mktemp("node")
    return where, node_python(where / "venv")


def submit_command(stream_file: Path) -> tuple[list[str], dict[str, str]]:
    """The consolidate DAG's spark-submit: its `TidemarkSparkSubmitOperator` task prepared as it
    runs (connections, Spark settings, library), the command line the provider's hook builds, and
    the environment the hook runs it with."""
    from tidemark.config import load_config

    for folder in ("plugins", "dags"):      # as Airflow's plugins and DAGs folders
        if str(ROOT / folder) not in sys.path:
            sys.path.insert(0, str(ROOT / folder))
    from tidemark_airflow.operators import TidemarkSparkSubmitOperator
    from tidemark_streams import consolidate_dag

    task = consolidate_dag(load_config(stream_file)).get_task("consolidate")
    assert isinstance(task, TidemarkSparkSubmitOperator)
    task.prepare()
    hook = task._get_hook()
    cmd = hook._build_spark_submit_command(task.application)
    return cmd, {**os.environ, **(task.env_vars or {})}


def run_submit(stream_file: Path, cwd: Path) -> tuple[dict, float, list[str]]:
    cmd, env = submit_command(stream_file)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=str(cwd), capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t0
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stderr[-5000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1]), took, cmd


def _drain_all(cfg) -> None:
    target = current_lsn(cfg)
    with open_control(cfg) as ctl:
        for _ in range(20):
            drain_stream(cfg)
            if ctl.stream(cfg.stream).landed_upper >= target:
                return
    raise AssertionError("the drain did not reach the source's position")


def _spark_conn(monkeypatch, master: str, python: Path | None) -> None:
    extra = {"spark.executor.memory": "1g", "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2",
             "spark.default.parallelism": "2"}
    if python is not None:
        extra["spark.pyspark.python"] = str(python)
    host, _, port = master.rpartition(":") if master.startswith("spark://") else (master, "", "")
    conn = {"conn_type": "spark", "host": host, "extra": extra, **({"port": int(port)} if port else {})}
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(conn))


def _workload_rounds(cfg, source_db, stream_file: Path, tmp_path: Path, *, label: str,
                     rounds: list[str] = ROUNDS, submit=None) -> list[float]:
    """Snapshot, then ``rounds`` of changes (both by default), each drained and consolidated by
    ``submit(stream_file, cwd)`` (the DAG's spark-submit by default, `run_submit`); the lake equals the
    source after each. Returns the spark-submit wall times."""
    submit = submit or run_submit
    with psycopg2.connect(source_db) as conn, conn.cursor() as cur:
        cur.execute(SETUP)
    conn.close()
    snapshot_stream(cfg, chunk_pages=4, parallelism=1)
    times = []
    writer = psycopg2.connect(source_db)
    writer.autocommit = True
    try:
        for i, sql in enumerate(rounds):
            with writer.cursor() as cur:
                cur.execute(sql)
            _drain_all(cfg)
            result, took, cmd = submit(stream_file, tmp_path)
            times.append(took)
            print(f"\n{label} round {i + 1}: spark-submit {took:.1f} s, rows changed {result['rows_changed']}; "
                  f"{' '.join(c for c in cmd if 'extraJavaOptions' not in c)[:600]}")
            report = parity_report(cfg)
            assert all(r["equal"] for r in report.values()), report
            assert result["frontier_after"] is not None and sorted(report) == TABLES
    finally:
        writer.close()
    return times


def _write(cfg, tmp_path: Path) -> Path:
    path = tmp_path / f"{cfg.stream}.yaml"
    path.write_text(yaml.safe_dump(cfg.as_dict()))
    return path


def _app_ids(cluster: Cluster) -> set[str]:
    """The applications the master has seen so far (running or completed)."""
    master = cluster.master()
    return {a["id"] for a in master["completedapps"] + master["activeapps"]}


def _ran_on_worker(cluster: Cluster, runs: int, before: set[str]) -> list[str]:
    """The applications the master saw since ``before`` (only this test's: `runs` of them), each
    FINISHED with cores granted and its executors on the worker (the worker's JSON lists them by
    application id)."""
    master = cluster.master()
    assert not [a for a in master["activeapps"] if a["id"] not in before], master["activeapps"]
    apps = [a for a in master["completedapps"] if a["id"] not in before]
    assert len(apps) == runs, apps
    assert all(a["cores"] >= 1 and a["state"] == "FINISHED" for a in apps), apps
    worker = cluster.worker()
    ran = {e["appid"] for e in worker["finishedexecutors"] + worker["executors"]}
    assert {a["id"] for a in apps} <= ran, worker
    return [f"{a['id']} ({a['name']})" for a in apps]


def documented_submit(cluster: Cluster, python: Path, workdir: Path):
    """The command of docs/operations/cluster.md, with no other flag (the job finds the library and
    ships it by itself), from a node's working directory and without this process's Python settings or
    ``spark_default``: a ``submit`` for `_workload_rounds`."""
    def submit(stream_file: Path, _cwd: Path) -> tuple[dict, float, list[str]]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTHON", "PYSPARK_", "AIRFLOW_CONN_SPARK"))}
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        cmd = [str(BIN / "spark-submit"), "--master", cluster.url, "--conf", f"spark.pyspark.python={python}",
               str(ROOT / "jobs" / "consolidate.py"), "--stream-file", str(stream_file)]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, env=env, cwd=str(workdir), capture_output=True, text=True, timeout=600)
        took = time.perf_counter() - t0
        assert out.returncode == 0, out.stderr[-5000:]
        return json.loads(out.stdout.strip().splitlines()[-1]), took, cmd
    return submit


def test_consolidate_on_a_standalone_cluster(cluster, node, make_stream, source_db, tmp_path, monkeypatch):
    """Landing and lake on local paths (a one-machine cluster): the snapshot and the first round through
    the command of docs/operations/cluster.md. The DAG's command line for this stream is checked as
    built here; it runs, for both rounds, in the S3 variant below (its flags are the same but for the
    paths in the stream file), so this test spends its one spark-submit on the command the docs give."""
    workdir, python = node
    before = _app_ids(cluster)
    cfg = make_stream(TABLES, consolidate={"buckets": 2})
    stream_file = _write(cfg, tmp_path)
    monkeypatch.setenv("TIDEMARK_DIST_DIR", str(tmp_path / "dist"))
    _spark_conn(monkeypatch, cluster.url, python)
    cmd, _ = submit_command(stream_file)
    assert cmd[:3] == ["spark-submit", "--master", cluster.url] and "--py-files" in cmd
    assert f"spark.pyspark.python={python}" in cmd
    times = _workload_rounds(cfg, source_db, stream_file, tmp_path, label="cluster, the documented command",
                             rounds=ROUNDS[:1], submit=documented_submit(cluster, python, workdir))
    apps = _ran_on_worker(cluster, 1, before)
    print(f"\ncluster applications {apps}: executors on worker {cluster.worker()['id']}")
    TIMES["cluster"] = times


TIMES: dict[str, list[float]] = {}


@pytest.mark.nightly        # figures beside the cluster's; the local spark-submit path: test_consolidate_job
def test_same_batches_in_local_mode(make_stream, source_db, tmp_path, monkeypatch):
    """The same rounds through the same operator with ``spark_default`` at ``local[2]`` (the
    library from the checkout, this interpreter): the figures beside the cluster's."""
    cfg = make_stream(TABLES, consolidate={"buckets": 2})
    stream_file = _write(cfg, tmp_path)
    monkeypatch.setenv("TIDEMARK_DIST_DIR", str(tmp_path / "dist"))
    _spark_conn(monkeypatch, "local[2]", Path("/nonexistent/python"))    # a node's path is not used locally
    cmd, _ = submit_command(stream_file)
    assert "--py-files" not in cmd and f"spark.pyspark.python={sys.executable}" in cmd
    TIMES["local[2]"] = _workload_rounds(cfg, source_db, stream_file, tmp_path, label="local[2]")
    print("\nwall time of the DAG's spark-submit per round (snapshot + round 1, round 2):")
    for what, times in TIMES.items():   # cluster: 1 worker with 1 core and 2 GB, on this machine
        print(f"  {what:>28}: " + ", ".join(f"{t:.1f} s" for t in times))


@pytest.fixture
def s3(monkeypatch):
    """A moto S3 server on loopback; its credentials in this process's environment only."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    secret = secrets.token_hex(12)
    for k, v in {"AWS_ACCESS_KEY_ID": "tidemark-test", "AWS_SECRET_ACCESS_KEY": secret,
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    bucket = f"tm-{secrets.token_hex(4)}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    yield endpoint, bucket, secret
    server.stop()


def test_consolidate_on_a_cluster_with_landing_and_lake_on_s3(cluster, node, s3, make_stream, source_db, tmp_path,
                                                              monkeypatch):
    """The executors read the segments from and write the lake to S3; the credentials reach them
    through Spark's executor environment, not a command line (the nodes' own environment has none)."""
    endpoint, bucket, secret = s3
    _, python = node
    before = _app_ids(cluster)
    cfg = make_stream(TABLES, consolidate={"buckets": 2},
                      landing={"url": f"s3://{bucket}/land", "endpoint_url": endpoint},
                      lake={"path": f"s3://{bucket}/lake"})
    stream_file = _write(cfg, tmp_path)
    monkeypatch.setenv("TIDEMARK_DIST_DIR", str(tmp_path / "dist"))
    _spark_conn(monkeypatch, cluster.url, python)
    cmd, _ = submit_command(stream_file)
    assert not any(secret in c or "AWS_SECRET" in c for c in cmd)
    assert not any(k.startswith("AWS_") for k in cluster.env)
    times = _workload_rounds(cfg, source_db, stream_file, tmp_path, label="cluster, S3")
    apps = _ran_on_worker(cluster, len(ROUNDS), before)
    print(f"\ncluster applications on S3 {apps}")
    TIMES["cluster, landing + lake on S3"] = times


@pytest.mark.nightly        # the same classification off a cluster: unit/test_failures*, test_spark_settings
def test_cluster_failures_name_the_fix(cluster, node, make_stream, control, tmp_path, monkeypatch):
    """On the cluster, what real nodes lack becomes one line naming the step and the fix: the library
    (the connection claims the nodes have it, they do not) and the executors' Python (a wrong path)."""
    from consolidate_kit import Lander, shape, up

    workdir, python = node
    cfg = make_stream(["public.t"], consolidate={"buckets": 2})
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=0, landed_upper=0)
    t = shape("t", [("k", "int32", True), ("v", "text")], oid=5)
    Lander(cfg, control).land(0, 10, [([up(t, {"k": 1, "v": "x"}, 5, 1, 0)], [])])
    stream_file = _write(cfg, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYSPARK_", "AIRFLOW_CONN_SPARK"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    job = [str(ROOT / "jobs" / "consolidate.py"), "--stream-file", str(stream_file)]
    base = [str(BIN / "spark-submit"), "--master", cluster.url, "--conf", "spark.task.maxFailures=1",
            "--conf", f"spark.pyspark.driver.python={python}"]
    cases = [
        ({"AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": cluster.url,
                                                     "extra": {"tidemark_installed": True}})},
         ["--conf", f"spark.pyspark.python={python}"], "ship the library"),
        ({}, ["--conf", "spark.pyspark.python=/nonexistent/bin/python3"], "set spark.pyspark.python"),
    ]
    for extra_env, conf, fix in cases:
        out = subprocess.run(base + conf + job, env={**env, **extra_env}, cwd=str(workdir),
                             capture_output=True, text=True, timeout=600)
        # spark-submit's PythonRunner merges the driver's stderr into its stdout
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("tidemark: error: consolidation failed")]
        assert out.returncode == 2 and len(lines) == 1, out.stdout[-4000:]
        line = lines[0]
        assert fix in line and "while decoding the segments (Spark job)" in line and "\tat " not in line, line
        print(f"\n{line}")
    incidents = [i for i in control.incidents(cfg.stream) if i["kind"] == "consolidate_failed"]
    assert {("ship the library" in i["detail"]["remedy"], "spark.pyspark.python" in i["detail"]["remedy"])
            for i in incidents} == {(True, False), (False, True)}
