"""The processes of the embedded default, read from ``/proc``: whether one runs (`alive`, by pid and
start time), the members of a process group, and stopping groups (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command's name (state, ppid, pgrp, ...; the start
    time is [19]), None if the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), None if it is gone: with the pid it names
    one process, not whichever one reuses the number later."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie (a killed component stays one until
    its parent reaps it), and it is the one that started at ``start`` when given."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X") and (start is None or int(fields[19]) == start)


def stop_groups(*pgids: int, timeout: float = 10.0) -> None:
    """SIGTERM the live members of the process groups ``pgids``, SIGKILL those left after ``timeout``."""
    for pgid in pgids:
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(map(group_members, pgids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pgid in pgids:
        if group_members(pgid):
            _signal_group(pgid, signal.SIGKILL)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        fields = _stat(entry.name) if entry.name.isdigit() else None
        if fields and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _signal_group(pid: int, sig: int) -> None:
    """Signal the process group led by ``pid`` (each component was started as a session leader)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
