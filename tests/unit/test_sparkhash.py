"""`sparkhash.buckets` gives every row the bucket Spark's ``pmod(xxhash64(keys), n)`` gives it, on
generated values of every lake type (a table without a key hashes every column: floats, wide
decimals and arrays too), alone and chained over several columns with nulls."""

from __future__ import annotations

import datetime as dt
import decimal

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidemark.consolidate import sparkhash
from tidemark.consolidate.transform import bucket_expr

pytestmark = pytest.mark.spark

UTC = dt.timezone.utc
TYPES = {
    "i8": (pa.int8(), st.integers(-128, 127)),
    "i16": (pa.int16(), st.integers(-(1 << 15), (1 << 15) - 1)),
    "i32": (pa.int32(), st.integers(-(1 << 31), (1 << 31) - 1)),
    "i64": (pa.int64(), st.integers(-(1 << 63), (1 << 63) - 1)),
    "b": (pa.bool_(), st.booleans()),
    "d": (pa.date32(), st.dates(dt.date(1, 1, 1), dt.date(9999, 12, 31))),
    "ts": (pa.timestamp("us"), st.datetimes(dt.datetime(1, 1, 2), dt.datetime(9999, 12, 30))),
    "tstz": (pa.timestamp("us", tz="UTC"), st.datetimes(dt.datetime(1, 1, 2), dt.datetime(9999, 12, 30),
                                                          timezones=st.just(UTC))),
    "s": (pa.string(), st.text(max_size=80)),
    "bin": (pa.binary(), st.binary(max_size=80)),
    "dec": (pa.decimal128(18, 4), st.decimals(min_value=decimal.Decimal("-99999999999999.9999"),
                                              max_value=decimal.Decimal("99999999999999.9999"), places=4)),
    "dec5": (pa.decimal128(5, 0), st.decimals(min_value=-99999, max_value=99999, places=0)),
    "f32": (pa.float32(), st.floats(width=32)),
    "f64": (pa.float64(), st.floats() | st.sampled_from([0.0, -0.0, float("nan"), float("inf")])),
    "wide": (pa.decimal128(38, 6), st.decimals(min_value=-(10 ** 32) + 1, max_value=10 ** 32 - 1, places=6)
             | st.sampled_from([decimal.Decimal(v) for v in ("0", "-1", "127", "128", "-128", "-129", "255", "-256")])),
    "li": (pa.list_(pa.int32()), st.lists(st.none() | st.integers(-(1 << 31), (1 << 31) - 1), max_size=4)),
    "ls": (pa.list_(pa.string()), st.lists(st.none() | st.text(max_size=10), max_size=4)),
    "lf": (pa.list_(pa.float64()), st.lists(st.none() | st.floats(), max_size=4)),
    # a 2-D array column (int[][]: lists of lists; an inner list is never null in PostgreSQL)
    "lli": (pa.list_(pa.list_(pa.int32())), st.lists(st.lists(st.none() | st.integers(-(1 << 31), (1 << 31) - 1),
                                                               max_size=3), max_size=3)),
}


@st.composite
def tables(draw):
    names = draw(st.lists(st.sampled_from(sorted(TYPES)), min_size=1, max_size=3, unique=True))
    n = draw(st.integers(1, 25))
    cols = {}
    for name in names:
        t, values = TYPES[name]
        cols[name] = pa.array(draw(st.lists(st.none() | values, min_size=n, max_size=n)), t)
    return pa.table(cols), names, draw(st.sampled_from([1, 2, 7, 16, 64]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=tables())
def test_buckets_equal_sparks_on_generated_keys(spark, case):
    from pyspark.sql import functions as F

    table, cols, n = case
    assert all(sparkhash.kind(table.schema.field(c).type) is not None for c in cols)
    df = spark.createDataFrame(table.append_column("_row", pa.array(range(table.num_rows), pa.int64())))
    got = df.select("_row", F.xxhash64(*cols).alias("h"), bucket_expr(cols, n).alias("b")).toArrow()
    got = got.sort_by("_row")
    assert sparkhash.xxhash64(table, cols).tolist() == got.column("h").to_pylist()
    assert sparkhash.buckets(table, cols, n).tolist() == got.column("b").to_pylist()


def test_every_lake_type_is_covered():
    from tidemark.pgtypes import Column, arrow_type

    kinds = ["int16", "int32", "int64", "float32", "float64", "bool", "text", "bytes", "date", "time", "timetz",
             "timestamp", "timestamptz", "interval", "uuid", "json", "jsonb"]
    cols = [Column(k, k, k, 0) for k in kinds]
    cols += [Column("n", "numeric", "numeric", 1700, typmod=((38 << 16) | 4) + 4),
             Column("n2", "numeric", "numeric", 1700, typmod=((12 << 16) | 2) + 4),
             Column("nu", "numeric", "numeric", 1700),
             Column("arr", "array", "_int4", 1007, elem_kind="int32"),
             Column("arrt", "array", "_text", 1009, elem_kind="text")]
    schema = pa.schema([pa.field(c.name, arrow_type(c)) for c in cols])
    assert [f.name for f in schema if sparkhash.kind(f.type) is None] == []
