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


def sliced(cov: Coverage, max_bytes: int, max_records: int | None = None) -> Coverage:
    """The first slice of ``cov``: its segments in order while their bytes stay within ``max_bytes``
    and their records within ``max_records`` (segments are compressed: a few MB may decode to
    millions of rows), at least one segment whatever its size (a transaction is never split),
    ending at the last one's upper. Segments that overlap the slice's end (duplicates, overlaps)
    are read again by the next slice, which starts at this one's frontier. ``more``: the run goes
    on after it."""
    total, records, chosen, end = 0, 0, [], cov.start
    for seg in cov.segments:
        if chosen and seg.lower >= end and (total + (seg.byte_size or 0) > max_bytes or (
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


def completeness(decoded, start: int, end: int, *, limit: int = 100) -> list[Unmet]:
    """The times in ``[start, end)`` whose counts are not met, earliest first (one small collect).

    Raises `CompletenessError` when two different records share a ``(time, position)``, when
    segments give different counts for one time, or when there are more distinct records than
    counted."""
    from pyspark.sql import functions as F

    window = (F.col("time") >= start) & (F.col("time") < end)
    recs = decoded.filter((F.col("kind") == "rec") & window)
    per_id = recs.groupBy("time", "position").agg(F.countDistinct("rhash").alias("n"),
                                                   F.collect_set("seg").alias("segs"))
    seen = per_id.groupBy("time").agg(F.count(F.lit(1)).alias("seen"), F.max("n").alias("n"),
                                      F.min(F.when(F.col("n") > 1, F.col("position"))).alias("conflict_pos"),
                                      F.flatten(F.collect_set(F.when(F.col("n") > 1, F.col("segs")))).alias("csegs"))
    expected = (decoded.filter((F.col("kind") == "cnt") & window).groupBy("time")
                .agg(F.min("count").alias("lo"), F.max("count").alias("hi"), F.collect_set("seg").alias("segs")))
    seen_n = F.coalesce(F.col("seen"), F.lit(0))
    problems = (expected.join(seen, on="time", how="full_outer")
                .filter((F.col("n") > 1) | (F.col("lo") != F.col("hi")) | (seen_n > F.coalesce(F.col("hi"), F.lit(0)))
                        | (seen_n < F.col("lo")))
                .orderBy("time").limit(limit).collect())
    unmet = []
    for r in problems:
        if (r["n"] or 0) > 1:
            raise CompletenessError(f"different records share the identity (time {r['time']}, position "
                                    f"{r['conflict_pos']}) in segments {sorted(set(r['csegs']))}; bad input, "
                                    "not a duplicate")
        if r["lo"] != r["hi"] or (r["seen"] or 0) > (r["hi"] or 0):
            raise CompletenessError(f"time {r['time']}: segments {sorted(r['segs'] or [])} give counts "
                                    f"{r['lo']}..{r['hi']} but {r['seen']} distinct records were found")
        unmet.append(Unmet(time=r["time"], expected=r["lo"], seen=r["seen"] or 0))
    return unmet


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


def completeness_rows(rows, start: int, end: int, *, limit: int = 100) -> list[Unmet]:
    """`completeness` over the decoded ``rec`` and ``cnt`` rows already on the driver (a
    `pyarrow.Table` with kind, seg, time, position, rhash, count): the same checks, errors and
    result, without a Spark shuffle."""
    import pyarrow.compute as pc

    window = pc.and_(pc.greater_equal(rows.column("time"), start), pc.less(rows.column("time"), end))
    recs = rows.filter(pc.and_(pc.equal(rows.column("kind"), "rec"), window))
    ids = recs.group_by(["time", "position", "rhash"]).aggregate([])
    per_id = ids.group_by(["time", "position"]).aggregate([("rhash", "count")])
    seen_t = per_id.group_by("time").aggregate([("position", "count"), ("rhash_count", "max")])
    seen = dict(zip(seen_t.column("time").to_pylist(), zip(seen_t.column("position_count").to_pylist(),
                                                           seen_t.column("rhash_count_max").to_pylist())))
    cnts = rows.filter(pc.and_(pc.equal(rows.column("kind"), "cnt"), window))
    exp_t = cnts.group_by("time").aggregate([("count", "min"), ("count", "max")])
    expected = dict(zip(exp_t.column("time").to_pylist(), zip(exp_t.column("count_min").to_pylist(),
                                                              exp_t.column("count_max").to_pylist())))

    def segs_of(table, time):
        return sorted(set(table.filter(pc.equal(table.column("time"), time)).column("seg").to_pylist()))

    unmet: list[Unmet] = []
    problems = 0
    for t in sorted(set(seen) | set(expected)):
        n_seen, n = seen.get(t, (0, 0))
        lo, hi = expected.get(t, (None, None))
        if not (n > 1 or (lo is not None and lo != hi) or n_seen > (hi or 0) or (lo is not None and n_seen < lo)):
            continue
        problems += 1
        if problems > limit:
            break
        if n > 1:
            multi = per_id.filter(pc.and_(pc.equal(per_id.column("time"), t), pc.greater(per_id.column("rhash_count"), 1)))
            pos = min(multi.column("position").to_pylist())
            at = recs.filter(pc.and_(pc.equal(recs.column("time"), t),
                                     pc.is_in(recs.column("position"), value_set=multi.column("position").combine_chunks())))
            raise CompletenessError(f"different records share the identity (time {t}, position {pos}) in segments "
                                    f"{sorted(set(at.column('seg').to_pylist()))}; bad input, not a duplicate")
        if lo != hi or n_seen > (hi or 0):
            raise CompletenessError(f"time {t}: segments {segs_of(cnts, t)} give counts {lo}..{hi} but "
                                    f"{n_seen if t in seen else None} distinct records were found")
        unmet.append(Unmet(time=t, expected=lo, seen=n_seen))
    return unmet
