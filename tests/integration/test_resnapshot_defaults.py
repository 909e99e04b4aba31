"""ADD COLUMN ... DEFAULT right after a re-snapshot of one table (mode table), against a real
PostgreSQL and the real consolidation: the copy's rows have the shape at its LSN, so a column added
after it takes its missing value in them as in the lake's rows; a volatile DEFAULT is refused as it
is without the re-snapshot, with a short message and the remedy once, and the remedy, followed as
printed, works — right after the refusal, and when the next segment alone exceeds
``consolidate.max_batch_bytes``."""

from __future__ import annotations

import pytest

from oracle import assert_lake_equals_source, consolidate, drain_until_current
from tidemark.capture.snapshot import snapshot_stream
from tidemark.consolidate import consolidate_stream
from tidemark.consolidate.job import ConsolidateFailed
from tidemark.control import Control, control_dsn
from tidemark.lake import read_table

pytestmark = [pytest.mark.spark, pytest.mark.slow]

MIB = 1 << 20


def _loaded_stream(make_stream, source_conn, spark, **overrides):
    """A stream of one keyed table, snapshotted, drained and consolidated."""
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
        cur.execute("INSERT INTO public.t SELECT g, 'v' || g FROM generate_series(1, 50) g")
    cfg = make_stream(["public.t"], **overrides)
    snapshot_stream(cfg)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    return cfg


def _frontier(cfg) -> tuple[int, int]:
    with Control(control_dsn(cfg)) as ctl:
        state = ctl.stream(cfg.stream)
    return state.frontier, state.landed_upper


def test_a_default_added_right_after_a_one_table_re_snapshot_is_in_every_row(make_stream, source_conn, spark):
    cfg = _loaded_stream(make_stream, source_conn, spark)
    snapshot_stream(cfg, tables=["public.t"], mode="table")
    with source_conn.cursor() as cur:
        cur.execute("ALTER TABLE public.t ADD COLUMN z int DEFAULT 7")
        cur.execute("UPDATE public.t SET v = 'changed' WHERE id = 3")     # a change in the new shape
        cur.execute("INSERT INTO public.t (id, v) VALUES (100, 'new')")
    drain_until_current(cfg)
    res = consolidate(cfg, spark)
    assert len(res.snapshots_loaded) == 1
    assert sorted(set(read_table(cfg, "public.t").column("z").to_pylist()), key=str) == [7]
    assert_lake_equals_source(cfg, "public.t")


@pytest.mark.parametrize("drain_first", [False, True], ids=["consolidate-right-after", "drain-first"])
@pytest.mark.parametrize("resnapshot_before", [True, False], ids=["after-a-re-snapshot", "alone"])
def test_a_volatile_default_is_refused_and_the_printed_remedy_works(
        make_stream, source_conn, spark, drain_first, resnapshot_before):
    cfg = _loaded_stream(make_stream, source_conn, spark, consolidate={"max_batch_bytes": MIB})
    if resnapshot_before:      # merged in the same batch as the ADD: no excuse to take NULLs
        snapshot_stream(cfg, tables=["public.t"], mode="table")
    with source_conn.cursor() as cur:
        cur.execute("ALTER TABLE public.t ADD COLUMN z float8 DEFAULT random()")
        cur.execute("UPDATE public.t SET v = 'changed' WHERE id = 3")
    drain_until_current(cfg)
    before = _frontier(cfg)[0]
    with pytest.raises(ConsolidateFailed) as err:
        consolidate_stream(cfg, spark=spark)
    msg = str(err.value)
    what, remedy = msg.split("\n")                  # the remedy on a line of its own, once
    command = f"tidemark snapshot {cfg.stream} --mode table --tables public.t"
    assert remedy.startswith("remedy: ") and command in remedy and msg.count("tidemark snapshot") == 1, msg
    reason = str(err.value.__cause__)
    assert len(reason) <= 200 and "column z" in reason and "random()" in reason and "public.t" in reason, reason
    assert _frontier(cfg)[0] == before
    # the remedy as printed
    snapshot_stream(cfg, tables=["public.t"], mode="table")
    if not drain_first:
        # before a drain: nothing fails, nothing is consolidated, the failure stays open for the next run
        res = consolidate_stream(cfg, spark=spark)
        assert res.held and "public.t" in res.waiting and _frontier(cfg)[0] == before, res
    with source_conn.cursor() as cur:       # the next segment alone is over max_batch_bytes (2 MiB, incompressible)
        cur.execute("INSERT INTO public.t (id, v) SELECT 1000, string_agg(md5(g::text || random()::text), '') "
                    "FROM generate_series(1, 65536) g")
    drain_until_current(cfg)
    res = consolidate(cfg, spark)
    assert len(res.snapshots_loaded) == 1
    assert None not in read_table(cfg, "public.t").column("z").to_pylist()
    assert_lake_equals_source(cfg, "public.t")
