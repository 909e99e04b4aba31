"""The stream's publication: created or aligned by `stream apply` to publish insert, update, delete
and truncate of exactly the stream's tables through partition roots; what was wrong is named; a
publication that cannot be aligned, or was altered behind Tidemark's back, is refused."""

from __future__ import annotations

import pytest

from tidemark.capture.drain import drain_stream
from tidemark.capture.snapshot import snapshot_stream
from tidemark.capture.source import apply_stream, connect_source, publication_problems
from tidemark.errors import TidemarkError


def _exec(conn, *stmts):
    with conn.cursor() as cur:
        for s in stmts:
            cur.execute(s)


def _pub(conn, name):
    with conn.cursor() as cur:
        cur.execute("""SELECT pubinsert, pubupdate, pubdelete, pubtruncate, pubviaroot FROM pg_publication
                        WHERE pubname = %s""", (name,))
        flags = cur.fetchone()
        cur.execute("SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s ORDER BY 1",
                    (name,))
        return flags, [r[0] for r in cur.fetchall()]


def test_new_publication_publishes_everything_via_partition_root(make_stream, source_conn):
    _exec(source_conn, "CREATE TABLE a (id int PRIMARY KEY)",
          "CREATE TABLE m (id int, k int, PRIMARY KEY (id, k)) PARTITION BY RANGE (k)",
          "CREATE TABLE m1 PARTITION OF m FOR VALUES FROM (0) TO (100)")
    cfg = make_stream(["public.a", "public.m"])
    aligned: list[str] = []
    apply_stream(cfg, aligned=aligned)
    assert aligned == []
    assert _pub(source_conn, cfg.source.publication) == ((True, True, True, True, True), ["public.a", "public.m"])
    conn = connect_source(cfg)
    try:
        assert publication_problems(cfg, conn) == []
    finally:
        conn.close()


def test_existing_publication_is_aligned_naming_what_was_wrong(make_stream, source_conn):
    _exec(source_conn, "CREATE TABLE a (id int PRIMARY KEY, v int)", "CREATE TABLE b (id int PRIMARY KEY)",
          "CREATE TABLE other (id int PRIMARY KEY)")
    cfg = make_stream(["public.a", "public.b"])
    pub = cfg.source.publication
    _exec(source_conn, f"CREATE PUBLICATION {pub} FOR TABLE a WHERE (v > 0), other WITH (publish = 'insert, update')")
    aligned: list[str] = []
    apply_stream(cfg, aligned=aligned)
    text = "\n".join(aligned)
    for part in ("does not publish delete, truncate", "publish_via_partition_root = false", "lacks public.b",
                 "also publishes public.other", "row filter on public.a"):
        assert part in text, text
    assert _pub(source_conn, pub) == ((True, True, True, True, True), ["public.a", "public.b"])
    again: list[str] = []
    apply_stream(cfg, aligned=again)
    assert again == []


def test_all_tables_publication_is_refused(make_stream, source_conn):
    _exec(source_conn, "CREATE TABLE a (id int PRIMARY KEY)")
    cfg = make_stream(["public.a"])
    _exec(source_conn, f"CREATE PUBLICATION {cfg.source.publication} FOR ALL TABLES")
    with pytest.raises(TidemarkError, match=f"{cfg.source.publication} is FOR ALL TABLES.*cannot be narrowed"):
        apply_stream(cfg)


def test_drain_refuses_a_publication_altered_after_apply(make_stream, source_conn):
    _exec(source_conn, "CREATE TABLE a (id int PRIMARY KEY)")
    cfg = make_stream(["public.a"])
    snapshot_stream(cfg)
    _exec(source_conn, f"ALTER PUBLICATION {cfg.source.publication} SET (publish = 'insert, update')",
          "INSERT INTO a VALUES (1)", "DELETE FROM a")
    with pytest.raises(TidemarkError, match="does not publish delete, truncate.*stream apply.*--resend"):
        drain_stream(cfg)
    apply_stream(cfg)
    assert drain_stream(cfg).registered
