"""Parts the decoding cut otherwise than the lake table cuts rows now are cut again before the merge.

A table without a key (REPLICA IDENTITY FULL) is bucketed by a hash of every column: the decoding
cuts each segment's changes by the columns of the segment's own shape, so a batch that drops a
column holds parts hashed with it, while the lake table hashes rows without it from then on. Those
parts are conformed and cut again (`batch._cut`); without that, deletes land in buckets whose rows
they cannot find, or identical rows split between buckets.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

import pyarrow as pa
import pyarrow.parquet as pq

from consolidate_kit import Lander, shape, snapshot, up
from tidemark.consolidate import batch as batch_mod, consolidate_stream, sparkhash
from tidemark.lake import open_delta, read_table, table_uri
from tidemark.landing.store import stream_keys

pytestmark = [pytest.mark.spark, pytest.mark.slow]

WIDE = shape("m", [("x", "int32"), ("s", "text")], oid=41, replica_identity="f")
NARROW = shape("m", [("x", "int32")], oid=41, replica_identity="f")


def test_a_batch_that_drops_a_column_of_a_table_without_a_key_cuts_its_older_parts_again(
        spark, make_stream, control, monkeypatch):
    """The lake table's rows are bucketed again by the DROP COLUMN's rewrite, the batch's wide parts
    are cut again: each bucket merged on its own finds every row its deletes take out."""
    monkeypatch.setattr(batch_mod, "WHOLE_TABLE_RECORDS", 0)       # bucket by bucket, however small
    cfg = make_stream(["public.m"], consolidate={"buckets": 4})
    control.upsert_stream(cfg)
    rng = random.Random(5)
    rows = [{"x": rng.randint(0, 30), "s": rng.choice(["a", "b", None])} for _ in range(200)]
    snapshot(cfg, control, "snap1", 10, {"public.m": (WIDE, rows)}, rows_per_file=50)
    assert consolidate_stream(cfg, spark=spark).frontier_after == 10
    live = Counter((r["x"], r["s"]) for r in rows)
    # before the DROP COLUMN: deletes of whole rows and inserts, in the wide shape
    before = []
    for pos, r in enumerate(rng.sample(rows, 40)):
        before.append(up(WIDE, r, 20, -1, pos))
        live[(r["x"], r["s"])] -= 1
    for pos in range(40, 70):
        r = {"x": rng.randint(0, 30), "s": rng.choice(["a", "c"])}
        before.append(up(WIDE, r, 20, 1, pos))
        live[(r["x"], r["s"])] += 1
    # after it: rows are x alone; deletes of rows that were there before it, inserts
    narrow = Counter()
    for (x, _), n in live.items():
        narrow[x] += n
    after = []
    for pos, x in enumerate(rng.sample(sorted(+narrow), 10)):
        after.append(up(NARROW, {"x": x}, 30, -1, pos))
        narrow[x] -= 1
    for pos in range(10, 25):
        x = rng.randint(0, 40)
        after.append(up(NARROW, {"x": x}, 30, 1, pos))
        narrow[x] += 1
    Lander(cfg, control).land(10, 40, [(before, []), (after, [])])
    cut = []
    real = batch_mod._cut
    monkeypatch.setattr(batch_mod, "_cut", lambda job, prepared, cuts, parts: cut.append(sorted(cuts))
                        or real(job, prepared, cuts, parts))
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_after == 40
    assert cut == [["public.m"]]                 # its parts were cut again, the wide ones by x alone
    got = read_table(cfg, "public.m")
    assert got.column_names == ["x"]
    assert Counter(got.column("x").to_pylist()) == +narrow
    # every row in the bucket its values hash to now (a row placed by the old hash is one the next
    # delete of it looks for in vain)
    files = pa.table(open_delta(table_uri(cfg, "public.m")).get_add_actions(flatten=True)).to_pydict()
    for path, bucket in zip(files["path"], files["partition._bucket"]):
        rows = pq.read_table(f"{table_uri(cfg, 'public.m')}/{path}")
        assert set(sparkhash.buckets(rows, ["x"], 4).tolist()) <= {int(bucket)}, path
    assert not list(Lander(cfg, control).store.list(stream_keys(cfg.stream)["decoded"]))
