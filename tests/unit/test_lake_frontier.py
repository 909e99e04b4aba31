"""Committed means kept (`commit.discard_uncommitted`) and one frontier for every table
(`lake.version_at`), on real Delta tables written with deltalake (no Spark)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tidemark.lake import open_delta, version_at, writer as C


def _write(uri, name, rows):
    os.makedirs(f"{uri}/_bucket=0", exist_ok=True)
    path = f"_bucket=0/{name}.parquet"
    pq.write_table(pa.table({"id": pa.array(rows, pa.int32())}), f"{uri}/{path}")
    return {"op": "add", "path": path, "size": os.path.getsize(f"{uri}/{path}"), "partition": "0", "stats": None,
            "rows": len(rows)}


SCHEMA = pa.schema([pa.field("id", pa.int32())])


def test_discard_keeps_files_of_a_commit_that_went_through(tmp_path):
    uri = str(tmp_path / "t")
    a = _write(uri, "a", [1, 2])
    C.commit_files(uri, None, None, SCHEMA, [a], stream="s", frontier=10)
    b = _write(uri, "b", [3])
    C.commit_files(uri, None, open_delta(uri), SCHEMA, [b], stream="s", frontier=20)
    # the failure came after the commit at 20: nothing of it may go
    assert C.discard_uncommitted(uri, None, [b], stream="s", frontier=20) == []
    assert os.path.exists(f"{uri}/{b['path']}")
    # an attempt at 30 that never committed: its file goes, committed ones stay
    c = _write(uri, "c", [4])
    assert C.discard_uncommitted(uri, None, [a, c], stream="s", frontier=30) == [c["path"]]
    assert os.path.exists(f"{uri}/{a['path']}") and not os.path.exists(f"{uri}/{c['path']}")


def test_discard_deletes_nothing_when_the_log_cannot_be_read(tmp_path, monkeypatch):
    uri = str(tmp_path / "t")
    a = _write(uri, "a", [1])

    def broken(*args, **kwargs):
        raise OSError("the store is unreachable")

    monkeypatch.setattr(C, "open_delta", broken)
    assert C.discard_uncommitted(uri, None, [a], stream="s", frontier=10) == []
    assert os.path.exists(f"{uri}/{a['path']}")


def test_version_at_picks_each_tables_version_at_one_frontier(tmp_path):
    uri = str(tmp_path / "t")
    C.commit_files(uri, None, None, SCHEMA, [_write(uri, "a", [1])], stream="s", frontier=10)      # v0
    C.commit_files(uri, None, open_delta(uri), SCHEMA, [_write(uri, "b", [2])], stream="s", frontier=20,
                   desc='{"buckets": 1}')                                                           # v1 desc, v2 data
    C.commit_files(uri, None, open_delta(uri), SCHEMA, [_write(uri, "c", [3])], stream="s", frontier=30)  # v3
    dt = open_delta(uri)
    assert dt.version() == 3
    assert version_at(dt, "s", 5) is None
    assert version_at(dt, "s", 10) == 0         # the description change belongs to the commit at 20
    assert version_at(dt, "s", 19) == 0
    assert version_at(dt, "s", 20) == 2
    assert version_at(dt, "s", 29) == 2
    assert version_at(dt, "s", 30) == 3
    assert version_at(dt, "other", 30) is None
    dt.load_as_version(version_at(dt, "s", 20))
    assert sorted(pa.table(dt.get_add_actions(flatten=True)).column("path").to_pylist()) == \
        ["_bucket=0/a.parquet", "_bucket=0/b.parquet"]


if __name__ == "__main__":
    pytest.main([__file__])


def test_plain_http_to_s3_only_when_the_endpoint_says_http():
    from tidemark.config import parse_config
    from tidemark.lake import storage_options

    def opts(endpoint):
        return storage_options(parse_config({
            "stream": "s", "source": {"connection": "c", "tables": ["public.x"]}, "control": {"connection": "c"},
            "landing": {"url": "s3://bucket/landing", **({"endpoint_url": endpoint} if endpoint else {})},
            "lake": {"path": "s3://bucket/lake"}}))

    assert opts("http://127.0.0.1:9000")["AWS_ALLOW_HTTP"] == "true"
    assert "AWS_ALLOW_HTTP" not in opts("https://s3.internal.example:443")
    assert opts(None) is None
