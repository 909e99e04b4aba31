"""Delta's change data feed on an S3 lake (a real S3-compatible HTTP server): the batch's version
with its ``cdc`` actions is put with ``If-None-Match: *`` (`lake.writer.log_commit`), and
``load_cdf`` reads it back."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pytest

from consolidate_kit import Lander, snapshot, up
from test_consolidate_s3 import T, s3  # noqa: F401  (the fixture)
from tidemark.consolidate import consolidate_stream
from tidemark.lake import read_table, storage_options, table_uri
from tidemark.landing.store import open_store

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def test_change_data_feed_on_an_s3_lake(spark, make_stream, control, s3, monkeypatch):  # noqa: F811
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
