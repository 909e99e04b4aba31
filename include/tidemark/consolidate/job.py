"""`consolidate_stream`: segments between the frontier and the newest complete upper → Delta tables.

One batch (`run`) passes its stages once each, in order (`plan` → `decoded` → `prepare` → `batch` →
`committed`, then `advance`), each a module taking the previous stage's frozen result and returning
its own; docs/internals/batch.md tells them. A failure anywhere is told by `failure.Where`.
"""

from __future__ import annotations

import logging
import time as _time
from dataclasses import dataclass, field
from typing import Any

from tidemark.capture.source import advance_slot
from tidemark.config import StreamConfig
from tidemark.consolidate import (batch as _batch, committed as _committed, decoded as _decoded, plan as _plan,
                                  prepare as _prepare, writecost as _writecost)
from tidemark.consolidate.changelog import advance_feeds
from tidemark.consolidate.failure import ConsolidateFailed, Where, check_unstorable
from tidemark.consolidate.history import keep_histories
from tidemark.control import open_control
from tidemark.errors import ConsolidateError, StreamBusy, TidemarkError
from tidemark.lake import layout, storage_options
from tidemark.lsn import format_lsn
from tidemark.sparkconf import propagate_s3_env, spark_session

__all__ = ["ConsolidateError", "ConsolidateFailed", "ConsolidateResult", "advance", "advance_if_idle",
           "consolidate_stream", "follow_stream", "run", "spark_session"]

log = logging.getLogger(__name__)


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
    # table -> what its new version did: rows inserted, updated, deleted (and ``snapshot_rows``)
    changes: dict[str, dict[str, int]] = field(default_factory=dict)

    def table_events(self) -> dict[str, dict]:
        """{table: the stream, frontier (LSN text), version and `changes` of its new Delta version} for each
        table this run committed: plain JSON, the extra of the table's Asset event under Airflow."""
        return {table: {"stream": self.stream, "table": table,
                        "frontier": format_lsn(self.frontiers.get(table, self.frontier_after)),
                        "version": version, **self.changes.get(table, {})}
                for table, version in sorted(self.versions.items())}

    def then(self, nxt: "ConsolidateResult") -> "ConsolidateResult":
        """This run's result followed by the next slice's."""
        def summed(a: dict, b: dict) -> dict:
            return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}

        changes = {t: summed(self.changes.get(t, {}), nxt.changes.get(t, {}))
                   for t in {**self.changes, **nxt.changes}}
        return ConsolidateResult(
            stream=self.stream, frontier_before=self.frontier_before, frontier_after=nxt.frontier_after,
            rows_changed=summed(self.rows_changed, nxt.rows_changed), versions={**self.versions, **nxt.versions},
            skipped=False, segments=self.segments + nxt.segments, unmet=nxt.unmet,
            incident=nxt.incident or self.incident, snapshots_loaded=self.snapshots_loaded + nxt.snapshots_loaded,
            slot_confirmed=nxt.slot_confirmed or self.slot_confirmed, spark=self.spark or nxt.spark,
            frontiers={**self.frontiers, **nxt.frontiers}, more=nxt.more,
            slices=self.slices + nxt.slices, waiting=nxt.waiting, history={**self.history, **nxt.history},
            changes=changes)


def consolidate_stream(cfg: StreamConfig, *, spark=None, target_rows: int | None = None,
                       without_spark: bool = False) -> ConsolidateResult | None:
    """Consolidate the stream's complete segments into its lake tables, slice by slice (`run`: at most
    ``consolidate.max_batch_bytes`` and ``max_batch_records`` each, committed and advanced before the
    next). Only progress landed (`plan.progress_only`): no SparkSession is created. ``without_spark``:
    return None instead of starting Spark when a slice needs it.

    Any failure is recorded as a ``consolidate_failed`` incident (`failure.Where.failed`) and raised
    as one `ConsolidateError` line; the next successful slice resolves the stream's open ones."""
    total: ConsolidateResult | None = None
    while True:
        where = Where(cfg)
        try:
            try:
                result = run(cfg, spark=spark, target_rows=target_rows, where=where, without_spark=without_spark)
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


def follow_stream(cfg: StreamConfig, *, spark=None, seconds: float | None = None) -> ConsolidateResult | None:
    """`consolidate_stream`, then the next batch at once while records have landed above the new
    frontier meanwhile, for up to ``seconds`` (``consolidate.follow_seconds``) from the start, on the
    same Spark session. Ends when nothing new landed, the time is up, or a batch moved nothing."""
    deadline = _time.monotonic() + (cfg.consolidate.follow_seconds if seconds is None else seconds)
    total = consolidate_stream(cfg, spark=spark)
    while total is not None and _time.monotonic() < deadline and total.frontier_after is not None:
        with open_control(cfg) as ctl:
            if not ctl.records_above(cfg.stream, total.frontier_after):
                break
        nxt = consolidate_stream(cfg, spark=spark)
        if nxt is None or nxt.frontier_after == nxt.frontier_before:
            break
        total = total.then(nxt)
    return total


def advance_if_idle(cfg: StreamConfig) -> ConsolidateResult | None:
    """`consolidate_stream` without Spark: None when a batch needs Spark."""
    return consolidate_stream(cfg, without_spark=True)


def run(cfg: StreamConfig, *, spark, target_rows: int | None, where: Where,
        without_spark: bool = False) -> ConsolidateResult | None:
    """One batch of the stream, under its consolidate lease; None when Spark is needed and
    ``without_spark`` is set."""
    where.step = "opening the control database"
    # the run's connection: `consolidate_stream` closes it after resolving the stream's incidents on it
    ctl = where.ctl = open_control(cfg)
    with ctl.stream_lock(cfg.stream, "consolidate") as lease:
        where.step = "planning"
        plan = _plan.plan_batch(ctl, cfg)
        result = ConsolidateResult(stream=cfg.stream, frontier_before=plan.frontier_before,
                                   frontier_after=plan.frontier_before)
        if plan.start is None or plan.held:
            result.skipped, result.held, result.waiting = True, plan.held, dict(plan.waiting)
            return result
        if plan.idle:
            return _advance_idle(ctl, lease, cfg, where, result, plan,
                                 start_spark=None if without_spark else (lambda: spark or spark_session(cfg=cfg)))
        if without_spark:
            return None
        t0 = _time.perf_counter()
        spark = spark or spark_session(cfg=cfg)
        propagate_s3_env(spark)
        _plan.phase("Spark session", _time.perf_counter() - t0)
        return _consolidate(ctl, lease, cfg, spark, where, result, plan, target_rows or layout.TARGET_ROWS)


def _consolidate(ctl, lease, cfg: StreamConfig, spark, where: Where, result: ConsolidateResult,
                 plan: _plan.BatchPlan, target_rows: int) -> ConsolidateResult:
    """The batch's Spark path: the stages after `plan`."""
    where.plan = plan
    where.step = "decoding the segments (Spark job)"
    t0 = _time.perf_counter()
    dec = where.decoded = _decoded.decode(cfg, spark, plan, target_rows)
    _plan.phase("decode segments (Spark job)", _time.perf_counter() - t0)
    where.step = "planning"
    try:
        scope = _decoded.scope(ctl, cfg, plan, dec)
        frontier = scope.frontier
        result.unmet, result.incident, result.waiting = list(scope.unmet), scope.incident, dict(scope.waiting)
        if scope.stays:
            result.skipped = True
            _catch_up_histories(cfg, spark, result)
            return result
        where.scope = scope
        check_unstorable(dec.bad, scope.tables, plan.snapshots, frontier)
        where.step = "consolidating the batch's tables in one Spark job"
        lease.confirm(f"commit {len(scope.tables)} tables to the lake at {format_lsn(frontier)}")
        done = where.committed = _committed.commit_tables(_batch.merge_tables(_prepare.prepare_tables(dec, scope)))
        for table, (changed, version) in done.done.items():
            if version is not None:
                result.versions[table] = version
                result.rows_changed[table] = changed
                result.changes[table] = dict(done.changes[table])
        t0 = _time.perf_counter()
        # idle tables' feeds too (a table the batch path committed has its changelog at the frontier)
        advance_feeds(cfg, frontier, options=dec.options, frontiers=plan.frontiers, committed=done.merged,
                      opened={t: dt for t, dt in dec.lake_tables.items() if t not in scope.tables})
        _plan.phase("advance idle feeds", _time.perf_counter() - t0)
        if cfg.history:
            # after the commits, each history the merge job did not keep catches up from its changelog
            where.step = "keeping the history tables (Spark job)"
            rest = [t.qualified for t in cfg.history if t.qualified not in done.history]
            result.history = {**done.history,
                              **(keep_histories(cfg, spark, options=dec.options, tables=rest) if rest else {})}
    finally:
        dec.close()
    # never raises
    _writecost.record_batch(ctl, cfg, dec, plan.start, frontier, list(scope.tables), frontiers=plan.frontiers)
    t0 = _time.perf_counter()
    advance(ctl, lease, cfg, where, result, plan, frontier, loaded=done.snapshots_loaded if scope.loadable else None)
    _plan.phase("frontier and slot (control db)", _time.perf_counter() - t0)
    return result


def advance(ctl, lease, cfg: StreamConfig, where: Where, result: ConsolidateResult, plan: _plan.BatchPlan,
            frontier: int, loaded=None) -> ConsolidateResult:
    """Move the stream to ``frontier`` once its lake tables are there: the frontier and checkpoint (an
    external feed's tables each to their own), the snapshots ``loaded`` marked, then the slot — never
    the reverse, so nothing the lake lacks is released. Each step confirms the lease first."""
    result.segments = [s.seq for s in plan.cov.segments if s.upper <= frontier]
    where.step = "advancing the frontier in the control database"
    lease.confirm(f"advance the frontier to {format_lsn(frontier)}")
    if plan.frontiers:
        for table, f in sorted(plan.frontiers.items()):
            ctl.advance_table_positions(cfg.stream, table, frontier=f)
        result.frontiers = dict(plan.frontiers)
    ctl.advance_frontier(cfg.stream, frontier, committed_segment=max(result.segments) if result.segments else None)
    if loaded is not None:
        ctl.mark_snapshots_loaded(cfg.stream, list(loaded))
        result.snapshots_loaded = list(loaded)
    result.frontier_after = frontier
    result.more = plan.cov.more and frontier == plan.cov.end
    if cfg.source.is_feed:     # an external feed has no slot
        return result
    where.step = "advancing the slot"
    lease.confirm(f"advance slot {cfg.source.slot} to {format_lsn(frontier)}")
    try:
        result.slot_confirmed = advance_slot(cfg, frontier)
    except TidemarkError as exc:  # an active drain owns the slot; its own feedback confirms later
        log.warning("stream %s: slot not advanced: %s", cfg.stream, exc)
    return result


def _advance_idle(ctl, lease, cfg: StreamConfig, where: Where, result: ConsolidateResult, plan: _plan.BatchPlan,
                  start_spark=None) -> ConsolidateResult:
    """Only progress since the frontier: every table's feed and then the stream (`advance`) move to the
    run's end without Spark (an external feed's tables each to their own frontier)."""
    frontier = plan.frontier([])
    result.spark = False
    if plan.stays(ctl, cfg, frontier):
        result.skipped = True
        _catch_up_histories(cfg, None, result, start_spark)
        return result
    advance_feeds(cfg, frontier, options=storage_options(cfg), frontiers=plan.frontiers)
    _catch_up_histories(cfg, None, result, start_spark)
    log.info("stream %s: only progress landed; frontier %s -> %s without Spark", cfg.stream,
             format_lsn(plan.frontier_before), format_lsn(frontier))
    return advance(ctl, lease, cfg, where, result, plan, frontier)


def _catch_up_histories(cfg: StreamConfig, spark, result: ConsolidateResult, start_spark=None) -> None:
    """Bring the history tables to their changelogs' frontiers (`history.keep_histories`) when no
    batch does (``start_spark``: how to start Spark if a history has rows to take; None: it waits)."""
    if not cfg.history:
        return
    result.history = keep_histories(cfg, spark, options=storage_options(cfg), start_spark=start_spark)
