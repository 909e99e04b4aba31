"""Subscribers: consumers that read the stream's committed changes from their own checkpoint (the
manual: docs/reading-the-lake.md, "Subscribers").

A subscriber is a row in ``tidemark.subscribers`` (stream, name, checkpoint); its **checkpoint** is an
upper: every change with ``time < checkpoint`` has been delivered and acknowledged. `read_changes`
returns every change of every table with ``checkpoint <= time < upper`` (``upper``: the frontier, or
less with ``max_transactions``, always at a transaction boundary: a time is one source transaction),
each table's snapshot loads as changes at its LSN too (``+1`` of the snapshot version's rows, ``-1`` of
the version it replaced; read by time travel), so a subscriber that starts at 0 and sums the diffs
holds each lake table. Reading moves nothing; only `ack` moves the checkpoint (forward only, never
past the frontier). A snapshot version vacuumed below a checkpoint makes `read_changes` fail naming
it, never return less. `retention_floor` is the lowest checkpoint: nothing at or above it may be
deleted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from tidemark.config import StreamConfig
from tidemark.consolidate.bases import base_changes, snapshot_versions
from tidemark.consolidate.preconsolidate import cancel_zero
from tidemark.control import open_control
from tidemark.errors import TidemarkError
from tidemark.lake import (LakeError, changelog_between, changelog_uri, exact_schema, open_delta, storage_options,
                           table_uri)
from tidemark.lake.delta import conform
from tidemark.lake.retention import check_position
from tidemark.lake.scd2 import log_schema
from tidemark.lsn import format_lsn

RESERVED = {"consolidate"}          # the consolidation's own checkpoint (moved by advance_frontier)
_NAME = re.compile(r"[a-z][a-z0-9_\-]{0,62}")


class SubscriberError(TidemarkError):
    """A subscriber operation cannot be done; names the stream, subscriber and reason."""


@dataclass
class Changes:
    """The changes of ``[lower, upper)``: per table, its rows + ``_time``, ``_diff``, ``_commit_ts``."""

    stream: str
    subscriber: str
    lower: int
    upper: int
    tables: dict[str, Any] = field(default_factory=dict)    # table -> pyarrow.Table

    @property
    def num_changes(self) -> int:
        return sum(t.num_rows for t in self.tables.values())

    def times(self) -> list[int]:
        return sorted({t for tab in self.tables.values() for t in tab.column("_time").to_pylist()})

    def transactions(self) -> Iterator[dict]:
        """One dict per source transaction, in time order: ``{time, commit_ts, changes: [{table,
        diff, row}]}`` (values as Python objects)."""
        by_time: dict[int, dict] = {}
        for name in sorted(self.tables):
            tab = self.tables[name]
            data = tab.drop_columns(["_time", "_diff", "_commit_ts"]).to_pylist()
            for row, t, d, ts in zip(data, tab.column("_time").to_pylist(), tab.column("_diff").to_pylist(),
                                     tab.column("_commit_ts").to_pylist()):
                tx = by_time.setdefault(t, {"time": t, "commit_ts": ts, "changes": []})
                if tx["commit_ts"] is None:
                    tx["commit_ts"] = ts
                tx["changes"].append({"table": name, "diff": d, "row": row})
        for t in sorted(by_time):
            yield by_time[t]


def _check_name(stream: str, name: str) -> None:
    if name in RESERVED:
        raise SubscriberError(f"stream {stream}: subscriber name {name!r} is reserved for the consolidation")
    if not _NAME.fullmatch(name):
        raise SubscriberError(f"stream {stream}: subscriber name {name!r} must be lower-case letters, digits, "
                              "'_' or '-', starting with a letter")


def add_subscriber(cfg: StreamConfig, name: str, *, from_frontier: bool = False) -> dict:
    """Register ``name``: at checkpoint 0 (it first reads every table's base, then every change), or at
    the current frontier (only what comes next). Registering an existing subscriber is an error."""
    _check_name(cfg.stream, name)
    with open_control(cfg) as ctl:
        state = ctl.stream(cfg.stream)
        at = (state.frontier or 0) if from_frontier else 0
        if not ctl.add_subscriber(cfg.stream, name, at):
            raise SubscriberError(f"stream {cfg.stream}: subscriber {name} already exists")
    return {"stream": cfg.stream, "name": name, "checkpoint": at}


def drop_subscriber(cfg: StreamConfig, name: str) -> None:
    """Forget a subscriber (what it has not acknowledged is no longer kept for it)."""
    _check_name(cfg.stream, name)
    with open_control(cfg) as ctl:
        if not ctl.drop_subscriber(cfg.stream, name):
            raise SubscriberError(f"stream {cfg.stream}: no subscriber {name}")


def list_subscribers(cfg: StreamConfig) -> list[dict]:
    """The stream's subscribers (not the consolidation's own) with checkpoint and lag behind the frontier."""
    with open_control(cfg) as ctl:
        return ctl.subscriber_lags(cfg.stream, ctl.stream(cfg.stream).frontier)


def retention_floor(ctl, stream: str) -> int | None:
    """The lowest checkpoint of the stream's subscribers (None: no subscribers): whatever a cleanup
    removes must lie below it, or be given up by dropping the subscriber."""
    points = [s["checkpoint"] or 0 for s in ctl.subscribers(stream) if s["name"] not in RESERVED]
    return min(points) if points else None


def read_changes(cfg: StreamConfig, name: str, *, max_transactions: int | None = None) -> Changes:
    """Every change since the subscriber's checkpoint up to the frontier (see the module doc)."""
    with open_control(cfg) as ctl:
        state = ctl.stream(cfg.stream)
        checkpoints = {s["name"]: s["checkpoint"] for s in ctl.subscribers(cfg.stream)}
    if name not in checkpoints or name in RESERVED:
        raise SubscriberError(f"stream {cfg.stream}: no subscriber {name} (tidemark subscriber add {cfg.stream} {name})")
    lower = checkpoints[name] or 0
    frontier = state.frontier
    out = Changes(cfg.stream, name, lower, lower)
    if frontier is None or frontier <= lower:
        return out

    try:       # behind the retention window: what it needs may be vacuumed (`lake.retention`)
        check_position(cfg, lower, f"subscriber {name}")
    except LakeError as exc:
        raise SubscriberError(str(exc)) from None
    for table in (t.qualified for t in cfg.source.tables):
        rows = _table_changes(cfg, table, lower, frontier)
        if rows is not None:
            out.tables[table] = rows
    out.upper = frontier
    if max_transactions is not None:
        times = out.times()
        if len(times) > max_transactions:
            out.upper = times[max_transactions - 1] + 1 if max_transactions > 0 else lower
            out.tables = {t: tab.filter(pc.less(tab.column("_time"), out.upper)) for t, tab in out.tables.items()}
    return out


def ack(cfg: StreamConfig, name: str, upper: int) -> int:
    """Acknowledge everything below ``upper`` (a `Changes.upper`); return the new checkpoint."""
    with open_control(cfg) as ctl:
        frontier = ctl.stream(cfg.stream).frontier
        if frontier is None or upper > frontier:
            raise SubscriberError(f"stream {cfg.stream} subscriber {name}: cannot acknowledge up to {format_lsn(upper)}, past "
                                  f"the frontier {format_lsn(frontier)}")
        if name in RESERVED:
            raise SubscriberError(f"stream {cfg.stream}: subscriber {name!r} is the consolidation's own")
        cp = ctl.ack_subscriber(cfg.stream, name, upper)
    if cp is None:
        raise SubscriberError(f"stream {cfg.stream}: no subscriber {name}")
    return cp


# -- one table ---------------------------------------------------------------------------------------

def _table_changes(cfg: StreamConfig, table: str, lower: int, upper: int):
    """The table's base changes and changelog rows with ``lower <= time < upper`` (None: no lake table)."""
    options = storage_options(cfg)
    uri = table_uri(cfg, table)
    dt = open_delta(uri, options)
    if dt is None:
        return None
    data = exact_schema(dt)
    target = log_schema(data)
    parts, bases = [], []
    for version, lsn in snapshot_versions(dt, cfg.stream):
        if lower <= lsn < upper:
            bases.append(lsn)
            try:
                parts.append(conform(base_changes(uri, options, version, lsn, data), target))
            except OSError as exc:
                raise SubscriberError(f"stream {cfg.stream} table {table}: the lake version of the snapshot at "
                                      f"{format_lsn(lsn)} (Delta version {version}) can no longer be read ({exc}); it was "
                                      "vacuumed below a subscriber's checkpoint") from exc
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise SubscriberError(f"stream {cfg.stream} table {table}: the re-snapshot at {format_lsn(lsn)} changed a "
                                      f"column's type and the rows it replaced have no value in the new one ({exc}); "
                                      f"take the table again from that snapshot (a checkpoint at {format_lsn(lsn)})") from exc
    if open_delta(changelog_uri(cfg, table), options) is not None:
        log = changelog_between(cfg, table, lower, upper).drop_columns(["_commit_date"])   # across restarts
        parts.append(conform(log, target))
    if not parts:
        return target.empty_table()
    out = pa.concat_tables(parts)
    if bases and out.num_rows:
        # a transaction committed at a snapshot's own LSN is in the changelog at that time, beside the
        # base's rows: one update per row and time (the base's -1/+1 and the change summed)
        at = pc.is_in(out.column("_time"), value_set=pa.array(bases, pa.int64()))
        if pc.any(at).as_py():
            out = pa.concat_tables([cancel_zero(out.filter(at)), out.filter(pc.invert(at))])
    return out.sort_by([("_time", "ascending"), ("_diff", "ascending")]) if out.num_rows else out
