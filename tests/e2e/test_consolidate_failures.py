"""Failures part-way through a consolidation: committed files are kept, every failure is an incident
printed as one line with its remedy, and readers can see every table at the same frontier.

Faults are injected right after each Delta commit (table and changelog) and between two tables'
commits; the next run must leave the lake equal to the source (the oracle is PostgreSQL)."""

from __future__ import annotations

import os

from urllib.parse import unquote

import pytest
import yaml

from adversarial_kit import assert_lake_equals_source
from oracle import consolidate, drain_until_current, rows, source_table
from tidemark import cli
from tidemark.capture.snapshot import snapshot_stream
from tidemark.capture.source import connect_source
from tidemark.lake import writer as _commit
from tidemark.consolidate.job import ConsolidateFailed, consolidate_stream
from tidemark.control import Control, control_dsn
from tidemark.lake import data_files, open_delta, read_table, read_tables, table_uri
from tidemark.lake.delta import changelog_uri
from tidemark.pgtypes import table_schema_from_catalog

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SETUP = """
CREATE TABLE a (id int PRIMARY KEY, ts timestamp, tstz timestamptz, big text);
ALTER TABLE a ALTER COLUMN big SET STORAGE EXTERNAL;
CREATE TABLE b (k int, v text, PRIMARY KEY (k, v));
INSERT INTO a SELECT i, '2020-01-01'::timestamp + i * interval '1 hour', now(), repeat('x' || i, 1500)
  FROM generate_series(1, 6) i;
INSERT INTO b SELECT i, 'v' || i FROM generate_series(1, 4) i;
"""
WORK = [
    "UPDATE a SET id = id + 100 WHERE id = 1",          # key change, TOAST untouched
    "UPDATE a SET id = id + 100 WHERE id = 101",        # ... and again in the same batch (a chain)
    "UPDATE a SET ts = 'infinity' WHERE id = 2",
    "DELETE FROM a WHERE id = 3",
    "INSERT INTO a VALUES (3, '1999-01-01', '-infinity', repeat('y', 3000))",
    "UPDATE b SET v = v || 'k' WHERE k < 3",
    "INSERT INTO b VALUES (9, 'nine')",
]


def _setup(make_stream, source_conn):
    with source_conn.cursor() as cur:
        cur.execute("SET synchronous_commit = on")
        cur.execute(SETUP)
    cfg = make_stream(["public.a", "public.b"], drain={"idle_timeout_seconds": 0.3}, consolidate={"buckets": 2})
    snapshot_stream(cfg)
    return cfg


def _work(source_conn, stmts=WORK):
    with source_conn.cursor() as cur:
        cur.execute("SET synchronous_commit = on")
        for s in stmts:
            cur.execute(s)


def _all_files_exist(uri) -> None:
    dt = open_delta(uri)
    missing = [f for f in data_files(dt, uri) if not os.path.exists(f)]
    assert not missing, f"{uri}: committed files are gone: {missing}"


def _frontier(cfg):
    with Control(control_dsn(cfg)) as ctl:
        return ctl.stream(cfg.stream).frontier


def _open_incidents(cfg):
    with Control(control_dsn(cfg)) as ctl:
        return [i for i in ctl.incidents(cfg.stream) if i["kind"] == "consolidate_failed"]


@pytest.mark.parametrize("target", ["table", "changelog"])
def test_failure_right_after_a_commit_keeps_the_committed_files(make_stream, source_conn, spark, monkeypatch, target):
    cfg = _setup(make_stream, source_conn)
    consolidate(cfg, spark)                       # the snapshot is loaded
    _work(source_conn)
    drain_until_current(cfg)
    real = _commit.commit_files
    hits = []

    def commit_then_fail(uri, *args, **kwargs):
        version = real(uri, *args, **kwargs)
        is_log = kwargs.get("partition") == "_commit_date"
        if (is_log if target == "changelog" else kwargs.get("operation", "consolidate") == "consolidate"):
            hits.append(uri)
            raise OSError("injected: the storage went away right after the commit")
        return version

    monkeypatch.setattr(_commit, "commit_files", commit_then_fail)
    with pytest.raises(ConsolidateFailed) as err:
        consolidate_stream(cfg, spark=spark)
    assert hits, "the fault was never injected"
    # the failure names a table whose commit the fault followed (the batch path commits its tables
    # several at once: either may be hit first)
    struck = [t for t in ("public.a", "public.b") if {table_uri(cfg, t), changelog_uri(cfg, t)} & set(hits)]
    (inc,) = _open_incidents(cfg)
    hit = inc["detail"]["table"]
    msg = str(err.value)
    assert hit in struck and "\n" not in msg and f"table {hit}" in msg and "injected" in msg and "remedy:" in msg
    # the commit that went through keeps its files
    for uri in hits:
        _all_files_exist(uri)
    assert inc["detail"]["segment"]["seq"] is not None
    assert inc["detail"]["position"] and inc["detail"]["at"] and "injected" in inc["detail"]["reason"]
    monkeypatch.setattr(_commit, "commit_files", real)
    consolidate(cfg, spark)                       # the retry: resumes, skips what is committed
    for t in ("public.a", "public.b"):
        _all_files_exist(table_uri(cfg, t))
        _all_files_exist(changelog_uri(cfg, t))
    assert_lake_equals_source(cfg)
    assert not _open_incidents(cfg)               # resolved by the successful run


def test_failure_between_two_tables_is_visible_and_readers_see_one_frontier(make_stream, source_conn, spark,
                                                                           monkeypatch, tmp_path, capsys):
    from tidemark.consolidate import committed as B

    cfg = _setup(make_stream, source_conn)
    consolidate(cfg, spark)
    conn = connect_source(cfg)
    try:
        before = {t: rows(source_table(conn, table_schema_from_catalog(conn, "public", t.split(".")[1])))
                  for t in ("public.a", "public.b")}
    finally:
        conn.close()
    f1 = _frontier(cfg)
    _work(source_conn)
    drain_until_current(cfg)
    real = B._commit_table

    def fail_on_b(job, p, *args, **kwargs):
        if p.table == "public.b":
            raise ValueError("injected: a fault between two tables' commits")
        return real(job, p, *args, **kwargs)

    monkeypatch.setattr(B, "_commit_table", fail_on_b)
    streams = tmp_path / "streams"
    streams.mkdir()
    (streams / f"{cfg.stream}.yaml").write_text(yaml.safe_dump(cfg.as_dict()))
    capsys.readouterr()
    assert cli.main(["--streams", str(streams), "consolidate", cfg.stream]) == 2
    err = capsys.readouterr().err.strip()
    # one line of what and where, the remedy on its own line
    assert len(err.splitlines()) == 2 and "Traceback" not in err, err
    what, remedy = err.splitlines()
    assert what.startswith("tidemark: error: consolidation failed") and "table public.b" in what, err
    assert remedy.startswith("tidemark: remedy: ") and "public.a are ahead" in remedy, err
    assert _frontier(cfg) == f1                                           # the stream frontier did not move
    (inc,) = _open_incidents(cfg)
    assert inc["detail"]["tables_at_new_frontier"] == ["public.a"] and inc["detail"]["table"] == "public.b"
    assert cli.main(["--streams", str(streams), "incidents", cfg.stream]) == 0
    assert "consolidate_failed" in capsys.readouterr().out
    assert cli.main(["--streams", str(streams), "status", cfg.stream]) == 0
    assert "consolidate_failed" in capsys.readouterr().out
    # public.a is ahead in its latest version; at the stream frontier both tables are as the source was at f1
    assert rows(read_table(cfg, "public.a")) != before["public.a"]
    at_f1 = read_tables(cfg, frontier=f1)
    assert {t: rows(v) for t, v in at_f1.items()} == before
    assert cli.main(["--streams", str(streams), "read", cfg.stream, "public.a", "--at-frontier",
                     "--format", "jsonl"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == sum(before["public.a"].values())
    monkeypatch.setattr(B, "_commit_table", real)
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg)
    f2 = _frontier(cfg)
    assert {t: rows(v) for t, v in read_tables(cfg, frontier=f2).items()} == \
        {t: rows(read_table(cfg, t)) for t in ("public.a", "public.b")}
    assert not _open_incidents(cfg)


def test_lost_control_database_after_the_commits_is_one_line_naming_the_connection(make_stream, source_conn,
                                                                                   spark, monkeypatch):
    import psycopg2

    cfg = _setup(make_stream, source_conn)
    consolidate(cfg, spark)
    _work(source_conn)
    drain_until_current(cfg)

    env = f"AIRFLOW_CONN_{cfg.control_connection.upper()}"
    userinfo = os.environ[env].split("://", 1)[1].split("@", 1)[0]
    secret = unquote(userinfo.partition(":")[2])   # the cluster's real (scram) password: it must not leak
    assert secret

    def restarted(self, *args, **kwargs):
        raise psycopg2.OperationalError(f"server closed the connection unexpectedly (password={secret})\n\tThis "
                                        "probably means the server terminated abnormally")

    real_advance = Control.advance_frontier
    monkeypatch.setattr(Control, "advance_frontier", restarted)
    with pytest.raises(ConsolidateFailed) as err:
        consolidate_stream(cfg, spark=spark)
    msg = str(err.value)
    assert "\n" not in msg and f"'{cfg.control_connection}'" in msg and "advancing the frontier" in msg, msg
    assert secret not in msg and secret not in str(_open_incidents(cfg)), msg
    monkeypatch.setattr(Control, "advance_frontier", real_advance)
    consolidate(cfg, spark)                       # every table already committed: only the frontier moves
    assert_lake_equals_source(cfg)
