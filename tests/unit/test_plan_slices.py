"""A slice of a backlog (`plan.sliced`): a prefix of the run's segments bounded by bytes AND records
(segments are compressed: their bytes alone let a few MB decode to millions of rows), never empty,
ending at its last segment's upper; the slices of a run, taken one after another, cover it."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from tidemark.consolidate.plan import coverage, sliced
from tidemark.control.db import Segment


@st.composite
def runs(draw):
    n = draw(st.integers(1, 30))
    segs, lower = [], 100
    for seq in range(n):
        upper = lower + draw(st.integers(1, 50))
        segs.append(Segment("s", seq, lower, upper, f"file:///{seq}", draw(st.integers(0, 5000)), 1,
                            draw(st.integers(0, 5000)), "x"))
        lower = upper
    return segs


@settings(max_examples=300, deadline=None)
@given(runs(), st.integers(1, 20000), st.integers(1, 20000))
def test_slices_are_bounded_by_bytes_and_records_and_cover_the_run(segs, max_bytes, max_records):
    start, seen = segs[0].lower, []
    while True:
        cov = sliced(coverage(segs, start), max_bytes, max_records)
        assert cov.segments and cov.segments[0].lower == start
        if len(cov.segments) > 1:       # one segment may exceed the bounds: a transaction is never split
            assert sum(s.byte_size for s in cov.segments) <= max_bytes
            assert sum(s.record_count for s in cov.segments) <= max_records
        assert cov.end == cov.segments[-1].upper
        seen += cov.segments
        if not cov.more:
            break
        start = cov.end
    assert seen == segs


def test_many_records_in_few_bytes_make_several_slices():
    segs = [Segment("s", i, 10 * i, 10 * i + 10, f"file:///{i}", 300_000, 1, 1_000_000, "x") for i in range(4)]
    cov = sliced(coverage(segs, 0), 64 << 20, 500_000)
    assert [s.seq for s in cov.segments] == [0] and cov.more          # the bytes alone would take all four
    assert sliced(coverage(segs, 0), 64 << 20).segments == segs


def test_a_slice_reaches_the_re_snapshot_a_failed_batch_asked_for():
    # the refused change in segment 0, the re-snapshot's LSN in segment 2: a slice ending before it
    # would be refused again, for good (`plan.resnapshots_asked`)
    segs = [Segment("s", i, 10 * i, 10 * i + 10, f"file:///{i}", 10, 1, 2 << 20, "x") for i in range(4)]
    assert [s.seq for s in sliced(coverage(segs, 0), 1 << 20).segments] == [0]
    cov = sliced(coverage(segs, 0), 1 << 20, reach=25)
    assert [s.seq for s in cov.segments] == [0, 1, 2] and cov.end == 30 and cov.more
    assert sliced(coverage(segs, 0), 1 << 20, reach=30).end == 30       # its upper is past the LSN: enough
    assert sliced(coverage(segs, 0), 1 << 20, reach=99).segments == segs
