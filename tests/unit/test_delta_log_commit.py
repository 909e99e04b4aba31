"""The lake writer's own Delta log commit (`lake.writer.log_commit`, for versions with change data):
put only if absent, locally and on S3, and a lost race re-reads the winner."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from tidemark.lake.writer import CommitConflict, _put_if_absent, log_commit


def _table(tmp_path):
    from deltalake import DeltaTable, write_deltalake

    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"k": [1, 2], "p": [0, 1]}), partition_by=["p"])
    return uri, DeltaTable(uri)


def _entries(stream: str, frontier: int, *, add=None, remove=None, part="0") -> list[dict]:
    out = [{"commitInfo": {"timestamp": 1, "operation": "MERGE"}},
           {"txn": {"appId": stream, "version": frontier, "lastUpdated": 1}}]
    if add:
        out.append({"add": {"path": add, "partitionValues": {"p": part}, "size": 1, "modificationTime": 1,
                            "dataChange": True, "stats": "{}"}})
    if remove:
        out.append({"remove": {"path": remove, "partitionValues": {"p": part}, "deletionTimestamp": 1,
                               "dataChange": True}})
    return out


def _log(uri, version: int) -> list[dict]:
    with open(f"{uri}/_delta_log/{version:020d}.json") as f:
        return [json.loads(line) for line in f]


def test_a_version_is_put_once_and_read_by_deltalake(tmp_path):
    from deltalake import DeltaTable

    uri, dt = _table(tmp_path)
    assert log_commit(uri, None, 1, _entries("s", 100), stream="s", frontier=100) == 1
    assert DeltaTable(uri).transaction_version("s") == 100
    # the same commit again (a retry whose first answer was lost): it is there, nothing new is written
    assert log_commit(uri, None, 1, _entries("s", 100), stream="s", frontier=100) == 1
    assert DeltaTable(uri).version() == 1
    assert not [p for p in (tmp_path / "t" / "_delta_log").iterdir() if p.name.endswith(".tmp")]


def test_a_lost_race_to_a_writer_that_touches_nothing_of_ours_takes_the_next_version(tmp_path):
    uri, dt = _table(tmp_path)
    log_commit(uri, None, 1, _entries("other", 7, add="p=1/x.parquet", part="1"), stream="other", frontier=7)
    assert log_commit(uri, None, 1, _entries("s", 100, add="p=0/y.parquet"), stream="s", frontier=100) == 2
    assert any("txn" in e and e["txn"]["appId"] == "s" for e in _log(uri, 2))


@pytest.mark.parametrize("winner, says", [
    (_entries("s", 50), "committed stream 's' to frontier 0/32"),
    (_entries("other", 7, remove="p=0/a.parquet"), "removed p=0/a.parquet"),
    (_entries("other", 7, add="p=0/z.parquet"), "changed rows of a partition"),
    ([{"commitInfo": {}}, {"metaData": {"id": "x"}}], "metadata or protocol"),
])
def test_a_lost_race_to_an_overlapping_writer_is_a_clear_error(tmp_path, winner, says):
    uri, dt = _table(tmp_path)
    log_commit(uri, None, 1, winner, stream="w", frontier=1)
    with pytest.raises(CommitConflict, match=says) as err:
        log_commit(uri, None, 1, _entries("s", 100, remove="p=0/a.parquet"), stream="s", frontier=100)
    assert "version 1" in str(err.value) and uri in str(err.value)


def test_s3_puts_a_version_only_if_absent(monkeypatch):
    import boto3
    from moto import mock_aws

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="lake-bucket")
        uri = "s3://lake-bucket/demo/tables/t"
        assert _put_if_absent(uri, None, "_delta_log/00000000000000000001.json", b"first\n")
        assert not _put_if_absent(uri, None, "_delta_log/00000000000000000001.json", b"second\n")
        got = client.get_object(Bucket="lake-bucket", Key="demo/tables/t/_delta_log/00000000000000000001.json")
        assert got["Body"].read() == b"first\n"
        # a lost race on S3 is read back like a local one
        body = "\n".join(json.dumps(e) for e in _entries("other", 7, add="p=1/x.parquet", part="1"))
        client.put_object(Bucket="lake-bucket", Key="demo/tables/t/_delta_log/00000000000000000002.json",
                          Body=body.encode())
        assert log_commit(uri, None, 2, _entries("s", 9, add="p=0/y.parquet"), stream="s", frontier=9) == 3
        with pytest.raises(CommitConflict):
            log_commit(uri, None, 2, _entries("s", 10, add="p=1/w.parquet", part="1"), stream="s", frontier=10)
