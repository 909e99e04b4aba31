"""Snapshot-copy against a real PostgreSQL: exported snapshot, parallel ctid chunks, counts, retries,
locking, modes, and every type's lake value compared with PostgreSQL's own output."""

from __future__ import annotations

import decimal
import json
import struct
import threading
from collections import Counter

import psycopg2
import pytest

from refapply import arrow_rows, source_counter
from tidemark.errors import StreamBusy
from tidemark.capture.snapshot import SnapshotError, load_manifest, read_snapshot_table, snapshot_stream
from tidemark.capture.source import drop_slot, slot_info
from tidemark.landing.store import open_store



def _snapshot_rows(cfg, result, table: str) -> Counter:
    store = open_store(cfg.landing.url)
    manifest = load_manifest(store, cfg.stream, result.snapshot_id)
    return Counter(arrow_rows(read_snapshot_table(store, manifest, table)))


def _chunks(control, cfg, snapshot_id):
    with control.tx() as cur:
        cur.execute("""SELECT table_name, chunk_no, page_lo, page_hi, status, row_count, error
                         FROM tidemark.snapshot_chunks WHERE stream = %s AND snapshot_id = %s
                        ORDER BY table_name, chunk_no""", (cfg.stream, snapshot_id))
        return cur.fetchall()


@pytest.fixture
def accounts(source_conn):
    with source_conn.cursor() as cur:
        cur.execute("""CREATE TABLE acc (id int PRIMARY KEY, v int NOT NULL, s text);
                       INSERT INTO acc SELECT g, g * 10, repeat('x', g % 50) FROM generate_series(1, 3000) g;
                       CREATE TABLE bag (a int, b text);
                       ALTER TABLE bag REPLICA IDENTITY FULL;
                       INSERT INTO bag SELECT g % 7, 'dup' FROM generate_series(1, 500) g;""")
    return ["public.acc", "public.bag"]


def test_snapshot_is_the_state_at_the_consistent_point_despite_concurrent_writes(make_stream, source_db,
                                                                                 source_conn, control, accounts):
    cfg = make_stream(accounts)
    before = {t: source_counter(source_db, t) for t in accounts}
    writer = psycopg2.connect(source_db)
    writer.autocommit = True
    calls: list[tuple[str, int, int]] = []
    lock = threading.Lock()

    def hook(chunk, attempt):
        with lock:
            calls.append((chunk.table, chunk.chunk_no, attempt))
            first = len(calls) == 1
        if first:   # change rows that later chunks have not copied yet, and committed rows they have
            with writer.cursor() as cur:
                cur.execute("UPDATE acc SET v = -v, s = 'changed' WHERE id % 3 = 0")
                cur.execute("DELETE FROM acc WHERE id % 5 = 0")
                cur.execute("INSERT INTO acc SELECT g, 1, 'new' FROM generate_series(3001, 3500) g")
                cur.execute("DELETE FROM bag WHERE a = 3")
                cur.execute("INSERT INTO bag SELECT 99, 'late' FROM generate_series(1, 50)")

    seen_progress = []
    result = snapshot_stream(cfg, chunk_pages=2, parallelism=2, chunk_hook=hook, progress=seen_progress.append)
    writer.close()

    n_chunks = {t: sum(1 for c in calls if c[0] == t) for t in accounts}
    assert n_chunks["public.acc"] > 4, "the test needs several chunks"
    for t in accounts:
        assert source_counter(source_db, t) != before[t], "the concurrent writes did not happen"
        assert _snapshot_rows(cfg, result, t) == before[t]
        assert result.tables[t] == sum(before[t].values())
    # the manifest, the control rows and the stream agree
    store = open_store(cfg.landing.url)
    manifest = load_manifest(store, cfg.stream, result.snapshot_id)
    assert manifest["lsn"] == result.lsn and manifest["mode"] == "initial"
    assert {t: e["rows"] for t, e in manifest["tables"].items()} == result.tables
    assert manifest["tables"]["public.acc"]["table_schema"]["columns"][0]["key"] is True
    chunks = _chunks(control, cfg, result.snapshot_id)
    assert all(c[4] == "done" for c in chunks)
    assert sum(c[5] for c in chunks if c[0] == "public.acc") == result.tables["public.acc"]
    assert [c[3] for c in chunks if c[0] == "public.acc"][-1] is None  # last chunk open-ended
    state = control.stream(cfg.stream)
    assert state.consistent_lsn == result.lsn == state.landed_upper
    assert state.state == "capturing"
    assert state.frontier is None
    with control.tx() as cur:
        cur.execute("SELECT status, lsn, tables FROM tidemark.snapshots WHERE stream = %s", (cfg.stream,))
        (status, lsn, tables), = cur.fetchall()
    assert status == "complete" and lsn == result.lsn and tables["public.bag"]["rows"] == result.tables["public.bag"]
    info = slot_info(cfg)
    assert info is not None and info.confirmed_flush_lsn == result.lsn and not info.active
    assert seen_progress[-1]["total_rows"] == sum(result.tables.values())
    assert {p["table"] for p in seen_progress} == set(accounts)


def test_failed_chunk_is_retried_alone(make_stream, source_db, control, accounts):
    cfg = make_stream(accounts)
    calls: list[tuple[str, int, int]] = []
    lock = threading.Lock()

    def hook(chunk, attempt):
        with lock:
            calls.append((chunk.table, chunk.chunk_no, attempt))
        if chunk.table == "public.acc" and chunk.chunk_no == 2 and attempt == 1:
            raise RuntimeError("injected failure")

    result = snapshot_stream(cfg, chunk_pages=3, parallelism=2, chunk_hook=hook)
    per_chunk = Counter((t, n) for t, n, _ in calls)
    assert per_chunk[("public.acc", 2)] == 2
    assert all(v == 1 for k, v in per_chunk.items() if k != ("public.acc", 2))
    assert ("public.acc", 2, 2) in calls
    assert _snapshot_rows(cfg, result, "public.acc") == source_counter(source_db, "public.acc")
    chunks = _chunks(control, cfg, result.snapshot_id)
    assert all(c[4] == "done" for c in chunks)


def test_chunk_failing_every_time_fails_the_snapshot_and_drops_the_slot(make_stream, control, accounts):
    cfg = make_stream(accounts)

    def hook(chunk, attempt):
        if chunk.table == "public.bag":
            raise RuntimeError("disk on fire")

    with pytest.raises(SnapshotError, match=r"public\.bag chunk 0 .*failed after 3 attempt.*disk on fire"):
        snapshot_stream(cfg, chunk_pages=4, parallelism=2, chunk_hook=hook)
    assert slot_info(cfg) is None
    with control.tx() as cur:
        cur.execute("SELECT status, snapshot_id FROM tidemark.snapshots WHERE stream = %s", (cfg.stream,))
        (status, failed_id), = cur.fetchall()
    assert status == "failed"
    assert list(open_store(cfg.landing.url).list(f"{cfg.stream}/snapshots/{failed_id}/")) == []
    state = control.stream(cfg.stream)
    assert state.consistent_lsn is None and state.landed_upper is None
    assert state.state == "new"
    # a new initial snapshot is allowed after a failed one
    result = snapshot_stream(cfg, chunk_pages=4, parallelism=2)
    assert result.tables["public.bag"] == 500


def test_second_snapshot_is_refused_while_one_runs(make_stream, accounts):
    cfg = make_stream(accounts)
    refused = []

    def hook(chunk, attempt):
        if not refused:
            with pytest.raises(StreamBusy, match="snapshot"):
                snapshot_stream(cfg, tables=["public.bag"])
            refused.append(chunk)

    snapshot_stream(cfg, chunk_pages=50, parallelism=1, chunk_hook=hook)
    assert refused


def test_modes_initial_refuses_then_resend_moves_the_consistent_point(make_stream, source_conn, control, accounts):
    cfg = make_stream(accounts)
    first = snapshot_stream(cfg, tables=[])
    assert first.tables == {}
    state = control.stream(cfg.stream)
    assert state.consistent_lsn == first.lsn == state.landed_upper
    with pytest.raises(SnapshotError, match="resend"):
        snapshot_stream(cfg)
    control.advance_frontier(cfg.stream, first.lsn)
    with source_conn.cursor() as cur:
        cur.execute("UPDATE acc SET v = 0 WHERE id < 10")
    # one table again while the slot is intact: online (mode table), the slot and positions untouched
    one = snapshot_stream(cfg, tables=["public.acc"], mode="resend")
    assert set(one.tables) == {"public.acc"} and one.lsn > first.lsn
    assert slot_info(cfg).confirmed_flush_lsn == first.lsn and control.stream(cfg.stream).consistent_lsn == first.lsn
    second = snapshot_stream(cfg, tables=["public.acc", "public.bag"], mode="resend")
    assert second.lsn > first.lsn and set(second.tables) == {"public.acc", "public.bag"}
    state = control.stream(cfg.stream)
    assert state.consistent_lsn == second.lsn == state.landed_upper
    assert state.frontier == first.lsn   # the consolidation moves it when it loads the snapshot
    assert slot_info(cfg).confirmed_flush_lsn == second.lsn
    with pytest.raises(SnapshotError, match="not one of the stream's tables"):
        snapshot_stream(cfg, tables=["public.nope"], mode="resend")
    drop_slot(cfg)        # without the slot a resend recreates it: a subset would lose the others' changes
    with pytest.raises(SnapshotError, match=r"every table of the stream .*public\.bag would lose the changes"):
        snapshot_stream(cfg, tables=["public.acc"], mode="resend")


def test_partitioned_table_is_copied_from_its_leaves(make_stream, source_conn, source_db):
    with source_conn.cursor() as cur:
        cur.execute("""CREATE TABLE ev (id int, day date, note text, PRIMARY KEY (id, day)) PARTITION BY RANGE (day);
                       CREATE TABLE ev_a PARTITION OF ev FOR VALUES FROM ('2020-01-01') TO ('2021-01-01');
                       CREATE TABLE ev_b PARTITION OF ev FOR VALUES FROM ('2021-01-01') TO ('2022-01-01');
                       INSERT INTO ev SELECT g, DATE '2020-01-01' + g, 'n' || g FROM generate_series(0, 700) g;""")
    cfg = make_stream(["public.ev"])
    result = snapshot_stream(cfg, chunk_pages=1)
    assert result.tables["public.ev"] == 701
    assert _snapshot_rows(cfg, result, "public.ev") == source_counter(source_db, "public.ev")


TYPES_DDL = '''
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN posint AS int4 CHECK (VALUE > 0);
CREATE DOMAIN dday AS date;
CREATE TABLE types (
    id int8 PRIMARY KEY, i2 int2, i4 int4, n numeric, n2 numeric(12, 3), f4 float4, f8 float8, b bool,
    t text, vc varchar(10), ch char(5), "Odd, ""name""" text, by bytea, d date, tm time, ts timestamp,
    tstz timestamptz, iv interval, u uuid, j json, jb jsonb, ai int4[], att text[], ad date[], ab bytea[],
    ats timestamptz[], e mood, dom posint, dd dday, p point, ttz timetz,
    gen int8 GENERATED ALWAYS AS (id * 2) STORED
);
ALTER TABLE types DROP COLUMN i4;
ALTER TABLE types ADD COLUMN i4 int4;
'''

TYPES_ROWS = """
INSERT INTO types (id) VALUES (1);
INSERT INTO types VALUES
 (2, -32768, 'NaN', 1.5, 'NaN', 'Infinity', true, '', 'varchar', 'ab', E'comma, "quote"\\nnewline', '\\x',
  'infinity', '24:00:00', 'infinity', '-infinity', '1 year 2 mons -3 days 04:05:06.789',
  'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{ "a" : [1, 2] }', '{"b": {"c": null}, "a": 1}',
  '{1,NULL,3}', '{"a,b","c\\"d",NULL,"NULL",""}', '{2020-01-01,NULL,infinity}', '{"\\\\x00ff",NULL}',
  '{"2020-01-01 00:00:00+02"}', 'happy', 7, '-infinity', '(1.5,2)', '12:00:00+05:30', DEFAULT, 2147483647),
 (3, 32767, '-123456789012345678901234567890.123456789012', -999999999.999, '-Infinity', '-0', false,
  'ünïcödé ☃ \t tab', '', '   ', '', '\\x000102fffe', '0044-03-15 BC', '00:00:00.000001',
  '0044-03-15 12:34:56.789012 BC', '2024-02-29 23:59:59.999999+00', 'P0D', '00000000-0000-0000-0000-000000000000',
  '[]', '[]', '{}', '{}', '{}', '{}', '{}', 'sad', 1, '2024-02-29', '(0,0)', '00:00:00-12', DEFAULT, -2147483648),
 (4, 0, '0.000000000000000000001', 0, 1.4e-45, 2.2250738585072014e-308, NULL, 'NULL', NULL, NULL, 'NULL', NULL,
  '1970-01-01', '13:14:15.5', '1970-01-01 00:00:00', '1969-12-31 23:59:59.999999+00', NULL, NULL,
  '"s"', 'null', NULL, '{NULL}', '{NULL}', NULL, NULL, NULL, NULL, NULL, NULL, NULL, DEFAULT, 0),
 (5, 1, 'Infinity', 123456789.123, 3.4028235e+38, 1.7976931348623157e+308, true, repeat('long ', 4000),
  'x', 'x', 'x', decode(repeat('ab', 5000), 'hex'), '1999-12-31', '23:59:59.999999', '294000-12-31 00:00:00',
  '4713-11-24 00:00:00+00 BC', 'P-1Y', 'ffffffff-ffff-ffff-ffff-ffffffffffff', '{"k": "\\u00e9"}', '{"k": "é"}',
  '{-2147483648,2147483647}', '{" spaced ","back\\\\slash"}', '{-infinity}', '{"\\\\x"}', '{infinity,NULL}',
  'ok', 2147483647, NULL, '(-1e300,1e-300)', '24:00:00+00', DEFAULT, 5);
INSERT INTO types (id, t, i2, f8, d, ts) SELECT g, 'row ' || g, (g % 1000)::int2, g / 7.0,
       DATE '2000-01-01' + g, TIMESTAMP '2000-01-01' + g * INTERVAL '1 second 1 microsecond'
  FROM generate_series(100, 1500) g;
"""


def test_types_survive_exactly_as_the_drain_canonical_values(make_stream, source_conn, source_db):
    with source_conn.cursor() as cur:
        cur.execute(TYPES_DDL)
        cur.execute(TYPES_ROWS)
    cfg = make_stream(["public.types"])
    result = snapshot_stream(cfg, chunk_pages=3, parallelism=2)
    assert result.tables["public.types"] == 5 + 1401
    store = open_store(cfg.landing.url)
    manifest = load_manifest(store, cfg.stream, result.snapshot_id)
    table = read_snapshot_table(store, manifest, "public.types")
    assert len(manifest["tables"]["public.types"]["files"]) > 3
    names = table.column_names
    assert "gen" not in names and names[-1] == "i4" and 'Odd, "name"' in names
    # 1. equal to the canonical route: SELECT ::text, parsed the drain's way, turned into lake values
    got = sorted(arrow_rows(table), key=lambda r: r[0])
    want = sorted(source_counter(source_db, "public.types").elements(), key=lambda r: r[0])
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for name, gv, wv in zip(names, g, w):
            assert gv == wv, f"row id={g[0]} column {name}: snapshot {gv!r} != canonical {wv!r}"
    # 2. equal to psycopg2's own values where Python has a natural type for them
    import pyarrow.compute as pc

    plain_names = ["id", "i2", "i4", "n2", "f4", "f8", "b", "t", "vc", "ch", "by", "u", "jb", "ai", "e", "dom"]
    lake = {r["id"]: r for r in table.select(plain_names).to_pylist()}
    ids = table.column("id")
    temporal_lake = {r["id"]: r for r in table.select(["id", "d", "ts", "tstz", "tm"]).filter(
        pc.or_(pc.equal(ids, 4), pc.greater_equal(ids, 100))).to_pylist()}
    conn = psycopg2.connect(source_db)
    with conn.cursor() as cur:
        cur.execute("""SELECT id, i2, i4, n2, f4, f8, b, t, vc, ch, by, u::text, jb, ai, e, dom
                         FROM types WHERE id <= 5 ORDER BY id""")
        plain = cur.fetchall()
        cur.execute("SELECT id, d, ts, tstz, tm FROM types WHERE id = 4 OR id >= 100 ORDER BY id")
        temporal = cur.fetchall()
    conn.close()
    for row in plain:
        want_row = dict(zip(plain_names, row))
        got_row = lake[row[0]]
        for name in plain_names:
            value, got_v = want_row[name], got_row[name]
            if name == "n2" and value is not None:
                value = decimal.Decimal(value)
            if name == "by" and value is not None:
                value = bytes(value)
            if name == "f4" and value is not None:
                value = struct.unpack("f", struct.pack("f", value))[0]   # psycopg2 reads float4 as a double
            if name == "jb" and got_v is not None:
                got_v = json.loads(got_v)
            if name in ("f4", "f8") and value is not None and value != value:
                assert got_v != got_v, f"id={row[0]} {name}: expected NaN, got {got_v!r}"
                continue
            assert got_v == value, f"id={row[0]} {name}: lake {got_v!r} != psycopg2 {value!r}"
    assert len(temporal) == 1402
    for id_, d, ts, tstz, tm in temporal:
        got_row = temporal_lake[id_]
        assert got_row["d"] == d and got_row["ts"] == ts, f"id={id_}"
        assert got_row["tstz"] == tstz
        assert got_row["tm"] == (None if tm is None else tm.strftime("%H:%M:%S.%f"))


def test_value_the_lake_type_cannot_hold_is_a_clear_error(make_stream, source_conn):
    with source_conn.cursor() as cur:
        cur.execute("""CREATE TABLE prices (id int PRIMARY KEY, amount numeric(6, 2));
                       INSERT INTO prices VALUES (1, 1.5), (2, 'NaN');""")
    cfg = make_stream(["public.prices"])
    with pytest.raises(SnapshotError, match=r"public\.prices chunk 0.*failed after 1 attempt.*column amount \(numeric, lake type decimal128\(6, 2\)\).*NaN"):
        snapshot_stream(cfg)
    assert slot_info(cfg) is None
