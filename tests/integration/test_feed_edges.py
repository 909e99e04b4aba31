"""External feeds at the format's edges, generated: NaN/±Inf/-0.0 values, duplicates, files invalid in
themselves mixed with good ones, a time given up with ``feed forget`` followed by a retraction of
the row it lost and by a late arrival of the lost update.

The producer here is the test's own: it keeps the distinct ``(data, time, diff)`` it meant to send,
and the oracle is their integral by docs/segment-format.md's rules, computed independently of Tidemark (its own
identity of a value: a NaN is a NaN, -0.0 is not 0.0): every update counts once; an update of a
forgotten time that was not there when the time landed is lost (reported when it arrives, not
applied); a retraction of more copies of a row than the table holds after a forget takes out what
is held (the rest is skipped, recorded). After every ingest + consolidate each table must equal
that integral at its own frontier and at the stream's (``read_tables(frontier=F)``), no good file
may be quarantined, and every bad one must be, alone, with a ``feed_file_bad`` incident naming it
and the rule it breaks.
"""

from __future__ import annotations

import math
import os
import random
import secrets
import shutil
import struct
import tempfile
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dbkit import dsn_uri
from tidemark import feeds
from tidemark.config import parse_config
from tidemark.consolidate import consolidate_stream
from tidemark.control import Control, control_dsn
from tidemark.lake import read_table, read_tables
from tidemark.landing.store import open_store

from feedkit import feed_file, seed_schema

pytestmark = [pytest.mark.spark, pytest.mark.slow]

M, K = "public.m", "shop.k"
SCHEMAS = {M: seed_schema([{"name": "x", "type": ["null", "double"]}, {"name": "n", "type": "long"}]),
           K: seed_schema([{"name": "y", "type": ["null", "float"]}, {"name": "s", "type": "string"}])}
_NAN2 = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]     # a NaN with another payload
FLOATS = [float("nan"), _NAN2, float("inf"), float("-inf"), -0.0, 0.0, 1.5, None]


def ident(v):
    """The test's own identity of a value: every NaN one value, -0.0 apart from 0.0."""
    if isinstance(v, float):
        if math.isnan(v):
            return ("nan",)
        if v == 0.0:
            return ("zero", math.copysign(1.0, v))
    return v


def row_id(table: str, data: dict) -> tuple:
    return tuple(ident(data[c]) for c in (("x", "n") if table == M else ("y", "s")))


def lake_rows(arrow) -> Counter:
    names = arrow.column_names
    return Counter(tuple(ident(r[c]) for c in names) for r in arrow.to_pylist())


def U(data, time, diff):
    return {"data": data, "time": time, "diff": diff}


def P(lower, upper, counts: dict):
    return ("com.materialize.cdc.progress", {"lower": [lower], "upper": [upper],
                                             "counts": [{"time": t, "count": c} for t, c in sorted(counts.items())]})


def datums(records: list) -> list:
    out: list = []
    for r in records:
        if isinstance(r, dict):
            if out and isinstance(out[-1], list):
                out[-1].append(r)
            else:
                out.append([r])
        else:
            out.append(r)
    return out


class Producer:
    """What the producer meant (``sent``: distinct updates per table), what it wrote, what is bad."""

    def __init__(self, cfg, rng: random.Random):
        self.cfg, self.rng = cfg, rng
        self.store = open_store(cfg.landing.url)
        self.sent = {M: [], K: []}          # (row id, data, time, diff)
        self.lost: set = set()              # (table, row id, time, diff): forgotten, never applied
        self.state = {M: Counter(), K: Counter()}    # what the producer believes each table holds
        self.data = {M: {}, K: {}}         # row id -> a data dict
        self.bad: dict[str, str] = {}      # key -> rule
        self.good: list[tuple[str, bytes]] = []
        self.n = 0

    def key(self, table: str, tag: str = "") -> str:
        self.n += 1
        return f"{feeds.feed_prefix(self.cfg.stream, table)}{tag}{self.n:04d}-{secrets.token_hex(3)}.avro"

    def put(self, table: str, records: list, *, copies: int = 1) -> None:
        body = feed_file(SCHEMAS[table], datums(records))
        for _ in range(copies):
            k = self.key(table)
            self.store.put(k, body)
            self.good.append((k, body))

    def put_bad(self, table: str, rule: str, body: bytes) -> None:
        k = self.key(table, "0000-bad-")         # sorts first: it would be the reference if registered
        self.store.put(k, body)
        self.bad[k] = rule

    def row(self, table: str) -> dict:
        v = self.rng.choice(FLOATS)
        if table == M:
            return {"x": v, "n": self.rng.randint(0, 1)}
        return {"y": v, "s": self.rng.choice(["a", "b"])}

    def updates(self, table: str, lo: int, up: int, force: list | None = None) -> list[dict]:
        """Updates at 1-3 times in (lo, up), in time order: inserts of pool rows, retractions of rows
        the producer holds then; one diff per (data, time); ``force``: updates to include (a
        retraction only while the producer holds the row)."""
        forced: dict[int, list] = {}
        for u in force or []:
            forced.setdefault(u["time"], []).append(u)
        times = set(self.rng.sample(range(lo + 1, up), k=self.rng.randint(1, 3))) | set(forced)
        out = []
        held = self.state[table]
        for t in sorted(times):
            used = set()
            todo = [(u["data"], u["diff"]) for u in forced.get(t, [])]
            for _ in range(self.rng.randint(0 if t in forced else 1, 3)):
                live = sorted((r for r, c in held.items() if c > 0), key=repr)
                if live and self.rng.random() < 0.4:
                    rid = self.rng.choice(live)
                    todo.append((self.data[table][rid], -self.rng.randint(1, held[rid])))
                else:
                    todo.append((self.row(table), self.rng.choice([1, 1, 2])))
            for data, diff in todo:
                rid = row_id(table, data)
                if rid in used or held[rid] + diff < 0:
                    continue
                used.add(rid)
                self.data[table].setdefault(rid, data)
                held[rid] += diff
                u = U(data, t, diff)
                out.append(u)
                self.sent[table].append((rid, data, t, diff))
        return out

    def send_round(self, table: str, lo: int, up: int, ups: list[dict], withheld: list[dict] = ()) -> None:
        """The round's updates in two files (a NaN update in both: a duplicate by value), the progress
        in one of them or its own file, one file written twice; ``withheld`` counted, not sent."""
        counts = Counter(u["time"] for u in ups)
        prog = P(lo, up, dict(counts))
        ups = [u for u in ups if u not in withheld]
        self.rng.shuffle(ups)
        cut = self.rng.randint(0, len(ups))
        a, b = ups[:cut], ups[cut:]
        for u in ups:
            x = u["data"]["x" if table == M else "y"]
            if isinstance(x, float) and math.isnan(x):
                (b if u in a else a).append(u)
        where = self.rng.choice(["a", "b", "own"])
        files = [a + ([prog] if where == "a" else []), b + ([prog] if where == "b" else [])]
        if where == "own":
            files.append([prog])
        self.rng.shuffle(files)
        for i, f in enumerate(files):
            if f:
                self.put(table, f, copies=2 if i == 0 else 1)

    def bad_file(self, table: str, lo: int, up: int, ups: list[dict]) -> None:
        """One file invalid in itself, whose counts would contradict the good files' if it registered."""
        kind = self.rng.choice(["negative", "fraction", "outside", "inverted", "zero-diff", "not-avro"])
        t = ups[0]["time"] if ups else lo + 1
        schema = SCHEMAS[table]
        if kind == "negative":
            body, rule = feed_file(schema, datums(ups[:1] + [P(lo, up, {t: -1})])), "count"
        elif kind == "fraction":
            odd = [dict(b) for b in schema]
            odd[1] = {**odd[1], "fields": [*odd[1]["fields"][:2], {"name": "counts", "type": {
                "type": "array", "items": {"type": "record", "name": "counts", "fields": [
                    {"name": "time", "type": "long"}, {"name": "count", "type": "double"}]}}}]}
            body = feed_file(odd, [("com.materialize.cdc.progress",
                                    {"lower": [lo], "upper": [up], "counts": [{"time": t, "count": 0.5}]})])
            rule = "count"
        elif kind == "outside":
            body, rule = feed_file(schema, datums([P(lo, up, {up + 3: 1, t: 7})])), "count-time"
        elif kind == "inverted":
            body, rule = feed_file(schema, datums([P(up, lo, {})])), "progress-interval"
        elif kind == "zero-diff":
            body, rule = feed_file(schema, datums([U(ups[0]["data"] if ups else self.row(table), t, 0),
                                                   P(lo, up, {t: 1})])), "diff"
        else:
            body, rule = b"Obj\x01 not really", "avro"
        self.put_bad(table, rule, body)

    def integral(self, table: str, below: int) -> tuple[Counter, int]:
        """The oracle: the table below ``below`` by docs/segment-format.md's rules; and how many copies of
        retractions were skipped (a forget lost what they take out)."""
        state: Counter = Counter()
        skipped = 0
        for rid, _, t, diff in sorted(self.sent[table], key=lambda s: s[2]):
            if t >= below or (table, rid, t, diff) in self.lost:
                continue
            state[rid] += diff
            if state[rid] < 0:
                assert any(x[0] == table and x[2] < t for x in self.lost), "only a forget makes this"
                skipped += -state[rid]
                state[rid] = 0
        return +state, skipped


def _ctl(cfg):
    return Control(control_dsn(cfg))


def _check(cfg, prod: Producer, expect: dict[str, int]) -> None:
    """Each table at its expected frontier equals the oracle there, also read at the stream frontier;
    the quarantine holds exactly the bad files, each with its incident naming the file and rule."""
    with _ctl(cfg) as ctl:
        positions = ctl.table_frontiers(cfg.stream)
        quarantined = {q["key"]: q["detail"] for q in ctl.feed_files(cfg.stream, status="quarantined")}
        incidents = [i["detail"] for i in ctl.incidents(cfg.stream, open_only=False) if i["kind"] == "feed_file_bad"]
        frontier = ctl.stream(cfg.stream).frontier
    assert {t: p["frontier"] for t, p in positions.items()} == expect
    assert set(quarantined) == set(prod.bad), "a good file was quarantined, or a bad one was not"
    named = {d.get("key"): d.get("rule") for d in incidents}
    for key, rule in prod.bad.items():
        assert named.get(key) == rule, (key, rule, named.get(key), quarantined[key])
    for table, f in expect.items():
        assert lake_rows(read_table(cfg, table)) == prod.integral(table, f)[0], (table, f)
    assert frontier == min(expect.values())
    at = read_tables(cfg, frontier=frontier)
    for table in expect:
        assert lake_rows(at[table]) == prod.integral(table, frontier)[0], (table, "at the stream frontier", frontier)


def _incidents(cfg, kind: str) -> list[dict]:
    with _ctl(cfg) as ctl:
        return [i["detail"] for i in ctl.incidents(cfg.stream, open_only=False) if i["kind"] == kind]


@pytest.fixture(scope="module")
def scratch():
    path = tempfile.mkdtemp(prefix="tidemark-feed-edges-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), rounds=st.integers(3, 4))
def test_feed_edges_generated(seed, rounds, control_dsn, spark, scratch):
    rng = random.Random(seed)
    stream = f"e_{secrets.token_hex(4)}"
    os.environ[f"AIRFLOW_CONN_CTL_{stream.upper()}"] = dsn_uri(control_dsn)
    root = os.path.join(scratch, stream)
    cfg = parse_config({"stream": stream, "source": {"kind": "feed", "tables": [M, K]},
                        "control": {"connection": f"ctl_{stream}"}, "landing": {"url": f"{root}/landing"},
                        "lake": {"path": f"{root}/lake"},
                        "consolidate": {"buckets": 2, "count_timeout_seconds": 3600}})
    feeds.register_feed_stream(cfg)
    prod = Producer(cfg, rng)
    lost_row = {"x": float("nan"), "n": 7}           # m's update given up in round 1
    withheld = None
    for r in range(rounds):
        lo, up = 10 * r, 10 * r + 10
        force = {M: [], K: []}
        if r == 0:      # a NaN row in k, retracted in round 1: its changelog adds and removes it
            force[K] = [U({"y": float("nan"), "s": "z"}, 1, 1)]
        if r == 1:
            withheld = U(lost_row, 15, 1)
            force[M] = [withheld]
            force[K] = [U({"y": float("nan"), "s": "z"}, 13, -1)]
        if r == 2:      # the producer retracts the row whose addition was forgotten
            force[M] = [U(lost_row, 21, -1)]
        ups = {t: prod.updates(t, lo, up, force[t]) for t in (M, K)}
        for table in (M, K):
            prod.send_round(table, lo, up, ups[table], [withheld] if (r == 1 and table == M) else [])
            if rng.random() < 0.7:
                prod.bad_file(table, lo, up, ups[table])
        if r == 2:      # the forgotten update arrives after all; an earlier good file arrives again
            prod.put(M, [withheld])
            old_key, body = rng.choice(prod.good[:-1])
            table = K if f"/{K}/" in old_key else M
            k = prod.key(table)
            prod.store.put(k, body)
        res = feeds.ingest(cfg)
        assert not (set(res.quarantined) - set(prod.bad)), res.quarantined
        consolidate_stream(cfg, spark=spark)
        if r == 1:      # m waits at the withheld time; k goes on; then the time is given up
            assert [(u["table"], u["time"]) for u in res.unmet] == [(M, 15)]
            _check(cfg, prod, {M: 15, K: up})
            out = feeds.forget(cfg, M, 15, "lost by the producer")
            assert (out["expected"], out["seen"]) == (Counter(u["time"] for u in ups[M])[15], out["expected"] - 1)
            prod.lost.add((M, row_id(M, lost_row), 15, 1))
            feeds.ingest(cfg)
            consolidate_stream(cfg, spark=spark)
        if r == 2:
            late = _incidents(cfg, "feed_forgotten_late")
            assert [(d["table"], d["time"], d["updates"]) for d in late] == [(M, 15, 1)], late
        _check(cfg, prod, {M: up, K: up})
        skipped = prod.integral(M, up)[1]
        got = sum(d["skipped"] for d in _incidents(cfg, "feed_update_skipped") if d["table"] == M)
        assert got == skipped, (got, skipped)
    os.environ.pop(f"AIRFLOW_CONN_CTL_{stream.upper()}", None)
