"""One drain run lands everything committed before it started, in bounded segments: the backlog is
not capped by ``max_changes`` (a segment's size), a run killed between segments resumes with no gap
and no duplicate, and a transaction still open in the source does not hold the run back.

Expected values come from PostgreSQL itself (SELECT through psycopg2) and, for the lake, from a
consolidation compared with the source."""

from __future__ import annotations

import time

import psycopg2
import pytest

from test_gaps_kit import create_items, items_schema, start_stream
from refapply import arrow_rows, source_rows
from tidemark.capture import drain as drain_mod
from tidemark.capture.drain import drain_stream
from tidemark.capture.source import slot_info
from tidemark.control import Control, control_dsn
from tidemark.landing.segments import read_segment_at
from tidemark.landing.store import read_uri

MAX_CHANGES = 100
TXN_CHANGES = 10            # each workload transaction: 10 changes (one record per change, or two for an update)


def _workload(conn, txns: int, start: int) -> None:
    """``txns`` committed transactions of ``TXN_CHANGES`` changes each on ``public.items``: inserts, then
    updates and deletes of rows inserted before."""
    with conn.cursor() as cur:
        for t in range(txns):
            base = start + t * TXN_CHANGES
            cur.execute("BEGIN")
            for i in range(TXN_CHANGES - 2):
                cur.execute("INSERT INTO public.items VALUES (%s, %s)", (base + i, f"v{base + i}"))
            cur.execute("UPDATE public.items SET v = v || '+' WHERE id = %s", (base,))
            cur.execute("DELETE FROM public.items WHERE id = %s", (base + 1,))
            cur.execute("COMMIT")


def _segments(cfg):
    with Control(control_dsn(cfg)) as ctl:
        return ctl.segments(cfg.stream)


def _replay(cfg, segs) -> dict[int, str]:
    """Apply every update of the segments in order (keyed by id); each (time, position) must occur once."""
    state: dict[int, str] = {}
    seen: set[tuple[int, int]] = set()
    for s in segs:
        c = read_segment_at(s.uri)
        assert (c.lower, c.upper) == (s.lower, s.upper)
        for u in c.updates:
            assert (u.time, u.position) not in seen, f"segment {s.seq} repeats {(u.time, u.position)}"
            seen.add((u.time, u.position))
            if u.diff == 1:
                state[u.row["id"]] = u.row["v"]
            else:
                state.pop(u.row["id"])
    return state


def _source(conn) -> dict[int, str]:
    with conn.cursor() as cur:
        cur.execute("SELECT id, v FROM public.items")
        return dict(cur.fetchall())


def _eventually(check, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def _contiguous(segs, start: int) -> None:
    assert [s.seq for s in segs] == list(range(len(segs)))
    assert segs[0].lower == start
    for prev, nxt in zip(segs, segs[1:]):
        assert nxt.lower == prev.upper, (prev, nxt)


@pytest.mark.spark
@pytest.mark.slow
def test_one_drain_lands_a_backlog_in_bounded_segments_and_the_lake_equals_the_source(make_stream, source_conn,
                                                                                       spark):
    from oracle import consolidate
    from tidemark.capture.snapshot import snapshot_stream
    from tidemark.lake import read_table

    create_items(source_conn)
    with source_conn.cursor() as cur:
        cur.execute("SET synchronous_commit = on")
        cur.execute("INSERT INTO public.items SELECT g, 's' || g FROM generate_series(100000, 100049) g")
    cfg = make_stream(["public.items"], drain={"idle_timeout_seconds": 0.5, "max_changes": MAX_CHANGES})
    snapshot_stream(cfg)
    with Control(control_dsn(cfg)) as ctl:
        start = ctl.stream(cfg.stream).landed_upper
    _workload(source_conn, 35, 0)                   # 350 changes > 3 x max_changes
    res = drain_stream(cfg)                          # ONE call
    segs = _segments(cfg)
    _contiguous(segs, start)
    data = [s for s in res.segments if s.records]
    assert len(data) >= 3, res
    assert [(p.seq, p.lower, p.upper) for p in res.segments] == [(s.seq, s.lower, s.upper) for s in segs]
    assert all(p.registered for p in res.segments)
    # each segment stops at the first commit that reaches max_changes: 10 transactions of 10 changes
    assert [p.txns for p in data] == [10, 10, 10, 5]
    assert [p.changes for p in data] == [100, 100, 100, 50] and res.changes == 350
    assert (res.lower, res.upper, res.txns) == (start, segs[-1].upper, 35)
    assert res.records == sum(s.record_count for s in segs) == 35 * (TXN_CHANGES + 1)
    assert _replay(cfg, segs) == {k: v for k, v in _source(source_conn).items() if k < 100000}
    consolidate(cfg, spark)
    table = items_schema(cfg)
    assert sorted(arrow_rows(read_table(cfg, "public.items"))) == sorted(source_rows(source_conn, table))


class _Killed(Exception):
    pass


def test_a_run_killed_between_segments_resumes_with_no_gap_or_duplicate(make_stream, source_conn, monkeypatch):
    create_items(source_conn)
    cfg = make_stream(["public.items"], drain={"max_changes": MAX_CHANGES, "ack_policy": "landed",
                                               "idle_timeout_seconds": 0.5})
    start = start_stream(cfg)
    _workload(source_conn, 45, 0)                   # 450 changes: segments of 10, 10, 10, 10, 5 transactions
    real_land = drain_mod._land
    landed = []

    def land_then_die(*args, **kwargs):
        out = real_land(*args, **kwargs)
        landed.append(out)
        if len(landed) == 2:
            raise _Killed("killed after the 2nd segment was registered")
        return out

    monkeypatch.setattr(drain_mod, "_land", land_then_die)
    with pytest.raises(_Killed):
        drain_stream(cfg)
    monkeypatch.setattr(drain_mod, "_land", real_land)
    segs = _segments(cfg)
    assert len(segs) == 2 and all(s.record_count for s in segs)
    _contiguous(segs, start)
    with Control(control_dsn(cfg)) as ctl:
        assert ctl.stream(cfg.stream).landed_upper == segs[-1].upper
    assert _eventually(lambda: slot_info(cfg).confirmed_flush_lsn == segs[0].upper)   # acked as the 1st landed
    res = drain_stream(cfg)
    assert res.seq == 2 and res.lower == segs[-1].upper
    segs = _segments(cfg)
    _contiguous(segs, start)
    assert sum(s.txn_count for s in segs) == 45
    assert _replay(cfg, segs) == _source(source_conn)
    again = drain_stream(cfg)                       # a retry with nothing new changes nothing
    assert again.records == 0 and again.lower == segs[-1].upper
    assert _replay(cfg, _segments(cfg)) == _source(source_conn)


def test_a_transaction_open_in_the_source_does_not_hold_the_run(make_stream, source_conn, source_db):
    create_items(source_conn)
    cfg = make_stream(["public.items"], drain={"max_changes": MAX_CHANGES, "idle_timeout_seconds": 0.5,
                                               "stall_timeout_seconds": 20})
    start = start_stream(cfg)
    other = psycopg2.connect(source_db)
    try:
        with other.cursor() as cur:              # open, with changes, never committed during the run
            cur.execute("INSERT INTO public.items SELECT g, 'open' FROM generate_series(900000, 900999) g")
        _workload(source_conn, 25, 0)
        t = time.monotonic()
        res = drain_stream(cfg)
        assert time.monotonic() - t < 15
        assert res.txns == 25 and len([p for p in res.segments if p.records]) == 3
        assert _replay(cfg, _segments(cfg)) == _source(source_conn)
        other.commit()
    finally:
        other.close()
    res = drain_stream(cfg)
    assert res.records == 1000 and res.lower > start
    assert _replay(cfg, _segments(cfg)) == _source(source_conn)


@pytest.mark.parametrize("codec", ["zstandard", "deflate", "null"])
def test_segments_are_written_with_the_streams_codec_and_read_the_same(make_stream, source_conn, codec):
    import fastavro
    import io

    create_items(source_conn)
    cfg = make_stream(["public.items"], landing={"codec": codec}, drain={"idle_timeout_seconds": 0.5})
    start_stream(cfg)
    _workload(source_conn, 30, 0)
    res = drain_stream(cfg)
    data = read_uri(res.uri)
    assert fastavro.reader(io.BytesIO(data)).metadata["avro.codec"] == codec
    assert sum(1 for _ in fastavro.reader(io.BytesIO(data))) == res.txns + 1      # one array per txn + progress
    assert _replay(cfg, _segments(cfg)) == _source(source_conn)
    per_record = res.byte_size / res.records
    assert per_record < 30 if codec != "null" else per_record > 40, per_record


def test_a_slow_landing_store_does_not_lose_the_replication_connection(make_stream, source_conn, monkeypatch):
    """The walsender drops a client silent for wal_sender_timeout: while a segment lands (an upload to
    S3 may take long) the drain keeps telling it that it is alive, and the run's next segments come."""
    create_items(source_conn)
    cfg = make_stream(["public.items"], drain={"max_changes": MAX_CHANGES, "idle_timeout_seconds": 0.5})
    start_stream(cfg)
    _workload(source_conn, 25, 0)
    real_land = drain_mod._land

    def slow_land(*args, **kwargs):
        time.sleep(3.0)
        return real_land(*args, **kwargs)

    monkeypatch.setattr(drain_mod, "_land", slow_land)
    res = drain_stream(cfg, extra_options="-c wal_sender_timeout=1s")
    assert res.txns == 25 and len([p for p in res.segments if p.records]) == 3
    assert _replay(cfg, _segments(cfg)) == _source(source_conn)


def test_the_cli_lists_the_runs_segments(tmp_path, make_stream, source_conn, capsys):
    import json

    import yaml

    from tidemark import cli

    create_items(source_conn)
    cfg = make_stream(["public.items"], drain={"idle_timeout_seconds": 0.5})
    start_stream(cfg)
    path = tmp_path / "streams" / f"{cfg.stream}.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(cfg.as_dict()))
    _workload(source_conn, 12, 0)
    assert cli.main(["--streams", str(path.parent), "drain", cfg.stream, "--max-changes", "50", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    segs = _segments(cfg)
    assert [(p["seq"], p["lower"], p["upper"], p["uri"]) for p in out["segments"]] == \
        [(s.seq, s.lower, s.upper, s.uri) for s in segs]
    assert [p["txns"] for p in out["segments"] if p["records"]] == [5, 5, 2] and out["changes"] == 120
    _workload(source_conn, 6, 1000)
    assert cli.main(["--streams", str(path.parent), "drain", cfg.stream, "--max-changes", "50"]) == 0
    text = capsys.readouterr().out
    assert "55 records in 5 transactions" in text and "2 segments [" in text and "66 records in 6 transactions" in text
