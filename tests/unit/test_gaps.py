"""The tiling walk and the repair/resend decision, on manifests built in memory."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tidemark.control import Segment, StreamState
from tidemark.gaps import _Tiler, decide
from tidemark.capture.source import SlotInfo


def state(*, consistent=1000, landed=None, next_seq=0, frontier=None) -> StreamState:
    return StreamState("s", {}, "slot", "pub", consistent, landed, frontier, next_seq, "streaming")


def seg(seq, lower, upper, status="landed") -> Segment:
    return Segment("s", seq, lower, upper, f"file:///x/{seq}", 1, 1, 1, "c", status)


def chain(bounds: list[int], start_seq: int = 0) -> list[Segment]:
    return [seg(start_seq + i, lo, hi) for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]


def walk(rows, **kw):
    t = _Tiler(state(**kw), rows)
    covering = t.walk()
    return t, covering


def slot(confirmed, wal_status="reserved") -> SlotInfo:
    return SlotInfo(name="slot", active=False, active_pid=None, restart_lsn=confirmed - 50,
                    confirmed_flush_lsn=confirmed, wal_status=wal_status, current_lsn=confirmed + 10_000)


def test_contiguous_chain_has_no_gaps():
    rows = chain([1000, 1100, 1200, 1300])
    t, covering = walk(rows, landed=1300, next_seq=3)
    assert t.gaps == [] and covering == rows and t.pos == 1300


def test_history_below_the_consistent_point_is_ignored_and_numbers_continue():
    rows = chain([500, 600, 700]) + chain([1000, 1100], start_seq=5)   # 2..4 were forgotten long ago
    t, _ = walk(rows, landed=1100, next_seq=6)
    assert [g.kind for g in t.gaps] == ["missing_seq"] and t.gaps[0].seq == 2 and not t.gaps[0].needs_wal


def test_forgotten_rows_settle_numbers_but_cover_nothing():
    rows = chain([1000, 1100, 1200, 1300])
    rows[1] = seg(1, 1100, 1200, "forgotten")
    t, covering = walk(rows, landed=1300, next_seq=3)
    assert [(g.kind, g.lower, g.upper, g.seq) for g in t.gaps] == [("lsn_hole", 1100, 1200, None)]
    assert [r.seq for r in covering] == [0, 2]


def test_missing_numbers_in_the_middle_and_at_the_end():
    rows = chain([1000, 1100, 1200, 1300, 1400])
    del rows[3], rows[1]
    t, _ = walk(rows, landed=1400, next_seq=4)
    assert [(g.kind, g.seq, g.lower, g.upper) for g in t.gaps] == [
        ("missing_seq", 1, 1100, 1200), ("missing_seq", 3, 1300, 1400)]


def test_missing_number_with_an_empty_range_needs_no_wal():
    rows = [seg(0, 1000, 1100), seg(2, 1100, 1200)]
    t, _ = walk(rows, landed=1200, next_seq=3)
    [g] = t.gaps
    assert (g.seq, g.lower, g.upper, g.needs_wal) == (1, 1100, 1100, False)
    assert decide(t.gaps, None)[0] == "repair"              # nothing to replay: no slot needed


def test_trailing_landed_upper_beyond_the_segments_is_a_hole_with_the_next_number():
    rows = chain([1000, 1100])
    t, _ = walk(rows, landed=1250, next_seq=1)
    [g] = t.gaps
    assert (g.kind, g.seq, g.lower, g.upper) == ("lsn_hole", 1, 1100, 1250)


def test_decide_prefers_repair_while_the_slot_covers_the_first_missing_position():
    rows = chain([1000, 1100, 1200, 1300])
    del rows[1]
    t, _ = walk(rows, landed=1300, next_seq=3)
    assert decide(t.gaps, slot(1000))[0] == "repair"
    assert decide(t.gaps, slot(1100))[0] == "repair"        # confirmed == lower: still replayable
    assert decide(t.gaps, slot(1101))[0] == "resend"
    assert decide(t.gaps, slot(1000, "lost"))[0] == "resend"
    assert decide(t.gaps, None)[0] == "resend"
    assert decide([], None) == ("ok", [])


@settings(max_examples=200, deadline=None)
@given(widths=st.lists(st.integers(0, 50), min_size=1, max_size=25), data=st.data())
def test_gaps_cover_exactly_the_ranges_of_deleted_rows(widths, data):
    bounds = [1000]
    for w in widths:
        bounds.append(bounds[-1] + w)
    rows = chain(bounds)
    deleted = data.draw(st.sets(st.sampled_from(range(len(rows)))))
    kept = [r for r in rows if r.seq not in deleted]
    t, covering = walk(kept, landed=bounds[-1], next_seq=len(rows))
    assert covering == kept
    missing_numbers = sorted(n for g in t.gaps for n in ((g.seq,) + g.extra_seqs))
    assert missing_numbers == sorted(deleted)
    covered = sorted([(r.lower, r.upper) for r in kept] + [(g.lower, g.upper) for g in t.gaps])
    pos = 1000
    for lo, hi in covered:                                   # rows plus gaps tile [1000, end) exactly
        assert lo == pos
        pos = hi
    assert pos == bounds[-1]
    assert all(g.in_place for g in t.gaps)
