"""SCD type 2 history tables (stream file ``history:``), against PostgreSQL itself (real slot, Spark).

Hypothesis draws workloads of inserts (keys come back after a delete), updates, key changes,
deletes, TRUNCATEs and an ADD COLUMN, cut into several batches; some batches are consolidated with
the history step left out (as a crash between the table's commit and the history's would), so the
next batch must catch the history up from the changelog. After every batch the history table must
equal an independent fold of the table's changelog (written here, from the snapshot's rows at its
LSN), its current versions must be the source's rows, and running the history step again must
commit nothing.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st
from psycopg2 import sql

from tidemark.capture.snapshot import snapshot_stream
from tidemark.config import parse_config
from tidemark.consolidate.history import keep_histories
from tidemark.control import open_control
from tidemark.errors import ConfigError
from tidemark.lake import history_uri, open_delta, read_changelog, read_history, storage_options

from oracle import consolidate, drain_until_current

_names = itertools.count()

OP = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 11), st.text("abc", max_size=3)),
    st.tuples(st.just("update"), st.integers(0, 50), st.text("xyz", max_size=3)),
    st.tuples(st.just("rekey"), st.integers(0, 50), st.integers(0, 11)),
    st.tuples(st.just("delete"), st.integers(0, 50)),
    st.tuples(st.just("truncate")),
    st.tuples(st.just("addcol")),
)
# a workload: batches of transactions of operations, and per batch whether the history step runs
WORKLOAD = st.lists(st.tuples(st.lists(st.lists(OP, min_size=1, max_size=3), min_size=1, max_size=5), st.booleans()),
                    min_size=2, max_size=3)


def _apply(conn, table: str, txn, live: set, state: dict) -> None:
    ident = sql.Identifier("public", table)
    with conn, conn.cursor() as cur:
        for op in txn:
            kind = op[0]
            if kind == "insert":
                k = op[1] + 100 * state["gen"]
                if k not in live:
                    cur.execute(sql.SQL("INSERT INTO {} (id, v) VALUES (%s, %s)").format(ident), (k, op[2]))
                    live.add(k)
            elif kind in ("update", "rekey", "delete") and live:
                k = sorted(live)[op[1] % len(live)]
                if kind == "update":
                    cur.execute(sql.SQL("UPDATE {} SET v = %s WHERE id = %s").format(ident), (op[2], k))
                    if state["added"]:
                        cur.execute(sql.SQL("UPDATE {} SET extra = length(v) WHERE id = %s").format(ident), (k,))
                elif kind == "rekey":
                    new = op[2] + 1000
                    if new not in live:
                        cur.execute(sql.SQL("UPDATE {} SET id = %s WHERE id = %s").format(ident), (new, k))
                        live.discard(k)
                        live.add(new)
                else:
                    cur.execute(sql.SQL("DELETE FROM {} WHERE id = %s").format(ident), (k,))
                    live.discard(k)
            elif kind == "truncate":
                cur.execute(sql.SQL("TRUNCATE {}").format(ident))
                live.clear()
                state["gen"] += 1 if state["gen"] < 3 else 0
            elif kind == "addcol" and not state["added"]:
                cur.execute(sql.SQL("ALTER TABLE {} ADD COLUMN extra int").format(ident))
                state["added"] = True


def _fold(base_rows: list[dict], base_lsn: int, log: list[dict]) -> list[tuple]:
    """The versions the changelog implies, folded the plain way: per commit LSN, a key with a -1
    closes its open version (deleted unless the same LSN has a +1 of that key), a key with a +1
    opens one."""
    meta = {"_time", "_diff", "_commit_ts", "_commit_date"}
    open_ = {r["id"]: (dict(r), base_lsn, None) for r in base_rows}
    out = []
    for t in sorted({r["_time"] for r in log}):
        at = [r for r in log if r["_time"] == t]
        ts = next((r["_commit_ts"] for r in at if r["_commit_ts"] is not None), None)
        plus = {r["id"]: r for r in at if r["_diff"] == 1}
        assert all(r["_diff"] in (1, -1) for r in at)
        for r in at:
            if r["_diff"] == -1:
                row, lsn, since = open_.pop(r["id"])
                out.append((row, lsn, t, since, ts, False, r["id"] not in plus))
        for k, r in plus.items():
            assert k not in open_
            open_[k] = ({n: v for n, v in r.items() if n not in meta}, t, ts)
    out += [(row, lsn, None, since, None, True, False) for row, lsn, since in open_.values()]
    return out


def _canon(row: dict, columns: list[str], *versions) -> tuple:
    return tuple(row.get(c) for c in columns) + tuple(versions)


def _history_as_tuples(cfg, table: str, columns: list[str]) -> list[tuple]:
    got = read_history(cfg, table).to_pylist()
    return sorted((_canon(r, columns, r["_valid_from_lsn"], r["_valid_to_lsn"], r["_valid_from"], r["_valid_to"],
                          r["_is_current"], r["_deleted"]) for r in got), key=repr)


def _check(cfg, table: str, base_rows: list[dict], base_lsn: int, conn, compacted: bool = False) -> None:
    log = read_changelog(cfg, table).to_pylist()
    columns = [c for c in read_changelog(cfg, table).column_names if not c.startswith("_")]
    want = sorted((_canon(row, columns, lsn, to, since, ts_to, cur, deleted)
                   for row, lsn, to, since, ts_to, cur, deleted in _fold(base_rows, base_lsn, log)), key=repr)
    assert _history_as_tuples(cfg, table, columns) == want
    with conn.cursor() as cur:     # the current versions are the source's rows
        cur.execute(sql.SQL("SELECT id, v FROM {}").format(sql.Identifier("public", table.split(".")[1])))
        source = sorted(cur.fetchall())
    conn.commit()
    current = read_history(cfg, table, current=True)
    assert sorted(zip(current.column("id").to_pylist(), current.column("v").to_pylist())) == source
    if compacted:      # COMPACT_FILES = 2: each bucket's closed versions are merged into one file
        import collections

        import pyarrow as pa

        paths = pa.table(open_delta(history_uri(cfg, table), storage_options(cfg)).get_add_actions(flatten=True)
                         ).column("path").to_pylist()
        closed = collections.Counter(p.split("/")[0] for p in paths if p.split("/")[-1].startswith("closed-"))
        assert all(n == 1 for n in closed.values()), closed


def _snapshotted(make_stream, source_conn, table: str, n: int, key_type: str = "int", key=lambda g: g):
    """``table`` (``id <key_type> PRIMARY KEY, v text``) with rows ``(key(g), 's' || g)`` for g in 1..n, in a
    stream keeping its history, snapshotted: ``(cfg, snapshot LSN, the snapshot's rows)``."""
    schema, name = table.split(".")
    ident = sql.Identifier(schema, name)
    rows = [{"id": key(g), "v": f"s{g}"} for g in range(1, n + 1)]
    with source_conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE TABLE {} (id {} PRIMARY KEY, v text)").format(ident, sql.SQL(key_type)))
        cur.executemany(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(ident), [(r["id"], r["v"]) for r in rows])
    source_conn.commit()
    cfg = make_stream([table], history=[table])
    snapshot_stream(cfg)
    with open_control(cfg) as ctl, ctl.tx() as cur:
        cur.execute("SELECT lsn FROM tidemark.snapshots WHERE stream = %s", (cfg.stream,))
        (base_lsn,), = cur.fetchall()
    return cfg, base_lsn, rows


# no shrinking: each example costs a few Spark jobs; the failing workload is printed as drawn
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(workload=WORKLOAD)
# found by this test: a batch whose only change is a no-op leaves the changelog moving without rows
# (the idle path, no Spark) while the history still has to be built: it starts Spark for it
@example(workload=[([[("addcol",), ("delete", 18), ("insert", 7, "")]], False),
                   ([[("insert", 2, "abb")], [("addcol",)]], True), ([[("rekey", 2, 4)]], False)])
def test_history_table_equals_the_fold_of_the_changelog_across_batches_and_reruns(
        workload, make_stream, source_conn, spark, monkeypatch):
    from tidemark.consolidate import history

    monkeypatch.setattr(history, "COMPACT_FILES", 2)     # a bucket's closed files merged every other batch
    monkeypatch.setattr(history, "OPEN_ROWS", 2)         # a bucket's open versions in several key ranges
    table = f"scd_{next(_names)}"
    qualified = f"public.{table}"
    cfg, base_lsn, base_rows = _snapshotted(make_stream, source_conn, qualified, 6)
    live, state = set(range(1, 7)), {"gen": 0, "added": False}
    source_conn.autocommit = False
    try:
        for txns, keep in workload:
            for txn in txns:
                _apply(source_conn, table, txn, live, state)
            drain_until_current(cfg)
            # without the history step: what a crash between the table's commit and the history's leaves
            consolidate(cfg if keep else dataclasses.replace(cfg, history=()), spark)
            if keep:
                _check(cfg, qualified, base_rows, int(base_lsn), source_conn, compacted=True)
                # a re-run commits nothing and changes nothing
                opts = storage_options(cfg)
                version = open_delta(history_uri(cfg, qualified), opts).version()
                before = read_history(cfg, qualified)
                assert keep_histories(cfg, spark, options=opts) == {}
                consolidate(cfg, spark)
                assert open_delta(history_uri(cfg, qualified), opts).version() == version
                assert read_history(cfg, qualified).equals(before)
        if not keep:       # the last batch left its history behind: the next batch catches it up
            _apply(source_conn, table, [("insert", 99, "z")], live, state)
            drain_until_current(cfg)
            consolidate(cfg, spark)
        _check(cfg, qualified, base_rows, int(base_lsn), source_conn, compacted=True)
    finally:
        source_conn.autocommit = True
        with source_conn.cursor() as cur:
            cur.execute("SELECT pg_drop_replication_slot(%s)", (cfg.source.slot,))


def test_history_key_is_validated(make_stream, source_conn):
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.scd_bag (g int, t text)")
        cur.execute("ALTER TABLE public.scd_bag REPLICA IDENTITY FULL")
        cur.execute("CREATE TABLE public.scd_keyed (id int PRIMARY KEY)")
    source_conn.commit()
    from tidemark.config import validate_against_source

    cfg = make_stream(["public.scd_bag", "public.scd_keyed"], history=["public.scd_keyed", "public.scd_bag"])
    with pytest.raises(ConfigError, match=r"history\[1\]: public.scd_bag has no key \(REPLICA IDENTITY FULL\)"):
        validate_against_source(cfg, source_conn)
    from tidemark.capture.source import apply_stream

    with pytest.raises(ConfigError, match=r"history\[1\]: public.scd_bag has no key") as err:   # stream apply
        apply_stream(cfg)
    assert "\n" not in str(err.value)
    ok = make_stream(["public.scd_bag", "public.scd_keyed"], history=["public.scd_keyed"])
    assert not validate_against_source(ok, source_conn)
    every = make_stream(["public.scd_bag", "public.scd_keyed"], history="all")    # the keyed ones: a note
    assert validate_against_source(every, source_conn) == [
        "history: all: public.scd_bag has no key (REPLICA IDENTITY FULL), so it gets no history table"]
    doc = {"stream": "s", "source": {"connection": "c", "tables": ["public.a"]}, "landing": {"url": "/l"},
           "lake": {"path": "/k"}}
    for bad, msg in ((["public.b"], "history\\[0\\]: public.b is not one of source.tables"),
                     ("some", "history: must be 'all' or a list"),
                     (["public.a", "a"], "history\\[1\\]: public.a is listed twice")):
        with pytest.raises(ConfigError, match=msg):
            parse_config({**doc, "history": bad})
    assert [t.qualified for t in parse_config({**doc, "history": "all"}).history] == ["public.a"]


@pytest.mark.parametrize("mode", ["table", "resend"])
def test_a_resnapshot_closes_and_opens_the_versions_it_corrects(mode, make_stream, source_conn, spark):
    """Changes the slot never saw (the table out of the publication meanwhile) reach the lake with a
    re-snapshot: of the table alone (mode table: its correction deltas in the changelog) or of the
    stream (mode resend: a new load, compared with the open versions at its LSN). Either closes the
    versions it changes and opens the new ones at its LSN, and leaves the others open."""
    cfg, base_lsn, base_rows = _snapshotted(make_stream, source_conn, "public.scd_re", 5)
    try:
        with source_conn.cursor() as cur:
            cur.execute("UPDATE public.scd_re SET v = 'seen' WHERE id = 1")
        source_conn.commit()
        drain_until_current(cfg)
        consolidate(cfg, spark)
        pub = sql.Identifier(cfg.source.publication)
        with source_conn.cursor() as cur:      # changes the slot does not see
            cur.execute(sql.SQL("ALTER PUBLICATION {} DROP TABLE public.scd_re").format(pub))
            cur.execute("UPDATE public.scd_re SET v = 'unseen' WHERE id = 2")
            cur.execute("DELETE FROM public.scd_re WHERE id = 3")
            cur.execute("INSERT INTO public.scd_re VALUES (9, 'unseen')")
            cur.execute(sql.SQL("ALTER PUBLICATION {} ADD TABLE public.scd_re").format(pub))
        source_conn.commit()
        resnap = snapshot_stream(cfg, tables=["public.scd_re"], mode=mode)
        with source_conn.cursor() as cur:
            cur.execute("UPDATE public.scd_re SET v = 'after' WHERE id = 4")
        source_conn.commit()
        drain_until_current(cfg)
        consolidate(cfg, spark)
        if mode == "table":       # the corrections are in the changelog: the fold holds them
            _check(cfg, "public.scd_re", base_rows, int(base_lsn), source_conn)
        h = read_history(cfg, "public.scd_re").to_pylist()
        at = ({r["_valid_to_lsn"] for r in h if r["id"] in (2, 3) and not r["_is_current"]}
              | {r["_valid_from_lsn"] for r in h if r["id"] in (2, 9) and r["_is_current"]})
        assert at == {resnap.lsn}, (at, resnap.lsn)     # the re-snapshot's position
        by_key = {}
        for r in h:
            by_key.setdefault(r["id"], []).append((r["v"], r["_is_current"], r["_deleted"]))
        assert by_key[2] == [("s2", False, False), ("unseen", True, False)]
        assert by_key[3] == [("s3", False, True)]
        assert by_key[9] == [("unseen", True, False)]
        assert by_key[5] == [("s5", True, False)]          # untouched by the re-snapshot: still its first version
        assert by_key[1] == [("s1", False, False), ("seen", True, False)]
        # from Spark SQL: the table right before and right after the re-snapshot's position
        from tidemark.lake import register_history

        register_history(spark, cfg, "public.scd_re", "scd_re_history")

        def as_of(lsn):
            return sorted(tuple(r) for r in spark.sql(
                f"SELECT id, v FROM scd_re_history WHERE _valid_from_lsn <= {lsn} "
                f"AND (_valid_to_lsn IS NULL OR _valid_to_lsn > {lsn})").collect())

        assert as_of(resnap.lsn - 1) == [(1, "seen"), (2, "s2"), (3, "s3"), (4, "s4"), (5, "s5")]
        assert as_of(resnap.lsn) == [(1, "seen"), (2, "unseen"), (4, "s4"), (5, "s5"), (9, "unseen")]
    finally:
        with source_conn.cursor() as cur:
            cur.execute("SELECT pg_drop_replication_slot(%s)", (cfg.source.slot,))
        source_conn.commit()


def _open_files(cfg, table: str) -> dict[str, set[str]]:
    """{bucket directory: its open-* files} of the history's current Delta version (each with its key range)."""
    import pyarrow as pa

    out: dict[str, set[str]] = {}
    for a in pa.table(open_delta(history_uri(cfg, table), storage_options(cfg)).get_add_actions(flatten=True)
                      ).to_pylist():
        if "/open-" in a["path"]:
            assert a["min.id"] is not None and a["min.id"] <= a["max.id"], a
            out.setdefault(a["path"].split("/")[0], set()).add(a["path"])
    return out


def test_the_merge_job_keeps_the_history_and_a_crash_before_its_commit_is_caught_up(
        make_stream, source_conn, spark, monkeypatch):
    """A history at its changelog's frontier is folded by the merge job's own tasks (no second Spark
    job reading the changelog back) and committed after the table; a failure between the table's
    commit and the history's leaves the history behind with its written files uncommitted, and the
    next run catches it up from the changelog: the same versions as the fold of the changelog."""
    from tidemark.consolidate import history, plan

    monkeypatch.setattr(history, "OPEN_ROWS", 1)         # each open version a key range of its own
    table = "public.scd_inline"
    cfg, base_lsn, base_rows = _snapshotted(make_stream, source_conn, table, 40)
    opts = storage_options(cfg)

    def change(sql_text: str) -> None:
        with source_conn.cursor() as cur:
            cur.execute(sql_text)
        source_conn.commit()
        drain_until_current(cfg)

    try:
        change("UPDATE public.scd_inline SET v = 'a' WHERE id <= 10")
        consolidate(cfg, spark)            # the first load: the history opened from it (keep_histories)
        change("UPDATE public.scd_inline SET v = 'b' WHERE id % 3 = 0; DELETE FROM public.scd_inline WHERE id = 7;"
               "UPDATE public.scd_inline SET id = 107 WHERE id = 8; INSERT INTO public.scd_inline VALUES (50, 'n')")
        before = _open_files(cfg, table)
        plan.PHASES.clear()
        res = consolidate(cfg, spark)
        after = _open_files(cfg, table)
        # only the open files holding a changed key (or the range below a new one) are rewritten: a
        # bucket keeps some of its open files and replaces others
        assert any(before[b] & after.get(b, set()) and before[b] - after.get(b, set()) for b in before), (before, after)
        assert "history: commit (Delta, folded in the merge job)" in plan.PHASES, plan.PHASES
        assert "history: fold buckets (Spark job)" not in plan.PHASES, plan.PHASES
        assert res.history == {table: open_delta(history_uri(cfg, table), opts).version()}
        _check(cfg, table, base_rows, int(base_lsn), source_conn)

        change("UPDATE public.scd_inline SET v = 'c' WHERE id % 2 = 0; DELETE FROM public.scd_inline WHERE id = 11")
        version = open_delta(history_uri(cfg, table), opts).version()

        def crash(*a, **k):
            raise RuntimeError("killed between the table's commit and the history's")

        with monkeypatch.context() as m:
            m.setattr(history, "commit_merged", crash)
            with pytest.raises(Exception, match="killed between"):
                consolidate(cfg, spark)
        assert open_delta(history_uri(cfg, table), opts).version() == version    # the history is behind
        consolidate(cfg, spark)            # caught up from the changelog
        _check(cfg, table, base_rows, int(base_lsn), source_conn)
        assert keep_histories(cfg, spark, options=opts) == {}
    finally:
        with source_conn.cursor() as cur:
            cur.execute("SELECT pg_drop_replication_slot(%s)", (cfg.source.slot,))
        source_conn.commit()


@pytest.mark.parametrize("key_type", ["bigint", "text"])
def test_a_history_caught_up_reads_the_changelog_past_its_own_frontier_whatever_the_keys(
        key_type, make_stream, source_conn, spark):
    """A history left behind (a crash between the table's commit and the history's) catches up from the
    changelog commits past ITS frontier, whatever the key's values: bigint keys above every LSN, text
    keys. Found reading `history._plan`: its loop over the open files reused the frontier's name for a
    file's smallest key, so a catch-up skipped the changelog commits below that key: the bigint case
    lost batch 2's versions silently (the text case passed before the fix too)."""
    table = f"scd_{next(_names)}"
    qualified = f"public.{table}"
    key = (lambda g: 10**15 + g) if key_type == "bigint" else (lambda g: f"k{g:03d}")
    ident = sql.Identifier("public", table)
    cfg, base_lsn, base_rows = _snapshotted(make_stream, source_conn, qualified, 6, key_type, key)
    try:
        for n, keep in enumerate((True, False, True), start=1):
            with source_conn.cursor() as cur:
                cur.execute(sql.SQL("UPDATE {} SET v = %s WHERE id = %s").format(ident), (f"batch {n}", key(n)))
                cur.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(ident), (key(10 + n), f"new {n}"))
            source_conn.commit()
            drain_until_current(cfg)
            consolidate(cfg if keep else dataclasses.replace(cfg, history=()), spark)
        _check(cfg, qualified, base_rows, int(base_lsn), source_conn)
    finally:
        with source_conn.cursor() as cur:
            cur.execute("SELECT pg_drop_replication_slot(%s)", (cfg.source.slot,))
        source_conn.commit()
