"""Spark settings in one module (`tidemark.sparkconf`): their order, the stream file's
``consolidate.spark_conf``, the connection's extras, the library zip, and the one-line reason of a
Spark failure (checked on text Spark really printed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidemark import sparkconf
from tidemark import failures
from tidemark.config import parse_config
from tidemark.errors import ConfigError
from tidemark.failures import is_transient

BASE = {"stream": "demo", "source": {"connection": "src", "tables": ["public.a"]},
        "landing": {"url": "/tmp/landing"}, "lake": {"path": "/tmp/lake"}}


def _cfg(spark_conf=None, **kw):
    doc = {**BASE, **kw}
    if spark_conf is not None:
        doc["consolidate"] = {"spark_conf": spark_conf}
    return parse_config(doc)


@given(st.integers(min_value=0, max_value=10**7))
def test_local_driver_memory_is_a_quarter_of_the_machine_within_bounds(mb):
    got = int(sparkconf.local_driver_memory(mb).rstrip("m"))
    assert 512 <= got <= 4096
    assert got == min(4096, max(512, mb // 4))


def test_order_defaults_extras_stream_file_environment():
    cfg = _cfg({"spark.driver.memory": "3g", "spark.sql.shuffle.partitions": 8, "spark.executor.cores": 2})
    extras = {"spark.driver.memory": "2g", "spark.executor.memory": "1g", "spark.executor.cores": "1",
              "deploy-mode": "client", "tidemark_installed": True}
    env = {"TIDEMARK_SPARK_CONF": "spark.executor.cores=4, spark.network.timeout=300s"}
    got = sparkconf.resolve_settings(cfg, master="local[2]", extras=extras, environ=env)
    assert got["spark.driver.memory"] == "3g"            # stream file over the connection over the default
    assert got["spark.executor.memory"] == "1g"          # the connection's extras
    assert got["spark.sql.shuffle.partitions"] == "8"    # numbers as Spark reads them
    assert got["spark.executor.cores"] == "4"            # the environment over everything
    assert got["spark.network.timeout"] == "300s"
    assert "deploy-mode" not in got and "tidemark_installed" not in got   # only spark.* extras
    assert got["spark.sql.session.timeZone"] == "UTC"
    bare = sparkconf.resolve_settings(None, master=None, extras={}, environ={})
    assert bare["spark.driver.memory"] == sparkconf.local_driver_memory()   # local mode: sized to the machine


def test_python_path_from_settings_only_on_a_cluster():
    extras = {"spark.pyspark.python": "/opt/node/python3"}
    assert "spark.pyspark.python" not in sparkconf.resolve_settings(None, master="local[*]", extras=extras, environ={})
    cluster = sparkconf.resolve_settings(None, master="spark://h:7077", extras=extras, environ={})
    assert cluster["spark.pyspark.python"] == "/opt/node/python3"
    assert "spark.driver.memory" not in cluster          # no machine default for another machine's driver
    conf, py_files = sparkconf.submit_settings(None, "local[2]", extras)
    assert conf["spark.pyspark.python"] == sys.executable and py_files == []
    conf, py_files = sparkconf.submit_settings(None, "spark://h:7077", extras)
    assert conf["spark.pyspark.python"] == "/opt/node/python3"
    assert conf["spark.pyspark.driver.python"] == sys.executable      # client mode: the driver is here
    assert len(py_files) == 1 and Path(py_files[0]).name.startswith("tidemark-")
    _, py_files = sparkconf.submit_settings(None, "spark://h:7077", {**extras, "tidemark_installed": "true"})
    assert py_files == []


@pytest.mark.parametrize("master", [None, "local[2]", "spark://h:7077"])
def test_allocators_of_the_python_workers_are_set_unless_the_user_set_them(master):
    """Every session gives the executors' Python workers glibc's and Arrow's settings (`MEMORY_ENV`:
    freed memory goes back to the system, so a worker does not grow slice after slice); the user's
    own ``spark.executorEnv.*`` (connection extras, stream file, environment) wins."""
    got = sparkconf.resolve_settings(None, master=master, extras={}, environ={})
    for name, value in sparkconf.MEMORY_ENV.items():
        assert got[f"spark.executorEnv.{name}"] == value
    assert got["spark.executorEnv.MALLOC_ARENA_MAX"] == "2"
    assert got["spark.executorEnv.ARROW_DEFAULT_MEMORY_POOL"] == "system"
    cfg = _cfg({"spark.executorEnv.MALLOC_ARENA_MAX": 8})
    got = sparkconf.resolve_settings(cfg, master=master, extras={"spark.executorEnv.ARROW_DEFAULT_MEMORY_POOL": "jemalloc"},
                                     environ={"TIDEMARK_SPARK_CONF": "spark.executorEnv.MALLOC_TRIM_THRESHOLD_=0"})
    assert got["spark.executorEnv.MALLOC_ARENA_MAX"] == "8"                     # the stream file's
    assert got["spark.executorEnv.ARROW_DEFAULT_MEMORY_POOL"] == "jemalloc"     # the connection's
    assert got["spark.executorEnv.MALLOC_TRIM_THRESHOLD_"] == "0"               # the environment's
    assert got["spark.executorEnv.MALLOC_MMAP_THRESHOLD_"] == sparkconf.MEMORY_ENV["MALLOC_MMAP_THRESHOLD_"]
    conf, _ = sparkconf.submit_settings(None, "local[2]", {})       # the DAGs' spark-submit passes them too
    assert conf["spark.executorEnv.ARROW_DEFAULT_MEMORY_POOL"] == "system"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tune_memory_applies_what_the_environment_does_not_set():
    """In a fresh interpreter: `tune_memory` sets glibc's options with ``mallopt`` and makes the
    system allocator pyarrow's default pool; a variable the process was started with is left alone
    (glibc and Arrow already read it)."""
    code = ("import json, os, pyarrow as pa\n"
            "from tidemark import sparkconf\n"
            "before = pa.default_memory_pool().backend_name\n"
            "done = sparkconf.tune_memory()\n"
            "print(json.dumps({'done': done, 'before': before, 'after': pa.default_memory_pool().backend_name}))\n")
    base = {k: v for k, v in os.environ.items() if k not in sparkconf.MEMORY_ENV}

    def run(**env):
        out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    plain = run()
    assert plain["done"] == sparkconf.MEMORY_ENV
    assert plain["before"] != "system" and plain["after"] == "system"
    mine = run(MALLOC_ARENA_MAX="4", ARROW_DEFAULT_MEMORY_POOL="jemalloc")
    assert "MALLOC_ARENA_MAX" not in mine["done"] and "ARROW_DEFAULT_MEMORY_POOL" not in mine["done"]
    assert mine["done"]["MALLOC_MMAP_THRESHOLD_"] == sparkconf.MEMORY_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert mine["after"] == "jemalloc"


@pytest.mark.parametrize("value, key", [
    ([1], "consolidate.spark_conf"),
    ({"driver.memory": "1g"}, "consolidate.spark_conf.driver.memory"),
    ({"spark.driver.memory": True}, "consolidate.spark_conf.spark.driver.memory"),
    ({"spark.driver.memory": {"a": 1}}, "consolidate.spark_conf.spark.driver.memory"),
    ({"spark.driver.memory": " "}, "consolidate.spark_conf.spark.driver.memory"),
])
def test_bad_spark_conf_names_the_key(value, key):
    with pytest.raises(ConfigError) as err:
        _cfg(value)
    assert err.value.key == key


def test_bad_environment_setting_names_the_variable():
    with pytest.raises(ConfigError, match="TIDEMARK_SPARK_CONF"):
        sparkconf.env_settings({"TIDEMARK_SPARK_CONF": "driver.memory=1g"})


@pytest.mark.parametrize("value", [
    json.dumps({"conn_type": "spark", "host": "spark://m", "port": 7077,
                "extra": {"spark.executor.memory": "2g", "tidemark_installed": True}}),
    json.dumps({"conn_type": "spark", "host": "spark://m", "extra": json.dumps({"spark.executor.memory": "2g",
                                                                              "tidemark_installed": True})}),
    "spark://m:7077?spark.executor.memory=2g&tidemark_installed=true",
])
def test_connection_extras_from_the_environment(monkeypatch, value):
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", value)
    extras = sparkconf.connection_extras()
    assert extras["spark.executor.memory"] == "2g" and sparkconf.library_installed(extras)
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_DEFAULT")
    assert sparkconf.connection_extras() == {}


def test_library_zip_is_cached_by_content_and_importable(tmp_path):
    first = sparkconf.library_zip(tmp_path)
    assert sparkconf.library_zip(tmp_path) == first and first.stat().st_size > 10_000
    names = zipfile.ZipFile(first).namelist()
    assert "tidemark/__init__.py" in names and "tidemark/sparkconf.py" in names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    # a Python that cannot import the checkout imports the library from the zip alone
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import tidemark.sparkconf, tidemark.consolidate.decode; "
            "print(tidemark.__file__)")
    out = subprocess.run([sys.executable, "-I", "-c", code, str(first)], cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=60, env={"PATH": os.environ.get("PATH", "")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(first))


# -- failures: text Spark 4.1 printed (captured from this project's runs) -------------------------

class Py4JJavaError(Exception):
    """Stands for py4j.protocol.Py4JJavaError: the same name and a message Spark printed."""


Py4JJavaError.__module__ = "py4j.protocol"

EXECUTOR_OOM = """An error occurred while calling o98.collectToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 3 in stage 2.0 failed 4 times, most recent failure: Lost task 3.3 in stage 2.0 (TID 17) (127.0.0.1 executor 0): java.lang.OutOfMemoryError: Java heap space
\tat java.base/java.util.Arrays.copyOf(Arrays.java:3537)
\tat java.base/java.io.ByteArrayOutputStream.ensureCapacity(ByteArrayOutputStream.java:100)
\tat org.apache.spark.sql.execution.arrow.ArrowConverters$ArrowBatchWithSchemaIterator.next(ArrowConverters.scala:128)
"""

MISSING_LIBRARY = """An exception was thrown from the Python worker. Please see the stack trace below.
Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/pyspark/python/lib/pyspark.zip/pyspark/worker.py", line 3155, in main
    func, profiler, deserializer, serializer = read_udfs(pickleSer, infile, eval_type)
  File "/work/main/.venv/lib/python3.11/site-packages/pyspark/python/lib/pyspark.zip/pyspark/serializers.py", line 193, in _read_with_length
    return self.loads(obj)
ModuleNotFoundError: No module named 'tidemark'
"""

MISSING_PYTHON = """An error occurred while calling o71.collectToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 0.0 failed 4 times, most recent failure: Lost task 0.3 in stage 0.0 (TID 3) (127.0.0.1 executor 0): java.io.IOException: Cannot run program "/home/airflow/.venv/bin/python3": error=2, No such file or directory
\tat java.base/java.lang.ProcessBuilder.start(ProcessBuilder.java:1143)
"""

LOST = """An error occurred while calling o80.collectToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 1 in stage 3.0 failed 4 times, most recent failure: Lost task 1.3 in stage 3.0 (TID 12) (10.0.0.7 executor 2): ExecutorLostFailure (executor 2 exited caused by one of the running tasks) Reason: Remote RPC client disassociated.
\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:2935)
"""


def test_executor_out_of_memory_names_the_setting():
    reason, fix = failures.classify(Py4JJavaError(EXECUTOR_OOM), master="spark://h:7077")
    assert "out of memory" in reason and "Java heap space" in reason and "\tat" not in reason
    assert "spark.executor.memory" in fix and "consolidate.spark_conf" in fix
    reason, fix = failures.classify(Py4JJavaError(EXECUTOR_OOM), master="local[2]")
    assert "spark.driver.memory" in fix


PYTHON_OOM = """An error occurred while calling o95.collectAsArrowToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 4.0 failed 1 times, most recent failure: Lost task 0.0 in stage 4.0 (TID 7) (host executor driver): org.apache.spark.api.python.PythonException: Traceback (most recent call last):
  File "/work/include/tidemark/consolidate/merge.py", line 80, in merge_tasks
numpy._core._exceptions._ArrayMemoryError: Unable to allocate 763. MiB for an array with shape (800000000,) and data type uint8
	at org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(PythonRunner.scala:652)
"""


def test_python_workers_out_of_memory_names_their_setting():
    reason, fix = failures.classify(Py4JJavaError(PYTHON_OOM), master="local[2]")
    assert reason.startswith("Spark's Python workers ran out of memory: _ArrayMemoryError: Unable to allocate")
    assert "\tat" not in reason and "spark.executor.pyspark.memory" in fix and "consolidate.spark_conf" in fix
    from tidemark.failures import is_transient

    assert not is_transient(Py4JJavaError(PYTHON_OOM))      # the same slice runs out again


PYTHON_UNMAPPED = """An error occurred while calling o95.collectAsArrowToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 4.0 failed 1 times, most recent failure: Lost task 0.0 in stage 4.0 (TID 7) (host executor driver): org.apache.spark.api.python.PythonException: Traceback (most recent call last):
  File "/work/include/tidemark/consolidate/decode.py", line 80, in decode_tasks
ImportError: /venv/lib/python3.11/site-packages/pyarrow/_fs.cpython-311-x86_64-linux-gnu.so: failed to map segment from shared object
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(PythonRunner.scala:652)
"""


def test_a_worker_at_its_memory_limit_loading_a_library_is_out_of_memory():
    """Under ``spark.executor.pyspark.memory`` (an address-space limit) a C extension imported late
    fails in dlopen's mmap: an ImportError that is the memory limit, not a missing library."""
    reason, fix = failures.classify(Py4JJavaError(PYTHON_UNMAPPED), master="local[2]")
    assert reason == ("Spark's Python workers ran out of memory: ImportError: _fs.cpython-311-x86_64-linux-gnu.so "
                      "failed to map segment from shared object")
    assert "spark.executor.pyspark.memory" in fix
    assert failures.classify(Py4JJavaError(PYTHON_UNMAPPED.replace("failed to map segment from shared object",
                                                                   "cannot open shared object file")),
                             master="local[2]") is None


def test_dead_jvm_is_not_the_socket_error():
    """What Python saw when the local JVM died of an OutOfMemoryError (captured): a Py4JJavaError
    whose message cannot be fetched, then Py4JNetworkError / ConnectionRefusedError."""
    class Py4JNetworkError(Exception):
        pass

    class GoneJavaError(Py4JJavaError):
        def __str__(self):     # py4j asks the JVM for the message
            raise ConnectionRefusedError(111, "Connection refused")

    try:
        try:
            raise GoneJavaError()
        except Py4JJavaError as first:
            raise Py4JNetworkError("Answer from Java side is empty") from first
    except Py4JNetworkError as err:
        exc = err
    reason, fix = failures.classify(exc, master="local[2]")
    assert "JVM died" in reason or "out of memory" in reason
    assert "Connection refused" not in reason and "spark.driver.memory" in fix
    assert not is_transient(exc)          # the same memory fails the same way: no retry


def test_a_call_after_the_jvm_died_is_a_dead_jvm():
    """Seen when a 6-million-record slice killed the local driver (captured): py4j's next call fails
    with this Py4JError, after a Py4JNetworkError / ConnectionResetError."""
    class Py4JError(Exception):
        pass

    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError:
            raise Py4JError("py4j.reflection does not exist in the JVM")
    except Py4JError as err:
        exc = err
    reason, fix = failures.classify(exc, master="local[2]")
    assert "JVM died" in reason or "out of memory" in reason, reason
    assert "spark.driver.memory" in fix and not is_transient(exc)


def test_plain_connection_refused_is_not_a_spark_failure():
    assert failures.classify(ConnectionRefusedError(111, "Connection refused")) is None
    assert is_transient(ConnectionRefusedError(111, "Connection refused"))


def test_library_python_and_lost_executor():
    class PythonException(Exception):
        pass

    PythonException.__module__ = "pyspark.errors.exceptions.captured"
    reason, fix = failures.classify(PythonException(MISSING_LIBRARY), master="spark://h:7077")
    assert "cannot import the tidemark library" in reason and fix.startswith("ship the library")
    reason, fix = failures.classify(Py4JJavaError(MISSING_PYTHON), master="spark://h:7077")
    assert "/home/airflow/.venv/bin/python3" in reason and "set spark.pyspark.python" in fix
    reason, fix = failures.classify(Py4JJavaError(LOST), master="spark://h:7077")
    assert reason.startswith(failures.LOST_EXECUTOR) and "spark.executor.memory" in fix
    assert is_transient(Py4JJavaError(LOST))                  # a node may come back
    assert not is_transient(PythonException(MISSING_LIBRARY))


def test_local_path_on_a_cluster_says_use_a_shared_store():
    cfg = _cfg()
    exc = FileNotFoundError(2, "No such file or directory", "/tmp/landing/demo/segments/000.avro")
    reason, fix = failures.classify(exc, cfg, master="spark://h:7077")
    assert "/tmp/landing" in reason and fix == "use a shared store (S3) for landing and lake"
    assert failures.classify(exc, cfg, master="local[2]") is None       # local mode: an ordinary error
    s3 = _cfg(landing={"url": "s3://tm-bucket/land"}, lake={"path": "s3://tm-bucket/lake"})
    assert failures.classify(exc, s3, master="spark://h:7077") is None


def test_failure_reason_is_one_line_without_frames():
    reason, fix = failures.failure_reason(Py4JJavaError(MISSING_PYTHON.replace("Cannot run program", "Cannot start")))
    assert fix is None and "\n" not in reason and "\tat" not in reason
    assert reason.startswith("Py4JJavaError: org.apache.spark.SparkException: Job aborted")


def test_unreachable_master():
    text = ("An error occurred while calling None.org.apache.spark.api.java.JavaSparkContext.\n"
            ": java.lang.IllegalStateException: Application has been killed. Reason: All masters are "
            "unresponsive! Giving up.")
    reason, fix = failures.classify(Py4JJavaError(text), master="spark://10.1.2.3:7077")
    assert reason == "the Spark master spark://10.1.2.3:7077 is unreachable (the driver could not register with it)"
    assert "spark_default" in fix and is_transient(Py4JJavaError(text))


def test_any_py4j_error_after_the_driver_jvm_exited_is_a_dead_jvm(monkeypatch):
    """Seen in CI: a driver that ran out of memory surfaced as ``Py4JError: An error occurred while
    calling z:py4j.reflection.TypeUtil.isInstanceOf``; what decides is that the JVM process exited,
    not the wording py4j chose."""
    from py4j.protocol import Py4JError

    exc = Py4JError("An error occurred while calling z:py4j.reflection.TypeUtil.isInstanceOf")
    monkeypatch.setattr(failures, "jvm_exit_code", lambda wait=2.0: None)
    assert failures.classify(exc, master="local[2]") is None          # a live JVM: not this
    monkeypatch.setattr(failures, "jvm_exit_code", lambda wait=2.0: 52)
    reason, fix = failures.classify(exc, master="local[2]")
    assert "out of memory" in reason and "spark.driver.memory" in fix
    monkeypatch.setattr(failures, "jvm_exit_code", lambda wait=2.0: 1)
    reason, _ = failures.classify(exc, master="local[2]")
    assert "JVM died" in reason
