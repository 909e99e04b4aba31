"""What the command line prints and where: progress on stderr, tables, JSON, values as text, the
error line, and Spark's own output sent to a log file."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tidemark.errors import TidemarkError, describe
from tidemark.words import when  # noqa: F401 - the one wording of a time (the status page's too)

DEBUG_ENV = "TIDEMARK_DEBUG"


def debug() -> bool:
    """``TIDEMARK_DEBUG`` set (not 0/false/no/off): tracebacks and Spark's own output on the terminal."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


class Progress:
    """Print progress on stderr: one rewritten line on a terminal, a line every few seconds otherwise."""

    def __init__(self, label: str, every: float = 5.0):
        self.label, self.every = label, every
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, info: dict) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last < self.every:
            return
        self.last = now
        text = " ".join(f"{k}={_fmt(v)}" for k, v in info.items())
        if self.tty:
            sys.stderr.write(f"\r{self.label}: {text}\033[K")
        else:
            sys.stderr.write(f"{self.label}: {text}\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty and self.last:
            sys.stderr.write("\n")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.1f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def json_default(o: Any) -> Any:
    if isinstance(o, (dt.datetime, dt.date, dt.time)):
        return o.isoformat()
    if isinstance(o, bytes):
        return "\\x" + o.hex()
    if hasattr(o, "__dataclass_fields__"):
        return dataclasses.asdict(o)
    if hasattr(o, "_asdict"):
        return o._asdict()
    return str(o)


def print_json(value: Any, **kw: Any) -> None:
    """``value`` as JSON on stdout, indented (``indent=None``: one line); dates, bytes, dataclasses as text."""
    print(json.dumps(value, default=json_default, **{"indent": 1, **kw}))


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))


def python_rows(table) -> list[dict]:
    """``table.to_pylist()``, except that a column holding dates or timestamps Python cannot hold
    (PostgreSQL's ``infinity`` and ``-infinity``, BC dates, years past 9999; at any depth: in lists and
    structs too) has all its dates and timestamps as text, alike: ``infinity``, ``-infinity``, else ISO
    8601 with astronomical years (``-0043-03-15`` is 44 BC). The other columns come as `to_pylist`
    gives them."""
    cols = []
    for col in table.columns:
        try:
            cols.append(col.to_pylist())
        except (ValueError, OverflowError):       # "year 5881580 is out of range", "date value out of range"
            cols.append(_temporal_text(col.combine_chunks()).to_pylist())
    return [dict(zip(table.column_names, row)) for row in zip(*cols)] if cols else table.to_pylist()


def _temporal_text(arr):
    """``arr`` with its dates and timestamps, at any depth, as text (`python_rows`)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    # deferred: pgtypes loads pyarrow; every command imports this module, only `read` needs these
    from tidemark.pgtypes.mapping import DATE_NEG_INF, DATE_POS_INF, TS_NEG_INF, TS_POS_INF
    from tidemark.pgtypes.text import iso_date

    t = arr.type
    if pa.types.is_date32(t) or pa.types.is_timestamp(t):
        day = pa.types.is_date32(t)
        ints = arr.cast(pa.int32() if day else pa.int64())
        # (Arrow writes a date past the year 9999 as out of range, a timestamp of any year)
        text = pa.array([None if v is None else iso_date(v) for v in ints.to_pylist()], pa.string()) if day \
            else arr.cast(pa.string())
        text = pc.if_else(pc.equal(ints, DATE_NEG_INF if day else TS_NEG_INF), "-infinity", text)
        return pc.if_else(pc.equal(ints, DATE_POS_INF if day else TS_POS_INF), "infinity", text)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return type(arr).from_arrays(arr.offsets, _temporal_text(arr.values), mask=arr.is_null())
    if pa.types.is_struct(t):
        return pa.StructArray.from_arrays([_temporal_text(c) for c in arr.flatten()], names=[f.name for f in t],
                                          mask=arr.is_null())
    return arr


def csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, (list, dict)):
        return json.dumps(v, default=json_default)
    return json_default(v) if isinstance(v, bytes) else v


def print_error(exc: BaseException) -> None:
    """An error as an operator reads it (`tidemark.errors.describe`): one line of what failed and
    where, the remedy on a line of its own, no traceback — unless ``TIDEMARK_DEBUG`` is set (then the
    traceback follows). An error Tidemark did not raise on purpose is its type and first meaningful
    line (a PySpark exception's own error, not its Java or Python frames)."""
    import traceback   # only for an error (with TIDEMARK_DEBUG): not loaded by every command

    out = sys.stderr
    what, remedy = describe(exc)
    print(f"tidemark: error: {what}", file=out)
    if remedy:
        print(f"tidemark: remedy: {remedy}", file=out)
    if debug():
        traceback.print_exception(exc, file=out)
    elif not isinstance(exc, TidemarkError):
        print(f"tidemark: (not an error Tidemark names: {DEBUG_ENV}=1 prints its traceback)", file=out)
    out.flush()


@contextlib.contextmanager
def spark_output_to(path: Path):
    """Send what a Spark JVM started inside writes — its log4j lines, an executor's Java stack trace,
    the tracebacks its Python workers' daemon prints when a failed job's pipes close — to ``path``
    (appended), not to the terminal: the JVM and its workers inherit the process's file descriptor 2,
    which points there while this process's own ``sys.stderr`` (progress, warnings, the error line)
    stays on the terminal. ``TIDEMARK_DEBUG=1``: everything on the terminal."""
    if debug():
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:        # no log file to write: Spark's output stays where it was
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    before = sys.stderr
    sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)       # a JVM started meanwhile keeps the log file as its stderr
        os.close(saved)
        sys.stderr.close()
        sys.stderr = before
