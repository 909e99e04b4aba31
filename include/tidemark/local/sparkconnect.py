"""A long-lived local Spark Connect server: a warm Spark (driver, executors, Python workers) for every
consolidation run on this machine, which connects to it as a thin client
(``TIDEMARK_SPARK_REMOTE=sc://127.0.0.1:PORT``, `tidemark.sparkconf.spark_session`) instead of starting
a JVM. The server listens on the loopback address only; its Python workers import Tidemark from the
same checkout as the client (``PYTHONPATH``), with the same interpreter (``PYSPARK_PYTHON``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tidemark.cds import jvm_options
from tidemark.errors import TidemarkError
from tidemark.local.localpg import free_port
from tidemark.local.processes import group_members
from tidemark.sparkconf import ALWAYS

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


class SparkConnectError(TidemarkError):
    """The Spark Connect server could not be started or reached."""


def spark_home() -> Path:
    import pyspark

    return Path(os.environ.get("SPARK_HOME") or Path(pyspark.__file__).parent)


def server_conf(port: int) -> dict[str, str]:
    """Settings of the local server: loopback only, UTC, Arrow, small-data friendly shuffles; the
    JVM's class-data-sharing archive when ``tidemark spark-cds`` built it."""
    return {"spark.driver.defaultJavaOptions": jvm_options(), **ALWAYS,
            "spark.connect.grpc.binding.address": "127.0.0.1", "spark.connect.grpc.binding.port": str(port),
            "spark.ui.enabled": "false", "spark.python.worker.reuse": "true",
            # a stream's runs share one session (`sparkconf.stream_session_url`): kept however long the
            # stream is idle (a closed session's id cannot be used again)
            "spark.connect.session.manager.defaultSessionTimeout": "-1"}


def server_command(port: int, master: str = "local[2]", conf: dict[str, str] | None = None) -> list[str]:
    cmd = [str(spark_home() / "bin" / "spark-submit"), "--class", SERVER_CLASS, "--name", "tidemark-spark-connect",
           "--master", master]
    for key, value in {**server_conf(port), **(conf or {})}.items():
        cmd += ["--conf", f"{key}={value}"]
    return cmd


def server_env(base: dict[str, str] | None = None, *, library: bool = True) -> dict[str, str]:
    """The server's environment: this interpreter for Python workers, this checkout's Tidemark first
    (``library=False``: no PYTHONPATH, as on a cluster's node without the library)."""
    env = dict(os.environ if base is None else base)
    include = str(Path(__file__).resolve().parents[2])      # include/tidemark/local/x.py -> include
    env["PYSPARK_PYTHON"] = env.get("PYSPARK_PYTHON") or sys.executable
    if library:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (include, env.get("PYTHONPATH")) if p)
    else:
        env.pop("PYTHONPATH", None)
    env["SPARK_NO_DAEMONIZE"] = "1"
    return env


def url(port: int) -> str:
    return f"sc://127.0.0.1:{port}"


def start(log_path: Path, *, port: int | None = None, master: str = "local[2]",
          conf: dict[str, str] | None = None, timeout: float = 180.0,
          library: bool = True) -> tuple[subprocess.Popen, str]:
    """Start a server in its own process group, its output in ``log_path``; return (process, URL)
    once it accepts connections (``library``: `server_env`). The caller stops it with `stop`."""
    port = port or free_port()
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(server_command(port, master, conf), stdout=log, stderr=subprocess.STDOUT,
                                env=server_env(library=library), start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SparkConnectError(f"the Spark Connect server exited with {proc.returncode}; see {log_path}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return proc, url(port)
        except OSError:
            time.sleep(0.5)
    stop(proc)
    raise SparkConnectError(f"the Spark Connect server did not listen on port {port} within {timeout:.0f} s; "
                            f"see {log_path}")


def server_pids(proc: subprocess.Popen) -> list[int]:
    """The live processes of a server started by `start` (its process group: the JVM, its Python workers)."""
    return group_members(proc.pid)


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop a server started by `start` (its whole process group: spark-submit and its JVM)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout)
    except ProcessLookupError:
        pass
