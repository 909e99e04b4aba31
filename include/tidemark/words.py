"""How Tidemark says a time, a duration, a size and a ratio to a person: one wording for `tidemark
status` and the other commands (`tidemark.cli`) and the CDC status page (`plugins/tidemark_status`),
so that the two say the same figures the same way. The standard library only: the command line
imports it at its start."""

from __future__ import annotations

import datetime as _dt


def when(at: _dt.datetime | None) -> str:
    """A time in UTC to the second (``2026-11-24 10:00:00 UTC``), whatever the time zone it came in
    (the control database's session); "-" for none."""
    return "-" if at is None else at.astimezone(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def seconds(s: float | None) -> str:
    """A duration: seconds below two minutes, minutes below two hours, hours above; "unknown" for none."""
    if s is None:
        return "unknown"
    if s < 120:
        return f"{s:,.1f} s"
    if s < 7200:
        return f"{s / 60:,.1f} min"
    return f"{s / 3600:,.1f} h"


def size(n: int | None) -> str:
    """A number of bytes, exactly, and from a KiB on also in the largest binary unit it reaches
    (``2,048 B (2.0 KiB)``); "-" for none."""
    if n is None:
        return "-"
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n:,} B" if unit == "B" else f"{n:,} B ({value:,.1f} {unit})"


def ratio(x: float | None) -> str:
    """A factor (``2.41×``); "-" for none."""
    return "-" if x is None else f"{x:,.2f}×"
