"""The history's column-wise fold (`history._fold_arrow`, what every batch's merge tasks run) against
the row-by-row fold (`history.fold_bucket`), on changelogs drawn by hypothesis: inserts, updates,
key changes, deletes and re-inserts at random times of random keys over a bucket's open versions,
with commit timestamps that are sometimes missing, and sometimes a row that contradicts the history.
Both must give the same versions; where the row-by-row fold names a problem, the column-wise one
must leave the bucket to it (None)."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
from hypothesis import given, settings, strategies as st

from tidemark.consolidate import history as H

UTC = dt.timezone.utc


def _spec(key_type) -> H.HistorySpec:
    data = pa.schema([pa.field("id", key_type, False), pa.field("v", pa.string())])
    return H.HistorySpec(table="public.t", uri="/unused", options=None, data=data, keys=["id"], buckets=1,
                         lo=0, hi=10**9)


def _k(i: int, key_type):
    return f"k{i:03d}" if pa.types.is_string(key_type) else i


def _canon(t) -> list:
    return sorted((tuple(sorted(r.items())) for r in t.to_pylist()), key=repr)


@st.composite
def buckets(draw):
    key_type = draw(st.sampled_from([pa.int64(), pa.int32(), pa.string()]))
    spec = _spec(key_type)
    hs = H.history_schema(spec.data)
    live = draw(st.sets(st.integers(0, 12), max_size=8))
    open_rows = [{"id": _k(i, key_type), "v": f"o{i}", "_valid_from_lsn": 10 + i,
                  "_valid_from": None if i % 3 == 0 else dt.datetime(2026, 1, 1, i, tzinfo=UTC),
                  "_valid_to_lsn": None, "_valid_to": None, "_is_current": True, "_deleted": False} for i in live]
    log = []
    live = set(live)
    for time in range(100, 100 + draw(st.integers(0, 8)) * 10, 10):
        ts = draw(st.sampled_from([None, dt.datetime(2026, 2, 1, tzinfo=UTC) + dt.timedelta(seconds=time)]))
        for i in draw(st.lists(st.integers(0, 20), max_size=4, unique=True)):
            op = draw(st.sampled_from(["write", "delete", "rekey", "bad"]))
            # a time's rows may lack its commit timestamp (all but one of them, or all)
            stamp = ts if draw(st.booleans()) else None
            row = lambda k, diff, v: {"id": _k(k, key_type), "v": v, "_time": time, "_diff": diff,  # noqa: E731
                                      "_commit_ts": stamp}
            if op == "bad":                  # contradicts the history: a -1 of a key with no version, a +2, ...
                log.append(row(i, draw(st.sampled_from([-1, 1, 2, -2])), "bad"))
            elif i in live and op == "delete":
                log.append(row(i, -1, "gone"))
                live.discard(i)
            elif i in live and op == "rekey" and (i + 21) not in live:
                log += [row(i, -1, "moved"), row(i + 21, 1, f"from{i}")]
                live.discard(i)
                live.add(i + 21)
            elif i in live:
                log += [row(i, -1, "old"), row(i, 1, f"v{time}")]
            elif op != "delete":
                log.append(row(i, 1, f"new{time}"))
                live.add(i)
    order = draw(st.permutations(range(len(log))))
    logt = pa.Table.from_pylist([log[j] for j in order], schema=H._log_schema(spec.data))
    return spec, hs, pa.Table.from_pylist(open_rows, schema=hs), logt, any(r["v"] == "bad" for r in log)


@settings(max_examples=400, deadline=None)
@given(case=buckets())
def test_the_column_wise_fold_equals_the_row_by_row_one(case):
    spec, hs, open_rows, log, bad = case
    kept, opened, closed, problem = H.fold_bucket(spec, open_rows, log, None)
    fast = H._fold_arrow(spec, open_rows, log, hs)
    if problem is not None:
        assert fast is None, problem
        return
    assert fast is not None or bad     # a consistent changelog is never left to the row-by-row fold
    if fast is None:
        return
    f_kept, f_opened, f_closed = fast
    assert _canon(f_kept) == _canon(kept)
    assert _canon(f_opened) == _canon(pa.Table.from_pylist(opened, schema=hs))
    assert _canon(f_closed) == _canon(pa.Table.from_pylist(closed, schema=hs))
    assert f_opened.schema == hs and f_closed.schema == hs


def test_a_key_of_several_columns_is_left_to_the_row_by_row_fold():
    data = pa.schema([pa.field("a", pa.int64(), False), pa.field("b", pa.int64(), False)])
    spec = H.HistorySpec(table="public.t", uri="/unused", options=None, data=data, keys=["a", "b"], buckets=1,
                         lo=0, hi=10**9)
    hs = H.history_schema(data)
    log = pa.Table.from_pylist([{"a": 1, "b": 2, "_time": 5, "_diff": 1, "_commit_ts": None}],
                               schema=H._log_schema(data))
    assert H._fold_arrow(spec, hs.empty_table(), log, hs) is None
