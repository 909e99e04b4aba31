"""`columns.recorded_renames` finds a RENAME COLUMN recorded at the committed frontier however many
versions came after it at that frontier: `tidemark.maintain` adds compactions (same frontier) and
vacuums and property changes (no frontier) between two batches."""

from __future__ import annotations

import json

import pyarrow as pa
from deltalake import CommitProperties, write_deltalake

from tidemark.consolidate.columns import recorded_renames as _recorded_renames
from tidemark.lake import open_delta


def _commit(path, meta: dict | None) -> None:
    props = CommitProperties(custom_metadata={"tidemark": json.dumps(meta)} if meta else None)
    write_deltalake(str(path), pa.table({"a": pa.array([1], pa.int64())}), mode="append", commit_properties=props)


def test_a_rename_is_found_behind_many_maintenance_versions(tmp_path):
    _commit(tmp_path, {"stream": "s", "frontier": 100})                               # a batch at 100
    _commit(tmp_path, {"stream": "s", "frontier": 200})                               # the batch at 200
    _commit(tmp_path, {"stream": "s", "frontier": 200, "renamed": {"a": "b"}})         # its RENAME rewrite
    _commit(tmp_path, {"stream": "s", "frontier": 200, "renamed": {"c": "d"}})
    for i in range(12):            # daily maintenance without a batch between: compactions and vacuums
        _commit(tmp_path, {"stream": "s", "frontier": 200, "operation": "compact"} if i % 3 == 0 else None)
    dt = open_delta(str(tmp_path), None)
    assert _recorded_renames(dt, "s", 200) == {"a": "b", "c": "d"}
    assert _recorded_renames(dt, "other", 200) == {}


def test_renames_of_an_earlier_frontier_do_not_count(tmp_path):
    _commit(tmp_path, {"stream": "s", "frontier": 100, "renamed": {"x": "y"}})
    _commit(tmp_path, {"stream": "s", "frontier": 200})
    assert _recorded_renames(open_delta(str(tmp_path), None), "s", 200) == {}
