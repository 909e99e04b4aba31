"""Snapshot as the first version, ADD/DROP COLUMN, TRUNCATE with its changelog, type changes,
and reading the lake through Spark."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from consolidate_kit import Lander, rows_counter, shape, snapshot, truncate, up
from tidemark.consolidate.cdc_file import read_cdc_all
from tidemark.consolidate.feed_files import changelog_key
from tidemark.consolidate import ConsolidateError, consolidate_stream
from tidemark.landing.store import open_store
from tidemark.lake import changelog_uri, open_delta, read_changelog, read_table, register_table, table_uri
from tidemark.pgtypes import arrow_schema

pytestmark = [pytest.mark.spark, pytest.mark.slow]

V1 = shape("acct", [("id", "int64", True), ("name", "text"), ("bal", "numeric", False, (12 << 16 | 2) + 4)], oid=9)
V2 = shape("acct", [("id", "int64", True), ("name", "text"), ("bal", "numeric", False, (12 << 16 | 2) + 4),
                    ("note", "text")], oid=9)
V3 = shape("acct", [("id", "int64", True), ("bal", "numeric", False, (12 << 16 | 2) + 4), ("note", "text")], oid=9)


def _changelog_sum(cfg, table, lower: int, upper: int, names: list[str]) -> Counter:
    """The sum of the changelog's diffs per row for times in ``[lower, upper)`` (zeros dropped)."""
    acc: Counter = Counter()
    for r in read_changelog(cfg, table).to_pylist():
        if lower <= r["_time"] < upper:
            acc[tuple(r[n] for n in names)] += r["_diff"]
    return Counter({k: v for k, v in acc.items() if v})


def test_snapshot_add_drop_column_truncate_and_spark_read(spark, make_stream, control):
    from decimal import Decimal

    cfg = make_stream(["public.acct"], consolidate={"buckets": 3})
    control.upsert_stream(cfg)
    snapshot(cfg, control, "s1", 100, {"public.acct": (V1, [{"id": i, "name": f"n{i}", "bal": f"{i}.50"}
                                                             for i in range(1, 21)])}, rows_per_file=6)
    res = consolidate_stream(cfg, spark=spark, target_rows=4)
    assert res.frontier_after == 100 and res.snapshots_loaded == ["s1"]
    lake = read_table(cfg, "public.acct")
    assert lake.schema == arrow_schema(V1) and lake.num_rows == 20
    assert open_delta(table_uri(cfg, "public.acct")).transaction_version(cfg.stream) == 100
    with control.tx() as cur:
        cur.execute("SELECT status FROM tidemark.snapshots WHERE stream = %s", (cfg.stream,))
        assert cur.fetchone()[0] == "loaded"

    lander = Lander(cfg, control)
    # ADD COLUMN note: later rows carry it, earlier rows read null
    lander.land(100, 200, [([up(V1, {"id": 1}, 110, -1, 0, image="key"), up(V1, {"id": 1, "name": "one", "bal": "1.00"}, 110, 1, 1)], []),
                           ([up(V2, {"id": 2}, 150, -1, 0, image="key"),
                             up(V2, {"id": 2, "name": "two", "bal": "2.00", "note": "hi"}, 150, 1, 1),
                             up(V2, {"id": 99, "name": "new", "bal": "0.01", "note": None}, 150, 1, 2)], [])])
    consolidate_stream(cfg, spark=spark, target_rows=4)
    lake = read_table(cfg, "public.acct")
    assert lake.schema == arrow_schema(V2) and lake.num_rows == 21
    rows = {r["id"]: r for r in lake.to_pylist()}
    assert rows[1] == {"id": 1, "name": "one", "bal": Decimal("1.00"), "note": None}
    assert rows[2]["note"] == "hi" and rows[3] == {"id": 3, "name": "n3", "bal": Decimal("3.50"), "note": None}

    # DROP COLUMN name: the lake reads as the source now does
    lander.land(200, 300, [([up(V3, {"id": 4}, 210, -1, 0, image="key"), up(V3, {"id": 4, "bal": "4.44", "note": "x"}, 210, 1, 1)], [])])
    consolidate_stream(cfg, spark=spark, target_rows=4)
    lake = read_table(cfg, "public.acct")
    assert lake.schema == arrow_schema(V3) and lake.num_rows == 21
    assert {r["id"]: r for r in lake.to_pylist()}[4] == {"id": 4, "bal": Decimal("4.44"), "note": "x"}
    df = register_table(spark, cfg, "public.acct", name="acct_view")
    assert df.columns == ["id", "bal", "note"]
    assert spark.sql("SELECT count(*) AS n, sum(bal) AS s FROM acct_view").collect()[0]["n"] == 21

    # TRUNCATE then inserts in one batch; the batch's changelog takes every old row out
    before = rows_counter(read_table(cfg, "public.acct"))
    lander.land(300, 400, [([up(V3, {"id": 5, "bal": "5.00", "note": None}, 305, 1, 0, xid=1)], []),
                           ([], [truncate(V3, 310, 0)]),
                           ([up(V3, {"id": 7, "bal": "7.00", "note": "after"}, 320, 1, 0)], [])])
    consolidate_stream(cfg, spark=spark, target_rows=4)
    assert rows_counter(read_table(cfg, "public.acct")) == Counter({(7, Decimal("7.00"), "after"): 1})
    expected = Counter({(7, Decimal("7.00"), "after"): 1})
    expected.update({k: -v for k, v in before.items()})
    assert _changelog_sum(cfg, "public.acct", 300, 400, ["id", "bal", "note"]) == expected


def test_type_change_is_refused_with_a_clear_error(spark, make_stream, control):
    cfg = make_stream(["public.acct"])
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=0, landed_upper=0)
    lander = Lander(cfg, control)
    lander.land(0, 10, [([up(V1, {"id": 1, "name": "a", "bal": "1.00"}, 5, 1, 0)], [])])
    consolidate_stream(cfg, spark=spark)
    changed = shape("acct", [("id", "int64", True), ("name", "int32"), ("bal", "numeric", False, (12 << 16 | 2) + 4)], oid=9)
    lander.land(10, 20, [([up(changed, {"id": 2, "name": 3, "bal": "1.00"}, 15, 1, 0)], [])])
    with pytest.raises(ConsolidateError, match="column name changed type"):
        consolidate_stream(cfg, spark=spark)
    assert control.stream(cfg.stream).frontier == 10


# -- generated: schema changes interleaved with truncates and idle batches ----------------------------

class _SchemaSource:
    """A simulated keyed table whose columns change: each batch is idle, or a few transactions of
    inserts/updates/deletes, possibly one ADD COLUMN or one DROP COLUMN (PostgreSQL's logical decoding
    shows a new shape on the next change), possibly a TRUNCATE."""

    KINDS = {"text": lambda r: r.choice([None, "a", "b", f"s{r.randint(0, 99)}"]),
             "int64": lambda r: r.choice([None, r.randint(-5, 5), r.randint(-10**12, 10**12)])}

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.cols: list[tuple] = [("id", "int64", True), ("v", "text")]
        self.rows: dict[int, dict] = {}
        self.next_id, self.next_col, self.lsn = 1, 0, 100
        self.ever: list[str] = ["id", "v"]

    @property
    def shape(self):
        return shape("t", self.cols, oid=7)

    def names(self) -> list[str]:
        return [c[0] for c in self.cols]

    def _value(self, kind: str):
        return self.KINDS[kind](self.rng)

    def _row(self, i: int) -> dict:
        return {"id": i, **{c[0]: self._value(c[1]) for c in self.cols[1:]}}

    def batch(self) -> tuple[int, int, list, str]:
        """(lower, upper, txns, what) of the next batch."""
        r, lower = self.rng, self.lsn
        what = r.choices(["idle", "add", "drop", "truncate", "plain"], [1, 2, 2, 1.5, 2])[0]
        if what == "drop" and len(self.cols) < 3:
            what = "add"
        txns = []
        if what != "idle":
            k = r.randint(1, 3)
            cut = r.randrange(k)
            for n in range(k):
                if n == 0 and what == "add":
                    name = f"c{self.next_col}"
                    self.next_col += 1
                    self.cols.append((name, r.choice(sorted(self.KINDS))))
                    self.ever.append(name)
                    for row in self.rows.values():
                        row[name] = None
                elif n == 0 and what == "drop":
                    gone = r.choice(self.cols[1:])
                    self.cols.remove(gone)
                    for row in self.rows.values():
                        row.pop(gone[0])
                txns.append(self._txn(truncating=what == "truncate" and n == cut))
        self.lsn += 100
        return lower, self.lsn, txns, what

    def _txn(self, truncating: bool) -> tuple[list, list]:
        r = self.rng
        self.lsn += r.randint(1, 5)
        t, ups, evs, pos = self.lsn, [], [], 0
        v = self.shape
        if truncating:
            evs.append(truncate(v, t, pos))
            pos += 1
            self.rows.clear()
        for _ in range(r.randint(1, 5)):
            op = r.choice(["ins", "ins", "upd", "del"]) if self.rows else "ins"
            if op == "ins":
                row = self._row(self.next_id)
                self.next_id += 1
                self.rows[row["id"]] = row
                ups.append(up(v, row, t, 1, pos)); pos += 1
            else:
                i = r.choice(sorted(self.rows))
                ups.append(up(v, {"id": i}, t, -1, pos, image="key")); pos += 1
                if op == "upd":
                    self.rows[i] = self._row(i)
                    ups.append(up(v, self.rows[i], t, 1, pos)); pos += 1
                else:
                    del self.rows[i]
        return ups, evs

    def counter(self) -> Counter:
        return Counter(tuple(row[n] for n in self.names()) for row in self.rows.values())


def _integrated(rows, names: list[str]) -> Counter:
    """Sum the diffs of changelog rows (dicts with ``_diff``) projected onto ``names``."""
    acc: Counter = Counter()
    for r in rows:
        acc[tuple(r.get(n) for n in names)] += r["_diff"]
    return Counter({k: v for k, v in acc.items() if v})


@pytest.mark.parametrize("seed", [11, 25])
def test_generated_schema_changes_truncates_and_idle_batches_integrate_to_the_source(spark, make_stream, control,
                                                                                     seed):
    """After every batch of a random sequence of ADD/DROP COLUMN, truncates, idle batches and changes:
    the lake table equals the source; the Delta changelog's schema is every column the table has had
    and its rows below the frontier, projected onto the source's columns now, integrate to the source;
    the table's Materialize CDC files tile ``[0, F)`` and integrate to it the same way."""
    rng = random.Random(seed)
    cfg = make_stream(["public.t"], consolidate={"buckets": 2})
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=0, landed_upper=0)
    src = _SchemaSource(rng)
    lander = Lander(cfg, control)
    store = open_store(cfg.landing.url)
    prefix = changelog_key(cfg.stream, "public.t", 0, 0).rsplit("/", 1)[0] + "/"
    lower, upper, txns, _ = src.batch()
    while not txns:                                 # the table exists from its first change on
        lower, upper, txns, _ = src.batch()
    lander.land(0, upper, txns)
    history = ["first"]
    for step in range(7):
        res = consolidate_stream(cfg, spark=spark)
        frontier = res.frontier_after
        assert frontier == upper, (history, res)
        names = src.names()
        lake = read_table(cfg, "public.t")
        assert lake.column_names == names, history
        assert rows_counter(lake) == src.counter(), history
        log_cols = [f.name for f in open_delta(changelog_uri(cfg, "public.t")).schema().fields]
        assert [c for c in log_cols if not c.startswith("_")] == src.ever, history
        log = [r for r in read_changelog(cfg, "public.t").to_pylist() if r["_time"] < frontier]
        assert _integrated(log, names) == src.counter(), history
        feed, covered = [], 0
        for key in sorted(k for k in store.list(prefix) if k.endswith(".avro")):
            ups, progress = read_cdc_all(store.get(key))
            for p in progress:
                assert p["lower"] == [covered], (key, history)
                covered = p["upper"][0]
            feed += [{**u["data"], "_diff": u["diff"]} for u in ups]
        assert covered == frontier, history
        assert _integrated(feed, names) == src.counter(), history
        if step == 6:
            break
        lower, upper, txns, what = src.batch()
        history.append(what)
        lander.land(lower, upper, txns)


def test_a_wide_table_survives_drop_and_add_column(spark, make_stream, control):
    """Tidemark's shape of a wide table does not fit a Delta description (4,000 characters): it is kept
    beside the table and every step (snapshot load, changes, DROP COLUMN, ADD COLUMN) goes on.

    150 columns: the shape (~22,500 characters) is far past the limit and Spark's whole-stage codegen
    field limit (100); a 1,000-column table goes the same way end to end against PostgreSQL in
    test_generated_schemas (its WIDE example: snapshot, changes, ADD and DROP COLUMN)."""
    import json

    from tidemark.lake import table_info

    cols = [("id", "int64", True)] + [(f"column_number_{i:04d}", "text") for i in range(149)]
    wide = shape("wide", cols, oid=21)
    dropped = shape("wide", cols[:1] + cols[2:], oid=21)                # DROP COLUMN column_number_0000
    added = shape("wide", cols[:1] + cols[2:] + [("extra", "int32")], oid=21)
    cfg = make_stream(["public.wide"])
    control.upsert_stream(cfg)
    row = {name: f"v{name[-4:]}" for name, *_ in cols[1:]}
    snapshot(cfg, control, "s1", 100, {"public.wide": (wide, [{"id": i, **row} for i in range(1, 6)])})
    consolidate_stream(cfg, spark=spark)
    lander = Lander(cfg, control)
    lander.land(100, 200, [([up(dropped, {"id": 1}, 150, -1, 0, image="key"),
                             up(dropped, {"id": 1, **{k: "new" for k in list(row)[1:]}}, 150, 1, 1)], [])])
    res = consolidate_stream(cfg, spark=spark)
    assert res.frontier_after == 200
    lake = read_table(cfg, "public.wide")
    assert lake.schema == arrow_schema(dropped) and lake.num_rows == 5
    assert {r["id"]: r["column_number_0148"] for r in lake.to_pylist()} == {1: "new", 2: "v0148", 3: "v0148",
                                                                             4: "v0148", 5: "v0148"}
    delta = open_delta(table_uri(cfg, "public.wide"), None)
    assert "table_schema_file" in json.loads(delta.metadata().description), "the shape is kept beside the table"
    assert table_info(delta)["table_schema"] == dropped.to_json()
    lander.land(200, 300, [([up(added, {"id": 9, **{k: "x" for k in list(row)[1:]}, "extra": 7}, 250, 1, 0)], [])])
    consolidate_stream(cfg, spark=spark)
    lake = read_table(cfg, "public.wide")
    assert lake.schema == arrow_schema(added) and lake.num_rows == 6
    assert table_info(open_delta(table_uri(cfg, "public.wide"), None))["table_schema"] == added.to_json()
