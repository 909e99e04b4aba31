"""`follow_stream`, what the consolidate task runs: batch after batch while records landed during the
previous one (a drain running beside it), each committed and advanced on its own, the lake equal to
the reference applier at each frontier; and no longer than its time."""

from __future__ import annotations

from collections import Counter

import pytest

from consolidate_kit import Lander, shape, up
from refapply import apply_capture, arrow_rows
from tidemark.consolidate import job
from tidemark.landing.segments import read_segment
from tidemark.lake import read_table

pytestmark = [pytest.mark.spark]

T = shape("t", [("k", "int64", True), ("v", "text")], oid=41)


def _txns(lower: int, n: int) -> list:
    """``n`` transactions at times above ``lower``: inserts of new keys and updates of earlier ones."""
    out, base = [], lower // 100 * n       # keys go on from the previous range's
    for i in range(n):
        k = base + i
        recs = [up(T, {"k": k, "v": f"v{k}"}, lower + 1 + i, 1, 0)]
        if k >= 2:
            recs += [up(T, {"k": k - 2, "v": f"v{k - 2}"}, lower + 1 + i, -1, 1),
                     up(T, {"k": k - 2, "v": f"w{k}"}, lower + 1 + i, 1, 2)]
        out.append((recs, []))
    return out


def _read(uri: str) -> bytes:
    with open(uri.removeprefix("file://"), "rb") as f:
        return f.read()


@pytest.mark.parametrize("seconds, batches", [(60, 3), (0, 1)])
def test_follow_takes_what_landed_during_a_batch(spark, make_stream, control, monkeypatch, seconds, batches):
    cfg = make_stream(["public.t"], consolidate={"buckets": 2, "follow_seconds": seconds})
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=0, landed_upper=0)
    lander = Lander(cfg, control)
    ranges = [(0, 100), (100, 200), (200, 300)]
    segments = []

    def land(i: int) -> None:
        lower, upper = ranges[i]
        seg = lander.land(lower, upper, _txns(lower, 20))
        segments.append(read_segment(_read(seg.uri), seg.uri.rsplit("/", 1)[-1]))

    land(0)
    real, frontiers = job.consolidate_stream, []

    def a_drain_lands_meanwhile(cfg, **kwargs):
        result = real(cfg, **kwargs)
        frontiers.append(result.frontier_after)
        expected = apply_capture({"public.t": (T, [])}, 0, segments)
        assert Counter(arrow_rows(read_table(cfg, "public.t"))) == expected["public.t"]
        if len(segments) < len(ranges):
            land(len(segments))          # landed while this batch ran
        return result

    monkeypatch.setattr(job, "consolidate_stream", a_drain_lands_meanwhile)
    result = job.follow_stream(cfg, spark=spark)
    assert frontiers == [100, 200, 300][:batches]
    assert control.stream(cfg.stream).frontier == result.frontier_after == 100 * batches
    assert result.frontier_before is None and sorted(result.segments) == list(range(batches))
    assert set(result.versions) == {"public.t"}
    assert result.changes["public.t"]["inserted"] == 20 * batches        # summed over its batches
