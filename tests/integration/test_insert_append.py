"""Insert-only batches append files, against PostgreSQL itself (real slot, real Spark).

A bucket whose part of a batch only inserts (a keyed table: new keys, none of them in a file's key
range; a table without a key: no ``-1``) keeps its files: the new rows are a new file beside them
(a Delta add with no remove), so an insert-only table costs about its changes a batch instead of
rewriting its bucket's small files (`merge.merge_records`). Checked over many insert-only batches
into a keyed table (serial key) and a table without a key (REPLICA IDENTITY FULL): the lake equals
PostgreSQL after each, and each removed no file of either table; then a mixed batch (updates and
deletes of rows in the appended files, key moves, inserts beside them), more insert-only batches and
maintenance compaction (which merges the small files of a bucket) keep the lake equal to PostgreSQL and the changelog summing to the lake's
changes since the first load.
"""

from __future__ import annotations

from collections import Counter

from tidemark.capture.snapshot import snapshot_stream
from tidemark.lake import open_delta, read_changelog, read_table, storage_options, table_uri
from tidemark.maintain import maintain

from oracle import assert_lake_equals_source, consolidate, drain_until_current, row_tuples

TABLES = ["public.ia_keyed", "public.ia_keyless"]


def _sql(source_conn, *statements):
    with source_conn, source_conn.cursor() as cur:
        for s in statements:
            cur.execute(s)


def _files(cfg, table: str) -> set[str]:
    return set(open_delta(table_uri(cfg, table), storage_options(cfg)).file_uris())


def _insert_batch(source_conn, i: int):
    _sql(source_conn,
         f"INSERT INTO public.ia_keyed (v, n) SELECT 'k{i}-' || g, g FROM generate_series(1, 30) g",
         f"INSERT INTO public.ia_keyless SELECT g % 7, 'r{i}', now() FROM generate_series(1, 25) g",
         # a duplicate of a row the lake holds: a multiset takes it twice
         "INSERT INTO public.ia_keyless SELECT a, b, t FROM public.ia_keyless ORDER BY a, b LIMIT 1")


def _assert_changelog_sums_to_lake(cfg, table: str, base: Counter):
    """The table's changelog sums to the lake's rows less ``base`` (the first load's rows, which it
    does not list)."""
    lake, log = read_table(cfg, table), read_changelog(cfg, table)
    net = Counter()
    for r, d in zip(row_tuples(log.select(lake.column_names)), log.column("_diff").to_pylist()):
        net[r] += d
    want = Counter(row_tuples(lake))
    want.subtract(base)
    assert {r: n for r, n in net.items() if n} == {r: n for r, n in want.items() if n}, table


def test_insert_only_batches_append_files_and_later_changes_reach_them(make_stream, source_conn, spark):
    _sql(source_conn,
         "CREATE TABLE public.ia_keyed (id bigserial PRIMARY KEY, v text, n int)",
         "CREATE TABLE public.ia_keyless (a int, b text, t timestamptz)",
         "ALTER TABLE public.ia_keyless REPLICA IDENTITY FULL",
         "INSERT INTO public.ia_keyed (v, n) SELECT 'first-' || g, g FROM generate_series(1, 40) g",
         "INSERT INTO public.ia_keyless SELECT g % 5, 'first', now() FROM generate_series(1, 40) g")
    cfg = make_stream(TABLES, consolidate={"buckets": 2})
    snapshot_stream(cfg)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    for t in TABLES:
        assert_lake_equals_source(cfg, t)
    base = {t: Counter(row_tuples(read_table(cfg, t))) for t in TABLES}
    files = {t: _files(cfg, t) for t in TABLES}

    def insert_only(i):
        nonlocal files
        _insert_batch(source_conn, i)
        drain_until_current(cfg)
        consolidate(cfg, spark)
        for t in TABLES:
            assert_lake_equals_source(cfg, t)
            now = _files(cfg, t)
            assert files[t] <= now, (i, t, "an insert-only batch removed files", sorted(files[t] - now))
            assert len(now) > len(files[t]), (i, t, "an insert-only batch added no file")
        files = {t: _files(cfg, t) for t in TABLES}

    def mixed_batch_reaches_the_lake():
        drain_until_current(cfg)
        consolidate(cfg, spark)
        for t in TABLES:
            assert_lake_equals_source(cfg, t)
            _assert_changelog_sums_to_lake(cfg, t, base[t])

    for i in range(4):
        insert_only(i)
    # a mixed batch: updates and deletes of rows the appended files hold, inserts beside them
    _sql(source_conn,
         "UPDATE public.ia_keyed SET v = v || '-u', n = n + 1000 WHERE id % 4 = 0",
         "DELETE FROM public.ia_keyed WHERE id % 9 = 0",
         # key moves (below every key: a new serial key stays outside every file's key range, or the file
         # that may hold it is rewritten)
         "UPDATE public.ia_keyed SET id = -id WHERE id % 11 = 0",
         "INSERT INTO public.ia_keyed (v, n) SELECT 'late-' || g, g FROM generate_series(1, 10) g",
         "DELETE FROM public.ia_keyless WHERE a = 3 AND b IN ('r1', 'r2')",
         "UPDATE public.ia_keyless SET b = b || '-u' WHERE a = 2 AND b = 'r2'",
         "INSERT INTO public.ia_keyless SELECT 9, 'mixed', now() FROM generate_series(1, 5)",
         "DELETE FROM public.ia_keyed WHERE n % 5 = 1",
         "DELETE FROM public.ia_keyless WHERE b = 'first' AND a = 1")
    mixed_batch_reaches_the_lake()
    files = {t: _files(cfg, t) for t in TABLES}
    for i in range(4, 6):
        insert_only(i)
    # maintenance compaction merges a bucket's small (appended) files, sorted
    maintain(cfg)
    for t in TABLES:
        assert len(_files(cfg, t)) < len(files[t]), t
        assert_lake_equals_source(cfg, t)
    # and the table goes on after it
    _insert_batch(source_conn, 99)
    _sql(source_conn, "UPDATE public.ia_keyed SET v = 'last' WHERE id % 3 = 0",
         "DELETE FROM public.ia_keyless WHERE a = 0")
    mixed_batch_reaches_the_lake()
