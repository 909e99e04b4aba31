"""The control database: migrations, manifest, frontier, locks."""

import pytest

from tidemark.control import Control, Segment
from tidemark.errors import StreamBusy, TidemarkError


def test_migrate_is_idempotent(control_dsn):
    with Control(control_dsn) as ctl:
        assert ctl.migrate() == []


def test_manifest_registration_is_idempotent_and_checked(control, make_stream):
    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    seg = Segment(cfg.stream, 0, 100, 200, "file:///x", 3, 1, 10, "abc")
    assert control.register_segment(seg) is True
    assert control.register_segment(seg) is False          # retry: no change
    with pytest.raises(TidemarkError, match="already registered"):
        control.register_segment(Segment(cfg.stream, 0, 100, 300, "file:///y", 3, 1, 10, "abd"))
    state = control.stream(cfg.stream)
    assert (state.landed_upper, state.next_seq) == (200, 1)


def test_frontier_never_moves_back(control, make_stream):
    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    control.advance_frontier(cfg.stream, 500)
    control.advance_frontier(cfg.stream, 400)
    assert control.stream(cfg.stream).frontier == 500
    assert control.subscriber_checkpoint(cfg.stream, "consolidate") == 500


def test_second_lock_holder_is_refused(control, make_stream):
    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    with control.stream_lock(cfg.stream, "drain"):
        with pytest.raises(StreamBusy, match="another drain is already running"):
            with control.stream_lock(cfg.stream, "drain"):
                pass
    with control.stream_lock(cfg.stream, "drain"):   # released: can be taken again
        pass


# -- incidents: one per cause ---------------------------------------------------------------------

def _failure(at: str, seen: int = 3, table: str = "public.t") -> dict:
    """A consolidation failure's detail as a retry records it: the same cause, another wall-clock time."""
    return {"stream": "s", "table": table, "step": "merging", "segment": {"seq": 4, "uri": "file:///x"},
            "position": "0/16B3748", "at": at, "seen": seen, "tables_at_new_frontier": [] if seen < 5 else ["a"],
            "reason": f"ValueError: bad row at {at}", "remedy": "fix it"}


def test_a_repeated_failure_is_one_incident_with_its_count_and_last_seen(control, make_stream):
    """Each retry of the same failure (its detail holds the time) counts on one incident; before, each
    retry opened a new incident (three rows here)."""
    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    ids = [control.open_incident(cfg.stream, "consolidate_failed", _failure(f"2026-11-24T12:0{i}:00+00:00", seen=i))
           for i in range(3, 6)]
    assert len(set(ids)) == 1
    [inc] = control.incidents(cfg.stream)
    assert inc["count"] == 3 and inc["table"] == "public.t"
    assert inc["last_seen_at"] > inc["opened_at"]
    assert inc["detail"]["at"] == "2026-11-24T12:05:00+00:00"           # the latest occurrence's detail
    # another cause (another table, another kind) is another incident
    other = control.open_incident(cfg.stream, "consolidate_failed", _failure("2026-11-24T12:09:00Z", table="public.u"))
    gap = control.open_incident(cfg.stream, "gap", {"gap": "missing_seq", "seq": 4, "reason": "segment 4 is missing"})
    assert len({ids[0], other, gap}) == 3
    assert control.open_incident(cfg.stream, "gap", {"gap": "missing_seq", "seq": 4,
                                                     "reason": "segment 4 is missing"}) == gap
    # once resolved, the same cause again opens a new incident
    control.resolve_incident(gap, "repaired")
    again = control.open_incident(cfg.stream, "gap", {"gap": "missing_seq", "seq": 4, "reason": "segment 4 is missing"})
    assert again != gap
    assert {i["id"]: i["count"] for i in control.incidents(cfg.stream)} == {ids[0]: 3, other: 1, again: 1}


def test_concurrent_repeats_of_a_cause_make_one_incident(control_dsn, make_stream):
    """Many processes recording the same failure at once: one row, every occurrence counted."""
    import multiprocessing

    cfg = make_stream(["public.t"])
    with Control(control_dsn) as ctl:
        ctl.upsert_stream(cfg)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        ids = pool.starmap(_open_failure, [(control_dsn, cfg.stream, i) for i in range(16)])
    assert len(set(ids)) == 1
    with Control(control_dsn) as ctl:
        [inc] = ctl.incidents(cfg.stream)
    assert inc["count"] == 16


def _open_failure(dsn: str, stream: str, i: int) -> int:
    with Control(dsn) as ctl:
        return ctl.open_incident(stream, "consolidate_failed", _failure(f"2026-11-24T12:00:{i:02d}Z", seen=i))


def test_status_shows_the_count_and_last_seen(stream, tmp_path, capsys):
    import yaml

    from tidemark import cli
    from tidemark.control import open_control
    from tidemark.status import stream_status

    cfg = stream[0]
    with open_control(cfg) as ctl:
        for i in range(4):
            ctl.open_incident(cfg.stream, "consolidate_failed",
                              _failure(f"2026-11-24T12:0{i}:00Z", seen=i, table="public.items"))
    st = stream_status(cfg)
    [inc] = st["incidents"]
    assert inc["count"] == 4 and inc["last_seen_at"] > inc["opened_at"] and inc["table"] == "public.items"
    streams = tmp_path / "streams"
    streams.mkdir()
    (streams / f"{cfg.stream}.yaml").write_text(yaml.safe_dump(cfg.as_dict()))
    capsys.readouterr()
    assert cli.main(["--streams", str(streams), "status", cfg.stream]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "consolidate_failed" in ln)
    assert f"#{inc['id']} consolidate_failed public.items, seen 4 time(s)" in line
    assert "last seen 20" in line and "ValueError: bad row" in line


def test_control_connections_time_out_instead_of_hanging(control_dsn):
    from tidemark.control import Control

    with Control(control_dsn) as ctl:
        assert ctl.conn.get_dsn_parameters().get("connect_timeout") == "10"
    with Control(control_dsn + " connect_timeout=3") as ctl:          # the DSN's own setting wins
        assert ctl.conn.get_dsn_parameters().get("connect_timeout") == "3"
