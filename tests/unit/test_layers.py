"""The library's layers (`.importlinter` at the top of the checkout) hold: `lint-imports` keeps every
contract, and would break one that the code does not keep (the check is not vacuous)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    return subprocess.run([str(LINT), "--config", str(config), "--no-cache"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_library_keeps_its_layers():
    run = _lint(ROOT / ".importlinter")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "BROKEN" not in run.stdout and run.stdout.count("KEPT") >= 2


def test_an_upward_import_breaks_the_layers(tmp_path):
    """The same contract with two layers swapped (the exceptions above the command line) is broken:
    every module imports `tidemark.errors`."""
    text = (ROOT / ".importlinter").read_text()
    swapped = text.replace("    cli\n", "    errors_placeholder\n", 1).replace("    errors\n", "    cli\n", 1) \
        .replace("errors_placeholder", "errors")
    assert swapped != text
    config = tmp_path / "swapped.ini"
    config.write_text(swapped)
    run = _lint(config)
    assert run.returncode != 0 and "BROKEN" in run.stdout
    assert "tidemark.cli is not allowed to import" in run.stdout or "is not allowed to import tidemark.cli" in run.stdout
