"""The command line as a shell user drives it."""

import os
import subprocess
import sys
from pathlib import Path


def test_output_piped_into_a_reader_that_stops_early_is_no_error(tmp_path):
    """`tidemark gaps demo | head` printed "error: BrokenPipeError ... not an error Tidemark names"."""
    (tmp_path / "env").write_text("".join(f"X{i}=y\n" for i in range(5000)))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "include")}
    proc = subprocess.Popen([sys.executable, "-m", "tidemark.cli", "--home", str(tmp_path), "db", "env"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()             # the reader is gone before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert err == "", err
    assert not os.path.exists(tmp_path / "pg")
