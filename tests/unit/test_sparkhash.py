"""`sparkhash.buckets` gives every row the bucket Spark's ``pmod(xxhash64(keys), n)`` gives it, on
generated values of every key type it covers, alone and chained over several columns with nulls."""

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


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=tables())
def test_buckets_equal_sparks_on_generated_keys(spark, case):
    from pyspark.sql import functions as F

    table, cols, n = case
    assert sparkhash.supported(table.schema, cols)
    df = spark.createDataFrame(table.append_column("_row", pa.array(range(table.num_rows), pa.int64())))
    got = df.select("_row", F.xxhash64(*cols).alias("h"), bucket_expr(cols, n).alias("b")).toArrow()
    got = got.sort_by("_row")
    assert sparkhash.xxhash64(table, cols).tolist() == got.column("h").to_pylist()
    assert sparkhash.buckets(table, cols, n).tolist() == got.column("b").to_pylist()


def test_types_it_does_not_cover_are_left_to_spark():
    schema = pa.schema([("f", pa.float64()), ("wide", pa.decimal128(30, 2)), ("i", pa.int64()),
                        ("l", pa.list_(pa.int32()))])
    assert not sparkhash.supported(schema, ["i", "f"])
    assert not sparkhash.supported(schema, ["wide"])
    assert not sparkhash.supported(schema, ["l"])
    assert not sparkhash.supported(schema, [])
    assert sparkhash.supported(schema, ["i"])
