"""The merge of a group of a table's buckets (`merge.merge_records`), in Arrow without Spark: every
change shape (TOAST, key changes, truncates, tables without a key) against a model."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tidemark.consolidate import merge, work_area
from tidemark.consolidate.bucket_parts import filled_from_old_rows as _filled_from_old_rows
from tidemark.consolidate.work_area import meta_arrow_fields
from tidemark.lake import layout
from tidemark.pgtypes import Column, TableSchema, arrow_schema

K = TableSchema(schema="public", name="k", oid=1, columns=(
    Column("id", "int64", "int8", 20, key=True, nullable=False), Column("v", "text", "text", 25)))
M = TableSchema(schema="public", name="m", oid=2, replica_identity="f", columns=(
    Column("x", "int32", "int4", 23), Column("s", "text", "text", 25)))


def _plan(tmp_path, shape, keys, lake_rows):
    target = arrow_schema(shape)
    sort = layout.sort_columns(target, keys)
    bp = layout.BucketPlan(uri=str(tmp_path), options=None, schema=target, keys=keys,
                           sort=sort, target_rows=1000, tag="T0")
    files = []
    if lake_rows:
        for a in layout.write_sorted(bp, pa.Table.from_pylist(lake_rows, schema=target), 0):
            st = json.loads(a["stats"])
            files.append({"path": a["path"], "size": a["size"], "rows": a["rows"], "min": st["minValues"],
                          "max": st["maxValues"]})
    bp.files = {0: files}
    bp.tag = "T1"
    return merge.TablePlan(shape.qualified, bp, lower=0, frontier=1000)


def _recs(shape, rows):
    schema = pa.schema(meta_arrow_fields() + list(arrow_schema(shape)))
    base = {"_tm_full": True, "_tm_unknown": [], "_tm_xid": 1}
    return pa.Table.from_pylist([{**base, "_tm_cts": r["_tm_time"], **r} for r in rows], schema=schema)


def _after(plan, actions):
    adds = [a["path"] for a in actions if a["op"] == "add"]
    removed = {a["path"] for a in actions if a["op"] == "remove"}
    kept = [f["path"] for f in plan.bucket_plan.files[0] if f["path"] not in removed]
    return Counter(tuple(r.values()) for r in layout.read_files(plan.bucket_plan, kept + adds).to_pylist())


def _log(log):
    return sorted((r["_time"], r["_diff"], *(r[c] for c in log.column_names[:-3])) for r in log.to_pylist())


def test_keyed_images_from_batch_and_lake_cancel_and_dedupe(tmp_path):
    plan = _plan(tmp_path, K, ["id"], [{"id": 1, "v": "a"}, {"id": 2, "v": "b"}, {"id": 3, "v": "c"}])
    key = {"_tm_full": False, "_tm_unknown": ["v"]}
    recs = _recs(K, [
        {"_tm_time": 10, "_tm_pos": 0, "_tm_diff": -1, "id": 1, **key},          # update 1: old image from the lake
        {"_tm_time": 10, "_tm_pos": 1, "_tm_diff": 1, "id": 1, "v": "A"},
        {"_tm_time": 10, "_tm_pos": 1, "_tm_diff": 1, "id": 1, "v": "A"},        # a duplicate record
        {"_tm_time": 20, "_tm_pos": 0, "_tm_diff": -1, "id": 1, **key},          # and again: old image from the batch
        {"_tm_time": 20, "_tm_pos": 1, "_tm_diff": 1, "id": 1, "v": "AA"},
        {"_tm_time": 20, "_tm_pos": 2, "_tm_diff": -1, "id": 2, **key},          # delete 2
        {"_tm_time": 30, "_tm_pos": 0, "_tm_diff": -1, "id": 3, **key},          # update to the same value: cancels
        {"_tm_time": 30, "_tm_pos": 1, "_tm_diff": 1, "id": 3, "v": "c"},
        {"_tm_time": 30, "_tm_pos": 2, "_tm_diff": 1, "id": 4, "v": "d"},        # insert 4, then delete it
        {"_tm_time": 40, "_tm_pos": 0, "_tm_diff": -1, "id": 4, **key},
    ])
    counts = dict.fromkeys(merge.CHANGE_COUNTS, 0)
    actions, log = merge.merge_records(plan, 0, recs, counts=counts)
    assert _after(plan, actions) == Counter({(1, "AA"): 1, (3, "c"): 1})
    # the net effect: 1 updated, 2 deleted; 3 updated to its own values and 4 inserted then deleted are none
    assert counts == {"inserted": 0, "updated": 1, "deleted": 1}
    assert _log(log) == [(10, -1, 1, "a"), (10, 1, 1, "A"), (20, -1, 1, "A"), (20, -1, 2, "b"), (20, 1, 1, "AA"),
                         (30, 1, 4, "d"), (40, -1, 4, "d")]


def test_keyed_delete_without_previous_image_is_an_error_that_names_the_key(tmp_path):
    plan = _plan(tmp_path, K, ["id"], [{"id": 1, "v": "a"}])
    recs = _recs(K, [{"_tm_time": 10, "_tm_pos": 0, "_tm_diff": -1, "id": 9, "_tm_full": False, "_tm_unknown": ["v"]}])
    with pytest.raises(merge.MergeError, match=r"key \{'id': 9\} at time 10: a delete or update of a row whose previous"):
        merge.merge_records(plan, 0, recs)
    toast = _recs(K, [{"_tm_time": 10, "_tm_pos": 0, "_tm_diff": 1, "id": 7, "v": None, "_tm_unknown": ["v"]}])
    with pytest.raises(merge.MergeError, match=r"key \{'id': 7\}"):
        merge.merge_records(plan, 0, toast)


def test_multiset_inserts_sum_identical_rows_and_keep_the_lake(tmp_path):
    plan = _plan(tmp_path, M, [], [{"x": 1, "s": "a"}, {"x": 1, "s": "a"}])
    recs = _recs(M, [{"_tm_time": 10, "_tm_pos": 0, "_tm_diff": 1, "x": 1, "s": "a"},
                     {"_tm_time": 10, "_tm_pos": 1, "_tm_diff": 1, "x": 1, "s": "a"},
                     {"_tm_time": 10, "_tm_pos": 1, "_tm_diff": 1, "x": 1, "s": "a"},     # duplicate record
                     {"_tm_time": 20, "_tm_pos": 0, "_tm_diff": 1, "x": 2, "s": "b"}])
    actions, log = merge.merge_records(plan, 0, recs)
    assert _after(plan, actions) == Counter({(1, "a"): 4, (2, "b"): 1})
    assert _log(log) == [(10, 2, 1, "a"), (20, 1, 2, "b")]
    deletes = _recs(M, [{"_tm_time": 10, "_tm_pos": 0, "_tm_diff": -1, "x": 1, "s": "a"}])
    actions, log = merge.merge_records(plan, 0, deletes)
    assert _after(plan, actions) == Counter({(1, "a"): 1})
    assert _log(log) == [(10, -1, 1, "a")]
    too_many = _recs(M, [{"_tm_time": 10, "_tm_pos": i, "_tm_diff": -1, "x": 1, "s": "a"} for i in range(3)])
    with pytest.raises(merge.MergeError, match=r"cannot delete row \{'x': 1, 's': 'a'\}"):
        merge.merge_records(plan, 0, too_many)


def test_multiset_update_with_unchanged_toast_takes_it_from_its_old_row(tmp_path):
    plan = _plan(tmp_path, M, [], [{"x": 1, "s": "long"}, {"x": 2, "s": "other"}])
    recs = _recs(M, [{"_tm_time": 10, "_tm_pos": 0, "_tm_diff": -1, "x": 1, "s": "long"},
                     {"_tm_time": 10, "_tm_pos": 1, "_tm_diff": 1, "x": 5, "s": None, "_tm_unknown": ["s"]}])
    # filled while decoding (before the row is hashed into its bucket: a multiset's bucket is every column's)
    recs = _filled_from_old_rows(recs)
    assert recs.column("s").to_pylist() == ["long", "long"] and recs.column("_tm_unknown").to_pylist() == [[], []]
    actions, log = merge.merge_records(plan, 0, recs)
    assert _after(plan, actions) == Counter({(5, "long"): 1, (2, "other"): 1})
    assert _log(log) == [(10, -1, 1, "long"), (10, 1, 5, "long")]
    alone = _filled_from_old_rows(_recs(M, [{"_tm_time": 10, "_tm_pos": 1, "_tm_diff": 1, "x": 5, "s": None,
                                              "_tm_unknown": ["s"]}]))
    with pytest.raises(merge.MergeError, match="no old image before it"):
        merge.merge_records(plan, 0, alone)


TOASTY = TableSchema(schema="public", name="t", oid=3, columns=(
    Column("id", "int64", "int8", 20, key=True, nullable=False), Column("v", "text", "text", 25),
    Column("big", "text", "text", 25)))


def test_unchanged_toast_values_come_from_the_rows_previous_image(tmp_path):
    plan = _plan(tmp_path, TOASTY, ["id"], [{"id": 1, "v": "a", "big": "B1"}, {"id": 2, "v": "b", "big": "B2"}])
    key = {"_tm_full": False, "_tm_unknown": ["v", "big"]}
    kept = {"big": None, "_tm_unknown": ["big"]}             # an update that left the TOASTed value alone
    recs = _recs(TOASTY, [
        {"_tm_time": 10, "_tm_pos": 0, "_tm_diff": -1, "id": 1, **key},
        {"_tm_time": 10, "_tm_pos": 1, "_tm_diff": 1, "id": 1, "v": "A", **kept},        # big from the lake
        {"_tm_time": 20, "_tm_pos": 0, "_tm_diff": -1, "id": 1, **key},
        {"_tm_time": 20, "_tm_pos": 1, "_tm_diff": 1, "id": 1, "v": "AA", **kept},       # ... through the batch
        {"_tm_time": 20, "_tm_pos": 2, "_tm_diff": -1, "id": 2, **key},
        {"_tm_time": 20, "_tm_pos": 3, "_tm_diff": 1, "id": 2, "v": "b", "big": "NEW"},  # big changed
        {"_tm_time": 30, "_tm_pos": 0, "_tm_diff": -1, "id": 2, **key},
        {"_tm_time": 30, "_tm_pos": 1, "_tm_diff": 1, "id": 2, "v": "bb", **kept},       # the new value
        {"_tm_time": 30, "_tm_pos": 2, "_tm_diff": 1, "id": 3, "v": "c", "big": "B3"},   # inserted in the batch
        {"_tm_time": 40, "_tm_pos": 0, "_tm_diff": -1, "id": 3, **key},
        {"_tm_time": 40, "_tm_pos": 1, "_tm_diff": 1, "id": 3, "v": "cc", **kept},
        {"_tm_time": 40, "_tm_pos": 1, "_tm_diff": 1, "id": 3, "v": "cc", **kept},       # a duplicate record
    ])
    actions, log = merge.merge_records(plan, 0, recs)
    assert _after(plan, actions) == Counter({(1, "AA", "B1"): 1, (2, "bb", "NEW"): 1, (3, "cc", "B3"): 1})
    assert _log(log) == [(10, -1, 1, "a", "B1"), (10, 1, 1, "A", "B1"), (20, -1, 1, "A", "B1"),
                         (20, -1, 2, "b", "B2"), (20, 1, 1, "AA", "B1"), (20, 1, 2, "b", "NEW"),
                         (30, -1, 2, "b", "NEW"), (30, 1, 2, "bb", "NEW"), (30, 1, 3, "c", "B3"),
                         (40, -1, 3, "c", "B3"), (40, 1, 3, "cc", "B3")]


def test_unchanged_toast_in_an_update_that_moved_the_key_comes_from_the_old_keys_image(tmp_path):
    plan = _plan(tmp_path, TOASTY, ["id"], [{"id": 1, "v": "a", "big": "B1"}, {"id": 9, "v": "n", "big": "B9"}])
    key = {"_tm_full": False, "_tm_unknown": ["v", "big"]}
    moved = _recs(TOASTY, [
        {"_tm_time": 10, "_tm_pos": 0, "_tm_diff": -1, "id": 1, **key},
        {"_tm_time": 10, "_tm_pos": 1, "_tm_diff": 1, "id": 5, "v": "a", "big": None, "_tm_unknown": ["big"]},
        {"_tm_time": 20, "_tm_pos": 0, "_tm_diff": -1, "id": 5, **key},          # and on: a chain of moves
        {"_tm_time": 20, "_tm_pos": 1, "_tm_diff": 1, "id": 6, "v": "b", "big": None, "_tm_unknown": ["big"]}])
    actions, log = merge.merge_records(plan, 0, moved)
    assert _after(plan, actions) == Counter({(6, "b", "B1"): 1, (9, "n", "B9"): 1})
    assert _log(log) == [(10, -1, 1, "a", "B1"), (10, 1, 5, "a", "B1"), (20, -1, 5, "a", "B1"),
                         (20, 1, 6, "b", "B1")]
    # key 1 deleted, then row 9 moved to key 1 leaving big alone: big is row 9's, not key 1's earlier one
    reused = _recs(TOASTY, [
        {"_tm_time": 10, "_tm_pos": 0, "_tm_diff": -1, "id": 1, **key},
        {"_tm_time": 20, "_tm_pos": 0, "_tm_diff": -1, "id": 9, **key},
        {"_tm_time": 20, "_tm_pos": 1, "_tm_diff": 1, "id": 1, "v": "z", "big": None, "_tm_unknown": ["big"]}])
    actions, log = merge.merge_records(plan, 0, reused)
    assert _after(plan, actions) == Counter({(1, "z", "B9"): 1})


def test_a_truncate_takes_out_every_row_present_then(tmp_path):
    plan = _plan(tmp_path, TOASTY, ["id"], [{"id": 1, "v": "a", "big": "B1"}, {"id": 2, "v": "b", "big": "B2"}])
    plan.truncates = [(20, 0, 20)]
    key = {"_tm_full": False, "_tm_unknown": ["v", "big"]}
    recs = _recs(TOASTY, [
        {"_tm_time": 10, "_tm_pos": 0, "_tm_diff": -1, "id": 1, **key},
        {"_tm_time": 10, "_tm_pos": 1, "_tm_diff": 1, "id": 1, "v": "A", "big": None, "_tm_unknown": ["big"]},
        {"_tm_time": 10, "_tm_pos": 2, "_tm_diff": 1, "id": 3, "v": "c", "big": "B3"},
        {"_tm_time": 20, "_tm_pos": 1, "_tm_diff": 1, "id": 1, "v": "new", "big": "N"},    # after the truncate
    ])
    actions, log = merge.merge_records(plan, 0, recs)
    assert _after(plan, actions) == Counter({(1, "new", "N"): 1})
    assert _log(log) == [(10, -1, 1, "a", "B1"), (10, 1, 1, "A", "B1"), (10, 1, 3, "c", "B3"),
                         (20, -1, 1, "A", "B1"), (20, -1, 2, "b", "B2"), (20, -1, 3, "c", "B3"),
                         (20, 1, 1, "new", "N")]
    nothing = _recs(TOASTY, [])            # a bucket whose only change is the truncate
    actions, log = merge.merge_records(plan, 0, nothing, buckets=[0])
    assert _after(plan, actions) == Counter()
    assert _log(log) == [(20, -1, 1, "a", "B1"), (20, -1, 2, "b", "B2")]


def _lake(tmp_path, shape, keys, rows, bucket_of, target_rows=4):
    """A lake table of ``rows`` written bucket by bucket (``bucket_of(row)``), as a plan tagged T1."""
    target = arrow_schema(shape)
    sort = layout.sort_columns(target, keys)
    bp = layout.BucketPlan(uri=str(tmp_path), options=None, schema=target, keys=keys,
                           sort=sort, target_rows=target_rows, tag="T0")
    bp.files = {}
    for b in sorted({bucket_of(r) for r in rows}):
        mine = pa.Table.from_pylist([r for r in rows if bucket_of(r) == b], schema=target)
        bp.files[b] = [{"path": a["path"], "size": a["size"], "rows": a["rows"],
                        "min": json.loads(a["stats"])["minValues"], "max": json.loads(a["stats"])["maxValues"],
                        "nulls": json.loads(a["stats"])["nullCount"]}
                       for a in layout.write_sorted(bp, mine, b)]
    bp.tag = "T1"
    return merge.TablePlan(shape.qualified, bp, lower=0, frontier=1000)


def _lake_after(plan, actions):
    """The table's rows after ``actions``, per bucket (the bucket its files are in)."""
    removed = {a["path"] for a in actions if a["op"] == "remove"}
    out = {}
    for b, files in plan.bucket_plan.files.items():
        for f in files:
            if f["path"] not in removed:
                out.setdefault(b, []).append(f["path"])
    for a in actions:
        if a["op"] == "add":
            assert a["path"].startswith(f"_bucket={a['bucket']}/")
            out.setdefault(a["bucket"], []).append(a["path"])
    return {b: Counter(tuple(r.values()) for r in layout.read_files(plan.bucket_plan, paths).to_pylist())
            for b, paths in out.items()}


@st.composite
def _batches(draw):
    """A lake of TOASTY rows and a batch of changes to it, as the decoding delivers them: updates as a
    key image then a new image (which may leave ``big`` unchanged), deletes as a key image, inserts,
    some records twice; and the model's rows after the batch."""
    keys = draw(st.integers(1, 12))
    model = {k: (f"v{k}", f"B{k}") for k in range(keys) if draw(st.booleans())}
    lake = [{"id": k, "v": v, "big": big} for k, (v, big) in model.items()]
    recs, time = [], 10
    for _ in range(draw(st.integers(1, 25))):
        k = draw(st.integers(0, keys - 1))
        time += draw(st.sampled_from([0, 10]))
        pos = len([r for r in recs if r["_tm_time"] == time])
        image = {"_tm_full": False, "_tm_unknown": ["v", "big"]}
        if k in model and draw(st.booleans()):
            v = draw(st.sampled_from(["x", "y", model[k][0]]))
            kept = draw(st.booleans())
            new = {"v": v, "big": None, "_tm_unknown": ["big"]} if kept else {"v": v, "big": f"N{time}"}
            recs += [{"_tm_time": time, "_tm_pos": pos, "_tm_diff": -1, "id": k, **image},
                     {"_tm_time": time, "_tm_pos": pos + 1, "_tm_diff": 1, "id": k, **new}]
            model[k] = (v, model[k][1] if kept else f"N{time}")
        elif k in model:
            recs.append({"_tm_time": time, "_tm_pos": pos, "_tm_diff": -1, "id": k, **image})
            del model[k]
        else:
            recs.append({"_tm_time": time, "_tm_pos": pos, "_tm_diff": 1, "id": k, "v": "i", "big": f"I{time}"})
            model[k] = ("i", f"I{time}")
    recs += draw(st.lists(st.sampled_from(recs), max_size=3))          # records landed twice
    return lake, draw(st.permutations(recs)), model


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_batches(), st.integers(1, 4))
def test_several_buckets_merged_at_once_are_each_bucket_merged_alone(tmp_path_factory, case, buckets):
    lake, rows, model = case
    bucket_of = lambda r: r["id"] % buckets                  # noqa: E731 (any assignment by key)
    recs = _recs(TOASTY, rows)
    rb = pa.array([r["id"] % buckets for r in rows]).to_numpy()
    together = _lake(tmp_path_factory.mktemp("together"), TOASTY, ["id"], lake, bucket_of)
    actions, log = merge.merge_records(together, rb, recs)
    after = _lake_after(together, actions)
    alone_actions, alone_log = [], []
    alone = _lake(tmp_path_factory.mktemp("alone"), TOASTY, ["id"], lake, bucket_of)
    for b in sorted(set(rb.tolist())):
        acts, lg = merge.merge_records(alone, b, recs.filter(pa.array(rb == b)))
        alone_actions += acts
        alone_log += _log(lg)
    assert after == _lake_after(alone, alone_actions)
    assert _log(log) == sorted(alone_log)
    # the oracle: every key's last state, each row in its key's bucket
    assert sum(after.values(), Counter()) == Counter((k, v, big) for k, (v, big) in model.items())
    assert all(k % buckets == b for b, rows_b in after.items() for k, *_ in rows_b)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from("ab")), max_size=6),
       st.lists(st.tuples(st.integers(0, 3), st.sampled_from("ab"), st.sampled_from([10, 20])), min_size=1,
                max_size=12), st.integers(1, 3))
def test_a_multisets_inserts_in_several_buckets_at_once_are_each_bucket_merged_alone(tmp_path_factory, lake, ins,
                                                                                      buckets):
    bucket_of = lambda r: r["x"] % buckets                   # noqa: E731
    rows = [{"x": x, "s": s} for x, s in lake]
    recs = _recs(M, [{"_tm_time": t, "_tm_pos": i, "_tm_diff": 1, "x": x, "s": s} for i, (x, s, t) in enumerate(ins)])
    rb = pa.array([x % buckets for x, _, _ in ins]).to_numpy()
    together = _lake(tmp_path_factory.mktemp("together"), M, [], rows, bucket_of)
    actions, log = merge.merge_records(together, rb, recs)
    alone = _lake(tmp_path_factory.mktemp("alone"), M, [], rows, bucket_of)
    alone_actions, alone_log = [], []
    for b in sorted(set(rb.tolist())):
        acts, lg = merge.merge_records(alone, b, recs.filter(pa.array(rb == b)))
        alone_actions += acts
        alone_log += _log(lg)
    after = _lake_after(together, actions)
    assert after == _lake_after(alone, alone_actions)
    assert _log(log) == sorted(alone_log)
    assert sum(after.values(), Counter()) == Counter([(x, s) for x, s in lake] + [(x, s) for x, s, _ in ins])


@st.composite
def _histories(draw):
    """A lake of TOASTY rows and a history of transactions on it as pgoutput delivers them: inserts,
    updates that may leave ``big`` unchanged (TOAST) and may change the key (chains of moves too),
    deletes, truncates; records landed twice and in any order. Returns (lake, records, truncates,
    model after)."""
    model = {k: (f"v{k}", f"B{k}") for k in range(draw(st.integers(0, 8))) if draw(st.booleans())}
    lake = [{"id": k, "v": v, "big": big} for k, (v, big) in model.items()]
    recs, truncs = [], []
    key = {"_tm_full": False, "_tm_unknown": ["v", "big"]}
    for time in range(10, 10 + 10 * draw(st.integers(1, 8)), 10):
        pos = 0
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["insert", "update", "move", "delete", "truncate"] if model else
                                      ["insert", "truncate"]))
            if op == "truncate":
                truncs.append((time, pos, time))
                model.clear()
                pos += 1
                continue
            if op == "insert":
                k = draw(st.integers(0, 15).filter(lambda k: k not in model))
                recs.append({"_tm_time": time, "_tm_pos": pos, "_tm_diff": 1, "id": k, "v": "i", "big": f"I{time}"})
                model[k] = ("i", f"I{time}")
                pos += 1
                continue
            k = draw(st.sampled_from(sorted(model)))
            recs.append({"_tm_time": time, "_tm_pos": pos, "_tm_diff": -1, "id": k, **key})
            if op == "delete":
                del model[k]
                pos += 1
                continue
            new = draw(st.integers(0, 15).filter(lambda n: n not in model)) if op == "move" else k
            v, kept = draw(st.sampled_from(["x", "y"])), draw(st.booleans())
            old_big = model.pop(k)[1]
            big = old_big if kept else f"N{time}"
            model[new] = (v, big)
            recs.append({"_tm_time": time, "_tm_pos": pos + 1, "_tm_diff": 1, "id": new, "v": v,
                         **({"big": None, "_tm_unknown": ["big"]} if kept else {"big": big})})
            pos += 2
    recs += draw(st.lists(st.sampled_from(recs), max_size=3)) if recs else []
    return lake, draw(st.permutations(recs)), truncs, model


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_histories(), st.integers(1, 4))
def test_every_change_shape_against_a_model(tmp_path_factory, case, buckets):
    """The lake after the merge is the model; the changelog is exact: one diff per (row, time), no
    zero, and the lake before plus every diff is the lake after (a subscriber's integral); the counts
    are the model's keys new, gone and with other values than the lake's."""
    lake, rows, truncs, model = case
    plan = _lake(tmp_path_factory.mktemp("lake"), TOASTY, ["id"], lake, lambda r: r["id"] % buckets)
    plan.truncates = truncs
    recs = _recs(TOASTY, rows)
    rb = pa.array([r["id"] % buckets for r in rows], pa.int32()).to_numpy(zero_copy_only=False)
    counts = dict.fromkeys(merge.CHANGE_COUNTS, 0)
    actions, log = merge.merge_records(plan, rb, recs, buckets=list(range(buckets)), counts=counts)
    after = _lake_after(plan, actions)
    assert sum(after.values(), Counter()) == Counter((k, v, big) for k, (v, big) in model.items())
    before = {r["id"]: (r["v"], r["big"]) for r in lake}
    assert counts == {"inserted": len(model.keys() - before.keys()), "deleted": len(before.keys() - model.keys()),
                      "updated": sum(before[k] != model[k] for k in model.keys() & before.keys())}
    assert all(k % buckets == b for b, rows_b in after.items() for k, *_ in rows_b)
    entries = _log(log)
    assert all(d != 0 for _, d, *_ in entries)
    assert len({(t, *r) for t, _, *r in entries}) == len(entries)
    integral = Counter((r["id"], r["v"], r["big"]) for r in lake)
    for _, d, *row in entries:
        integral[tuple(row)] += d
    assert +integral == Counter((k, v, big) for k, (v, big) in model.items())


def test_an_insert_of_a_key_the_lake_holds_replaces_it_in_the_changelog_too(tmp_path):
    plan = _plan(tmp_path, K, ["id"], [{"id": 1, "v": "a"}, {"id": 2, "v": "b"}])
    recs = _recs(K, [{"_tm_time": 10, "_tm_pos": 0, "_tm_diff": 1, "id": 1, "v": "new"},
                     {"_tm_time": 10, "_tm_pos": 1, "_tm_diff": 1, "id": 2, "v": "b"}])     # the same row again
    actions, log = merge.merge_records(plan, 0, recs)
    assert _after(plan, actions) == Counter({(1, "new"): 1, (2, "b"): 1})
    assert _log(log) == [(10, -1, 1, "a"), (10, 1, 1, "new")]


def _wide_lake(tmp_path, files: int, target_rows: int):
    """One bucket of ``files`` full files of TOASTY rows (keys 0, 2, 4, ...; ~400-byte values)."""
    n = files * target_rows
    target = arrow_schema(TOASTY)
    bp = layout.BucketPlan(uri=str(tmp_path), options=None, schema=target, keys=["id"],
                           sort=["id"], target_rows=target_rows, tag="T0")
    rows = pa.table({"id": pa.array(range(0, 2 * n, 2), pa.int64()), "v": [f"v{i:06d}" * 8 for i in range(n)],
                     "big": [f"B{i:06d}" * 50 for i in range(n)]}, schema=target)
    bp.files = {0: [{"path": a["path"], "size": a["size"], "rows": a["rows"],
                     "min": json.loads(a["stats"])["minValues"], "max": json.loads(a["stats"])["maxValues"]}
                    for a in layout.write_sorted(bp, rows, 0)]}
    bp.tag = "T1"
    return merge.TablePlan(TOASTY.qualified, bp, lower=0, frontier=1000), rows


_POOLS: list = []


def test_a_groups_memory_follows_one_file_not_its_buckets_size(tmp_path):
    """A merge task holds the records and a few files' rows at a time, however many files its bucket
    has: the Arrow memory it allocates at most (its pool's peak) is the same for a bucket of 8 files
    and one of 32, each file touched by the batch; and it is well below the bucket's rows."""
    key = {"_tm_full": False, "_tm_unknown": ["v", "big"]}
    peaks, sizes = {}, {}
    for files in (8, 32):
        plan, lake = _wide_lake(tmp_path / str(files), files, 500)
        n = lake.num_rows
        step = n // 40 * 2                              # 40 keys spread over the whole bucket
        recs, model = [], {r["id"]: (r["v"], r["big"]) for r in lake.to_pylist()}
        for i, k in enumerate(range(0, 2 * n, step)):
            t = 10 + i
            if i % 4 == 0:         # a key change, TOAST left alone, into another file's range (its old image's)
                new = (k + n) % (2 * n) + 1
                recs += [{"_tm_time": t, "_tm_pos": 0, "_tm_diff": -1, "id": k, **key},
                         {"_tm_time": t, "_tm_pos": 1, "_tm_diff": 1, "id": new, "v": "m", "big": None,
                          "_tm_unknown": ["big"]}]
                model[new] = ("m", model.pop(k)[1])
            elif i % 4 == 1:
                recs.append({"_tm_time": t, "_tm_pos": 0, "_tm_diff": -1, "id": k, **key})
                del model[k]
            else:
                recs += [{"_tm_time": t, "_tm_pos": 0, "_tm_diff": -1, "id": k, **key},
                         {"_tm_time": t, "_tm_pos": 1, "_tm_diff": 1, "id": k, "v": "u", "big": None,
                          "_tm_unknown": ["big"]}, {"_tm_time": t, "_tm_pos": 2, "_tm_diff": 1, "id": k + 1,
                                                    "v": "i", "big": "I"}]
                model[k] = ("u", model[k][1])
                model[k + 1] = ("i", "I")
        recs = _recs(TOASTY, recs)
        pool, before = pa.proxy_memory_pool(pa.default_memory_pool()), pa.default_memory_pool()
        _POOLS.append(pool)             # buffers it allocated may outlive the test: the pool must too
        pa.set_memory_pool(pool)
        try:
            actions, log = merge.merge_records(plan, 0, recs)
        finally:
            pa.set_memory_pool(before)
        peaks[files], sizes[files] = pool.max_memory(), lake.nbytes
        assert sum(_lake_after(plan, actions).values(), Counter()) == Counter(
            (k, v, big) for k, (v, big) in model.items())
        assert sum(a["op"] == "remove" for a in actions) == files
    assert peaks[32] < 1.25 * peaks[8], peaks
    assert peaks[32] < sizes[32] / 3, (peaks, sizes)


def _files_after(plan, actions):
    """Per bucket, the rows of each of its files after ``actions`` (kept and added)."""
    removed = {a["path"] for a in actions if a["op"] == "remove"}
    paths = {b: [f["path"] for f in files if f["path"] not in removed] for b, files in plan.bucket_plan.files.items()}
    for a in actions:
        if a["op"] == "add":
            paths.setdefault(a["bucket"], []).append(a["path"])
    return {b: [layout.read_files(plan.bucket_plan, [p]).to_pylist() for p in ps] for b, ps in paths.items()}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_histories(), st.integers(1, 2), st.sampled_from([1, 2, 3]))
def test_every_change_shape_over_buckets_of_many_small_files(tmp_path_factory, case, buckets, target_rows):
    """The model test over buckets of files of one to three rows (a key's old image for an update that
    moved it in another file, new keys between files and beyond them, files kept between rewritten
    ones): the lake after is the model, the changelog's integral too, and each bucket's files stay
    sorted, at most ``target_rows`` rows each, their key ranges apart."""
    lake, rows, truncs, model = case
    plan = _lake(tmp_path_factory.mktemp("lake"), TOASTY, ["id"], lake, lambda r: r["id"] % buckets, target_rows)
    plan.truncates = truncs
    rb = pa.array([r["id"] % buckets for r in rows], pa.int32()).to_numpy(zero_copy_only=False)
    actions, log = merge.merge_records(plan, rb, _recs(TOASTY, rows), buckets=list(range(buckets)))
    assert sum(_lake_after(plan, actions).values(), Counter()) == Counter((k, v, big) for k, (v, big) in model.items())
    integral = Counter((r["id"], r["v"], r["big"]) for r in lake)
    for _, d, *row in _log(log):
        integral[tuple(row)] += d
    assert +integral == Counter((k, v, big) for k, (v, big) in model.items())
    for files in _files_after(plan, actions).values():
        ranges = sorted((f[0]["id"], f[-1]["id"]) for f in files if f)
        assert all(len(f) <= target_rows and [r["id"] for r in f] == sorted(r["id"] for r in f) for f in files)
        assert all(hi < lo for (_, hi), (lo, _) in zip(ranges, ranges[1:]))


@st.composite
def _multiset_histories(draw):
    """A lake of rows of a table without a key (many identical ones) and transactions on it: inserts
    (of rows the lake holds too), whole-row deletes of rows present, updates as a delete and an
    insert, truncates; records landed twice. Returns (lake, records, truncates, model after)."""
    row = st.tuples(st.integers(0, 3), st.sampled_from(["a", "b", None]))
    lake = draw(st.lists(row, max_size=12))
    model = Counter(lake)
    recs, truncs = [], []
    for time in range(10, 10 + 10 * draw(st.integers(1, 6)), 10):
        pos = 0
        for _ in range(draw(st.integers(1, 3))):
            op = draw(st.sampled_from(["insert", "delete", "update", "truncate"] if +model else ["insert", "truncate"]))
            if op == "truncate":
                truncs.append((time, pos, time))
                model.clear()
                pos += 1
                continue
            if op in ("delete", "update"):
                x, s = draw(st.sampled_from(sorted(+model, key=str)))
                recs.append({"_tm_time": time, "_tm_pos": pos, "_tm_diff": -1, "x": x, "s": s})
                model[(x, s)] -= 1
                pos += 1
            if op in ("insert", "update"):
                x, s = draw(row)
                recs.append({"_tm_time": time, "_tm_pos": pos, "_tm_diff": 1, "x": x, "s": s})
                model[(x, s)] += 1
                pos += 1
    recs += draw(st.lists(st.sampled_from(recs), max_size=3)) if recs else []
    return lake, draw(st.permutations(recs)), truncs, +model


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_multiset_histories(), st.integers(1, 2), st.sampled_from([1, 2, 3]))
def test_a_multisets_every_change_shape_over_many_small_files(tmp_path_factory, case, buckets, target_rows):
    """A table without a key whose identical rows lie in several files of a bucket (files of one to
    three rows): deletes, updates and truncates give the model, and an exact changelog (one diff per
    (row, time), none zero, its integral the model)."""
    lake, rows, truncs, model = case
    bucket_of = lambda r: r["x"] % buckets                   # noqa: E731
    plan = _lake(tmp_path_factory.mktemp("lake"), M, [], [{"x": x, "s": s} for x, s in lake], bucket_of, target_rows)
    plan.truncates = truncs
    rb = pa.array([bucket_of(r) for r in rows], pa.int32()).to_numpy(zero_copy_only=False)
    counts = dict.fromkeys(merge.CHANGE_COUNTS, 0)
    actions, log = merge.merge_records(plan, rb, _recs(M, rows), buckets=list(range(buckets)), counts=counts)
    after = _lake_after(plan, actions)
    assert sum(after.values(), Counter()) == model
    # no key, no updates: each identical row's net count, up inserted, down deleted
    assert counts == {"inserted": (model - Counter(lake)).total(), "updated": 0,
                      "deleted": (Counter(lake) - model).total()}
    assert all(bucket_of({"x": x}) == b for b, rows_b in after.items() for x, _ in rows_b)
    entries = [(r["_time"], r["_diff"], r["x"], r["s"]) for r in log.to_pylist()]     # (None sorts with no str)
    assert all(d != 0 for _, d, *_ in entries)
    assert len({(t, *r) for t, _, *r in entries}) == len(entries)
    integral = Counter(lake)
    for _, d, *row in entries:
        integral[tuple(row)] += d
    assert +integral == model


def test_records_whose_times_are_2_to_the_32_apart_are_different_records(tmp_path):
    """A record's identity is (time, position) exactly: times 4 GiB of WAL apart, at one position,
    are two records (a time shifted into the high half of an int64 wraps there, and one was dropped
    as the other's duplicate), and a moved key's old image is its own -1, not one 2^32 away."""
    t = 0x5A_1234_5678                        # an LSN past 2^32, as a server that ran a while has
    plan = _plan(tmp_path, TOASTY, ["id"], [{"id": 1, "v": "a", "big": "B1"}, {"id": 2, "v": "b", "big": "B2"}])
    key = {"_tm_full": False, "_tm_unknown": ["v", "big"]}
    recs = _recs(TOASTY, [
        {"_tm_time": t, "_tm_pos": 0, "_tm_diff": 1, "id": 7, "v": "x", "big": "X"},
        {"_tm_time": t + (1 << 32), "_tm_pos": 0, "_tm_diff": 1, "id": 8, "v": "y", "big": "Y"},
        {"_tm_time": t + (2 << 32), "_tm_pos": 0, "_tm_diff": -1, "id": 2, **key},
        {"_tm_time": t + (3 << 32), "_tm_pos": 0, "_tm_diff": -1, "id": 1, **key},
        {"_tm_time": t + (3 << 32), "_tm_pos": 1, "_tm_diff": 1, "id": 5, "v": "a", "big": None,
         "_tm_unknown": ["big"]},
    ])
    actions, log = merge.merge_records(plan, 0, recs)
    assert _after(plan, actions) == Counter({(5, "a", "B1"): 1, (7, "x", "X"): 1, (8, "y", "Y"): 1})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_histories(), st.integers(1, 2), st.sampled_from([1, 2, 3]), st.integers(1, 4))
def test_a_group_merged_key_range_by_key_range_is_the_group_merged_whole(tmp_path_factory, case, buckets,
                                                                         target_rows, bound):
    """A group of more records than ``max_records`` (one huge transaction) merged in key ranges
    (`merge._key_ranges`: cuts between key values, never inside a lake file's key range; a moved
    key's TOAST-unchanged ``+1`` with its old key's ``-1``), each range over its own files: the lake
    after is the model and the whole merge's, the changelog the whole merge's, each range holds at
    most ``bound`` records unless one key or one file's range holds more, files stay sorted and apart."""
    lake, rows, truncs, model = case
    whole = _lake(tmp_path_factory.mktemp("lake"), TOASTY, ["id"], lake, lambda r: r["id"] % buckets, target_rows)
    whole.truncates = truncs
    recs = _recs(TOASTY, rows)
    rb = pa.array([r["id"] % buckets for r in rows], pa.int32()).to_numpy(zero_copy_only=False)
    actions, log = merge.merge_records(whole, rb, recs, buckets=list(range(buckets)))
    ranged = _lake(tmp_path_factory.mktemp("lake"), TOASTY, ["id"], lake, lambda r: r["id"] % buckets, target_rows)
    ranged.truncates, ranged.max_records, ranged.full = truncs, bound, recs.schema
    files = [f for fs in ranged.bucket_plan.files.values() for f in fs]
    info = pa.table({"key": recs.column("id"), "time": recs.column("_tm_time"), "pos": recs.column("_tm_pos"),
                     "diff": recs.column("_tm_diff"), "unknown": recs.column("_tm_unknown")})
    ranges = merge._key_ranges(ranged, info, files) or [(None, None)]
    event(f"{min(len(ranges), 3)} ranges")
    assert [lo for lo, _ in ranges[1:]] == [hi for _, hi in ranges[:-1]] and ranges[0][0] is None is ranges[-1][1]
    for lo, hi in ranges[1:]:     # a cut between key values, outside every file
        assert not any(f["min"]["id"] < lo <= f["max"]["id"] for f in files)
    held, parts = [], []
    part = work_area.ipc(recs)

    def records(within):
        got = merge._part_records(ranged, part, within)
        held.append(got.num_rows)
        b = pa.array([k % buckets for k in got.column("id").to_pylist()], pa.int32()).to_numpy(zero_copy_only=False)
        return got, b

    r_actions = merge.merge_ranges(ranged, list(range(buckets)), ranges, records, parts.append)
    assert sum(held) == recs.num_rows                   # every record in one range
    if len(ranges) > 1:
        assert len(held) == len(ranges)
    r_log = pa.concat_tables(parts) if parts else log.slice(0, 0)
    after = _lake_after(ranged, r_actions)
    assert sum(after.values(), Counter()) == Counter((k, v, big) for k, (v, big) in model.items())
    assert after == _lake_after(whole, actions)
    assert _log(r_log) == _log(log)
    for files_b in _files_after(ranged, r_actions).values():
        spans = sorted((f[0]["id"], f[-1]["id"]) for f in files_b if f)
        assert all([r["id"] for r in f] == sorted(r["id"] for r in f) for f in files_b)
        assert all(hi < lo for (_, hi), (lo, _) in zip(spans, spans[1:]))


def test_a_huge_groups_ranges_hold_at_most_max_records(tmp_path):
    """10,000 inserts and updates in one group, a lake of a few files: merged in ranges of at most
    ``max_records`` records (plus what one file's key range holds), the same lake as merged whole."""
    lake = [{"id": k, "v": f"v{k}", "big": f"B{k}"} for k in range(0, 3000, 3)]
    rows = ([{"_tm_time": 10, "_tm_pos": i, "_tm_diff": 1, "id": 3000 + i, "v": "i", "big": "I"} for i in range(9000)]
            + [{"_tm_time": 20, "_tm_pos": 2 * i + d, "_tm_diff": -1 if d == 0 else 1, "id": 3 * i,
                **({"_tm_full": False, "_tm_unknown": ["v", "big"]} if d == 0 else {"v": "u", "big": "U"})}
               for i in range(500) for d in (0, 1)])
    recs = _recs(TOASTY, rows)
    whole = _lake(tmp_path / "a", TOASTY, ["id"], lake, lambda r: 0, 400)
    actions, _ = merge.merge_records(whole, 0, recs, buckets=[0])
    ranged = _lake(tmp_path / "b", TOASTY, ["id"], lake, lambda r: 0, 400)
    ranged.max_records, ranged.full = 1000, recs.schema
    blobs = [work_area.ipc(recs.slice(i, 997)) for i in range(0, recs.num_rows, 997)]
    sizes, loads = [], []
    part_records = merge._part_records

    def counted(plan, blob, within=None):
        got = part_records(plan, blob, within)
        sizes.append((within, got.num_rows))
        return got

    import unittest.mock as mock

    with mock.patch.object(merge, "_part_records", counted):
        out = merge.merge_group_by_ranges(ranged, [0], [0] * len(blobs), lambda k: loads.append(k) or blobs[k])
    per_range = Counter()
    for within, n in sizes:
        if within is not None:
            per_range[within] += n
    assert len(per_range) >= 10 and max(per_range.values()) <= 1000 + 400, per_range
    got = [dict(zip(out.column_names, r)) for r in zip(*[out.column(c).to_pylist() for c in out.column_names])]
    assert not [r for r in got if r["op"] == "problem"]
    assert _lake_after(ranged, got) == _lake_after(whole, actions)
