"""Environment for running Airflow in a child process against this checkout's dags/ and plugins/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
VENV_BIN = str(Path(PYTHON).parent)


def airflow_env(home: Path, *, streams_dir: Path | None = None, sql_alchemy_conn: str | None = None,
                extra: dict[str, str] | None = None) -> dict[str, str]:
    """Return an environment for an Airflow child process with its own AIRFLOW_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
        "TIDEMARK_HOME": env.get("TIDEMARK_HOME", str(home / "tidemark")),
        "PATH": VENV_BIN + os.pathsep + env.get("PATH", ""),
        "PYSPARK_PYTHON": PYTHON,
        "PYSPARK_DRIVER_PYTHON": PYTHON,
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[*]"}),
    })
    if streams_dir is not None:
        env["TIDEMARK_STREAMS_DIR"] = str(streams_dir)
    if sql_alchemy_conn is not None:
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = sql_alchemy_conn
    env.update(extra or {})
    return env


def run_json(script: Path, env: dict[str, str], *args: str, timeout: float = 600) -> dict:
    """Run a helper script in a child Python; return the JSON object it prints on its last line."""
    proc = subprocess.run([PYTHON, str(script), *args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"{script.name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    out = json.loads(lines[-1])
    if any(r.get("state") == "failed" for r in out.get("runs", [])):
        # a failed run's tasks logged why on the child's output: keep it where the assertion shows it
        out["log"] = "\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines()
                               if "ERROR" in ln or "Error" in ln or "error" in ln)[-6000:]
    return out
