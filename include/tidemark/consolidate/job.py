"""`consolidate_stream`: segments between the frontier and the newest complete upper → Delta tables.

Order of effects, each idempotent:

1. plan: the landed segments that tile ``[frontier, end)``; decode them in executors; check
   completeness; the new frontier ``F`` is held below the first unmet time;
2. every table in one Spark job (`batch`): a pending snapshot loaded as its own version (app
   transaction ``(stream, lsn)``), then the table's changes in ``[max(frontier, committed), F)``
   merged (`merge`): its changelog commit and its table commit each carry ``(stream, F)`` and are
   skipped when already there;
3. the history tables (stream file ``history:``): each one at its changelog's frontier before the
   batch is kept by the merge tasks of step 2 from the changelog rows they work out
   (`history.in_merge`) and committed after its table; the others (a first history, a load, a
   schema change, one left behind by a failure) are brought to their changelogs' frontier from the
   changelog (`history.keep_histories`); each commit carries its own ``(stream, F)``;
4. ``Control.advance_frontier`` (frontier and the consolidation subscriber's checkpoint), snapshots
   marked loaded, then the slot advanced to ``F`` — in that order, never the reverse.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time as _time
from dataclasses import dataclass, field
from typing import Any

from tidemark.config import StreamConfig
from tidemark.consolidate import batch as _batch, idle as _idle, layout, plan as _plan, prepare as _prepare
from tidemark.consolidate.changelog import advance_feeds
from tidemark.consolidate.decode import (DECODED_DDL, Work, content_hashes, decode_partition, held_as_text, identities,
                                         read_parts, with_content_hashes)
from tidemark.errors import ConsolidateError, StreamBusy, TableNeedsSnapshot, TidemarkError, lake_full
from tidemark.lake import committed_frontier, open_delta, storage_options, table_uri
from tidemark.lsn import format_lsn
from tidemark.sparkconf import default_parallelism, propagate_s3_env, spark_session  # noqa: F401
from tidemark.failures import failure_reason

log = logging.getLogger(__name__)


class ConsolidateFailed(ConsolidateError):
    """A consolidation run failed and the failure was recorded as an incident (``incident`` id, or
    None if the control database could not be reached); the message is one line with the remedy."""

    def __init__(self, message: str, *, incident: int | None, detail: dict):
        super().__init__(message)
        self.incident = incident
        self.detail = detail
        self.remedy = detail.get("remedy")      # the message's end, printed on its own line by the CLI


@dataclass
class ConsolidateResult:
    stream: str
    frontier_before: int | None
    frontier_after: int | None
    rows_changed: dict[str, int] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    skipped: bool = False
    segments: list[int] = field(default_factory=list)
    unmet: list[Any] = field(default_factory=list)
    incident: int | None = None
    snapshots_loaded: list[str] = field(default_factory=list)
    slot_confirmed: int | None = None
    spark: bool = True          # False: only progress landed, the control database alone moved
    frontiers: dict[str, int] = field(default_factory=dict)   # an external feed's tables: each one's own
    more: bool = False          # landed segments remain after this slice (`plan.sliced`)
    slices: int = 1             # slices consolidated by this run
    waiting: dict[str, str] = field(default_factory=dict)     # table -> why the lake does not take its changes yet
    held: bool = False          # nothing consolidated: a re-snapshot a failure asked for has not landed yet
    history: dict[str, int | None] = field(default_factory=dict)   # table -> its history table's new version
    # table -> what its new version (``versions``) did: rows inserted, updated, deleted (`merge._count_changes`),
    # and ``snapshot_rows``, the rows of a snapshot loaded as a version of its own; only the tables committed
    changes: dict[str, dict[str, int]] = field(default_factory=dict)

    def table_events(self) -> dict[str, dict]:
        """{table: what its lake table got} for each table this run committed a new Delta version of
        (a table the batch left alone is not here): the stream, the frontier (LSN text), that version
        and its rows inserted, updated and deleted (with a snapshot loaded, ``snapshot_rows``). Plain
        JSON, the extra of the table's Asset event under Airflow."""
        return {table: {"stream": self.stream, "table": table,
                        "frontier": format_lsn(self.frontiers.get(table, self.frontier_after)),
                        "version": version, **self.changes.get(table, {})}
                for table, version in sorted(self.versions.items())}

    def then(self, nxt: "ConsolidateResult") -> "ConsolidateResult":
        """This run's result followed by the next slice's."""
        rows = dict(self.rows_changed)
        for t, n in nxt.rows_changed.items():
            rows[t] = rows.get(t, 0) + n
        changes = {t: dict(c) for t, c in self.changes.items()}
        for t, c in nxt.changes.items():
            mine = changes.setdefault(t, {})
            for k, n in c.items():
                mine[k] = mine.get(k, 0) + n
        return ConsolidateResult(
            stream=self.stream, frontier_before=self.frontier_before, frontier_after=nxt.frontier_after,
            rows_changed=rows, versions={**self.versions, **nxt.versions}, skipped=False,
            segments=self.segments + nxt.segments, unmet=nxt.unmet, incident=nxt.incident or self.incident,
            snapshots_loaded=self.snapshots_loaded + nxt.snapshots_loaded,
            slot_confirmed=nxt.slot_confirmed or self.slot_confirmed, spark=self.spark or nxt.spark,
            frontiers={**self.frontiers, **nxt.frontiers}, more=nxt.more,
            slices=self.slices + nxt.slices, waiting=nxt.waiting, history={**self.history, **nxt.history},
            changes=changes)


# -- control-database helpers (snapshots) -----------------------------------------------------------

@dataclass(frozen=True)
class PendingSnapshot:
    snapshot_id: str
    lsn: int
    mode: str
    tables: dict


def pending_snapshots(ctl, stream: str) -> list[PendingSnapshot]:
    """Snapshots that are complete but not yet loaded into the lake, oldest first."""
    return [PendingSnapshot(*r) for r in ctl.complete_snapshots(stream)]


# -- the job ---------------------------------------------------------------------------------------

def consolidate_stream(cfg: StreamConfig, *, spark=None, target_rows: int | None = None,
                       without_spark: bool = False) -> ConsolidateResult | None:
    """Consolidate the stream's complete segments into its lake tables (see module doc), slice by
    slice: one Spark job takes at most ``consolidate.max_batch_bytes`` of segments and
    ``max_batch_records`` of their records, commits and
    advances the frontier before the next one starts, so a backlog of any size is worked off with the
    same memory (a kill between slices resumes at the last frontier). When only progress landed
    since the frontier (`idle.progress_only`), no SparkSession is created or used. ``without_spark``:
    return None instead of starting Spark when a slice needs it.

    Any failure is recorded as a ``consolidate_failed`` incident (stream, table, segment, position,
    the reason in plain words, which tables already reached the new frontier, the remedy) and raised
    as one `ConsolidateError` line; the next successful slice resolves the stream's open ones."""
    total: ConsolidateResult | None = None
    while True:
        where = _Where(cfg)
        try:
            try:
                result = _consolidate_stream(cfg, spark=spark, target_rows=target_rows, where=where,
                                             without_spark=without_spark)
            except (StreamBusy, ConsolidateFailed):
                raise
            except Exception as exc:  # noqa: BLE001 - every failure becomes an incident and one clear line
                where.close()         # (the incident is recorded on a connection of its own)
                raise where.failed(exc) from exc
            if result is None:
                return total
            if not result.held:       # (held: the failure stays open until its re-snapshot is merged)
                where.resolve(result.frontier_after)      # every table is at the stream frontier again
        finally:
            where.close()
        total = result if total is None else total.then(result)
        if not result.more or result.skipped or result.frontier_after == result.frontier_before:
            return total


def advance_if_idle(cfg: StreamConfig) -> ConsolidateResult | None:
    """Advance an idle stream without Spark (`idle.progress_only`); return the `ConsolidateResult`, or
    None when the landed segments hold records (or snapshots wait to be loaded) and Spark must
    consolidate them."""
    return consolidate_stream(cfg, without_spark=True)


def _consolidate_stream(cfg: StreamConfig, *, spark, target_rows: int | None, where: "_Where",
                        without_spark: bool = False) -> ConsolidateResult | None:
    from tidemark.control import open_control
    from tidemark.capture.source import advance_slot

    where.step = "opening the control database"
    # the run's connection: `consolidate_stream` closes it after resolving the stream's incidents on it
    ctl = where.ctl = open_control(cfg)
    with ctl.stream_lock(cfg.stream, "consolidate") as lease:
        where.step = "planning"
        state = ctl.stream(cfg.stream)
        snaps = pending_snapshots(ctl, cfg.stream)
        start = state.frontier if state.frontier is not None else state.consistent_lsn
        if start is None and snaps:
            start = min(s.lsn for s in snaps)
        captured = {t.qualified for t in cfg.source.tables}
        superseding = [s.lsn for s in snaps if s.mode in ("initial", "resend") and captured <= set(s.tables)
                       and start is not None and s.lsn > start]
        if superseding:
            # a snapshot of every captured table (a resend) supersedes all changes below its lsn,
            # including lost ones: consolidation resumes from there
            start = max(superseding)
        result = ConsolidateResult(stream=cfg.stream, frontier_before=state.frontier, frontier_after=state.frontier)
        if start is None:
            result.skipped = True
            return result
        segs = ctl.segments(cfg.stream, status="landed", lower_from=start)
        reach = _resnapshots_asked(ctl, cfg, snaps, start)
        run = _plan.coverage(segs, start)
        if reach and run.end < max(reach.values()):
            # a table's change only its re-snapshot corrects is in the landed segments, the re-snapshot's
            # LSN is not yet: any batch would fail the same way; a drain lands the rest
            result.held, result.skipped = True, True
            result.waiting = {t: f"its change needs its re-snapshot at {format_lsn(lsn)}, merged once the segments "
                                 f"up to it land (landed up to {format_lsn(run.end)}): it goes on after a drain"
                              for t, lsn in reach.items()}
            return result
        cov = _plan.sliced(run, cfg.consolidate.max_batch_bytes, cfg.consolidate.max_batch_records,
                           reach=max(reach.values(), default=None))
        table_at = _feed_frontiers(ctl, cfg, state, cov, start) if cfg.source.is_feed else None
        if not any(s.lsn <= cov.end for s in snaps) and _idle.progress_only(cfg, cov.segments):
            return _advance_idle(ctl, lease, cfg, result, cov, start, table_at,
                                 start_spark=None if without_spark else (lambda: spark or spark_session(cfg=cfg)))
        if without_spark:
            return None
        t0 = _time.perf_counter()
        spark = spark or spark_session(cfg=cfg)
        propagate_s3_env(spark)
        _plan.phase("Spark session", _time.perf_counter() - t0)
        where.start, where.segments = start, list(cov.segments)
        where.step = "decoding the segments (Spark job)"
        t0 = _time.perf_counter()
        job = _Job(cfg, spark, start, cov, target_rows or layout.TARGET_ROWS, snaps)
        _plan.phase("decode segments (Spark job)", _time.perf_counter() - t0)
        where.job = job
        where.step = "planning"
        try:
            # an external feed's completeness is the ingest's (per table, by the format's rules): its
            # segments land each table's complete times only, and a time's records may span segments
            unmet = (_plan.completeness_rows(job.ids, start, cov.end, counted=job.counted)
                     if cov.segments and table_at is None else [])
            frontier = _plan.new_frontier(cov, unmet) if table_at is None else min(table_at.values())
            result.unmet = unmet
            result.incident = _plan.report_unmet(ctl, cfg.stream, unmet, cfg.consolidate.count_timeout_seconds)
            loadable = [s for s in snaps if s.lsn <= frontier]
            if (frontier == start and not loadable and state.frontier is not None
                    and not _feed_moves(ctl, cfg, table_at, start)):
                result.skipped = True
                _catch_up_histories(cfg, spark, result)
                return result
            result.waiting = {} if table_at is not None else _waiting(ctl, cfg, snaps, frontier)
            where.frontier = frontier
            where.tables = [t for t in job.tables(loadable) if t not in result.waiting]
            _check_unstorable(job.bad, where.tables, snaps, frontier)
            where.step = "consolidating the batch's tables in one Spark job"
            lease.confirm(f"commit {len(where.tables)} tables to the lake at {format_lsn(frontier)}")
            done = _batch.consolidate_tables(job, where.tables, frontier, loadable, frontiers=table_at)
            for table in where.tables:
                changed, version = done[table]
                where.done.append(table)
                if version is not None:
                    result.versions[table] = version
                    result.rows_changed[table] = changed
                    result.changes[table] = job.changes[table]
            where.table = None
            t0 = _time.perf_counter()
            # idle tables' feeds too (a table the batch path committed has its changelog at the frontier)
            advance_feeds(cfg, frontier, options=job.options, frontiers=table_at,
                          committed=job.merged,
                          opened={t: dt for t, dt in job.lake_tables.items() if t not in where.tables})
            _plan.phase("advance idle feeds", _time.perf_counter() - t0)
            if cfg.history:
                # after the tables' and changelogs' commits: each history table catches up from its
                # changelog (a crash before this step is caught up by the next run)
                from tidemark.consolidate.history import keep_histories

                where.step = "keeping the history tables (Spark job)"
                # (those the merge job kept are at the frontier: not read again)
                rest = [t.qualified for t in cfg.history if t.qualified not in job.history_versions]
                result.history = {**job.history_versions,
                                  **(keep_histories(cfg, spark, options=job.options, tables=rest) if rest else {})}
        finally:
            job.close()
        t0 = _time.perf_counter()
        result.segments = [s.seq for s in cov.segments if s.upper <= frontier]
        where.step = "advancing the frontier in the control database"
        lease.confirm(f"advance the frontier to {format_lsn(frontier)}")
        _record_feed_frontiers(ctl, cfg, table_at, result)
        ctl.advance_frontier(cfg.stream, frontier, committed_segment=max(result.segments) if result.segments else None)
        if loadable:
            done = [s.snapshot_id for s in loadable if all(job.loaded_ok(t, s) for t in s.tables)]
            ctl.mark_snapshots_loaded(cfg.stream, done)
            result.snapshots_loaded = done
        result.frontier_after = frontier
        result.more = cov.more and frontier == cov.end
        if cfg.source.is_feed:     # an external feed has no slot
            return result
        where.step = "advancing the slot"
        lease.confirm(f"advance slot {cfg.source.slot} to {format_lsn(frontier)}")
        try:
            result.slot_confirmed = advance_slot(cfg, frontier)
        except TidemarkError as exc:  # an active drain owns the slot; its own feedback confirms later
            log.warning("stream %s: slot not advanced: %s", cfg.stream, exc)
        _plan.phase("frontier and slot (control db)", _time.perf_counter() - t0)
    return result


def _resnapshots_asked(ctl, cfg: StreamConfig, snaps: list["PendingSnapshot"], start: int) -> dict[str, int]:
    """{table: the LSN of its newest pending re-snapshot (mode table) above ``start``} for the tables
    an open consolidation failure asked to re-snapshot (`TableNeedsSnapshot`: ``resnapshot`` in its
    detail). Its change below that LSN is merged only in the batch that merges the re-snapshot too:
    the batch reaches it (`plan.sliced`'s ``reach``), or waits until it has landed. A re-snapshot
    that replaces its table (`prepare.replaces`) is not one: the table waits for it alone
    (`_waiting`), its changes below it left out."""
    asked = {t for i in ctl.incidents(cfg.stream) if i["kind"] == "consolidate_failed"
             and isinstance(i["detail"], dict) for t in (i["detail"].get("resnapshot") or ())}
    out: dict[str, int] = {}
    for s in snaps:
        if s.mode == "table" and s.lsn > start:
            for t in asked & set(s.tables):
                if not _prepare.replaces(s, t, open_delta(table_uri(cfg, t), storage_options(cfg))):
                    out[t] = max(out.get(t, 0), s.lsn)
    return out


def _waiting(ctl, cfg: StreamConfig, snaps: list["PendingSnapshot"], frontier: int) -> dict[str, str]:
    """{table: why} for the tables whose changes the lake does not take in this batch: added to the
    running stream and waiting for their snapshot, snapshotted at an LSN above ``frontier`` (loaded
    once the frontier reaches it; their changes below it are in the snapshot), or removed from the
    stream file (frozen). Every other table goes on, also one being re-snapshotted (mode table): its
    changes below the snapshot's LSN are merged as usual, the snapshot at that LSN — unless the
    re-snapshot replaces the table (`prepare.replaces`: a column's type or the row identity changed),
    which waits like a first snapshot."""
    out = {}
    for table, (state, since) in ctl.table_states(cfg.stream).items():
        if state == "awaiting_snapshot":
            out[table] = (f"added to the stream: its changes wait for its snapshot (tidemark snapshot {cfg.stream} "
                          f"--mode add --tables {table})")
        elif state == "frozen":
            out[table] = f"removed from the stream file: its lake table is frozen at {format_lsn(since or 0)}"
    for s in snaps:
        if s.lsn <= frontier:
            continue
        for table in s.tables:     # a re-snapshot's table goes on until its LSN, unless it replaces the table
            if s.mode != "table" or _prepare.replaces(s, table, open_delta(table_uri(cfg, table), storage_options(cfg))):
                out.setdefault(table, f"its snapshot {s.snapshot_id} at {format_lsn(s.lsn)} is loaded once the "
                                      "frontier reaches it")
    return out


def _redact(cfg: StreamConfig, text: str) -> str:
    """``text`` without the stream's connection passwords (a driver message may echo a DSN)."""
    from psycopg2.extensions import parse_dsn

    from tidemark.connections import resolve_dsn

    for conn_id in (cfg.source.connection, cfg.control_connection):
        try:
            password = parse_dsn(resolve_dsn(conn_id)).get("password")
        except Exception:  # noqa: BLE001 - an unresolvable connection has no password to hide
            continue
        if password:
            text = text.replace(password, "***")
    return text


class _Where:
    """Where a consolidation run is, so a failure can say it: step, table, segments, positions."""

    def __init__(self, cfg: StreamConfig):
        self.cfg = cfg
        self.step = "starting"
        self.table: str | None = None
        self.start: int | None = None
        self.frontier: int | None = None
        self.segments: list = []
        self.tables: list[str] = []
        self.done: list[str] = []
        self.job = None
        self.ctl = None           # the run's control connection (`_consolidate_stream`)

    def _segment(self):
        """The segment holding the failing table's first change of the batch (else the batch's first)."""
        times = []
        if self.job is not None and self.table is not None:
            times = sorted(r["time"] for r in getattr(self.job, "shapes", []) if r["table"] == self.table
                           and r["time"] >= (self.start or 0))
        for s in self.segments:
            if times and s.lower <= times[0] < s.upper:
                return s, times[0]
        return (self.segments[0] if self.segments else None), (times[0] if times else None)

    def _ahead(self) -> list[str]:
        """Tables whose lake commit already records the batch's frontier (from their Delta logs)."""
        if self.frontier is None:
            return []
        out = []
        for t in self.tables:
            try:
                done = committed_frontier(open_delta(table_uri(self.cfg, t), storage_options(self.cfg)),
                                          self.cfg.stream)
            except Exception:  # noqa: BLE001 - unreadable now: not known to be ahead
                continue
            if done is not None and done >= self.frontier:
                out.append(t)
        return out

    def failed(self, exc: BaseException) -> ConsolidateFailed:
        """Record the failure as an incident; return the one-line error to raise."""
        import datetime as _dt

        import psycopg2

        cfg = self.cfg
        if self.table is None and self.job is not None:   # the batch path names the table it was committing
            self.table = getattr(self.job, "committing", None)
        full = lake_full(exc)
        if self.table is None and full is not None:       # a merge task's file: the table it belongs to
            from tidemark.lake import changelog_uri, history_uri

            path = str(full.get("path", ""))
            self.table = next((t for t in self.tables for uri in (table_uri, changelog_uri, history_uri)
                               if path.startswith(uri(cfg, t) + "/")), None)
        reason, fix = failure_reason(exc, cfg)     # a Spark failure: what ran out or is missing, and the fix
        value = unstorable_value(exc)
        if value is not None:
            return self._unstorable(value)
        if isinstance(exc, psycopg2.Error):
            if self.step.endswith("control database") or self.step in ("opening the control database", "planning"):
                which = f"the control database connection '{cfg.control_connection}'"
            else:
                which = (f"a database connection (source '{cfg.source.connection}' or control "
                         f"'{cfg.control_connection}')")
            verb = "was lost" if isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)) else "failed"
            reason = f"{which} {verb} while {self.step}: {_redact(cfg, reason)}"
        seg, first_time = self._segment()
        ahead = self._ahead()
        behind = [t for t in self.tables if t not in ahead and t not in self.done]
        detail = {"stream": cfg.stream, "table": self.table, "step": self.step,
                  "segment": None if seg is None else {"seq": seg.seq, "uri": seg.uri},
                  "lower": format_lsn(self.start) if self.start is not None else None,
                  "frontier": format_lsn(self.frontier) if self.frontier is not None else None,
                  "position": format_lsn(first_time) if first_time is not None else None,
                  "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  "reason": reason, "tables_at_new_frontier": ahead, "tables_not_reached": behind}
        remedy = (f"{fix or 'fix the cause'}, then run `tidemark consolidate {cfg.stream}` again: it resumes where it stopped "
                  "(tables already committed are skipped)")
        if ahead:
            remedy += (f"; until then {', '.join(ahead)} are ahead of the stream frontier: "
                       "read consistent tables with tidemark.lake.read_tables(cfg)")
        detail["remedy"] = remedy
        if isinstance(exc, TableNeedsSnapshot):   # the gap sensor's resend step re-snapshots it alone
            detail["resnapshot"] = [exc.table]
            detail["remedy"] = remedy = (f"re-snapshot {exc.table} alone while the stream runs: the consolidate DAG's "
                                         f"resend step does it by itself; by hand: `tidemark snapshot {cfg.stream} "
                                         f"--mode table --tables {exc.table}`, then drain and consolidate (a "
                                         "consolidation before the drain waits for it)")
        incident = self._record(detail)
        parts = [f"stream {cfg.stream}"]
        if self.table:
            parts.append(f"table {self.table}")
        if seg is not None:
            parts.append(f"segment {seg.seq}")
        if self.start is not None and self.frontier is not None:
            parts.append(f"batch [{format_lsn(self.start)}, {format_lsn(self.frontier)})")
        if first_time is not None:
            parts.append(f"first change at {format_lsn(first_time)}")
        recorded = f" (incident {incident})" if incident is not None else " (not recorded: the control database is unreachable)"
        # a table's re-snapshot: the remedy on a line of its own (its reason names the change, not the remedy)
        sep = "\n" if isinstance(exc, TableNeedsSnapshot) else "; "
        msg = f"consolidation failed{recorded}: {', '.join(parts)}, while {self.step}: {reason}{sep}remedy: {remedy}"
        return ConsolidateFailed(msg, incident=incident, detail=detail)

    def _record(self, detail: dict) -> int | None:
        """Open a ``consolidate_failed`` incident; its id, or None if the control database is unreachable."""
        try:
            from tidemark.control import open_control

            with open_control(self.cfg) as ctl:
                return ctl.open_incident(self.cfg.stream, "consolidate_failed", detail)
        except Exception as rec_exc:  # noqa: BLE001 - the control database may be what failed
            log.warning("stream %s: the failure could not be recorded as an incident: %s", self.cfg.stream, rec_exc)
        return None

    def _unstorable(self, facts: dict) -> ConsolidateFailed:
        """A landed value the lake type cannot hold: running again reads the same segment and fails the
        same way, so the remedy is a resend of the table (after correcting the value in the source)."""
        import datetime as _dt

        cfg = self.cfg
        table = facts["table"]
        self.table = table
        name = facts.get("segment") or ""
        seg = next((s for s in self.segments if name and s.uri.rsplit("/", 1)[-1] == name), None)
        segment = f"segment {seg.seq}" if seg is not None else f"segment {facts.get('segment')}"
        resend = f"tidemark snapshot {cfg.stream} --mode table --tables {table}"
        remedy = (f"correct the value in the source (or change the column to a type whose lake type holds it, "
                  f"e.g. unconstrained numeric), then resend the table: `{resend}`; running the consolidation "
                  "again fails the same way, because the value is in a landed segment")
        reason = (f"the value {facts['value']!r} of column {facts['column']} ({facts.get('type')}) cannot be stored "
                  f"in the lake: {facts.get('why')}")
        detail = {"stream": cfg.stream, "table": table, "column": facts["column"], "step": self.step,
                  "segment": {"seq": seg.seq if seg is not None else None,
                              "uri": seg.uri if seg is not None else facts.get("segment")},
                  "lower": format_lsn(self.start) if self.start is not None else None,
                  "frontier": format_lsn(self.frontier) if self.frontier is not None else None,
                  "position": facts["lsn"], "value": facts["value"],
                  "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  "reason": reason, "remedy": remedy,
                  "tables_at_new_frontier": self._ahead(), "tables_not_reached": []}
        detail["tables_not_reached"] = [t for t in self.tables if t not in detail["tables_at_new_frontier"]
                                        and t not in self.done]
        incident = self._record(detail)
        recorded = f" (incident {incident})" if incident is not None else " (not recorded: the control database is unreachable)"
        msg = (f"consolidation failed{recorded}: stream {cfg.stream}, table {table}, column {facts['column']}, "
               f"{segment}, LSN {facts['lsn']}: {reason}; remedy: {remedy}")
        return ConsolidateFailed(msg, incident=incident, detail=detail)

    def resolve(self, frontier: int | None) -> None:
        """A run succeeded: the stream's open consolidation failures are resolved (on the run's
        control connection, else on one of its own)."""
        from tidemark.control import open_control

        try:
            with contextlib.nullcontext(self.ctl) if self.ctl is not None else open_control(self.cfg) as ctl:
                for i in ctl.incidents(self.cfg.stream):
                    if i["kind"] == "consolidate_failed":
                        ctl.resolve_incident(i["id"], f"consolidated to {format_lsn(frontier)}")
        except Exception as exc:  # noqa: BLE001 - the run itself succeeded
            log.warning("stream %s: open consolidation incidents not resolved: %s", self.cfg.stream, exc)

    def close(self) -> None:
        """Close the run's control connection (if open)."""
        ctl, self.ctl = self.ctl, None
        if ctl is not None:
            ctl.close()


def _feed_frontiers(ctl, cfg: StreamConfig, state, cov, start: int) -> dict[str, int]:
    """An external feed's tables: how far each may move now, its landed upper (`feeds.ingest`) within
    the landed run (a stream without per-table positions yet: every table to the run's end)."""
    positions = ctl.table_frontiers(cfg.stream)
    out = {}
    for ref in cfg.source.tables:
        at = positions.get(ref.qualified) or {}
        landed = at.get("landed_upper")
        if landed is None:
            landed = cov.end if not positions else start
        out[ref.qualified] = max(start, at.get("frontier") or start, min(landed, cov.end))
    return out


def _feed_moves(ctl, cfg: StreamConfig, table_at: dict[str, int] | None, start: int) -> bool:
    """Whether some feed table may move past the frontier it has recorded."""
    if not table_at:
        return False
    positions = ctl.table_frontiers(cfg.stream)
    return any(f > ((positions.get(t) or {}).get("frontier") or start) for t, f in table_at.items())


def _record_feed_frontiers(ctl, cfg: StreamConfig, table_at: dict[str, int] | None, result) -> None:
    if table_at:
        for table, f in sorted(table_at.items()):
            ctl.advance_table_positions(cfg.stream, table, frontier=f)
        result.frontiers = dict(table_at)


def _catch_up_histories(cfg: StreamConfig, spark, result: ConsolidateResult, start_spark=None) -> None:
    """Bring the history tables to their changelogs' frontiers (`history.keep_histories`) when no
    batch does: one left behind by a crash is caught up by the next run, even an idle one (Spark is
    started for it by ``start_spark`` only when a history has changelog rows to take; without it,
    such a history waits for the next run with Spark)."""
    if not cfg.history:
        return
    from tidemark.consolidate.history import keep_histories

    result.history = keep_histories(cfg, spark, options=storage_options(cfg), start_spark=start_spark)


def _advance_idle(ctl, lease, cfg: StreamConfig, result: ConsolidateResult, cov, start: int,
                  table_at: dict[str, int] | None = None, start_spark=None) -> ConsolidateResult:
    """Only progress since ``start``: move the frontier, checkpoint and slot to the run's end, and every
    table's feed with it (no Spark: the control database and the changelog's progress only). An
    external feed's tables each move to their own frontier, the stream's to the least of them."""
    from tidemark.capture.source import advance_slot

    frontier = _plan.new_frontier(cov, []) if table_at is None else min(table_at.values())
    result.spark = False
    if frontier == start and result.frontier_before is not None and not _feed_moves(ctl, cfg, table_at, start):
        result.skipped = True
        _catch_up_histories(cfg, None, result, start_spark)
        return result
    result.segments = [s.seq for s in cov.segments if s.upper <= frontier]
    advance_feeds(cfg, frontier, options=storage_options(cfg), frontiers=table_at)
    _catch_up_histories(cfg, None, result, start_spark)
    lease.confirm(f"advance the frontier to {format_lsn(frontier)}")
    _record_feed_frontiers(ctl, cfg, table_at, result)
    ctl.advance_frontier(cfg.stream, frontier, committed_segment=max(result.segments) if result.segments else None)
    result.frontier_after = frontier
    result.more = cov.more and frontier == cov.end
    log.info("stream %s: only progress landed; frontier %s -> %s without Spark", cfg.stream,
             format_lsn(result.frontier_before), format_lsn(frontier))
    if cfg.source.is_feed:     # an external feed has no slot
        return result
    lease.confirm(f"advance slot {cfg.source.slot} to {format_lsn(frontier)}")
    try:
        result.slot_confirmed = advance_slot(cfg, frontier)
    except TidemarkError as exc:
        log.warning("stream %s: slot not advanced: %s", cfg.stream, exc)
    return result


class _Job:
    """The state of one consolidation run (decoded segments, the steps before a table's merge)."""

    def __init__(self, cfg: StreamConfig, spark, start: int, cov, target_rows: int, snaps=()):
        """Decode the segments of ``cov`` in one Spark job: their parts into the run's work area
        (`decode.Work`), each table's updates cut by its lake buckets (`prepare.bucket_counts`), and
        the small rows (shapes, events, counts, the records' identities tallied per time: `decode.identities`)
        to the driver."""
        import uuid

        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        from tidemark.consolidate import transform as T
        from tidemark.landing.store import stream_keys

        self.cfg, self.spark, self.start, self.cov, self.target_rows = cfg, spark, start, cov, target_rows
        self.options = storage_options(cfg)
        self.loaded: dict[tuple[str, str], bool] = {}
        self.merged: list[str] = []          # the tables the batch merged (`batch.consolidate_tables`)
        self.bases: dict[str, str] = {}     # table -> the snapshot its changelog restarts from in this run
        self.history_versions: dict[str, int] = {}   # table -> its history's version the merge job committed
        self.changes: dict[str, dict[str, int]] = {}  # table -> its rows inserted, updated, deleted (`batch`)
        land = cfg.landing
        area = stream_keys(cfg.stream)["decoded"]
        self.work = Work((land.url, land.endpoint_url, land.region), f"{area}{uuid.uuid4().hex[:12]}-")
        uris = [s.uri for s in cov.segments]
        self.buckets, self.lake_tables = _prepare.bucket_counts(cfg, self.options) if uris else ({}, {})
        self.shapes, self.events, self.ids, self.counted, self.bad, self.links = [], [], None, None, [], {}
        if not uris:
            return
        self.work.discard(area)          # what a stopped run left (the stream's lease: no other run is on)
        endpoint, buckets, work = land.endpoint_url, self.buckets, self.work
        # segment i is row i of a range split over the cores: no local relation to ship, no shuffle; the
        # parts stay in the work area, the driver gets the small rows only
        src = spark.range(0, len(uris), 1, min(len(uris), max(1, default_parallelism(spark))))
        from tidemark.landing.segments import PIECE_RECORDS

        piece = min(PIECE_RECORDS, cfg.consolidate.max_batch_records)     # a huge segment: decoded piece by piece
        texts = held_as_text(self.lake_tables, snaps, cov.end)     # array columns the lake holds as text
        small = src.mapInArrow(lambda it: decode_partition(it, endpoint, uris, buckets, work, piece, texts),
                               T.schema(spark, DECODED_DDL)).toArrow()
        kinds = small.column("kind")
        meta = small.filter(pc.is_in(kinds, value_set=pa.array(["data", "evt"]))).drop_columns(["payload"]).to_pylist()
        self.shapes = [r for r in meta if r["kind"] == "data"]
        # the check's rows: per time, not per record (a huge transaction's identities stay in the work area)
        store = work.open()
        found = identities(small, lambda parts: read_parts(store, work, parts))
        self.counted = found.counted
        self.ids = with_content_hashes(found.rows, self._content_hashes)   # (reads shapes' parts)
        bad = small.filter(pc.equal(kinds, "bad"))
        self.bad = sorted(zip(bad.column("time").to_pylist(), bad.column("table").to_pylist(),
                              bad.column("info").to_pylist()))
        events = {(r["time"], r["position"]): r for r in meta if r["kind"] == "evt"}
        self.events = [events[k] for k in sorted(events)]
        lnk = small.filter(pc.equal(kinds, "lnk"))
        for table, payload in zip(lnk.column("table").to_pylist(), lnk.column("payload").to_pylist()):
            self.links.setdefault(table, set()).update(
                map(tuple, np.frombuffer(payload, "<i4").reshape(-1, 2).tolist()))

    def _content_hashes(self, wanted: list[int], segs: list[str]):
        """The content hashes of the updates whose identity occurs twice (`decode.content_hashes`):
        a Spark job only when segments overlap."""
        from tidemark.consolidate import transform as T

        rows = [(r["seg"], r["table"], r["offset"], r["size"]) for r in self.shapes if r["seg"] in set(segs)]
        df = self.spark.createDataFrame(rows, "seg string, table string, offset long, size long")
        ddl = "kind string, seg string, table string, time long, position int, rhash long, count long"
        work = self.work
        return df.mapInArrow(lambda it: content_hashes(it, wanted, work), T.schema(self.spark, ddl)).toArrow()

    def close(self) -> None:
        """The run's decoded parts are deleted (committed or not, they are never read again)."""
        if self.shapes:
            self.work.discard()

    def tables(self, loadable: list[PendingSnapshot]) -> list[str]:
        names = {r["table"] for r in self.shapes} | {e["table"] for e in self.events}
        for s in loadable:
            names |= set(s.tables)
        return sorted(names)

    def loaded_ok(self, table: str, snap: PendingSnapshot) -> bool:
        return self.loaded.get((table, snap.snapshot_id), False)


def _check_unstorable(bad: list, tables: list[str], snaps: list["PendingSnapshot"], frontier: int) -> None:
    """Stop at the first landed value the lake type cannot hold (`decode` put null in its place) that
    this batch would merge: one of ``tables`` below ``frontier`` that no pending snapshot of its
    table at a later LSN supersedes (the remedy: a resend of the table, after correcting the value).
    Until such a snapshot loads, its row reads null in that column."""
    from tidemark.errors import UnstorableValue

    for time, table, info in bad:
        if table not in tables or time >= frontier:
            continue
        if any(table in s.tables and s.lsn > time for s in snaps):
            continue
        facts = json.loads(info)
        if facts.get("fallback") == "text":     # an array value its lists cannot hold: the column goes to text
            why = (f"table {table} column {facts['column']}: the value at LSN {facts['lsn']} does not fit the lake "
                   f"type {facts['lake_type']} ({facts['why']}); the column is held as PostgreSQL's text from the "
                   "table's re-snapshot on, the rest of the table as it is")
            log.warning("%s", why)
            raise TableNeedsSnapshot(f"{why}; the lake table is replaced by a re-snapshot of that table alone while "
                                     "the stream runs", table=table)
        raise UnstorableValue(facts.get("segment", "?"), facts)


def unstorable_value(exc: BaseException) -> dict | None:
    """The facts of a `tidemark.errors.UnstorableValue` behind ``exc`` (raised here, or in a Spark
    executor: then only its text reaches the driver), or None."""
    from tidemark.errors import UnstorableValue, facts_behind

    return facts_behind(exc, UnstorableValue)
