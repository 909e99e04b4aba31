"""One lake writer (`tidemark.lake.writer`): no other module of the library calls deltalake's write or
transaction API, and the writer has the shape a second lake format would implement (`LakeWriter`)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import tidemark
from tidemark.lake import writer

LIBRARY = Path(tidemark.__file__).parent
WRITER = Path(writer.__file__)

# deltalake's calls that write a table or its log: writes, transactions, table creation, ALTER,
# maintenance (OPTIMIZE, VACUUM, checkpoints, log clean-up); and its DML and RESTORE on a Delta
# table's handle (named ``dt`` or ``…dt`` throughout the library; a landing store's ``delete`` is not one)
WRITE_API = re.compile(
    r"\b(write_deltalake|create_write_transaction|create_table_with_add_actions|convert_to_deltalake"
    r"|CommitProperties|PostCommitHookProperties|AddAction|RemoveAction|deltalake\.transaction)\b"
    r"|\bDeltaTable\.create\b|\.(alter|optimize)\.\w+\(|\.(vacuum|create_checkpoint|cleanup_metadata)\("
    r"|\b\w*dt\.(restore|repair|merge|update|delete)\(")


def _calls(path: Path) -> list[str]:
    return [f"{path.relative_to(LIBRARY.parent)}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text().splitlines(), 1) if WRITE_API.search(line.split("#", 1)[0])]


def test_deltalake_is_written_by_the_lake_writer_only():
    stray = [c for p in sorted(LIBRARY.rglob("*.py")) if p != WRITER for c in _calls(p)]
    assert not stray, "deltalake's write API outside tidemark.lake.writer:\n" + "\n".join(stray)
    assert _calls(WRITER), "the pattern finds the writer's own calls (it is not blind)"


def test_the_writer_implements_its_interface():
    """Every member of `LakeWriter` is a function of the module, with the same parameters."""
    members = [n for n, v in vars(writer.LakeWriter).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"commit_files", "discard_uncommitted", "add_columns"} <= set(members)
    for name in members:
        want = list(inspect.signature(getattr(writer.LakeWriter, name)).parameters)[1:]
        have = list(inspect.signature(getattr(writer, name)).parameters)
        assert have == want, name
