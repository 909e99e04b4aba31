"""The one SCD type 2 fold (`lake.scd2.fold`: the history tables' buckets and `lake.history`'s key
versions) against a plain Python model, row by row: changelogs drawn by hypothesis (inserts,
updates, key changes, deletes, re-inserts at random times of random keys, one-column keys of several
types and a two-column key, commit timestamps sometimes missing, rows that contradict the history),
over a bucket's open versions, with or without a full load in between. Both give the same versions;
where the model meets a contradiction, the fold names a problem."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from tidemark.lake import LakeError
from tidemark.lake.history import fold_versions
from tidemark.lake.scd2 import fold, history_schema

UTC = dt.timezone.utc
KEYS = {"int64": ["id"], "int32": ["id"], "string": ["id"], "pair": ["id", "part"]}


def _data(kind: str):
    key = {"int64": pa.int64(), "int32": pa.int32(), "string": pa.string(), "pair": pa.int64()}[kind]
    return pa.schema([pa.field("id", key), pa.field("part", pa.string()), pa.field("v", pa.string())])


def _row(kind: str, i: int, v: str) -> dict:
    return {"id": f"k{i:03d}" if kind == "string" else i, "part": f"p{i % 2}", "v": v}


def _log_schema(data):
    return pa.schema(list(data) + [pa.field("_time", pa.int64()), pa.field("_diff", pa.int64()),
                                   pa.field("_commit_ts", pa.timestamp("us", tz="UTC"))])


def model(open_rows: list[dict], log: list[dict], keys: list[str], names: list[str], base, reset):
    """Row by row, in time order: (current versions, closed versions) or a problem (a str)."""
    def key(r):
        return tuple(r[k] for k in keys)

    state = {key(r): r for r in open_rows}
    closed = []

    def close(k, t, ts, deleted):
        closed.append({**state.pop(k), "_valid_to_lsn": t, "_valid_to": ts, "_is_current": False, "_deleted": deleted})

    times = sorted({r["_time"] for r in log} | ({reset} if base is not None else set()))
    for t in times:
        if base is not None and t == reset:
            loaded = {key(r): r for r in base}
            for k in list(state):
                if k not in loaded or any(state[k][n] != loaded[k][n] for n in names):
                    close(k, reset, None, k not in loaded)
            for k, r in loaded.items():
                if k not in state:
                    state[k] = {**r, "_valid_from_lsn": reset, "_valid_from": None, "_valid_to_lsn": None,
                                "_valid_to": None, "_is_current": True, "_deleted": False}
        group = [r for r in log if r["_time"] == t]
        ts = next((r["_commit_ts"] for r in group if r["_commit_ts"] is not None), None)
        plus = {}
        for r in group:
            if r["_diff"] > 0:
                if r["_diff"] != 1 or key(r) in plus:
                    return "twice"
                plus[key(r)] = r
        for r in group:
            if r["_diff"] < 0:
                if key(r) not in state or r["_diff"] != -1:
                    return "out"
                close(key(r), t, ts, key(r) not in plus)
        for k, r in plus.items():
            if k in state:
                return "open"
            state[k] = {**{n: r[n] for n in names}, "_valid_from_lsn": t, "_valid_from": ts, "_valid_to_lsn": None,
                        "_valid_to": None, "_is_current": True, "_deleted": False}
    return list(state.values()), closed


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(sorted(KEYS)))
    data = _data(kind)
    live = draw(st.sets(st.integers(0, 12), max_size=8))
    open_rows = [{**_row(kind, i, f"o{i}"), "_valid_from_lsn": 10 + i,
                  "_valid_from": None if i % 3 == 0 else dt.datetime(2026, 1, 1, i, tzinfo=UTC),
                  "_valid_to_lsn": None, "_valid_to": None, "_is_current": True, "_deleted": False} for i in live]
    reset = draw(st.one_of(st.none(), st.sampled_from([95, 125, 155])))
    base, log, live = None, [], set(live)
    for time in range(100, 100 + draw(st.integers(0, 8)) * 10, 10):
        if reset is not None and base is None and time > reset:
            loaded = draw(st.sets(st.integers(0, 20), max_size=8))
            base = [_row(kind, i, draw(st.sampled_from([f"o{i}", "L"]))) for i in sorted(loaded)]
            live = set(loaded)
        ts = draw(st.sampled_from([None, dt.datetime(2026, 2, 1, tzinfo=UTC) + dt.timedelta(seconds=time)]))
        for i in draw(st.lists(st.integers(0, 20), max_size=4, unique=True)):
            op = draw(st.sampled_from(["write", "write", "delete", "delete", "rekey", "bad"]))
            stamp = ts if draw(st.booleans()) else None

            def row(k, diff, v):
                return {**_row(kind, k, v), "_time": time, "_diff": diff, "_commit_ts": stamp}
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
    if reset is not None and base is None:
        base = [_row(kind, i, "L") for i in sorted(draw(st.sets(st.integers(0, 20), max_size=8)))]
    order = draw(st.permutations(range(len(log))))
    return kind, data, open_rows, [log[j] for j in order], base, reset


def _canon(rows) -> list:
    return sorted((tuple(sorted(r.items())) for r in rows), key=repr)


@settings(max_examples=400, deadline=None)
@given(case=cases())
def test_the_one_fold_equals_the_row_by_row_model(case):
    kind, data, open_rows, log, base, reset = case
    keys, hs = KEYS[kind], history_schema(data)
    expect = model(open_rows, log, keys, data.names, base, reset)
    kept, opened, closed, problem = fold(
        pa.Table.from_pylist(open_rows, schema=hs), pa.Table.from_pylist(log, schema=_log_schema(data)), keys, hs,
        base=pa.Table.from_pylist(base, schema=data) if base is not None else None, reset=reset)
    if isinstance(expect, str):
        assert problem is not None and "key" in problem, (expect, problem)
        return
    assert problem is None, problem
    assert kept.schema == hs and opened.schema == hs and closed.schema == hs
    assert _canon(kept.to_pylist() + opened.to_pylist()) == _canon(expect[0])
    assert _canon(closed.to_pylist()) == _canon(expect[1])


def test_a_key_of_a_list_type_folds_by_its_value():
    data = pa.schema([pa.field("k", pa.list_(pa.int64())), pa.field("v", pa.string())])
    hs = history_schema(data)
    log = pa.Table.from_pylist([{"k": [1, 2], "v": "a", "_time": 5, "_diff": 1, "_commit_ts": None},
                                {"k": [1, 2], "v": "a", "_time": 7, "_diff": -1, "_commit_ts": None},
                                {"k": [1, 2], "v": "b", "_time": 7, "_diff": 1, "_commit_ts": None}],
                               schema=_log_schema(data))
    kept, opened, closed, problem = fold(hs.empty_table(), log, ["k"], hs)
    assert problem is None
    assert [(r["v"], r["_valid_from_lsn"]) for r in opened.to_pylist()] == [("b", 7)]
    assert [(r["v"], r["_valid_to_lsn"], r["_deleted"]) for r in closed.to_pylist()] == [("a", 7, False)]


def test_lake_history_names_a_changelog_that_contradicts_the_versions():
    with pytest.raises(LakeError, match=r"takes key \{'id': 2\} out at 0/64 but no version of it is open"):
        fold_versions([{"id": 1, "v": 0}], 99, [{"id": 2, "v": 0, "_time": 100, "_diff": -1, "_commit_ts": None}],
                      ["id"])
