"""Seed 000's example changefeed, consolidated at each frontier, with a duplicate at time 4."""

from __future__ import annotations

from collections import Counter

import pytest

from consolidate_kit import Lander, rows_counter, shape, up
from tidemark.consolidate import consolidate_stream
from tidemark.lake import read_table

pytestmark = [pytest.mark.spark, pytest.mark.slow]

# (id, price, time, diff) exactly as in seed 000
SEED = [(5, 10, 5, 1), (5, 12, 4, 1), (5, 12, 5, -1), (5, 10, 6, -1)]


def _txns(t_shape, lo: int, hi: int) -> list:
    """The seed's updates with lo <= time < hi, one transaction per time, -1 before +1."""
    out = []
    for t in range(lo, hi):
        ups = sorted([u for u in SEED if u[2] == t], key=lambda u: u[3])
        if ups:
            out.append(([up(t_shape, {"id": i, "price": p}, time, d, pos) for pos, (i, p, time, d) in enumerate(ups)], []))
    return out


def _expected(frontier: int) -> Counter:
    """Accumulate the seed's diffs below the frontier (Materialize's reading of the feed)."""
    acc: Counter = Counter()
    for i, p, t, d in SEED:
        if t < frontier:
            acc[(i, p)] += d
    return Counter({k: v for k, v in acc.items() if v})


@pytest.mark.parametrize("keyed", [True, False], ids=["primary-key", "multiset"])
def test_seed_changefeed_at_each_frontier(spark, make_stream, control, keyed):
    cfg = make_stream(["public.prices"])
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=0, landed_upper=0)
    t_shape = shape("prices", [("id", "int64", keyed), ("price", "int32")], replica_identity="d" if keyed else "f")
    lander = Lander(cfg, control)
    ranges = [(0, 3), (3, 5), (5, 6), (6, 10)]
    for lo, hi in ranges:
        seg = lander.land(lo, hi, _txns(t_shape, lo, hi))
        if (lo, hi) == (3, 5):   # the time-4 update lands twice (a duplicated segment)
            lander.land(lo, hi, [], data=lander.store.get(seg.uri.split("/landing/", 1)[1]))
        res = consolidate_stream(cfg, spark=spark)
        assert res.frontier_after == hi
        if hi >= 5:
            assert rows_counter(read_table(cfg, "public.prices")) == _expected(hi), f"frontier {hi}"
    assert control.stream(cfg.stream).frontier == 10
    again = consolidate_stream(cfg, spark=spark)
    assert again.skipped and again.versions == {}
