"""The README's main command, headless, as a user runs it: the lake equals the source at the end."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spark]

TIDEMARK = [sys.executable, "-m", "tidemark.cli"]


def _run(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW_CONN_", "TIDEMARK_"))}
    return subprocess.run([*TIDEMARK, "--home", str(home), *args], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.fixture
def home():
    base = Path(tempfile.mkdtemp(prefix="tidemark-demo-"))
    os.chmod(base, 0o755)
    yield base / "home"
    _run(base / "home", "demo", "--stop")
    shutil.rmtree(base, ignore_errors=True)


def test_headless_demo_then_operate_with_the_cli(home):
    first = _run(home, "demo", "--headless", "--transactions", "120")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "snapshot at" in first.stdout and "landed segment 0" in first.stdout
    parity_rows = [line for line in first.stdout.splitlines() if line.startswith("public.")]
    assert len(parity_rows) == 4 and all(line.split()[-1] == "ok" for line in parity_rows), first.stdout

    assert _run(home, "workload", "demo", "--transactions", "60", "--seed", "5").returncode == 0
    behind = _run(home, "parity", "demo")
    assert behind.returncode == 1 and "MISMATCH" in behind.stdout and "not in the lake yet" in behind.stdout

    drained = _run(home, "drain", "demo")
    assert drained.returncode == 0 and "segment 1 [" in drained.stdout, drained.stderr
    assert _run(home, "consolidate", "demo").returncode == 0
    equal = _run(home, "parity", "demo")
    assert equal.returncode == 0, equal.stdout + equal.stderr
    assert "MISMATCH" not in equal.stdout

    segments = _run(home, "segments", "demo")
    assert [line.split()[0] for line in segments.stdout.splitlines()[1:]] == ["0", "1"]
    status = _run(home, "status", "demo", "--json")
    assert '"committed_segment": 1' in status.stdout, status.stdout

    rows = _run(home, "read", "demo", "public.customers", "--format", "jsonl")
    assert rows.returncode == 0 and rows.stdout.count("\n") == int(
        next(line.split()[1] for line in equal.stdout.splitlines() if line.startswith("public.customers")))

    dags = _run(home, "airflow", "dags", "list", "--local", "-o", "plain")  # parses dags/ here
    assert dags.returncode == 0, dags.stderr
    for kind in ("snapshot", "drain", "consolidate", "changelog"):
        assert f"tidemark_demo_{kind}" in dags.stdout

    stopped = _run(home, "demo", "--stop")
    assert stopped.returncode == 0 and "nothing is left running" in stopped.stdout
    assert _run(home, "db", "status").returncode == 3
