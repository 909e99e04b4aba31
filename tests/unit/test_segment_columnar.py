"""The column-by-column segment decoder (`tidemark.landing.columnar`) against fastavro, on generated
segments: table shapes of every column kind, null and TOAST-unchanged values, key-only images,
truncate events, several transactions, blocks spilled by size, every block codec segments are
written with. Also: segments it must leave to fastavro (counted array blocks, as older segments and
other producers write them; a codec Tidemark does not write) and damaged bytes (never a different
answer than fastavro's)."""

from __future__ import annotations

import bz2
import functools
import io
import math

import fastavro
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from segment_kit import counted_framing
from tidemark.errors import SegmentError
from tidemark.landing import segments as S
from tidemark.landing.columnar import decode_columnar
from tidemark.pgtypes import Column, TableSchema

I32 = st.integers(-(1 << 31), (1 << 31) - 1)
I64 = st.integers(-(1 << 63), (1 << 63) - 1)
TEXT = st.text(max_size=12)
SPECIAL = st.sampled_from([math.nan, -0.0, math.inf, -math.inf])
VALUES = {
    "int16": st.integers(-(1 << 15), (1 << 15) - 1), "int32": I32, "int64": I64,
    "float32": st.one_of(st.floats(width=32), SPECIAL), "float64": st.one_of(st.floats(), SPECIAL),
    "bool": st.booleans(),
    "numeric": st.decimals(allow_nan=False, places=3).map(str), "text": TEXT, "bytes": st.binary(max_size=12),
    "date": I32, "time": st.integers(0, 86_400_000_000), "timestamp": I64, "timestamptz": I64,
    "timetz": TEXT, "interval": TEXT, "uuid": st.uuids().map(str), "json": TEXT, "jsonb": TEXT,
}
ELEMS = ("int32", "int64", "float64", "bool", "text", "bytes")


@st.composite
def shapes(draw, n_tables):
    out = []
    for t in range(n_tables):
        ncols = draw(st.integers(1, 6))
        cols = []
        for i in range(ncols):
            kind = draw(st.sampled_from(sorted(VALUES) + ["array"]))
            cols.append(Column(name=draw(st.sampled_from([f"c{i}", f"Col {i}", f"c_{i}", f"ü{i}"])), kind=kind,
                               type_name=kind, type_oid=0, key=(i == 0 and kind != "array"),
                               elem_kind=draw(st.sampled_from(ELEMS)) if kind == "array" else None))
        out.append(TableSchema(schema="public", name=f"t{t}", oid=1000 + t, columns=tuple(cols)))
    return out


def value(draw, col: Column):
    if col.kind == "array":
        return draw(st.one_of(st.none(), TEXT, st.lists(st.one_of(st.none(), VALUES[col.elem_kind]), max_size=4)))
    return draw(st.one_of(st.none(), VALUES[col.kind]))


@st.composite
def segments(draw):
    tables = draw(shapes(draw(st.integers(1, 3))))
    b = S.SegmentBuilder("s", 3, 100, codec=draw(st.sampled_from(S.CODECS)))
    time = 100
    for _ in range(draw(st.integers(0, 6))):
        time += draw(st.integers(1, 5))
        ups, events, pos = [], [], 0
        for _ in range(draw(st.integers(0, 12))):
            table = draw(st.sampled_from(tables))
            if draw(st.integers(0, 9)) == 0:
                events.append(S.Event("truncate", table.qualified, time, 7, pos, 5,
                                      {"cascade": draw(st.booleans()), "restart_identity": False}))
            else:
                image = draw(st.sampled_from(["full", "full", "key"]))
                cols = [c for c in table.columns if image == "full" or c.key]
                row = {c.name: value(draw, c) for c in cols}
                others = [c.name for c in table.columns if not c.key]
                toast = draw(st.lists(st.sampled_from(others), unique=True, max_size=3)) if others and image == "full" else []
                for name in toast:
                    row[name] = None
                ups.append(S.Update(table, row, time, draw(st.sampled_from([1, -1])), 7, pos, draw(I64),
                                    image=image, unchanged_toast=tuple(toast)))
            pos += 1
        b.add_transaction(ups, events)
    return b.build(time + 1)


def _same(a, b) -> bool:
    """Equal, with NaN equal to NaN and -0.0 told from 0.0 (bit-exact floats); arrays (numpy, Arrow)
    of one type and equal values."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and _same(a.tolist(), b.tolist())
    if isinstance(a, pa.Array) or isinstance(b, pa.Array):
        return type(a) is type(b) and a.type == b.type and _same(a.to_pylist(), b.to_pylist())
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(segments())
def test_the_columnar_decoder_says_what_fastavro_says(data):
    fast = decode_columnar(data, "gen")
    assert fast is not None, "a segment Tidemark wrote must take the columnar path"
    ref = S._decode_fastavro(data, "gen")
    meta, relations, shapes_, events, progress, n = fast
    assert meta == ref[0] and relations == ref[1] and events == ref[3] and progress == ref[4] and n == ref[5]
    assert list(shapes_) == list(ref[2])
    for rname, cols in shapes_.items():
        assert _same(cols, ref[2][rname]), rname
    got, want = S.read_segment_columns(data, "gen"), S._checked("gen", *ref)
    assert (got.lower, got.upper, got.counts, got.events) == (want.lower, want.upper, want.counts, want.events)
    assert _same(got.shapes, want.shapes)


def test_segments_in_counted_blocks_are_left_to_fastavro_and_read_the_same():
    t = TableSchema("public", "m", 1, (Column("id", "int64", "int8", 20, key=True), Column("v", "text", "text", 25)))
    b = S.SegmentBuilder("s", 1, 10)
    for i in range(3):
        b.add_transaction([S.Update(t, {"id": i, "v": f"v{i}"}, 10 + i, 1, 5, 0, 99)])
    new = b.build(20)
    old = counted_framing(new)
    assert decode_columnar(old) is None
    assert decode_columnar(new) is not None
    assert S.read_segment(old).updates == S.read_segment(new).updates


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(segments(), st.data())
def test_damaged_bytes_never_decode_differently_from_fastavro(data, draw):
    at = draw.draw(st.integers(0, len(data) - 1))
    bad = data[:at] + bytes([data[at] ^ (1 << draw.draw(st.integers(0, 7)))]) + data[at + 1:]

    def outcome(fastavro_only: bool):
        try:
            if fastavro_only:
                return S._checked("x", *S._decode_fastavro(bad, "x"))
            return S.read_segment_columns(bad, "x")
        except Exception as exc:  # noqa: BLE001
            return ("error", exc)

    got, ref = outcome(False), outcome(True)
    if isinstance(got, tuple):
        assert isinstance(got[1], SegmentError), f"not a SegmentError: {got[1]!r}"
    if isinstance(ref, tuple):
        # fastavro refuses it: so must we (the columnar path may refuse with its own reason)
        assert isinstance(got, tuple), f"decoded what fastavro refuses: {ref[1]}"
    else:
        assert not isinstance(got, tuple) and _same(got.shapes, ref.shapes) and got.events == ref.events


def test_a_real_segment_falls_back_with_fastavro_naming_the_problem():
    t = TableSchema("public", "m", 1, (Column("id", "int64", "int8", 20, key=True),))
    b = S.SegmentBuilder("s", 1, 10)
    b.add_transaction([S.Update(t, {"id": 1}, 10, 1, 5, 0, 99)])
    data = b.build(20)
    with pytest.raises(SegmentError):
        S.read_segment_columns(data[:-20], "cut")


@pytest.mark.parametrize("codec", S.CODECS)
def test_a_large_segment_of_many_blocks_and_long_values(codec):
    t = TableSchema("public", "big", 1, (Column("id", "int64", "int8", 20, key=True), Column("v", "text", "text", 25),
                                         Column("f", "float32", "float4", 700), Column("b", "bytes", "bytea", 17)))
    b = S.SegmentBuilder("s", 1, 10, codec=codec)
    # ~11 MB in 5 blocks (a transaction's datum is never split): ten 200,000-character values per
    # transaction among multi-byte ones; the cost is per row (10,000 rows a transaction: 4x the time)
    for tx in range(4):
        b.add_transaction([S.Update(t, {"id": i * (1 << 40) - 7, "v": ("é" * (i % 300)) if i % 250 else "x" * 200_000,
                                        "f": i / 3, "b": bytes([i % 256]) * (i % 5)}, 10 + tx, (-1) ** i, 5, i,
                                    1 << 50, unchanged_toast=("v",) if i % 7 == 0 else ())
                           for i in range(2_500)])
    data = b.build(20)
    assert len(list(fastavro.block_reader(io.BytesIO(data)))) > 4
    fast = decode_columnar(data, "big")
    assert fast is not None and fast[5] == 10_000
    assert _same(fast[2], S._decode_fastavro(data, "big")[2])


@functools.cache       # bytes: each codec's segment built once for the tests below (~1.5 s of CPU each)
def _segment_of_every_kind(codec: str) -> bytes:
    t = TableSchema("public", "m", 1, (Column("id", "int64", "int8", 20, key=True), Column("v", "text", "text", 25)))
    b = S.SegmentBuilder("s", 1, 10, codec=codec)
    for tx in range(3):
        b.add_transaction([S.Update(t, {"id": i, "v": f"value {i % 17}" if i % 5 else None}, 10 + tx, 1, 5, i, 99,
                                    unchanged_toast=("v",) if i % 5 == 0 else ())
                           for i in range(4_000)],     # (many blocks: the large segment's test)
                          [S.Event("truncate", "public.m", 10 + tx, 5, 4_000, 99, {"cascade": False})])
    return b.build(20)


@pytest.mark.parametrize("codec", S.CODECS)
def test_every_codec_decodes_to_the_same_segment_on_both_paths(codec):
    plain, packed = _segment_of_every_kind("null"), _segment_of_every_kind(codec)
    assert fastavro.reader(io.BytesIO(packed)).metadata["avro.codec"] == codec
    if codec != "null":
        assert len(packed) < len(plain) / 4          # 1 MiB blocks of row images compress
    fast = decode_columnar(packed, "c")
    assert fast is not None
    assert _same(fast[2], decode_columnar(plain, "p")[2]) and fast[3] == decode_columnar(plain, "p")[3]
    assert _same(fast[2], S._decode_fastavro(packed, "c")[2])        # any Avro reader reads it
    assert list(fastavro.reader(io.BytesIO(packed))) == list(fastavro.reader(io.BytesIO(plain)))
    assert S.read_segment(packed).updates == S.read_segment(plain).updates


def _recompressed(data: bytes, codec: str, compress) -> bytes:
    """The same segment with every block compressed by ``compress`` and ``avro.codec`` = ``codec``."""
    from tidemark.landing.columnar import _header, _varint

    meta, sync, pos = _header(data)
    body = []
    while pos < len(data):
        count, pos = _varint(data, pos)
        size, pos = _varint(data, pos)
        packed = compress(data[pos:pos + size])
        body += (S.avro_long(count), S.avro_long(len(packed)), packed, sync)
        pos += size + 16
    meta = {**meta, "avro.codec": codec.encode()}
    head = [b"Obj\x01", S.avro_long(len(meta))]
    for k, v in meta.items():
        head += (S.avro_string(k), S.avro_bytes(v))
    return b"".join([*head, b"\x00", sync, *body])


def test_a_codec_tidemark_does_not_write_is_left_to_fastavro():
    t = TableSchema("public", "m", 1, (Column("id", "int64", "int8", 20, key=True),))
    b = S.SegmentBuilder("s", 1, 10, codec="null")
    b.add_transaction([S.Update(t, {"id": i}, 10, 1, 5, i, 99) for i in range(50)])
    plain = b.build(20)
    other = _recompressed(plain, "bzip2", bz2.compress)
    assert decode_columnar(other) is None
    assert S.read_segment(other).updates == S.read_segment(plain).updates


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(segments())
def test_lake_columns_from_the_decoders_arrays_equal_those_from_python_values(data):
    """`lake_array` takes the decoders' Arrow columns as they are (a cast): the lake table of every
    shape is the one built from the same values as Python lists, of every column kind."""
    from tidemark.consolidate.decode import _payload_table

    content = S.read_segment_columns(data, "gen")
    for rname, cols in content.shapes.items():
        shape = content.relations[rname]
        as_lists = {**cols, "row": {c: S._pylist(v) for c, v in cols["row"].items()}}
        bad_arrow, bad_lists = [], []
        got = _payload_table("gen", shape, cols, bad_arrow)
        want = _payload_table("gen", shape, as_lists, bad_lists)
        assert got.schema == want.schema, rname
        for name in got.column_names:           # NaN equal to NaN: compared as text when not equal as values
            a, b = got.column(name), want.column(name)
            text = pa.list_(pa.string()) if pa.types.is_list(a.type) else pa.string()
            assert a.equals(b) or a.cast(text).equals(b.cast(text)), (rname, name)
        assert [b[1] for b in bad_arrow] == [b[1] for b in bad_lists]
