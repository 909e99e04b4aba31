"""An import of a tidemark module inside a function says why it is not at the top of its module.

The layers (`.importlinter`) count imports inside functions as much as those at the top, so a deferred
import hides no cycle from that check; what it may hide from a reader is *why* it is deferred. The rule:
each such import carries a ``# deferred: <reason>`` comment, on its own line or on the comment line(s)
right above a run of imports (one comment covers the run). Reasons in use: a heavy optional dependency
the importer must not pull in (pyspark, airflow, deltalake, boto3), a cycle (name the other module),
a command line that loads only the command it runs, a name a test replaces.

    python tests/unit/test_deferred_imports.py [FILE...]   # lists the imports without a reason
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "include" / "tidemark"
REASON = re.compile(r"#\s*deferred:\s*\S.{3,}")


def _imports_tidemark(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "tidemark"
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "tidemark" for alias in node.names)
    return False


def unexplained(path: Path) -> list[str]:
    """``path:line: source`` of each deferred tidemark import in ``path`` without a reason."""
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for func in ast.walk(ast.parse(text)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if not _imports_tidemark(node):
                continue
            if any(REASON.search(lines[i]) for i in range(node.lineno - 1, node.end_lineno)):
                continue
            # walk up over the run of imports and comments right above this one
            i = node.lineno - 2
            explained = False
            while i >= 0:
                above = lines[i].strip()
                if REASON.search(above):
                    explained = True
                    break
                if not (above.startswith("#") or above.startswith(("import ", "from "))
                        or above.startswith(")") or above.endswith((",", "("))):
                    break
                i -= 1
            if not explained:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_every_deferred_import_of_tidemark_says_why():
    offenders = [o for p in sorted(LIBRARY.rglob("*.py")) for o in unexplained(p)]
    assert not offenders, f"{len(offenders)} imports inside functions without '# deferred: <reason>':\n" + \
        "\n".join(offenders[:80])


def test_the_check_sees_an_import_without_a_reason(tmp_path):
    (tmp_path / "m.py").write_text(
        "def f():\n"
        "    # deferred: pyspark is heavy\n"
        "    from tidemark.consolidate import merge\n"
        "    import tidemark.lake\n"
        "    x = 1\n"
        "    from tidemark import config\n"
        "    from tidemark import lsn  # deferred: a test replaces lsn.parse\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert unexplained(tmp_path / "m.py") == ["m.py:6: from tidemark import config"]
    finally:
        ROOT = saved


if __name__ == "__main__":
    files = [Path(a).resolve() for a in sys.argv[1:]] or sorted(LIBRARY.rglob("*.py"))
    rows = [o for p in files for o in unexplained(p)]
    print("\n".join(rows))
    print(f"{len(rows)} without a reason", file=sys.stderr)
