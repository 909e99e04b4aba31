"""The batch path's per-bucket merge (`batch.merge_records`), in Arrow without Spark."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pytest

from tidemark.consolidate import batch, layout
from tidemark.consolidate.decode import meta_arrow_fields
from tidemark.pgtypes import Column, TableSchema, arrow_schema

K = TableSchema(schema="public", name="k", oid=1, columns=(
    Column("id", "int64", "int8", 20, key=True, nullable=False), Column("v", "text", "text", 25)))
M = TableSchema(schema="public", name="m", oid=2, replica_identity="f", columns=(
    Column("x", "int32", "int4", 23), Column("s", "text", "text", 25)))


def _plan(tmp_path, shape, keys, lake_rows):
    target = arrow_schema(shape)
    sort = layout.sort_columns(target, keys)
    bp = layout.BucketPlan(table=shape.qualified, uri=str(tmp_path), options=None, schema=target, keys=keys,
                           sort=sort, target_rows=1000, tag="T0")
    files = []
    if lake_rows:
        for a in layout.write_sorted(bp, pa.Table.from_pylist(lake_rows, schema=target), 0):
            st = json.loads(a["stats"])
            files.append({"path": a["path"], "size": a["size"], "rows": a["rows"], "min": st["minValues"],
                          "max": st["maxValues"]})
    bp.files = {0: files}
    bp.tag = "T1"
    return batch.TablePlan(shape.qualified, bp, [c for c in target.names if c not in keys], 0, 1000)


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
    actions, log = batch.merge_records(plan, 0, recs)
    assert _after(plan, actions) == Counter({(1, "AA"): 1, (3, "c"): 1})
    assert _log(log) == [(10, -1, 1, "a"), (10, 1, 1, "A"), (20, -1, 1, "A"), (20, -1, 2, "b"), (20, 1, 1, "AA"),
                         (30, 1, 4, "d"), (40, -1, 4, "d")]


def test_keyed_delete_without_previous_image_is_left_to_the_per_table_path(tmp_path):
    plan = _plan(tmp_path, K, ["id"], [{"id": 1, "v": "a"}])
    recs = _recs(K, [{"_tm_time": 10, "_tm_pos": 0, "_tm_diff": -1, "id": 9, "_tm_full": False, "_tm_unknown": ["v"]}])
    with pytest.raises(batch._Unhandled):
        batch.merge_records(plan, 0, recs)
    toast = _recs(K, [{"_tm_time": 10, "_tm_pos": 0, "_tm_diff": 1, "id": 1, "v": None, "_tm_unknown": ["v"]}])
    with pytest.raises(batch._Unhandled):
        batch.merge_records(plan, 0, toast)


def test_multiset_inserts_sum_identical_rows_and_keep_the_lake(tmp_path):
    plan = _plan(tmp_path, M, [], [{"x": 1, "s": "a"}, {"x": 1, "s": "a"}])
    recs = _recs(M, [{"_tm_time": 10, "_tm_pos": 0, "_tm_diff": 1, "x": 1, "s": "a"},
                     {"_tm_time": 10, "_tm_pos": 1, "_tm_diff": 1, "x": 1, "s": "a"},
                     {"_tm_time": 10, "_tm_pos": 1, "_tm_diff": 1, "x": 1, "s": "a"},     # duplicate record
                     {"_tm_time": 20, "_tm_pos": 0, "_tm_diff": 1, "x": 2, "s": "b"}])
    actions, log = batch.merge_records(plan, 0, recs)
    assert _after(plan, actions) == Counter({(1, "a"): 4, (2, "b"): 1})
    assert _log(log) == [(10, 2, 1, "a"), (20, 1, 2, "b")]
    deletes = _recs(M, [{"_tm_time": 10, "_tm_pos": 0, "_tm_diff": -1, "x": 1, "s": "a"}])
    with pytest.raises(batch._Unhandled):
        batch.merge_records(plan, 0, deletes)


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
    actions, log = batch.merge_records(plan, 0, recs)
    assert _after(plan, actions) == Counter({(1, "AA", "B1"): 1, (2, "bb", "NEW"): 1, (3, "cc", "B3"): 1})
    assert _log(log) == [(10, -1, 1, "a", "B1"), (10, 1, 1, "A", "B1"), (20, -1, 1, "A", "B1"),
                         (20, -1, 2, "b", "B2"), (20, 1, 1, "AA", "B1"), (20, 1, 2, "b", "NEW"),
                         (30, -1, 2, "b", "NEW"), (30, 1, 2, "bb", "NEW"), (30, 1, 3, "c", "B3"),
                         (40, -1, 3, "c", "B3"), (40, 1, 3, "cc", "B3")]


def test_unchanged_toast_in_an_update_that_moved_the_key_is_left_to_the_per_table_path(tmp_path):
    plan = _plan(tmp_path, TOASTY, ["id"], [{"id": 1, "v": "a", "big": "B1"}, {"id": 9, "v": "n", "big": "B9"}])
    moved = _recs(TOASTY, [
        {"_tm_time": 10, "_tm_pos": 0, "_tm_diff": -1, "id": 1, "_tm_full": False, "_tm_unknown": ["v", "big"]},
        {"_tm_time": 10, "_tm_pos": 1, "_tm_diff": 1, "id": 5, "v": "a", "big": None, "_tm_unknown": ["big"]}])
    with pytest.raises(batch._Unhandled, match="changed the key"):
        batch.merge_records(plan, 0, moved)
    # key 1 deleted, then row 9 moved to key 1 leaving big alone: key 1's earlier image is not its previous one
    reused = _recs(TOASTY, [
        {"_tm_time": 10, "_tm_pos": 0, "_tm_diff": -1, "id": 1, "_tm_full": False, "_tm_unknown": ["v", "big"]},
        {"_tm_time": 20, "_tm_pos": 0, "_tm_diff": -1, "id": 9, "_tm_full": False, "_tm_unknown": ["v", "big"]},
        {"_tm_time": 20, "_tm_pos": 1, "_tm_diff": 1, "id": 1, "v": "z", "big": None, "_tm_unknown": ["big"]}])
    with pytest.raises(batch._Unhandled, match="changed the key"):
        batch.merge_records(plan, 0, reused)
