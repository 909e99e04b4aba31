"""External feeds: Materialize CDC files from another producer → manifest → Delta, by the format's rules.

The oracle is the integral of the feed the test wrote: the distinct ``(data, time, diff)`` below the
frontier, summed. Two tables, updates and progress split over files, duplicated and shuffled, a diff
of 2 (identical rows pre-consolidated), a time whose count is not met (frontier held, incident after
the timeout), a late file that completes it, a time given up with ``forget``, bad files
quarantined; and the seed's own example feed.
"""

from __future__ import annotations

import datetime as dt
import secrets
from collections import Counter

import pytest

from dbkit import dsn_uri
from tidemark import feeds, gaps
from tidemark.config import parse_config
from tidemark.consolidate import consolidate_stream
from tidemark.control import Control
from tidemark.lake import read_table, read_tables
from tidemark.landing.store import open_store

from feedkit import feed_file, seed_schema
from oracle import rows

pytestmark = [pytest.mark.spark, pytest.mark.slow]


_schema = seed_schema


PRICES = _schema([{"name": "id", "type": "long"}, {"name": "price", "type": ["null", "int"]}])
ITEMS = _schema([{"name": "sku", "type": "string"}, {"name": "qty", "type": "long"}])


def U(data: dict, time: int, diff: int) -> dict:
    return {"data": data, "time": time, "diff": diff}


def P(lower: int, upper: int, counts: dict[int, int]) -> tuple:
    return ("com.materialize.cdc.progress", {"lower": [lower], "upper": [upper],
                                             "counts": [{"time": t, "count": c} for t, c in sorted(counts.items())]})


def avro(schema, records: list) -> bytes:
    """A feed file: consecutive updates as one array datum, progress records as themselves."""
    datums: list = []
    for r in records:
        if isinstance(r, dict):
            if datums and isinstance(datums[-1], list):
                datums[-1].append(r)
            else:
                datums.append([r])
        else:
            datums.append(r)
    return feed_file(schema, datums)


class Producer:
    """Writes feed files into the stream's landing prefix and remembers what it sent (the oracle)."""

    def __init__(self, cfg):
        self.cfg, self.store, self.sent, self.n = cfg, open_store(cfg.landing.url), [], 0

    def put(self, table: str, schema, records: list, *, copies: int = 1) -> None:
        data = avro(schema, records)
        for _ in range(copies):
            self.n += 1
            self.store.put(f"{feeds.feed_prefix(self.cfg.stream, table)}{self.n:04d}-{secrets.token_hex(3)}.avro", data)
        self.sent += [(table, r) for r in records if isinstance(r, dict)]

    def integral(self, table: str, below: int) -> Counter:
        distinct = {(tuple(r["data"].values()), r["time"], r["diff"]) for t, r in self.sent if t == table}
        acc: Counter = Counter()
        for data, time, diff in distinct:
            if time < below:
                acc[data] += diff
        return +acc


@pytest.fixture
def feed_stream(tmp_path, control_dsn, monkeypatch):
    def make(tables):
        stream = f"f_{secrets.token_hex(4)}"
        monkeypatch.setenv(f"AIRFLOW_CONN_CTL_{stream.upper()}", dsn_uri(control_dsn))
        cfg = parse_config({"stream": stream, "source": {"kind": "feed", "tables": tables},
                            "control": {"connection": f"ctl_{stream}"}, "landing": {"url": str(tmp_path / "landing")},
                            "lake": {"path": str(tmp_path / "lake")},
                            "consolidate": {"buckets": 2, "count_timeout_seconds": 60}})
        feeds.register_feed_stream(cfg)
        return cfg
    return make


def _lake(cfg, table) -> Counter:
    return rows(read_table(cfg, table))


def _frontier(cfg) -> int:
    with Control(control_dsn_of(cfg)) as ctl:
        return ctl.stream(cfg.stream).frontier


def control_dsn_of(cfg):
    from tidemark.control import control_dsn

    return control_dsn(cfg)


def test_config_of_a_feed_refuses_postgres_keys():
    with pytest.raises(Exception, match="no connection, publication or slot"):
        parse_config({"stream": "x", "source": {"kind": "feed", "tables": ["a.b"], "slot": "s"},
                      "landing": {"url": "/tmp/x"}, "lake": {"path": "/tmp/y"}})
    with pytest.raises(Exception, match="source.kind"):
        parse_config({"stream": "x", "source": {"kind": "kafka", "tables": ["a.b"]},
                      "landing": {"url": "/tmp/x"}, "lake": {"path": "/tmp/y"}})


def test_external_feed_two_tables(feed_stream, spark, tmp_path):
    cfg = feed_stream(["public.prices", "shop.items"])
    prod = Producer(cfg)
    p_ups = [U({"id": 1, "price": 10}, 2, 1), U({"id": 2, "price": 20}, 2, 1),
             U({"id": 1, "price": 10}, 4, -1), U({"id": 1, "price": 11}, 4, 1), U({"id": 2, "price": 20}, 8, -1),
             U({"id": 3, "price": None}, 8, 1)]
    # prices: updates and progress in separate files, one duplicated, written out of order
    prod.put("public.prices", PRICES, [P(5, 10, {8: 2})])
    prod.put("public.prices", PRICES, p_ups[3:], copies=2)
    prod.put("public.prices", PRICES, p_ups[:3] + [P(0, 5, {2: 2, 4: 2})])
    # items: a diff of 2, a time (6) whose update is withheld, progress first
    prod.put("shop.items", ITEMS, [P(0, 10, {3: 1, 6: 1, 7: 1})])
    prod.put("shop.items", ITEMS, [U({"sku": "a", "qty": 1}, 7, -1), U({"sku": "a", "qty": 1}, 3, 2)], copies=2)
    # bad input: not Avro; a table the stream does not have
    prod.store.put(f"{feeds.feed_prefix(cfg.stream, 'public.prices')}zz-garbage.avro", b"not avro at all")
    prod.store.put(f"{feeds.feed_prefix(cfg.stream, 'public.other')}0001.avro", avro(PRICES, [P(0, 1, {})]))

    res = feeds.ingest(cfg)
    assert len(res.quarantined) == 2 and res.registered and res.segment is not None
    assert res.frontiers == {"public.prices": 10, "shop.items": 6}     # items held at its first unmet time
    assert (res.lower, res.upper) == (0, 10)                             # prices lands to its own frontier
    assert [(u["table"], u["time"], u["expected"], u["seen"]) for u in res.unmet] == [("shop.items", 6, 1, 0)]
    assert res.incident is None                                           # not yet past the timeout
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    again = feeds.ingest(cfg, now=later)                                  # idempotent: nothing new to land
    assert again.segment is None and again.frontiers == res.frontiers and again.incident is not None
    with Control(control_dsn_of(cfg)) as ctl:
        incs = {i["kind"]: i["detail"] for i in ctl.incidents(cfg.stream)}
        quarantined = ctl.feed_files(cfg.stream, status="quarantined")
    assert incs["counts_unmet"]["table"] == "shop.items" and incs["counts_unmet"]["time"] == 6
    report = gaps.detect(cfg)                 # the gap sensor: nothing to re-drain, the producer resends
    assert report.decision == "producer" and report.action == "consolidate"
    assert any("resend shop.items at time 6" in r for r in report.reasons)
    assert "resend" in incs["counts_unmet"]["action"]
    assert "not a readable Avro file" in {q["key"].rsplit("/", 1)[-1]: q["detail"] for q in quarantined}["zz-garbage.avro"]
    assert not prod.store.exists(f"{feeds.feed_prefix(cfg.stream, 'public.prices')}zz-garbage.avro")

    done = consolidate_stream(cfg, spark=spark)
    # each table at its own frontier: prices complete to 10 is readable there while items waits at 6;
    # the stream's frontier is the least, where every table reads consistently
    assert done.frontiers == {"public.prices": 10, "shop.items": 6} and _frontier(cfg) == done.frontier_after == 6
    assert _lake(cfg, "public.prices") == prod.integral("public.prices", 10) != prod.integral("public.prices", 6)
    assert _lake(cfg, "shop.items") == prod.integral("shop.items", 6) == Counter({("a", 1): 2})
    at6 = read_tables(cfg, frontier=6)
    for t in ("public.prices", "shop.items"):
        assert rows(at6[t]) == prod.integral(t, 6), t
    assert rows(read_table(cfg, "public.prices", frontier=10)) == prod.integral("public.prices", 10)
    with Control(control_dsn_of(cfg)) as ctl:
        assert ctl.table_frontiers(cfg.stream) == {"public.prices": {"landed_upper": 10, "frontier": 10},
                                                   "shop.items": {"landed_upper": 6, "frontier": 6}}
    from tidemark.status import stream_status

    shown = stream_status(cfg)
    assert shown["frontier"] == 6 and shown["table_frontiers"]["public.prices"] == {"landed_upper": 10, "frontier": 10}
    # a feed has no slot and no source database: nothing about either, and no error for it
    assert (shown["source"], shown["slot"], shown["slot_error"]) == ("feed", None, None)
    waiting = gaps.detect(cfg)
    assert (waiting.decision, waiting.action) == ("producer", "wait")    # nothing to consolidate until it comes
    assert consolidate_stream(cfg, spark=spark).skipped

    # the late file completes time 6; a late duplicate below the landed upper is harmless
    prod.put("shop.items", ITEMS, [U({"sku": "b", "qty": 5}, 6, 1)])
    prod.put("public.prices", PRICES, p_ups[:2])
    res = feeds.ingest(cfg)
    assert (res.lower, res.upper) == (6, 10) and not res.unmet
    assert res.frontiers == {"public.prices": 10, "shop.items": 10}
    caught = consolidate_stream(cfg, spark=spark)                        # both caught up
    assert caught.frontiers == {"public.prices": 10, "shop.items": 10} and _frontier(cfg) == 10
    for t in ("public.prices", "shop.items"):
        assert _lake(cfg, t) == prod.integral(t, 10) == rows(read_tables(cfg, frontier=10)[t]), t
    # a time never met, given up with forget
    prod.put("shop.items", ITEMS, [U({"sku": "c", "qty": 9}, 12, 1), P(10, 20, {12: 2})])
    prod.put("public.prices", PRICES, [P(10, 20, {})])
    assert feeds.ingest(cfg).frontiers == {"public.prices": 20, "shop.items": 12}
    out = feeds.forget(cfg, "shop.items", 12, "producer lost it")
    assert (out["expected"], out["seen"]) == (2, 1)
    assert feeds.ingest(cfg).frontiers == {"public.prices": 20, "shop.items": 20}
    consolidate_stream(cfg, spark=spark)
    assert _frontier(cfg) == 20
    for t in ("public.prices", "shop.items"):
        assert _lake(cfg, t) == prod.integral(t, 20), t
    with Control(control_dsn_of(cfg)) as ctl:
        assert [(f["table"], f["time"], f["seen"]) for f in ctl.feed_forgotten(cfg.stream)] == [("shop.items", 12, 1)]
        assert not [i for i in ctl.incidents(cfg.stream) if i["kind"] == "counts_unmet"]
    assert gaps.detect(cfg).action == "wait"
    # a late file with a distinct update at a time already complete: bad input, set aside and named
    prod.put("public.prices", PRICES, [U({"id": 9, "price": 1}, 2, 1)])
    prod.sent.pop()
    res = feeds.ingest(cfg)
    assert len(res.quarantined) == 1 and res.segment is None
    with Control(control_dsn_of(cfg)) as ctl:
        detail = {q["key"]: q["detail"] for q in ctl.feed_files(cfg.stream, status="quarantined")}[res.quarantined[0]]
        assert "3 distinct updates of public.prices at time 2, but the progress counts 2" in detail
    assert feeds.ingest(cfg).quarantined == []                            # once
    assert _lake(cfg, "public.prices") == prod.integral("public.prices", 20)
    # a subscriber of the feed stream, through the command line's Arrow output: the lake's integral
    import yaml

    from tidemark import subscribers
    from tidemark.cli import main as cli_main

    stream_file = tmp_path / "feed.yaml"
    stream_file.write_text(yaml.safe_dump(cfg.as_dict()))
    assert cli_main(["subscriber", "add", str(stream_file), "reader"]) == 0
    assert cli_main(["changes", str(stream_file), "--subscriber", "reader", "--format", "arrow",
                     "--out", str(tmp_path / "out"), "--ack"]) == 0
    import pyarrow as pa

    for t in ("public.prices", "shop.items"):
        got = pa.ipc.open_file(str(tmp_path / "out" / f"{t}.arrow")).read_all()
        acc: Counter = Counter()
        for r in got.to_pylist():
            acc[tuple(v for k, v in r.items() if not k.startswith("_"))] += r["_diff"]
        assert +acc == _lake(cfg, t), t
    assert subscribers.read_changes(cfg, "reader").num_changes == 0


def test_the_seeds_example_feed(feed_stream, spark):
    """The seed's example changefeed, verbatim (schema and records), in two files in reverse order."""
    cfg = feed_stream(["public.prices"])
    prod = Producer(cfg)
    schema = _schema([{"name": "id", "type": "long"}, {"name": "price", "type": ["null", "int"]}])
    prod.put("public.prices", schema, [P(3, 10, {4: 1, 5: 2, 6: 1}), U({"id": 5, "price": 12}, 5, -1)])
    prod.put("public.prices", schema, [U({"id": 5, "price": 10}, 5, 1), U({"id": 5, "price": 12}, 4, 1),
                                       P(0, 3, {})])
    res = feeds.ingest(cfg)
    assert res.upper == 6                       # the time-6 update is not there yet: count 1, seen 0
    consolidate_stream(cfg, spark=spark)
    assert _lake(cfg, "public.prices") == Counter({(5, 10): 1}) == prod.integral("public.prices", 6)
    prod.put("public.prices", schema, [U({"id": 5, "price": 10}, 6, -1)])
    assert feeds.ingest(cfg).upper == 10
    consolidate_stream(cfg, spark=spark)
    assert _lake(cfg, "public.prices") == Counter() == prod.integral("public.prices", 10)
    assert _frontier(cfg) == 10


def test_gap_sensor_producer_branch_resend_and_forget(feed_stream, spark, tmp_path):
    """The gap sensor's ``producer`` branch end to end: a time whose count stays unmet becomes a
    ``counts_unmet`` incident asking the producer to resend (the other table goes on meanwhile); the
    resent file resolves it and the table catches up; a time never resent is given up with
    ``tidemark feed forget`` (recorded with expected and seen counts) and the frontier moves past it."""
    import yaml

    from tidemark.cli import main as cli_main

    cfg = feed_stream(["public.prices", "shop.items"])
    stream_file = tmp_path / "feed.yaml"
    stream_file.write_text(yaml.safe_dump(cfg.as_dict()))
    prod = Producer(cfg)
    at2 = [U({"id": 1, "price": 10}, 2, 1), U({"id": 2, "price": 20}, 2, 1)]
    lost = U({"id": 1, "price": 10}, 5, -1)
    prod.put("public.prices", PRICES, at2 + [P(0, 10, {2: 2, 5: 1})])       # the update at 5 never came
    prod.sent.append(("public.prices", lost))                               # ... but the producer has it
    prod.put("shop.items", ITEMS, [U({"sku": "a", "qty": 1}, 3, 1), U({"sku": "b", "qty": 2}, 7, 1),
                                   P(0, 10, {3: 1, 7: 1})])
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)

    def open_unmet():
        with Control(control_dsn_of(cfg)) as ctl:
            return [(i["detail"]["table"], i["detail"]["time"]) for i in ctl.incidents(cfg.stream)
                    if i["kind"] == "counts_unmet"]

    assert feeds.ingest(cfg).frontiers == {"public.prices": 5, "shop.items": 10}
    assert open_unmet() == [] and gaps.detect(cfg).decision == "ok"       # not yet past the timeout
    assert feeds.ingest(cfg, now=later).incident is not None
    assert open_unmet() == [("public.prices", 5)]
    report = gaps.detect(cfg)
    assert (report.decision, report.action) == ("producer", "consolidate")
    assert any("ask the producer to resend public.prices at time 5" in r for r in report.reasons), report.reasons
    consolidate_stream(cfg, spark=spark)
    assert _lake(cfg, "shop.items") == prod.integral("shop.items", 10)     # not held back by prices
    assert _lake(cfg, "public.prices") == prod.integral("public.prices", 5)
    report = gaps.detect(cfg)
    assert (report.decision, report.action) == ("producer", "wait")

    # the producer resends the table's updates at that time (with a duplicate of earlier ones and progress)
    prod.put("public.prices", PRICES, [at2[0], lost, P(0, 10, {2: 2, 5: 1})])
    res = feeds.ingest(cfg)
    assert res.frontiers == {"public.prices": 10, "shop.items": 10} and not res.quarantined
    assert open_unmet() == []
    with Control(control_dsn_of(cfg)) as ctl:
        resolved = [i for i in ctl.incidents(cfg.stream, open_only=False) if i["kind"] == "counts_unmet"]
    assert [i["resolution"] for i in resolved] == ["met: the updates of time 5 arrived"]
    assert gaps.detect(cfg).action == "consolidate"
    consolidate_stream(cfg, spark=spark)
    assert _frontier(cfg) == 10
    for t in ("public.prices", "shop.items"):
        assert _lake(cfg, t) == prod.integral(t, 10), t
    assert (gaps.detect(cfg).decision, gaps.detect(cfg).action) == ("ok", "wait")

    # a time the producer cannot resend: given up from the command line
    prod.put("shop.items", ITEMS, [U({"sku": "c", "qty": 9}, 12, 1), P(10, 20, {12: 2})])
    prod.put("public.prices", PRICES, [U({"id": 3, "price": 30}, 15, 1), P(10, 20, {15: 1})])
    assert feeds.ingest(cfg, now=later).frontiers == {"public.prices": 20, "shop.items": 12}
    report = gaps.detect(cfg)
    assert report.decision == "producer"
    assert any(f"tidemark feed forget {cfg.stream} shop.items 12" in r for r in report.reasons), report.reasons
    assert cli_main(["feed", "forget", str(stream_file), "shop.items", "12", "--reason", "producer lost it"]) == 0
    with Control(control_dsn_of(cfg)) as ctl:
        assert [(f["table"], f["time"], f["expected"], f["seen"], f["reason"]) for f in ctl.feed_forgotten(cfg.stream)] \
            == [("shop.items", 12, 2, 1, "producer lost it")]
    assert open_unmet() == []
    assert feeds.ingest(cfg).frontiers == {"public.prices": 20, "shop.items": 20}
    consolidate_stream(cfg, spark=spark)
    assert _frontier(cfg) == 20
    for t in ("public.prices", "shop.items"):
        assert _lake(cfg, t) == prod.integral(t, 20), t                   # what did arrive at 12 is taken
    assert (gaps.detect(cfg).decision, gaps.detect(cfg).action) == ("ok", "wait")
