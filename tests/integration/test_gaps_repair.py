"""Repair and sweep with real drains: re-drained segments are byte-identical to the originals."""

from __future__ import annotations

import psycopg2
import pytest

from oracle import drain_until_current
from segment_kit import counted_framing
from test_gaps_kit import create_items, landing_files, manifest_state
from tidemark.control import Control
from tidemark.capture.drain import drain_stream
from tidemark.gaps import detect, landing_store, repair, resend, sweep
from tidemark.landing.segments import read_segment
from tidemark.capture.snapshot import snapshot_stream
from tidemark.control import control_dsn
from tidemark.capture.source import drop_slot


@pytest.fixture
def drained(make_stream, source_conn):
    """A stream with three drained segments holding real transactions."""
    create_items(source_conn)
    with source_conn.cursor() as cur:
        cur.execute("SET synchronous_commit = on")           # commits are flushed: drains see them at once
    cfg = make_stream(["public.items"], drain={"idle_timeout_seconds": 0.5})
    snapshot_stream(cfg, tables=[])
    for batch in range(3):
        with source_conn.cursor() as cur:
            cur.execute("INSERT INTO public.items SELECT g, 'v' || g FROM generate_series(%s, %s) g",
                        (batch * 100 + 1, batch * 100 + 100))
            cur.execute("UPDATE public.items SET v = v || '!' WHERE id %% 7 = %s", (batch,))
        drain_until_current(cfg)
    segs = segments(cfg)
    assert len(segs) >= 3 and sum(s.record_count for s in segs) > 300
    store = landing_store(cfg)
    originals = {s.seq: store.get(key_of(s)) for s in segs}
    return cfg, segs, originals


def segments(cfg):
    with Control(control_dsn(cfg)) as ctl:
        return ctl.segments(cfg.stream, status=None)


def key_of(seg) -> str:
    return f"{seg.stream}/segments/{seg.uri.rsplit('/', 1)[-1]}"


def middle(segs):
    """A segment with records that has neighbours on both sides."""
    return next(s for s in segs[1:-1] if s.record_count > 0) if len(segs) > 2 else segs[0]


def test_missing_file_is_redrained_byte_identical_and_repair_twice_changes_nothing(drained):
    cfg, segs, originals = drained
    victim = middle(segs)
    store = landing_store(cfg)
    store.delete(key_of(victim))
    report = detect(cfg)
    assert [(g.kind, g.seq, g.lower, g.upper) for g in report.gaps] == [
        ("missing_file", victim.seq, victim.lower, victim.upper)]
    assert report.decision == "repair"
    result = repair(cfg, report)
    assert [r["seq"] for r in result.repaired] == [victim.seq]
    assert store.get(key_of(victim)) == originals[victim.seq]
    assert detect(cfg).decision == "ok"
    with Control(control_dsn(cfg)) as ctl:
        assert ctl.incidents(cfg.stream) == []
        [inc] = ctl.incidents(cfg.stream, open_only=False)
    assert inc["kind"] == "gap" and inc["resolution"].startswith("repaired")
    state, files = manifest_state(cfg), landing_files(cfg)
    again = repair(cfg, report)                                   # a retry with the same (stale) report
    assert again.repaired == () and len(again.skipped) == 1
    assert (manifest_state(cfg), landing_files(cfg)) == (state, files)


def test_corrupt_file_is_quarantined_moved_aside_and_repaired(drained):
    cfg, segs, originals = drained
    victim = middle(segs)
    store = landing_store(cfg)
    bad = originals[victim.seq][:-40] + b"\0" * 40
    store.put(key_of(victim), bad)
    report = detect(cfg)
    [gap] = report.gaps
    assert (gap.kind, gap.seq) == ("bad_file", victim.seq)
    assert [s.status for s in segments(cfg) if s.seq == victim.seq] == ["quarantined"]
    result = repair(cfg, report)
    [moved] = result.quarantined
    assert moved.startswith(f"{cfg.stream}/quarantine/") and store.get(moved) == bad   # kept for inspection
    assert store.get(key_of(victim)) == originals[victim.seq]
    assert [s.status for s in segments(cfg) if s.seq == victim.seq] == ["landed"]
    with Control(control_dsn(cfg)) as ctl:
        assert ctl.incidents(cfg.stream) == []
    assert detect(cfg).gaps == ()
    state, files = manifest_state(cfg), landing_files(cfg)
    repair(cfg, detect(cfg))
    assert (manifest_state(cfg), landing_files(cfg)) == (state, files)


def test_a_segment_written_in_the_earlier_framing_is_repaired_in_the_current_one(drained):
    """A segment landed before updates were framed one per block, then lost: its re-drain has other
    bytes for the same records; the repair checks them and records the new checksum."""
    from tidemark.landing.columnar import decode_columnar
    from tidemark.landing.segments import checksum

    cfg, segs, originals = drained
    victim = middle(segs)
    store = landing_store(cfg)
    old = counted_framing(originals[victim.seq])
    assert old != originals[victim.seq] and decode_columnar(old) is None
    assert read_segment(old).updates == read_segment(originals[victim.seq]).updates
    store.put(key_of(victim), old)
    with Control(control_dsn(cfg)) as ctl, ctl.tx() as cur:      # as the earlier version registered it
        cur.execute("UPDATE tidemark.segments SET checksum = %s, byte_size = %s WHERE stream = %s AND seq = %s",
                    (checksum(old), len(old), cfg.stream, victim.seq))
    assert detect(cfg).decision == "ok"
    store.delete(key_of(victim))
    result = repair(cfg, detect(cfg))
    assert [r["seq"] for r in result.repaired] == [victim.seq]
    assert store.get(key_of(victim)) == originals[victim.seq]
    [seg] = [s for s in segments(cfg) if s.seq == victim.seq]
    assert (seg.status, seg.checksum, seg.byte_size) == ("landed", checksum(originals[victim.seq]),
                                                        len(originals[victim.seq]))
    assert detect(cfg).decision == "ok"


def test_missing_registration_and_file_are_redrained_with_the_original_number(drained):
    cfg, segs, originals = drained
    victim = middle(segs)
    landing_store(cfg).delete(key_of(victim))
    conn = psycopg2.connect(control_dsn(cfg))
    with conn, conn.cursor() as cur:
        cur.execute("DELETE FROM tidemark.segments WHERE stream = %s AND seq = %s", (cfg.stream, victim.seq))
    conn.close()
    report = detect(cfg)
    [gap] = report.gaps
    assert (gap.kind, gap.seq, gap.lower, gap.upper) == ("missing_seq", victim.seq, victim.lower, victim.upper)
    repair(cfg, report)
    [again] = [s for s in segments(cfg) if s.seq == victim.seq]
    assert (again.lower, again.upper, again.checksum, again.origin) == (victim.lower, victim.upper, victim.checksum,
                                                                       "repair")
    assert landing_store(cfg).get(key_of(victim)) == originals[victim.seq]
    assert detect(cfg).decision == "ok"


def test_repair_then_drain_continues_where_it_stopped(drained, source_conn):
    cfg, segs, originals = drained
    landing_store(cfg).delete(key_of(segs[-1]))
    repair(cfg, detect(cfg))
    with source_conn.cursor() as cur:
        cur.execute("DELETE FROM public.items WHERE id < 10")
    drain_until_current(cfg)
    after = segments(cfg)
    assert after[len(segs)].lower == segs[-1].upper and detect(cfg).decision == "ok"


def test_killed_drain_leaves_a_zombie_that_sweep_registers(drained, source_conn, monkeypatch):
    cfg, segs, originals = drained
    with source_conn.cursor() as cur:
        cur.execute("UPDATE public.items SET v = 'zombie' WHERE id <= 20")
    real = Control.register_segment

    def killed(self, seg):
        raise KeyboardInterrupt("drain killed between writing and registering")

    monkeypatch.setattr(Control, "register_segment", killed)
    with pytest.raises(KeyboardInterrupt):
        drain_stream(cfg)
    monkeypatch.setattr(Control, "register_segment", real)
    zombie = [k for k in landing_store(cfg).list(f"{cfg.stream}/segments/") if k not in {key_of(s) for s in segs}]
    assert len(zombie) == 1
    result = sweep(cfg)
    assert result.registered == (segs[-1].seq + 1,) and result.quarantined == ()
    [reg] = [s for s in segments(cfg) if s.seq == segs[-1].seq + 1]
    assert reg.origin == "sweep" and reg.lower == segs[-1].upper and key_of(reg) == zombie[0]
    content = read_segment(landing_store(cfg).get(zombie[0]))
    assert reg.record_count == len(content.updates) + len(content.events) == 2 * 20   # -old, +new per row
    assert detect(cfg).decision == "ok"
    again = sweep(cfg)
    assert (again.registered, again.quarantined) == ((), ())


def test_zombie_superseded_by_a_later_drain_is_quarantined(drained, source_conn, monkeypatch):
    cfg, segs, originals = drained
    with source_conn.cursor() as cur:
        cur.execute("UPDATE public.items SET v = 'first' WHERE id <= 5")
    real = Control.register_segment
    monkeypatch.setattr(Control, "register_segment", lambda self, seg: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        drain_stream(cfg)
    monkeypatch.setattr(Control, "register_segment", real)
    with source_conn.cursor() as cur:                 # more commits: the restarted drain reaches further
        cur.execute("UPDATE public.items SET v = 'second' WHERE id <= 5")
    drain_until_current(cfg)
    before = landing_files(cfg)
    result = sweep(cfg)
    [q] = result.quarantined
    assert q["moved_to"].startswith(f"{cfg.stream}/quarantine/")
    assert landing_store(cfg).get(q["moved_to"]) and before[q["key"]]          # moved, not deleted
    assert detect(cfg).decision == "ok"


def test_slot_dropped_after_drains_resend_then_drains_continue(drained, source_conn):
    cfg, segs, originals = drained
    drop_slot(cfg)
    with source_conn.cursor() as cur:
        cur.execute("UPDATE public.items SET v = 'lost' WHERE id <= 30")
    report = detect(cfg)
    assert report.decision == "resend"
    with pytest.raises(Exception, match="resend"):
        repair(cfg, report)
    result = resend(cfg)
    assert result.forgotten == () and result.tables == {"public.items": 300}
    with source_conn.cursor() as cur:
        cur.execute("UPDATE public.items SET v = 'after' WHERE id <= 3")
    drain_until_current(cfg)
    new = [s for s in segments(cfg) if s.seq > segs[-1].seq]
    assert new and new[0].lower == result.lsn and new[0].seq == segs[-1].seq + 1
    assert detect(cfg).decision == "ok"
