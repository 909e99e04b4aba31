"""The property-based oracle: hypothesis generates random plans of transactions (property_kit) over
tables covering every captured type — keyed, composite-keyed and REPLICA IDENTITY FULL, with TOASTed
text and bytea (STORAGE EXTERNAL), key changes and chains of them inside and across batches, delete +
re-insert, updates that leave TOAST untouched, rollbacks, savepoints, truncates — runs each against a
fresh source database, drains and consolidates at random batch boundaries (segments of random size),
and after every consolidation every lake table equals the source, value for value. `tidemark parity`
must agree with that comparison: ok after each consolidation, and, after more changes the lake has
not seen, MISMATCH exactly on the tables whose rows differ.

Profiles (``TIDEMARK_HYPOTHESIS``): ``ci`` (default; a fixed, derandomized set of 3 examples, so a CI
run is reproducible) and ``nightly`` (many random examples). A failing example prints its plan;
add it to test_property_regressions.py.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

import psycopg2
import pytest
from hypothesis import HealthCheck, given, settings

import property_kit as K
from adversarial_kit import assert_lake_equals_source
from dbkit import drop_database, dsn_uri
from oracle import consolidate, drain_until_current, rows, source_table

pytestmark = [pytest.mark.spark, pytest.mark.slow]

_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                      HealthCheck.data_too_large, HealthCheck.large_base_example])
settings.register_profile("ci", max_examples=int(os.environ.get("TIDEMARK_HYPOTHESIS_EXAMPLES", "3")),
                          derandomize=True, **_COMMON)
settings.register_profile("nightly", max_examples=int(os.environ.get("TIDEMARK_HYPOTHESIS_EXAMPLES", "150")),
                          **_COMMON)
PROFILE = os.environ.get("TIDEMARK_HYPOTHESIS", "ci")


class Source:
    """A fresh source database and stream config for one example (function-scoped fixtures do not
    reset between hypothesis examples, so each example makes and drops its own)."""

    def __init__(self, pg_cluster, control_dsn):
        from tidemark.config import parse_config

        self.cluster = pg_cluster
        self.name = f"prop_{secrets.token_hex(4)}"
        self.dsn = pg_cluster.ensure_database(self.name)
        self.tmp = Path(tempfile.mkdtemp(prefix="tidemark-prop-"))
        stream = f"p_{secrets.token_hex(4)}"
        self.env = {f"AIRFLOW_CONN_SRC_{stream.upper()}": _uri(self.dsn),
                    f"AIRFLOW_CONN_CTL_{stream.upper()}": _uri(control_dsn)}
        os.environ.update(self.env)
        self.cfg = parse_config({
            "stream": stream,
            "source": {"connection": f"src_{stream}", "publication": f"pub_{stream}", "slot": f"slot_{stream}",
                       "tables": K.TABLES},
            "control": {"connection": f"ctl_{stream}"},
            "landing": {"url": str(self.tmp / "landing")},
            "lake": {"path": str(self.tmp / "lake")},
            "drain": {"idle_timeout_seconds": 0.3},
            "consolidate": {"buckets": 2},
        }, origin="<property test>")
        self.conn = psycopg2.connect(self.dsn)
        self.conn.autocommit = True
        with self.conn.cursor() as cur:
            cur.execute("SET synchronous_commit = on")     # the drain's target is the flush position
            cur.execute(K.SETUP)

    def close(self) -> None:
        self.conn.close()
        drop_database(self.cluster, self.name)
        for k in self.env:
            os.environ.pop(k, None)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _uri(dsn: str) -> str:
    return dsn_uri(dsn)


def lake_equals_source_per_table(cfg) -> dict[str, bool]:
    """The independent comparison (tests/oracle.py): per table, lake rows == source rows."""
    from tidemark.capture.source import connect_source
    from tidemark.lake import read_table
    from tidemark.pgtypes import table_schema_from_catalog

    conn = connect_source(cfg)
    try:
        out = {}
        for ref in cfg.source.tables:
            shape = table_schema_from_catalog(conn, ref.schema, ref.name)
            out[ref.qualified] = rows(read_table(cfg, ref)) == rows(source_table(conn, shape))
        return out
    finally:
        conn.close()


def run_plan(pg_cluster, control_dsn, spark, plan) -> None:
    """Execute a plan (see property_kit) and check the oracle after every consolidation."""
    from tidemark.capture.snapshot import snapshot_stream
    from tidemark.control import Control, control_dsn as control_dsn_of
    from tidemark.parity import moved_since, parity_report

    initial, batches, after = plan
    src = Source(pg_cluster, control_dsn)
    counter = [0]
    try:
        for t in initial:
            K.run_txn(src.conn, t, counter)
        snapshot_stream(src.cfg)
        for txns, max_changes in batches:
            for t in txns:
                K.run_txn(src.conn, t, counter)
            drain_until_current(src.cfg, max_changes=max_changes)
            consolidate(src.cfg, spark)
            assert_lake_equals_source(src.cfg)
            report = parity_report(src.cfg)
            assert {t: r["equal"] for t, r in report.items()} == {t: True for t in K.TABLES}, report
        for t in after:       # changes the lake has not seen: parity must agree with the oracle per table
            K.run_txn(src.conn, t, counter)
        report = parity_report(src.cfg)
        equal = lake_equals_source_per_table(src.cfg)
        assert {t: r["equal"] for t, r in report.items()} == equal, report
        # "the source has moved past the frontier" only for tables that did: a table that differs has
        # moved; a table no committed transaction touched after the frontier has not
        with Control(control_dsn_of(src.cfg)) as ctl:
            frontier = ctl.stream(src.cfg.stream).frontier
        moved = moved_since(src.cfg, frontier, K.TABLES)
        untouched = set(K.TABLES) - K.touched_tables(after)
        for t in K.TABLES:
            if not equal[t]:
                assert moved[t] is True, (t, moved)
            if t in untouched:
                assert moved[t] is False, (t, moved)
    finally:
        src.close()


@settings(settings.get_profile(PROFILE))
@given(plan=K.plan())
def test_random_plans_lake_equals_source(pg_cluster, control_dsn, spark, plan):
    run_plan(pg_cluster, control_dsn, spark, plan)
