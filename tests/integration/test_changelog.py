"""The consolidated changelog against PostgreSQL itself: a random workload in phases, each phase's
end recorded as ``(pg_current_wal_lsn(), SELECT *)``; after draining and consolidating (several
batches), the snapshot version plus the changelog's diffs below each recorded LSN equal that
SELECT. Then the per-interval rebuild from retained segments (``write_changelog``)."""

from __future__ import annotations

import datetime as dt
import random
from collections import Counter

import pytest

from tidemark.consolidate.interval import ChangelogError, write_changelog  # noqa: E402
from tidemark.consolidate import consolidate_stream  # noqa: E402
from tidemark.consolidate.cdc_file import read_cdc  # noqa: E402
from tidemark.consolidate.preconsolidate import plain  # noqa: E402
from tidemark.lake.delta import conform  # noqa: E402
from tidemark.control import Control  # noqa: E402
from tidemark.lake import changelog_uri, open_delta, read_changelog, table_info, table_uri  # noqa: E402
from tidemark.pgtypes import TableSchema, arrow_schema, table_schema_from_catalog  # noqa: E402
from tidemark.capture.snapshot import snapshot_stream  # noqa: E402
from tidemark.control import control_dsn  # noqa: E402
from tidemark.landing.store import open_store, stream_keys  # noqa: E402

from oracle import drain_until_current, norm, row_tuples, rows, source_table  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SETUP = """
CREATE TABLE items (id int PRIMARY KEY, v text, big text, n numeric(10, 2));
ALTER TABLE items ALTER COLUMN big SET STORAGE EXTERNAL;
CREATE TABLE bag (x int, y text, big text);
ALTER TABLE bag REPLICA IDENTITY FULL;
ALTER TABLE bag ALTER COLUMN big SET STORAGE EXTERNAL;
"""
TABLES = ["public.items", "public.bag"]


def _big(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.choice([5, 3000])))


def _phase(cur, rng: random.Random, next_id: list[int], *, truncate: bool) -> None:
    """One phase: every kind of change at least once, then random transactions."""
    def ins(n=1):
        for _ in range(n):
            cur.execute("INSERT INTO items VALUES (%s, %s, %s, %s)",
                        (next_id[0], rng.choice(["a", None]), _big(rng), rng.choice(["1.50", None])))
            next_id[0] += 1

    def some_id():
        cur.execute("SELECT id FROM items ORDER BY random() LIMIT 1")
        row = cur.fetchone()
        return row[0] if row else None

    cur.execute("BEGIN")
    ins(8)
    cur.execute("INSERT INTO bag SELECT g %% 3, 'dup', %s FROM generate_series(1, 6) g", (_big(rng),))
    cur.execute("UPDATE items SET v = 'toast-untouched' WHERE id %% 3 = %s", (rng.randint(0, 2),))
    i = some_id()
    cur.execute("UPDATE items SET v = v WHERE id = %s", (i,))                          # changes nothing
    i = some_id()
    cur.execute("UPDATE items SET id = %s WHERE id = %s", (next_id[0], i))             # key change, TOAST kept
    cur.execute("UPDATE items SET id = %s, v = 'chain' WHERE id = %s", (next_id[0] + 1, next_id[0]))  # chained
    next_id[0] += 2
    cur.execute("DELETE FROM items WHERE id = %s", (some_id(),))
    i = some_id()
    cur.execute("SELECT v, big, n FROM items WHERE id = %s", (i,))
    v, big, n = cur.fetchone()
    cur.execute("DELETE FROM items WHERE id = %s", (i,))                               # delete + identical reinsert
    cur.execute("INSERT INTO items VALUES (%s, %s, %s, %s)", (i, v, big, n))
    cur.execute("UPDATE bag SET y = 'upd' WHERE ctid = (SELECT ctid FROM bag LIMIT 1)")
    cur.execute("DELETE FROM bag WHERE ctid IN (SELECT ctid FROM bag WHERE x = 1 LIMIT 2)")
    cur.execute("COMMIT")
    for _ in range(12):
        cur.execute("BEGIN")
        for _ in range(rng.randint(1, 4)):
            op = rng.choice(["ins", "toast", "key", "del", "bag", "bagdel"])
            if op == "ins":
                ins()
            elif op == "toast":
                cur.execute("UPDATE items SET n = %s WHERE id %% 4 = %s", (rng.choice(["2.25", None]), rng.randint(0, 3)))
            elif op == "key" and (i := some_id()) is not None:
                cur.execute("UPDATE items SET id = %s WHERE id = %s", (next_id[0], i))
                next_id[0] += 1
            elif op == "del":
                cur.execute("DELETE FROM items WHERE id = %s", (some_id(),))
            elif op == "bag":
                cur.execute("INSERT INTO bag VALUES (%s, 'r', %s), (%s, 'r', %s)", (rng.randint(0, 2), _big(rng),
                                                                                   rng.randint(0, 2), _big(rng)))
                cur.execute("UPDATE bag SET x = x + 10 WHERE ctid = (SELECT ctid FROM bag ORDER BY random() LIMIT 1)")
            elif op == "bagdel":
                cur.execute("DELETE FROM bag WHERE ctid = (SELECT ctid FROM bag ORDER BY random() LIMIT 1)")
        cur.execute("ROLLBACK" if rng.random() < 0.1 else "COMMIT")
    if truncate:
        cur.execute("BEGIN")
        ins(2)
        cur.execute("UPDATE items SET v = 'before-truncate' WHERE id = %s", (some_id(),))
        cur.execute("TRUNCATE items, bag")
        ins(3)
        cur.execute("INSERT INTO bag VALUES (7, 'after', 'x')")
        cur.execute("COMMIT")
        cur.execute("BEGIN")
        ins(2)
        cur.execute("UPDATE items SET v = 'after-truncate' WHERE id = %s", (some_id(),))
        cur.execute("COMMIT")



def _snapshot_version(cfg, table):
    """The rows of the lake version written by the snapshot load (the changelog's start)."""
    from deltalake import DeltaTable

    uri = table_uri(cfg, table)
    hist = sorted(DeltaTable(uri).history(), key=lambda h: h["version"])
    v = next(h["version"] for h in hist if (h.get("tidemark") or {}).get("operation") == "snapshot")
    old = DeltaTable(uri, version=v)
    return conform(old.to_pyarrow_table(), arrow_schema(TableSchema.from_json(table_info(old)["table_schema"])))


def _sum_below(log, names, lsn) -> Counter:
    acc: Counter = Counter()
    for row, t, d in zip(row_tuples(log.select(names)), log.column("_time").to_pylist(),
                         log.column("_diff").to_pylist()):
        if t < lsn:
            acc[row] += d
    return acc


def test_changelog_oracle_and_interval_rebuild(make_stream, source_conn, spark):
    rng = random.Random(7)
    cur = source_conn.cursor()
    cur.execute("SET synchronous_commit = on")
    cur.execute(SETUP)
    next_id = [1]
    cur.execute("INSERT INTO items SELECT g, 'init', repeat('z', 3000), 1.00 FROM generate_series(1, 12) g")
    cur.execute("INSERT INTO bag VALUES (1, 'init', 'b'), (1, 'init', 'b')")
    next_id[0] = 13
    cfg = make_stream(TABLES, drain={"idle_timeout_seconds": 0.5, "max_changes": 60}, consolidate={"buckets": 3})
    snapshot_stream(cfg)
    shapes = {t: table_schema_from_catalog(source_conn, *t.split(".")) for t in TABLES}
    points, marks = [], []
    for phase in range(4):
        cur.execute("SELECT clock_timestamp()")
        marks.append(cur.fetchone()[0])
        _phase(cur, rng, next_id, truncate=phase == 2)
        cur.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
        lsn = int(cur.fetchone()[0])
        points.append((lsn, {t: rows(source_table(cur.connection, shapes[t])) for t in TABLES}))
        if phase in (1, 3):          # consolidate in several batches
            drain_until_current(cfg)
            consolidate_stream(cfg, spark=spark)

    # 1. the oracle: snapshot version + diffs below each recorded LSN == SELECT at that point
    for t in TABLES:
        names = [c.name for c in shapes[t].columns]
        log = read_changelog(cfg, t)
        base = rows(_snapshot_version(cfg, t))
        for lsn, selects in points:
            acc = Counter(base)
            acc.update(_sum_below(log, names, lsn))
            assert +acc == selects[t], (t, lsn)
            assert all(v >= 0 for v in acc.values()), (t, lsn)
        # at most one diff per (data, time), none zero
        keys = [(r, tm) for r, tm in zip(_rows_list(log, names), log.column("_time").to_pylist())]
        assert len(keys) == len(set(keys)), t
        assert 0 not in log.column("_diff").to_pylist()
        # the Materialize CDC files hold exactly the Delta rows; progress counts match; ranges tile
        store = open_store(cfg.landing.url)
        prefix = f"{stream_keys(cfg.stream)['changelog']}{t}/"
        files = sorted(k for k in store.list(prefix) if k.endswith(".avro"))
        assert len(files) == 2, files
        uppers, cdc = [], Counter()
        for key in files:
            updates, progress = read_cdc(store.get(key))
            counts = Counter(u["time"] for u in updates)
            assert {c["time"]: c["count"] for c in progress["counts"]} == dict(counts)
            assert all(progress["lower"][0] <= u["time"] < progress["upper"][0] for u in updates)
            uppers.append((progress["lower"][0], progress["upper"][0]))
            for u in updates:
                cdc[(u["time"], u["diff"])] += 1
        assert uppers[0][1] == uppers[1][0]
        # the files also hold the snapshot (the feed's base) as updates at its LSN, identical rows as one
        # update with diff = n; the Delta changelog does not
        expected = Counter(zip(log.column("_time").to_pylist(), log.column("_diff").to_pylist()))
        for n in rows(_snapshot_version(cfg, t)).values():
            expected[(uppers[0][0], n)] += 1
        assert cdc == expected
    kinds = Counter(d for d in read_changelog(cfg, "public.items").column("_diff").to_pylist())
    assert kinds[-1] and kinds[1]

    # 2. the interval rebuild: phase 2 (truncate, key changes) needs the lake version of batch 1
    start, end = marks[2], marks[3]
    uri = changelog_uri(cfg, "public.items")
    before = {t: _interval(cfg, t, start, end) for t in TABLES}
    assert before["public.items"] and before["public.bag"]
    version = open_delta(uri).version()
    out = write_changelog(cfg, start=start, end=end, spark=spark)
    assert out["replaced"] == []                                  # the same rows as the consolidation's
    assert out["tables"] == {t: len(before[t]) for t in TABLES}
    assert open_delta(uri).version() == version
    # delete the interval's rows, forget the segments' bounds: the rebuild restores them from segments
    for t in TABLES:
        open_delta(changelog_uri(cfg, t)).delete(
            f"_commit_ts >= '{start.isoformat()}' AND _commit_ts < '{end.isoformat()}'")
        assert _interval(cfg, t, start, end) == []
    with Control(control_dsn(cfg)) as ctl, ctl.tx() as c:
        c.execute("UPDATE tidemark.segments SET min_commit_ts = NULL, max_commit_ts = NULL WHERE stream = %s",
                  (cfg.stream,))
    out = write_changelog(cfg, start=start, end=end, spark=spark)
    assert sorted(out["replaced"]) == sorted(TABLES)
    assert {t: _interval(cfg, t, start, end) for t in TABLES} == before
    version = open_delta(uri).version()
    assert write_changelog(cfg, start=start, end=end, spark=spark)["replaced"] == []
    assert open_delta(uri).version() == version
    # a forgotten segment holding commits of the interval: a clear error, nothing written
    with Control(control_dsn(cfg)) as ctl:
        inside = [s for s in ctl.segments(cfg.stream) if s.min_commit_ts is not None
                  and s.max_commit_ts >= int(start.timestamp() * 1e6) and s.min_commit_ts < int(end.timestamp() * 1e6)]
        assert inside
        ctl.set_segment_status(cfg.stream, [inside[0].seq], "forgotten")
        with pytest.raises(ChangelogError, match=rf"interval .*segment\(s\) {inside[0].seq} .*forgotten.*no longer retained"):
            write_changelog(cfg, start=start, end=end, spark=spark)
        assert open_delta(uri).version() == version
        ctl.set_segment_status(cfg.stream, [inside[0].seq], "landed")
    # an interval with no commits writes nothing
    empty = write_changelog(cfg, start=end + dt.timedelta(days=1), end=end + dt.timedelta(days=2), spark=spark)
    assert empty["replaced"] == [] and open_delta(uri).version() == version


def _rows_list(log, names) -> list:
    return row_tuples(log.select(names))


def _interval(cfg, table, start, end) -> list:
    """The changelog rows of ``table`` committed in ``[start, end)``, sorted (comparable)."""
    log = read_changelog(cfg, table)
    out = []
    for r in plain(log.drop_columns(["_commit_date"])).to_pylist():
        ts = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(microseconds=r["_commit_ts"])
        if start <= ts < end:
            out.append(repr(tuple(norm(v) for v in r.values())))
    return sorted(out)
