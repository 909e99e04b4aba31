"""Stage 1 of a batch (`BatchPlan`, `plan_batch`): which segments to read, and how far the frontier may move.

The frontier may move to the *newest complete upper*: the end of the contiguous run of landed
segments that starts at the current frontier, but not past the first time whose progress count is
not met by the distinct records found (duplicates are identical records with the same
``(time, position)`` and count once). A time that stays unmet longer than
``consolidate.count_timeout_seconds`` becomes a ``counts_unmet`` incident.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Mapping

import pyarrow as pa
import pyarrow.compute as pc

from tidemark.config import StreamConfig
from tidemark.consolidate.columns import replaces
from tidemark.control import Control, Segment
from tidemark.errors import TidemarkError
from tidemark.lake import open_delta, storage_options, table_uri
from tidemark.landing.segments import read_segment_at
from tidemark.lsn import format_lsn


# seconds per phase of the last run (the benchmarks print them; every step adds its own)
PHASES: dict[str, float] = {}


def phase(name: str, seconds: float) -> None:
    PHASES[name] = PHASES.get(name, 0.0) + seconds


class CompletenessError(TidemarkError):
    """Segments contradict each other (different records with one identity, or different counts)."""


@dataclass(frozen=True)
class Coverage:
    """The contiguous run of segments from ``start``: the segments to read and where the run ends."""

    start: int
    end: int
    segments: list[Segment] = field(default_factory=list)
    hole: tuple[int, int] | None = None   # (from, to) of the first gap after the run, if any
    more: bool = False                    # the run goes on past ``end``: a slice (`sliced`) of it


def coverage(segments: list[Segment], start: int) -> Coverage:
    """The segments that tile ``[start, end)`` contiguously (duplicates and overlaps allowed)."""
    cur = start
    chosen: list[Segment] = []
    hole = None
    for seg in sorted(segments, key=lambda s: (s.lower, s.upper, s.seq)):
        if seg.upper <= start:
            continue
        if seg.lower > cur:
            hole = (cur, seg.lower)
            break
        chosen.append(seg)
        cur = max(cur, seg.upper)
    return Coverage(start=start, end=cur, segments=chosen, hole=hole)


def sliced(cov: Coverage, max_bytes: int, max_records: int | None = None, reach: int | None = None) -> Coverage:
    """The first slice of ``cov``: its segments in order while their bytes stay within ``max_bytes``
    and their records within ``max_records``, at least one segment (a transaction is never split),
    ending at the last one's upper; ``more`` when the run goes on. ``reach``: an LSN the slice reaches
    whatever its size (a re-snapshot a failed batch asked for: `resnapshots_asked`)."""
    total, records, chosen, end = 0, 0, [], cov.start
    for seg in cov.segments:
        if chosen and seg.lower >= end and end >= (reach or 0) and (total + (seg.byte_size or 0) > max_bytes or (
                max_records is not None and records + (seg.record_count or 0) > max_records)):
            break
        chosen.append(seg)
        total += seg.byte_size or 0
        records += seg.record_count or 0
        end = max(end, seg.upper)
    if len(chosen) == len(cov.segments):
        return cov
    return Coverage(start=cov.start, end=end, segments=chosen, hole=None, more=True)


@dataclass(frozen=True)
class Unmet:
    time: int
    expected: int
    seen: int


def new_frontier(cov: Coverage, unmet: list[Unmet]) -> int:
    """The newest complete upper: the end of the run, held below the first unmet time."""
    end = cov.end
    if unmet:
        end = min(end, unmet[0].time)
    return max(end, cov.start)


def report_unmet(ctl: Control, stream: str, unmet: list[Unmet], timeout_seconds: int) -> int | None:
    """Open a ``counts_unmet`` incident for the first unmet time if it has waited past the timeout."""
    if not unmet:
        return None
    first = unmet[0]
    since = ctl.first_landed_at(stream, first.time)
    if since is None or (dt.datetime.now(dt.timezone.utc) - since).total_seconds() < timeout_seconds:
        return None
    return ctl.open_incident(stream, "counts_unmet", {"time": first.time, "expected": first.expected,
                                                     "seen": first.seen})


def completeness_rows(rows, start: int, end: int, *, limit: int = 100, counted=None) -> list[Unmet]:
    """The times in ``[start, end)`` whose counts are not met, earliest first, from the decoded
    ``rec`` and ``cnt`` rows (a `pyarrow.Table` with kind, seg, time, position, rhash, count) and
    ``counted`` (a `pyarrow.Table` of ``time``, ``seen``: times whose distinct records were counted
    without their rows, `identities.identities`; none of them has ``rec`` rows).

    Raises `CompletenessError` when two different records share a ``(time, position)``, when
    segments give different counts for one time, or when there are more distinct records than
    counted."""
    kind, time = rows.column("kind"), pc.fill_null(rows.column("time"), 0)
    window = pc.and_(pc.greater_equal(time, start), pc.less(time, end))
    # each identity (time, position) and its distinct hashes (a null one is no content to compare)
    idents = pa.table({"time": time, "position": pc.fill_null(rows.column("position"), 0),
                       "rhash": rows.column("rhash")}).filter(pc.and_(pc.equal(kind, "rec"), window)).group_by(
        ["time", "position"]).aggregate([("rhash", "count_distinct")])
    # per time: its distinct identities, the most hashes one of them has
    seen = idents.group_by("time").aggregate([("position", "count"), ("rhash_count_distinct", "max")]).rename_columns(
        ["time", "seen", "hashes"])
    if counted is not None and counted.num_rows:
        c_time = pc.cast(counted.column("time"), pa.int64())
        c_in = pc.and_(pc.greater_equal(c_time, start), pc.less(c_time, end))
        c_time, c_seen = c_time.filter(c_in), pc.cast(counted.column("seen"), pa.int64()).filter(c_in)
        if pc.any(pc.is_in(c_time, value_set=seen.column("time"))).as_py():
            raise ValueError("completeness_rows: a counted time also has rec rows")
        seen = pa.concat_tables([seen, pa.table({"time": c_time, "seen": c_seen,      # each identity once: one hash
                                                 "hashes": pc.cast(pc.greater(c_seen, 0), pa.int64())})])
    expected = pa.table({"time": time, "count": pc.fill_null(rows.column("count"), 0)}).filter(
        pc.and_(pc.equal(kind, "cnt"), window)).group_by("time").aggregate([("count", "min"), ("count", "max")])
    # every time of either, with its seen / expected figures (a time without counts: lo, hi None)
    both = seen.join(expected.rename_columns(["time", "lo", "hi"]), "time", join_type="full outer").sort_by("time")
    has_e = both.column("lo").is_valid()
    n_seen, hashes, lo, hi = (pc.fill_null(both.column(c), 0) for c in ("seen", "hashes", "lo", "hi"))
    bad = pc.or_(pc.or_(pc.greater(hashes, 1), pc.and_(has_e, pc.not_equal(lo, hi))),
                 pc.or_(pc.greater(n_seen, hi), pc.and_(has_e, pc.less(n_seen, lo))))
    unmet: list[Unmet] = []
    for r in both.filter(bad).slice(0, limit).to_pylist():
        t = r["time"]
        if (r["hashes"] or 0) > 1:
            multi = idents.filter(pc.and_(pc.equal(idents.column("time"), t),
                                          pc.greater(idents.column("rhash_count_distinct"), 1))).column("position")
            recs = rows.filter(pc.and_(pc.equal(kind, "rec"), pc.equal(rows.column("time"), t)))
            at = recs.filter(pc.is_in(recs.column("position"), value_set=multi))
            pos, segs = pc.min(multi).as_py(), sorted(set(at.column("seg").to_pylist()))
            raise CompletenessError(f"different records share the identity (time {t}, position {pos}) in segments "
                                    f"{segs}; bad input, not a duplicate")
        if r["lo"] != r["hi"] or (r["seen"] or 0) > (r["hi"] or 0):
            cnt = rows.filter(pc.and_(pc.equal(kind, "cnt"), pc.equal(rows.column("time"), t)))
            segs = sorted(set(cnt.column("seg").to_pylist()))
            raise CompletenessError(f"time {t}: segments {segs} give counts {r['lo']}..{r['hi']} but "
                                    f"{r['seen']} distinct records were found")
        unmet.append(Unmet(time=t, expected=r["lo"], seen=r["seen"] or 0))
    return unmet


# -- the stage: one batch's plan ----------------------------------------------------------------------

@dataclass(frozen=True)
class PendingSnapshot:
    snapshot_id: str
    lsn: int
    mode: str
    tables: dict


@dataclass(frozen=True)
class BatchPlan:
    """Stage 1's result: where the batch starts (None: nothing consolidated and no snapshot yet), the
    slice of landed segments it reads, the frontier's candidates (the slice's end; an external
    feed's tables: each one's own, ``frontiers``) and the pending snapshots."""

    frontier_before: int | None = None
    start: int | None = None
    cov: Coverage | None = None
    snapshots: tuple[PendingSnapshot, ...] = ()
    frontiers: Mapping[str, int] | None = None
    held: bool = False         # a re-snapshot a failure asked for has not landed: nothing moves (``waiting``)
    waiting: Mapping[str, str] = field(default_factory=dict)
    idle: bool = False         # only progress landed, no snapshot to load: no Spark (`progress_only`)

    def frontier(self, unmet: list[Unmet]) -> int:
        """The new frontier: the newest complete upper (`new_frontier`), an external feed's: the least
        of its tables' own."""
        return new_frontier(self.cov, unmet) if self.frontiers is None else min(self.frontiers.values())

    def stays(self, ctl, cfg: StreamConfig, frontier: int, loadable=()) -> bool:
        """Whether the batch moves nothing: its frontier is its start, no snapshot loads, no feed table moves."""
        return (frontier == self.start and not loadable and self.frontier_before is not None
                and not feed_moves(ctl, cfg, self))


def plan_batch(ctl, cfg: StreamConfig) -> BatchPlan:
    """Plan the stream's next batch from the control database (no Spark): its start (the frontier, a
    superseding snapshot's LSN), its slice (`sliced`), whether it is held or idle."""
    state = ctl.stream(cfg.stream)
    snaps = [PendingSnapshot(*r) for r in ctl.complete_snapshots(cfg.stream)]     # complete, not loaded
    start = state.frontier if state.frontier is not None else state.consistent_lsn
    if start is None and snaps:
        start = min(s.lsn for s in snaps)
    captured = {t.qualified for t in cfg.source.tables}
    superseding = [s.lsn for s in snaps if s.mode in ("initial", "resend") and captured <= set(s.tables)
                   and start is not None and s.lsn > start]
    if superseding:
        # a snapshot of every captured table supersedes all changes below its lsn, lost ones too
        start = max(superseding)
    plan = BatchPlan(state.frontier, start, snapshots=tuple(snaps))
    if start is None:
        return plan
    segs = ctl.segments(cfg.stream, status="landed", lower_from=start)
    reach = resnapshots_asked(ctl, cfg, snaps, start)
    run = coverage(segs, start)
    if reach and run.end < max(reach.values()):
        # a table's change only its re-snapshot corrects is in the landed segments, the re-snapshot's
        # LSN is not yet: any batch would fail the same way; a drain lands the rest
        return BatchPlan(state.frontier, start, run, tuple(snaps), held=True, waiting={
            t: f"its change needs its re-snapshot at {format_lsn(lsn)}, merged once the segments up to it land "
               f"(landed up to {format_lsn(run.end)}): it goes on after a drain" for t, lsn in reach.items()})
    cov = sliced(run, cfg.consolidate.max_batch_bytes, cfg.consolidate.max_batch_records,
                 reach=max(reach.values(), default=None))
    return BatchPlan(state.frontier, start, cov, tuple(snaps),
                     frontiers=feed_frontiers(ctl, cfg, cov, start) if cfg.source.is_feed else None,
                     idle=not any(s.lsn <= cov.end for s in snaps) and progress_only(cfg, cov.segments))


# a progress-only segment is a few hundred bytes; anything larger goes to Spark without being read
MAX_IDLE_BYTES = 64 * 1024


def progress_only(cfg: StreamConfig, segments) -> bool:
    """Whether ``segments`` (a coverage run) hold no record, no event and no promised count: an idle
    batch, advanced with the control database alone. Decided without Spark from the manifest and the
    (tiny) files; anything else, or a file that cannot be read, goes to the Spark path."""
    if any(seg.record_count or (seg.byte_size or 0) > MAX_IDLE_BYTES for seg in segments):
        return False
    for seg in segments:
        try:
            content = read_segment_at(seg.uri, cfg.landing.endpoint_url)
        except (OSError, TidemarkError):
            return False        # the Spark path reads it again and names the problem
        if content.updates or content.events or any(c for c in content.counts.values()):
            return False
    return True


def resnapshots_asked(ctl, cfg: StreamConfig, snaps: list[PendingSnapshot], start: int) -> dict[str, int]:
    """{table: the LSN of its newest pending re-snapshot (mode table) above ``start``} for the tables
    an open consolidation failure asked to re-snapshot (``resnapshot`` in its detail), whose change
    is merged only together with it. A re-snapshot that replaces its table (`columns.replaces`) is
    not one: that table waits for it (`waiting`)."""
    asked = {t for i in ctl.incidents(cfg.stream) if i["kind"] == "consolidate_failed"
             and isinstance(i["detail"], dict) for t in (i["detail"].get("resnapshot") or ())}
    out: dict[str, int] = {}
    for s in snaps:
        if s.mode == "table" and s.lsn > start:
            for t in asked & set(s.tables):
                if not replaces(s, t, open_delta(table_uri(cfg, t), storage_options(cfg)), cfg):
                    out[t] = max(out.get(t, 0), s.lsn)
    return out


def waiting(ctl, cfg: StreamConfig, snaps, frontier: int) -> dict[str, str]:
    """{table: why} for the tables whose changes the lake does not take in this batch: added to the
    stream and waiting for their snapshot, snapshotted above ``frontier`` (a re-snapshot of mode
    table only when it replaces the table, `columns.replaces`), or removed from the stream (frozen)."""
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
            if s.mode != "table" or replaces(s, table, open_delta(table_uri(cfg, table), storage_options(cfg)), cfg):
                out.setdefault(table, f"its snapshot {s.snapshot_id} at {format_lsn(s.lsn)} is loaded once the "
                                      "frontier reaches it")
    return out


def feed_frontiers(ctl, cfg: StreamConfig, cov: Coverage, start: int) -> dict[str, int]:
    """{table: how far it may move now} for an external feed: its landed upper within the run (no
    per-table positions yet: the run's end)."""
    positions = ctl.table_frontiers(cfg.stream)
    out = {}
    for ref in cfg.source.tables:
        at = positions.get(ref.qualified) or {}
        landed = at.get("landed_upper")
        if landed is None:
            landed = cov.end if not positions else start
        out[ref.qualified] = max(start, at.get("frontier") or start, min(landed, cov.end))
    return out


def feed_moves(ctl, cfg: StreamConfig, plan: BatchPlan) -> bool:
    """Whether some feed table may move past the frontier it has recorded."""
    if not plan.frontiers:
        return False
    positions = ctl.table_frontiers(cfg.stream)
    return any(f > ((positions.get(t) or {}).get("frontier") or plan.start) for t, f in plan.frontiers.items())
