"""Key-range checksums without a database: the lake side folds its fine ranges into the ranges the
source is compared at, the packed set of ranges copied round-trips, and the report says what was
copied."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings, strategies as st

from tidemark.capture import ranges
from tidemark.pgtypes import Column, TableSchema

SHAPE = TableSchema("public", "t", 1, (Column("id", "int64", "int8", 20, key=True), Column("v", "text", "text", 25)))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(-2**63, 2**63 - 1), st.none() | st.text(max_size=6)), max_size=60,
                unique_by=lambda r: r[0]), st.integers(0, 8))
def test_fine_sums_folded_equal_sums_taken_at_fewer_bits(data, bits):
    """The lake is summed once at `MAX_BITS` and folded to the bits chosen afterwards: the same as
    summing at those bits (a range is a prefix of the key hash's bits), so the comparison with
    PostgreSQL's sums at those bits is sound."""
    table = pa.table({"id": pa.array([r[0] for r in data], pa.int64()), "v": pa.array([r[1] for r in data], pa.string())})
    fine = ranges.Sums.zeros(ranges.MAX_BITS)
    fine.add_rows(*ranges.lake_ranges(SHAPE, ["id"], table, ranges.MAX_BITS))
    direct = ranges.Sums.zeros(bits)
    direct.add_rows(*ranges.lake_ranges(SHAPE, ["id"], table, bits))
    folded = fine.fold(bits)
    assert not folded.differing(direct).any()
    assert int(folded.count.sum()) == len(data)


@given(st.integers(0, 12), st.integers(0, 2**32 - 1), st.floats(0, 1))
def test_the_set_of_ranges_copied_round_trips(bits, seed, share):
    # the mask drawn from a seed (a list of 4,096 drawn booleans made the health check fail under load)
    mask = np.random.default_rng(seed).random(1 << bits) < share
    assert (ranges.unpack_ranges(ranges.pack_ranges(mask), bits) == mask).all()


def test_a_row_text_is_injective_across_columns():
    """Values that concatenate alike in different columns give different row texts."""
    a = pa.table({"id": pa.array([1], pa.int64()), "v": pa.array(["1V"], pa.string())})
    b = pa.table({"id": pa.array([1], pa.int64()), "v": pa.array([None], pa.string())})
    assert ranges._texts(SHAPE.columns, a) != ranges._texts(SHAPE.columns, b)
    assert ranges._texts(SHAPE.columns, b) == ["V1:1N"]


def test_bits_aim_at_a_few_rows_a_range_and_are_bounded():
    assert ranges.choose_bits(0) == 0 and ranges.choose_bits(ranges.RANGE_ROWS) == 0
    assert ranges.choose_bits(30_000) == 13                   # 8,192 ranges of about 4 rows
    assert ranges.choose_bits(10**12) == ranges.MAX_BITS


def test_the_copy_is_described_as_rows_re_copied_of_rows():
    entry = {"rows": 40, "ranges": {"bits": 4, "ranges": 16, "ranges_differing": 3, "source_rows": 1000,
                                    "copied": "", "rows_expected": 40}}
    copy = ranges.summary(entry)
    assert copy == {"rows_copied": 40, "rows": 1000, "ranges": 16, "ranges_copied": 3}
    assert ranges.describe_copy(copy, 40) == "40 rows re-copied of 1,000 (3 of 16 key ranges differed from the lake)"
    whole = ranges.summary({"rows": 7, "ranges": {"full": "no key"}})
    assert ranges.describe_copy(whole, 7) == "7 rows (copied whole: no key)"
    assert ranges.why_full(SHAPE, [], SHAPE).startswith("no key")
    assert ranges.why_full(SHAPE, ["id"], None) == "the lake does not hold it yet"
    assert ranges.why_full(SHAPE, ["id"], SHAPE) is None


def test_a_table_with_an_array_column_is_copied_whole():
    """Lists have no canonical text shared with PostgreSQL's array output here: a resend copies such a
    table whole instead of comparing range checksums (never a range wrongly found equal)."""
    shape = TableSchema("public", "t", 1, (Column("id", "int64", "int8", 20, key=True),
                                           Column("a", "array", "_int4", 1007, elem_kind="int32", dims=1)))
    assert "a have no canonical text" in ranges.why_full(shape, ["id"], shape)
