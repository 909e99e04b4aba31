"""A source database whose encoding is not UTF8 (LATIN1), as old databases are: the drain's and the
snapshot's connections ask for UTF8, so its text reaches the lake as the characters it holds."""

from __future__ import annotations

import secrets

import psycopg2
import pytest

from tidemark.capture.snapshot import snapshot_stream
from tidemark.parity import parity_report

from adversarial_kit import assert_lake_equals_source, consolidate, drain_until_current
from dbkit import drop_database

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(params=["LATIN1"])
def source_db(pg_cluster, request):
    name = f"src_{request.param.lower()}_{secrets.token_hex(4)}"
    conn = psycopg2.connect(pg_cluster.dsn("postgres"))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name} ENCODING '{request.param}' TEMPLATE template0 "
                    "LC_COLLATE 'C' LC_CTYPE 'C'")
    conn.close()
    yield pg_cluster.dsn(name)
    drop_database(pg_cluster, name)


def test_text_of_a_database_not_in_utf8(make_stream, source_db, spark):
    conn = psycopg2.connect(source_db)
    conn.autocommit = True
    conn.set_client_encoding("LATIN1")
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE t (id int PRIMARY KEY, v text, a text[])")
        cur.execute("INSERT INTO t VALUES (1, %s, %s)", ("café ÿ", ["é", "a b"]))
    cfg = make_stream(["public.t"])
    snapshot_stream(cfg)
    with conn.cursor() as cur:
        cur.execute("INSERT INTO t VALUES (2, %s, %s)", ("naïve ©", ["ü"]))
        cur.execute("UPDATE t SET v = v || %s WHERE id = 1", ("°",))
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg)
    report = parity_report(cfg)
    assert all(r["equal"] for r in report.values()), report
    from tidemark.lake import read_table

    assert sorted(read_table(cfg, "public.t").column("v").to_pylist()) == ["café ÿ°", "naïve ©"]
