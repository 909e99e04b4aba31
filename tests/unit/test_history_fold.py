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


@settings(max_examples=60, deadline=None)
@given(data=st.data(), open_rows=st.integers(1, 12))
def test_open_files_kept_as_key_ranges_hold_the_same_versions(data, open_rows, tmp_path_factory):
    """A bucket's open versions in files of at most ``open_rows`` rows, each a key range: batch after
    batch, each rewriting only the files its keys reach (`history._reached`), the bucket's open and
    closed files hold exactly the versions of the fold of every batch over all the open versions."""
    import json
    import os

    import pyarrow.parquet as pq

    root = str(tmp_path_factory.mktemp("hist"))
    spec = _spec(pa.int64())
    spec.uri, spec.open_rows, spec.compact_files = root, open_rows, 10**6
    hs = H.history_schema(spec.data)
    live = data.draw(st.sets(st.integers(0, 30), max_size=12))
    base = pa.table({"id": sorted(live), "v": [f"o{i}" for i in sorted(live)]}, schema=spec.data)
    spec.reset = 5
    ref_open, ref_closed = H._opened_at_load(base, 5), []
    files: dict[str, int] = {}            # path -> rows, of the files committed

    def apply(acts):
        for a in acts.to_pylist():
            assert a["op"] in ("add", "remove"), a
            if a["op"] == "remove":
                del files[a["path"]]
                spec.open_files[0].remove(a["path"])
                spec.open_ranges[0].pop(a["path"], None)
                spec.open_counts[0].pop(a["path"], None)
            else:
                files[a["path"]] = a["rows"]
                if "/open-" in a["path"]:
                    st_ = json.loads(a["stats"])
                    spec.open_files.setdefault(0, []).append(a["path"])
                    spec.open_ranges.setdefault(0, {})[a["path"]] = (st_["minValues"]["id"], st_["maxValues"]["id"])
                    spec.open_counts.setdefault(0, {})[a["path"]] = a["rows"]
                    assert a["rows"] <= open_rows

    spec.tag = "load"
    apply(H.merge_bucket(spec, 0, H._log_schema(spec.data).empty_table(), base))
    spec.reset = None
    time = 100
    for batch in range(data.draw(st.integers(1, 4))):
        log = []
        for i in data.draw(st.lists(st.integers(0, 40), max_size=6, unique=True)):
            time += 10
            row = lambda k, diff, v: {"id": k, "v": v, "_time": time, "_diff": diff, "_commit_ts": None}  # noqa
            if i in live and data.draw(st.booleans()):
                log.append(row(i, -1, "x"))
                live.discard(i)
            elif i in live:
                log += [row(i, -1, "x"), row(i, 1, f"v{time}")]
            else:
                log.append(row(i, 1, f"n{time}"))
                live.add(i)
        logt = pa.Table.from_pylist(log, schema=H._log_schema(spec.data))
        kept, opened, closed, problem = H.fold_bucket(spec, ref_open, logt, None)
        assert problem is None
        ref_open = pa.concat_tables([kept, pa.Table.from_pylist(opened, schema=hs)])
        ref_closed += closed
        spec.tag = f"b{batch}"
        apply(H.merge_bucket(spec, 0, logt, None))
        got_open = [pq.read_table(os.path.join(root, p)) for p in files if "/open-" in p]
        got_closed = [pq.read_table(os.path.join(root, p)) for p in files if "/closed-" in p]
        assert _canon(pa.concat_tables(got_open) if got_open else hs.empty_table()) == _canon(ref_open)
        assert _canon(pa.concat_tables(got_closed) if got_closed else hs.empty_table()) == \
            _canon(pa.Table.from_pylist(ref_closed, schema=hs))
        for p in files:                  # each open file's stats are its key range
            if "/open-" in p:
                ids = pq.read_table(os.path.join(root, p)).column("id").to_pylist()
                assert spec.open_ranges[0][p] == (min(ids), max(ids))


def test_a_batch_reaches_the_open_files_of_its_keys_ranges_and_new_keys_join_a_small_range_below():
    spec = _spec(pa.int64())
    spec.open_rows = 40
    spec.open_files = {0: ["a", "b", "c"]}
    spec.open_ranges = {0: {"a": (10, 19), "b": (20, 29), "c": (40, 49)}}
    spec.open_counts = {0: {"a": 9, "b": 9, "c": 9}}

    def log(*keys):
        return pa.Table.from_pylist([{"id": k, "v": "x", "_time": 1, "_diff": 1, "_commit_ts": None} for k in keys],
                                    schema=H._log_schema(spec.data))

    assert H._reached(spec, 0, ["a", "b", "c"], log(25)) == ["b"]
    assert H._reached(spec, 0, ["a", "b", "c"], log(33, 99)) == ["b", "c"]     # new keys: the range below
    assert H._reached(spec, 0, ["a", "b", "c"], log(1, 45)) == ["a", "c"]      # below every range: the lowest
    spec.open_counts[0]["c"] = 10                                             # full enough: new keys, a new file
    assert H._reached(spec, 0, ["a", "b", "c"], log(25, 99)) == ["b"]
    spec.open_ranges[0].pop("c")                                              # a file without its range: all
    assert H._reached(spec, 0, ["a", "b", "c"], log(25)) == ["a", "b", "c"]
