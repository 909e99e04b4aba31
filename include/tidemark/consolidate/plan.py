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

from tidemark.config import StreamConfig
from tidemark.consolidate.columns import replaces
from tidemark.control import Control, Segment
from tidemark.errors import TidemarkError
from tidemark.lake import open_delta, storage_options, table_uri
from tidemark.landing.segments import read_segment
from tidemark.landing.store import read_uri
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
    without their rows, `decode.identities`; none of them has ``rec`` rows).

    Raises `CompletenessError` when two different records share a ``(time, position)``, when
    segments give different counts for one time, or when there are more distinct records than
    counted."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = rows.column("kind")
    times = pc.fill_null(rows.column("time"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    window = (times >= start) & (times < end)
    is_rec = pc.equal(kind, "rec").to_numpy(zero_copy_only=False) & window
    is_cnt = pc.equal(kind, "cnt").to_numpy(zero_copy_only=False) & window
    # distinct records: (time, position, rhash), a null rhash a value of its own
    rt = times[is_rec]
    rp = pc.fill_null(rows.column("position"), 0).to_numpy(zero_copy_only=False).astype(np.int64)[is_rec]
    rh_col = rows.column("rhash")
    rh = pc.fill_null(rh_col, 0).to_numpy(zero_copy_only=False).astype(np.int64)[is_rec]
    rnull = (rh_col.is_null().to_numpy(zero_copy_only=False) if rh_col.null_count
             else np.zeros(len(rows), bool))[is_rec]
    order = np.lexsort((rh, rnull, rp, rt))
    rt, rp, rh, rnull = rt[order], rp[order], rh[order], rnull[order]
    new_ident = np.r_[True, (rt[1:] != rt[:-1]) | (rp[1:] != rp[:-1])] if len(rt) else np.zeros(0, bool)
    new_rec = new_ident | np.r_[True, (rh[1:] != rh[:-1]) | (rnull[1:] != rnull[:-1])] if len(rt) else new_ident
    ident_at = np.nonzero(new_ident)[0]
    # distinct non-null hashes per identity (a null one is no content to compare)
    per_ident = (np.add.reduceat((new_rec & ~rnull).astype(np.int64), ident_at) if len(ident_at)
                 else np.zeros(0, np.int64))
    it, ip = rt[ident_at], rp[ident_at]                       # each identity once, by time
    seen_times, seen_at = np.unique(it, return_index=True)
    seen_n = np.diff(np.r_[seen_at, len(it)])                 # distinct identities per time
    seen_max = np.maximum.reduceat(per_ident, seen_at) if len(seen_at) else np.zeros(0, np.int64)
    if counted is not None and counted.num_rows:
        c_t = counted.column("time").to_numpy(zero_copy_only=False).astype(np.int64)
        c_in = (c_t >= start) & (c_t < end)
        c_t = c_t[c_in]
        if np.isin(c_t, seen_times).any():
            raise ValueError("completeness_rows: a counted time also has rec rows")
        c_n = counted.column("seen").to_numpy(zero_copy_only=False).astype(np.int64)[c_in]
        c_order = np.argsort(np.r_[seen_times, c_t], kind="stable")
        seen_times = np.r_[seen_times, c_t][c_order]
        seen_n = np.r_[seen_n, c_n][c_order]
        seen_max = np.r_[seen_max, (c_n > 0).astype(np.int64)][c_order]   # each identity once: one hash
    ct = times[is_cnt]
    cc = pc.fill_null(rows.column("count"), 0).to_numpy(zero_copy_only=False).astype(np.int64)[is_cnt]
    corder = np.lexsort((cc, ct))
    ct, cc = ct[corder], cc[corder]
    exp_times, exp_at = np.unique(ct, return_index=True)
    exp_lo = cc[exp_at]
    exp_hi = cc[np.r_[exp_at[1:], len(ct)] - 1] if len(exp_at) else np.zeros(0, np.int64)
    # every time of either, with its seen / expected figures (a time without counts: lo, hi None)
    all_times = np.union1d(seen_times, exp_times)
    s_idx = np.searchsorted(seen_times, all_times)
    has_s = (s_idx < len(seen_times)) & (seen_times[np.minimum(s_idx, len(seen_times) - 1)] == all_times) \
        if len(seen_times) else np.zeros(len(all_times), bool)
    e_idx = np.searchsorted(exp_times, all_times)
    has_e = (e_idx < len(exp_times)) & (exp_times[np.minimum(e_idx, len(exp_times) - 1)] == all_times) \
        if len(exp_times) else np.zeros(len(all_times), bool)
    n_seen = np.where(has_s, seen_n[np.minimum(s_idx, len(seen_times) - 1)] if len(seen_times) else 0, 0)
    n_max = np.where(has_s, seen_max[np.minimum(s_idx, len(seen_times) - 1)] if len(seen_times) else 0, 0)
    lo = np.where(has_e, exp_lo[np.minimum(e_idx, len(exp_times) - 1)] if len(exp_times) else 0, 0)
    hi = np.where(has_e, exp_hi[np.minimum(e_idx, len(exp_times) - 1)] if len(exp_times) else 0, 0)
    bad = (n_max > 1) | (has_e & (lo != hi)) | (n_seen > hi) | (has_e & (n_seen < lo))
    unmet: list[Unmet] = []
    for k in np.nonzero(bad)[0][:limit].tolist():
        t = int(all_times[k])
        if n_max[k] > 1:
            at_t = it == t
            multi = np.nonzero(at_t)[0][per_ident[at_t] > 1]
            pos = int(ip[multi].min())
            positions = pa.array(ip[multi].astype(np.int32))
            recs = rows.filter(pc.and_(pc.equal(kind, "rec"), pc.equal(rows.column("time"), t)))
            at = recs.filter(pc.is_in(recs.column("position"), value_set=positions))
            raise CompletenessError(f"different records share the identity (time {t}, position {pos}) in segments "
                                    f"{sorted(set(at.column('seg').to_pylist()))}; bad input, not a duplicate")
        lo_t, hi_t = (int(lo[k]), int(hi[k])) if has_e[k] else (None, None)
        if lo_t != hi_t or n_seen[k] > (hi_t or 0):
            cnt = rows.filter(pc.and_(pc.equal(kind, "cnt"), pc.equal(rows.column("time"), t)))
            segs = sorted(set(cnt.column("seg").to_pylist()))
            raise CompletenessError(f"time {t}: segments {segs} give counts {lo_t}..{hi_t} but "
                                    f"{int(n_seen[k]) if has_s[k] else None} distinct records were found")
        unmet.append(Unmet(time=t, expected=lo_t, seen=int(n_seen[k])))
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

    stream: str
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
    plan = BatchPlan(cfg.stream, state.frontier, start, snapshots=tuple(snaps))
    if start is None:
        return plan
    segs = ctl.segments(cfg.stream, status="landed", lower_from=start)
    reach = resnapshots_asked(ctl, cfg, snaps, start)
    run = coverage(segs, start)
    if reach and run.end < max(reach.values()):
        # a table's change only its re-snapshot corrects is in the landed segments, the re-snapshot's
        # LSN is not yet: any batch would fail the same way; a drain lands the rest
        return BatchPlan(cfg.stream, state.frontier, start, run, tuple(snaps), held=True, waiting={
            t: f"its change needs its re-snapshot at {format_lsn(lsn)}, merged once the segments up to it land "
               f"(landed up to {format_lsn(run.end)}): it goes on after a drain" for t, lsn in reach.items()})
    cov = sliced(run, cfg.consolidate.max_batch_bytes, cfg.consolidate.max_batch_records,
                 reach=max(reach.values(), default=None))
    return BatchPlan(cfg.stream, state.frontier, start, cov, tuple(snaps),
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
            content = read_segment(read_uri(seg.uri, endpoint_url=cfg.landing.endpoint_url),
                                   seg.uri.rsplit("/", 1)[-1])
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
                if not replaces(s, t, open_delta(table_uri(cfg, t), storage_options(cfg))):
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
            if s.mode != "table" or replaces(s, table, open_delta(table_uri(cfg, table), storage_options(cfg))):
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
