"""Spark's memory is set on purpose (`tidemark.sparkconf`): the stream file's ``consolidate.spark_conf``
reaches the driver's JVM in local mode, and a driver too small for a batch becomes an incident that
says Spark ran out of memory and names the setting to raise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from consolidate_kit import Lander, shape, up

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
T = shape("t", [("k", "int32", True), ("v", "text")], oid=5)


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "TIDEMARK_SPARK"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "include"), str(ROOT)]), TIDEMARK_SPARK_CDS="off",
               TIDEMARK_DIST_DIR=str(tmp_path / "dist"))
    return env


def _in_a_session(tmp_path, cfg, body: str, env: dict) -> dict:
    """Run ``body`` in a new Python process after ``spark = spark_session('t', cfg=<cfg's stream file>)``
    (``sc`` its context); return the JSON it prints last."""
    stream_file = tmp_path / "s.yaml"
    stream_file.write_text(yaml.safe_dump(cfg.as_dict()))
    code = ("import json, sys\n"
            "from tidemark.config import load_config\n"
            "from tidemark.consolidate import spark_session\n"
            "spark = spark_session('t', cfg=load_config(sys.argv[1]))\n"
            "sc = spark.sparkContext\n" + body + "spark.stop()\n")
    out = subprocess.run([sys.executable, "-c", code, str(stream_file)], env=env, cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_stream_file_settings_and_allocators_reach_the_driver_and_its_python_workers(tmp_path, make_stream):
    """One session (a new JVM costs ~10 s; both settings are read at its start, neither touches the other):

    ``consolidate.spark_conf: {spark.driver.memory: 777m}`` is the heap of the JVM that `spark_session`
    starts (it only counts before the JVM starts: passed through the builder).

    The session `spark_session` starts gives `sparkconf.MEMORY_ENV` (glibc's arenas and thresholds,
    Arrow's system pool) to this process, to the driver's JVM and to the executors' Python workers,
    whose Arrow then allocates from the system allocator; the stream file's own
    ``spark.executorEnv.MALLOC_ARENA_MAX`` wins over Tidemark's."""
    from tidemark.sparkconf import MEMORY_ENV

    cfg = make_stream(["public.t"], consolidate={"spark_conf": {"spark.driver.memory": "777m",
                                                                "spark.executorEnv.MALLOC_ARENA_MAX": "3"}})
    body = ("import pyarrow as pa\n"
            "names = ['MALLOC_ARENA_MAX', 'MALLOC_MMAP_THRESHOLD_', 'ARROW_DEFAULT_MEMORY_POOL']\n"
            "def probe(_):\n"
            "    import os, pyarrow as pa\n"
            "    return [{n: os.environ.get(n) for n in names}, pa.default_memory_pool().backend_name]\n"
            "worker, pool = sc.parallelize([0], 1).map(probe).collect()[0]\n"
            "jvm = {n: sc._jvm.java.lang.System.getenv(n) for n in names}\n"
            "heap = sc._jvm.java.lang.Runtime.getRuntime().maxMemory()\n"
            "print(json.dumps({'worker': worker, 'pool': pool, 'jvm': jvm, 'here': pa.default_memory_pool().backend_name,"
            " 'conf': sc.getConf().get('spark.driver.memory'), 'heap': heap, 'master': sc.master}))\n")
    got = _in_a_session(tmp_path, cfg, body, {k: v for k, v in _env(tmp_path).items() if k not in MEMORY_ENV})
    assert got["conf"] == "777m" and got["master"].startswith("local")
    assert 700 * 2**20 < got["heap"] < 850 * 2**20, got     # -Xmx777m (the JVM rounds to its regions)
    assert got["here"] == "system" and got["pool"] == "system"
    assert got["jvm"] == {n: MEMORY_ENV[n] for n in got["jvm"]}
    assert got["worker"] == {"MALLOC_ARENA_MAX": "3", "MALLOC_MMAP_THRESHOLD_": MEMORY_ENV["MALLOC_MMAP_THRESHOLD_"],
                             "ARROW_DEFAULT_MEMORY_POOL": "system"}


def test_tiny_memory_is_an_out_of_memory_incident(tmp_path, make_stream, control):
    """A segment of ~200 MB of text consolidated with Spark's Python workers held to 300 MB
    (``spark.executor.pyspark.memory``: the decoded parts and the merge live there; the driver's JVM
    holds none of them, so a tiny ``spark.driver.memory`` no longer runs out) fails;
    ``tidemark consolidate`` exits with one line that says Spark ran out of memory and names the
    setting, and the incident's reason says the same, without a stack trace."""
    cfg = make_stream(["public.t"], consolidate={"spark_conf": {"spark.driver.memory": "512m",
                                                                "spark.executor.pyspark.memory": "300m"}})
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=0, landed_upper=0)
    # random text (2 MB a row): the segment's codec and the decoded parts' compression keep its size
    Lander(cfg, control).land(0, 1000, [([up(T, {"k": i, "v": os.urandom(1024 * 1024).hex()}, 10 + i, 1, 0)], [])
                                        for i in range(100)])
    streams = tmp_path / "streams"
    streams.mkdir()
    (streams / f"{cfg.stream}.yaml").write_text(yaml.safe_dump(cfg.as_dict()))
    out = subprocess.run([sys.executable, "-m", "tidemark.cli", "--streams", str(streams), "consolidate", cfg.stream],
                         env=_env(tmp_path), cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    what, remedy = out.stderr.strip().splitlines()[-2:]       # (the remedy on its own line)
    # a MemoryError, or a library the worker loads late failing to map at the limit (ImportError)
    assert "out of memory" in what and ("MemoryError" in what or "failed to map segment" in what), what
    assert "spark.executor.pyspark.memory" in remedy and "consolidate.spark_conf" in remedy, remedy
    incidents = [i for i in control.incidents(cfg.stream) if i["kind"] == "consolidate_failed"]
    assert len(incidents) == 1
    reason = incidents[0]["detail"]["reason"]
    assert "out of memory" in reason and "\tat " not in reason and len(reason) < 400, reason
    assert "spark.executor.pyspark.memory" in incidents[0]["detail"]["remedy"]
