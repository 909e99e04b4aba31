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
