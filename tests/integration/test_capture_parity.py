"""Capture parity: the snapshot plus the drained changes after its consistent point reproduce every
table exactly (row for row against SELECT at the end), including rows changed while the snapshot was
being copied, key changes, unchanged TOAST values, duplicate rows, and truncates."""

from __future__ import annotations

import threading

import psycopg2

from refapply import apply_capture, arrow_rows, source_counter
from tidemark.pgtypes import TableSchema
from tidemark.landing.segments import read_segment_at
from tidemark.capture.snapshot import load_manifest, read_snapshot_table, snapshot_stream
from tidemark.control import open_control
from tidemark.capture.source import current_lsn
from tidemark.landing.store import open_store

from tidemark.capture.drain import drain_stream

TABLES = ["public.acc", "public.bag", "public.kinds", "public.small"]

SETUP = """
CREATE TYPE color AS ENUM ('red', 'green');
CREATE TABLE acc (id int PRIMARY KEY, v int NOT NULL, s text, doc text);
INSERT INTO acc SELECT g, g, 'row ' || g,
       CASE WHEN g % 50 = 0 THEN (SELECT string_agg(md5(g::text || i::text), '') FROM generate_series(1, 300) i) END
  FROM generate_series(1, 2000) g;
CREATE TABLE bag (a int, b text);
ALTER TABLE bag REPLICA IDENTITY FULL;
INSERT INTO bag SELECT g % 5, 'dup' FROM generate_series(1, 300) g;
CREATE TABLE kinds (id bigint PRIMARY KEY, n numeric, n2 numeric(8, 2), f float8, d date, ts timestamptz,
                    tm time, by bytea, arr int[], tags text[], c color, j jsonb, iv interval, p point);
INSERT INTO kinds SELECT g, g / 3.0, g / 4.0, g / 7.0, DATE '2000-01-01' + g, TIMESTAMPTZ '2000-01-01' + g * INTERVAL '1 hour',
       TIME '00:00' + g * INTERVAL '1 second', decode(md5(g::text), 'hex'), ARRAY[g, NULL, -g], ARRAY['t' || g, NULL],
       CASE WHEN g % 2 = 0 THEN 'red'::color ELSE 'green' END, jsonb_build_object('g', g), g * INTERVAL '1 minute',
       point(g, -g)
  FROM generate_series(1, 600) g;
CREATE TABLE small (k text PRIMARY KEY, v int);
INSERT INTO small VALUES ('a', 1), ('b', 2);
"""

DURING_COPY = """
UPDATE acc SET v = -v WHERE id % 7 = 0;
UPDATE acc SET v = v + 1 WHERE id % 50 = 0;                    -- doc is TOASTed and unchanged
UPDATE acc SET id = id + 100000 WHERE id % 11 = 0;             -- key changes
DELETE FROM acc WHERE id % 13 = 0;
INSERT INTO acc SELECT g, 0, 'during', NULL FROM generate_series(5001, 5300) g;
DELETE FROM bag WHERE ctid IN (SELECT ctid FROM bag WHERE a = 1 LIMIT 10);
INSERT INTO bag SELECT 7, 'during' FROM generate_series(1, 20);
UPDATE kinds SET n = 'NaN', f = '-Infinity', d = 'infinity', ts = '-infinity', arr = '{}', tags = NULL,
                 by = '\\x', j = '[1, {"x": null}]' WHERE id % 9 = 0;
DELETE FROM kinds WHERE id % 10 = 0;
"""

AFTER_COPY = """
BEGIN;
UPDATE acc SET s = 'after', v = v * 2 WHERE id % 5 = 0;
UPDATE acc SET doc = 'short now' WHERE id = 100;
INSERT INTO acc VALUES (9000, 1, 'x', NULL);
UPDATE acc SET id = 9001 WHERE id = 9000;
DELETE FROM acc WHERE id = 9001;
COMMIT;
UPDATE bag SET b = 'after' WHERE a = 2;
DELETE FROM bag WHERE a = 3;
TRUNCATE small;
INSERT INTO small VALUES ('c', 3);
UPDATE small SET k = 'd' WHERE k = 'c';
INSERT INTO kinds (id, n, d, tm) VALUES (100000, '1e-20', '0044-03-15 BC', '24:00:00');
UPDATE kinds SET c = NULL, p = NULL WHERE id < 50;
"""



def test_snapshot_plus_drained_changes_equal_the_source(make_stream, source_conn, source_db):
    with source_conn.cursor() as cur:
        cur.execute(SETUP)
    cfg = make_stream(TABLES)
    writer = psycopg2.connect(source_db)
    writer.autocommit = True
    fired = threading.Event()

    def hook(chunk, attempt):
        if chunk.table == "public.acc" and chunk.chunk_no == 1 and not fired.is_set():
            fired.set()
            with writer.cursor() as cur:
                cur.execute(DURING_COPY)

    snap = snapshot_stream(cfg, chunk_pages=3, parallelism=2, chunk_hook=hook)
    assert fired.is_set()
    with writer.cursor() as cur:
        cur.execute(AFTER_COPY)
    writer.close()
    target = current_lsn(cfg)

    with open_control(cfg) as ctl:
        for _ in range(20):
            drain_stream(cfg)
            if ctl.stream(cfg.stream).landed_upper >= target:
                break
        assert ctl.stream(cfg.stream).landed_upper >= target
        segments = ctl.segments(cfg.stream)
    store = open_store(cfg.landing.url)
    contents = [read_segment_at(s.uri) for s in segments]
    assert contents and contents[0].lower == snap.lsn
    assert sum(len(c.updates) for c in contents) > 1000
    assert any("doc" in u.unchanged_toast for c in contents for u in c.updates), "no unchanged TOAST exercised"
    assert any(e.kind == "truncate" for c in contents for e in c.events)

    manifest = load_manifest(store, cfg.stream, snap.snapshot_id)
    snapshot = {}
    for t in TABLES:
        schema = TableSchema.from_json(manifest["tables"][t]["table_schema"])
        snapshot[t] = (schema, arrow_rows(read_snapshot_table(store, manifest, t)))
        # the snapshot's table shape is the drain's, to the fingerprint
        for c in contents:
            for shape in c.relations.values():
                if shape.qualified == t:
                    assert shape.record_name == schema.record_name, t
    applied = apply_capture(snapshot, snap.lsn, contents)
    for t in TABLES:
        want = source_counter(source_db, t)
        got = applied[t]
        only_got, only_want = sorted(map(_short, got - want)), sorted(map(_short, want - got))
        assert got == want, f"{t}: {len(only_got)} rows only in the capture, e.g. {only_got[:3]}; " \
                            f"{len(only_want)} only in the source, e.g. {only_want[:3]}"


def _short(row: tuple) -> str:
    return repr(tuple(v[:20] + "..." if isinstance(v, str) and len(v) > 24 else v for v in row))[:300]
