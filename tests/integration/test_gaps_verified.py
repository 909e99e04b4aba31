"""Gap detection reads the backlog, not the history: a segment's file is decoded once (a verified
mark in the manifest), and manifest rows below the retention floor are archived.

On the code before these tests every `detect` decoded every pending file again (the sensor polls it
every 20 s, and the branch and the repair detect again), and the manifest was never pruned: the
decode counts and the archive assertions failed."""

from __future__ import annotations

import pytest

from test_gaps_kit import delete_row, land_chain
from tidemark import gaps
from tidemark.control import Control, control_dsn
from tidemark.gaps import common, detect
from tidemark.landing.store import landing_store


@pytest.fixture
def decodes(monkeypatch):
    """Count the files `inspect_file` decodes."""
    seen = []
    real = common.read_segment

    def counting(data, name):
        seen.append(name)
        return real(data, name)

    monkeypatch.setattr(common, "read_segment", counting)
    return seen


def test_each_pending_file_is_decoded_once(stream, decodes):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 5)
    assert detect(cfg).decision == "ok" and len(decodes) == 5
    with Control(control_dsn(cfg)) as ctl:
        assert all(s.verified for s in ctl.segments(cfg.stream))
    decodes.clear()
    for _ in range(3):                                    # the sensor's pokes, the branch, the repair
        report = detect(cfg)
        assert (report.decision, report.checked_segments) == ("ok", 5)
    assert decodes == []
    # a segment whose file is re-written (a re-drain with another framing) is verified again
    with Control(control_dsn(cfg)) as ctl:
        ctl.set_segment_file(cfg.stream, 2, chain[2].segment.checksum, chain[2].segment.byte_size)
    detect(cfg)
    assert len(decodes) == 1
    # a verified file that disappears is still found
    landing_store(cfg).delete(chain[3].key)
    assert [g.kind for g in detect(cfg).gaps] == ["missing_file"]


def test_a_bad_file_is_still_found_before_its_first_verification(stream, decodes):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 3)
    landing_store(cfg).put(chain[1].key, b"not an avro file")
    report = detect(cfg)
    assert [g.kind for g in report.gaps] == ["bad_file"]
    with Control(control_dsn(cfg)) as ctl:
        assert {s.seq: s.verified for s in ctl.segments(cfg.stream, status=None)} == {0: True, 1: False, 2: True}


def test_rows_below_the_retention_floor_are_archived_and_detection_tiles_from_there(stream, decodes):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 10)
    with Control(control_dsn(cfg)) as ctl:
        ctl.advance_frontier(cfg.stream, chain[6].upper, committed_segment=6)
        ctl.add_subscriber(cfg.stream, "reader", chain[3].upper)     # a subscriber holds the floor lower
    report = detect(cfg)
    assert (report.decision, report.action, report.checked_segments) == ("ok", "consolidate", 3)
    with Control(control_dsn(cfg)) as ctl:
        live = [s.seq for s in ctl.segments(cfg.stream, status=None, archived=False)]
        assert live == list(range(3, 10))              # 0..2 end at or below the reader's checkpoint; 3 kept
        ctl.ack_subscriber(cfg.stream, "reader", chain[6].upper)
    assert detect(cfg).decision == "ok"
    with Control(control_dsn(cfg)) as ctl:
        assert [s.seq for s in ctl.segments(cfg.stream, status=None, archived=False)] == [6, 7, 8, 9]
        assert [s.seq for s in ctl.segments(cfg.stream, status=None)] == list(range(10))   # still readable
        assert ctl.segment(cfg.stream, 1).uri == chain[1].segment.uri
        state = ctl.stream(cfg.stream)
        assert (state.archived_seq, state.archived_upper) == (6, chain[5].upper)
        assert ctl.register_segment(chain[2].segment) is False       # a retried registration is still known
    assert gaps.sweep(cfg).registered == () and gaps.sweep(cfg).quarantined == ()   # archived files are known
    delete_row(cfg, 8)                                               # a gap above the archive is still found
    [gap] = detect(cfg).gaps
    assert (gap.kind, gap.seq, gap.lower, gap.upper) == ("missing_seq", 8, chain[8].lower, chain[8].upper)
