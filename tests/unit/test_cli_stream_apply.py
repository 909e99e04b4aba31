"""`tidemark stream apply` without a stream file says what is missing (it printed a bare TypeError)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stream_apply_without_a_file_names_what_is_missing(tmp_path):
    run = subprocess.run([sys.executable, "-m", "tidemark.cli", "stream", "apply"], capture_output=True, text=True,
                         cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "include"),
                                            "TIDEMARK_HOME": str(tmp_path)}, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "stream apply" in run.stderr and "needs the stream file" in run.stderr, run.stderr
    assert "TypeError" not in run.stderr and "Traceback" not in run.stderr
