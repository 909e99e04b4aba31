"""The oracle: real PostgreSQL, snapshot + drains + consolidation, then every lake table equals
``SELECT * FROM table`` row for row with exact lake types — also after duplicated segments, a
replay of an already consolidated range, and with pgbench as the workload."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from tidemark.control import Control
from tidemark.local.localpg import pg_bin_dir
from tidemark.pgtypes import arrow_schema, table_schema_from_catalog
from tidemark.control import control_dsn
from tidemark.capture.source import connect_source
from tidemark.landing.store import open_store, segment_key, stream_keys

from oracle import consolidate as _consolidate, drain_until_current, rows, source_table

from tidemark.lake import open_delta, read_table, table_uri  # noqa: E402
from tidemark.capture.snapshot import snapshot_stream  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SETUP = """
CREATE TABLE items (id int PRIMARY KEY, v text, big text, n numeric(10, 2), f float8, d date, ts timestamptz,
                    tm time, arr int[], b bytea);
ALTER TABLE items ALTER COLUMN big SET STORAGE EXTERNAL;
CREATE TABLE pairs (a int, b text, w int, PRIMARY KEY (a, b));
CREATE TABLE bag (x int, y text);
ALTER TABLE bag REPLICA IDENTITY FULL;
"""
TABLES = ["public.items", "public.pairs", "public.bag"]


def _big(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(rng.choice([10, 3000])))


def _item_values(rng: random.Random, i: int) -> tuple:
    return (i, rng.choice(["a", "b", None, "é"]), _big(rng), rng.choice([None, "1.50", "-99999999.99", "0.01"]),
            rng.choice([1.5, float("inf"), -0.25, None]), rng.choice(["2000-01-01", "infinity", "1999-12-31", None]),
            rng.choice(["2020-01-01 00:00:00+00", "-infinity", None]), rng.choice(["12:34:56.5", "00:00:00", None]),
            rng.choice([[1, None, 3], [], None]), rng.choice([b"\x00\x01", None]))


INSERT_ITEM = "INSERT INTO items VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"


def _workload(conn, rng: random.Random, txns: int, next_id: list[int]) -> None:
    """Random transactions: inserts, updates (some leaving TOAST untouched, some changing the key),
    deletes, delete-and-reinsert, truncates, multi-table transactions and rollbacks."""
    with conn.cursor() as cur:
        for _ in range(txns):
            cur.execute("BEGIN")
            for _ in range(rng.randint(1, 5)):
                op = rng.choices(["ins", "upd", "toast", "key", "del", "reins", "pair", "bag", "bag_del", "trunc"],
                                 [5, 3, 3, 2, 2, 1, 3, 3, 1, 0.2])[0]
                if op == "ins":
                    cur.execute(INSERT_ITEM, _item_values(rng, next_id[0]))
                    next_id[0] += 1
                elif op == "upd":
                    cur.execute("UPDATE items SET v = %s, n = %s, big = %s WHERE id %% 7 = %s",
                                (rng.choice(["u", None]), "2.25", _big(rng), rng.randint(0, 6)))
                elif op == "toast":
                    cur.execute("UPDATE items SET v = %s, tm = '23:59:59.999999' WHERE id %% 5 = %s",
                                (f"t{rng.randint(0, 9)}", rng.randint(0, 4)))
                elif op == "key":
                    cur.execute("UPDATE items SET id = id + 100000 WHERE id = (SELECT min(id) FROM items WHERE id %% 3 = %s)",
                                (rng.randint(0, 2),))
                elif op == "del":
                    cur.execute("DELETE FROM items WHERE id %% 11 = %s", (rng.randint(0, 10),))
                elif op == "reins":
                    cur.execute("SELECT id FROM items ORDER BY random() LIMIT 1")
                    row = cur.fetchone()
                    if row:
                        cur.execute("DELETE FROM items WHERE id = %s", row)
                        cur.execute(INSERT_ITEM, _item_values(rng, row[0]))
                elif op == "pair":
                    a, b = rng.randint(0, 5), rng.choice(["x", "y", "z"])
                    cur.execute("""INSERT INTO pairs VALUES (%s, %s, 1) ON CONFLICT (a, b)
                                   DO UPDATE SET w = pairs.w + 1""", (a, b))
                    if rng.random() < 0.3:
                        cur.execute("UPDATE pairs SET b = b || 'k' WHERE a = %s AND length(b) < 4", (a,))
                elif op == "bag":
                    cur.execute("INSERT INTO bag SELECT %s, 'dup' FROM generate_series(1, %s)", (rng.randint(0, 3), rng.randint(1, 3)))
                    cur.execute("UPDATE bag SET y = 'upd' WHERE ctid = (SELECT ctid FROM bag LIMIT 1)")
                elif op == "bag_del":
                    cur.execute("DELETE FROM bag WHERE ctid IN (SELECT ctid FROM bag WHERE x = %s LIMIT 2)", (rng.randint(0, 3),))
                elif op == "trunc":
                    cur.execute("TRUNCATE pairs")
            cur.execute("ROLLBACK" if rng.random() < 0.1 else "COMMIT")


def _assert_lake_equals_source(cfg) -> None:
    conn = connect_source(cfg)
    try:
        for table in [t.qualified for t in cfg.source.tables]:
            schema, name = table.split(".")
            shape = table_schema_from_catalog(conn, schema, name)
            lake = read_table(cfg, table)
            assert lake.schema == arrow_schema(shape), table
            assert rows(lake) == rows(source_table(conn, shape)), table
    finally:
        conn.close()


def _land_copy(cfg, ctl: Control, seg) -> None:
    """Land a copy of a registered segment under the next sequence number (a duplicate)."""
    store = open_store(cfg.landing.url)
    data = store.get(f"{stream_keys(cfg.stream)['segments']}{seg.uri.rsplit('/', 1)[-1]}")
    seq = ctl.stream(cfg.stream).next_seq
    uri = store.put(segment_key(cfg.stream, seq, seg.lower, seg.upper), data)
    ctl.register_segment(type(seg)(**{**seg.__dict__, "seq": seq, "uri": uri, "origin": "external"}))


@pytest.mark.parametrize("seed", [1, 2])
def test_random_workload_lake_equals_source(make_stream, source_conn, spark, seed):
    rng = random.Random(seed)
    with source_conn.cursor() as cur:
        cur.execute("SET synchronous_commit = on")    # the drain's target is the flush position
        cur.execute(SETUP)
    next_id = [1]
    _workload(source_conn, rng, 20, next_id)
    cfg = make_stream(TABLES, drain={"idle_timeout_seconds": 0.5, "max_changes": 150},
                      consolidate={"buckets": 4})
    snapshot_stream(cfg)
    for _ in range(3):
        _workload(source_conn, rng, 25, next_id)
        drain_until_current(cfg)
        with Control(control_dsn(cfg)) as ctl:
            segs = ctl.segments(cfg.stream)
            _land_copy(cfg, ctl, rng.choice(segs))          # a duplicated segment
        _consolidate(cfg, spark)
        _assert_lake_equals_source(cfg)
    # replay an already consolidated range: no new versions, nothing changes
    versions = {t: open_delta(table_uri(cfg, t)).version() for t in TABLES}
    with Control(control_dsn(cfg)) as ctl:
        _land_copy(cfg, ctl, ctl.segments(cfg.stream)[0])
    res = _consolidate(cfg, spark)
    assert res.skipped
    assert {t: open_delta(table_uri(cfg, t)).version() for t in TABLES} == versions
    _assert_lake_equals_source(cfg)


PGBENCH_TABLES = ["public.pgbench_accounts", "public.pgbench_branches", "public.pgbench_tellers",
                  "public.pgbench_history"]


def test_pgbench_lake_equals_source(make_stream, source_db, source_conn, spark):
    pgbench = Path(pg_bin_dir()) / "pgbench"
    if not pgbench.exists() and not shutil.which("pgbench"):
        pytest.skip("pgbench is not installed")
    subprocess.run([str(pgbench), "-i", "-s", "1", "-q", source_db], check=True, capture_output=True)
    with source_conn.cursor() as cur:
        cur.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
        cur.execute("ALTER DATABASE " + source_conn.info.dbname + " SET synchronous_commit = on")
    cfg = make_stream(PGBENCH_TABLES, drain={"idle_timeout_seconds": 0.5}, consolidate={"buckets": 4})
    snapshot_stream(cfg)
    subprocess.run([str(pgbench), "-T", "5", "-c", "2", "-n", source_db], check=True, capture_output=True)
    drain_until_current(cfg)
    _consolidate(cfg, spark)
    _assert_lake_equals_source(cfg)
