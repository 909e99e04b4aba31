"""The consolidated changelog per data interval (the Airflow changelog DAG and its backfills).

`write_changelog(cfg, start=, end=)` rebuilds the rows of the Delta changelog tables whose
``_commit_ts`` is in ``[start, end)`` from the retained segments, exactly as the consolidation
wrote them (`tidemark.consolidate.changelog`), and replaces them in one Delta commit per table.
The state before the interval is the newest lake version at or below its first segment
(docs/internals/batch.md).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tidemark.consolidate import batch as _batch, plan as _plan
from tidemark.consolidate.decoded import decode, lake_buckets
from tidemark.consolidate.preconsolidate import plain
from tidemark.consolidate.prepare import Prepared
from tidemark.control import open_control
from tidemark.errors import ChangelogError
from tidemark.lake import (LakeError, changelog_uri, open_delta, read_changelog, storage_options, table_info,
                           table_uri, writer)
from tidemark.lake.delta import conform, renames_since
from tidemark.lake.layout import effective_keys
from tidemark.lake.retention import check_position
from tidemark.landing.segments import read_segment_at
from tidemark.lsn import format_lsn
from tidemark.pgtypes import TableSchema, arrow_schema
from tidemark.sparkconf import propagate_s3_env, spark_session

__all__ = ["write_changelog", "ChangelogError"]


_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)


def _utc(t: Any) -> _dt.datetime:
    """A plain `datetime.datetime` in UTC for any datetime-like value: a `datetime` (naive = UTC), a
    subclass such as pendulum's ``DateTime`` (rebuilt field by field, so arithmetic on it is the
    standard library's), a pandas ``Timestamp``, or ISO 8601 text; else `ChangelogError`."""
    if isinstance(t, str):
        try:
            t = _dt.datetime.fromisoformat(t.replace("Z", "+00:00"))
        except ValueError:
            raise ChangelogError(f"{t!r} is not an ISO 8601 date-time") from None
    if not isinstance(t, _dt.datetime):
        to_py = getattr(t, "to_pydatetime", None)
        if to_py is None:
            raise ChangelogError(f"{t!r} ({type(t).__name__}) is not a date-time")
        t = to_py()
    offset = t.utcoffset()
    naive = _dt.datetime(t.year, t.month, t.day, t.hour, t.minute, t.second, t.microsecond)
    if offset is not None:
        naive -= offset
    return naive.replace(tzinfo=_dt.timezone.utc)


def _us(t: Any) -> int:
    """Microseconds since the Unix epoch (UTC) of any datetime-like value, in integer arithmetic."""
    d = _utc(t) - _EPOCH
    return (d.days * 86_400 + d.seconds) * 1_000_000 + d.microseconds


def write_changelog(cfg, *, start: _dt.datetime, end: _dt.datetime, spark=None) -> dict:
    """Rebuild the changelog rows of commits in ``[start, end)`` (commit time, UTC; naive = UTC)
    below the stream's frontier from the retained segments, and replace that interval's rows of
    each table's Delta changelog in one commit (none when they are already equal). Raises
    `ChangelogError` naming the interval when a segment that may hold its commits is no longer
    retained or the segments from the lake version before the interval do not tile up to it.
    Returns ``{"tables": {table: rows}, "replaced": [tables], "frontier", "start", "end"}``; with
    ``frontier`` None and a ``reason`` when the stream has nothing consolidated yet."""
    start, end = _utc(start), _utc(end)
    if end <= start:
        raise ChangelogError(f"stream {cfg.stream}: empty interval [{start.isoformat()}, {end.isoformat()})")
    out: dict[str, Any] = {"tables": {}, "replaced": [], "frontier": None, "start": start.isoformat(),
                           "end": end.isoformat()}
    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, "changelog"):
        if cfg.stream not in {s.name for s in ctl.streams()}:
            out["reason"] = "the stream is not registered yet (no snapshot): nothing is consolidated"
            return out
        frontier = ctl.stream(cfg.stream).frontier
        out["frontier"] = frontier
        if frontier is None:
            out["reason"] = "nothing is consolidated yet (no frontier)"
            return out
        _Interval(cfg, ctl, start, end, frontier, spark).run(out)
    return out


class _Interval:
    """One rebuild: which segments, which lake versions, then per table compute and replace."""

    def __init__(self, cfg, ctl, start, end, frontier: int, spark):
        self.cfg, self.ctl, self.start, self.end, self.frontier = cfg, ctl, start, end, frontier
        self.spark = spark
        self.s_us, self.e_us = _us(start), _us(end)
        self.name = f"stream {cfg.stream} interval [{start.isoformat()}, {end.isoformat()})"

    def run(self, out: dict) -> None:
        opts = storage_options(self.cfg)
        tables = [t.qualified for t in self.cfg.source.tables
                  if open_delta(changelog_uri(self.cfg, t.qualified), opts) is not None]
        relevant = self.relevant_segments()
        if not relevant:
            for table in tables:
                out["tables"][table] = 0
                if self.replace(table, None):
                    out["replaced"].append(table)
            return
        low = min(s.lower for s in relevant)
        upper = min(max(s.upper for s in relevant), self.frontier)
        try:    # below the retention window the version before it may be vacuumed, its segments deleted
            check_position(self.cfg, low, self.name)
        except LakeError as exc:
            raise ChangelogError(str(exc)) from None
        bases = {t: self.base_version(t, low) for t in tables}
        f0 = min((f for _, f in bases.values()), default=low)
        landed = self.ctl.segments(self.cfg.stream, status="landed", lower_from=f0, upper_to=upper)
        cov = _plan.coverage(landed, f0)
        if cov.end < upper:
            hole = cov.hole or (cov.end, upper)
            raise ChangelogError(f"{self.name}: the retained segments do not cover LSN [{format_lsn(hole[0])}, "
                                 f"{format_lsn(hole[1])}) between the lake version at {format_lsn(f0)} and the "
                                 f"interval's last commit (below {format_lsn(upper)}); "
                                 "those changes are no longer retained")
        cov = _plan.Coverage(start=f0, end=upper, segments=[s for s in cov.segments if s.lower < upper])
        spark = self.spark or spark_session()
        propagate_s3_env(spark)
        # the consolidation's own stages: its plan (this range), decoded once for every table
        dec = decode(self.cfg, spark, _plan.BatchPlan(self.frontier, f0, cov), 0)
        try:
            for table in tables:
                version, base = bases[table]
                rows = self.table_rows(dec, table, version, base, upper)
                out["tables"][table] = rows.num_rows
                if self.replace(table, rows):
                    out["replaced"].append(table)
        except OSError as exc:
            raise ChangelogError(f"{self.name}: a retained segment cannot be read: {exc}") from exc
        finally:
            dec.close()

    # -- segments ---------------------------------------------------------------------------------
    def relevant_segments(self) -> list:
        """Segments below the frontier that may hold a commit of the interval; error if one of them
        is not retained."""
        segs = [s for s in self.ctl.segments(self.cfg.stream, status=None)
                if s.lower < self.frontier and s.record_count > 0]
        segs = [self.with_bounds(s) for s in segs]
        known = [s for s in segs if s.min_commit_ts is not None]
        relevant = [s for s in known if s.max_commit_ts >= self.s_us and s.min_commit_ts < self.e_us]
        if relevant:
            lo, hi = min(s.lower for s in relevant), max(s.upper for s in relevant)
            # a segment whose bounds are unknown (its file is gone) inside the interval's LSN span
            relevant += [s for s in segs if s.min_commit_ts is None and s.lower < hi and s.upper > lo]
        lost = [s for s in relevant if s.status != "landed" or s.min_commit_ts is None]
        if lost:
            what = ", ".join(f"{s.seq} [{format_lsn(s.lower)}, {format_lsn(s.upper)}) {s.status}"
                             + ("" if s.min_commit_ts is not None else " (file unreadable)") for s in lost)
            raise ChangelogError(f"{self.name}: commits of this interval are in segment(s) {what}, which are no "
                                 "longer retained; the interval cannot be rebuilt")
        return relevant

    def with_bounds(self, seg):
        """``seg`` with its commit-time bounds, read from its file (and recorded) when unknown."""
        if seg.min_commit_ts is not None:
            return seg
        try:
            content = read_segment_at(seg.uri, self.cfg.landing.endpoint_url)
        except Exception:  # noqa: BLE001 - a missing or unreadable file: bounds stay unknown
            return seg
        low, high = content.commit_span
        if low is None:
            return seg
        self.ctl.set_segment_commit_bounds(self.cfg.stream, seg.seq, low, high)
        return dataclasses.replace(seg, min_commit_ts=low, max_commit_ts=high)

    # -- lake versions -----------------------------------------------------------------------------
    def base_version(self, table: str, low: int) -> tuple[int | None, int]:
        """(version, frontier) of the newest lake version of ``table`` whose frontier is <= ``low``;
        (None, consistent LSN) for a table that was empty there (no snapshot, created by changes)."""
        dt = open_delta(table_uri(self.cfg, table), storage_options(self.cfg))
        if dt is None:
            raise ChangelogError(f"{self.name}: table {table} has a changelog but no lake table")
        best, current, first_op = None, None, None
        for h in sorted(dt.history(), key=lambda h: h["version"]):
            meta = h.get("tidemark")
            if isinstance(meta, dict) and meta.get("stream") == self.cfg.stream and meta.get("frontier") is not None:
                current = int(meta["frontier"])
                first_op = first_op or meta.get("operation")
            if current is not None and current <= low:
                best = (int(h["version"]), current)
        consistent = self.ctl.stream(self.cfg.stream).consistent_lsn
        if best is None and first_op != "snapshot" and consistent is not None and consistent <= low:
            return None, consistent      # created by changes, not by a snapshot: empty before its first version
        if best is None:
            raise ChangelogError(f"{self.name}: table {table} has no lake version at or below LSN {low} (the state "
                                 "before the interval); its history was not kept")
        return best

    # -- per table --------------------------------------------------------------------------------
    def table_rows(self, dec, table: str, version: int | None, base: int, upper: int):
        """The exact changelog rows of ``table`` in the interval, replayed from lake ``version``."""
        uri, opts = table_uri(self.cfg, table), storage_options(self.cfg)
        latest = open_delta(uri, opts)
        shape = TableSchema.from_json(table_info(latest)["table_schema"])
        try:
            from deltalake import DeltaTable

            old = DeltaTable(uri, version=version, storage_options=opts) if version is not None else None
        except Exception as exc:  # noqa: BLE001 - vacuumed log or files
            raise ChangelogError(f"{self.name}: lake version {version} of {table} (frontier {base}) cannot be "
                                 f"read: {exc}") from exc
        # columns renamed since the version: a rename rewrites the table at the frontier it had, so the
        # versions up to it at that frontier (the batch's commit and the rewrites that followed it) tell them
        renames = {}
        for h in sorted(latest.history(), key=lambda h: h["version"]):
            meta = h.get("tidemark")
            if version is not None and int(h["version"]) <= version and isinstance(meta, dict) \
                    and meta.get("stream") == self.cfg.stream and meta.get("frontier") == base:
                then = DeltaTable(uri, version=int(h["version"]), storage_options=opts)
                renames.update(renames_since(table_info(then), table_info(latest)))
        return self.within(_batch.replay(dec, Prepared(
            table, uri, old, shape, arrow_schema(shape), effective_keys(shape), base, lake_buckets(self.cfg, latest),
            truncates=dec.truncates(table, base, upper), frontier=upper, replay=True, renames=renames)))

    def within(self, rows):
        """The changelog ``rows`` committed in the interval, below the frontier."""
        ts = rows.column("_commit_ts")
        return rows.filter(pc.and_(pc.and_(pc.greater_equal(ts, pa.scalar(self.start, ts.type)),
                                           pc.less(ts, pa.scalar(self.end, ts.type))),
                                   pc.less(rows.column("_time"), self.frontier)))

    def replace(self, table: str, rows) -> bool:
        """Replace the interval's rows of ``table``'s changelog with ``rows`` in one Delta commit, unless
        they are equal already; return whether a commit was made."""
        uri, opts = changelog_uri(self.cfg, table), storage_options(self.cfg)
        dt = open_delta(uri, opts)
        schema = pa.schema(dt.schema().to_arrow())
        data_schema = pa.schema([f for f in schema if f.name != "_commit_date"])
        rows = conform(rows, data_schema) if rows is not None else data_schema.empty_table()
        have = conform(self.within(read_changelog(self.cfg, table, days=(self.start.date(), self.end.date()))),
                       data_schema)
        if _multiset(have) == _multiset(rows):
            return False
        dates = pc.cast(pc.cast(rows.column("_commit_ts"), pa.timestamp("us")), pa.date32())
        data = rows.append_column(schema.field("_commit_date"), dates)
        pred = (f"_commit_date >= '{self.start.date().isoformat()}' AND _commit_date <= '{self.end.date().isoformat()}' "
                f"AND _commit_ts >= '{self.start.isoformat()}' AND _commit_ts < '{self.end.isoformat()}' "
                f"AND _time < {int(self.frontier)}")
        writer.replace_where(uri, opts, data, pred)
        return True


def _multiset(rows) -> list:
    """A sortable, comparable form of rows (temporal values as integers, NaN-safe through repr)."""
    return sorted(repr(tuple(r.values())) for r in plain(rows).to_pylist())
