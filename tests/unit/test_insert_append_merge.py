"""A bucket a batch only inserts into keeps its files (`merge.merge_records`): its new rows are new files
beside them, no remove; a file that may hold an inserted key (by its statistics) is still rewritten
(the insert replaces the lake's row), and a bucket with a ``-1`` is merged as before. Checked on the
merge's file actions, against the rows each bucket should hold after the batch."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pyarrow as pa

from tidemark.consolidate import merge
from tidemark.consolidate.work_area import meta_arrow_fields
from tidemark.lake import layout
from tidemark.pgtypes import Column, TableSchema, arrow_schema

KEYED = TableSchema(schema="public", name="k", oid=1, columns=(
    Column("id", "int64", "int8", 20, key=True, nullable=False), Column("v", "text", "text", 25)))
KEYLESS = TableSchema(schema="public", name="m", oid=2, replica_identity="f", columns=(
    Column("x", "int32", "int4", 23), Column("s", "text", "text", 25)))


def _plan(tmp_path, shape, rows, bucket_of, target_rows=8):
    """A lake of ``rows`` (each in bucket ``bucket_of(row)``; files of at most ``target_rows`` rows)."""
    keys = layout.effective_keys(shape)
    target = arrow_schema(shape)
    bp = layout.BucketPlan(uri=str(tmp_path), options=None, schema=target, keys=keys,
                           sort=layout.sort_columns(target, keys), target_rows=target_rows, tag="T0")
    for b in sorted({bucket_of(r) for r in rows}):
        mine = pa.Table.from_pylist([r for r in rows if bucket_of(r) == b], schema=target)
        bp.files[b] = [{"path": a["path"], "size": a["size"], "rows": a["rows"],
                        **{k: json.loads(a["stats"])[s] for k, s in
                           (("min", "minValues"), ("max", "maxValues"), ("nulls", "nullCount"))}}
                       for a in layout.write_sorted(bp, mine, b)]
    bp.tag = "T1"
    return merge.TablePlan(shape.qualified, bp, lower=0, frontier=1000)


def _merge(plan, shape, changes, bucket_of):
    """Merge ``changes`` (``(diff, row)``, in order at times 10, 11, ...); return (file actions, rows per
    bucket after them)."""
    schema = pa.schema(meta_arrow_fields() + list(arrow_schema(shape)))
    recs = pa.Table.from_pylist([{"_tm_full": True, "_tm_unknown": [], "_tm_xid": 1, "_tm_time": 10 + i,
                                  "_tm_cts": 10 + i, "_tm_pos": 0, "_tm_diff": d, **r}
                                 for i, (d, r) in enumerate(changes)], schema=schema)
    rb = np.array([bucket_of(r) for _, r in changes], np.int32)
    actions, _ = merge.merge_records(plan, rb, recs, buckets=sorted(plan.bucket_plan.files))
    removed = {a["path"] for a in actions if a["op"] == "remove"}
    paths = {b: [f["path"] for f in fs if f["path"] not in removed] for b, fs in plan.bucket_plan.files.items()}
    for a in actions:
        if a["op"] == "add":
            paths.setdefault(a["bucket"], []).append(a["path"])
    return actions, {b: Counter(tuple(r.values()) for r in layout.read_files(plan.bucket_plan, ps).to_pylist())
                     for b, ps in paths.items()}


def _removed_buckets(actions) -> set[int]:
    return {a["bucket"] for a in actions if a["op"] == "remove"}


def test_new_keys_are_new_files_beside_a_buckets_small_files(tmp_path):
    bucket_of = lambda r: r["id"] % 2           # noqa: E731
    lake = [{"id": i, "v": f"v{i}"} for i in range(1, 7)]          # 3 rows a bucket: small files
    plan = _plan(tmp_path, KEYED, lake, bucket_of)
    new = [{"id": i, "v": f"n{i}"} for i in range(7, 13)]
    actions, after = _merge(plan, KEYED, [(1, r) for r in new], bucket_of)
    assert not _removed_buckets(actions), actions
    assert sum(a["op"] == "add" for a in actions) == 2               # one new file a bucket
    for b in (0, 1):
        assert after[b] == Counter((r["id"], r["v"]) for r in lake + new if bucket_of(r) == b)


def test_an_inserted_key_a_file_may_hold_rewrites_that_file_and_a_bucket_with_a_delete_is_merged(tmp_path):
    bucket_of = lambda r: r["id"] % 2           # noqa: E731
    lake = [{"id": i, "v": f"v{i}"} for i in (1, 2, 4, 5, 8, 9)]
    plan = _plan(tmp_path, KEYED, lake, bucket_of)
    # bucket 0: an insert of a key the lake holds (replaces its row) and a new key inside the file's range;
    # bucket 1: a delete, then an insert of a new key
    changes = [(1, {"id": 2, "v": "again"}), (1, {"id": 6, "v": "six"}), (-1, {"id": 5, "v": None}),
               (1, {"id": 11, "v": "eleven"})]
    actions, after = _merge(plan, KEYED, changes, bucket_of)
    assert _removed_buckets(actions) == {0, 1}
    assert after[0] == Counter([(2, "again"), (4, "v4"), (6, "six"), (8, "v8")])
    assert after[1] == Counter([(1, "v1"), (9, "v9"), (11, "eleven")])


def test_a_table_without_a_key_appends_where_it_has_no_delete(tmp_path):
    bucket_of = lambda r: r["x"] % 2            # noqa: E731
    lake = [{"x": x, "s": s} for x in range(6) for s in ("a", "b")]
    plan = _plan(tmp_path, KEYLESS, lake, bucket_of)
    changes = [(1, {"x": 0, "s": "a"}), (1, {"x": 2, "s": "c"}),          # bucket 0: inserts only (a duplicate)
               (-1, {"x": 1, "s": "b"}), (1, {"x": 3, "s": "z"})]           # bucket 1: a delete
    actions, after = _merge(plan, KEYLESS, changes, bucket_of)
    assert _removed_buckets(actions) == {1}
    want = Counter((r["x"], r["s"]) for r in lake) + Counter([(0, "a"), (2, "c"), (3, "z")]) - Counter([(1, "b")])
    assert after[0] + after[1] == want
    assert all(bucket_of({"x": x}) == b for b in after for x, _ in after[b])
