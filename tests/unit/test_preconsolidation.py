"""The one pre-consolidation of ``(data, time, diff)`` updates (`preconsolidate.consolidated_updates`, and its
form on changelog rows `preconsolidate.cancel_zero`) against a plain Python multiset: identical ``(data,
time)`` summed into one update, zero sums dropped, on rows drawn by hypothesis with list, nested
list, map and struct values, NULLs at every level, NaN and -0.0 (rows are the same by their value
bits: `tidemark.rowid`). The snapshot bases of the feed (`bases.base_changes`) use the same
function, so a row in both versions of a table with a list column cancels."""

from __future__ import annotations

import math
import struct
from collections import Counter

import numpy as np
import pyarrow as pa
from hypothesis import given, settings, strategies as st

from tidemark.consolidate import bases, preconsolidate

SCHEMA = pa.schema([
    pa.field("id", pa.int64()),
    pa.field("tags", pa.list_(pa.string())),
    pa.field("nums", pa.list_(pa.float64())),
    pa.field("grid", pa.list_(pa.list_(pa.int32()))),
    pa.field("attrs", pa.map_(pa.string(), pa.float64())),
    pa.field("rec", pa.struct([pa.field("a", pa.int64()), pa.field("b", pa.float64())])),
    pa.field("x", pa.float64()),
])

floats = st.sampled_from([0.0, -0.0, 1.5, float("nan"), -float("nan"), None])
values = {
    "id": st.one_of(st.none(), st.integers(0, 3)),
    "tags": st.one_of(st.none(), st.lists(st.one_of(st.none(), st.sampled_from(["a", "b", ""])), max_size=3)),
    "nums": st.one_of(st.none(), st.lists(floats, max_size=3)),
    "grid": st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(0, 2)),
                                                                        max_size=2)), max_size=2)),
    "attrs": st.one_of(st.none(), st.lists(st.tuples(st.sampled_from(["k", "v"]), floats), max_size=2,
                                           unique_by=lambda kv: kv[0])),
    "rec": st.one_of(st.none(), st.fixed_dictionaries({"a": st.one_of(st.none(), st.integers(0, 2)), "b": floats})),
    "x": floats,
}
rows = st.fixed_dictionaries(values)


def _model_value(v):
    """A value as plain Python compares it, floats by their bits (every NaN one value, -0.0 not 0.0)."""
    if isinstance(v, float):
        return ("f", struct.pack("<d", math.nan if v != v else v))
    if isinstance(v, dict):
        return ("d",) + tuple((k, _model_value(x)) for k, x in sorted(v.items()))
    if isinstance(v, (list, tuple)):
        return ("l",) + tuple(_model_value(x) for x in v)
    return v


def _model_row(r: dict) -> tuple:
    return tuple(_model_value(r[n]) for n in SCHEMA.names)


@st.composite
def updates(draw):
    pool = draw(st.lists(rows, min_size=1, max_size=5))
    picks = draw(st.lists(st.tuples(st.integers(0, len(pool) - 1), st.integers(1, 3), st.integers(-2, 2)),
                          max_size=30))
    return [(pool[i], t, d) for i, t, d in picks]


@settings(max_examples=150, deadline=None)
@given(ups=updates())
def test_the_one_pre_consolidation_equals_a_python_multiset(ups):
    data = pa.Table.from_pylist([r for r, _, _ in ups], schema=SCHEMA)
    times = np.array([t for _, t, _ in ups], np.int64)
    diffs = np.array([d for _, _, d in ups], np.int64)
    expect = _net(ups)

    keep, sums = preconsolidate.consolidated_updates(data, times, diffs)
    kept = data.take(pa.array(keep, pa.int64())).to_pylist()
    got = {(int(times[i]), _model_row(r)): int(s) for i, r, s in zip(keep.tolist(), kept, sums.tolist())}
    assert len(got) == len(keep), "two updates of one (data, time)"
    assert got == expect
    assert list(zip(times[keep].tolist(), keep.tolist())) == sorted(zip(times[keep].tolist(), keep.tolist()))
    for i in keep.tolist():          # each update is its group's first occurrence
        assert all((int(times[j]), _model_row(ups[j][0])) != (int(times[i]), _model_row(ups[i][0]))
                   for j in range(i))

    log = data.append_column("_time", pa.array(times)).append_column("_diff", pa.array(diffs)) \
        .append_column("_commit_ts", pa.nulls(len(ups), pa.timestamp("us", tz="UTC")))
    net = preconsolidate.cancel_zero(log)
    assert net.schema == log.schema
    got_log = Counter()
    for r in net.to_pylist():
        key = (r["_time"], _model_row(r))
        assert key not in got_log
        got_log[key] = r["_diff"]
    assert dict(got_log) == expect


def _net(ups) -> dict:
    out: dict = {}
    for r, t, d in ups:
        k = (t, _model_row(r))
        out[k] = out.get(k, 0) + d
    return {k: v for k, v in out.items() if v != 0}


def test_a_snapshot_base_cancels_the_rows_of_a_table_with_a_list_column_in_both_versions(monkeypatch):
    """A resend of a table with an array column: the rows it did not change are in the loaded version
    and in the one it replaced; the base holds only the rows that differ (it held every row twice,
    as a +1 and a -1, when the base's pre-consolidation gave up on list columns)."""
    target = pa.schema([pa.field("id", pa.int64()), pa.field("tags", pa.list_(pa.string()))])
    versions = {
        4: [{"id": 1, "tags": ["a"]}, {"id": 2, "tags": None}, {"id": 3, "tags": ["b", None]}],
        5: [{"id": 1, "tags": ["a"]}, {"id": 2, "tags": None}, {"id": 3, "tags": ["c"]}],
    }

    def version_buckets(uri, options, version, schema):
        return (lambda files: pa.Table.from_pylist(versions[version], schema=schema)), {0: ["f"]}

    monkeypatch.setattr(bases, "version_buckets", version_buckets)
    got = bases.base_changes("/unused", None, 5, 0x50, target)
    assert sorted((r["id"], r["tags"], r["_diff"], r["_time"]) for r in got.to_pylist()) == [
        (3, ["b", None], -1, 0x50), (3, ["c"], 1, 0x50)]
