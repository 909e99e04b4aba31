"""Delta's change data feed on an S3 lake (a real S3-compatible HTTP server): the batch's version
with its ``cdc`` actions is put with ``If-None-Match: *`` (`lake.writer.log_commit`), and
``load_cdf`` reads it back. The server runs in a process of its own: deltalake's ``history()``
holds the GIL while it waits for the server, so a server thread in the test's process never answers
(`test_consolidate_s3`'s lake is local)."""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import time
from collections import Counter

import boto3
import pyarrow as pa
import pytest

from consolidate_kit import Lander, snapshot, up
from test_consolidate_s3 import S3_ENV, T
from tidemark.consolidate import consolidate_stream
from tidemark.lake import read_table, storage_options, table_uri
from tidemark.landing.store import open_store

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture
def s3(monkeypatch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        for k, v in S3_ENV.items():
            monkeypatch.setenv(k, v)
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        bucket = f"tm-{secrets.token_hex(4)}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield endpoint, bucket
    finally:
        server.terminate()
        server.wait(10)


def test_change_data_feed_on_an_s3_lake(spark, make_stream, control, s3, monkeypatch):
    from deltalake import DeltaTable

    endpoint, bucket = s3
    cfg = make_stream(["public.t"], landing={"url": f"s3://{bucket}/land", "endpoint_url": endpoint},
                      lake={"path": f"s3://{bucket}/lake"})
    control.upsert_stream(cfg)
    import consolidate_kit

    monkeypatch.setattr(consolidate_kit, "open_store", lambda url: open_store(url, endpoint_url=endpoint))
    snapshot(cfg, control, "s1", 100, {"public.t": (T, [{"k": i, "v": "snap"} for i in range(5)])}, rows_per_file=2)
    lander = Lander(cfg, control)
    lander.land(100, 200, [([up(T, {"k": 0}, 150, -1, 0, image="key"), up(T, {"k": 9, "v": "new"}, 150, 1, 1)], [])])
    consolidate_stream(cfg, spark=spark)
    lander.land(200, 300, [([up(T, {"k": 1}, 250, -1, 0, image="key"), up(T, {"k": 1, "v": "upd"}, 250, 1, 1)], [])])
    consolidate_stream(cfg, spark=spark)
    assert sorted(read_table(cfg, "public.t").to_pylist(), key=lambda r: r["k"]) == \
        [{"k": 1, "v": "upd"}, {"k": 2, "v": "snap"}, {"k": 3, "v": "snap"}, {"k": 4, "v": "snap"}, {"k": 9, "v": "new"}]
    dt = DeltaTable(table_uri(cfg, "public.t"), storage_options=storage_options(cfg))
    feed = pa.table(dt.load_cdf(starting_version=0).read_all())
    got = Counter((r["_commit_version"], r["k"], r["v"], r["_change_type"]) for r in feed.to_pylist())
    last = dt.version()
    assert {(k, v, c) for (ver, k, v, c) in got if ver == last} == {(1, "snap", "update_preimage"),
                                                                   (1, "upd", "update_postimage")}
    assert {(k, v, c) for (ver, k, v, c) in got if ver == last - 1} == {(0, "snap", "delete"), (9, "new", "insert")}
    assert {h["version"]: h.get("tidemark", {}).get("frontier") for h in dt.history()}[last] == 300
