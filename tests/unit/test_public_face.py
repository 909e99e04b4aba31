"""The package's public face (`tidemark/__init__.py`), in a fresh interpreter each: the lazy names
are what the docstring says, before and after their packages are imported by anything else."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_tidemark_consolidate_calls_consolidate_stream_however_often_and_after_the_package_is_imported():
    out = _run("""
        import tidemark
        first = tidemark.consolidate
        import tidemark.consolidate
        import tidemark.consolidate.job
        tidemark.consolidate.consolidate_stream = lambda cfg, **kw: ("called", cfg, kw)
        print(first is tidemark.consolidate, tidemark.consolidate("cfg"), tidemark.consolidate("c2", spark=1))
        print(tidemark.consolidate.follow_stream is tidemark.consolidate.job.follow_stream)
    """)
    assert out.splitlines() == ["True ('called', 'cfg', {}) ('called', 'c2', {'spark': 1})", "True"]


def test_the_other_public_names_are_the_functions_the_docstring_names():
    out = _run("""
        import tidemark
        from tidemark.capture.drain import drain_stream
        from tidemark.capture.snapshot import snapshot_stream
        from tidemark.config import load_config
        from tidemark.lake import read_table
        print(tidemark.snapshot is snapshot_stream, tidemark.drain is drain_stream, tidemark.read is read_table,
              tidemark.load_config is load_config, callable(tidemark.gaps.detect))
    """)
    assert out == "True True True True True"
