"""The changelog Delta table's schema across ADD/DROP COLUMN (`log_evolution.evolve_log_schema`): the union of
every column the table has had, added columns nullable, a column back with another type refused."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from tidemark.consolidate.log_evolution import evolve_log_schema
from tidemark.errors import ChangelogError
from tidemark.lake import open_delta
from tidemark.lake.scd2 import log_schema


def _names(dt) -> list[str]:
    return [f.name for f in dt.schema().fields]


def test_added_columns_join_and_dropped_ones_stay(tmp_path):
    uri = str(tmp_path / "log")
    v1 = pa.schema([pa.field("id", pa.int64(), False), pa.field("name", pa.string())])
    write_deltalake(uri, log_schema(v1).empty_table())
    dt = open_delta(uri, None)
    assert evolve_log_schema(uri, None, dt, v1, "public.t") is dt          # nothing new: untouched
    v2 = pa.schema([pa.field("id", pa.int64(), False), pa.field("note", pa.string()),
                    pa.field("bal", pa.decimal128(12, 2))])             # name dropped, note and bal added
    dt = evolve_log_schema(uri, None, dt, v2, "public.t")
    assert _names(dt) == ["id", "name", "_time", "_diff", "_commit_ts", "note", "bal"]
    assert all(f.nullable for f in dt.schema().fields if f.name in ("note", "bal"))
    assert evolve_log_schema(uri, None, dt, v2, "public.t").version() == dt.version()   # idempotent
    v3 = pa.schema([pa.field("id", pa.int64(), False), pa.field("name", pa.string())])  # added back, same type
    assert _names(evolve_log_schema(uri, None, dt, v3, "public.t")) == _names(dt)


def test_a_column_back_with_another_type_is_refused_by_name(tmp_path):
    uri = str(tmp_path / "log")
    write_deltalake(uri, log_schema(pa.schema([pa.field("id", pa.int64()), pa.field("name", pa.string())])).empty_table())
    dt = open_delta(uri, None)
    with pytest.raises(ChangelogError, match=r"table public\.t: column name has type int32 now but"):
        evolve_log_schema(uri, None, dt, pa.schema([pa.field("id", pa.int64()), pa.field("name", pa.int32())]),
                          "public.t")
    assert _names(open_delta(uri, None)) == ["id", "name", "_time", "_diff", "_commit_ts"]


def test_no_table_yet_is_left_to_the_first_commit(tmp_path):
    assert evolve_log_schema(str(tmp_path / "none"), None, None, pa.schema([pa.field("id", pa.int64())]), "t") is None
