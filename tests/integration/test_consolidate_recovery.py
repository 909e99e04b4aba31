"""Crash before the Delta commit, re-runs, shuffled landing order, holes and unmet counts."""

from __future__ import annotations

import io
import random
from collections import Counter
from pathlib import Path

import fastavro
import pytest

import tidemark.lake.writer as commit_mod
from consolidate_kit import Lander, rows_counter, shape, up
from tidemark.consolidate import consolidate_stream
from tidemark.consolidate.job import ConsolidateFailed
from tidemark.consolidate.cdc_file import read_cdc
from tidemark.consolidate.feed_files import changelog_key
from tidemark.lake import open_delta, read_changelog, read_table, table_uri

pytestmark = [pytest.mark.spark, pytest.mark.slow]

T = shape("t", [("k", "int32", True), ("v", "text")], oid=3)


def _stream(make_stream, control, lsn=100):
    cfg = make_stream(["public.t"], consolidate={"buckets": 2, "count_timeout_seconds": 60})
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=lsn, landed_upper=lsn)
    return cfg


def _txn(t, rows, deletes=()):
    ups, pos = [], 0
    for k in deletes:
        ups.append(up(T, {"k": k}, t, -1, pos, image="key")); pos += 1
    for k, v in rows:
        ups.append(up(T, {"k": k, "v": v}, t, 1, pos)); pos += 1
    return (ups, [])


def test_killed_before_commit_then_rerun(spark, make_stream, control, monkeypatch):
    cfg = _stream(make_stream, control)
    lander = Lander(cfg, control)
    lander.land(100, 200, [_txn(110, [(1, "a"), (2, "b")]), _txn(120, [(3, "c")])])
    consolidate_stream(cfg, spark=spark)
    lander.land(200, 300, [_txn(210, [(2, "B"), (4, "d")], deletes=[2]), _txn(220, [], deletes=[1])])

    real = commit_mod.commit_files

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed after writing files, before the Delta commit")

    monkeypatch.setattr(commit_mod, "commit_files", killed)
    with pytest.raises(KeyboardInterrupt):
        consolidate_stream(cfg, spark=spark)
    assert control.stream(cfg.stream).frontier == 200
    assert rows_counter(read_table(cfg, "public.t")) == Counter({(1, "a"): 1, (2, "b"): 1, (3, "c"): 1})
    live = {Path(u.replace("file://", "")) for u in open_delta(table_uri(cfg, "public.t")).file_uris()}
    on_disk = set(Path(table_uri(cfg, "public.t")).glob("_bucket=*/*.parquet"))
    assert on_disk == live      # the failed attempt's files were discarded
    monkeypatch.setattr(commit_mod, "commit_files", real)
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_after == 300
    assert rows_counter(read_table(cfg, "public.t")) == Counter({(2, "B"): 1, (3, "c"): 1, (4, "d"): 1})
    version = open_delta(table_uri(cfg, "public.t")).version()
    again = consolidate_stream(cfg, spark=spark)
    assert again.skipped
    assert open_delta(table_uri(cfg, "public.t")).version() == version
    # the changelog: Delta table and Materialize CDC file accumulate to the lake's rows
    log = read_changelog(cfg, "public.t").to_pylist()
    acc = Counter()
    for r in log:
        acc[(r["k"], r["v"])] += r["_diff"]
    assert +acc == rows_counter(read_table(cfg, "public.t"))
    feed_file = lander.store.get(changelog_key(cfg.stream, "public.t", 200, 300))
    assert fastavro.reader(io.BytesIO(feed_file)).codec == "zstandard"     # compressed as the segments are
    updates, progress = read_cdc(feed_file)
    assert progress["lower"] == [200] and progress["upper"] == [300]
    assert sum(c["count"] for c in progress["counts"]) == len(updates)
    assert len({(tuple(u["data"].values()), u["time"]) for u in updates}) == len(updates)
    assert all(u["diff"] != 0 for u in updates)


def test_crash_between_table_commit_and_frontier(spark, make_stream, control, monkeypatch):
    """The table already holds (stream, F): a re-run does not apply the batch twice."""
    cfg = _stream(make_stream, control)
    lander = Lander(cfg, control)
    lander.land(100, 200, [_txn(110, [(1, "a")])])
    import tidemark.control as control_mod

    real = control_mod.Control.advance_frontier

    def crash(self, *a, **k):
        raise RuntimeError("crash after the lake commit")

    monkeypatch.setattr(control_mod.Control, "advance_frontier", crash)
    with pytest.raises(ConsolidateFailed, match="crash after the lake commit"):
        consolidate_stream(cfg, spark=spark)
    monkeypatch.setattr(control_mod.Control, "advance_frontier", real)
    lander.land(200, 300, [_txn(210, [(2, "b")])])
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_after == 300
    assert rows_counter(read_table(cfg, "public.t")) == Counter({(1, "a"): 1, (2, "b"): 1})


def test_shuffled_landing_hole_and_unmet_counts(spark, make_stream, control):
    cfg = _stream(make_stream, control)
    lander = Lander(cfg, control)
    ranges = [(100, 150), (150, 200), (200, 250), (250, 300)]
    txns = {lo: [_txn(lo + 5, [(lo, f"v{lo}")])] for lo, _ in ranges}
    blobs = {lo: lander.build(lo, hi, txns[lo], seq=i) for i, (lo, hi) in enumerate(ranges)}
    order = [2, 3, 0]   # 150..200 is still missing: a hole
    rng = random.Random(3)
    rng.shuffle(order)
    for i in order:
        lo, hi = ranges[i]
        lander.next_seq = i
        lander.land(lo, hi, txns[lo], data=blobs[lo])
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_after == 150
    assert rows_counter(read_table(cfg, "public.t")) == Counter({(100, "v100"): 1})
    # the missing segment lands, but one record of time 155's transaction is missing (counts say 2)
    lander.next_seq = 1
    partial = lander.build(150, 200, txns[150], seq=1, extra_counts={155: 1})
    lander.land(150, 200, txns[150], data=partial)
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_after == 155 and res.unmet[0].time == 155 and res.incident is None
    # past the timeout it becomes an incident instead of an endless wait
    with control.tx() as cur:
        cur.execute("UPDATE tidemark.segments SET created_at = now() - interval '1 hour' WHERE stream = %s",
                    (cfg.stream,))
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_after == 155
    incidents = control.incidents(cfg.stream)
    assert [i["kind"] for i in incidents] == ["counts_unmet"] and incidents[0]["detail"]["time"] == 155
    # a re-drain of the range with the whole transaction completes it
    full = [([*txns[150][0][0], up(T, {"k": 999, "v": "late"}, 155, 1, 1)], [])]
    lander.next_seq = 4
    lander.land(150, 200, full, origin="repair")
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_after == 300
    assert rows_counter(read_table(cfg, "public.t")) == Counter(
        {(100, "v100"): 1, (150, "v150"): 1, (999, "late"): 1, (200, "v200"): 1, (250, "v250"): 1})


def test_changelog_per_interval(spark, make_stream, control):
    """The interval writer selects changes by source commit time; a re-run changes nothing."""
    import datetime as dt

    from tidemark.consolidate.interval import write_changelog
    from tidemark.lake import changelog_uri

    cfg = _stream(make_stream, control)
    lander = Lander(cfg, control)
    lander.land(100, 200, [_txn(110, [(1, "a")]), _txn(120, [(2, "b")], deletes=[])])
    consolidate_stream(cfg, spark=spark)
    base = dt.datetime(2023, 11, 14, 22, 13, 20, tzinfo=dt.timezone.utc)   # commit_ts of the kit = 1.7e15 µs + time
    start, end = base, base + dt.timedelta(microseconds=115)
    version = open_delta(changelog_uri(cfg, "public.t")).version()
    out = write_changelog(cfg, start=start, end=end, spark=spark)
    assert out["tables"] == {"public.t": 1} and out["replaced"] == []
    assert open_delta(changelog_uri(cfg, "public.t")).version() == version
    rows = read_changelog(cfg, "public.t").to_pylist()
    assert sorted((r["k"], r["_diff"], r["_time"]) for r in rows) == [(1, 1, 110), (2, 1, 120)]


def test_an_overlapping_segment_with_another_record_under_one_identity_is_refused(spark, make_stream, control):
    """Overlapping segments are hashed record by record only where identities repeat: an equal
    re-landing is harmless, a different record under a landed identity stops the batch, naming it."""
    cfg = _stream(make_stream, control)
    lander = Lander(cfg, control)
    lander.land(100, 200, [_txn(110, [(1, "a"), (2, "b")])])
    lander.land(100, 200, [_txn(110, [(1, "a"), (2, "b")])])                 # the same, landed again
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_after == 200
    assert rows_counter(read_table(cfg, "public.t")) == Counter({(1, "a"): 1, (2, "b"): 1})
    lander.land(200, 300, [_txn(210, [(3, "c")])])
    lander.land(200, 300, [_txn(210, [(3, "C")])])                           # another record at (210, 0)
    with pytest.raises(ConsolidateFailed, match=r"different records share the identity \(time 210, position 0\)"):
        consolidate_stream(cfg, spark=spark)
    assert control.stream(cfg.stream).frontier == 200
    assert rows_counter(read_table(cfg, "public.t")) == Counter({(1, "a"): 1, (2, "b"): 1})
