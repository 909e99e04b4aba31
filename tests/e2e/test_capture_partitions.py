"""A partitioned table is followed through its parent: changes to every partition — moved between
partitions, in a partition attached after the snapshot, in one created later with PARTITION OF —
land in the parent's lake table, which equals the source."""

from __future__ import annotations

import pytest

from adversarial_kit import cycle
from tidemark.capture.snapshot import snapshot_stream
from tidemark.lake import read_table

pytestmark = [pytest.mark.spark]


def _exec(conn, *stmts):
    with conn.cursor() as cur:
        for s in stmts:
            cur.execute(s)


def test_partition_changes_land_in_the_parent_table(make_stream, source_conn, spark):
    _exec(source_conn,
          "CREATE TABLE m (id int, k int, v text, PRIMARY KEY (id, k)) PARTITION BY RANGE (k)",
          "CREATE TABLE m1 PARTITION OF m FOR VALUES FROM (0) TO (100)",
          "CREATE TABLE m2 PARTITION OF m FOR VALUES FROM (100) TO (200)",
          "INSERT INTO m SELECT i, i % 200, 'v' FROM generate_series(1, 400) i")
    cfg = make_stream(["public.m"])
    snapshot_stream(cfg)
    _exec(source_conn,
          "INSERT INTO m1 VALUES (1001, 5, 'leaf insert')",              # straight into a partition
          "UPDATE m SET v = 'updated' WHERE id % 10 = 0",
          "UPDATE m SET k = k + 100 WHERE id BETWEEN 1 AND 20 AND k < 100",   # moves rows from m1 to m2
          "DELETE FROM m2 WHERE id % 7 = 0",
          "CREATE TABLE m3 (id int, k int, v text, PRIMARY KEY (id, k))",
          "ALTER TABLE m ATTACH PARTITION m3 FOR VALUES FROM (200) TO (300)",
          "INSERT INTO m VALUES (2001, 250, 'in attached partition')",
          "INSERT INTO m3 VALUES (2002, 260, 'into the attached leaf')",
          "CREATE TABLE m4 PARTITION OF m FOR VALUES FROM (300) TO (400)",
          "INSERT INTO m4 VALUES (3001, 350, 'created later')",
          "UPDATE m SET k = 255 WHERE id = 3001")                         # m4 -> m3
    cycle(cfg, spark)
    ids = set(read_table(cfg, "public.m").column("id").to_pylist())
    assert {1001, 2001, 2002, 3001} <= ids
    # TRUNCATE of the parent is published as the parent's (TRUNCATE of a single partition is not:
    # PostgreSQL does not publish it through the root; the runbook tells the operator)
    _exec(source_conn, "TRUNCATE m", "INSERT INTO m VALUES (4001, 150, 'after truncate')")
    cycle(cfg, spark)
