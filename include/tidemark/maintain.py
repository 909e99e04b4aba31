"""Maintenance of a stream (`maintain`, ``tidemark maintain STREAM``, the ``tidemark_<stream>_maintain``
DAG): keeps the lake and the landing store bounded however long the stream runs (the manual:
docs/operations/runbook.md, "Maintenance").

For every lake, changelog and history table: compaction of small files (`compact_table` keeps the
bucket layout and sort order the merge relies on; `compact_changelog`), one Delta commit through
`lake.writer` with ``dataChange=false`` and the frontier unchanged, so it changes no row (a history
table compacts its own ``closed-*`` files as it is kept); then checkpoint, vacuum and log clean-up
(`maintain_table`: the vacuum also keeps the version at the control database's frontier). Then the
landing files wholly below `landing_floor` are deleted (`landing_retention`): nothing above the
frontier nor above a subscriber's checkpoint.

It runs under the stream's lease with purpose ``maintain``, which excludes every job that writes the
lake or reads old segments (`control.db.COMPATIBLE_PURPOSES`). Killed at any point it leaves a readable
lake: a compaction's files are invisible until its commit (a later vacuum deletes them when it never
happens), a vacuum deletes only unreferenced files, a segment's file is deleted only after its row is
archived, and a changelog feed file only after it is listed in ``tidemark.deleted_feed_files``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tidemark.config import StreamConfig
from tidemark.consolidate.feed_files import feed_prefix
from tidemark.consolidate.log_evolution import write_log_part
from tidemark.control import open_control
from tidemark.lake import (changelog_uri, committed_frontier, filesystem, history_uri, layout, open_delta,
                           storage_options, strip_scheme, table_uri, writer as _commit)
from tidemark.lake.delta import exact_schema, missing_values, table_info, tidemark_commits, version_at
from tidemark.lake.retention import horizons
from tidemark.lake.storage import stream_storage
from tidemark.landing.store import file_uri_path, landing_store, segment_key, stream_keys
from tidemark.pgtypes import TableSchema
from tidemark.subscribers import retention_floor

SMALL_FRACTION = 2          # a file with fewer than target_rows / SMALL_FRACTION rows is small
KEEP_MARGIN_MS = 600_000    # versions this close to the vacuum's time cut are kept by name too
LOG_MARGIN_SECONDS = 3600   # the Delta log keeps its entries this much longer than lake.retention (at most)


def log_retention_seconds(cfg) -> float:
    """How long each table's Delta log keeps its entries (``delta.logRetentionDuration``): the retention
    window and a margin (the window again, an hour at most), not Delta's default of 30 days; the log
    clean-up keeps what a version inside the window needs to load (from the newest checkpoint before
    the cut)."""
    return cfg.lake_retention_seconds + min(cfg.lake_retention_seconds, LOG_MARGIN_SECONDS)


@dataclass
class TableReport:
    table: str
    kind: str                      # table | changelog | history
    files_before: int = 0
    files_after: int = 0
    compacted: int = 0             # files rewritten by the compaction
    vacuumed: int = 0              # files deleted by the vacuum
    version: int | None = None


@dataclass
class MaintainReport:
    stream: str
    retention_seconds: float
    tables: list[TableReport] = field(default_factory=list)
    floor: int | None = None                           # the landing floor
    deleted_segments: list[int] = field(default_factory=list)
    deleted_segment_bytes: int = 0
    deleted_feed_files: list[str] = field(default_factory=list)
    deleted_feed_bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"stream": self.stream, "retention_seconds": self.retention_seconds,
                "tables": [vars(t) for t in self.tables], "landing_floor": self.floor,
                "deleted_segments": len(self.deleted_segments), "deleted_segment_bytes": self.deleted_segment_bytes,
                "deleted_feed_files": len(self.deleted_feed_files), "deleted_feed_bytes": self.deleted_feed_bytes,
                "seconds": round(self.seconds, 3)}


def maintain(cfg: StreamConfig, *, now_ms: int | None = None, target_rows: int | None = None) -> MaintainReport:
    """Compact, checkpoint and vacuum every lake, changelog and history table of the stream, then
    delete the landing files below the floor (see the module doc); under the ``maintain`` lease."""
    t0 = time.monotonic()
    report = MaintainReport(cfg.stream, cfg.lake_retention_seconds)
    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, "maintain") as lease:
        started = ctl.now()
        stream_frontier = ctl.stream(cfg.stream).frontier
        for table in [t.qualified for t in cfg.source.tables]:
            for kind in ("table", "changelog", "history"):
                r = maintain_table(cfg, table, kind, lease=lease, now_ms=now_ms, target_rows=target_rows,
                                   stream_frontier=stream_frontier)
                if r is not None:
                    report.tables.append(r)
        landing_retention(cfg, ctl, report, lease=lease, now_ms=now_ms)
        report.seconds = time.monotonic() - t0
        # what it did, for the status page's "last maintenance run", and the storage it leaves
        ctl.record_maintenance_run(cfg.stream, started, report.as_dict())
        try:        # a failure is logged: the run's work stands
            ctl.record_storage(cfg.stream, stream_storage(cfg, now_ms=now_ms))
        except Exception as exc:  # noqa: BLE001 - the figures are a report, not part of the maintenance
            logging.getLogger(__name__).warning("stream %s: storage not measured after maintenance: %s",
                                                cfg.stream, exc)
    return report


def maintain_table(cfg: StreamConfig, table: str, kind: str, *, lease, now_ms: int | None,
                   target_rows: int | None, stream_frontier: int | None) -> TableReport | None:
    """Compact (lake and changelog tables), checkpoint and vacuum one Delta table; None if it does not
    exist. ``stream_frontier``: the control database's frontier, whose version is kept whatever its age
    (a consolidation that failed part-way leaves a table committed past it; readers at the stream's
    frontier read the version before)."""
    # deferred: tests replace retention.window_start_ms (test_maintain): looked up at each call
    from tidemark.lake.retention import table_window, window_start_ms

    uri = {"table": table_uri, "changelog": changelog_uri, "history": history_uri}[kind](cfg, table)
    opts = storage_options(cfg)
    dt = open_delta(uri, opts)
    if dt is None:
        return None
    report = TableReport(table, kind, files_before=len(dt.file_uris()))
    frontier = committed_frontier(dt, cfg.stream)
    if kind != "history" and frontier is not None:
        actions = (compact_table(dt, uri, opts, target_rows) if kind == "table"
                   else compact_changelog(dt, uri, opts, target_rows))
        if actions:
            lease.confirm(f"the compaction of {kind} {table}")
            partition = "_bucket" if kind == "table" else "_commit_date"
            with _commit.discard_on_failure(uri, opts, actions, stream=cfg.stream, frontier=frontier + 1):
                # the table's Delta schema without its partition column (what `writer.commit_files` extends)
                schema = pa.schema([f for f in pa.schema(dt.schema().to_arrow()) if f.name != partition])
                _commit.commit_files(uri, opts, dt, schema, actions, stream=cfg.stream, frontier=frontier,
                                     partition=partition, operation="compact", data_change=False)
            report.compacted = sum(1 for a in actions if a["op"] == "remove")
            dt = open_delta(uri, opts)
        elif _frontier_entry_expires(dt, cfg):
            # the log clean-up below deletes the entries older than the log retention: were the table's
            # newest Tidemark commit among them (a table no batch changed for that long), no version the
            # log lists would say which frontier the table holds, and reads at the stream's frontier, as
            # of a position or time, a key's history and the retention window, which go by those, would
            # find none. A version that changes nothing records the frontier again.
            lease.confirm(f"recording the frontier of {kind} {table} again")
            partition = "_bucket" if kind == "table" else "_commit_date"
            schema = pa.schema([f for f in pa.schema(dt.schema().to_arrow()) if f.name != partition])
            _commit.commit_files(uri, opts, dt, schema, [], stream=cfg.stream, frontier=frontier,
                                 partition=partition, operation="compact", data_change=False)
            dt = open_delta(uri, opts)
    # the vacuum: files removed before the window's start, unless a version inside it lists them
    now = int(time.time() * 1000) if now_ms is None else now_ms
    start = window_start_ms(cfg, now)
    hours = int(cfg.lake_retention_seconds // 3600)
    _, _, inside = table_window(dt, cfg.stream, start)
    by_time = {int(h["version"]): int(h.get("timestamp") or 0) for h in dt.history()}
    # The vacuum's time rule keeps a file removed less than ``hours`` before the clock's now (the real
    # one, whatever ``now_ms`` says). A file of version v is removed by a later version, at or after v's
    # commit (a remove's timestamp is taken just before its commit: the margin), so only versions
    # committed before that cut can lose a file to it: those inside the window are kept by name.
    cut = int(time.time() * 1000) - hours * 3600 * 1000 + KEEP_MARGIN_MS
    keep = [v for v in inside if by_time.get(v, 0) <= cut] or inside[:1]
    if stream_frontier is not None and kind == "table":
        at = version_at(dt, cfg.stream, stream_frontier)
        if at is not None and at != dt.version():
            keep.append(at)
    _commit.set_log_retention(dt, log_retention_seconds(cfg))
    lease.confirm(f"the vacuum of {kind} {table}")
    report.vacuumed = len(_commit.checkpoint_and_vacuum(dt, retention_hours=hours, keep_versions=keep))
    dt = open_delta(uri, opts)
    report.files_after, report.version = len(dt.file_uris()), dt.version()
    return report


def _frontier_entry_expires(dt, cfg: StreamConfig) -> bool:
    """Whether the log entry of the table's newest commit that records ``cfg.stream``'s frontier is
    older than the table's log retention (`log_retention_seconds`, less a margin), or gone already:
    the log clean-up (real time, as its files' ages) may delete it."""
    ours = tidemark_commits(dt, cfg.stream)
    if not ours:
        return True
    stamp = next((int(h.get("timestamp") or 0) for h in dt.history() if int(h["version"]) == ours[-1][0]), 0)
    return stamp < int(time.time() * 1000) - int(log_retention_seconds(cfg) * 1000) + KEEP_MARGIN_MS


def compact_table(dt, uri: str, options, target_rows: int | None = None) -> list[dict]:
    """Write each bucket's small files (fewer than half ``target_rows`` rows) again, sorted and
    ``target_rows`` rows a file, never spanning the key range of a file that stays (`layout.SortedWriter`),
    where that leaves the bucket fewer files; return the file actions (removes and adds), nothing committed."""
    info = table_info(dt)
    shape = info.get("table_schema")
    schema = exact_schema(dt)
    keys = layout.effective_keys(TableSchema.from_json(shape)) if shape else []
    sort = layout.sort_columns(schema, keys)
    plan = layout.BucketPlan(uri=uri, options=options, schema=schema, keys=keys, sort=sort,
                             target_rows=target_rows or layout.TARGET_ROWS,
                             tag=f"compact-{uuid.uuid4().hex[:12]}", fill=missing_values(info))
    actions: list[dict] = []
    for bucket, files in sorted(layout.file_index(dt, sort).items()):
        small = [f for f in files if (f["rows"] or 0) < plan.target_rows // SMALL_FRACTION]
        if len(small) < 2:
            continue
        stay = [f for f in files if f not in small]
        writer = layout.SortedWriter(plan, bucket, stay)
        writer.add(layout.read_files(plan, [f["path"] for f in small]))
        added = writer.close()
        if len(added) >= len(small):       # runs between the files that stay: no fewer files, leave them
            fs, base = filesystem(uri, options), strip_scheme(uri).rstrip("/")
            for a in added:
                with contextlib.suppress(OSError):
                    fs.delete_file(base + "/" + a["path"])
            continue
        actions += layout.removes(small, bucket) + added
    return actions


def compact_changelog(dt, uri: str, options, target_rows: int | None = None) -> list[dict]:
    """Write the small files of each ``_commit_date`` partition (grouped by their Parquet schema, so
    that no file reads a column otherwise than before) as files of ``target_rows`` rows, rows in time
    order; return the file actions, nothing committed."""
    target = target_rows or layout.TARGET_ROWS
    fs, base = filesystem(uri, options), strip_scheme(uri).rstrip("/")
    groups: dict[tuple, list[dict]] = {}
    for a in pa.table(dt.get_add_actions(flatten=True)).to_pylist():
        if (a["num_records"] or 0) >= target // SMALL_FRACTION:
            continue
        day = a["partition._commit_date"]
        day = day.isoformat() if isinstance(day, _dt.date) else str(day)
        with fs.open_input_file(base + "/" + unquote(a["path"])) as fh:
            schema = pq.ParquetFile(fh).schema_arrow
        groups.setdefault((day, schema.to_string()), []).append({**a, "_schema": schema})
    tag = f"compact-{uuid.uuid4().hex[:12]}"
    actions: list[dict] = []
    for n, ((day, _), files) in enumerate(sorted(groups.items(), key=lambda kv: kv[0])):
        if len(files) < 2:
            continue
        parts = []
        for f in files:
            with fs.open_input_file(base + "/" + unquote(f["path"])) as fh:
                parts.append(pq.ParquetFile(fh, pre_buffer=True).read())
        rows = pa.concat_tables(parts)
        rows = rows.take(pa.array(np.argsort(rows.column("_time").to_numpy(), kind="stable")))
        for i in range(0, rows.num_rows, target):
            chunk = rows.slice(i, target)
            rel = f"_commit_date={day}/part-{tag}-{n:05d}-{i // target:04d}.parquet"
            actions.append(write_log_part(chunk, base, rel, fs, day))
        actions += [{"target": "changelog", "op": "remove", "path": f["path"], "size": f["size_bytes"],
                     "rows": f["num_records"], "stats": None, "partition": day} for f in files]
    return actions


# -- the landing store -------------------------------------------------------------------------------

def landing_floor(cfg: StreamConfig, ctl, *, now_ms: int | None = None) -> int | None:
    """The position below which no landing file is needed: the least of the frontier, every
    subscriber's checkpoint and the lowest table horizon (a changelog rebuild inside the window
    replays segments from the lake version it starts at). None: nothing consolidated yet."""
    frontier = ctl.stream(cfg.stream).frontier
    if frontier is None:
        return None
    h = horizons(cfg, now_ms=now_ms)
    if len(h) < len(cfg.source.tables):
        return None          # a table without a lake copy yet: its snapshot load may still need its segments
    points = [frontier, retention_floor(ctl, cfg.stream), min(h.values())]
    return min(p for p in points if p is not None)


def landing_retention(cfg: StreamConfig, ctl, report: MaintainReport, *, lease, now_ms: int | None) -> None:
    """Delete the segment files and changelog feed files wholly below `landing_floor`, recording it."""
    floor = landing_floor(cfg, ctl, now_ms=now_ms)
    report.floor = floor
    if floor is None:
        return
    ctl.archive_segments(cfg.stream, floor=floor)
    store = landing_store(cfg)
    gone: list[int] = []
    for seg in ctl.deletable_segments(cfg.stream, floor):
        key = segment_key(cfg.stream, seg.seq, seg.lower, seg.upper)
        if store.uri(key) != seg.uri:
            continue           # a file of another name (an external producer's): left alone
        lease.confirm(f"deleting segment {seg.seq}'s file")
        store.delete(key)
        gone.append(seg.seq)
        report.deleted_segment_bytes += seg.byte_size or 0
    if gone:
        ctl.mark_segment_files_deleted(cfg.stream, gone)
    report.deleted_segments = gone
    feed: list[tuple[str, int, int | None]] = []
    root = stream_keys(cfg.stream)["changelog"]
    for t in cfg.source.tables:
        prefix = feed_prefix(cfg.stream, t.qualified)
        for key in list(store.list(prefix)):
            name = key.rsplit("/", 1)[-1]
            if not key.startswith(root) or "/" in key[len(prefix):] or not name.endswith(".avro"):
                continue
            try:
                upper = int(name[:-len(".avro")].split("_", 1)[1], 16)
            except (IndexError, ValueError):
                continue
            if upper <= floor:
                feed.append((key, upper, _size(store, key)))
    # recorded first, then deleted: a feed file has no manifest row, so a kill between the two must
    # leave the record (a re-run deletes what is left), not a file gone without one
    if feed:
        ctl.record_feed_files_deleted(cfg.stream, feed)
    for key, _, size in feed:
        lease.confirm(f"deleting changelog feed file {key}")
        store.delete(key)
        report.deleted_feed_bytes += size or 0
    report.deleted_feed_files = [k for k, _, _ in feed]


def _size(store, key: str) -> int | None:
    uri = store.uri(key)
    if uri.startswith("file://"):
        with contextlib.suppress(OSError):
            return Path(file_uri_path(uri)).stat().st_size
    return None
