"""History from the lake, against PostgreSQL itself (real slot, real Spark).

A seeded random workload (inserts, updates that leave a TOASTed column alone, key changes and
chains of them, deletes, a keyless table with duplicate rows, a TRUNCATE, ADD COLUMN) runs one
transaction at a time; after some of them the test records the source's position and its rows of
every table (the oracle). Batches are consolidated at a few points only, so most recorded
positions fall inside a batch. Then every recorded position is read back — by LSN and by time —
and must equal the source's rows at that position, for all tables at once; and every version a
key's history reports must be the source's row of that key at each recorded position it covers.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import time

import pytest
import yaml

from tidemark import cli

from tidemark.capture.snapshot import snapshot_stream
from tidemark.capture.source import connect_source
from tidemark.lake import LakeError, read_tables, register_table
from tidemark.lake.history import fold_versions, key_history, read_tables_at
from tidemark.lsn import format_lsn
from tidemark.pgtypes.catalog import table_schema_from_catalog

from oracle import consolidate, drain_until_current, rows, source_table

TABLES = ["public.h_keyed", "public.h_bag"]


def _state(conn) -> dict:
    """(position, time, {table: rows}) of the source right now (one writer: nothing commits meanwhile)."""
    out = {}
    for t in TABLES:
        schema, name = t.split(".")
        out[t] = source_table(conn, table_schema_from_catalog(conn, schema, name))
    with conn.cursor() as cur:
        cur.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn, clock_timestamp()")
        lsn, now = cur.fetchone()
    conn.commit()
    return int(lsn), now, out


def _one_txn(conn, rnd: random.Random, live: list[int], step: int, added: bool) -> None:
    with conn, conn.cursor() as cur:
        for _ in range(rnd.randint(1, 4)):
            op = rnd.random()
            if op < 0.3 or not live:
                k = 10_000 + step * 10 + rnd.randint(0, 9)
                if k not in live:
                    cur.execute("INSERT INTO public.h_keyed (id, v, big) VALUES (%s, %s, repeat('t', 3000))",
                                (k, f"n{step}"))
                    live.append(k)
            elif op < 0.55:      # an update that leaves the TOASTed column unchanged
                cur.execute("UPDATE public.h_keyed SET v = v || %s WHERE id = %s", (f".{step}", rnd.choice(live)))
                if added:
                    cur.execute("UPDATE public.h_keyed SET extra = %s WHERE id = %s", (step, rnd.choice(live)))
            elif op < 0.7:       # a key change (its TOAST value unchanged), sometimes twice in one txn
                old = rnd.choice(live)
                new = max(live) + 1 + rnd.randint(0, 5)
                cur.execute("UPDATE public.h_keyed SET id = %s WHERE id = %s", (new, old))
                live[live.index(old)] = new
            elif op < 0.8:
                k = rnd.choice(live)
                cur.execute("DELETE FROM public.h_keyed WHERE id = %s", (k,))
                live.remove(k)
            elif op < 0.93:      # the keyless table: duplicates in, one of them out
                v = rnd.randint(0, 3)
                cur.execute("INSERT INTO public.h_bag VALUES (%s, 'x'), (%s, 'x')", (v, v))
                cur.execute("DELETE FROM public.h_bag WHERE ctid = (SELECT ctid FROM public.h_bag WHERE g = %s "
                            "LIMIT 1)", (rnd.randint(0, 3),))
            else:
                cur.execute("UPDATE public.h_bag SET t = t || 'y' WHERE g = %s", (rnd.randint(0, 3),))


def test_tables_as_of_recorded_positions_and_times_equal_the_source_and_key_versions_cover_them(
        make_stream, source_conn, source_db, spark, tmp_path, capsys):
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.h_keyed (id int PRIMARY KEY, v text, big text)")
        cur.execute("ALTER TABLE public.h_keyed ALTER COLUMN big SET STORAGE EXTERNAL")
        cur.execute("CREATE TABLE public.h_bag (g int, t text)")
        cur.execute("CREATE TABLE public.h_other (n int)")
        cur.execute("ALTER TABLE public.h_bag REPLICA IDENTITY FULL")
        cur.execute("INSERT INTO public.h_keyed SELECT g, 'v' || g, repeat('s', 3000) FROM generate_series(1, 40) g")
        cur.execute("INSERT INTO public.h_bag SELECT g % 4, 'x' FROM generate_series(1, 12) g")
    cfg = make_stream(TABLES)
    snapshot_stream(cfg)
    conn = connect_source(cfg)
    conn.autocommit = False
    rnd = random.Random(25)
    live = list(range(1, 41))
    recorded = [_state(conn)]        # the snapshot's state: before any change
    added = False
    try:
        for step in range(1, 61):
            if step == 25:       # everything out of both tables in one transaction
                with conn, conn.cursor() as cur:
                    cur.execute("TRUNCATE public.h_keyed, public.h_bag")
                live.clear()
            elif step == 40:     # a schema change mid-stream, inside a batch
                with conn, conn.cursor() as cur:
                    cur.execute("ALTER TABLE public.h_keyed ADD COLUMN extra int")
                added = True
            else:
                _one_txn(conn, rnd, live, step, added)
            if step % 3 == 0 or step in (25, 40, 41):
                recorded.append(_state(conn))
            if step in (15, 33, 60):      # batches: most recorded positions fall inside one
                with conn, conn.cursor() as cur:    # a commit elsewhere: the frontier passes what was recorded
                    cur.execute("INSERT INTO public.h_other VALUES (%s)", (step,))
                drain_until_current(cfg)
                consolidate(cfg, spark)
            time.sleep(0.002)     # commit times strictly after a recorded time
    finally:
        conn.close()

    for lsn, when, expected in recorded:
        got = read_tables_at(cfg, lsn)
        for t in TABLES:
            exp_cols = expected[t].column_names
            assert rows(got[t].select(exp_cols)) == rows(expected[t]), (t, format_lsn(lsn))
            extra = [c for c in got[t].column_names if c not in exp_cols]   # a column added later in the batch
            assert all(got[t].column(c).null_count == got[t].num_rows for c in extra), (t, format_lsn(lsn), extra)
        by_time = read_tables_at(cfg, when.astimezone(dt.timezone.utc).isoformat())
        for t in TABLES:
            assert rows(by_time[t].select(expected[t].column_names)) == rows(expected[t]), (t, when)

    # every version of a key is the source's row of that key at each recorded position it covers
    keys = sorted({r["id"] for _, _, e in recorded for r in e["public.h_keyed"].to_pylist()})
    for k in rnd.sample(keys, 12):
        versions = key_history(cfg, "public.h_keyed", {"id": str(k)})
        for lsn, _, expected in recorded:
            src = [r for r in expected["public.h_keyed"].to_pylist() if r["id"] == k]
            live_v = [v for v in versions if v["_valid_from_lsn"] <= lsn
                      and (v["_valid_to_lsn"] is None or lsn < v["_valid_to_lsn"])]
            assert len(live_v) == len(src), (k, format_lsn(lsn), versions)
            for v, s in zip(live_v, src):
                assert {c: v.get(c) for c in s} == s, (k, format_lsn(lsn))
        assert sum(v["_is_current"] for v in versions) <= 1

    # the public faces: lake.read_tables(at=), Spark SQL over a view as of a position, the CLI
    lsn, when, expected = recorded[len(recorded) // 2]
    got = read_tables(cfg, at=format_lsn(lsn))
    assert rows(got["public.h_bag"]) == rows(expected["public.h_bag"])
    register_table(spark, cfg, "public.h_keyed", "keyed_then", as_of=lsn)
    assert spark.sql("SELECT count(*) AS n FROM keyed_then").collect()[0]["n"] == expected["public.h_keyed"].num_rows
    streams = tmp_path / "streams"
    streams.mkdir()
    (streams / f"{cfg.stream}.yaml").write_text(yaml.safe_dump(cfg.as_dict()))
    capsys.readouterr()
    assert cli.main(["--streams", str(streams), "read", cfg.stream, "public.h_keyed", "--as-of", format_lsn(lsn),
                     "--format", "jsonl"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(r["id"] for r in printed) == sorted(r["id"] for r in expected["public.h_keyed"].to_pylist())
    moved = next(k for k in keys if len(key_history(cfg, "public.h_keyed", {"id": str(k)})) > 1)
    versions = key_history(cfg, "public.h_keyed", {"id": str(moved)})
    assert cli.main(["--streams", str(streams), "history", cfg.stream, "public.h_keyed", "--key", f"id={moved}",
                     "--format", "jsonl"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(v["_valid_from_lsn"], v["_valid_to_lsn"], v["_deleted"]) for v in printed] == \
        [(v["_valid_from_lsn"], v["_valid_to_lsn"], v["_deleted"]) for v in versions]
    assert cli.main(["--streams", str(streams), "history", cfg.stream, "public.h_keyed", "--key", f"id={moved}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["valid_from", "valid_to", "from_time", "to_time", "ended_by"]
    assert len([ln for ln in lines[1:] if ln.strip() and not set(ln.strip()) <= set("-  ")]) == len(versions)

    # beyond the frontier, and not a position at all: one clear line each
    with pytest.raises(LakeError, match="the lake holds stream .* up to"):
        read_tables_at(cfg, recorded[-1][0] + 10**9)
    with pytest.raises(LakeError, match="neither an LSN"):
        read_tables_at(cfg, "yesterday")
    with pytest.raises(LakeError, match="no key"):
        key_history(cfg, "public.h_bag", {"g": "1"})


def test_fold_versions_against_an_independent_replay():
    """SCD2 versions folded from a changelog equal, at every time, a direct replay of the changes."""
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=150, deadline=None)
    @given(st.lists(st.tuples(st.sampled_from(["ins", "upd", "del", "move"]), st.integers(0, 5),
                              st.integers(0, 9)), max_size=40), st.integers(0, 4))
    def check(ops, n_base):
        state = {k: {"id": k, "v": 0} for k in range(n_base)}
        base_rows = [dict(r) for r in state.values()]
        changes, snapshots, t = [], {99: {k: dict(r) for k, r in state.items()}}, 100
        for op, k, v in ops:
            t += 1
            before = {kk: dict(r) for kk, r in state.items()}
            if op == "ins" and k not in state:
                state[k] = {"id": k, "v": v}
            elif op == "upd" and k in state and state[k]["v"] != v:
                state[k] = {"id": k, "v": v}
            elif op == "del" and k in state:
                del state[k]
            elif op == "move" and k in state and (k + 6) not in state:
                state[k + 6] = {"id": k + 6, "v": state.pop(k)["v"]}
            for kk in set(before) | set(state):   # the exact changelog of this time
                if before.get(kk) != state.get(kk):
                    if kk in before:
                        changes.append({**before[kk], "_time": t, "_diff": -1, "_commit_ts": None})
                    if kk in state:
                        changes.append({**state[kk], "_time": t, "_diff": 1, "_commit_ts": None})
            snapshots[t] = {kk: dict(r) for kk, r in state.items()}
        rnd_order = random.Random(len(changes)).sample(changes, len(changes))   # the changelog's order is free
        versions = fold_versions(base_rows, 99, rnd_order, ["id"])
        for at, expect in snapshots.items():
            live = {v["id"]: {"id": v["id"], "v": v["v"]} for v in versions
                    if v["_valid_from_lsn"] <= at and (v["_valid_to_lsn"] is None or at < v["_valid_to_lsn"])}
            assert live == expect, (at, versions)
        assert {v["id"] for v in versions if v["_is_current"]} == set(state)
        for v in versions:
            if not v["_is_current"]:
                gone = v["id"] not in snapshots[v["_valid_to_lsn"]]
                assert v["_deleted"] == gone, v

    check()
