"""The column-wise Avro encoder (`avro_columns`) against fastavro, and the changelog file built with it
(`cdc_file.cdc_bytes`) against a plain Python pre-consolidation, on generated tables."""

from __future__ import annotations

import decimal
import io
import math

import fastavro
import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidemark.consolidate import avro_columns as AC
from tidemark.consolidate.cdc_file import _avro_type, cdc_bytes, cdc_schema
from tidemark.consolidate.preconsolidate import plain

INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
TYPES = {
    "bool": (pa.bool_(), st.booleans()),
    "int16": (pa.int16(), st.integers(-(1 << 15), (1 << 15) - 1)),
    "int32": (pa.int32(), st.integers(-(1 << 31), (1 << 31) - 1)),
    "int64": (pa.int64(), INT64),
    "float32": (pa.float32(), st.floats(width=32)),
    "float64": (pa.float64(), st.floats()),
    "text": (pa.string(), st.text(max_size=20)),
    "bytes": (pa.binary(), st.binary(max_size=20)),
    "date": (pa.date32(), st.integers(-(1 << 31), (1 << 31) - 1)),
    "ts": (pa.timestamp("us"), INT64),
    "tstz": (pa.timestamp("us", tz="UTC"), INT64),
    "num18": (pa.decimal128(18, 3), st.integers(-(10 ** 18) + 1, 10 ** 18 - 1)),
    "num38": (pa.decimal128(38, 5), st.integers(-(10 ** 38) + 1, 10 ** 38 - 1)),
    "ints": (pa.list_(pa.int32()), st.lists(st.one_of(st.none(), st.integers(-(1 << 31), (1 << 31) - 1)), max_size=4)),
    "texts": (pa.list_(pa.string()), st.lists(st.one_of(st.none(), st.text(max_size=5)), max_size=4)),
}


def _array(kind: str, values: list):
    t = TYPES[kind][0]
    if pa.types.is_decimal(t):
        return pa.array([None if v is None else decimal.Decimal(v).scaleb(-t.scale, decimal.Context(prec=60)) for v in values], t)
    if pa.types.is_date32(t):
        return pa.array(values, pa.int32()).cast(t)
    if pa.types.is_timestamp(t):
        return pa.array(values, pa.int64()).cast(t)
    return pa.array(values, t)


@st.composite
def columns(draw, min_rows=0):
    kinds = draw(st.lists(st.sampled_from(sorted(TYPES)), min_size=1, max_size=4))
    n = draw(st.integers(min_rows, 12))
    return [(k, _array(k, draw(st.lists(st.one_of(st.none(), TYPES[k][1]), min_size=n, max_size=n)))) for k in kinds]


def _fastavro_rows(arrays: list) -> list[bytes]:
    """What fastavro writes for each row: a record of ``["null", T]`` fields (`cdc_file._avro_type`)."""
    schema = fastavro.parse_schema({"type": "record", "name": "r", "fields": [
        {"name": f"f{i}", "type": _avro_type(a.type)} for i, a in enumerate(arrays)]})
    view = plain(pa.table({f"f{i}": a for i, a in enumerate(arrays)}))
    out = []
    for row in view.to_pylist():
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, schema, row)
        out.append(buf.getvalue())
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(columns(), st.data())
def test_rows_are_encoded_byte_for_byte_as_fastavro_writes_them(cols, data):
    arrays = [a for _, a in cols]
    n = len(arrays[0])
    if n > 2 and data.draw(st.booleans()):          # a sliced (offset) array must encode the same
        lo = data.draw(st.integers(0, n - 1))
        arrays = [pa.chunked_array([a]).slice(lo) for a in arrays]
    off, enc = AC.encode_rows([(a, True) for a in arrays])
    got = [enc[off[i]:off[i + 1]].tobytes() for i in range(len(off) - 1)]
    assert got == _fastavro_rows([a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a for a in arrays])


def _reference_file(rows, times, diffs, lower, upper, since) -> bytes:
    """The changelog file written by fastavro from Python values, pre-consolidated in plain Python:
    identical (data, time) summed (NaN equal to NaN, -0.0 not equal to 0.0), zero sums dropped,
    ordered by time then first occurrence."""
    from tidemark.consolidate.cdc_file import feed_field_names

    def key(v):
        if isinstance(v, list):
            return ("list",) + tuple(key(x) for x in v)
        if isinstance(v, float) and math.isnan(v):
            return ("nan",)
        if isinstance(v, float) and v == 0.0 and math.copysign(1.0, v) < 0:
            return ("-0",)          # PostgreSQL prints -0: a change from 0 to -0 is a change
        return v

    names = feed_field_names(rows.column_names)
    merged: dict = {}
    for r, t, d in zip(plain(rows).to_pylist(), times, diffs):
        k = (t, tuple(key(v) for v in r.values()))
        merged.setdefault(k, [list(r.values()), t, 0])[2] += d
    ups = sorted((u for u in merged.values() if u[2]), key=lambda u: u[1])
    counts: dict = {}
    for _, t, _ in ups:
        counts[t] = counts.get(t, 0) + 1
    records = [("com.materialize.cdc.progress", {"lower": [since], "upper": [lower], "counts": []}),
               [{"data": dict(zip(names, v)), "time": t, "diff": d} for v, t, d in ups],
               ("com.materialize.cdc.progress", {"lower": [lower], "upper": [upper], "counts": [
                   {"time": t, "count": c} for t, c in sorted(counts.items())]})]
    buf = io.BytesIO()
    fastavro.writer(buf, fastavro.parse_schema(cdc_schema("public.t", rows.schema)), records,
                    metadata={"tidemark.table": "public.t"}, codec="zstandard")     # the feed's codec
    return buf.getvalue()


def _raw(blob: bytes):
    """A file's header and records, read without logical types (dates, timestamps, decimals as stored)."""
    import json

    def strip(s):
        if isinstance(s, dict):
            return {k: strip(v) for k, v in s.items() if k != "logicalType"}
        if isinstance(s, list):
            return [strip(x) for x in s]
        return s

    blocks = fastavro.block_reader(io.BytesIO(blob))
    schema = fastavro.parse_schema(strip(json.loads(blocks.metadata["avro.schema"])))
    records = []
    for block in blocks:
        raw = io.BytesIO(block.bytes_.getvalue() if hasattr(block.bytes_, "getvalue") else block.bytes_)
        records += [fastavro.schemaless_reader(raw, schema, None) for _ in range(block.num_records)]
    updates = [u for r in records if isinstance(r, list) for u in r]
    return blocks.metadata, updates, [r for r in records if isinstance(r, dict)]


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(columns(min_rows=1), st.data())
def test_changelog_file_is_the_preconsolidated_updates_and_their_counts(cols, data):
    n = len(cols[0][1])
    # repeat some rows (same or another time, diff +-1) so there is something to consolidate
    picks = data.draw(st.lists(st.integers(0, n - 1), max_size=2 * n))
    idx = list(range(n)) + picks
    rows = pa.table({f"c{i} {k}": a for i, (k, a) in enumerate(cols)}).take(pa.array(idx, pa.int64()))
    times = data.draw(st.lists(st.integers(1, 3), min_size=len(idx), max_size=len(idx)))
    diffs = data.draw(st.lists(st.sampled_from([-1, 1, 2]), min_size=len(idx), max_size=len(idx)))
    blob = cdc_bytes("public.t", rows.schema, rows, times, diffs, 1, 9, chunk=data.draw(st.integers(1, 5)),
                     since=0)
    meta, updates, progress = _raw(blob)
    ref_meta, ref_updates, ref_progress = _raw(_reference_file(rows, times, diffs, 1, 9, 0))
    assert meta == ref_meta          # the same writer schema and metadata
    assert progress == ref_progress
    assert len(updates) == len(ref_updates) and all(_same(a, b) for a, b in zip(updates, ref_updates))


def test_varints_at_their_boundaries():
    values = np.array([0, 1, -1, 63, -64, 64, -65, 8191, 8192, (1 << 62), -(1 << 63), (1 << 63) - 1], np.int64)
    off, enc = AC.long_values(values)
    for i, v in enumerate(values.tolist()):
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, "long", v)
        assert enc[off[i]:off[i + 1]].tobytes() == buf.getvalue()


def test_a_change_between_zero_and_negative_zero_is_kept():
    """An UPDATE of a float8 from 0 to -0 (PostgreSQL prints ``0`` and ``-0``) is a change: its -1 and +1
    are not identical rows and must not cancel; NaN rows do cancel (every NaN is one value)."""
    from tidemark.consolidate.preconsolidate import consolidated_updates

    rows = pa.table({"id": pa.array([1, 1, 2, 2], pa.int64()),
                     "f": pa.array([0.0, -0.0, float("nan"), float("nan")], pa.float64()),
                     "l": pa.array([[0.0], [-0.0], [1.0], [1.0]], pa.list_(pa.float64()))})
    idx, sums = consolidated_updates(rows, [5, 5, 5, 5], [-1, 1, -1, 1])
    assert idx.tolist() == [0, 1] and sums.tolist() == [-1, 1]
    idx, sums = consolidated_updates(rows.select(["id", "f"]), [5, 5, 5, 5], [-1, 1, -1, 1])
    assert idx.tolist() == [0, 1] and sums.tolist() == [-1, 1]
