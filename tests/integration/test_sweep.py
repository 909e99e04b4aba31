"""Sweep: files written to the landing store but never registered (a drain killed in between)."""

from __future__ import annotations

import pytest

from test_gaps_kit import build_segment, land, land_chain, landing_files, manifest_state
from tidemark.control import Control
from tidemark.errors import StreamBusy
from tidemark.gaps import detect, landing_store, sweep
from tidemark.landing.segments import checksum
from tidemark.control import control_dsn



def test_orphan_that_fits_the_tiling_is_registered(stream):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 2)
    orphan = build_segment(cfg, table, 2, chain[-1].upper, chain[-1].upper + 100, [7, 8, 9])
    land(cfg, orphan, register=False)
    result = sweep(cfg)
    assert result.registered == (2,) and result.quarantined == () and result.scanned == 3
    with Control(control_dsn(cfg)) as ctl:
        seg = ctl.segments(cfg.stream, status=None)[-1]
        state = ctl.stream(cfg.stream)
    assert (seg.seq, seg.lower, seg.upper, seg.origin, seg.checksum) == (2, orphan.lower, orphan.upper, "sweep",
                                                                        checksum(orphan.data))
    assert (seg.record_count, seg.txn_count) == (3, 3)
    assert (state.next_seq, state.landed_upper) == (3, orphan.upper)
    assert detect(cfg).decision == "ok"


def test_orphans_in_a_row_are_registered_in_order(stream):
    cfg, start, table = stream
    first = build_segment(cfg, table, 0, start, start + 100, [1])
    second = build_segment(cfg, table, 1, start + 100, start + 250, [2])
    land(cfg, second, register=False)
    land(cfg, first, register=False)
    assert sweep(cfg).registered == (0, 1)


def test_orphan_filling_a_hole_in_the_manifest_is_registered(stream):
    cfg, start, table = stream
    land_chain(cfg, table, start, 3)
    import psycopg2
    conn = psycopg2.connect(control_dsn(cfg))
    with conn, conn.cursor() as cur:
        cur.execute("DELETE FROM tidemark.segments WHERE stream = %s AND seq = 1", (cfg.stream,))
    conn.close()
    assert detect(cfg).decision == "repair"
    assert sweep(cfg).registered == (1,)
    assert detect(cfg).gaps == ()


def test_identical_duplicate_is_left_alone(stream):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 2)
    store = landing_store(cfg)
    other_name = build_segment(cfg, table, 1, chain[1].lower, chain[1].upper + 1, [1]).key
    store.put(other_name, chain[1].data)                     # same seq, same bytes, another name
    before = manifest_state(cfg), landing_files(cfg)
    result = sweep(cfg)
    assert result.duplicates == (other_name,) and result.registered == () and result.quarantined == ()
    assert (manifest_state(cfg), landing_files(cfg)) == before


@pytest.mark.parametrize("case", ["other_bytes_same_seq", "not_avro", "wrong_place", "bad_name", "other_stream"])
def test_foreign_or_invalid_file_is_quarantined_never_deleted(stream, case):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 2)
    store = landing_store(cfg)
    upper = chain[-1].upper
    if case == "other_bytes_same_seq":       # a killed drain's segment 1, re-drained with other bounds
        bad = build_segment(cfg, table, 1, chain[1].lower, chain[1].lower + 50, [99])
        key, data = bad.key, bad.data
    elif case == "not_avro":
        key, data = build_segment(cfg, table, 2, upper, upper + 10, [1]).key, b"not a segment"
    elif case == "wrong_place":              # fits by name, but starts past the landed upper
        bad = build_segment(cfg, table, 2, upper + 5, upper + 50, [3])
        key, data = bad.key, bad.data
    elif case == "bad_name":
        key, data = f"{cfg.stream}/segments/notes.txt", b"hello"
    else:                                    # right name and range, but written for another stream
        from dataclasses import replace
        other = build_segment(replace(cfg, stream="someone_else"), table, 2, upper, upper + 50, [4])
        key, data = f"{cfg.stream}/segments/{other.key.rsplit('/', 1)[-1]}", other.data
    store.put(key, data)
    before = manifest_state(cfg)[0]
    result = sweep(cfg)
    [q] = result.quarantined
    assert q["key"] == key and q["reason"] and q["moved_to"].startswith(f"{cfg.stream}/quarantine/")
    assert not store.exists(key) and store.get(q["moved_to"]) == data
    assert manifest_state(cfg)[0] == before
    with Control(control_dsn(cfg)) as ctl:
        [inc] = ctl.incidents(cfg.stream)
    assert inc["kind"] == "orphan_segment" and inc["detail"]["key"] == key
    again = sweep(cfg)                                       # second run: nothing left to do
    assert (again.registered, again.duplicates, again.quarantined) == ((), (), ())


def test_sweep_twice_changes_nothing(stream):
    cfg, start, table = stream
    chain = land_chain(cfg, table, start, 1)
    land(cfg, build_segment(cfg, table, 1, chain[0].upper, chain[0].upper + 100, [5]), register=False)
    store = landing_store(cfg)
    store.put(f"{cfg.stream}/segments/junk.avro", b"junk")
    sweep(cfg)
    state, files = manifest_state(cfg), landing_files(cfg)
    result = sweep(cfg)
    assert (result.registered, result.quarantined) == ((), ())
    assert (manifest_state(cfg), landing_files(cfg)) == (state, files)


def test_sweep_waits_for_a_running_drain(stream):
    cfg, start, table = stream
    with Control(control_dsn(cfg)) as ctl, ctl.stream_lock(cfg.stream, "drain"):
        with pytest.raises(StreamBusy):
            sweep(cfg)
