"""The standard feed and the subscribers against PostgreSQL itself.

A workload in three batches over four tables (the seed's own shape ``(id bigint, price int)``, a
table whose column names Avro cannot hold, a multiset table with identical rows, and a table that
never changes). Then:

* every table's Materialize CDC files are read with the seed's exact reader schema (fastavro
  schema resolution) and fed, shuffled and with duplicates, to a reference consumer that follows the
  seed's semantics (progress from time 0, dedup by counts, wait for counts, reorder by time); each
  feed integrates to the source at the stream's frontier, idle table included;
* subscriber ``fast`` reads a few transactions at a time and acknowledges after each batch: its
  integral equals the source after every batch; ``slow`` reads once at the end, crashes before its
  ack (the re-read returns the same changes), then acknowledges through the command line;
  ``status`` reports the lagging one.
"""

from __future__ import annotations

import io
import json
import random
from collections import Counter, defaultdict

import pytest
import yaml

from tidemark import subscribers
from tidemark.capture.snapshot import snapshot_stream
from tidemark.cli import main as cli_main
from tidemark.consolidate import consolidate_stream
from tidemark.consolidate.cdc_file import feed_field_names, read_cdc_all
from tidemark.consolidate.preconsolidate import plain
from tidemark.status import stream_status
from tidemark.landing.store import open_store, stream_keys
from tidemark.pgtypes import table_schema_from_catalog

from feedkit import SEED_READER
from oracle import drain_until_current, norm, row_tuples, rows, source_table

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SETUP = """
CREATE TABLE prices (id bigint PRIMARY KEY, price int);
CREATE TABLE "Odd Names" ("order id" int PRIMARY KEY, "1st" text, "a b" text, a_b text);
CREATE TABLE bag (x int, y text);
ALTER TABLE bag REPLICA IDENTITY FULL;
CREATE TABLE idle (id int PRIMARY KEY, v text);
INSERT INTO prices VALUES (1, 10), (2, NULL), (3, 30);
INSERT INTO "Odd Names" VALUES (1, 'one', 'x', 'y');
INSERT INTO bag VALUES (1, 'dup'), (1, 'dup'), (2, 'solo');
INSERT INTO idle VALUES (1, 'never changes'), (2, 'me neither');
"""
TABLES = ["public.prices", 'public."Odd Names"', "public.bag", "public.idle"]
QUALIFIED = ["public.prices", 'public."Odd Names"', "public.bag", "public.idle"]

def _batch(cur, rng: random.Random, n: int) -> None:
    for _ in range(n):
        cur.execute("BEGIN")
        op = rng.choice(["price", "ins", "del", "odd", "bag", "multi"])
        if op == "price":
            cur.execute("UPDATE prices SET price = %s WHERE id = (SELECT id FROM prices ORDER BY random() LIMIT 1)",
                        (rng.choice([None, rng.randint(1, 99)]),))
        elif op == "ins":
            cur.execute("INSERT INTO prices SELECT COALESCE(max(id), 0) + 1, %s FROM prices", (rng.randint(1, 99),))
        elif op == "del":
            cur.execute("DELETE FROM prices WHERE id = (SELECT id FROM prices ORDER BY random() LIMIT 1)")
        elif op == "odd":
            cur.execute('INSERT INTO "Odd Names" SELECT COALESCE(max("order id"), 0) + 1, %s, %s, %s FROM "Odd Names"',
                        (rng.choice(["a", None]), "p", "q"))
            cur.execute('UPDATE "Odd Names" SET "a b" = %s WHERE "order id" = 1', (str(rng.random()),))
        elif op == "bag":
            cur.execute("INSERT INTO bag VALUES (%s, 'dup'), (%s, 'dup')", (rng.randint(1, 2),) * 2)
            cur.execute("DELETE FROM bag WHERE ctid = (SELECT ctid FROM bag ORDER BY random() LIMIT 1)")
        else:   # one transaction over two tables, and a change that is undone within it
            cur.execute("UPDATE prices SET price = -1 WHERE id = (SELECT min(id) FROM prices)")
            cur.execute("INSERT INTO bag VALUES (9, 'tx')")
            cur.execute("UPDATE prices SET price = price WHERE id = (SELECT max(id) FROM prices)")
        cur.execute("COMMIT")


def _source(conn, shapes) -> dict[str, Counter]:
    return {t: rows(source_table(conn, shapes[t])) for t in QUALIFIED}


def _integrate(changes, into: dict[str, Counter], names: dict[str, list[str]]) -> None:
    for table, tab in changes.tables.items():
        for row, d in zip(row_tuples(tab.select(names[table])), tab.column("_diff").to_pylist()):
            into[table][row] += d


# -- the reference consumer: the seed's semantics, nothing of Tidemark's --------------------------------

def reference_consume(records: list) -> tuple[int, Counter]:
    """``records``: ("u", update) / ("p", progress) in arrival order (any order, duplicates). Returns
    (frontier, the integral of the updates below it). Distinct ``(data, time, diff)`` count once; a
    time's updates count only once its progress count is met; updates are applied in time order."""
    seen: dict[int, set] = defaultdict(set)
    counts: dict[int, int] = {}
    intervals = []
    for kind, r in records:
        if kind == "u":
            seen[r["time"]].add((tuple(norm(v) for v in r["data"].values()), r["diff"]))
        else:
            intervals.append((r["lower"][0], r["upper"][0]))
            for c in r["counts"]:
                assert counts.setdefault(c["time"], c["count"]) == c["count"], "progress records disagree"
    frontier = 0
    for lo, up in sorted(intervals):
        if lo > frontier:
            break
        frontier = max(frontier, up)
    for t in sorted(counts):
        if t < frontier and len(seen[t]) < counts[t]:
            frontier = t
            break
    state: Counter = Counter()
    for t in sorted(seen):
        if t >= frontier:
            continue
        assert len(seen[t]) == counts.get(t, 0), (t, "more distinct updates than counted")
        assert len({data for data, _ in seen[t]}) == len(seen[t]), "two diffs for one (data, time)"
        for data, diff in seen[t]:
            state[data] += diff
    return frontier, +state


def _feed_records(store, prefix: str, rng: random.Random) -> tuple[list, list]:
    """Every update and progress record of a table's feed files, files shuffled and some duplicated."""
    keys = [k for k in store.list(prefix) if k.endswith(".avro")]
    assert keys, prefix
    files = [store.get(k) for k in keys]
    first_progress = []
    order = files + rng.sample(files, k=max(1, len(files) // 2))
    rng.shuffle(order)
    records = []
    for data in order:
        updates, progress = read_cdc_all(data)
        first_progress.append(progress[0])
        records += [("u", u) for u in updates] + [("p", p) for p in progress]
    rng.shuffle(records)
    return records, first_progress


def test_standard_feed_and_subscribers(make_stream, source_conn, spark, tmp_path):
    import fastavro

    rng = random.Random(12)
    cur = source_conn.cursor()
    cur.execute("SET synchronous_commit = on")
    cur.execute(SETUP)
    cfg = make_stream(TABLES, drain={"idle_timeout_seconds": 0.5}, consolidate={"buckets": 2})
    assert [t.qualified for t in cfg.source.tables] == QUALIFIED
    shapes = {t.qualified: table_schema_from_catalog(source_conn, t.schema, t.name) for t in cfg.source.tables}
    names = {t: [c.name for c in shapes[t].columns] for t in QUALIFIED}
    snapshot_stream(cfg)
    subscribers.add_subscriber(cfg, "fast")
    subscribers.add_subscriber(cfg, "slow")
    with pytest.raises(subscribers.SubscriberError, match="already exists"):
        subscribers.add_subscriber(cfg, "fast")
    with pytest.raises(subscribers.SubscriberError, match="reserved"):
        subscribers.add_subscriber(cfg, "consolidate")

    fast: dict[str, Counter] = {t: Counter() for t in QUALIFIED}
    for batch in range(3):
        _batch(cur, rng, 6)
        expected = _source(source_conn, shapes)
        drain_until_current(cfg)
        consolidate_stream(cfg, spark=spark)
        reads = 0
        while True:     # a few whole transactions at a time, acknowledged one read after another
            ch = subscribers.read_changes(cfg, "fast", max_transactions=3)
            if ch.upper == ch.lower:
                break
            assert len(ch.times()) <= 3
            for tx in ch.transactions():     # whole transactions: every table's rows of a time together
                assert tx["changes"] and len({c["table"] for c in tx["changes"]}) >= 1
            _integrate(ch, fast, names)
            subscribers.ack(cfg, "fast", ch.upper)
            reads += 1
        assert reads >= 2
        assert {t: +c for t, c in fast.items()} == expected, batch

    status = stream_status(cfg)
    assert status["lagging_subscribers"] == ["slow"]
    assert {s["name"]: s["lagging"] for s in status["subscribers"]} == {"fast": False, "slow": True}

    # slow: everything at once; a crash before the ack re-reads the same changes
    first = subscribers.read_changes(cfg, "slow")
    again = subscribers.read_changes(cfg, "slow")
    assert (first.lower, first.upper) == (again.lower, again.upper) == (0, status["frontier"])
    assert {t: plain(x).to_pylist() for t, x in first.tables.items()} == \
           {t: plain(x).to_pylist() for t, x in again.tables.items()}
    slow = {t: Counter() for t in QUALIFIED}
    _integrate(again, slow, names)
    assert {t: +c for t, c in slow.items()} == expected
    # the command line: the same changes as JSON lines, acknowledged once written
    stream_file = tmp_path / "stream.yaml"
    stream_file.write_text(yaml.safe_dump(cfg.as_dict()))
    out = tmp_path / "out.jsonl"
    import contextlib

    with open(out, "w") as fh, contextlib.redirect_stdout(fh):
        assert cli_main(["changes", str(stream_file), "--subscriber", "slow", "--ack"]) == 0
    txs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [tx["time"] for tx in txs] == sorted(first.times())
    assert sum(len(tx["changes"]) for tx in txs) == first.num_changes
    assert subscribers.read_changes(cfg, "slow").num_changes == 0
    assert stream_status(cfg)["lagging_subscribers"] == []
    with io.StringIO() as buf, contextlib.redirect_stdout(buf):
        assert cli_main(["subscriber", "list", str(stream_file)]) == 0
        assert "slow" in buf.getvalue() and "fast" in buf.getvalue()
    assert cli_main(["subscriber", "drop", str(stream_file), "slow"]) == 0
    assert [s["name"] for s in subscribers.list_subscribers(cfg)] == ["fast"]

    # the standard feed, per table: seed reader schema, reference consumer, from time 0, idle too
    store = open_store(cfg.landing.url)
    frontier = status["frontier"]
    for t in QUALIFIED:
        prefix = f"{stream_keys(cfg.stream)['changelog']}{t}/"
        records, firsts = _feed_records(store, prefix, rng)
        assert min(p["lower"][0] for p in firsts) == 0, t
        got_frontier, state = reference_consume(records)
        assert got_frontier == frontier, t
        assert state == expected[t], t
        # holding back one update of a counted time holds the consumer's frontier at that time
        ups = [r for r in records if r[0] == "u"]
        victim = ups[0][1]
        held = [r for r in records if not (r[0] == "u" and r[1] == victim)]
        assert reference_consume(held)[0] == victim["time"], t
    # column names as in the source; Avro-impossible ones by the documented rule (doc = real name)
    odd_key = [k for k in store.list(f"{stream_keys(cfg.stream)['changelog']}public.\"Odd Names\"/")][0]
    schema = fastavro.reader(io.BytesIO(store.get(odd_key))).writer_schema
    fields = schema[0]["items"]["fields"][0]["type"]["fields"]
    assert [f["name"] for f in fields] == ["order_id", "_1st", "a_b_2", "a_b"] == \
           feed_field_names(names['public."Odd Names"'])
    assert [f["doc"] for f in fields] == names['public."Odd Names"']
    # the seed's exact reader schema resolves against the prices feed (fastavro schema resolution)
    seen = []
    for key in store.list(f"{stream_keys(cfg.stream)['changelog']}public.prices/"):
        for datum in fastavro.reader(io.BytesIO(store.get(key)), reader_schema=SEED_READER):
            seen.append(datum)
    ups = [u for d in seen if isinstance(d, list) for u in d]
    assert ups and set(ups[0]["data"]) == {"id", "price"}
    assert any(isinstance(d, dict) and d["lower"] == [0] for d in seen)
