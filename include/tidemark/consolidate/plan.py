"""Planning a consolidation: which segments to read, and how far the frontier may move.

The frontier may move to the *newest complete upper*: the end of the contiguous run of landed
segments that starts at the current frontier, but not past the first time whose progress count is
not met by the distinct records found (duplicates are identical records with the same
``(time, position)`` and count once). A time that stays unmet longer than
``consolidate.count_timeout_seconds`` becomes a ``counts_unmet`` incident.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from tidemark.control import Control, Segment
from tidemark.errors import TidemarkError


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
    and their records within ``max_records`` (segments are compressed: a few MB may decode to
    millions of rows), at least one segment whatever its size (a transaction is never split),
    ending at the last one's upper. Segments that overlap the slice's end (duplicates, overlaps)
    are read again by the next slice, which starts at this one's frontier. ``more``: the run goes
    on after it. ``reach``: an LSN the slice reaches whatever its size — a re-snapshot a failed
    batch asked for, whose table's change is merged only together with it (`job._resnapshots_asked`):
    a slice ending before it would fail again, for good."""
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


def report_unmet(ctl: Control, stream: str, unmet: list[Unmet], timeout_seconds: int,
                 now: dt.datetime | None = None) -> int | None:
    """Open a ``counts_unmet`` incident for the first unmet time if it has waited past the timeout."""
    if not unmet:
        return None
    first = unmet[0]
    since = ctl.first_landed_at(stream, first.time)
    now = now or dt.datetime.now(dt.timezone.utc)
    if since is None or (now - since).total_seconds() < timeout_seconds:
        return None
    return ctl.open_incident(stream, "counts_unmet", {"time": first.time, "expected": first.expected,
                                                     "seen": first.seen})


def completeness_rows(rows, start: int, end: int, *, limit: int = 100, counted=None) -> list[Unmet]:
    """The times in ``[start, end)`` whose counts are not met, earliest first, from the decoded
    ``rec`` and ``cnt`` rows on the driver (a `pyarrow.Table` with kind, seg, time, position, rhash,
    count; sorted in numpy) and ``counted`` (a `pyarrow.Table` of ``time``, ``seen``: times whose
    distinct records were counted without their rows, each identity once: `decode.identities`;
    none of them has ``rec`` rows), so a run's one row per record need not reach the driver.

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

    def segs_of(kind_name: str, time: int) -> list:
        mask = pc.and_(pc.equal(kind, kind_name), pc.equal(rows.column("time"), time))
        return sorted(set(rows.filter(mask).column("seg").to_pylist()))

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
            raise CompletenessError(f"time {t}: segments {segs_of('cnt', t)} give counts {lo_t}..{hi_t} but "
                                    f"{int(n_seen[k]) if has_s[k] else None} distinct records were found")
        unmet.append(Unmet(time=t, expected=lo_t, seen=int(n_seen[k])))
    return unmet
