"""A history bucket's open files kept as key ranges (`history.merge_bucket`, `history._reached`):
batch after batch, the files hold the versions of the fold (`lake.scd2.fold`; the fold itself against
a row-by-row model: test_scd2_fold.py)."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
from hypothesis import given, settings, strategies as st

from tidemark.consolidate import history as H
from tidemark.lake.scd2 import fold, log_schema, opened_at_load

UTC = dt.timezone.utc


def _spec(key_type) -> H.HistorySpec:
    data = pa.schema([pa.field("id", key_type, False), pa.field("v", pa.string())])
    return H.HistorySpec(table="public.t", uri="/unused", options=None, data=data, keys=["id"], buckets=1,
                         lo=0, hi=10**9)


def _k(i: int, key_type):
    return f"k{i:03d}" if pa.types.is_string(key_type) else i


def _canon(t) -> list:
    return sorted((tuple(sorted(r.items())) for r in t.to_pylist()), key=repr)


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
    ref_open, ref_closed = opened_at_load(base, 5), []
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
    apply(H.merge_bucket(spec, 0, log_schema(spec.data).empty_table(), base))
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
        logt = pa.Table.from_pylist(log, schema=log_schema(spec.data))
        kept, opened, closed, problem = fold(ref_open, logt, spec.keys, hs)
        assert problem is None
        ref_open = pa.concat_tables([kept, opened])
        ref_closed += closed.to_pylist()
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
                                    schema=log_schema(spec.data))

    assert H._reached(spec, 0, ["a", "b", "c"], log(25)) == ["b"]
    assert H._reached(spec, 0, ["a", "b", "c"], log(33, 99)) == ["b", "c"]     # new keys: the range below
    assert H._reached(spec, 0, ["a", "b", "c"], log(1, 45)) == ["a", "c"]      # below every range: the lowest
    spec.open_counts[0]["c"] = 10                                             # full enough: new keys, a new file
    assert H._reached(spec, 0, ["a", "b", "c"], log(25, 99)) == ["b"]
    spec.open_ranges[0].pop("c")                                              # a file without its range: all
    assert H._reached(spec, 0, ["a", "b", "c"], log(25)) == ["a", "b", "c"]
