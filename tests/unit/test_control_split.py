"""The control database client split by responsibility (issue 35): `tidemark.control.db.Control` is the
mixins of the modules beside it. Every name other code imports from ``tidemark.control`` or
``tidemark.control.db`` still resolves there, no method is defined by two mixins (one would silently
win by the class order), and no module or function outgrows the house limits."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import tidemark.control
from tidemark.control.db import Control

ROOT = Path(__file__).resolve().parents[2]
CONTROL = Path(tidemark.control.__file__).parent
IMPORT = re.compile(r"from (tidemark\.control(?:\.db)?) import \(?([\w\s,]+?)\)?\s*(?:#.*)?$", re.M)
MENTION = re.compile(r"\bcontrol\.db[.:](\w+(?:\.\w+)*)")  # ``control.db.<name>`` in a comment, a doc, a kill point


def _imported_names() -> set[tuple[str, str]]:
    """(module, name) of every ``from tidemark.control[.db] import ...`` outside the package, and of
    every ``control.db.<name>`` the code or the manual mentions."""
    found = set()
    for folder in ("include", "dags", "plugins", "jobs", "tests", "benchmarks", "docs"):
        for path in [*(ROOT / folder).rglob("*.py"), *(ROOT / folder).rglob("*.md")]:
            if CONTROL in path.parents or path == Path(__file__).resolve():
                continue
            text = path.read_text(encoding="utf-8")
            found.update(("tidemark.control.db", name) for name in MENTION.findall(text))
            for module, names in IMPORT.findall(text):
                for name in names.split(","):
                    name = name.split(" as ")[0].strip()
                    if name:
                        found.add((module, name))
    return found


def test_every_imported_name_still_resolves():
    names = _imported_names()
    assert ("tidemark.control.db", "LOCK_WAIT_ENV") in names      # the scan sees the imports
    def resolves(module: str, path: str) -> bool:
        owner = importlib.import_module(module)
        for part in path.split("."):
            if not hasattr(owner, part):
                return False
            owner = getattr(owner, part)
        return True

    missing = sorted(f"{m}.{n}" for m, n in names if not resolves(m, n))
    assert not missing, f"names imported elsewhere that the control package no longer has: {missing}"


def test_no_method_is_defined_by_two_mixins():
    owners: dict[str, list[str]] = {}
    for cls in Control.__mro__[1:]:
        if cls is object:
            continue
        for name, value in vars(cls).items():
            if inspect.isfunction(value) or isinstance(value, (staticmethod, property)):
                owners.setdefault(name, []).append(cls.__name__)
    twice = {n: o for n, o in owners.items() if len(o) > 1}
    assert not twice, f"methods defined by more than one part of Control: {twice}"
    # Control itself only composes its parts
    assert not vars(Control).keys() - {"__module__", "__doc__", "__qualname__"}, sorted(vars(Control))


def test_modules_and_functions_keep_to_the_house_limits():
    for path in sorted(CONTROL.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert text.count("\n") <= 600, f"{path.name}: {text.count(chr(10))} lines (at most 600)"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 100, f"{path.name}: {node.name} is {length} lines (at most 100)"
