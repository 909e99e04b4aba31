"""Shared fixtures: a real PostgreSQL cluster with logical replication, fresh source databases,
a migrated control database, and stream configs with random slot/publication names."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import psycopg2
import pytest

from tidemark.config import parse_config
from tidemark.control import Control

from dbkit import TEST_SETTINGS, destroy_own_cluster, drop_database, dsn_uri, start_own_cluster


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.nightly``: run only in the nightly profile (``TIDEMARK_NIGHTLY=1``): larger or
    slower variants of what the default profile already covers (docs/development.md)."""
    if os.environ.get("TIDEMARK_NIGHTLY") == "1":
        return
    skip = pytest.mark.skip(reason="the nightly profile (TIDEMARK_NIGHTLY=1)")
    for item in items:
        if item.get_closest_marker("nightly"):
            item.add_marker(skip)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def pg_cluster():
    """A PostgreSQL cluster for the whole test session (fsync off: tests do not need durability)."""
    home, cluster = start_own_cluster("tidemark-pg-", TEST_SETTINGS)
    yield cluster
    destroy_own_cluster(home, cluster)


def _name(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(4)}"


@pytest.fixture
def source_db(pg_cluster):
    """A fresh, empty source database; dropped afterwards (with its slots)."""
    name = _name("src")
    dsn = pg_cluster.ensure_database(name)
    yield dsn
    drop_database(pg_cluster, name)


@pytest.fixture
def source_conn(source_db):
    conn = psycopg2.connect(source_db)
    conn.autocommit = True
    yield conn
    conn.close()


@pytest.fixture(scope="session")
def control_dsn(pg_cluster):
    dsn = pg_cluster.ensure_database("tidemark_control")
    with Control(dsn) as ctl:
        ctl.migrate()
    return dsn


@pytest.fixture
def control(control_dsn):
    ctl = Control(control_dsn)
    yield ctl
    ctl.close()


@pytest.fixture
def make_stream(tmp_path, source_db, control_dsn, monkeypatch):
    """Build a validated StreamConfig over ``source_db`` with random names; connections via env vars."""
    created = []

    def factory(tables, **overrides):
        stream = _name("s")
        conn_src, conn_ctl = f"src_{stream}", f"ctl_{stream}"
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_src.upper()}", _uri(source_db))
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_ctl.upper()}", _uri(control_dsn))
        doc = {
            "stream": stream,
            "source": {"connection": conn_src, "publication": f"pub_{stream}", "slot": f"slot_{stream}",
                       "tables": list(tables)},
            "control": {"connection": conn_ctl},
            "landing": {"url": str(tmp_path / "landing")},
            "lake": {"path": str(tmp_path / "lake")},
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(doc.get(key), dict):
                doc[key].update(value)
            else:
                doc[key] = value
        cfg = parse_config(doc, origin="<test>")
        created.append(cfg)
        return cfg

    yield factory


def _uri(dsn: str) -> str:
    return dsn_uri(dsn)


@pytest.fixture(scope="session")
def spark():
    """One small local SparkSession for the whole session (pyspark is imported only when used), set up
    for tiny data: two shuffle partitions for the two cores, no UI, no console progress bars."""
    import sys

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from tidemark.cds import driver_java_options
    from tidemark.sparkconf import ALWAYS

    builder = SparkSession.builder.master("local[2]").appName("tidemark-tests")
    for key, value in ALWAYS.items():        # what the library gives every session (UTC, Arrow, ...)
        builder = builder.config(key, value)
    # Spark's classes from the class-data-sharing archive `make test`'s setup built (~4 s off the start);
    # not the library's first-tier-only JIT: this JVM lives for the whole session
    if driver_java_options():
        builder = builder.config("spark.driver.defaultJavaOptions", driver_java_options())
    session = (builder.config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.driver.memory", "2g").config("spark.sql.adaptive.enabled", "true")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
