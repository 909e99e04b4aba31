"""Two DAG flows with ``dag.test()`` against a real PostgreSQL (source, control and Airflow's metadata
database) that the live-scheduler test (test_live_airflow.py: snapshot, drain, consolidate, repair,
resend, changelog) does not cover: a duplicated segment changes nothing, and a drain killed before
registering is recovered by the sweep.

Each flow runs its DAGs in a child process (tests/dags/run_dags.py); the oracle is `SELECT` on the
source, compared with the lake table by row count and content checksum (`tidemark.local.embedded.parity_report`).
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
    pg_cluster.ensure_database("airflow_dagtest")
    url = pg_cluster.sqlalchemy_url("airflow_dagtest")
    env = airflow_env(home, sql_alchemy_conn=url)
    proc = subprocess.run([str(Path(PYTHON).parent / "airflow"), "db", "migrate"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"home": home, "url": url}


@dataclass
class Flow:
    cfg: object
    stream_file: Path
    env: dict
    conn: object

    def dag(self, kind: str) -> str:
        return f"tidemark_{self.cfg.stream}_{kind}"

    def run(self, *steps: str | dict) -> list[dict]:
        """Run DAG kinds (or step dicts) in order with dag.test(); return each run's task states."""
        plan = [s if isinstance(s, dict) else {"dag_id": self.dag(s)} for s in steps]
        out = run_json(HERE / "run_dags.py", self.env, json.dumps(plan), timeout=600)
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
def flow(make_stream, source_conn, airflow_meta, tmp_path) -> Flow:
    if not (ROOT / "jobs" / "consolidate.py").exists():
        pytest.skip("jobs/consolidate.py (the Spark consolidation job) is not in the checkout yet")
    with source_conn.cursor() as cur:
        cur.execute(SCHEMA)
    cfg = make_stream(TABLES)
    streams = tmp_path / "streams"
    streams.mkdir()
    stream_file = streams / f"{cfg.stream}.yaml"
    stream_file.write_text(yaml.safe_dump(cfg.as_dict()))
    env = airflow_env(airflow_meta["home"], streams_dir=streams, sql_alchemy_conn=airflow_meta["url"])
    return Flow(cfg=cfg, stream_file=stream_file, env=env, conn=source_conn)


def _states(run: dict) -> dict:
    return run["tasks"]


def _snapshot_and_drain(flow: Flow, rounds: int = 2) -> list:
    from tidemark.capture.drain import drain_stream
    from tidemark.capture.snapshot import snapshot_stream
    from tidemark.capture.source import apply_stream

    apply_stream(flow.cfg)
    snapshot_stream(flow.cfg)
    landed = []
    for r in range(rounds):
        flow.workload(10 + r)
        landed.append(drain_stream(flow.cfg))
    return landed


def test_a_duplicated_segment_changes_nothing(flow):
    from tidemark.control import Segment
    from tidemark.lake import open_delta, storage_options, table_uri
    from tidemark.control import open_control

    landed = _snapshot_and_drain(flow, rounds=1)
    consolidate, = flow.run("consolidate")
    assert consolidate["state"] == "success"
    flow.assert_lake_equals_source()
    versions = {t: open_delta(table_uri(flow.cfg, t), storage_options(flow.cfg)).version() for t in TABLES}

    seg_path = Path(landed[0].uri.removeprefix("file://"))
    data = seg_path.read_bytes()
    seg_path.write_bytes(data)  # delivered again, same name and bytes
    with open_control(flow.cfg) as ctl:
        row, = [s for s in ctl.segments(flow.cfg.stream) if s.seq == landed[0].seq]
        assert ctl.register_segment(Segment(**{**row.__dict__})) is False
    drain, consolidate = flow.run("drain", "consolidate")
    assert drain["state"] == "success" and consolidate["state"] == "success"
    assert _states(consolidate)["consolidate"] in ("skipped", "success")
    after = {t: open_delta(table_uri(flow.cfg, t), storage_options(flow.cfg)).version() for t in TABLES}
    if _states(consolidate)["consolidate"] == "success":
        assert after == versions, "consolidating a duplicate must not commit to the lake"
    assert after == versions
    flow.assert_lake_equals_source()


def test_a_drain_killed_before_registering_is_recovered_by_the_sweep(flow):
    from tidemark.capture.snapshot import snapshot_stream
    from tidemark.control import open_control
    from tidemark.capture.source import apply_stream

    apply_stream(flow.cfg)
    snapshot_stream(flow.cfg)
    flow.workload(40)
    step = [{"kill_drain_before_register": True, "stream_file": str(flow.stream_file)}]
    proc = subprocess.run([PYTHON, str(HERE / "run_dags.py"), json.dumps(step)], env=flow.env, capture_output=True,
                          text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 137, proc.stderr[-3000:]
    with open_control(flow.cfg) as ctl:
        assert ctl.segments(flow.cfg.stream, status=None) == []
    landing = Path(flow.cfg.landing.url) / flow.cfg.stream / "segments"
    assert len(list(landing.iterdir())) == 1, "the killed drain wrote its segment"

    drain, consolidate = flow.run("drain", "consolidate")
    assert drain["state"] == "success" and consolidate["state"] == "success", (drain, consolidate)
    with open_control(flow.cfg) as ctl:
        segs = ctl.segments(flow.cfg.stream)
    assert segs and segs[0].seq == 0 and segs[0].origin == "sweep"
    flow.assert_lake_equals_source()


def test_an_idle_stream_moves_its_frontier_without_spark_submit(flow):
    flow.workload(0)
    snap, = flow.run({"dag_id": flow.dag("snapshot"), "conf": {"tables": TABLES, "chunk_pages": 2}})
    assert snap["state"] == "success", snap
    drain, consolidate = flow.run("drain", "consolidate")
    assert _states(consolidate)["consolidate"] == "success", consolidate
    with flow.conn.cursor() as cur:     # WAL moves, but nothing the publication carries
        cur.execute("CREATE TABLE IF NOT EXISTS not_captured (x int); INSERT INTO not_captured VALUES (1)")
    drain, consolidate = flow.run("drain", "consolidate")
    assert drain["state"] == "success" and consolidate["state"] == "success", (drain, consolidate)
    states = _states(consolidate)
    assert states["skip_spark_if_idle"] == "success" and states["consolidate"] == "skipped", states
    from tidemark.control import open_control

    with open_control(flow.cfg) as ctl:
        state = ctl.stream(flow.cfg.stream)
        assert state.frontier == state.landed_upper
        assert ctl.subscriber_checkpoint(flow.cfg.stream, "consolidate") == state.frontier
    flow.assert_lake_equals_source()


def test_an_external_feed_through_its_drain_and_consolidate_dags(airflow_meta, control_dsn, tmp_path, monkeypatch):
    """A feed stream (``source.kind: feed``) in Airflow: the drain DAG registers the stream and ingests the
    producer's files (duplicated, split over files), publishing the landing Asset only when a segment
    landed; the consolidate DAG consolidates with spark-submit; a time whose count is unmet holds the
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
    env = airflow_env(airflow_meta["home"], streams_dir=streams, sql_alchemy_conn=airflow_meta["url"])
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
