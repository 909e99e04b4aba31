"""The standard feed's file format and the external feed's file checks, without Spark or PostgreSQL."""

from __future__ import annotations

import io

import fastavro
import pyarrow as pa
import pytest

from hypothesis import given, settings, strategies as st

from tidemark.consolidate.cdc_file import cdc_bytes, encode_updates, feed_field_names, read_cdc_all
from tidemark.consolidate.preconsolidate import consolidated_updates
from tidemark.feeds import FeedError, parse_feed_file, table_shape
from tidemark.landing.segments import SegmentBuilder

from feedkit import SEED_READER, feed_file, seed_schema

def test_field_names_keep_source_names_and_follow_the_rule_otherwise():
    assert feed_field_names(["id", "price"]) == ["id", "price"]
    assert feed_field_names(["order id", "1st", "a b", "a_b", "Ünï"]) == ["order_id", "_1st", "a_b_2", "a_b", "_n_"]
    assert feed_field_names(["x-y", "x_y", "x y"]) == ["x_y_0", "x_y", "x_y_2"]
    names = feed_field_names(["a b", "a_b", "a_b_0", "a-b"])
    assert len(set(names)) == 4


def test_feed_file_is_preconsolidated_counted_and_readable_with_the_seeds_schema():
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("price", pa.int32())])
    rows = pa.table({"id": [5, 5, 5, 7, 7, 8], "price": [10, 10, 12, 1, 1, None]}, schema=schema)
    times = [4, 4, 4, 5, 5, 5]
    diffs = [1, 1, 1, 1, -1, 1]           # (5,10)@4 twice → diff 2; (7,1)@5 cancels → dropped
    data = cdc_bytes("public.prices", schema, rows, times, diffs, 3, 10, since=0)
    updates, progress = read_cdc_all(data)
    got = sorted((tuple(u["data"].values()), u["time"], u["diff"]) for u in updates)
    assert got == [((5, 10), 4, 2), ((5, 12), 4, 1), ((8, None), 5, 1)]
    assert [(p["lower"], p["upper"], p["counts"]) for p in progress] == [
        ([0], [3], []), ([3], [10], [{"time": 4, "count": 2}, {"time": 5, "count": 1}])]
    resolved = list(fastavro.reader(io.BytesIO(data), reader_schema=SEED_READER))
    assert [d for d in resolved if isinstance(d, dict)][0] == {"lower": [0], "upper": [3], "counts": []}
    assert sum(len(d) for d in resolved if isinstance(d, list)) == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.one_of(st.none(), st.text(max_size=3)), st.integers(1, 4),
                          st.sampled_from([-1, 1])), max_size=40),
       st.integers(1, 5), st.integers(1, 4))
def test_a_file_from_updates_encoded_in_groups_reads_as_the_one_encoded_whole(records, groups, chunk):
    """The batch path encodes each bucket's consolidated updates in its executor and the driver only
    frames them: the file must read as the driver-encoded one (same updates, same progress), in
    any number of groups, datums per group and group order; and it stays a readable Avro file."""
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("s", pa.string())])
    rows = pa.table({"id": [r[0] for r in records], "s": [r[1] for r in records]}, schema=schema)
    times = [r[2] for r in records]
    diffs = [r[3] for r in records]
    whole = cdc_bytes("public.t", schema, rows, times, diffs, 1, 9, chunk=chunk)
    # the executors' side: consolidated rows, split by key as buckets are, each group encoded apart
    import numpy as np

    keep, sums = consolidated_updates(rows, np.asarray(times, np.int64), np.asarray(diffs, np.int64))
    merged = rows.take(pa.array(keep, pa.int64())).append_column("_time", pa.array(np.asarray(times)[keep]))
    merged = merged.append_column("_diff", pa.array(sums, pa.int64()))
    encoded = []
    for g in range(groups):
        part = merged.filter(pa.array([k % groups == g for k in merged.column("id").to_pylist()], pa.bool_()))
        datums = encode_updates(schema, part, part.column("_time"), part.column("_diff"), chunk=chunk)
        encoded.append((len(datums), b"".join(datums)))
    framed = cdc_bytes("public.t", schema, merged, merged.column("_time"), merged.column("_diff"), 1, 9,
                       encoded=encoded[::-1])

    def content(data):
        updates, progress = read_cdc_all(data)
        return sorted(((tuple(u["data"].values()), u["time"], u["diff"]) for u in updates), key=repr), progress

    assert content(framed) == content(whole)
    assert len(list(fastavro.reader(io.BytesIO(framed)))) == sum(n for n, _ in encoded) + 1



@pytest.mark.parametrize("codec", ["zstandard", "deflate", "null"])
def test_a_compressed_feed_file_framed_from_parts_is_read_by_the_seeds_reader(codec):
    """The feed's files are compressed as segments are (`landing.codec`, zstandard by default): the
    executors compress their parts' blocks, the driver frames them after a header of the same codec.
    A reader with the seed's reader schema (fastavro, nothing of Tidemark's) reads every update."""
    import os

    from tidemark.consolidate import avro_columns as AC
    from tidemark.consolidate.cdc_file import cdc_schema

    schema = pa.schema([pa.field("id", pa.int64()), pa.field("price", pa.int32())])
    n = 5000
    rows = pa.table({"id": list(range(n)), "price": [1999] * n}, schema=schema)
    datums = encode_updates(schema, rows, pa.array([7] * n), pa.array([1] * n))
    parsed = fastavro.parse_schema(cdc_schema("public.t", schema))
    sync = os.urandom(16)
    parts = [b"".join(AC.blocks(datums[i::3], sync, codec=codec, block_bytes=4096)) for i in range(3)]
    data = b"".join([AC.header(parsed, metadata={"tidemark.table": "public.t"}, sync=sync, codec=codec), *parts])
    assert fastavro.reader(io.BytesIO(data)).codec == codec
    resolved = list(fastavro.reader(io.BytesIO(data), reader_schema=SEED_READER))
    assert sorted(u["data"]["id"] for d in resolved for u in d) == list(range(n))
    plain = b"".join([AC.header(parsed, sync=sync), *(b"".join(AC.blocks(datums, sync)) for _ in [0])])
    if codec != "null":
        assert len(data) * 4 < len(plain)       # repetitive updates compress (the feed cost 44x its segments)
    whole = cdc_bytes("public.t", schema, rows, [7] * n, [1] * n, 1, 9, codec=codec)
    assert fastavro.reader(io.BytesIO(whole)).codec == codec
    assert sum(len(d) for d in fastavro.reader(io.BytesIO(whole), reader_schema=SEED_READER)
               if isinstance(d, list)) == n


def _file(fields, records) -> bytes:
    return feed_file(seed_schema(fields), records)


def test_feed_files_are_checked_and_errors_name_the_file():
    good = _file([{"name": "id", "type": "long"}], [[{"data": {"id": 1}, "time": 2, "diff": 1}],
                                                     ("com.materialize.cdc.progress",
                                                      {"lower": [0], "upper": [5], "counts": [{"time": 2, "count": 1}]})])
    columns, updates, progress = parse_feed_file(good, "k/good.avro")
    assert columns == [("id", "long")] and len(updates) == 1
    assert progress == [{"lower": 0, "upper": 5, "counts": {"2": 1}}]
    assert [c.name for c in table_shape("shop.items", columns).columns] == ["id"]
    assert table_shape("shop.items", columns).replica_identity == "f"
    with pytest.raises(FeedError, match=r"k/bad.avro: not a readable Avro file"):
        parse_feed_file(b"garbage", "k/bad.avro")
    dated = _file([{"name": "d", "type": {"type": "int", "logicalType": "date"}}], [])
    with pytest.raises(FeedError, match=r"k/d.avro: column d has type"):
        parse_feed_file(dated, "k/d.avro")
    outside = _file([{"name": "id", "type": "long"}], [("com.materialize.cdc.progress",
                                                        {"lower": [0], "upper": [5], "counts": [{"time": 7, "count": 1}]})])
    with pytest.raises(FeedError, match=r"counts time 7 outside it"):
        parse_feed_file(outside, "k/o.avro")
    segment = SegmentBuilder("s", 0, 0).build(10)          # Tidemark's internal segment is not a feed file
    with pytest.raises(FeedError, match="k/seg.avro: an update must have exactly the fields data"):
        parse_feed_file(segment, "k/seg.avro")
