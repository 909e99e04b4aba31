"""The retention window (``lake.retention``): how far back the lake and the landing store can be read.

A Delta version is *inside the window* when it was still the table's current version at the
window's start (now − ``lake.retention``) or was committed after it: the version current at the
start (``v0``) and every later one. `tidemark.maintain` keeps every file those versions reference
and deletes the rest, so the rule is the window, not what a vacuum happened to leave: a table's
**horizon** is the frontier recorded at ``v0`` (positions from there on are read from versions
inside the window), and everything that reads the past — `read_tables(at=…)`, `tidemark history`,
changelog rebuilds of past intervals, subscribers behind the frontier — refuses a position below
the stream's horizon with one line naming the oldest position it can read (`check_position`).
"""

from __future__ import annotations

import time

from tidemark.config import StreamConfig
from tidemark.lake.delta import LakeError, open_delta, storage_options, table_uri, tidemark_meta
from tidemark.lsn import format_lsn


def window_start_ms(cfg: StreamConfig, now_ms: int | None = None) -> int:
    """The window's start, in milliseconds since the epoch (Delta commit timestamps)."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    return now - int(cfg.lake_retention_seconds * 1000)


def window_text(cfg: StreamConfig) -> str:
    s = cfg.lake_retention_seconds
    for unit, n in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s >= n and s % n == 0:
            return f"{int(s // n)} {unit}{'s' if s // n != 1 else ''}"
    return f"{s:g} seconds"


def table_window(dt, stream: str, start_ms: int) -> tuple[int | None, int | None, list[int]]:
    """(``v0``: the version current at ``start_ms``, None when every listed version is younger; the
    table's horizon: the Tidemark frontier recorded at ``v0`` (carried forward), None when every
    listed version is inside the window (nothing limits a read yet); every listed version inside the
    window, oldest first)."""
    history = sorted(dt.history(), key=lambda h: h["version"])
    v0, at_v0, running, oldest = None, None, None, None
    for h in history:
        m = tidemark_meta(h, stream)
        if m is not None and m.get("frontier") is not None:
            running = int(m["frontier"])
            oldest = running if oldest is None else min(oldest, running)
        if int(h.get("timestamp") or 0) <= start_ms:
            v0, at_v0 = int(h["version"]), running
    inside = [int(h["version"]) for h in history if v0 is None or int(h["version"]) >= v0]
    return v0, (None if v0 is None else at_v0 if at_v0 is not None else oldest), inside


def horizons(cfg: StreamConfig, *, now_ms: int | None = None) -> dict[str, int]:
    """{table: its horizon} of the stream's lake tables that exist (`table_window`)."""
    start, opts, out = window_start_ms(cfg, now_ms), storage_options(cfg), {}
    for t in cfg.source.tables:
        dt = open_delta(table_uri(cfg, t), opts)
        if dt is None:
            continue
        _, horizon, _ = table_window(dt, cfg.stream, start)
        if horizon is not None:
            out[t.qualified] = horizon
    return out


def oldest_readable(cfg: StreamConfig, *, now_ms: int | None = None) -> int | None:
    """The oldest position every table of the stream can be read at: the highest table horizon."""
    h = horizons(cfg, now_ms=now_ms)
    return max(h.values()) if h else None


def check_position(cfg: StreamConfig, position: int, what: str, *, now_ms: int | None = None) -> None:
    """Raise `LakeError` when ``position`` lies below the retention window (one line, naming the
    oldest position that can be read)."""
    oldest = oldest_readable(cfg, now_ms=now_ms)
    if oldest is not None and position < oldest:
        raise LakeError(f"{what}: position {format_lsn(position)} is older than stream {cfg.stream}'s retention "
                        f"window (lake.retention: {window_text(cfg)}); the oldest position it can read is "
                        f"{format_lsn(oldest)}")
