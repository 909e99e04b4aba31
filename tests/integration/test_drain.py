"""The slot drain against a real PostgreSQL: whole transactions, TOAST, DDL, truncate, tiling,
re-drain determinism, the drain lock and the ack policy.

Expected values always come from PostgreSQL itself (SELECT through psycopg2), never from the
decoder's own parser."""

from __future__ import annotations

import threading
import time

import pytest

from oracle import start_at_new_slot
from tidemark.capture.drain import drain_stream, redrain_range
from tidemark.capture.replication import WalStream
from tidemark.errors import SlotLost, StreamBusy, TidemarkError
from tidemark.landing.segments import read_segment_at
from tidemark.capture.source import apply_stream, slot_info, source_dsn
from tidemark.landing.store import open_store, read_uri, stream_keys


@pytest.fixture
def capture(make_stream, source_conn, control):
    """Build a registered stream over tables created by ``ddl``, with its slot at a consistent point."""

    def factory(ddl: str, tables: list[str], **overrides):
        with source_conn.cursor() as cur:
            cur.execute(ddl)
        cfg = make_stream(tables, **overrides)
        start_at_new_slot(cfg, source_conn, control)
        return cfg

    return factory


def run(conn, *statements):
    with conn.cursor() as cur:
        for s in statements:
            cur.execute(s)


def content(result):
    return read_segment_at(result.uri)


def confirmed(cfg) -> int | None:
    return slot_info(cfg).confirmed_flush_lsn


def test_transaction_over_three_tables_lands_whole_and_rollbacks_never_appear(capture, source_conn, control):
    cfg = capture("CREATE TABLE a (id int PRIMARY KEY, v text); CREATE TABLE b (id int PRIMARY KEY, v text);"
                  "CREATE TABLE c (id int PRIMARY KEY, v text)", ["public.a", "public.b", "public.c"])
    source_conn.autocommit = False
    with source_conn.cursor() as cur:
        cur.execute("SELECT txid_current()")
        xid = cur.fetchone()[0]
        cur.execute("INSERT INTO a VALUES (1, 'a1')")
        cur.execute("SAVEPOINT s1")
        cur.execute("INSERT INTO b VALUES (99, 'rolled back savepoint')")
        cur.execute("ROLLBACK TO SAVEPOINT s1")
        cur.execute("INSERT INTO b VALUES (1, 'b1')")
        cur.execute("UPDATE a SET v = 'a1x' WHERE id = 1")
        cur.execute("INSERT INTO c VALUES (1, 'c1')")
    source_conn.commit()
    with source_conn.cursor() as cur:
        cur.execute("INSERT INTO c VALUES (98, 'rolled back transaction')")
    source_conn.rollback()
    source_conn.autocommit = True
    res = drain_stream(cfg)
    seg = content(res)
    assert (res.txns, res.records, res.registered, res.empty) == (1, 5, True, False)
    assert len({u.time for u in seg.updates}) == 1 and len({u.xid for u in seg.updates}) == 1
    assert [u.position for u in seg.updates] == [0, 1, 2, 3, 4]
    assert [(u.table.name, u.diff, u.row.get("id"), u.row.get("v"), u.image) for u in seg.updates] == [
        ("a", 1, 1, "a1", "full"), ("b", 1, 1, "b1", "full"),
        ("a", -1, 1, None, "key"), ("a", 1, 1, "a1x", "full"), ("c", 1, 1, "c1", "full")]
    assert seg.counts == {seg.updates[0].time: 5}
    assert seg.updates[0].xid == xid
    state = control.stream(cfg.stream)
    assert (state.landed_upper, state.next_seq) == (res.upper, 1)


def test_transaction_larger_than_logical_decoding_work_mem_lands_whole(capture, source_conn):
    cfg = capture("CREATE TABLE big (id int PRIMARY KEY, pad text)", ["public.big"])
    run(source_conn, "INSERT INTO big SELECT g, repeat(md5(g::text), 4) FROM generate_series(1, 25000) g")
    res = drain_stream(cfg, extra_options="-c logical_decoding_work_mem=64kB")
    seg = content(res)
    assert res.txns == 1 and res.records == 25000
    assert [u.position for u in seg.updates] == list(range(25000))
    with source_conn.cursor() as cur:
        cur.execute("SELECT id, pad FROM big ORDER BY id")
        assert [(u.row["id"], u.row["pad"]) for u in seg.updates] == cur.fetchall()

    def spilled() -> bool:   # it really was spilled to disk by the walsender
        with source_conn.cursor() as cur:
            cur.execute("SELECT spill_txns FROM pg_stat_replication_slots WHERE slot_name = %s", (cfg.source.slot,))
            row = cur.fetchone()
        return bool(row and row[0])

    assert _eventually(spilled)


def test_untouched_toast_column_is_marked_unchanged_not_empty(capture, source_conn):
    cfg = capture("CREATE TABLE doc (id int PRIMARY KEY, body text, n int)", ["public.doc"])
    run(source_conn, "ALTER TABLE doc ALTER COLUMN body SET STORAGE EXTERNAL",
        "INSERT INTO doc SELECT 1, string_agg(md5(g::text), '') FROM generate_series(1, 400) g",
        "UPDATE doc SET n = 5 WHERE id = 1",
        "DELETE FROM doc WHERE id = 1")
    seg = content(drain_stream(cfg))
    ins, upd_old, upd_new, dele = seg.updates
    with source_conn.cursor() as cur:
        cur.execute("SELECT string_agg(md5(g::text), '') FROM generate_series(1, 400) g")
        body = cur.fetchone()[0]
    assert ins.row == {"id": 1, "body": body, "n": None} and ins.unchanged_toast == ()
    assert (upd_old.diff, upd_old.image, upd_old.row) == (-1, "key", {"id": 1, "body": None, "n": None})
    assert (upd_new.diff, upd_new.image) == (1, "full")
    assert upd_new.unchanged_toast == ("body",) and upd_new.row == {"id": 1, "body": None, "n": 5}
    assert (dele.diff, dele.image, dele.row["id"]) == (-1, "key", 1)


def test_replica_identity_full_and_key_change_send_old_images(capture, source_conn):
    cfg = capture("CREATE TABLE f (id int, v text); ALTER TABLE f REPLICA IDENTITY FULL;"
                  "CREATE TABLE k (id int PRIMARY KEY, v text)", ["public.f", "public.k"])
    run(source_conn, "INSERT INTO f VALUES (1, 'x')", "UPDATE f SET v = 'y'", "DELETE FROM f",
        "INSERT INTO k VALUES (1, 'x')", "UPDATE k SET id = 2")
    ups = content(drain_stream(cfg)).updates
    got = [(u.table.name, u.diff, u.image, u.row) for u in ups]
    assert got == [
        ("f", 1, "full", {"id": 1, "v": "x"}),
        ("f", -1, "full", {"id": 1, "v": "x"}), ("f", 1, "full", {"id": 1, "v": "y"}),
        ("f", -1, "full", {"id": 1, "v": "y"}),
        ("k", 1, "full", {"id": 1, "v": "x"}),
        ("k", -1, "key", {"id": 1, "v": None}), ("k", 1, "full", {"id": 2, "v": "x"}),
    ]


def test_add_and_drop_column_mid_stream_change_the_shape(capture, source_conn):
    cfg = capture("CREATE TABLE t (id int PRIMARY KEY, a text)", ["public.t"])
    run(source_conn, "INSERT INTO t VALUES (1, 'one')",
        "ALTER TABLE t ADD COLUMN b numeric(6,2)", "INSERT INTO t VALUES (2, 'two', 2.5)",
        "ALTER TABLE t DROP COLUMN a", "INSERT INTO t VALUES (3, 3.25)", "UPDATE t SET b = 1 WHERE id = 1")
    seg = content(drain_stream(cfg))
    shapes = [tuple(c.name for c in u.table.columns) for u in seg.updates]
    assert shapes == [("id", "a"), ("id", "a", "b"), ("id", "b"), ("id", "b"), ("id", "b")]
    assert len(seg.relations) == 3
    assert [u.row for u in seg.updates] == [{"id": 1, "a": "one"}, {"id": 2, "a": "two", "b": "2.50"},
                                            {"id": 3, "b": "3.25"}, {"id": 1, "b": None}, {"id": 1, "b": "1.00"}]
    with source_conn.cursor() as cur:
        cur.execute("SELECT id, b::text FROM t ORDER BY id")
        assert cur.fetchall() == [(1, "1.00"), (2, "2.50"), (3, "3.25")]


def test_truncate_is_an_event_ordered_among_updates(capture, source_conn):
    cfg = capture("CREATE TABLE p (id serial PRIMARY KEY); CREATE TABLE q (id int PRIMARY KEY)",
                  ["public.p", "public.q"])
    run(source_conn, "INSERT INTO p DEFAULT VALUES", "INSERT INTO q VALUES (1)")
    source_conn.autocommit = False
    run(source_conn, "INSERT INTO q VALUES (2)", "TRUNCATE p, q RESTART IDENTITY", "INSERT INTO q VALUES (3)")
    source_conn.commit()
    source_conn.autocommit = True
    seg = content(drain_stream(cfg))
    t = max(u.time for u in seg.updates)
    events = [(e.kind, e.table, e.position, e.detail) for e in seg.events]
    assert events == [("truncate", "public.p", 1, {"cascade": False, "restart_identity": True}),
                      ("truncate", "public.q", 2, {"cascade": False, "restart_identity": True})]
    assert all(e.time == t for e in seg.events)
    assert [(u.position, u.row["id"]) for u in seg.updates if u.time == t] == [(0, 2), (3, 3)]
    assert seg.counts[t] == 4


def test_segments_tile_and_redrain_is_byte_identical(capture, source_conn, control):
    cfg = capture("CREATE TABLE t (id int PRIMARY KEY, v int)", ["public.t"])
    results = []
    run(source_conn, "INSERT INTO t SELECT g, 0 FROM generate_series(1, 30) g")
    results.append(drain_stream(cfg))
    results.append(drain_stream(cfg))                   # idle: a progress-only segment
    for i in range(6):
        run(source_conn, f"UPDATE t SET v = v + 1 WHERE id % 6 = {i}")
    results.append(drain_stream(cfg, max_changes=10))   # one run: segments end at the commit reaching 10 changes
    results.append(drain_stream(cfg))
    run(source_conn, "DELETE FROM t WHERE id > 25")
    results.append(drain_stream(cfg))
    segs = control.segments(cfg.stream)
    landed = [p for r in results for p in r.segments if p.registered]
    assert [s.seq for s in segs] == list(range(len(segs))) == [p.seq for p in landed]
    for prev, nxt in zip(segs, segs[1:]):
        assert prev.upper == nxt.lower
    assert results[1].empty and results[1].records == 0 and results[1].upper > results[1].lower
    assert [p.txns for p in results[2].segments if p.records] == [2, 2, 2] and results[2].txns == 6
    # every change exactly once: replaying the segments gives the table
    state: dict[int, int] = {}
    seen = set()
    for s in segs:
        c = read_segment_at(s.uri)
        assert (c.lower, c.upper) == (s.lower, s.upper)
        for u in c.updates:
            assert (u.time, u.position) not in seen
            seen.add((u.time, u.position))
            if u.diff == 1:
                state[u.row["id"]] = u.row["v"]
            else:
                state.pop(u.row["id"])
    with source_conn.cursor() as cur:
        cur.execute("SELECT id, v FROM t")
        assert state == dict(cur.fetchall())
    # re-drain each range after deleting its file: the same bytes come back
    store = open_store(cfg.landing.url)
    for s in segs:
        key = stream_keys(cfg.stream)["segments"] + s.uri.rsplit("/", 1)[1]
        before = store.get(key)
        store.delete(key)
        again = redrain_range(cfg, seq=s.seq, lower=s.lower, upper=s.upper)
        assert store.get(key) == before
        assert (again.registered, again.records, again.txns) == (False, s.record_count, s.txn_count)
    assert confirmed(cfg) == control.stream(cfg.stream).consistent_lsn   # frontier is NULL: never acked


def test_redrain_fills_a_missing_segment(capture, source_conn, control):
    cfg = capture("CREATE TABLE t (id int PRIMARY KEY)", ["public.t"])
    run(source_conn, "INSERT INTO t VALUES (1)")
    first = drain_stream(cfg)
    run(source_conn, "INSERT INTO t VALUES (2)")
    drain_stream(cfg)
    data = read_uri(first.uri)
    with control.tx() as cur:          # the manifest lost segment 0 and its file is gone
        cur.execute("DELETE FROM tidemark.segments WHERE stream = %s AND seq = 0", (cfg.stream,))
    open_store(cfg.landing.url).delete(stream_keys(cfg.stream)["segments"] + first.uri.rsplit("/", 1)[1])
    again = redrain_range(cfg, seq=0, lower=first.lower, upper=first.upper)
    assert again.registered and read_uri(again.uri) == data
    assert [s.origin for s in control.segments(cfg.stream)] == ["repair", "drain"]


def test_second_drain_is_refused(capture, source_conn, control, monkeypatch):
    import tidemark.capture.drain as drain_mod

    monkeypatch.setattr(drain_mod, "SLOT_BUSY_WAIT_SECONDS", 1.0)
    cfg = capture("CREATE TABLE t (id int PRIMARY KEY)", ["public.t"])
    with control.stream_lock(cfg.stream, "drain"):
        with pytest.raises(StreamBusy, match="another drain is already running"):
            drain_stream(cfg)
    # a foreign consumer holding the slot: refused with the server's reason
    ws = WalStream(source_dsn(cfg))
    try:
        ws.start(cfg.source.slot, control.stream(cfg.stream).landed_upper, cfg.source.publication)
        with pytest.raises(StreamBusy, match="in use by another process"):
            drain_stream(cfg)
    finally:
        ws.close()
    assert control.segments(cfg.stream) == []


def test_a_slot_held_for_moments_is_waited_for(capture, source_conn, control):
    """A consolidation advancing the slot, or the last drain's walsender exiting, holds it for moments:
    the drain asks again instead of failing (its task's retry would come 30 s later)."""
    cfg = capture("CREATE TABLE t (id int PRIMARY KEY)", ["public.t"])
    run(source_conn, "INSERT INTO t VALUES (1)")
    ws = WalStream(source_dsn(cfg))
    ws.start(cfg.source.slot, control.stream(cfg.stream).landed_upper, cfg.source.publication)
    holder = threading.Timer(1.5, ws.close)
    holder.start()
    try:
        t0 = time.monotonic()
        result = drain_stream(cfg)
        assert time.monotonic() - t0 >= 1.0 and result.registered and result.records == 1
    finally:
        holder.join()


def test_concurrent_drains_one_wins(capture, source_conn, control):
    cfg = capture("CREATE TABLE t (id int PRIMARY KEY)", ["public.t"], drain={"idle_timeout_seconds": 1.0})
    run(source_conn, "INSERT INTO t SELECT generate_series(1, 20000)")
    outcomes: list = []

    def one():
        try:
            outcomes.append(drain_stream(cfg))
        except StreamBusy as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = [o for o in outcomes if not isinstance(o, Exception)]
    assert len(results) >= 1
    segs = control.segments(cfg.stream)
    assert [s.seq for s in segs] == list(range(len(segs)))
    assert sum(s.record_count for s in segs) == 20000


def test_ack_policy_frontier_and_landed(capture, source_conn, control):
    cfg = capture("CREATE TABLE t (id int PRIMARY KEY)", ["public.t"])
    start = confirmed(cfg)
    run(source_conn, "INSERT INTO t VALUES (1)")
    first = drain_stream(cfg)
    run(source_conn, "INSERT INTO t VALUES (2)")
    drain_stream(cfg)
    assert confirmed(cfg) == start           # frontier NULL: never acknowledged
    control.advance_frontier(cfg.stream, first.upper)
    run(source_conn, "INSERT INTO t VALUES (3)")
    third = drain_stream(cfg)
    assert _eventually(lambda: confirmed(cfg) == first.upper)
    assert confirmed(cfg) < third.upper       # landed beyond the frontier, not acknowledged

    landed_cfg = capture("CREATE TABLE u (id int PRIMARY KEY)", ["public.u"], drain={"ack_policy": "landed"})
    run(source_conn, "INSERT INTO u VALUES (1)")
    res = drain_stream(landed_cfg)
    assert _eventually(lambda: confirmed(landed_cfg) == res.upper)


def _eventually(check, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_drain_reports_progress_and_refuses_without_consistent_point(capture, make_stream, control):
    cfg = capture("CREATE TABLE t (id int PRIMARY KEY)", ["public.t"])
    calls = []
    drain_stream(cfg, progress=calls.append)
    assert calls and set(calls[-1]) >= {"records", "txns", "bytes", "lsn"}
    bare = make_stream(["public.t"])
    apply_stream(bare)
    with pytest.raises(TidemarkError, match="no consistent point"):
        drain_stream(bare)


def test_slot_confirmed_past_landed_upper_is_slot_lost(capture, source_conn, control):
    cfg = capture("CREATE TABLE t (id int PRIMARY KEY)", ["public.t"])
    run(source_conn, "SET synchronous_commit = on", "INSERT INTO t VALUES (1)")
    with source_conn.cursor() as cur:
        cur.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())", (cfg.source.slot,))
    with pytest.raises(SlotLost, match="can no longer be replayed"):
        drain_stream(cfg)
