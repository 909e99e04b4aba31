"""DAG flows with ``dag.test()`` against a real PostgreSQL (source, control and Airflow's metadata database)
that the live-scheduler test (test_live_airflow.py: snapshot, drain, consolidate, repair, resend, changelog)
does not cover.

The consolidations run as they do in the embedded deployment: as clients of one warm Spark Connect server
(the module's, named by ``spark_connect_default``; the spark-submit fallback has its own tests in
tests/integration/test_consolidate_connect_operator.py). One PostgreSQL stream goes through them all: a drain killed before registering
is recovered by the sweep of the next drain DAG run; then a duplicated segment changes nothing, and an
idle stream (WAL moving only in an uncaptured table) moves its frontier without spark-submit; each lake
table's Asset gets an event from the consolidations that changed that table only. An external feed goes
through its own drain and consolidate DAGs.

The flows run their DAGs in child processes (tests/dags/run_dags.py, several DAGs per process); the
oracle is `SELECT` on the source, compared with the lake table by row count and content checksum
(`tidemark.local.embedded.parity_report`), or for the feed the integral of what its producer sent.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from airflow_env import PYTHON, ROOT, airflow_env, run_json
from dag_workload import SCHEMA, TABLES, workload
from tidemark.local.embedded import parity_report

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.spark]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def airflow_meta(pg_cluster, tmp_path_factory) -> dict:
    """Airflow's metadata database on the test cluster, migrated once for the module."""
    home = tmp_path_factory.mktemp("af-flows")
    dsn = pg_cluster.ensure_database("airflow_dagtest")
    url = pg_cluster.sqlalchemy_url("airflow_dagtest")
    env = airflow_env(home, sql_alchemy_conn=url)
    proc = subprocess.run([str(Path(PYTHON).parent / "airflow"), "db", "migrate"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"home": home, "url": url, "dsn": dsn}


@pytest.fixture(scope="module")
def connect_conn(tmp_path_factory) -> dict[str, str]:
    """One Spark Connect server for the module, as the embedded default runs beside Airflow; the
    connection the consolidate task finds it by."""
    from tidemark.local import sparkconnect

    proc, url = sparkconnect.start(tmp_path_factory.mktemp("connect") / "server.log", master="local[2]",
                                   conf={"spark.sql.shuffle.partitions": "2", "spark.driver.memory": "768m"})
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    yield {"AIRFLOW_CONN_SPARK_CONNECT_DEFAULT": json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1",
                                                             "port": port, "extra": {"tidemark_installed": True}})}
    sparkconnect.stop(proc)


@dataclass
class Flow:
    cfg: object
    stream_file: Path
    env: dict
    conn: object
    meta_dsn: str = ""

    def table_events(self) -> list[tuple[str, dict]]:
        """The lake table Asset events the consolidate DAG's runs emitted, oldest first: (URI, extra),
        from Airflow's metadata database."""
        import psycopg2

        with psycopg2.connect(self.meta_dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT a.uri, e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id "
                        "WHERE e.source_dag_id = %s AND a.uri LIKE 'tidemark://%%' ORDER BY e.id",
                        (self.dag("consolidate"),))
            return [(uri, json.loads(extra) if isinstance(extra, str) else extra) for uri, extra in cur.fetchall()]

    def source_rows(self) -> dict:
        """The source tables' rows now: items by key, events as a multiset (each row as jsonb text)."""
        from collections import Counter

        with self.conn.cursor() as cur:
            cur.execute("SELECT id, to_jsonb(i)::text FROM items i")
            items = dict(cur.fetchall())
            cur.execute("SELECT to_jsonb(e)::text FROM events e")
            events = Counter(r for r, in cur.fetchall())
        return {"public.items": items, "public.events": events}

    def dag(self, kind: str) -> str:
        return f"tidemark_{self.cfg.stream}_{kind}"

    def run(self, *steps: str | dict) -> list[dict]:
        """Run DAG kinds (or step dicts) in order with dag.test(); return each run's task states."""
        plan = [s if isinstance(s, dict) else {"dag_id": self.dag(s)} for s in steps]
        out = run_json(HERE / "run_dags.py", self.env, json.dumps(plan), timeout=600)
        for r in out["runs"]:
            if r["state"] == "failed":
                r["log"] = out.get("log")
        return out["runs"]

    def workload(self, round_: int) -> None:
        """Inserts, updates (TOAST left unchanged), deletes and multiset changes in several transactions."""
        workload(self.conn, round_)

    def assert_lake_equals_source(self) -> None:
        report = parity_report(self.cfg)
        assert set(report) == set(TABLES)
        for table, row in report.items():
            assert row["equal"], f"{table}: {row}"


@pytest.fixture
def flow(make_stream, source_conn, airflow_meta, connect_conn, tmp_path) -> Flow:
    if not (ROOT / "jobs" / "consolidate.py").exists():
        pytest.skip("jobs/consolidate.py (the Spark consolidation job) is not in the checkout yet")
    with source_conn.cursor() as cur:
        cur.execute(SCHEMA)
    cfg = make_stream(TABLES)
    streams = tmp_path / "streams"
    streams.mkdir()
    stream_file = streams / f"{cfg.stream}.yaml"
    stream_file.write_text(yaml.safe_dump(cfg.as_dict()))
    env = airflow_env(airflow_meta["home"], streams_dir=streams, sql_alchemy_conn=airflow_meta["url"], extra=connect_conn)
    return Flow(cfg=cfg, stream_file=stream_file, env=env, conn=source_conn, meta_dsn=airflow_meta["dsn"])


def _states(run: dict) -> dict:
    return run["tasks"]


def _versions(cfg) -> dict[str, int]:
    from tidemark.lake import open_delta, storage_options, table_uri

    return {t: open_delta(table_uri(cfg, t), storage_options(cfg)).version() for t in TABLES}


def _net_changes(before: dict, after: dict) -> dict:
    """The oracle of an event's counts, from two reads of the source: items by key (a key new, gone,
    or with other values), events as a multiset (each identical row's net count)."""
    items_b, items_a = before["public.items"], after["public.items"]
    events_b, events_a = before["public.events"], after["public.events"]
    return {"public.items": {"inserted": len(items_a.keys() - items_b.keys()),
                             "deleted": len(items_b.keys() - items_a.keys()),
                             "updated": sum(items_a[k] != items_b[k] for k in items_a.keys() & items_b.keys())},
            "public.events": {"inserted": (events_a - events_b).total(), "deleted": (events_b - events_a).total(),
                              "updated": 0}}


def _asset_uri(cfg, table: str) -> str:
    return f"tidemark://{cfg.stream}/{table}"


def test_one_stream_through_a_killed_drain_a_duplicate_and_an_idle_round(flow):
    """One stream: snapshot (DAG), a drain, a drain killed before registering, a drain DAG
    whose sweep registers the killed drain's file before the drain lands what followed, consolidate; then
    a segment delivered again and WAL that moves in an uncaptured table: the next drain and consolidate
    DAGs register nothing twice, skip Spark, move the frontier and commit nothing to the lake."""
    from tidemark.capture.drain import drain_stream
    from tidemark.control import Segment, open_control

    landing = Path(flow.cfg.landing.url) / flow.cfg.stream / "segments"

    def files() -> set[str]:
        return {p.name for p in landing.iterdir()} if landing.exists() else set()

    def segments() -> list:
        with open_control(flow.cfg) as ctl:
            return ctl.segments(flow.cfg.stream, status=None)

    # snapshot through the snapshot DAG (the rows of workload 0 are in it, not in the WAL)
    flow.workload(0)
    snap, = flow.run({"dag_id": flow.dag("snapshot"), "conf": {"tables": TABLES, "chunk_pages": 2}})
    assert snap["state"] == "success", snap
    at_snapshot = flow.source_rows()

    # segment 0: an ordinary drain
    flow.workload(1)
    first = drain_stream(flow.cfg)
    assert first.registered and first.seq == 0 and first.records > 0, first

    # a drain killed between writing its segment and registering it: a file no manifest row names
    flow.workload(2)
    before = files()
    step = [{"kill_drain_before_register": True, "stream_file": str(flow.stream_file)}]
    proc = subprocess.run([PYTHON, str(HERE / "run_dags.py"), json.dumps(step)], env=flow.env, capture_output=True,
                          text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 137, proc.stderr[-3000:]
    assert '{"killed_before_registering": 1}' in proc.stdout, proc.stdout[-3000:]
    killed, = files() - before            # the killed drain wrote its segment ...
    assert [(s.seq, s.uri) for s in segments()] == [(0, first.uri)]         # ... and registered nothing

    # the next drain DAG run: its sweep registers the killed drain's file as segment 1, then its drain lands
    # what followed from there (segment 2), in the same task; one consolidation takes the snapshot and segments 0-2
    flow.workload(3)
    drain, consolidate = flow.run("drain", "consolidate")
    assert drain["state"] == "success" and consolidate["state"] == "success", (drain, consolidate)
    assert _states(drain) == {"drain": "success"} and _states(consolidate)["consolidate"] == "success", \
        (drain, consolidate)
    segs = segments()
    assert [(s.seq, s.origin) for s in segs] == [(0, "drain"), (1, "sweep"), (2, "drain")], segs
    assert segs[1].uri.rsplit("/", 1)[-1] == killed and segs[1].record_count > 0, segs[1]
    assert all(a.upper == b.lower for a, b in zip(segs, segs[1:])), segs
    assert segs[2].record_count > 0, segs[2]
    flow.assert_lake_equals_source()
    versions = _versions(flow.cfg)
    with open_control(flow.cfg) as ctl:
        before_idle = ctl.stream(flow.cfg.stream)
    assert before_idle.frontier == before_idle.landed_upper == segs[2].upper

    # both tables changed: each one's Asset got one event, its extra the frontier, the table's new Delta
    # version, the snapshot's rows it loaded and the net effect of the changes since, as the source says
    from tidemark.lsn import format_lsn

    now = flow.source_rows()
    expected = _net_changes(at_snapshot, now)
    events = flow.table_events()
    assert sorted(uri for uri, _ in events) == sorted(_asset_uri(flow.cfg, t) for t in TABLES), events
    for uri, extra in events:
        table = uri.rsplit("/", 1)[1]
        assert extra == {"stream": flow.cfg.stream, "table": table, "frontier": format_lsn(before_idle.frontier),
                         "version": versions[table], "snapshot_rows": len(at_snapshot[table]) if table ==
                         "public.items" else at_snapshot[table].total(), **expected[table]}, (table, extra)

    # segment 0 delivered again (same name and bytes): the manifest refuses it as already registered ...
    seg_path = Path(first.uri.removeprefix("file://"))
    seg_path.write_bytes(seg_path.read_bytes())
    with open_control(flow.cfg) as ctl:
        assert ctl.register_segment(Segment(**{**segs[0].__dict__})) is False
    # ... and WAL moves, but nothing the publication carries: the drain lands a progress-only segment, the
    # consolidate task moves the frontier in the control database and is skipped: no Spark, nothing committed
    with flow.conn.cursor() as cur:
        cur.execute("CREATE TABLE IF NOT EXISTS not_captured (x int); INSERT INTO not_captured VALUES (1)")
    before = files()
    drain, consolidate = flow.run("drain", "consolidate")
    assert drain["state"] == "success" and consolidate["state"] == "success", (drain, consolidate)
    states = _states(consolidate)
    assert states == {"wait_for_segments": "success", "repair": "skipped", "resend": "skipped",
                      "consolidate": "skipped"}, states
    idle_segs = segments()
    assert idle_segs[:3] == segs, "a segment delivered again must not be registered again"
    idle, = idle_segs[3:]
    assert (idle.seq, idle.origin, idle.record_count, idle.lower) == (3, "drain", 0, segs[2].upper), idle
    assert files() - before == {idle.uri.rsplit("/", 1)[-1]} and before <= files(), "nothing moved aside"
    with open_control(flow.cfg) as ctl:
        state = ctl.stream(flow.cfg.stream)
        assert state.frontier == state.landed_upper == idle.upper > before_idle.frontier
        assert ctl.subscriber_checkpoint(flow.cfg.stream, "consolidate") == state.frontier
        assert ctl.incidents(flow.cfg.stream) == []
    assert _versions(flow.cfg) == versions, "neither the duplicate nor the idle round may commit to the lake"
    flow.assert_lake_equals_source()
    assert flow.table_events() == events, "a consolidation that changed no table updates no table's Asset"

    # only items changes: its Asset gets an event, the events table's (left alone) none
    with flow.conn.cursor() as cur:
        cur.execute("INSERT INTO items (id, name) VALUES (90001, 'only items'), (90002, 'only items'); "
                    "UPDATE items SET qty = coalesce(qty, 0) + 100 WHERE id IN (SELECT id FROM items ORDER BY id LIMIT 3); "
                    "DELETE FROM items WHERE id = (SELECT max(id) FROM items WHERE id < 90000)")
    drain, consolidate = flow.run("drain", "consolidate")
    assert _states(consolidate)["consolidate"] == "success", consolidate
    after = _versions(flow.cfg)
    assert after["public.events"] == versions["public.events"] and after["public.items"] > versions["public.items"]
    with open_control(flow.cfg) as ctl:
        frontier = ctl.stream(flow.cfg.stream).frontier
    new = flow.table_events()[len(events):]
    assert new == [(_asset_uri(flow.cfg, "public.items"), {
        "stream": flow.cfg.stream, "table": "public.items", "frontier": format_lsn(frontier),
        "version": after["public.items"], **_net_changes(now, flow.source_rows())["public.items"]})], new
    assert new[0][1]["inserted"] == 2 and new[0][1]["updated"] == 3 and new[0][1]["deleted"] == 1
    flow.assert_lake_equals_source()


def test_an_external_feed_through_its_drain_and_consolidate_dags(airflow_meta, connect_conn, control_dsn, tmp_path,
                                                                 monkeypatch):
    """A feed stream (``source.kind: feed``) in Airflow: the drain DAG registers the stream and ingests the
    producer's files (duplicated, split over files), publishing the landing Asset only when a segment
    landed; the consolidate DAG consolidates (a client of the warm server); a time whose count is unmet holds the
    frontier, opens a ``counts_unmet`` incident and the sensor skips with the producer's reason; a late
    file completes it. The oracle is the integral of what the producer sent (distinct updates)."""
    import secrets
    import time
    from collections import Counter

    from dbkit import dsn_uri
    from feedkit import feed_file, seed_schema
    from oracle import rows
    from tidemark.config import load_config
    from tidemark.control import open_control
    from tidemark.feeds import feed_prefix
    from tidemark.lake import read_table, read_tables
    from tidemark.landing.store import open_store

    stream = f"feed_{secrets.token_hex(3)}"
    monkeypatch.setenv(f"AIRFLOW_CONN_CTL_{stream.upper()}", dsn_uri(control_dsn))
    streams = tmp_path / "streams"
    streams.mkdir()
    (streams / f"{stream}.yaml").write_text(yaml.safe_dump({
        "stream": stream, "source": {"kind": "feed", "tables": ["public.prices", "public.items"]},
        "control": {"connection": f"ctl_{stream}"}, "landing": {"url": str(tmp_path / "landing")},
        "lake": {"path": str(tmp_path / "lake")}, "consolidate": {"buckets": 2, "count_timeout_seconds": 1}}))
    cfg = load_config(streams / f"{stream}.yaml")
    env = airflow_env(airflow_meta["home"], streams_dir=streams, sql_alchemy_conn=airflow_meta["url"], extra=connect_conn)
    schemas = {"public.prices": seed_schema([{"name": "id", "type": "long"}, {"name": "price", "type": ["null", "int"]}]),
               "public.items": seed_schema([{"name": "sku", "type": "string"}, {"name": "qty", "type": "long"}])}
    store, sent = open_store(cfg.landing.url), []

    def put(table: str, updates: list[tuple], progress: tuple | None = None, copies: int = 1) -> None:
        datums: list = [[{"data": d, "time": t, "diff": n} for d, t, n in updates]] if updates else []
        if progress:
            lower, upper, counts = progress
            datums.append(("com.materialize.cdc.progress", {"lower": [lower], "upper": [upper], "counts": [
                {"time": t, "count": c} for t, c in sorted(counts.items())]}))
        for _ in range(copies):
            store.put(f"{feed_prefix(stream, table)}{secrets.token_hex(4)}.avro", feed_file(schemas[table], datums))
        sent.extend((table, tuple(d.values()), t, n) for d, t, n in updates)

    def integral(table: str, below: int) -> Counter:
        acc: Counter = Counter()
        for tb, data, t, n in set(sent):
            if tb == table and t < below:
                acc[data] += n
        return +acc

    def run(*kinds: str) -> list[dict]:
        plan = [{"dag_id": f"tidemark_{stream}_{k}"} for k in kinds]
        return run_json(HERE / "run_dags.py", env, json.dumps(plan), timeout=600)["runs"]

    def lake(table: str) -> Counter:
        return rows(read_table(cfg, table))

    # times 1..2 complete for both tables (a file delivered twice, a diff of 2); time 3 of prices counts 2 updates
    # but only one has arrived
    put("public.prices", [({"id": 1, "price": 10}, 1, 1), ({"id": 2, "price": None}, 1, 2)], copies=2)
    put("public.prices", [({"id": 1, "price": 10}, 2, -1), ({"id": 1, "price": 11}, 2, 1),
                          ({"id": 3, "price": 30}, 3, 1)], (0, 5, {1: 2, 2: 2, 3: 2}))
    put("public.items", [({"sku": "a", "qty": 1}, 1, 1), ({"sku": "b", "qty": 2}, 4, 1)], (0, 5, {1: 1, 4: 1}))
    drain, consolidate = run("drain", "consolidate")
    assert drain["state"] == "success" and drain["tasks"]["ingest_feed"] == "success", drain
    assert consolidate["tasks"]["consolidate"] == "success", consolidate
    assert lake("public.prices") == integral("public.prices", 3)
    with open_control(cfg) as ctl:
        frontier = ctl.stream(stream).frontier
    assert frontier == 3                  # the least of the tables' frontiers: prices waits at 3
    assert lake("public.items") == integral("public.items", 5)               # items goes on to its own
    assert {t: rows(r) for t, r in read_tables(cfg, frontier=frontier).items()} == {
        t: integral(t, frontier) for t in ("public.prices", "public.items")}

    time.sleep(1.5)                       # past count_timeout_seconds: the next ingest opens the incident
    drain, consolidate = run("drain", "consolidate")
    assert drain["state"] == "success", drain
    with open_control(cfg) as ctl:
        unmet = [i for i in ctl.incidents(stream) if i["kind"] == "counts_unmet"]
    assert len(unmet) == 1 and unmet[0]["detail"]["table"] == "public.prices" and unmet[0]["detail"]["time"] == 3
    assert consolidate["tasks"]["wait_for_segments"] in ("skipped", "success"), consolidate
    assert lake("public.prices") == integral("public.prices", 3)

    put("public.prices", [({"id": 4, "price": 40}, 3, 1)])          # the late update completes time 3
    drain, consolidate = run("drain", "consolidate")
    assert drain["tasks"]["ingest_feed"] == "success" and consolidate["tasks"]["consolidate"] == "success", \
        (drain, consolidate)
    with open_control(cfg) as ctl:
        assert ctl.stream(stream).frontier == 5
        assert [i for i in ctl.incidents(stream) if i["kind"] == "counts_unmet"] == []
    for table in ("public.prices", "public.items"):
        assert lake(table) == integral(table, 5), table
