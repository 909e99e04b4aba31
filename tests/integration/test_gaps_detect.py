"""Gap detection against a real PostgreSQL slot and a real landing store, with segments built by
`SegmentBuilder` and registered by hand (the ranges need not hold real WAL for detection)."""

from __future__ import annotations

import psycopg2
import pytest

from test_gaps_kit import (build_segment, delete_row, land, land_chain, landing_files, manifest_state)
from tidemark.control import Control
from tidemark.gaps import detect
from tidemark.control import control_dsn
from tidemark.capture.source import drop_slot
from tidemark.errors import TidemarkError
from tidemark.failures import is_transient



def kinds(report) -> list[str]:
    return [g.kind for g in report.gaps]


def test_contiguous_segments_are_ok_and_a_duplicate_registration_changes_nothing(stream):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 3)
    land(cfg, chain[1])                      # the drain retried its registration: same segment again
    report = detect(cfg)
    assert (report.decision, report.action, report.gaps) == ("ok", "consolidate", ())
    assert report.checked_segments == 3
    with Control(control_dsn(cfg)) as ctl:
        assert ctl.stream(cfg.stream).next_seq == 3
        assert ctl.incidents(cfg.stream) == []


def test_missing_sequence_number_is_a_repairable_gap_with_its_exact_range(stream):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 4)
    delete_row(cfg, 2)
    report = detect(cfg)
    assert kinds(report) == ["missing_seq"]
    gap = report.gaps[0]
    assert (gap.seq, gap.lower, gap.upper, gap.extra_seqs) == (2, chain[2].lower, chain[2].upper, ())
    assert report.decision == "repair"
    with Control(control_dsn(cfg)) as ctl:
        [inc] = ctl.incidents(cfg.stream)
    assert inc["kind"] == "gap" and inc["detail"]["seq"] == 2 and inc["detail"]["lower"] == chain[2].lower


def test_several_missing_numbers_at_the_end(stream):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 4)
    delete_row(cfg, 2)
    delete_row(cfg, 3)
    report = detect(cfg)
    [gap] = report.gaps
    assert (gap.kind, gap.seq, gap.extra_seqs, gap.lower, gap.upper) == (
        "missing_seq", 2, (3,), chain[2].lower, chain[3].upper)


def test_lsn_hole_between_contiguous_numbers_needs_a_resend(stream):
    cfg, start, table = stream
    land(cfg, build_segment(cfg, table, 0, start, start + 100, [1]))
    land(cfg, build_segment(cfg, table, 1, start + 150, start + 200, [2]))
    report = detect(cfg)
    [gap] = report.gaps
    assert (gap.kind, gap.lower, gap.upper, gap.seq) == ("lsn_hole", start + 100, start + 150, None)
    assert report.decision == "resend"


def test_lsn_overlap_is_detected(stream):
    cfg, start, table = stream
    land(cfg, build_segment(cfg, table, 0, start, start + 100, [1]))
    land(cfg, build_segment(cfg, table, 1, start + 60, start + 200, [2]))
    report = detect(cfg)
    assert [(g.kind, g.lower, g.upper) for g in report.gaps] == [("lsn_overlap", start + 60, start + 100)]
    assert report.decision == "resend"


def test_first_segment_must_start_at_the_consistent_point(stream):
    cfg, start, table = stream
    land(cfg, build_segment(cfg, table, 0, start + 10, start + 100, [1]))
    [gap] = detect(cfg).gaps
    assert (gap.kind, gap.lower, gap.upper) == ("lsn_hole", start, start + 10)


def test_segments_below_the_consistent_point_are_history(stream):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 3)
    delete_row(cfg, 0)                                       # a hole in what is now history
    with Control(control_dsn(cfg)) as ctl:
        ctl.update_stream(cfg.stream, consistent_lsn=chain[1].upper)
    report = detect(cfg)
    assert report.decision == "ok", report.reasons
    assert report.checked_segments == 1


def test_missing_file_is_a_gap_of_that_segment(stream):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 3)
    from tidemark.gaps import landing_store
    landing_store(cfg).delete(chain[1].key)
    report = detect(cfg)
    [gap] = report.gaps
    assert (gap.kind, gap.seq, gap.lower, gap.upper) == ("missing_file", 1, chain[1].lower, chain[1].upper)
    assert report.decision == "repair"


@pytest.mark.parametrize("damage", ["truncate", "flip", "other_segment"])
def test_bad_file_is_quarantined_in_the_manifest_with_an_incident(stream, damage):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 3)
    from tidemark.gaps import landing_store
    store = landing_store(cfg)
    if damage == "truncate":
        bad = chain[1].data[: len(chain[1].data) // 2]
    elif damage == "flip":
        bad = bytearray(chain[1].data)
        bad[-20] ^= 0xFF
        bad = bytes(bad)
    else:
        bad = chain[2].data                                  # a valid segment, but not this one
    store.put(chain[1].key, bad)
    before = landing_files(cfg)
    report = detect(cfg)
    [gap] = report.gaps
    assert (gap.kind, gap.seq, gap.lower, gap.upper) == ("bad_file", 1, chain[1].lower, chain[1].upper)
    with Control(control_dsn(cfg)) as ctl:
        assert [s.status for s in ctl.segments(cfg.stream, status=None)] == ["landed", "quarantined", "landed"]
        [inc] = ctl.incidents(cfg.stream)
    assert inc["kind"] == "bad_segment"
    assert inc["detail"]["seq"] == 1 and inc["detail"]["segment"] == chain[1].key.rsplit("/", 1)[-1]
    assert inc["detail"]["reason"]
    assert landing_files(cfg) == before                      # detect keeps the file where it is
    assert report.decision == "repair"


def test_unmet_counts_in_a_file_are_detected(stream):
    cfg, start, table = stream
    from test_gaps_kit import Built
    from tidemark.gaps import segment_key
    from tidemark.landing.segments import SegmentBuilder, Update, checksum
    from tidemark.control import Segment

    b = SegmentBuilder(cfg.stream, 0, start)
    b.add_transaction([Update(table=table, row={"id": 1, "v": "a"}, time=start + 1, diff=1, xid=5, position=0,
                              commit_ts=0)])
    b.counts[start + 1] = 2                                  # progress promises a record that is not there
    data = b.build(start + 100)
    key = segment_key(cfg.stream, 0, start, start + 100)
    from tidemark.gaps import landing_store
    seg = Segment(cfg.stream, 0, start, start + 100, landing_store(cfg).uri(key), 1, 1, len(data), checksum(data))
    land(cfg, Built(0, start, start + 100, key, data, seg))
    [gap] = detect(cfg).gaps
    assert gap.kind == "bad_file" and "counts unmet" in gap.reason


def test_open_counts_unmet_incident_of_the_consolidation_is_a_gap(stream):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 2)
    with Control(control_dsn(cfg)) as ctl:
        # as the consolidation records it: the first unmet time, expected and seen counts
        inc = ctl.open_incident(cfg.stream, "counts_unmet", {"time": chain[1].lower + 1, "expected": 3, "seen": 2})
    report = detect(cfg)
    [gap] = report.gaps
    assert (gap.kind, gap.seq, gap.incidents) == ("counts_unmet", 1, (inc,))
    assert report.decision == "repair"


def test_dropped_slot_chooses_resend(stream):
    cfg, start, table = stream
    land_chain(cfg, table, start, 2)
    drop_slot(cfg)
    report = detect(cfg)
    assert [g.kind for g in report.gaps] == ["slot_lost"]
    assert report.decision == "resend"


def test_missing_range_below_the_slots_confirmed_position_chooses_resend(stream, source_conn):
    cfg, start, table = stream
    with source_conn.cursor() as cur:                        # make WAL, then confirm the slot past the gap
        cur.execute("SET synchronous_commit = on")           # the slot advances only up to flushed WAL
        cur.execute("INSERT INTO public.items SELECT g, 'x' FROM generate_series(1, 100) g")
        cur.execute("SELECT lsn, (lsn - '0/0'::pg_lsn)::numeric::bigint FROM pg_current_wal_flush_lsn() lsn")
        flushed_lsn, flushed = cur.fetchone()
        width = (flushed - start) // 2 + 1
        land_chain(cfg, table, start, 3, width=width)        # tiles [start, start + 3 * width) > flushed
        delete_row(cfg, 0)
        # to the position read above, not the flush position now: WAL written meanwhile (by anything on the
        # server) must not carry the slot past the chain's end, which would add a slot_ahead gap
        cur.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (cfg.source.slot, flushed_lsn))
    report = detect(cfg)
    assert kinds(report) == ["missing_seq"]
    assert report.decision == "resend"
    assert any("past the first missing position" in r for r in report.reasons)


def test_detect_twice_changes_nothing(stream):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 4)
    delete_row(cfg, 1)
    from tidemark.gaps import landing_store
    landing_store(cfg).put(chain[2].key, b"garbage")
    first = detect(cfg)
    state = manifest_state(cfg)
    files = landing_files(cfg)
    second = detect(cfg)
    assert manifest_state(cfg) == state and landing_files(cfg) == files
    assert second.gaps == first.gaps and second.decision == first.decision == "repair"


def test_detect_reports_an_unreachable_source_as_an_error(stream, monkeypatch):
    cfg, start, table = stream
    monkeypatch.setenv(f"AIRFLOW_CONN_{cfg.source.connection.upper()}", "postgresql://postgres@127.0.0.1:1/x")
    with pytest.raises(TidemarkError, match=r"cannot connect to the source \(connection 'src_\w+', 127\.0\.0\.1:1\)") \
            as err:
        detect(cfg)
    assert isinstance(err.value.__cause__, psycopg2.OperationalError)     # so a retry is still tried
    assert is_transient(err.value)



def test_verify_levels_trade_depth_for_cost(stream):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 2)
    from tidemark.gaps import landing_store
    from tidemark.landing.segments import SegmentBuilder
    store = landing_store(cfg)
    # right checksum in the manifest, but a file whose content is not the registered segment
    wrong = SegmentBuilder(cfg.stream, 1, chain[0].lower).build(chain[0].lower + 5)
    store.put(chain[1].key, wrong)
    from tidemark.landing.segments import checksum
    conn = psycopg2.connect(control_dsn(cfg))
    with conn, conn.cursor() as cur:
        cur.execute("UPDATE tidemark.segments SET checksum = %s WHERE stream = %s AND seq = 1",
                    (checksum(wrong), cfg.stream))
    conn.close()
    assert detect(cfg, verify="exists").gaps == ()
    assert detect(cfg, verify="checksum").gaps == ()
    [gap] = detect(cfg, verify="full").gaps
    assert gap.kind == "bad_file" and "manifest says" in gap.reason
    store.delete(chain[0].key)
    assert [g.kind for g in detect(cfg, verify="exists").gaps] == ["missing_file", "quarantined"]
    with pytest.raises(ValueError):
        detect(cfg, verify="everything")
