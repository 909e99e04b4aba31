"""A backlog larger than ``consolidate.max_batch_bytes`` is consolidated slice by slice: each slice
commits and advances the frontier (the lake equals the source at every frontier), a kill between
slices resumes from the last one, and the changelog feed's files tile the whole range with no file
visible before its Delta commit."""

from __future__ import annotations

import random
from collections import Counter

import pytest

import tidemark.consolidate.prepare as prepare_mod
from tidemark.consolidate.decoded import Decoded
import tidemark.consolidate.feed_files as feed_files_mod
from consolidate_kit import Lander, rows_counter, shape, up
from tidemark.consolidate import consolidate_stream
from tidemark.consolidate.cdc_file import read_cdc_all
from tidemark.control import Control
from tidemark.lake import read_changelog, read_table
from tidemark.lake.delta import LakeError
from tidemark.landing.store import stream_keys

pytestmark = [pytest.mark.spark, pytest.mark.slow]

K = shape("k", [("id", "int32", True), ("v", "text"), ("n", "int64")], oid=11)
M = shape("m", [("a", "int32"), ("b", "text")], oid=12, replica_identity="f")


class Source:
    """The source as the test's own model: each table's rows, changed by random transactions."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.k: dict[int, tuple] = {}
        self.m: Counter = Counter()

    def txn(self, t: int) -> tuple[list, list]:
        ups, pos = [], 0
        for _ in range(self.rng.randint(1, 6)):
            op = self.rng.random()
            key = self.rng.randint(1, 40)
            if op < 0.5 or key not in self.k:
                row = {"id": key, "v": f"v{self.rng.randint(0, 9)}" * self.rng.randint(1, 30),
                       "n": self.rng.randint(-5, 5)}
                if key in self.k:
                    ups.append(up(K, {"id": key}, t, -1, pos, image="key"))
                    pos += 1
                ups.append(up(K, row, t, 1, pos))
                pos += 1
                self.k[key] = (key, row["v"], row["n"])
            elif op < 0.7:
                ups.append(up(K, {"id": key}, t, -1, pos, image="key"))
                pos += 1
                del self.k[key]
            else:
                row = {"a": self.rng.randint(0, 3), "b": self.rng.choice(["x", "y"])}
                ups.append(up(M, row, t, 1, pos))
                pos += 1
                self.m[(row["a"], row["b"])] += 1
        return ups, []


def _stream(make_stream, control: Control, max_batch_bytes: int):
    cfg = make_stream(["public.k", "public.m"], consolidate={"buckets": 4, "max_batch_bytes": max_batch_bytes})
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=100, landed_upper=100)
    return cfg


def _land_backlog(lander: Lander, src: Source, segments: int) -> dict[int, tuple[dict, Counter]]:
    """Land ``segments`` segments of random transactions; return the model's state at each upper."""
    at, lower = {}, 100
    for _ in range(segments):
        upper = lower + 100
        txns = [src.txn(t) for t in range(lower + 1, upper, 20)]
        lander.land(lower, upper, txns)
        at[upper] = (dict(src.k), Counter(src.m))
        lower = upper
    return at


def _lake(cfg, table: str) -> Counter:
    try:
        return rows_counter(read_table(cfg, table))
    except LakeError:       # no change of the table landed yet
        return Counter()


def _check(cfg, state) -> None:
    k, m = state
    assert _lake(cfg, "public.k") == Counter(k.values())
    assert _lake(cfg, "public.m") == m


def _feed(cfg, store, table: str, frontier: int) -> Counter:
    """The table's changelog feed files read in order: they tile [start, frontier) (the stream
    starts at 100 with an empty lake, no snapshot); their integral."""
    prefix = f"{stream_keys(cfg.stream)['changelog']}{table}/"
    covered, acc = 100, Counter()
    for key in sorted(k for k in store.list(prefix) if k.endswith(".avro")):
        ups, progress = read_cdc_all(store.get(key))
        for p in progress:
            assert p["lower"] == [covered], key
            covered = p["upper"][0]
        for u in ups:
            acc[tuple(u["data"].values())] += u["diff"]
    assert covered == frontier
    return +acc


def test_a_backlog_over_max_batch_bytes_is_consolidated_in_slices(spark, make_stream, control, monkeypatch):
    cfg = _stream(make_stream, control, max_batch_bytes=1024)    # every segment is a slice of its own
    lander = Lander(cfg, control)
    src = Source(7)
    at = _land_backlog(lander, src, 5)
    assert all(s.byte_size > 1024 for s in control.segments(cfg.stream))
    seen = []
    real_advance = Control.advance_frontier

    def advance(self, stream, frontier, **kw):
        _check(cfg, at[frontier])       # the tables are committed: the lake equals the source here
        seen.append(frontier)
        return real_advance(self, stream, frontier, **kw)

    monkeypatch.setattr(Control, "advance_frontier", advance)
    res = consolidate_stream(cfg, spark=spark)
    assert res.slices == 5 and seen == [200, 300, 400, 500, 600]
    assert res.frontier_before is None and res.frontier_after == 600
    assert res.segments == [0, 1, 2, 3, 4]
    _check(cfg, at[600])
    # the changelog, as Delta rows and as the feed's files, integrates to the lake
    log = Counter()
    for r in read_changelog(cfg, "public.k").to_pylist():
        log[(r["id"], r["v"], r["n"])] += r["_diff"]
    assert +log == Counter(src.k.values())
    assert _feed(cfg, lander.store, "public.k", 600) == Counter(src.k.values())
    assert _feed(cfg, lander.store, "public.m", 600) == src.m
    # nothing left behind: no parts, no pending files, no decoded parts
    assert not [k for k in lander.store.list(stream_keys(cfg.stream)["changelog"]) if not k.endswith(".avro")]
    assert not list(lander.store.list(stream_keys(cfg.stream)["decoded"]))


def test_a_kill_between_slices_resumes_at_the_last_frontier(spark, make_stream, control, monkeypatch):
    cfg = _stream(make_stream, control, max_batch_bytes=1024)
    lander = Lander(cfg, control)
    src = Source(11)
    at = _land_backlog(lander, src, 4)
    real = prepare_mod.prepare_tables
    calls = []

    def killed_in_third(dec, *args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed in the third slice")
        return real(dec, *args, **kw)

    monkeypatch.setattr(prepare_mod, "prepare_tables", killed_in_third)
    close = Decoded.close
    monkeypatch.setattr(Decoded, "close", lambda self: None)     # killed: nothing of it cleans up
    with pytest.raises(KeyboardInterrupt):
        consolidate_stream(cfg, spark=spark)
    assert control.stream(cfg.stream).frontier == 300
    _check(cfg, at[300])
    decoded = stream_keys(cfg.stream)["decoded"]
    left = list(lander.store.list(decoded))
    assert left                                  # the killed slice's decoded parts
    monkeypatch.setattr(prepare_mod, "prepare_tables", real)
    monkeypatch.setattr(Decoded, "close", close)
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_before == 300 and res.frontier_after == 500 and res.slices == 2
    _check(cfg, at[500])
    assert not list(lander.store.list(decoded))  # the next run deleted them, and its own
    assert _feed(cfg, lander.store, "public.k", 500) == Counter(src.k.values())


def test_a_changelog_file_is_visible_only_after_its_commit(spark, make_stream, control, monkeypatch):
    """Killed between the changelog's Delta commit and the file's publication: no feed file of the
    range is visible; the next run publishes it (and the range is not committed twice)."""
    cfg = _stream(make_stream, control, max_batch_bytes=1 << 20)
    lander = Lander(cfg, control)
    src = Source(3)
    at = _land_backlog(lander, src, 2)
    prefix = f"{stream_keys(cfg.stream)['changelog']}public.k/"
    real = feed_files_mod.publish

    def killed(store, pending, key):
        if "public.k" in key:
            assert not store.exists(key) and store.exists(pending)
            raise KeyboardInterrupt("killed before publishing the changelog file")
        return real(store, pending, key)

    monkeypatch.setattr(feed_files_mod, "publish", killed)
    with pytest.raises(KeyboardInterrupt):
        consolidate_stream(cfg, spark=spark)
    assert not [k for k in lander.store.list(prefix) if k.endswith(".avro")]
    monkeypatch.setattr(feed_files_mod, "publish", real)
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_after == 300
    _check(cfg, at[300])
    assert _feed(cfg, lander.store, "public.k", 300) == Counter(src.k.values())
    assert [k for k in lander.store.list(prefix)] == [k for k in lander.store.list(prefix) if k.endswith(".avro")]


def test_one_huge_transaction_is_decoded_in_pieces_and_committed_whole(spark, make_stream, control):
    """A segment of one transaction far over ``max_batch_records`` (one slice: a transaction is one
    lake commit) is decoded in pieces of about that many updates (issue 34, point 5) inside the Spark
    workers: the lake equals the model, with key changes that leave a TOASTed value unchanged (their
    -1 and +1 in one piece) and updates of a table without a key among the pieces."""
    cfg = make_stream(["public.k", "public.m"], consolidate={"buckets": 4, "max_batch_records": 500})
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=100, landed_upper=100)
    lander = Lander(cfg, control)
    first, pos = [], 0
    for key in range(1, 20_001):
        first.append(up(K, {"id": key, "v": f"toasted {key} " + "w" * (key % 90), "n": key}, 110, 1, pos))
        first.append(up(M, {"a": key % 5, "b": "x" if key % 3 else "y"}, 110, 1, pos + 1))
        pos += 2
    lander.land(100, 120, [(first, [])])
    ups, pos = [], 0
    k = {key: (key, f"toasted {key} " + "w" * (key % 90), key) for key in range(1, 20_001)}
    m = Counter({(a, b): 0 for a in range(5) for b in "xy"})
    for key in range(1, 20_001):
        m[(key % 5, "x" if key % 3 else "y")] += 1
    for key in range(1, 20_001):
        if key % 4 == 0:            # the key changes, the TOASTed v is not sent: taken from its own -1
            ups.append(up(K, {"id": key}, 130, -1, pos, image="key"))
            ups.append(up(K, {"id": key + 100_000, "v": None, "n": -key}, 130, 1, pos + 1, toast=("v",)))
            k[key + 100_000] = (key + 100_000, k.pop(key)[1], -key)
            pos += 2
        elif key % 4 == 1:
            ups.append(up(K, {"id": key}, 130, -1, pos, image="key"))
            pos += 1
            del k[key]
        elif key % 4 == 2:          # a keyless row changed: its whole old row, then the new one
            old = (key % 5, "x" if key % 3 else "y")
            ups.append(up(M, {"a": old[0], "b": old[1]}, 130, -1, pos))
            ups.append(up(M, {"a": 9, "b": old[1]}, 130, 1, pos + 1))
            m[old] -= 1
            m[(9, old[1])] += 1
            pos += 2
    lander.land(120, 140, [(ups, [])])
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_after == 140
    assert _lake(cfg, "public.k") == Counter(k.values())
    assert _lake(cfg, "public.m") == +m


def test_a_huge_transactions_merge_groups_are_merged_in_key_ranges(spark, make_stream, control):
    """One transaction whose merge groups hold far more records than ``max_batch_records`` (issue 34,
    point 5): each group is merged key range by key range (`merge.merge_group_by_ranges`; its files
    are named by range), in one lake commit: inserts around and beyond the lake's keys, updates
    that leave a TOASTed value unchanged, deletes, key changes; the lake and the changelog feed
    equal the model."""
    from deltalake import DeltaTable

    from tidemark.lake import storage_options, table_uri

    cfg = make_stream(["public.k"], consolidate={"buckets": 2, "max_batch_records": 500})
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=100, landed_upper=100)
    lander = Lander(cfg, control)
    k = {key: (key, f"toasted {key} " + "w" * (key % 90), key) for key in range(1, 3001)}
    lander.land(100, 120, [([up(K, {"id": key, "v": v, "n": n}, 110, 1, pos)
                             for pos, (key, v, n) in enumerate(k.values())], [])])
    assert consolidate_stream(cfg, spark=spark).frontier_after == 120
    ups, pos = [], 0
    for key in range(1, 3001):
        if key % 5 == 0:            # an update that leaves the TOASTed v unchanged
            ups.append(up(K, {"id": key}, 130, -1, pos, image="key"))
            ups.append(up(K, {"id": key, "v": None, "n": -key}, 130, 1, pos + 1, toast=("v",)))
            k[key] = (key, k[key][1], -key)
            pos += 2
        elif key % 5 == 1:
            ups.append(up(K, {"id": key}, 130, -1, pos, image="key"))
            del k[key]
            pos += 1
        elif key % 5 == 2:          # the key changes (the whole new row sent)
            ups.append(up(K, {"id": key}, 130, -1, pos, image="key"))
            ups.append(up(K, {"id": key + 50_000, "v": f"moved {key}", "n": 0}, 130, 1, pos + 1))
            del k[key]
            k[key + 50_000] = (key + 50_000, f"moved {key}", 0)
            pos += 2
    for key in range(3001, 9001):   # new keys beyond the lake's
        ups.append(up(K, {"id": key, "v": f"new {key}", "n": 1}, 130, 1, pos))
        k[key] = (key, f"new {key}", 1)
        pos += 1
    lander.land(120, 140, [(ups, [])])
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_after == 140
    assert _lake(cfg, "public.k") == Counter(k.values())
    assert _feed(cfg, lander.store, "public.k", 140) == Counter(k.values())
    import pyarrow as pa

    dt = DeltaTable(table_uri(cfg, "public.k"), storage_options=storage_options(cfg))
    files = pa.table(dt.get_add_actions(flatten=True)).column("path").to_pylist()
    assert any("-r1-" in f for f in files) and any("-r2-" in f for f in files), files
