"""Landing on S3 (a real S3-compatible HTTP server): executors read segments and snapshot files
through boto3; the changelog file lands there too."""

from __future__ import annotations

import secrets
from collections import Counter

import boto3
import pytest

from consolidate_kit import Lander, rows_counter, shape, snapshot, up
from tidemark.consolidate import consolidate_stream
from tidemark.consolidate.cdc_file import read_cdc
from tidemark.consolidate.feed_files import changelog_key
from tidemark.lake import read_table
from tidemark.landing.store import open_store

pytestmark = [pytest.mark.spark, pytest.mark.slow]

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
T = shape("t", [("k", "int32", True), ("v", "text")], oid=5)


@pytest.fixture
def s3(monkeypatch):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    bucket = f"tm-{secrets.token_hex(4)}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    yield endpoint, bucket
    server.stop()


def test_s3_landing(spark, make_stream, control, s3, monkeypatch):
    endpoint, bucket = s3
    cfg = make_stream(["public.t"], landing={"url": f"s3://{bucket}/land", "endpoint_url": endpoint})
    control.upsert_stream(cfg)
    import consolidate_kit

    monkeypatch.setattr(consolidate_kit, "open_store", lambda url: open_store(url, endpoint_url=endpoint))
    snapshot(cfg, control, "s1", 100, {"public.t": (T, [{"k": i, "v": "snap"} for i in range(5)])}, rows_per_file=2)
    lander = Lander(cfg, control)
    assert lander.store.url.startswith("s3://")
    lander.land(100, 200, [([up(T, {"k": 0}, 150, -1, 0, image="key"), up(T, {"k": 9, "v": "new"}, 150, 1, 1)], [])])
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_after == 200
    assert rows_counter(read_table(cfg, "public.t")) == Counter(
        {(1, "snap"): 1, (2, "snap"): 1, (3, "snap"): 1, (4, "snap"): 1, (9, "new"): 1})
    updates, progress = read_cdc(lander.store.get(changelog_key(cfg.stream, "public.t", 100, 200)))
    assert sorted((u["data"]["k"], u["diff"]) for u in updates if u["time"] == 150) == [(0, -1), (9, 1)]
    # the feed's first file also holds the snapshot as updates at its LSN
    assert sorted((u["data"]["k"], u["diff"]) for u in updates if u["time"] == 100) == [(i, 1) for i in range(5)]
