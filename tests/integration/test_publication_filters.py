"""Column lists and row filters per table (``source.tables: [{name, columns, where}]``), against a real
PostgreSQL and the real consolidation: `stream apply` turns them into the publication's column list and
row filter (and refuses, in one line naming the table, what PostgreSQL would refuse or would make it
refuse the table's UPDATE and DELETE); the snapshot copies the same columns under the same WHERE; the
drain gets what pgoutput sends (an UPDATE that moves a row out of the filter as a DELETE, into it as an
INSERT); the lake holds exactly the source's filtered projection and parity says so; a changed column
list or filter re-snapshots that table online (`stream apply`)."""

from __future__ import annotations

import pytest
import yaml

from oracle import assert_lake_equals_source, consolidate, drain_until_current, snapshots_taken
from tidemark.capture.snapshot import snapshot_stream
from tidemark.capture.source import apply_stream, check_publication, connect_source
from tidemark.config import load_config
from tidemark.errors import ConfigError
from tidemark.parity import parity_report

USERS = ("CREATE TABLE public.users (id int, region text, email text, note text, big text, "
         "PRIMARY KEY (id, region))")


def _users(source_conn) -> None:
    with source_conn.cursor() as cur:
        cur.execute(USERS)
        cur.execute("ALTER TABLE public.users ALTER big SET STORAGE EXTERNAL")    # out of line from 2 KB: TOAST
        cur.execute("""INSERT INTO public.users SELECT g, (ARRAY['eu', 'us', 'apac'])[g % 3 + 1], 'e' || g, 'n' || g,
                              CASE WHEN g % 4 = 0 THEN repeat(md5(g::text), 200) ELSE 'small' || g END
                         FROM generate_series(1, 60) g""")


def _entry(columns=None, where=None, name="public.users") -> dict:
    return {"name": name, **({"columns": columns} if columns else {}), **({"where": where} if where else {})}


def _write(cfg, tmp_path, entry) -> str:
    """The stream file of ``cfg`` with ``entry`` as its one table; returns its path."""
    doc = cfg.as_dict()
    doc["source"]["tables"] = [entry]
    path = tmp_path / f"{cfg.stream}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_the_stream_file_takes_a_column_list_and_row_filter_per_table(make_stream):
    cfg = make_stream([_entry(["id", "email", "region"], "region = 'eu'"), "public.other"])
    assert cfg.source.filter_of("public.users").columns == ("id", "email", "region")
    assert cfg.source.filter_of("public.users").where == "region = 'eu'"
    assert cfg.source.filter_of("public.other").columns is None
    assert [t.qualified for t in cfg.source.tables] == ["public.users", "public.other"]
    # it round-trips through the stored configuration
    assert cfg.as_dict()["source"]["tables"][0] == _entry(["id", "email", "region"], "region = 'eu'")
    for bad, where in [("region = 'eu'); DROP TABLE public.users; --", "without its"),
                       ("true; select 1", "';'"), ("region = $$eu$$", "dollar"), ("(region = 'eu'", "without its")]:
        with pytest.raises(ConfigError) as err:
            make_stream([_entry(where=bad)])
        assert "source.tables[0].where" in str(err.value) and where in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match=r"source.tables\[0\].columns"):
        make_stream([_entry(columns=["id", "id"])])
    with pytest.raises(ConfigError, match=r"source.tables\[0\].colums: unknown key"):
        make_stream([{"name": "public.users", "colums": ["id"]}])


@pytest.mark.parametrize("entry, key, words", [
    (_entry(where="regon = 'eu'"), "source.tables[0]", ["public.users", "regon = 'eu'", "PostgreSQL refuses it",
                                                        "regon"]),
    (_entry(where="region = 'eu' AND random() > 0.5"), "source.tables[0]", ["public.users", "random()"]),
    (_entry(columns=["id", "email"]), "source.tables[0].columns", ["public.users", "lacks region", "id, region"]),
    (_entry(columns=["id", "region", "mail"]), "source.tables[0].columns", ["public.users", "no column mail"]),
    (_entry(where="email LIKE '%@eu.example'"), "source.tables[0].where",
     ["public.users", "uses email", "replica identity (id, region)", "REPLICA IDENTITY FULL"]),
])
def test_stream_apply_refuses_in_one_line_what_postgresql_would_refuse(make_stream, source_conn, entry, key, words):
    _users(source_conn)
    cfg = make_stream([entry])
    with pytest.raises(ConfigError) as err:
        apply_stream(cfg)
    msg = str(err.value)
    assert "\n" not in msg and key in msg and all(w in msg for w in words), msg
    with source_conn.cursor() as cur:      # nothing was created
        cur.execute("SELECT count(*) FROM pg_publication WHERE pubname LIKE 'tidemark_check_%%' OR pubname = %s",
                    (cfg.source.publication,))
        assert cur.fetchone()[0] == 0


def test_a_full_identity_table_filters_on_any_column_and_lists_every_column(make_stream, source_conn):
    _users(source_conn)
    with source_conn.cursor() as cur:
        cur.execute("ALTER TABLE public.users REPLICA IDENTITY FULL")
    apply_stream(make_stream([_entry(where="email LIKE 'e1%'")]))
    with pytest.raises(ConfigError, match="REPLICA IDENTITY FULL: every column"):
        apply_stream(make_stream([_entry(columns=["id", "region", "email"])]))


def test_the_publication_carries_them_and_a_hand_made_change_is_found(make_stream, source_conn):
    _users(source_conn)
    cfg = make_stream([_entry(["id", "region", "email"], "region = 'eu'")])
    apply_stream(cfg)
    with source_conn.cursor() as cur:
        cur.execute("""SELECT pg_get_expr(prqual, prrelid), prattrs::text FROM pg_publication_rel pr
                         JOIN pg_publication p ON p.oid = pr.prpubid WHERE p.pubname = %s""", (cfg.source.publication,))
        assert cur.fetchone() == ("(region = 'eu'::text)", "1 2 3")
    check_publication(cfg)
    with source_conn.cursor() as cur:
        cur.execute(f"ALTER PUBLICATION {cfg.source.publication} SET TABLE public.users (id, region, email, note)")
    with pytest.raises(Exception, match="no row filter on public.users.*not the stream file's columns"):
        check_publication(cfg)
    assert apply_stream(cfg) is not None          # aligned again
    check_publication(cfg)


COLUMNS = ["id", "region", "email", "big"]


@pytest.mark.spark
@pytest.mark.slow
def test_the_lake_holds_the_filtered_projection_and_a_changed_filter_re_snapshots_online(
        make_stream, source_conn, spark, tmp_path):
    from tidemark.cli import main

    _users(source_conn)
    cfg = make_stream([_entry(COLUMNS, "region = 'eu'")])
    snapshot_stream(cfg)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg, "public.users", COLUMNS, "region = 'eu'")
    big = "repeat(md5(random()::text), 200)"
    with source_conn.cursor() as cur:
        cur.execute(f"INSERT INTO public.users VALUES (100, 'eu', 'in', 'x', {big}), (101, 'us', 'out', 'x', 'y')")
        cur.execute("UPDATE public.users SET region = 'us' WHERE id IN (3, 6)")          # out of the filter
        cur.execute("UPDATE public.users SET region = 'eu', big = 'now small' WHERE id = 4")   # into it
        cur.execute("UPDATE public.users SET region = 'eu' WHERE id = 7")                # into it, small values
        cur.execute("UPDATE public.users SET note = 'unlisted' WHERE id IN (9, 12)")      # unlisted column only
        cur.execute("UPDATE public.users SET email = 'mail' WHERE id = 12")              # TOAST value unchanged
        cur.execute(f"UPDATE public.users SET big = {big} WHERE id = 15")                 # TOAST value changed
        cur.execute("UPDATE public.users SET email = 'outside' WHERE id = 5")            # outside, stays out
        cur.execute("DELETE FROM public.users WHERE id IN (18, 19)")                     # one in, one out
        cur.execute("UPDATE public.users SET id = 1000 WHERE id = 21")                   # key change inside
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg, "public.users", COLUMNS, "region = 'eu'")
    report = parity_report(cfg)["public.users"]
    assert report["equal"] and report["where"] == "(region = 'eu'::text)" and report["columns"] == COLUMNS, report
    with connect_source(cfg) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM public.users WHERE region = 'eu'")
        assert report["lake_rows"] == cur.fetchone()[0] < 61

    # on the running stream: another filter and another column list, applied as the operator does
    taken = snapshots_taken(cfg)
    columns2, where2 = ["id", "region", "note"], "region IN ('eu', 'apac')"
    path = _write(cfg, tmp_path, _entry(columns2, where2))
    assert main(["stream", "apply", path]) == 0
    assert snapshots_taken(cfg) == taken + 1                 # that table was copied again, online
    assert main(["stream", "apply", path]) == 0              # idempotent: no second copy
    assert snapshots_taken(cfg) == taken + 1
    cfg2 = load_config(path)
    with source_conn.cursor() as cur:
        cur.execute("UPDATE public.users SET note = 'after' WHERE id IN (1, 2, 3)")
        cur.execute("INSERT INTO public.users VALUES (200, 'apac', 'a', 'b', 'c')")
    drain_until_current(cfg2)
    consolidate(cfg2, spark)
    assert_lake_equals_source(cfg2, "public.users", columns2, where2)
    assert parity_report(cfg2)["public.users"]["equal"]


@pytest.mark.spark
@pytest.mark.slow
def test_a_row_moved_into_the_filter_with_its_toast_value_unchanged_is_mended_by_a_re_snapshot(
        make_stream, source_conn, spark):
    """PostgreSQL sends an UPDATE that moves a row into the row filter as an INSERT, and a TOAST value
    the UPDATE left alone is not in it (the old row holds only the key): no one can know that value
    but a copy. The consolidation asks for a re-snapshot of that table (never a row without it), the
    gap sensor's resend step takes it, and the lake is the filtered projection again."""
    from tidemark import gaps
    from tidemark.consolidate import consolidate_stream
    from tidemark.consolidate.job import ConsolidateFailed
    from tidemark.errors import TableNeedsSnapshot

    _users(source_conn)
    cfg = make_stream([_entry(COLUMNS, "region = 'eu'")])
    snapshot_stream(cfg)
    with source_conn.cursor() as cur:
        cur.execute("UPDATE public.users SET region = 'eu' WHERE id = 8")     # 'us', a TOASTed big, unchanged
        cur.execute("UPDATE public.users SET email = 'x' WHERE id = 12")      # inside, TOAST unchanged: fine
    drain_until_current(cfg)
    with pytest.raises(ConsolidateFailed) as err:
        consolidate_stream(cfg, spark=spark)
    assert isinstance(err.value.__cause__, TableNeedsSnapshot), repr(err.value.__cause__)
    assert "public.users" in str(err.value) and "row filter" in str(err.value.__cause__)
    assert gaps.detect(cfg).resnapshot == ("public.users",)
    result = gaps.resend(cfg)
    assert not result.skipped and "public.users" in result.tables
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg, "public.users", COLUMNS, "region = 'eu'")
    assert parity_report(cfg)["public.users"]["equal"]


@pytest.mark.spark
@pytest.mark.slow
def test_a_resend_compares_key_ranges_over_the_published_columns_and_rows(make_stream, source_conn, spark):
    """A resend's key-range checksums read the source's published columns under the row filter: a lake
    equal to the filtered projection differs in no range, so nothing is copied, and the lake stays equal."""
    _users(source_conn)
    with source_conn.cursor() as cur:
        cur.execute("INSERT INTO public.users SELECT g, 'eu', 'e' || g, 'n', 's' FROM generate_series(1000, 3000) g")
    cfg = make_stream([_entry(COLUMNS, "region = 'eu'")])
    snapshot_stream(cfg)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    res = snapshot_stream(cfg, mode="resend")
    copy = res.copies["public.users"]
    with connect_source(cfg) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM public.users WHERE region = 'eu'")
        eu = cur.fetchone()[0]
    assert copy.get("ranges_copied") == 0 and copy["rows_copied"] == 0 and copy["rows"] == eu, copy
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg, "public.users", COLUMNS, "region = 'eu'")
    assert parity_report(cfg)["public.users"]["equal"]
