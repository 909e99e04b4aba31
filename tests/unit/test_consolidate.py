"""Unit tests of consolidation's pure pieces: planning, decoding, the DataFrame transforms (local
SparkSession), the per-bucket rewrite and the changelog format."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidemark.consolidate import plan as P
from tidemark.consolidate.cdc_file import cdc_bytes, read_cdc
from tidemark.consolidate.decode import decode_segment
from tidemark.consolidate.identities import content_hashes, identities, identity_rows, with_content_hashes
from tidemark.consolidate.key_lookup import key_lookup, key_match
from tidemark.consolidate.preconsolidate import cancel_zero
from tidemark.consolidate.recut import conform_payload
from tidemark.consolidate.work_area import Work, decoded_arrow_schema, meta_arrow_fields, put_parts, read_parts
from tidemark.control import Segment
from tidemark.errors import UnstorableValue
from tidemark.lake import layout
from tidemark.pgtypes import Column, TableSchema, arrow_schema
from tidemark.landing.segments import SegmentBuilder, Update

T = TableSchema("public", "t", 1, (Column("id", "int64", "int8", 20, key=True), Column("v", "text", "text", 25),
                                   Column("big", "text", "text", 25)))


def seg(seq, lower, upper):
    return Segment("s", seq, lower, upper, f"file:///x/{seq}", 0, 0, 0, "")


def test_coverage_tiles_duplicates_and_stops_at_a_hole():
    segs = [seg(0, 0, 10), seg(1, 10, 20), seg(2, 10, 20), seg(3, 30, 40), seg(4, 5, 15)]
    cov = P.coverage(segs, 10)
    assert [s.seq for s in cov.segments] == [4, 1, 2]
    assert cov.end == 20 and cov.hole == (20, 30)
    assert P.new_frontier(cov, [P.Unmet(time=17, expected=2, seen=1)]) == 17
    assert P.new_frontier(cov, []) == 20
    assert P.coverage([], 10).end == 10


def _segment_bytes(updates, lower=0, upper=100, extra=None):
    b = SegmentBuilder("s", 0, lower)
    b.add_transaction(updates)
    for t, n in (extra or {}).items():
        b.counts[t] += n
    return b.build(upper)


def u(row, time, diff, pos, **kw):
    return Update(T, row, time, diff, time, pos, 0, **kw)


def test_decode_segment_gives_records_counts_and_typed_payloads():
    data = _segment_bytes([u({"id": 1}, 5, -1, 0, image="key"), u({"id": 1, "v": "a", "big": None}, 5, 1, 1,
                                                                      unchanged_toast=("big",))])
    out = decode_segment("file:///l/seg.avro", data)
    kinds = out["kind"]
    assert kinds.count("ids") == 1 and kinds.count("cnt") == 1 and kinds.count("data") == 1
    ids = identity_rows(pa.Table.from_pydict(out, schema=decoded_arrow_schema()))
    recs = ids.filter(pc.equal(ids.column("kind"), "rec"))
    assert recs.column("seg").to_pylist() == ["seg.avro"] * 2 and recs.column("position").to_pylist() == [0, 1]
    assert recs.column("table").to_pylist() == ["public.t"] * 2 and set(recs.column("time").to_pylist()) == {5}
    assert recs.column("rhash").null_count == 2           # hashed only if the identity occurs again
    assert ids.filter(pc.equal(ids.column("kind"), "cnt")).column("count").to_pylist() == [2]
    payload = out["payload"][kinds.index("data")]
    full = pa.schema(meta_arrow_fields() + list(arrow_schema(T)))
    rows = conform_payload(pa.ipc.open_stream(payload).read_all(), full, "public.t")
    assert rows.column("_tm_unknown").to_pylist() == [["v", "big"], ["big"]]
    assert rows.column("id").to_pylist() == [1, 1] and rows.schema == full


def test_numeric_nan_in_a_declared_numeric_names_table_and_column():
    num = TableSchema("public", "m", 2, (Column("id", "int64", "int8", 20, key=True),
                                         Column("price", "numeric", "numeric", 1700, typmod=(10 << 16 | 2) + 4)))
    b = SegmentBuilder("s", 0, 0)
    b.add_transaction([Update(num, {"id": 1, "price": "NaN"}, 5, 1, 5, 0, 0)])
    out = decode_segment("file:///l/seg.avro", b.build(10))
    bad = [(t, json.loads(i)) for k, t, i in zip(out["kind"], out["time"], out["info"]) if k == "bad"]
    assert len(bad) == 1 and bad[0][0] == 5, out["kind"]     # the driver stops with it unless a resend supersedes it
    facts = bad[0][1]
    assert (facts["table"], facts["column"], facts["value"], facts["lsn"], facts["segment"]) == \
        ("public.m", "price", "NaN", "0/5", "seg.avro") and "numeric(10,2)" in facts["why"], facts
    with pytest.raises(UnstorableValue, match=r"public\.m column price: value 'NaN' at LSN 0/5"):
        raise UnstorableValue("seg.avro", facts)
    assert UnstorableValue.find("PythonException: ... " + str(UnstorableValue("seg.avro", facts)) + "\n  at x") == \
        dict(facts, segment="seg.avro")


def spark_completeness(decoded, start: int, end: int, *, limit: int = 100) -> list:
    """The oracle of `plan.completeness_rows`: the same checks over a Spark DataFrame of the decoded
    rows, in Spark SQL (earliest first).

    Raises `CompletenessError` when two different records share a ``(time, position)``, when
    segments give different counts for one time, or when there are more distinct records than
    counted."""
    from pyspark.sql import functions as F

    window = (F.col("time") >= start) & (F.col("time") < end)
    recs = decoded.filter((F.col("kind") == "rec") & window)
    per_id = recs.groupBy("time", "position").agg(F.countDistinct("rhash").alias("n"),
                                                   F.collect_set("seg").alias("segs"))
    seen = per_id.groupBy("time").agg(F.count(F.lit(1)).alias("seen"), F.max("n").alias("n"),
                                      F.min(F.when(F.col("n") > 1, F.col("position"))).alias("conflict_pos"),
                                      F.flatten(F.collect_set(F.when(F.col("n") > 1, F.col("segs")))).alias("csegs"))
    expected = (decoded.filter((F.col("kind") == "cnt") & window).groupBy("time")
                .agg(F.min("count").alias("lo"), F.max("count").alias("hi"), F.collect_set("seg").alias("segs")))
    seen_n = F.coalesce(F.col("seen"), F.lit(0))
    problems = (expected.join(seen, on="time", how="full_outer")
                .filter((F.col("n") > 1) | (F.col("lo") != F.col("hi")) | (seen_n > F.coalesce(F.col("hi"), F.lit(0)))
                        | (seen_n < F.col("lo")))
                .orderBy("time").limit(limit).collect())
    unmet: list = []
    for r in problems:
        if (r["n"] or 0) > 1:
            raise P.CompletenessError(f"different records share the identity (time {r['time']}, position "
                                    f"{r['conflict_pos']}) in segments {sorted(set(r['csegs']))}; bad input, "
                                    "not a duplicate")
        if r["lo"] != r["hi"] or (r["seen"] or 0) > (r["hi"] or 0):
            raise P.CompletenessError(f"time {r['time']}: segments {sorted(r['segs'] or [])} give counts "
                                    f"{r['lo']}..{r['hi']} but {r['seen']} distinct records were found")
        unmet.append(P.Unmet(time=r["time"], expected=r["lo"], seen=r["seen"] or 0))
    return unmet


def test_completeness_unmet_conflict_and_disagreeing_counts(spark):
    def decoded(rows):
        from tidemark.consolidate.work_area import DECODED_DDL

        full = [dict(dict.fromkeys(["kind", "seg", "table", "time", "position", "rhash", "count", "payload", "info"]),
                     **r) for r in rows]
        return spark.createDataFrame(full, DECODED_DDL)

    ok = decoded([{"kind": "cnt", "seg": "a", "time": 5, "count": 2}, {"kind": "rec", "seg": "a", "time": 5, "position": 0, "rhash": 1},
                  {"kind": "rec", "seg": "b", "time": 5, "position": 0, "rhash": 1},     # a duplicate
                  {"kind": "cnt", "seg": "a", "time": 7, "count": 1}, {"kind": "rec", "seg": "a", "time": 7, "position": 0, "rhash": 2}])
    assert spark_completeness(ok, 0, 10) == [P.Unmet(time=5, expected=2, seen=1)]
    conflict = decoded([{"kind": "cnt", "seg": "a", "time": 5, "count": 1}, {"kind": "rec", "seg": "a", "time": 5, "position": 0, "rhash": 1},
                        {"kind": "rec", "seg": "b", "time": 5, "position": 0, "rhash": 9}])
    with pytest.raises(P.CompletenessError, match=r"\(time 5, position 0\)"):
        spark_completeness(conflict, 0, 10)
    disagree = decoded([{"kind": "cnt", "seg": "a", "time": 5, "count": 1}, {"kind": "cnt", "seg": "b", "time": 5, "count": 2},
                        {"kind": "rec", "seg": "a", "time": 5, "position": 0, "rhash": 1}])
    with pytest.raises(P.CompletenessError, match="time 5"):
        spark_completeness(disagree, 0, 10)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), keyed=st.booleans(), n=st.integers(1, 40), buckets=st.integers(1, 5))
def test_a_tables_updates_cut_by_bucket_while_decoding_are_its_updates_each_in_its_bucket(data, keyed, n, buckets):
    """A table given a number of buckets: one ``data`` row per bucket present, each holding exactly
    the updates Spark's bucket (`sparkhash`) of the shape's key (every column of a table without one)
    puts there, together the table's updates, with their own newest time, count and TOAST count; a
    table given none is not cut."""
    import dataclasses
    import json
    from collections import Counter

    from tidemark.consolidate import sparkhash

    shape = T if keyed else dataclasses.replace(T, replica_identity="f")

    ups, t = [], 10
    for pos in range(n):
        t += data.draw(st.integers(0, 2))
        row = {"id": data.draw(st.integers(-3, 12)), "v": data.draw(st.one_of(st.none(), st.text("ab", max_size=2))),
               "big": "x"}
        toast = ("big",) if data.draw(st.booleans()) else ()
        ups.append(Update(shape, row, t, data.draw(st.sampled_from([1, -1])) if not toast else 1, t, pos, 0,
                          unchanged_toast=toast))
    seg_bytes = _segment_bytes(ups, upper=t + 1)
    hashed = ("id",) if keyed else ("id", "v", "big")
    whole = decode_segment("file:///l/s.avro", seg_bytes)
    cut = decode_segment("file:///l/s.avro", seg_bytes, {"public.t": buckets})

    def data_rows(out):
        return [dict(zip(out, vals)) for vals in zip(*out.values()) if vals[0] == "data"]

    (one,) = data_rows(whole)
    parts = data_rows(cut)
    assert one["bucket"] is None and [r["bucket"] for r in parts] == sorted({r["bucket"] for r in parts})
    everything = pa.ipc.open_stream(one["payload"]).read_all()
    got = Counter()
    for r in parts:
        part = pa.ipc.open_stream(r["payload"]).read_all()
        assert set(sparkhash.buckets(part, list(hashed), buckets).tolist()) == {r["bucket"]}
        assert r["time"] == max(part.column("_tm_time").to_pylist()) and r["position"] == part.num_rows
        assert r["count"] == sum(1 for d, un in zip(part.column("_tm_diff").to_pylist(),
                                                    part.column("_tm_unknown").to_pylist()) if d > 0 and un)
        assert r["info"] == one["info"] and part.schema == everything.schema
        got.update(json.dumps(x, sort_keys=True, default=str) for x in part.to_pylist())
    assert got == Counter(json.dumps(x, sort_keys=True, default=str) for x in everything.to_pylist())
    assert sum(r["count"] for r in parts) == one["count"]
    assert [r["bucket"] for r in data_rows(decode_segment("file:///l/s.avro", seg_bytes, {"public.other": buckets}))] \
        == [None]


values = st.one_of(st.none(), st.text(max_size=3))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_identities_seen_twice_are_hashed_and_different_records_under_one_are_caught(data):
    """Segments overlap (a transaction landed again, maybe altered in one value or TOAST flag, maybe
    twice within one segment's overlap): only then are records hashed, and the completeness check
    passes exactly when every identity's records are equal."""
    n = data.draw(st.integers(1, 5))
    rows = [{"id": i, "v": data.draw(values), "big": data.draw(values)} for i in range(n)]

    def txn(time, rows, toast=()):
        return [u(r, time, 1, pos, unchanged_toast=("big",) if pos in toast else ()) for pos, r in enumerate(rows)]

    segs = {"a.avro": _segment_bytes(txn(5, rows))}
    again = data.draw(st.sampled_from(["none", "same", "value", "toast"]))
    altered = False
    if again != "none":
        other = [dict(r) for r in rows]
        toast = ()
        if again == "value":
            i = data.draw(st.integers(0, n - 1))
            other[i]["v"] = data.draw(values)
            altered = other[i]["v"] != rows[i]["v"]
        elif again == "toast":
            toast = (data.draw(st.integers(0, n - 1)),)
            altered = True
        later = data.draw(st.booleans())
        segs["b.avro"] = _segment_bytes(txn(5, other, toast) + (txn(7, rows[:1]) if later else []))
    import tempfile

    from tidemark.landing.store import open_store

    area = tempfile.TemporaryDirectory()
    work = Work((area.name, None, None), "w-")
    decoded = {name: decode_segment(f"file:///l/{name}", b) for name, b in segs.items()}
    for name, d in decoded.items():          # the parts in the work area, as the decoding leaves them
        put_parts(open_store(area.name), work.key(name), d)
    small = pa.concat_tables([pa.Table.from_pydict(d, schema=decoded_arrow_schema()) for d in decoded.values()])
    calls = []

    def rehash(wanted, names):
        calls.append(sorted(names))
        data = small.filter(pc.and_(pc.equal(small.column("kind"), "data"), pc.is_in(small.column("seg"),
                                                                                     value_set=pa.array(names))))
        return pa.Table.from_batches(list(content_hashes(data.select(["seg", "table", "offset", "size"]).to_batches(),
                                                         wanted, work)))

    # the identities are in the work area: read back where segments overlap, tallied elsewhere
    found = identities(small, lambda parts: read_parts(open_store(area.name), work, parts))
    ids = with_content_hashes(found.rows, rehash)
    area.cleanup()
    assert calls == ([] if again == "none" else [["a.avro", "b.avro"]])
    recs = ids.filter(pc.equal(ids.column("kind"), "rec"))
    counted = sum(found.counted.column("seen").to_pylist())
    assert recs.num_rows + counted == n * len(segs) + (1 if again != "none" and later else 0)   # every record, once
    assert counted == (n if again == "none" else (1 if later else 0))
    if altered:
        with pytest.raises(P.CompletenessError, match=r"different records share the identity \(time 5, position"):
            P.completeness_rows(ids, 0, 10, counted=found.counted)
    else:
        assert P.completeness_rows(ids, 0, 10, counted=found.counted) == []


def _plan(tmp_path, files=None, target=4):
    return layout.BucketPlan(uri=str(tmp_path), options=None, schema=arrow_schema(T), keys=["id"],
                             sort=["id"], files=files or {}, target_rows=target, tag="T")


def test_cdc_file_is_pre_consolidated_and_ends_with_progress():
    schema = arrow_schema(T)
    rows = pa.Table.from_pylist([{"id": 5, "v": "10", "big": None}, {"id": 5, "v": "12", "big": None}], schema=schema)
    data = cdc_bytes("public.t", schema, rows, [5, 4], [1, 1], 3, 10)
    updates, progress = read_cdc(data)
    assert [(u["data"]["id"], u["time"], u["diff"]) for u in updates] == [(5, 4, 1), (5, 5, 1)]   # by time
    assert progress == {"lower": [3], "upper": [10], "counts": [{"time": 4, "count": 1}, {"time": 5, "count": 1}]}
    log = rows.append_column("_time", pa.array([4, 4])).append_column("_diff", pa.array([1, -1]))
    log = log.append_column("_commit_ts", pa.array([0, 0], pa.timestamp("us", tz="UTC")))
    same = pa.concat_tables([log.slice(0, 1), log.slice(0, 1).set_column(4, "_diff", pa.array([-1]))])
    assert cancel_zero(same).num_rows == 0


def test_completeness_on_the_driver_agrees_with_spark(spark):
    """`completeness_rows` (collected rows, no shuffle) gives the same unmet times and errors."""
    from tidemark.consolidate.work_area import DECODED_DDL

    def both(rows, start=0, end=10):
        full = [dict(dict.fromkeys(["kind", "seg", "table", "time", "position", "rhash", "count", "payload", "info"]),
                     **r) for r in rows]
        df = spark.createDataFrame(full, DECODED_DDL)
        out = []
        for fn, arg in ((spark_completeness, df), (P.completeness_rows, df.toArrow())):
            try:
                out.append(fn(arg, start, end))
            except P.CompletenessError as exc:
                out.append(str(exc))
        assert out[0] == out[1]
        return out[0]

    cnt = lambda seg, t, c: {"kind": "cnt", "seg": seg, "time": t, "count": c}        # noqa: E731
    rec = lambda seg, t, p, h: {"kind": "rec", "seg": seg, "time": t, "position": p, "rhash": h}  # noqa: E731
    assert both([cnt("a", 5, 2), rec("a", 5, 0, 1), rec("b", 5, 0, 1), cnt("a", 7, 1), rec("a", 7, 0, 2)]) == \
        [P.Unmet(time=5, expected=2, seen=1)]
    assert both([cnt("a", 5, 2), rec("a", 5, 0, 1), rec("a", 5, 1, 1), cnt("b", 5, 2), rec("b", 5, 1, 1),
                 cnt("a", 12, 3)]) == []                                           # 12 is outside the window
    assert "position 1" in both([cnt("a", 5, 2), rec("a", 5, 0, 1), rec("a", 5, 1, 1), rec("b", 5, 1, 2)])
    assert "counts 1..2" in both([cnt("a", 5, 1), cnt("b", 5, 2), rec("a", 5, 0, 1)])
    assert "counts None..None" in both([rec("a", 6, 0, 1)])                        # records nobody counted
    assert both([cnt("a", 3, 1), cnt("a", 4, 2), rec("a", 4, 0, 1)]) == [P.Unmet(3, 1, 0), P.Unmet(4, 2, 1)]


@settings(max_examples=25, deadline=None)
@given(recs=st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 12), st.integers(0, 3),
                               st.one_of(st.none(), st.integers(0, 2))), max_size=12),
       cnts=st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 12), st.integers(0, 4)), max_size=6))
def test_completeness_on_the_driver_agrees_with_spark_on_generated_rows(spark, recs, cnts):
    """`completeness_rows` (grouped in Arrow) and `completeness` (Spark): the same unmet times and
    the same errors on any mix of records (null hashes too), counts, duplicates and conflicts."""
    from tidemark.consolidate.work_area import DECODED_DDL

    rows = ([{"kind": "rec", "seg": g, "time": t, "position": p, "rhash": h} for g, t, p, h in recs]
            + [{"kind": "cnt", "seg": g, "time": t, "count": c} for g, t, c in cnts])
    full = [dict(dict.fromkeys(["kind", "seg", "table", "time", "position", "rhash", "count", "payload", "info"]),
                 **r) for r in rows]
    df = spark.createDataFrame(full, DECODED_DDL)
    out = []
    for fn, arg in ((spark_completeness, df), (P.completeness_rows, df.toArrow())):
        try:
            out.append(fn(arg, 0, 10))
        except P.CompletenessError as exc:
            out.append(str(exc))
    assert out[0] == out[1]


@settings(max_examples=50, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["int", "sorted", "str", "pair"]))
def test_key_lookup_agrees_with_the_join(data, kind):
    """`key_lookup` (a hash lookup for one-column keys, on the side with fewer rows; a binary
    search in integers sorted as a file's rows are) gives what the left outer join gives."""
    import numpy as np

    key = {"int": st.integers(-5, 30), "sorted": st.integers(-5, 30), "str": st.text("ab", max_size=3),
           "pair": st.tuples(st.integers(0, 4), st.text("ab", max_size=2))}[kind]
    right_keys = data.draw(st.lists(key, max_size=40, unique=True))
    if kind == "sorted":
        right_keys.sort()
    left_keys = data.draw(st.lists(key, max_size=20))      # also far fewer than the right (its hash side)

    def table(keys):
        if kind == "pair":
            return pa.table({"a": pa.array([k[0] for k in keys], pa.int64()), "b": pa.array([k[1] for k in keys], pa.string())})
        return pa.table({"a": pa.array(keys, pa.string() if kind == "str" else pa.int64())})

    cols = ["a", "b"] if kind == "pair" else ["a"]
    left, right = table(left_keys), table(right_keys)
    got = key_lookup(left, right, cols)
    assert got.tolist() == [right_keys.index(k) if k in right_keys else -1 for k in left_keys]
    if left.num_rows and right.num_rows:
        assert np.array_equal(got, key_match(left, right, cols)[1])


@settings(max_examples=60, deadline=None)
@given(runs=st.lists(st.lists(st.integers(-3, 8), max_size=12), min_size=1, max_size=3),
       kind=st.sampled_from(["int", "int", "str"]), null=st.booleans())
def test_rows_sorted_by_one_integer_column_as_arrow_sorts_them(runs, kind, null):
    """`layout._sorted` (numpy's stable sort for one integer column without nulls, nothing copied when
    already in order) gives ``Table.sort_by``'s rows and order, ties and nulls included; rows come
    as a file's sorted rows and then new ones."""
    runs = [sorted(r) if i == 0 else r for i, r in enumerate(runs)]
    if null:
        runs[-1] = runs[-1] + [None]
    values = [v for r in runs for v in r]
    col = pa.array(values, pa.int64()) if kind == "int" else pa.array([None if v is None else str(v) for v in values])
    rows = pa.concat_tables([pa.table({"k": col.slice(a, len(r)), "i": pa.array(range(a, a + len(r)), pa.int64())})
                             for a, r in zip([sum(map(len, runs[:j])) for j in range(len(runs))], runs)])
    assert layout._sorted(rows, ["k"]).to_pylist() == rows.sort_by([("k", "ascending")]).to_pylist()
