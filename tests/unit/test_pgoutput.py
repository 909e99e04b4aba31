"""pgoutput message decoding, tuple values, and the drain's Avro fast path (no database needed).

Messages are built here with `struct` from the protocol documentation, independently of the decoder.
The fast path's Avro bytes are checked against fastavro encoding the canonical value."""

from __future__ import annotations

import io
import math
import struct

import fastavro
import pytest

from tidemark.errors import DecodeError, SegmentError
from tidemark.capture.pgoutput import (
    PG_EPOCH_US,
    UNCHANGED,
    Begin,
    Commit,
    Delete,
    Insert,
    Message,
    Origin,
    Relation,
    RelationCodec,
    Truncate,
    Type,
    Update,
    avro_long,
    decode_message,
    encode_value,
    raw_encoder,
    table_from_relation,
)
from tidemark.pgtypes import Column, TableSchema, TypeResolver, avro_type, text_parser
from tidemark.landing.segments import Event, SegmentBuilder, SegmentWriter, Update as SegUpdate, read_segment


def cstr(s: str) -> bytes:
    return s.encode() + b"\0"


def tuple_data(*values) -> bytes:
    out = struct.pack(">h", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v is UNCHANGED:
            out += b"u"
        else:
            raw = v.encode() if isinstance(v, str) else v
            out += b"t" + struct.pack(">i", len(raw)) + raw
    return out


def relation_msg(oid, ns, name, ident, cols) -> bytes:
    out = b"R" + struct.pack(">I", oid) + cstr(ns) + cstr(name) + ident.encode() + struct.pack(">h", len(cols))
    for flags, cname, toid, typmod in cols:
        out += bytes([flags]) + cstr(cname) + struct.pack(">Ii", toid, typmod)
    return out


# -- message decoding ------------------------------------------------------------------------------

def test_begin_and_commit():
    b = decode_message(b"B" + struct.pack(">QqI", 0x16B3748, 1_000_000, 731))
    assert b == Begin(final_lsn=0x16B3748, commit_ts=1_000_000 + PG_EPOCH_US, xid=731)
    c = decode_message(b"C" + struct.pack(">BQQq", 0, 0x16B3748, 0x16B3780, 5))
    assert c == Commit(flags=0, commit_lsn=0x16B3748, end_lsn=0x16B3780, commit_ts=5 + PG_EPOCH_US)


def test_relation_type_origin_message():
    rel = decode_message(relation_msg(16384, "", "t", "d", [(1, "id", 23, -1), (0, "Name x", 1043, 36)]))
    assert isinstance(rel, Relation)
    assert (rel.oid, rel.namespace, rel.name, rel.replica_identity) == (16384, "pg_catalog", "t", "d")
    assert [(c.flags, c.name, c.type_oid, c.typmod) for c in rel.columns] == [(1, "id", 23, -1), (0, "Name x", 1043, 36)]
    assert decode_message(b"Y" + struct.pack(">I", 99999) + cstr("public") + cstr("mood")) == Type(99999, "public", "mood")
    assert decode_message(b"O" + struct.pack(">Q", 77) + cstr("node_a")) == Origin(77, "node_a")
    m = decode_message(b"M" + b"\x01" + struct.pack(">Q", 88) + cstr("pfx") + struct.pack(">i", 3) + b"abc")
    assert m == Message(flags=1, lsn=88, prefix="pfx", content=b"abc")


def test_insert_update_delete_tuples():
    ins = decode_message(b"I" + struct.pack(">I", 5) + b"N" + tuple_data("1", None, UNCHANGED, "é"))
    assert ins == Insert(5, (b"1", None, UNCHANGED, "é".encode()))
    upd = decode_message(b"U" + struct.pack(">I", 5) + b"N" + tuple_data("2", "x"))
    assert upd == Update(5, None, None, (b"2", b"x"))
    upd_k = decode_message(b"U" + struct.pack(">I", 5) + b"K" + tuple_data("1", None) + b"N" + tuple_data("2", "x"))
    assert upd_k == Update(5, "K", (b"1", None), (b"2", b"x"))
    upd_o = decode_message(b"U" + struct.pack(">I", 5) + b"O" + tuple_data("1", "a") + b"N" + tuple_data("1", "b"))
    assert upd_o.old_kind == "O" and upd_o.old == (b"1", b"a")
    dele = decode_message(b"D" + struct.pack(">I", 5) + b"K" + tuple_data("1", None))
    assert dele == Delete(5, "K", (b"1", None))


def test_truncate_options():
    t = decode_message(b"T" + struct.pack(">iB", 2, 3) + struct.pack(">II", 10, 11))
    assert t == Truncate(3, (10, 11)) and t.cascade and t.restart_identity
    assert not decode_message(b"T" + struct.pack(">iB", 1, 0) + struct.pack(">I", 10)).cascade


@pytest.mark.parametrize("payload, match", [
    (b"Z\x00", "unknown pgoutput message type 'Z'"),
    (b"I" + struct.pack(">I", 5) + b"N" + struct.pack(">h", 1) + b"b" + struct.pack(">i", 1) + b"x", "unknown value kind 'b'"),
    (b"B\x00\x01", "malformed pgoutput message 'B'"),
    (b"U" + struct.pack(">I", 5) + b"X", "unexpected tuple kind 'X'"),
])
def test_bad_messages_raise_decode_error(payload, match):
    with pytest.raises(DecodeError, match=match):
        decode_message(payload, lsn=0x1234)


# -- relation -> table shape, canonical rows -------------------------------------------------------

def test_table_from_relation_builtin_and_type_message_fallback():
    rel = decode_message(relation_msg(16384, "sales", "orders", "f",
                                      [(1, "id", 20, -1), (0, "amount", 1700, (10 << 16 | 2) + 4), (0, "m", 70000, -1)]))
    types = {70000: Type(70000, "sales", "mood")}
    t = table_from_relation(rel, TypeResolver(None), types)
    assert t.qualified == "sales.orders" and t.replica_identity == "f" and t.key_columns == ("id",)
    assert [c.kind for c in t.columns] == ["int64", "numeric", "text"]
    assert t.columns[1].numeric_precision_scale == (10, 2)
    assert t.columns[2].type_name == "sales.mood"


def _table(*cols: Column) -> TableSchema:
    return TableSchema("public", "t", 1, cols)


def test_codec_row_keeps_unchanged_marker_and_nulls():
    t = _table(Column("id", "int32", "int4", 23, key=True), Column("doc", "text", "text", 25),
               Column("n", "int64", "int8", 20))
    row, unchanged = RelationCodec(t).row((b"7", UNCHANGED, None))
    assert row == {"id": 7, "doc": None, "n": None} and unchanged == ("doc",)
    with pytest.raises(DecodeError, match="tuple has 2 columns, the relation has 3"):
        RelationCodec(t).row((b"7", None))
    with pytest.raises(DecodeError, match="column id: cannot parse"):
        RelationCodec(t).row((b"seven", None, None))


# -- Avro fast path == fastavro on canonical values ----------------------------------------------------

def fastavro_bytes(schema, value) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), value)
    return buf.getvalue()


@pytest.mark.parametrize("n", [0, 1, -1, 63, -64, 64, 8191, -8192, 8192, 2**31 - 1, -2**31, 2**53 + 1,
                               2**63 - 1, -2**63, 1_700_000_000_000_000, 0x16B3748])
def test_avro_long_matches_fastavro(n):
    assert avro_long(n) == fastavro_bytes("long", n)


CASES = [
    (Column("a", "int16", "int2", 21), ["0", "-32768", "32767"]),
    (Column("a", "int32", "int4", 23), ["-2147483648", "2147483647", "42"]),
    (Column("a", "int64", "int8", 20), ["-9223372036854775808", "9223372036854775807"]),
    (Column("a", "float32", "float4", 700), ["1.1", "NaN", "Infinity", "-Infinity", "-0", "3.4028235e+38"]),
    (Column("a", "float64", "float8", 701), ["0.1", "NaN", "-Infinity", "1e-308", "2.2250738585072014e-308"]),
    (Column("a", "bool", "bool", 16), ["t", "f"]),
    (Column("a", "numeric", "numeric", 1700), ["123456789012345678901234567890.123456789", "NaN", "-0.5"]),
    (Column("a", "text", "text", 25), ["", "héllo wörld ✓", "x" * 9000]),
    (Column("a", "bytes", "bytea", 17), ["\\x", "\\x00ff10", "\\x" + "ab" * 5000]),
    (Column("a", "date", "date", 1082), ["2024-02-29", "infinity", "-infinity", "0044-03-15 BC", "10000-01-01"]),
    (Column("a", "time", "time", 1083), ["00:00:00", "23:59:59.999999", "24:00:00", "12:00:00.5"]),
    (Column("a", "timestamp", "timestamp", 1114), ["2024-01-02 03:04:05.123456", "infinity", "1999-12-31 23:59:59"]),
    (Column("a", "timestamptz", "timestamptz", 1184), ["2024-01-02 03:04:05.123456+00", "1970-01-01 00:00:00+00",
                                                       "-infinity", "0001-01-01 00:00:00+00 BC"]),
    (Column("a", "interval", "interval", 1186), ["P1Y2M3DT4H5M6.5S", "PT0S"]),
    (Column("a", "uuid", "uuid", 2950), ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"]),
    (Column("a", "jsonb", "jsonb", 3802), ['{"a": [1, 2.5, null]}']),
    (Column("a", "array", "_int4", 1007, elem_kind="int32"), ["{}", "{1,NULL,-3}", "{{1,2},{3,4}}", "[0:1]={1,2}"]),
    (Column("a", "array", "_text", 1009, elem_kind="text"), ['{a,"b c","NULL",NULL,"q\\"x"}']),
    (Column("a", "array", "_float8", 1022, elem_kind="float64"), ["{NaN,Infinity,1.5}"]),
    (Column("a", "array", "_bytea", 1001, elem_kind="bytes"), ['{"\\\\x0102",NULL}']),
]


@pytest.mark.parametrize("col, texts", CASES, ids=[c[0].type_name for c in CASES])
def test_raw_encoder_matches_fastavro_of_canonical_value(col, texts):
    enc = raw_encoder(col)
    parse = text_parser(col)
    for text in texts:
        value = parse(text)
        expected = fastavro_bytes(avro_type(col), value)
        assert enc(text.encode()) == expected, text
        assert encode_value(col, value) == expected, text
    assert encode_value(col, None) == fastavro_bytes(avro_type(col), None)


def test_canonical_values_of_edge_cases():
    assert math.isnan(text_parser(Column("a", "float64", "float8", 701))("NaN"))
    assert text_parser(Column("a", "date", "date", 1082))("1970-01-02") == 1
    assert text_parser(Column("a", "timestamptz", "timestamptz", 1184))("1970-01-01 01:00:00+01") == 0
    assert text_parser(Column("a", "timestamptz", "timestamptz", 1184))("1970-01-01 00:00:00-05:30") == 19_800_000_000
    assert text_parser(Column("a", "array", "_int4", 1007, elem_kind="int32"))("{{1,2},{3,4}}") == "{{1,2},{3,4}}"


@pytest.mark.parametrize("col", [Column("a", "timestamp", "timestamp", 1114),
                                 Column("a", "timestamptz", "timestamptz", 1184)], ids=["timestamp", "timestamptz"])
def test_a_timestamp_on_infinitys_bound_is_refused_as_the_snapshot_refuses_it(col):
    """2**63 - 1 µs since 1970 (294247-01-10 04:00:54.775807, a finite PostgreSQL timestamp) is how the
    lake stores +infinity: the drain landed that value as +infinity, while a snapshot refused it as
    beyond the lake's range. Now both refuse it; infinity itself and the µs before it still land."""
    enc = raw_encoder(col)
    tz = "+00" if col.kind == "timestamptz" else ""
    with pytest.raises(OverflowError, match=r"294247-01-10 04:00:54\.775807.* beyond the lake's range"):
        enc(f"294247-01-10 04:00:54.775807{tz}".encode())
    assert enc(b"infinity") == fastavro_bytes(avro_type(col), 2**63 - 1)
    assert enc(b"-infinity") == fastavro_bytes(avro_type(col), -(2**63))
    assert enc(f"294247-01-10 04:00:54.775806{tz}".encode()) == fastavro_bytes(avro_type(col), 2**63 - 2)


# -- the fast path assembles records fastavro/read_segment agree with ----------------------------------

def test_encoded_segment_reads_like_segment_builder():
    t = TableSchema("public", "t", 1, (Column("id", "int64", "int8", 20, key=True), Column("doc", "text", "text", 25),
                                       Column("d", "date", "date", 1082)))
    codec = RelationCodec(t)
    time_, xid, ts = 0x2000, 900, 1_700_000_000_000_000
    seg = SegmentWriter("s", 3, 0x1000)
    branch = seg.branch(t)
    new = tuple_data("5", UNCHANGED, "2024-01-01")
    parts, toast, _ = codec.encode_tuple(new, 0)
    records = [
        [branch, *codec.key_parts(parts), avro_long(time_), codec.minus, avro_long(xid), avro_long(0),
         avro_long(ts) + b"\x02", b"\x00"],
        [branch, *parts, avro_long(time_), codec.plus, avro_long(xid), avro_long(1), avro_long(ts) + b"\x00",
         codec.toast_array(toast)],
    ]
    seg.append(b"\x00" + avro_long(2) + b"".join(b"".join(r) for r in records) + b"\x00")
    seg.append(b"\x04" + b"".join(fastavro_bytes("string", s) for s in ["truncate", "public.t"])
                      + avro_long(time_) + avro_long(xid) + avro_long(2) + avro_long(ts)
                      + fastavro_bytes("string", '{"cascade": false, "restart_identity": false}'))
    seg.counts[time_] = 3
    got = read_segment(seg.build(0x3000), "fast")

    ref = SegmentBuilder("s", 3, 0x1000)
    ref.add_transaction([
        SegUpdate(t, {"id": 5}, time_, -1, xid, 0, ts, image="key"),
        SegUpdate(t, {"id": 5, "doc": None, "d": 19723}, time_, 1, xid, 1, ts, unchanged_toast=("doc",)),
    ], [Event("truncate", "public.t", time_, xid, 2, ts, {"cascade": False, "restart_identity": False})])
    want = read_segment(ref.build(0x3000), "ref")
    assert got.updates == want.updates and got.events == want.events
    assert (got.lower, got.upper, got.counts, got.seq, got.stream) == (want.lower, want.upper, want.counts, 3, "s")
    assert got.relations == want.relations
    assert seg.build(0x3000) == seg.build(0x3000)


def test_encoded_segment_refuses_records_outside_range():
    seg = SegmentWriter("s", 0, 100)
    seg.counts[250] = 1
    with pytest.raises(SegmentError, match="outside"):
        seg.build(200)


def test_empty_encoded_segment_is_a_valid_progress_only_segment():
    content = read_segment(SegmentWriter("s", 0, 100).build(200))
    assert (content.lower, content.upper, content.updates, content.events, content.counts) == (100, 200, [], [], {})
