"""`tidemark parity`'s source side reads each type's output text the way the drain does (not
``col::text``), and its checksum keeps apart what equality keeps apart (the lake side is compared
in the property-based oracle, tests/e2e/test_property_oracle.py)."""

from __future__ import annotations

from collections import Counter

import psycopg2
import pyarrow as pa

from refapply import arrow_rows, source_rows
from tidemark.parity import source_table, table_checksum
from tidemark.pgtypes import session_options, table_schema_from_catalog

SETUP = """
CREATE TYPE mood AS ENUM ('sad', 'ok');
CREATE DOMAIN posint AS int CHECK (VALUE > 0);
CREATE TABLE t (id int PRIMARY KEY, bo bool, c char(5), f8 float8, f4 float4, n numeric(12, 3), nn numeric,
                iv interval, ts timestamp, tstz timestamptz, e mood, d posint, a int[], j jsonb, b bytea);
INSERT INTO t VALUES
  (1, true, 'ab', '-0', 'NaN', 1.5, 'NaN', '1 year 2 mons -3 days 04:05:06.000007', 'infinity', '-infinity',
   'ok', 3, '{1,NULL}', '{"k": [1, 2.50]}', '\\x00ff'),
  (2, false, 'abcde', 'Infinity', '-Infinity', -0.001, '1e-30', '-00:00:00.000001', '0044-03-15 BC', now(),
   'sad', NULL, '{}', 'null', ''),
  (3, NULL, NULL, 0, 0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
"""


def test_source_side_reads_output_text_like_the_drain(source_db, source_conn):
    with source_conn.cursor() as cur:
        cur.execute(SETUP)
    conn = psycopg2.connect(source_db, options=session_options())
    try:
        schema = table_schema_from_catalog(conn, "public", "t")
        got = source_table(conn, schema)
        want = source_rows(conn, schema)               # the independent reader of tests/refapply.py
    finally:
        conn.close()
    assert Counter(arrow_rows(got)) == Counter(want)
    by_id = {r["id"]: r for r in got.select(["id", "bo", "c"]).to_pylist()}
    assert by_id[1]["bo"] is True and by_id[2]["bo"] is False        # ::text would parse 'true' as false
    assert by_id[1]["c"] == "ab   "                                     # ::text trims char(n) padding


def test_checksum_keeps_apart_what_equality_keeps_apart():
    def cs(values, typ=pa.float64()):
        return table_checksum(pa.table({"v": pa.array(values, typ)}))

    assert cs([0.0]) != cs([-0.0])
    assert cs([float("nan")]) == cs([float("nan")]) != cs([None])
    assert cs([float("inf")]) != cs([float("-inf")])
    assert cs([1.0, 2.0]) == cs([2.0, 1.0]) != cs([1.0, 2.0, 2.0])      # a multiset
    ts = pa.timestamp("us", tz="UTC")
    big = 2 ** 63 - 1
    assert cs([big], pa.int64()) != cs([big - 1], pa.int64())
    assert table_checksum(pa.table({"t": pa.array([big], pa.int64()).cast(ts)}))[0] == 1   # +infinity survives


def test_the_source_side_is_read_and_hashed_in_chunks(source_db, source_conn, monkeypatch):
    """`tidemark parity` holds a chunk of rows at a time, not the table (issue 34: 3.4 GB on 3.6 M
    rows): the source through a server-side cursor, `CHUNK_ROWS` rows at a time, hashed chunk by chunk
    into the same checksum as the whole table's."""
    from tidemark import parity

    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE many (id int PRIMARY KEY, f float8, s text)")
        cur.execute("INSERT INTO many SELECT g, CASE WHEN g % 7 = 0 THEN 'NaN' ELSE g / 3.0 END, "
                    "repeat('s', g % 50) FROM generate_series(1, 1000) g")
    monkeypatch.setattr(parity, "CHUNK_ROWS", 128)
    conn = psycopg2.connect(source_db, options=session_options())
    try:
        schema = table_schema_from_catalog(conn, "public", "many")
        chunks = list(parity.source_chunks(conn, schema))
        whole = source_table(conn, schema)
    finally:
        conn.close()
    assert [c.num_rows for c in chunks] == [128] * 7 + [104]
    assert Counter(arrow_rows(pa.concat_tables(chunks))) == Counter(arrow_rows(whole))
    backwards = whole.take(pa.array(range(whole.num_rows - 1, -1, -1)))
    assert parity._chunks_checksum(chunks) == table_checksum(whole) == table_checksum(backwards)
    assert table_checksum(whole)[0] == 1000 and table_checksum(whole.slice(1)) != table_checksum(whole)


def test_long_values_are_told_apart_by_their_hash():
    from tidemark.parity import LONG_VALUE

    long = "x" * (LONG_VALUE + 1)
    cs = lambda v, typ: table_checksum(pa.table({"v": pa.array([v], typ)}))      # noqa: E731
    assert cs(long, pa.string()) == cs(long, pa.string()) != cs(long + "y", pa.string())
    assert cs(long.encode(), pa.binary()) != cs((long + "y").encode(), pa.binary())
    assert cs(long.encode(), pa.binary()) != cs(long, pa.string())
