"""The changelog feed's base survives every ordering of snapshot, drain, consolidate, idle batches and
resends: generated orderings, each ending with a drain and a consolidation; then every table's
Materialize CDC files, read with the seed's own reader schema (fastavro schema resolution), shuffled
and duplicated, are consumed from time 0 by a reference CDCv2 consumer written here (nothing of
Tidemark's), which must reach the stream's frontier after every step, with the lake's rows once
the frontier is past the newest snapshot (its base is at its LSN S: a feed at S holds only [0, S)),
and at the end with the source's.
"""

from __future__ import annotations

import io
import random
import secrets
from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from tidemark.capture.snapshot import snapshot_stream
from tidemark.consolidate import consolidate_stream
from tidemark.control import Control, control_dsn
from tidemark.gaps import resend
from tidemark.lake import read_table
from tidemark.landing.store import open_store, stream_keys

from feedkit import SEED_READER
from oracle import drain_until_current

pytestmark = [pytest.mark.spark, pytest.mark.slow]

STEPS = ["write", "drain", "consolidate", "idle", "resend"]


def cdcv2_consume(records: list) -> tuple[int, Counter]:
    """A consumer of the seed's format from time 0: records ("u", update) / ("p", progress) in any
    order, duplicated. Its frontier is the end of the progress covering [0, ...) without a hole,
    held at the first time whose count of distinct (data, time, diff) is not met; the integral is
    the distinct updates below it, in time order."""
    distinct: dict[int, set] = defaultdict(set)
    counted: dict[int, int] = {}
    covered: list[tuple[int, int]] = []
    for kind, r in records:
        if kind == "u":
            distinct[r["time"]].add((tuple(sorted(r["data"].items())), r["diff"]))
            continue
        lo, up = r["lower"][0], r["upper"][0]
        covered.append((lo, up))
        for c in r["counts"]:
            assert lo <= c["time"] < up, f"progress [{lo}, {up}) counts time {c['time']} outside it"
            assert counted.setdefault(c["time"], c["count"]) == c["count"], "two progress records disagree"
    frontier = 0
    for lo, up in sorted(covered):
        if lo > frontier:
            break
        frontier = max(frontier, up)
    for t in sorted(set(counted) | set(distinct)):
        if t >= frontier:
            break
        if len(distinct[t]) != counted.get(t, 0):
            assert len(distinct[t]) < counted.get(t, 0), f"more distinct updates at {t} than counted"
            frontier = t
            break
    state: Counter = Counter()
    for t in sorted(distinct):
        if t < frontier:
            for data, diff in distinct[t]:
                state[data] += diff
    assert all(n >= 0 for n in state.values()), "a row taken out more often than it was put in"
    return frontier, +state


def _feed(cfg, table: str, rng: random.Random) -> list:
    store = open_store(cfg.landing.url)
    prefix = f"{stream_keys(cfg.stream)['changelog']}{table}/"
    keys = [k for k in store.list(prefix) if k.endswith(".avro")]
    import fastavro

    records = []
    for key in keys + rng.sample(keys, k=len(keys) // 2):     # some files twice
        for datum in fastavro.reader(io.BytesIO(store.get(key)), reader_schema=SEED_READER):
            if isinstance(datum, list):
                records += [("u", u) for u in datum]
            else:
                records.append(("p", datum))
    rng.shuffle(records)
    return records


def _write(cur, rng: random.Random, names: dict[str, str]) -> None:
    cur.execute("BEGIN")
    cur.execute(f"INSERT INTO {names['keyed']} SELECT COALESCE(max(id), 0) + 1, NULL FROM {names['keyed']}")
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(["ins", "upd", "del", "bag"])
        if op == "ins":
            cur.execute(f"INSERT INTO {names['keyed']} SELECT COALESCE(max(id), 0) + 1, %s FROM {names['keyed']}",
                        (rng.choice([None, rng.randint(1, 9)]),))
        elif op == "upd":
            cur.execute(f"UPDATE {names['keyed']} SET price = %s WHERE id = (SELECT min(id) FROM {names['keyed']})",
                        (rng.randint(1, 9),))
        elif op == "del":
            cur.execute(f"DELETE FROM {names['keyed']} WHERE id = (SELECT max(id) FROM {names['keyed']})")
        else:
            cur.execute(f"INSERT INTO {names['bag']} VALUES (1, %s), (1, %s)", (rng.randint(1, 2),) * 2)
            cur.execute(f"DELETE FROM {names['bag']} WHERE ctid = (SELECT min(ctid) FROM {names['bag']})")
    cur.execute("COMMIT")


def _source(cur, table: str) -> Counter:
    cur.execute(f"SELECT id, price FROM {table}")
    return Counter(tuple(sorted({"id": i, "price": p}.items())) for i, p in cur.fetchall())


def _lake(cfg, table: str) -> Counter:
    return Counter(tuple(sorted(r.items())) for r in read_table(cfg, table).select(["id", "price"]).to_pylist())


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@example(steps=["consolidate", "write", "drain", "consolidate"], seed=1)      # the reported ordering
@example(steps=["consolidate", "idle", "resend", "consolidate", "write", "idle"], seed=2)
@example(steps=["write", "drain", "consolidate", "resend", "consolidate", "consolidate"], seed=3)
@example(steps=["consolidate", "resend", "consolidate"], seed=488)
@example(steps=["write", "consolidate", "resend", "consolidate"], seed=0)
@given(steps=st.lists(st.sampled_from(STEPS), min_size=2, max_size=6), seed=st.integers(0, 2**16))
def test_changelog_feed_base_survives_every_ordering(steps, seed, make_stream, source_conn, spark):
    rng = random.Random(seed)
    tag = secrets.token_hex(3)
    names = {"keyed": f"prices_{tag}", "bag": f"bag_{tag}", "idle": f"still_{tag}"}
    cur = source_conn.cursor()
    cur.execute(f"""CREATE TABLE {names['keyed']} (id bigint PRIMARY KEY, price int);
                    CREATE TABLE {names['bag']} (id bigint NOT NULL, price int);
                    ALTER TABLE {names['bag']} REPLICA IDENTITY FULL;
                    CREATE TABLE {names['idle']} (id bigint PRIMARY KEY, price int);
                    INSERT INTO {names['keyed']} SELECT g, g FROM generate_series(1, 5) g;
                    INSERT INTO {names['bag']} VALUES (1, 1), (1, 1), (2, NULL);
                    INSERT INTO {names['idle']} VALUES (1, 1);""")
    tables = [f"public.{n}" for n in names.values()]
    cfg = make_stream(tables, drain={"idle_timeout_seconds": 0.5}, consolidate={"buckets": 2})
    snapshot_stream(cfg)

    def check(final: bool) -> None:
        """The consumer reaches the stream's frontier; its rows are the lake's (at the end also the
        source's) once the frontier is past the newest snapshot (at S the base is not below S yet)."""
        with Control(control_dsn(cfg)) as ctl:
            state = ctl.stream(cfg.stream)
        if state.frontier is None:
            return
        for table in tables:
            frontier, rows = cdcv2_consume(_feed(cfg, table, rng))
            assert frontier == state.frontier, (table, steps, frontier, state.frontier)
            if state.frontier > state.consistent_lsn:
                assert rows == _lake(cfg, table), (table, steps)
        if final:
            assert state.frontier == state.landed_upper > state.consistent_lsn
            for table in tables:
                assert _lake(cfg, table) == _source(cur, table), table

    for step in steps + ["write", "drain", "consolidate"]:
        if step == "write":
            _write(cur, rng, names)
        elif step == "drain":
            drain_until_current(cfg)
        elif step == "consolidate":
            consolidate_stream(cfg, spark=spark)
        elif step == "idle":         # a batch in which no table changes (a progress-only segment)
            drain_until_current(cfg)
            consolidate_stream(cfg, spark=spark)
        else:
            resend(cfg, force=True)
        check(final=False)
    check(final=True)


def test_a_base_is_read_and_written_one_bucket_at_a_time(make_stream, source_conn, spark, monkeypatch):
    """The feed's base (a snapshot's rows as updates at its LSN, and a resend's difference from the
    lake before it) never holds a whole table in the driver: each version is read one bucket at a
    time, and the feed still equals the lake, then the source, duplicates of a keyless table
    included."""
    from tidemark.consolidate import bases

    tag = secrets.token_hex(3)
    keyed, bag = f"public.wide_{tag}", f"public.heap_{tag}"
    cur = source_conn.cursor()
    cur.execute(f"""CREATE TABLE {keyed} (id bigint PRIMARY KEY, price int);
                    CREATE TABLE {bag} (id bigint NOT NULL, price int);
                    ALTER TABLE {bag} REPLICA IDENTITY FULL;
                    INSERT INTO {keyed} SELECT g, g % 7 FROM generate_series(1, 400) g;
                    INSERT INTO {bag} SELECT g % 50, g % 3 FROM generate_series(1, 400) g;""")
    cfg = make_stream([keyed, bag], consolidate={"buckets": 4})
    reads: list[int] = []
    real = bases.version_buckets

    def counted(*a, **k):
        read, buckets = real(*a, **k)

        def read_counted(files):
            rows = read(files)
            reads.append(rows.num_rows)
            return rows
        return read_counted, buckets

    monkeypatch.setattr(bases, "version_buckets", counted)
    rng = random.Random(7)
    snapshot_stream(cfg)
    for change in (f"UPDATE {keyed} SET price = price + 1 WHERE id % 5 = 0", None):
        if change is None:      # a resend: its base is the difference from the lake before it
            cur.execute(f"UPDATE {keyed} SET price = -1 WHERE id < 20")
            resend(cfg, force=True)
        else:
            cur.execute(change)
        drain_until_current(cfg)
        consolidate_stream(cfg, spark=spark)
        with Control(control_dsn(cfg)) as ctl:
            frontier = ctl.stream(cfg.stream).frontier
        for table in (keyed, bag):
            got, rows = cdcv2_consume(_feed(cfg, table, rng))
            assert got == frontier, table
            assert rows == _lake(cfg, table) == _source(cur, table), table
    assert reads and max(reads) < 400, reads              # a bucket's rows, never a version's 400
    assert sum(reads) >= 4 * 400, reads                    # both tables' first base, and the resend's two sides
