"""Probes of source data shapes a new user's database has: values at the edges of their types
(numeric NaN/±Infinity and huge scales, ±infinity and BC timestamps and dates, time 24:00, interval
extremes, money, bits, network types, xml, jsonb escapes, odd unicode, large and empty bytea), arrays
(NULL elements, empty, declared multi-dimensional), ranges and multiranges, enums given a value while
the stream runs, domains with constraints (over an array too), nested composites, tsvector, oid and
regclass, char(n) and "char", citext and hstore. Each round lands its changes through the real
pipeline (drain, consolidate) and compares the lake with PostgreSQL: `tidemark.parity`, the oracle's
multiset of rows, and, for the temporal columns, PostgreSQL's own epoch arithmetic (not the parsers
both of the others share)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidemark.capture.snapshot import snapshot_stream
from tidemark.lake import read_table
from tidemark.parity import parity_report

from adversarial_kit import assert_lake_equals_source, consolidate, drain_until_current, rows

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SETUP = """
CREATE EXTENSION IF NOT EXISTS citext;
CREATE EXTENSION IF NOT EXISTS hstore;
CREATE TYPE xmood AS ENUM ('sad', 'ok');
CREATE TYPE xinner AS (a int, t text[]);
CREATE TYPE xouter AS (i xinner, d date, m xmood);
CREATE DOMAIN xposlist AS int[] CHECK (VALUE IS NULL OR array_position(VALUE, 0) IS NULL);
CREATE DOMAIN xcode AS varchar(8) CHECK (VALUE ~ '^[A-Z]');
CREATE DOMAIN xmoney AS numeric(12, 2) CHECK (VALUE >= 0);
CREATE TABLE tz (
  id int PRIMARY KEY,
  n numeric, n2 numeric(38, 10), n3 numeric(5, -2), n4 numeric(1000, 500),
  ts timestamp, tstz timestamptz, d date, t time, ttz timetz, iv interval,
  m money, b bit(12), vb varbit, u uuid, ip inet, cn cidr, m8 macaddr8, x xml,
  j jsonb, js json, tx text, by bytea,
  ai int[], at text[], a2 int[][], ats timestamptz[], ad date[], aiv interval[],
  r int4range, rts tstzrange, rd daterange, mr int4multirange, mrn nummultirange,
  e xmood, ea xmood[], dl xposlist, dc xcode, dm xmoney, comp xouter, comps xouter[],
  tv tsvector, tq tsquery, o oid, rc regclass, ch char(6), c1 "char", ci citext, hs hstore, nm name
);
"""

COLUMNS = ("id, n, n2, n3, n4, ts, tstz, d, t, ttz, iv, m, b, vb, u, ip, cn, m8, x, j, js, tx, by, ai, at, a2, ats, "
           "ad, aiv, r, rts, rd, mr, mrn, e, ea, dl, dc, dm, comp, comps, tv, tq, o, rc, ch, c1, ci, hs, nm")

ROW_EDGES = r"""(%(id)s, 'NaN', 1234567890123456789012345678.0123456789, 1234567, NULL,
  '4713-01-01 00:00:00 BC', '294246-12-31 23:59:59.999999+00', '5874897-12-31', '24:00:00', '24:00:00-15:59',
  '178000000 years', '92233720368547758.07', B'101010101010', B'1', 'ffffffff-ffff-ffff-ffff-ffffffffffff',
  '::ffff:1.2.3.4/128', '::/0', 'ff:ff:ff:ff:ff:ff:ff:ff', '<?xml version="1.0"?><a>&lt;é&gt;</a>',
  '{"e\u00e9": "\u2603 \ud83d\ude00", "n": null, "a": [null, {"b": null}], "": ""}',
  '{"k": "\u0000", "k": 2,  "sp" : [ ] }',
  E'😀 e\u0301 \u202Eevil\u202C עברית \u0001\u001f \\ "q" \r\n\t end',
  decode(repeat('00ff10', 300000), 'hex'),
  '{1,NULL,-2147483648}', '{"a,b",NULL,"NULL","","\\\"",é}', '{{1,NULL},{3,4}}',
  '{infinity,-infinity,"0001-01-01 00:00:00+00 BC"}', '{infinity,"0044-03-15 BC"}', '{"-178000000 years",PT0S}',
  'empty', '[-infinity,infinity)', '[2020-01-01,infinity)', '{[1,3),[5,7)}', '{}',
  'ok', '{sad,NULL,ok}', '{1,2,NULL}', 'Abc', 0.00,
  ROW(ROW(1, '{"x,y",NULL}')::xinner, '0044-03-15 BC', 'sad')::xouter,
  ARRAY[ROW(ROW(NULL, NULL)::xinner, NULL, NULL)::xouter, NULL],
  'a:1A fat:2B,4C cat', 'fat & (rat | !cat)', 4294967295, 'pg_class', 'ab', E'\\001', 'MiXeD Ünïcode',
  'a=>1, "b c"=>NULL, "\"q\""=>"x\\y"', repeat('n', 63))"""

ROW_NULLS = "(%(id)s" + ", NULL" * (len(COLUMNS.split(",")) - 1) + ")"

ROW_OTHER = r"""(%(id)s, '-Infinity', -0.0000000001, -9999900, ('0.' || repeat('0', 499) || '1')::numeric,
  '0001-01-01 00:00:00', '-infinity', '0044-03-15 BC', '00:00:00', '00:00:00+15:59',
  '-178000000 years -2147483648 days -2562047788:00:54.775807', '-92233720368547758.08', B'000000000000', B'',
  '00000000-0000-0000-0000-000000000000', '0.0.0.0/0', '10.1.0.0/16', '00:00:00:00:00:00:00:00', '<a/>',
  '[]', 'null', '', ''::bytea, '{}', '{}', '{}', '{}', '{}', '{}',
  '(,)', 'empty', '(,)', '{(,)}', '{[1.5,2.5]}',
  'sad', '{}', '{}', 'Z', 99.99, ROW(NULL, NULL, NULL), '{}', '', 'a', 0, '-', '', ' ', '', '', '')"""


def _exec(conn, *stmts, params=None):
    with conn.cursor() as cur:
        for s in stmts:
            cur.execute(s, params)


def _insert(conn, template: str, ids) -> None:
    for i in ids:
        _exec(conn, f"INSERT INTO tz ({COLUMNS}) VALUES {template}", params={"id": i})


def _epochs_agree(cfg, conn) -> None:
    """The lake's temporal values (µs or days since 1970) are PostgreSQL's own epoch arithmetic."""
    import pyarrow as pa

    lake = read_table(cfg, "public.tz")
    ints = {"ts": lake.column("ts").cast(pa.int64()), "tstz": lake.column("tstz").cast(pa.int64()),
            "d": lake.column("d").cast(pa.int32())}
    at = {i: n for n, i in enumerate(lake.column("id").to_pylist())}
    with conn.cursor() as cur:
        cur.execute("""SELECT id, CASE WHEN isfinite(ts) THEN (extract(epoch FROM ts) * 1000000)::bigint END,
                              CASE WHEN isfinite(tstz) THEN (extract(epoch FROM tstz) * 1000000)::bigint END,
                              CASE WHEN isfinite(d) THEN d - date '1970-01-01' END FROM tz""")
        for id_, *want in cur.fetchall():
            for col, w in zip(("ts", "tstz", "d"), want):
                if w is not None:
                    assert ints[col][at[id_]].as_py() == w, (id_, col, ints[col][at[id_]], w)


def _equal(cfg, spark, conn) -> None:
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg)
    report = parity_report(cfg)
    assert all(r["equal"] for r in report.values()), report


def test_values_at_the_edges_of_their_types_round_trip(make_stream, source_conn, spark, capsys):
    """Snapshot and slot carry every value exactly; the table read as of an earlier position
    (`read_tables(at=)`, the lake's version there and its changelog) and through Spark
    (`register_table`, also ``as_of``) too. Those two failed on a date of 'infinity' (2**31 - 1 days)
    or a BC date with "ValueError: year 5881580 is out of range", naming nothing: the rows were made
    Python (or pandas) values on the way."""
    _exec(source_conn, SETUP)
    _insert(source_conn, ROW_EDGES, [1])
    _insert(source_conn, ROW_OTHER, [2])
    _insert(source_conn, ROW_NULLS, [3])
    cfg = make_stream(["public.tz"], consolidate={"buckets": 2})
    snapshot_stream(cfg)
    _equal(cfg, spark, source_conn)
    first, first_rows = _frontier(cfg), rows(read_table(cfg, "public.tz"))
    # the same values through the slot
    _insert(source_conn, ROW_EDGES, [11])
    _insert(source_conn, ROW_OTHER, [12])
    _insert(source_conn, ROW_NULLS, [13])
    _exec(source_conn,
          "ALTER TYPE xmood ADD VALUE 'happy ✓'",                           # a value added while streaming
          "ALTER TYPE xmood ADD VALUE 'first' BEFORE 'sad'",
          "UPDATE tz SET e = 'happy ✓', ea = '{first,\"happy ✓\"}' WHERE id IN (1, 12)",
          "UPDATE tz SET tx = tx || '!' WHERE id = 11",                       # by (TOAST) left unchanged
          "UPDATE tz SET comp = ROW(ROW(2, '{}')::xinner, 'infinity', 'first')::xouter WHERE id = 2",
          "DELETE FROM tz WHERE id = 3")
    _equal(cfg, spark, source_conn)
    _epochs_agree(cfg, source_conn)
    # read as of the first frontier (the lake's version there and its changelog), and through Spark
    from tidemark.lake import read_tables, register_table

    assert rows(read_tables(cfg, ["public.tz"], at=first)["public.tz"]) == first_rows
    n = read_table(cfg, "public.tz").num_rows
    assert register_table(spark, cfg, "public.tz").count() == n
    assert register_table(spark, cfg, "public.tz", name="tz_then", as_of=first).count() == sum(first_rows.values())
    # `tidemark read` prints them (it failed with "year 5881580 is out of range"): ±infinity as PostgreSQL
    # writes it, BC as ISO 8601's astronomical years, in lists and composites too
    import json

    import yaml

    from tidemark import cli

    streams = Path(cfg.landing.url.removeprefix("file://")).parent / "streams"
    streams.mkdir(exist_ok=True)
    (streams / f"{cfg.stream}.yaml").write_text(yaml.safe_dump(cfg.as_dict()))
    capsys.readouterr()
    assert cli.main(["--streams", str(streams), "read", cfg.stream, "public.tz", "--format", "jsonl"]) == 0
    printed = {r["id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert (printed[1]["ts"], printed[1]["d"], printed[2]["tstz"]) == ("-4712-01-01 00:00:00.000000", "5874897-12-31",
                                                                       "-infinity")
    assert printed[1]["ad"] == ["infinity", "-0043-03-15"] and printed[2]["d"] == "-0043-03-15"
    assert printed[12]["ts"] == "0001-01-01 00:00:00.000000"   # the column's other values alike
    assert cli.main(["--streams", str(streams), "read", cfg.stream, "public.tz"]) == 0     # csv
    assert "infinity" in capsys.readouterr().out


def _frontier(cfg) -> int:
    from tidemark.control import open_control

    with open_control(cfg) as ctl:
        return ctl.stream(cfg.stream).frontier
