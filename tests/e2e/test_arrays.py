"""Arrays are lists in the lake (issue 37, point 1), end to end against a real PostgreSQL.

Every element type Tidemark maps, NULL arrays, NULL elements, empty arrays, text elements with
quotes, backslashes, commas, braces, blanks and the word NULL, declared 2-D columns: from the
snapshot (COPY) and from the drain (pgoutput) alike, the lake holds lists of the element's lake type
that equal what psycopg2 decodes from PostgreSQL itself (not Tidemark's parser: the oracle is the
source). A value a column's lists cannot hold (a 2-D value in a 1-D column, non-default lower bounds)
does not stop the stream: that column alone goes to PostgreSQL's text through the per-table
re-snapshot route (the table's shape records it, the changelog restart notes it, one log line names
table, column and LSN), the table's other columns and the other tables stay lists, and parity stays
green. Failed before: every array column was a string."""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
from decimal import Decimal

import psycopg2
import pytest

from tidemark import gaps
from tidemark.capture.snapshot import snapshot_stream
from tidemark.consolidate import ConsolidateError
from tidemark.lake import open_delta, read_table, storage_options, table_info, table_uri
from tidemark.pgtypes import TableSchema

from oracle import consolidate, drain_until_current

pytestmark = [pytest.mark.spark, pytest.mark.slow]

# column -> (declared type, SQL that psycopg2 decodes into Python lists of natives)
COLUMNS = {
    "a_i2": ("int2[]", None), "a_i4": ("int4[]", None), "a_i8": ("int8[]", None),
    "a_f4": ("float4[]", None), "a_f8": ("float8[]", None), "a_b": ("bool[]", None),
    "a_n": ("numeric[]", None), "a_n2": ("numeric(10,2)[]", None),
    "a_t": ("text[]", None), "a_vc": ("varchar(8)[]", None), "a_ch": ("char(3)[]", None),
    "a_by": ("bytea[]", None), "a_d": ("date[]", None), "a_ts": ("timestamp[]", None),
    "a_tz": ("timestamptz[]", None), "a_tm": ("time[]", None), "a_u": ("uuid[]", "a_u::text[]"),
    "a_j": ("jsonb[]", "a_j::text[]"), "a_in": ("inet[]", "array_to_json(a_in)"), "a_e": ("mood[]", "a_e::text[]"),
    "a_dom": ("posint[]", "a_dom::int[]"), "a_ovr": ("intlist", "a_ovr::int[]"),
    "g_i": ("int[][]", None), "g_t": ("text[][]", None),
}

NASTY = ['q"uote', "back\\slash", "com,ma", "{brace}", "NULL", "", " lead", "trail ", "é ü"]


def _exec(dsn: str, *stmts, params=None) -> None:
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            for s in stmts:
                cur.execute(s, params)
    finally:
        conn.close()


def _setup(dsn: str) -> None:
    _exec(dsn, "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')",
          "CREATE DOMAIN posint AS int CHECK (VALUE > 0)",
          "CREATE DOMAIN intlist AS int[] CHECK (cardinality(VALUE) < 10)",
          "CREATE TABLE arr (id int PRIMARY KEY, " + ", ".join(f"{c} {t}" for c, (t, _) in COLUMNS.items()) + ")",
          "CREATE TABLE fb (id int PRIMARY KEY, a int[], b text[], ok int[])",
          "CREATE TABLE fs (id int PRIMARY KEY, a int[], ok text[])")


def _row(i: int, variant: int) -> dict:
    """One row of ``arr``: values of every element type, NULLs, empties, nasty text."""
    if variant == 0:
        return {c: None for c in COLUMNS}
    if variant == 1:
        return {c: [] for c in COLUMNS}
    nasty = NASTY[i % len(NASTY):] + NASTY[:i % len(NASTY)]
    return {
        "a_i2": [i, None, -32768, 32767], "a_i4": [i, None, -1, 2**31 - 1], "a_i8": [2**63 - 1, None, -i],
        "a_f4": [1.5, None, float("nan"), float("inf"), -0.0], "a_f8": [0.1 * i, None, float("-inf"), 1e300],
        "a_b": [True, None, False], "a_n": [Decimal("1.50"), None, Decimal("-12345678901234567890.123"),
                                            Decimal("NaN")],
        "a_n2": [Decimal("1.25"), None, Decimal(-i)], "a_t": nasty + [None], "a_vc": ["abc", None, 'x"y'],
        "a_ch": ["a", None, "abc"], "a_by": [b"\x00\x01", None, b"", b"\\"],
        "a_d": [dt.date(2024, 2, 29), None, dt.date(1, 1, 1)],
        "a_ts": [dt.datetime(2020, 1, 2, 3, 4, 5, 678901), None],
        "a_tz": [dt.datetime(2020, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc), None],
        "a_tm": [dt.time(12, 0, 1, 500000), None, dt.time(0, 0)],
        "a_u": ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", None], "a_j": ['{"a": [1, "x,\\"y"]}', None, "null"],
        "a_in": ["10.0.0.1", None, "::1/128"], "a_e": ["sad", None, "happy"], "a_dom": [i, None, 7],
        "a_ovr": [i, None], "g_i": [[1, None], [3, i]], "g_t": [[nasty[0], None], ["x", ""]],
    }


def _insert(dsn: str, table: str, rows: list[tuple[int, dict]]) -> None:
    casts = {"a_u": "uuid[]", "a_j": "jsonb[]", "a_in": "inet[]", "a_e": "mood[]", "a_n": "numeric[]"}
    cols = list(COLUMNS)
    sql = (f"INSERT INTO {table} (id, {', '.join(cols)}) VALUES (%s, "
           + ", ".join(f"%s::{casts.get(c, COLUMNS[c][0])}" for c in cols) + ")")
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            for i, r in rows:
                cur.execute(sql, [i] + [r[c] for c in cols])
    finally:
        conn.close()


def _norm(v):
    """A value as compared: floats by repr (NaN, -0.0, inf kept apart), Decimals by their text,
    times and bytes by what they are, lists element by element."""
    if isinstance(v, list):
        return [_norm(x) for x in v]
    if isinstance(v, float):
        return "NaN" if math.isnan(v) else repr(v)
    if isinstance(v, Decimal):
        return str(v)
    if isinstance(v, (bytes, memoryview)):
        return bytes(v)
    if isinstance(v, dt.time):
        return v.strftime("%H:%M:%S.%f")
    if isinstance(v, dt.datetime) and v.tzinfo is not None:
        return v.astimezone(dt.timezone.utc)
    return v


def _source(dsn: str, table: str, columns: dict[str, str | None]) -> dict[int, dict]:
    """PostgreSQL's rows, each array as psycopg2 decodes it (its own parser, not Tidemark's)."""
    exprs = ", ".join(f"{e or c} AS {c}" for c, e in columns.items())
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SET TimeZone = 'UTC'")
            cur.execute(f"SELECT id, {exprs} FROM {table}")
            names = [d.name for d in cur.description]
            return {r[0]: {n: _norm(v) for n, v in zip(names[1:], r[1:])} for r in cur.fetchall()}
    finally:
        conn.close()


def _lake(cfg, table: str, columns) -> dict[int, dict]:
    out = {}
    for r in read_table(cfg, table).to_pylist():
        row = {c: _norm(r[c]) for c in columns}
        if isinstance(row.get("a_j"), list):     # jsonb: the lake holds PostgreSQL's text of each element
            row["a_j"] = [None if x is None else json.dumps(json.loads(x), sort_keys=True) for x in row["a_j"]]
        out[r["id"]] = row
    return out


def _src_json(src: dict[int, dict]) -> dict[int, dict]:
    for row in src.values():
        if row.get("a_j") is not None:
            row["a_j"] = [None if x is None else json.dumps(json.loads(x), sort_keys=True) for x in row["a_j"]]
    return src


def _assert_arr_equal(cfg, dsn: str) -> None:
    src = _src_json(_source(dsn, "arr", {c: e for c, (_, e) in COLUMNS.items()}))
    lake = _lake(cfg, "arr", COLUMNS)
    assert lake.keys() == src.keys()
    for i in src:
        for c in COLUMNS:
            assert lake[i][c] == src[i][c], (i, c, lake[i][c], src[i][c])


def _shape(cfg, table: str) -> TableSchema:
    return TableSchema.from_json(table_info(open_delta(table_uri(cfg, table), storage_options(cfg)))["table_schema"])


def _like_the_dag(cfg, spark, rounds: int = 3) -> list[str]:
    """What the consolidate DAG does by itself: consolidate; on a failure the gap sensor's branch
    chooses the resend step, which re-snapshots the table the incident names."""
    done = []
    for _ in range(rounds):
        drain_until_current(cfg)
        try:
            consolidate(cfg, spark)
            return done
        except ConsolidateError:
            report = gaps.detect(cfg)
            assert (report.decision, report.action) == ("ok", "resend") and len(report.resnapshot) == 1, report
            done += list(gaps.resend(cfg).tables)
    raise AssertionError(f"still failing after {rounds} re-snapshots: {done}")


def test_arrays_are_lists_from_snapshot_and_drain_and_a_misfit_sends_one_column_to_text(
        make_stream, source_db, spark, caplog):
    from tidemark.parity import parity_report

    _setup(source_db)
    _insert(source_db, "arr", [(i, _row(i, i % 4 if i < 4 else 2)) for i in range(8)])
    _exec(source_db, "INSERT INTO fb VALUES (1, '{1,NULL}', '{a,\"b c\"}', '{1}'), (2, NULL, '{}', '{2,3}')",
          # a 2-D value in a 1-D column before the snapshot: that column is text from the start
          "INSERT INTO fs VALUES (1, '{1,2}', '{x}'), (2, '{{1,2},{3,4}}', '{y,NULL}')")
    cfg = make_stream(["arr", "fb", "fs"])
    with caplog.at_level(logging.WARNING):
        snapshot_stream(cfg)
    consolidate(cfg, spark)
    _assert_arr_equal(cfg, source_db)
    assert any("table public.fs column a is held as PostgreSQL's text" in r.getMessage() for r in caplog.records)

    # the drain: inserts, updates (to NULL, to empty, to other values), deletes
    _insert(source_db, "arr", [(100 + i, _row(i, i % 4)) for i in range(8)])
    _exec(source_db, "UPDATE arr SET a_t = ARRAY['new \"one\"', NULL, '\\\\'], g_i = '{{9}}' WHERE id = 2",
          "UPDATE arr SET a_i4 = NULL, a_f8 = '{}' WHERE id = 3", "DELETE FROM arr WHERE id = 5",
          "INSERT INTO fb VALUES (3, '{4,5,6}', '{\"x,y\",NULL,\"NULL\"}', '{}')",
          "UPDATE fs SET a = '{7}' WHERE id = 1", "INSERT INTO fs VALUES (3, '[2:3]={8,9}', '{z}')")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    _assert_arr_equal(cfg, source_db)
    lake = read_table(cfg, "arr")
    assert str(lake.schema.field("g_i").type) == "list<item: list<item: int32>>"
    assert str(lake.schema.field("a_n2").type) == "list<item: decimal128(10, 2)>"
    assert str(lake.schema.field("a_e").type) == "list<item: string>"
    assert str(lake.schema.field("a_ovr").type) == "list<item: int32>"      # a domain over int[]
    # fs.a is PostgreSQL's text (a 2-D value came before the snapshot), fs.ok lists
    assert _shape(cfg, "public.fs").held_as_text == ["a"]
    fs_src = _source(source_db, "fs", {"a": "a::text", "ok": None})
    assert _lake(cfg, "fs", ["a", "ok"]) == fs_src and fs_src[3]["a"] == "[2:3]={8,9}"

    # misfits while streaming: a 2-D value in fb.a (1-D), non-default bounds in fb.b; fb.ok stays lists
    caplog.clear()
    _exec(source_db, "INSERT INTO fb VALUES (4, '{{1,2},{3,4}}', '{p}', '{4}')",
          "UPDATE fb SET b = '[0:1]={x,y}' WHERE id = 1", "INSERT INTO arr (id, a_i4) VALUES (200, '{200}')")
    with caplog.at_level(logging.WARNING):
        replaced = _like_the_dag(cfg, spark)
    assert replaced and set(replaced) == {"public.fb"}, replaced
    assert _shape(cfg, "public.fb").held_as_text == ["a", "b"]
    lines = [r.getMessage() for r in caplog.records if "public.fb" in r.getMessage() and " LSN " in r.getMessage()]
    assert lines and ("column a" in lines[0] or "column b" in lines[0]), lines
    fb_src = _source(source_db, "fb", {"a": "a::text", "b": "b::text", "ok": None})
    assert _lake(cfg, "fb", ["a", "b", "ok"]) == fb_src
    assert fb_src[4]["a"] == "{{1,2},{3,4}}" and fb_src[1]["b"] == "[0:1]={x,y}"
    _assert_arr_equal(cfg, source_db)
    assert _shape(cfg, "public.arr").held_as_text == []
    # the load that took the text columns notes them in its commit; the changelog restarted there
    lake_history = open_delta(table_uri(cfg, "public.fb"), storage_options(cfg)).history()
    assert [h["tidemark"]["held_as_text"] for h in lake_history
            if h.get("tidemark", {}).get("held_as_text")] == [["a", "b"]], lake_history
    from tidemark.lake import changelog_uri

    log_history = open_delta(changelog_uri(cfg, "public.fb"), storage_options(cfg)).history()
    assert any(h.get("tidemark", {}).get("operation") == "changelog_restart" for h in log_history), log_history

    # the stream goes on: plain values into the text columns, lists elsewhere
    _exec(source_db, "INSERT INTO fb VALUES (5, '{1}', '{q}', '{5,NULL}')", "UPDATE arr SET a_i2 = '{1}' WHERE id = 1")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert _lake(cfg, "fb", ["a", "b", "ok"]) == _source(source_db, "fb", {"a": "a::text", "b": "b::text", "ok": None})
    _assert_arr_equal(cfg, source_db)
    report = parity_report(cfg)
    assert all(r["equal"] for r in report.values()), report
