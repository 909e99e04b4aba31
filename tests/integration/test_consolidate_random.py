"""Randomized workloads as segments (the generator is the source): after consolidation every lake
table equals the generator's table, also with duplicated, shuffled and replayed segments."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from consolidate_kit import Lander, rows_counter, shape, snapshot, truncate, up
from tidemark.consolidate import batch as batch_path, consolidate_stream
from tidemark.lake import open_delta, read_table, table_uri
from tidemark.pgtypes import arrow_schema, lake_array

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ITEMS = shape("items", [("id", "int64", True), ("v", "text"), ("big", "text"), ("n", "numeric", False, (10 << 16 | 2) + 4),
                        ("d", "date"), ("ts", "timestamptz")], oid=1)
LOG = shape("log", [("a", "int32"), ("b", "text"), ("big", "text")], oid=2, replica_identity="f")


class Source:
    """A tiny simulated source database that emits pgoutput-like change records."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.items: dict[int, dict] = {}
        self.log: list[dict] = []
        self.next_id = 1
        self.lsn = 1000

    def _item(self, i: int) -> dict:
        r = self.rng
        return {"id": i, "v": r.choice(["a", "b", None, "ü"]), "big": "x" * r.randint(0, 5) + str(r.random()),
                "n": r.choice([None, "1.50", "-3.25", "99999999.99"]), "d": r.randint(-1000, 20000),
                "ts": r.randint(0, 2_000_000_000_000_000)}

    WEIGHTS = {"ins": 6, "upd": 4, "upd_toast": 4, "upd_key": 2, "del": 2, "del_ins": 1, "log_ins": 4, "log_del": 1,
               "log_upd": 1, "trunc": 0.3}

    def txn(self, weights: dict | None = None) -> tuple[int, list, list]:
        """One committed transaction: (time, updates, events); or a rollback (nothing)."""
        weights = weights or self.WEIGHTS
        r = self.rng
        self.lsn += r.randint(1, 50)
        t = self.lsn
        ups, evs, pos = [], [], 0
        saved = (dict(self.items), list(self.log), self.next_id)
        for _ in range(r.randint(1, 6)):
            op = r.choices(list(weights), list(weights.values()))[0]
            if op in ("upd", "upd_toast", "upd_key", "del", "del_ins") and not self.items:
                op = "ins"
            if op == "ins":
                row = self._item(self.next_id)
                self.next_id += 1
                self.items[row["id"]] = row
                ups.append(up(ITEMS, row, t, 1, pos)); pos += 1
            elif op in ("upd", "upd_toast"):
                i = r.choice(sorted(self.items))
                new = dict(self._item(i))
                toast = ()
                if op == "upd_toast":
                    new["big"] = self.items[i]["big"]
                    toast = ("big",)
                self.items[i] = new
                ups.append(up(ITEMS, {"id": i}, t, -1, pos, image="key")); pos += 1
                sent = dict(new, big=None) if toast else new
                ups.append(up(ITEMS, sent, t, 1, pos, toast=toast)); pos += 1
            elif op == "upd_key":
                i = r.choice(sorted(self.items))
                new_id = self.next_id
                self.next_id += 1
                new = dict(self.items.pop(i), id=new_id, v=r.choice(["k", None]))
                toast = ("big",) if r.random() < 0.5 else ()
                self.items[new_id] = new
                ups.append(up(ITEMS, {"id": i}, t, -1, pos, image="key")); pos += 1
                ups.append(up(ITEMS, dict(new, big=None) if toast else new, t, 1, pos, toast=toast)); pos += 1
            elif op == "del":
                i = r.choice(sorted(self.items))
                del self.items[i]
                ups.append(up(ITEMS, {"id": i}, t, -1, pos, image="key")); pos += 1
            elif op == "del_ins":
                i = r.choice(sorted(self.items))
                ups.append(up(ITEMS, {"id": i}, t, -1, pos, image="key")); pos += 1
                row = self._item(i)
                self.items[i] = row
                ups.append(up(ITEMS, row, t, 1, pos)); pos += 1
            elif op == "log_ins":
                row = {"a": r.randint(0, 3), "b": r.choice(["p", "q"]), "big": r.choice(["B1", "B2"])}
                self.log.append(row)
                ups.append(up(LOG, row, t, 1, pos)); pos += 1
            elif op == "log_del" and self.log:
                row = self.log.pop(r.randrange(len(self.log)))
                ups.append(up(LOG, row, t, -1, pos)); pos += 1
            elif op == "log_upd" and self.log:
                k = r.randrange(len(self.log))
                old = self.log[k]
                new = dict(old, a=old["a"] + 1)
                self.log[k] = new
                ups.append(up(LOG, old, t, -1, pos)); pos += 1
                ups.append(up(LOG, dict(new, big=None), t, 1, pos, toast=("big",))); pos += 1
            elif op == "trunc":
                self.items.clear()
                evs.append(truncate(ITEMS, t, pos)); pos += 1
        if r.random() < 0.1:   # rollback: nothing reaches the log
            self.items, self.log, self.next_id = saved
            return t, [], []
        return t, ups, evs

    def expected(self) -> dict[str, Counter]:
        def lake(schema, rows):
            cols = [lake_array(c, [r.get(c.name) for r in rows]).to_pylist() for c in schema.columns]
            return Counter(zip(*cols)) if rows else Counter()
        return {"public.items": lake(ITEMS, list(self.items.values())), "public.log": lake(LOG, self.log)}


def _snapshot_rows(src: Source) -> dict:
    return {"public.items": (ITEMS, [dict(r) for r in src.items.values()]), "public.log": (LOG, [dict(r) for r in src.log])}


def _check(cfg, src: Source) -> None:
    exp = src.expected()
    for table, schema in (("public.items", ITEMS), ("public.log", LOG)):
        got = read_table(cfg, table)
        assert got.schema == arrow_schema(schema), table
        assert rows_counter(got) == exp[table], table


def _snapshotted(make_stream, control, seed: int, txns: int):
    """A stream over both tables, a generator that ran ``txns`` transactions, and their snapshot as
    the tables' first version; return (cfg, generator, the snapshot's LSN)."""
    cfg = make_stream(["public.items", "public.log"], consolidate={"buckets": 4})
    control.upsert_stream(cfg)
    src = Source(random.Random(seed))
    for _ in range(txns):
        src.txn()
    snap_lsn = src.lsn + 1
    snapshot(cfg, control, "snap1", snap_lsn, _snapshot_rows(src), rows_per_file=7)
    src.lsn = snap_lsn
    return cfg, src, snap_lsn


@pytest.mark.parametrize("seed, whole", [(7, batch_path.WHOLE_TABLE_RECORDS), (11, 0)],
                         ids=["tables-merged-whole", "merged-bucket-by-bucket"])
def test_random_workload_equals_source(spark, make_stream, control, monkeypatch, seed, whole):
    monkeypatch.setattr(batch_path, "WHOLE_TABLE_RECORDS", whole)     # a small table in one group, or per bucket
    cfg, src, snap_lsn = _snapshotted(make_stream, control, seed, 30)
    rng = src.rng
    lander = Lander(cfg, control)
    lower = snap_lsn
    landed = []
    for batch in range(3):
        for _ in range(rng.randint(1, 3)):
            txns = []
            for _ in range(rng.randint(0, 12)):
                t, ups, evs = src.txn()
                if ups or evs:
                    txns.append((ups, evs))
            upper = src.lsn + 1
            landed.append(lander.land(lower, upper, txns))
            lower = upper
        # duplicates: a segment landed again under a new sequence number
        dup = rng.choice(landed)
        lander.land(dup.lower, dup.upper, [], data=lander.store.get(dup.uri.split("/landing/", 1)[1]))
        lower = max(lower, dup.upper)
        res = consolidate_stream(cfg, spark=spark, target_rows=8)
        assert res.frontier_after == lower
        _check(cfg, src)
    # a replay of an already consolidated range changes nothing
    versions = {t: open_delta(table_uri(cfg, t)).version() for t in ("public.items", "public.log")}
    old = landed[0]
    lander.land(old.lower, old.upper, [], data=lander.store.get(old.uri.split("/landing/", 1)[1]))
    res = consolidate_stream(cfg, spark=spark, target_rows=8)
    assert res.skipped
    assert {t: open_delta(table_uri(cfg, t)).version() for t in versions} == versions
    _check(cfg, src)


def test_unchanged_toast_values_take_the_batch_path(spark, make_stream, control):
    """Updates that leave a TOASTed value alone (and keep the key), mixed with inserts, deletes and
    re-inserts over several transactions and duplicated segments: the batch path takes both tables
    (no per-table path), and the lake equals the generator."""
    cfg, src, lower = _snapshotted(make_stream, control, 3, 20)
    consolidate_stream(cfg, spark=spark, target_rows=8)          # the snapshot
    lander = Lander(cfg, control)
    weights = {"ins": 2, "upd": 2, "upd_toast": 6, "del": 1, "del_ins": 1, "log_ins": 3}
    for _ in range(2):
        txns = [(ups, evs) for ups, evs in (src.txn(weights)[1:] for _ in range(25)) if ups or evs]
        assert any(u.unchanged_toast for ups, _ in txns for u in ups)
        upper = src.lsn + 1
        seg = lander.land(lower, upper, txns)
        lander.land(seg.lower, seg.upper, [], data=lander.store.get(seg.uri.split("/landing/", 1)[1]))
        lower = upper
        res = consolidate_stream(cfg, spark=spark, target_rows=8)
        assert res.frontier_after == lower
        _check(cfg, src)
