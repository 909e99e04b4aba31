"""Every mapped PostgreSQL type round-trips through the drain value-for-value.

The oracle is PostgreSQL: for each column the test SELECTs, through psycopg2, the natural value
and the text form, and for date/time kinds the exact integer PostgreSQL computes (days, µs since
the epoch), then compares each drained canonical value with them."""

from __future__ import annotations

import decimal
import math
import struct

import pytest

from oracle import start_at_new_slot
from tidemark.capture.drain import drain_stream
from tidemark.pgtypes import DATE_NEG_INF, DATE_POS_INF, TS_NEG_INF, TS_POS_INF, US_PER_DAY
from tidemark.landing.segments import read_segment_at
from tidemark.capture.source import connect_source

DDL = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN posint AS integer CHECK (VALUE > 0);
CREATE TABLE alltypes (
    id int PRIMARY KEY,
    i2 int2, i4 int4, i8 int8, num numeric, num_ps numeric(12,3), f4 float4, f8 float8, b bool,
    t text, vc varchar(20), ch char(5), by bytea,
    d date, tm time, ts timestamp, tstz timestamptz, iv interval, ttz timetz,
    u uuid, j json, jb jsonb,
    ai int4[], atx text[], an numeric[], ad date[], af float8[],
    e mood, dom posint, other inet, pt point, bx box[]
);
"""

ROWS = [
    """(1, 1, 2, 3, 12345.6789, 123456789.123, 1.1, 0.1, true,
        'héllo ✓ "q" \\ back', 'varchar', 'ab', '\\x00ff7f',
        '2024-02-29', '13:14:15.123456', '2024-02-29 13:14:15.5', '2024-02-29 13:14:15.123456+02', '1 year 2 mons 3 days 04:05:06.7',
        '10:00:00+05:30',
        'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{"b": 1,  "a": [true, null]}', '{"b": 1, "a": [true, null]}',
        '{1,NULL,-3}', '{"a,b",NULL,"NULL","q\\"x",""}', '{1.50,NaN,-2}', '{2024-01-01,NULL}', '{Infinity,-0,1e-300}',
        'happy', 7, '192.168.0.1/24', '(1.5,2)', '{(1,1),(0,0);(3,3),(2,2)}')""",
    "(2" + ", NULL" * 31 + ")",
    """(3, -32768, -2147483648, 9223372036854775807, 'NaN', -0.001, 'NaN', 'Infinity', false,
        '', '', '', '\\x',
        'infinity', '24:00:00', '-infinity', 'infinity', '-178000000 years', '00:00:00-12',
        '00000000-0000-0000-0000-000000000000', '[]', '{}',
        '{{1,2},{3,4}}', '{}', '{}', '[2:3]={2024-01-01,2024-01-02}', '{-Infinity}',
        'sad', 1, '::1', '(0,0)', '{}')""",
    """(4, 32767, 2147483647, -9223372036854775808, '-1e-20', 999999999.999, '-Infinity', '-1.7976931348623157e308', true,
        repeat('x', 10000), 'z', 'abcde', decode(repeat('ab', 3000), 'hex'),
        '0044-03-15 BC', '00:00:00', '0001-01-01 00:00:00 BC', '1970-01-01 00:00:00+00', 'P0D', '23:59:59.999999+14',
        'ffffffff-ffff-ffff-ffff-ffffffffffff', '"s"', 'null',
        '{2147483647}', '{"\\\\"}', '{123456789012345678901234567890.5}', '{-infinity,infinity}', '{NaN}',
        'ok', 2147483647, '10.0.0.0/8', '(-1,-1)', NULL)""",
]


@pytest.fixture
def typed_stream(make_stream, source_conn, control):
    with source_conn.cursor() as cur:
        cur.execute(DDL)
    cfg = make_stream(["public.alltypes"])
    start_at_new_slot(cfg, source_conn, control)
    return cfg


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def same_float(a, b) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))


def oracle_sql(col) -> str:
    """A SQL expression PostgreSQL evaluates to the canonical integer of a date/time column."""
    q = f'"{col.name}"'
    if col.kind == "date":
        return (f"CASE WHEN {q} = 'infinity' THEN {DATE_POS_INF} WHEN {q} = '-infinity' THEN {DATE_NEG_INF} "
                f"ELSE ({q} - date '1970-01-01') END")
    if col.kind in ("timestamp", "timestamptz"):
        return (f"CASE WHEN {q} = 'infinity' THEN {TS_POS_INF} WHEN {q} = '-infinity' THEN {TS_NEG_INF} "
                f"ELSE (extract(epoch FROM {q}) * 1000000)::bigint END")
    return f"(extract(epoch FROM {q}) * 1000000)::bigint"


def check(col, value, natural, text, exact):
    """Assert the drained canonical value equals what PostgreSQL returned."""
    where = f"{col.name} ({col.type_name}): drained {value!r}, PostgreSQL {natural!r} / {text!r}"
    if text is None:
        assert value is None, where
        return
    kind = col.kind
    if kind in ("int16", "int32", "int64", "bool"):
        assert value == natural and type(value) is type(natural), where
    elif kind == "float64":
        assert same_float(value, natural), where
    elif kind == "float32":
        assert same_float(value, f32(natural)), where
    elif kind == "bytes":
        assert value == bytes(natural), where
    elif kind in ("date", "time", "timestamp", "timestamptz"):
        assert value == exact, where
    elif kind == "text" and col.type_name.endswith("[]"):   # arrays: PostgreSQL's text form, any dimensions
        assert value == text, where
    elif kind == "text":                                  # text, char(n) with its padding, enums, inet, point
        assert value == natural, where                    # psycopg2 returns their output text
    elif kind == "array":
        if isinstance(value, str):                        # multi-dimensional / non-default bounds
            assert value == text, where
            return
        assert len(value) == len(natural), where
        for v, n in zip(value, natural):
            if n is None:
                assert v is None, where
            elif col.elem_kind == "numeric":
                assert decimal.Decimal(v).compare_total(n) == 0, where
            elif col.elem_kind == "float64":
                assert same_float(v, n), where
            else:                                         # date elements: PostgreSQL's day numbers
                assert v == n, where
    else:                                                 # numeric, interval, uuid, json(b), timetz, others
        assert value == text, where


def test_every_type_round_trips_value_for_value(typed_stream, source_conn):
    with source_conn.cursor() as cur:
        for row in ROWS:
            cur.execute("INSERT INTO alltypes VALUES " + row)
    result = drain_stream(typed_stream)
    seg = read_segment_at(result.uri)
    assert result.records == len(ROWS)
    table = seg.updates[0].table
    kinds = {c.name: (c.kind, c.type_name, c.elem_kind) for c in table.columns}
    assert kinds["e"] == ("text", "mood", None) and kinds["dom"][0] == "int32"
    assert kinds["other"] == ("text", "inet", None) and kinds["pt"] == ("text", "point", None)
    assert kinds["bx"] == ("text", "box[]", None)      # ';'-delimited array: kept as text
    # arrays: lists of their element's kind in the lake; the segment carries PostgreSQL's text (`check`)
    assert kinds["ai"] == ("array", "integer[]", "int32") and kinds["an"] == ("array", "numeric[]", "numeric")
    assert kinds["ts"][0] == "timestamp" and kinds["tstz"][0] == "timestamptz" and kinds["j"][0] == "json"

    cols = table.columns
    natural_cols = [c for c in cols if c.kind not in ("date", "time", "timestamp", "timestamptz", "interval")
                    and not c.type_name.endswith("[]")]
    conn = connect_source(typed_stream)
    try:
        for u in seg.updates:
            with conn.cursor() as cur:
                cur.execute("SELECT " + ", ".join(f'"{c.name}"' for c in natural_cols) + " FROM alltypes WHERE id = %s",
                            (u.row["id"],))
                natural = dict(zip([c.name for c in natural_cols], cur.fetchone()))
                cur.execute("SELECT " + ", ".join(f'"{c.name}"::text' for c in cols) + " FROM alltypes WHERE id = %s",
                            (u.row["id"],))
                text = dict(zip([c.name for c in cols], cur.fetchone()))
                timed = [c for c in cols if c.kind in ("date", "time", "timestamp", "timestamptz")]
                cur.execute("SELECT " + ", ".join(oracle_sql(c) for c in timed) + " FROM alltypes WHERE id = %s",
                            (u.row["id"],))
                exact = dict(zip([c.name for c in timed], cur.fetchone()))
            for c in cols:
                check(c, u.row[c.name], natural.get(c.name), text[c.name], exact.get(c.name))
    finally:
        conn.close()
    # spot checks that make the comparisons above meaningful
    by_id = {u.row["id"]: u.row for u in seg.updates}
    assert by_id[3]["tm"] == US_PER_DAY and by_id[3]["d"] == DATE_POS_INF and by_id[3]["ts"] == TS_NEG_INF
    assert math.isnan(by_id[3]["f4"]) and by_id[3]["num"] == "NaN" and by_id[3]["ai"] == "{{1,2},{3,4}}"
    assert by_id[1]["ch"] == "ab   " and by_id[1]["j"] == '{"b": 1,  "a": [true, null]}'
    assert len(by_id[4]["t"]) == 10000 and len(by_id[4]["by"]) == 3000
