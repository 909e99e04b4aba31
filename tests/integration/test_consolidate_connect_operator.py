"""The consolidate task on a warm engine: `TidemarkSparkSubmitOperator` runs the job as a client of the
Spark Connect server its ``spark_connect`` connection names (no JVM of its own), and survives that server
being killed with ``kill -9`` in the middle of a batch: the run is spark-submitted instead and the lake
ends equal to what the landed segments say (the job is idempotent). Without a reachable server it
spark-submits from the start."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from consolidate_kit import Lander, shape, up
from refapply import apply_capture, arrow_rows
from tidemark.lake import read_table
from tidemark.landing.segments import read_segment
from tidemark.landing.store import read_uri

pytestmark = [pytest.mark.spark, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
ITEMS = shape("items", [("k", "int64", True), ("v", "text")], oid=11)


@pytest.fixture
def server(tmp_path):
    from tidemark.local import sparkconnect

    jars = sparkconnect.spark_home() / "jars"
    if not any(p.name.startswith("spark-connect_") for p in jars.glob("*.jar")):
        pytest.skip("this PySpark ships no Spark Connect server")
    proc, url = sparkconnect.start(tmp_path / "server.log", master="local[1]",
                                   conf={"spark.sql.shuffle.partitions": "2", "spark.driver.memory": "768m"})
    yield proc, url
    sparkconnect.stop(proc)


@pytest.fixture
def stream(make_stream, control, tmp_path, monkeypatch):
    """A registered stream with one landed segment of ``n`` inserts (``land(n)``); its stream file."""
    for folder in ("plugins", "dags"):
        monkeypatch.syspath_prepend(str(ROOT / folder))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"}))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "include"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    # spark-submit (PySpark's, beside this Python), as on an Airflow worker's PATH
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    cfg = make_stream(["public.items"])
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=0, landed_upper=0)
    path = tmp_path / f"{cfg.stream}.yaml"
    path.write_text(yaml.safe_dump(cfg.as_dict()))
    lander = Lander(cfg, control)
    segments = []

    def land(n: int, per_txn: int = 50) -> int:
        lower = segments[-1].upper if segments else 0
        txns, t = [], lower
        for i in range(0, n, per_txn):
            t += 10
            txns.append(([up(ITEMS, {"k": lower + i + j, "v": f"v{i + j}"}, t, 1, j)
                          for j in range(min(per_txn, n - i))], []))
        seg = lander.land(lower, t + 1, txns)
        segments.append(seg)
        return seg.upper

    def lake_is_right() -> None:
        read = [read_segment(read_uri(s.uri), s.uri.rsplit("/", 1)[-1]) for s in segments]
        expected = apply_capture({"public.items": (ITEMS, [])}, 0, read)
        assert Counter(arrow_rows(read_table(cfg, "public.items"))) == expected["public.items"]

    return cfg, path, land, lake_is_right


def _task(path, connect_port: int | None):
    from tidemark_airflow.operators import TidemarkSparkSubmitOperator

    if connect_port is not None:
        os.environ["AIRFLOW_CONN_SPARK_CONNECT_DEFAULT"] = json.dumps(
            {"conn_type": "spark_connect", "host": "127.0.0.1", "port": connect_port})
    return TidemarkSparkSubmitOperator(task_id="consolidate", stream_file=str(path), conn_id="spark_default",
                                       application=str(ROOT / "jobs" / "consolidate.py"), name="tidemark-t",
                                       application_args=["--stream-file", str(path)])


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def test_the_task_consolidates_through_the_spark_connect_server(server, stream, control, monkeypatch):
    proc, url = server
    cfg, path, land, lake_is_right = stream
    upper = land(200)
    # no Spark installation for spark-submit: had the task not used the server, it would fail
    monkeypatch.setenv("SPARK_HOME", str(path.parent / "no-spark-here"))
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_CONNECT_DEFAULT", raising=False)
    task = _task(path, _port(url))
    assert task.connect_url().startswith(f"sc://127.0.0.1:{_port(url)}")
    task.execute({})
    assert getattr(task, "_hook", None) is None and task._connect_proc.returncode == 0
    assert control.stream(cfg.stream).frontier == upper
    lake_is_right()


def test_no_reachable_server_means_spark_submit(stream, monkeypatch):
    from tidemark.local.localpg import free_port

    cfg, path, land, _ = stream
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_CONNECT_DEFAULT", raising=False)
    assert _task(path, None).connect_url() is None                   # no connection
    assert _task(path, free_port()).connect_url() is None            # nothing listens there
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_CONNECT_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"}))
    assert _task(path, None).connect_url() is None                   # not a spark_connect connection


def test_the_server_killed_mid_batch_is_survived(server, stream, control, monkeypatch):
    """kill -9 of the server's JVM while the client's batch runs: the task spark-submits the batch
    (a real JVM) and the lake is right; nothing is left for a human."""
    from tidemark.local import sparkconnect

    proc, url = server
    cfg, path, land, lake_is_right = stream
    upper = land(3000)
    task = _task(path, _port(url))
    outcome: dict = {}

    def run():
        try:
            task.execute({})
            outcome["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 120
    while getattr(task, "_connect_proc", None) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(4.0)                          # the client connected and its batch runs on the server
    killed = sparkconnect.server_pids(proc)
    assert killed, "the server's JVM was not found"
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    worker.join(600)
    assert outcome.get("ok"), outcome.get("error")
    assert getattr(task, "_hook", None) is not None, "the run was not spark-submitted after the kill"
    assert control.stream(cfg.stream).frontier == upper
    lake_is_right()
