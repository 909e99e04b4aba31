"""Row identity by value bits (`tidemark.rowid`): equal keys exactly when the rows are the same by
an independent identity (every NaN one value whatever its payload or sign, -0.0 apart from 0.0,
null equal to null), for floats of both widths, inside lists, and in sliced tables."""

from __future__ import annotations

import math
import struct

import pyarrow as pa
from hypothesis import given, settings, strategies as st

from tidemark.rowid import row_keys

NANS = [float("nan"), struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0],
        struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000000))[0]]
VALUES = st.sampled_from(NANS + [float("inf"), float("-inf"), -0.0, 0.0, 1.5, None])


def ident(v):
    if isinstance(v, list):
        return ("list",) + tuple(ident(x) for x in v)
    if isinstance(v, float):
        if math.isnan(v):
            return ("nan",)
        return ("f", v, math.copysign(1.0, v))
    return v


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(VALUES, VALUES, st.one_of(st.none(), st.lists(VALUES, max_size=3)),
                               st.sampled_from(["a", "b", None])), min_size=1, max_size=12),
       start=st.integers(0, 3))
def test_keys_are_the_identity_by_value_bits(rows, start):
    table = pa.table({"d": pa.array([r[0] for r in rows], pa.float64()),
                      "f": pa.array([r[1] for r in rows], pa.float32()),
                      "l": pa.array([r[2] for r in rows], pa.list_(pa.float64())),
                      "s": pa.array([r[3] for r in rows], pa.string())}).slice(min(start, len(rows) - 1))
    py = table.to_pylist()
    keys = row_keys(table)
    assert len(keys) == len(py)
    for i in range(len(py)):
        for j in range(len(py)):
            same = all(ident(py[i][c]) == ident(py[j][c]) for c in ("d", "f", "l", "s"))
            assert (keys[i] == keys[j]) == same, (py[i], py[j])
    assert row_keys(pa.table({"d": pa.array([-0.0], pa.float64())})) != row_keys(pa.table({"d": pa.array([0.0])}))
