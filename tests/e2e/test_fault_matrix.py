"""The fault matrix: each fault, then only the recovery the runbook (docs/operations/runbook.md) tells an
operator, then "lake equals source, nothing lost or doubled" (the lake compared with ``SELECT *`` of
the source, as multisets).

Faults covered elsewhere are listed in the runbook's fault matrix next to this file's. Kills are real
``SIGKILL``s of a child process at a chosen point (the child patches the point to kill itself, so
the moment is exact); PostgreSQL restarts are ``pg_ctl restart -m immediate`` of a dedicated
cluster, so the shared one is left alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg2
import pytest

from dbkit import destroy_own_cluster, start_own_cluster
from adversarial_kit import assert_lake_equals_source, consolidate, drain_until_current, snapshotted_t
from tidemark.capture.snapshot import snapshot_stream
from tidemark.capture.source import slot_info
from tidemark.config import parse_config
from tidemark.control import Control, control_dsn
from tidemark.errors import StreamBusy, TidemarkError
from tidemark.gaps import detect, landing_store, repair, resend, sweep
from tidemark.local.localpg import LocalCluster, pg_bin_dir

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _exec(conn, *stmts):
    with conn.cursor() as cur:
        for s in stmts:
            cur.execute(s)


def _workload(conn) -> None:
    _exec(conn, "INSERT INTO t SELECT i, 'n' || i FROM generate_series(1001, 1050) i",
          "UPDATE t SET v = v || '+' WHERE id % 3 = 0", "DELETE FROM t WHERE id % 5 = 0")


def retry_busy(fn, seconds: float = 60.0):
    """The runbook's answer to 'a drain refuses to start': the dead run's walsender still holds the
    slot for a moment; run it again."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return fn()
        except StreamBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def recover_and_compare(cfg, spark) -> None:
    """What the scheduled DAGs do next: sweep, drain to the source's position, consolidate; compare."""
    sweep(cfg)
    retry_busy(lambda: drain_until_current(cfg))
    report = detect(cfg)
    assert report.decision == "ok", report
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg)


# -- the drain, killed (a child process SIGKILLs itself at the point) -------------------------------

CHILD = r"""
import json, os, signal, sys
from tidemark.config import parse_config
from tidemark.capture.drain import drain_stream
from tidemark.landing import segments
from tidemark.control import db

cfg = parse_config(json.loads(sys.argv[1]))
point = sys.argv[2]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if point == "mid-transaction":      # the first 10,000-record array of a bigger transaction is encoded
    segments.SegmentWriter.append = lambda self, datum: die()
elif point == "mid-segment-write":  # the header is written, the records are not
    def write(self, fh, upper):
        fh.write(next(self._chunks(upper)))
        fh.fh.flush()
        die()
    segments.SegmentWriter.write = write
elif point == "before-registration":  # the file is landed, the manifest does not know it: a zombie
    db.Control.register_segment = lambda self, seg: die()
drain_stream(cfg)
raise SystemExit("the drain finished without reaching the kill point")
"""


def kill_drain_at(cfg, point: str) -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg.as_dict()), point],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-2000:])


@pytest.fixture
def big(make_stream, source_conn):
    cfg = snapshotted_t(make_stream, source_conn, "INSERT INTO t SELECT i, 'v' || i FROM generate_series(1, 100) i")
    _exec(source_conn, "UPDATE t SET v = 'before' WHERE id < 10",
          "INSERT INTO t SELECT i, 'big' FROM generate_series(10001, 40000) i")
    return cfg


@pytest.mark.parametrize("point", ["mid-transaction", "mid-segment-write", "before-registration"])
def test_drain_killed(big, source_conn, spark, point):
    kill_drain_at(big, point)
    with Control(control_dsn(big)) as ctl:
        assert ctl.segments(big.stream, status=None) == []           # nothing registered
    segdir = Path(big.landing.url, big.stream, "segments")
    files = sorted(p.name for p in segdir.iterdir()) if segdir.exists() else []
    if point == "mid-segment-write":
        assert len(files) == 1 and files[0].startswith(".tmp-")       # a partial file, never a segment
    elif point == "before-registration":
        assert len(files) == 1 and files[0].endswith(".avro")         # a zombie: the sweep registers it
    else:
        assert files == []
    _workload(source_conn)
    recover_and_compare(big, spark)


# -- the consolidation, killed (a child process with its own Spark SIGKILLs itself) ----------------

CONSOLIDATE_CHILD = r"""
import json, os, signal, sys
from tidemark.config import parse_config
from tidemark.consolidate import consolidate_stream
from tidemark.lake import writer as commit

cfg = parse_config(json.loads(sys.argv[1]))
point = sys.argv[2]
real = commit.commit_files

def commit_files(uri, *args, **kwargs):
    if "/tables/" in uri and point == "before-delta-commit":
        os.kill(os.getpid(), signal.SIGKILL)
    version = real(uri, *args, **kwargs)
    if "/tables/" in uri and point == "after-delta-commit":
        os.kill(os.getpid(), signal.SIGKILL)
    return version

commit.commit_files = commit_files
consolidate_stream(cfg)
raise SystemExit("the consolidation finished without reaching the kill point")
"""


@pytest.mark.parametrize("point", ["before-delta-commit", "after-delta-commit"])
def test_consolidation_killed(big, source_conn, spark, point):
    from tidemark.lake import open_delta, table_uri

    drain_until_current(big)
    consolidate(big, spark)                                  # the snapshot and a first batch are in the lake
    _workload(source_conn)
    drain_until_current(big)
    with Control(control_dsn(big)) as ctl:
        before = ctl.stream(big.stream).frontier
    version = open_delta(table_uri(big, "public.t")).version()
    proc = subprocess.run([sys.executable, "-c", CONSOLIDATE_CHILD, json.dumps(big.as_dict()), point],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-3000:])
    with Control(control_dsn(big)) as ctl:
        assert ctl.stream(big.stream).frontier == before      # killed before the frontier moved
    after = open_delta(table_uri(big, "public.t")).version()
    assert after == (version if point == "before-delta-commit" else version + 1)
    recover_and_compare(big, spark)                          # run it again: applied once, not twice


# -- landed segments damaged ------------------------------------------------------------------------

@pytest.fixture
def landed(make_stream, source_conn):
    """A stream with three landed segments, none consolidated yet."""
    cfg = snapshotted_t(make_stream, source_conn, "INSERT INTO t SELECT i, 'v' || i FROM generate_series(1, 100) i")
    for i in range(3):
        _exec(source_conn, f"UPDATE t SET v = v || '{i}' WHERE id % 4 = {i}",
              f"INSERT INTO t VALUES ({200 + i}, 'i{i}')", f"DELETE FROM t WHERE id = {10 + i}")
        drain_until_current(cfg)
    with Control(control_dsn(cfg)) as ctl:
        segs = [s for s in ctl.segments(cfg.stream) if s.record_count]
    assert len(segs) >= 3
    return cfg, segs


@pytest.mark.parametrize("damage", ["deleted", "truncated", "corrupted"])
def test_damaged_segment_is_repaired_from_the_slot(landed, spark, damage):
    cfg, segs = landed
    victim = segs[1]
    path = Path(victim.uri.removeprefix("file://"))
    data = path.read_bytes()
    if damage == "deleted":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(flipped))
    report = detect(cfg)                                   # the sensor's decision: repair
    assert report.decision == "repair", report
    repair(cfg, report)
    assert path.read_bytes() == data                       # re-drained byte for byte
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg)


def test_segment_duplicated_under_another_name_is_not_applied_twice(landed, spark):
    cfg, segs = landed
    src = Path(segs[0].uri.removeprefix("file://"))
    shutil.copy(src, src.with_name("00000000000000000099" + src.name[20:]))      # another sequence number
    shutil.copy(src, src.with_name("copy-of-" + src.name))                       # not a segment name
    result = sweep(cfg)                                    # the drain DAG sweeps first
    assert len(result.quarantined) == 2 and not result.registered
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg)


def test_schema_change_between_drain_and_consolidation(landed, source_conn, spark):
    cfg, _ = landed
    _exec(source_conn, "ALTER TABLE t ADD COLUMN extra int", "UPDATE t SET extra = id WHERE id < 5")
    consolidate(cfg, spark)                                 # the landed segments, in their own shape
    drain_until_current(cfg)
    _exec(source_conn, "ALTER TABLE t DROP COLUMN extra", "INSERT INTO t VALUES (500, 'late')")
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg)


# -- PostgreSQL restarted, slot invalidated: a dedicated cluster -------------------------------------

@pytest.fixture(scope="module")
def own_pg():
    home, cluster = start_own_cluster("tidemark-faults-pg-", {"fsync": "off", "full_page_writes": "off",
                                                              "shared_buffers": "64MB"})
    ctl = cluster.ensure_database("ctl")
    with Control(ctl) as c:
        c.migrate()
    try:
        yield cluster
    finally:
        destroy_own_cluster(home, cluster)


@pytest.fixture
def own_stream(own_pg, tmp_path, monkeypatch):
    name = f"f{os.getpid()}_{int(time.time() * 1000) % 10**8}"
    own_pg.ensure_database(name)
    monkeypatch.setenv(f"AIRFLOW_CONN_{name.upper()}_SRC", own_pg.uri(name))
    monkeypatch.setenv(f"AIRFLOW_CONN_{name.upper()}_CTL", own_pg.uri("ctl"))
    conn = psycopg2.connect(own_pg.dsn(name))
    conn.autocommit = True
    _exec(conn, "CREATE TABLE t (id int PRIMARY KEY, v text)",
          "INSERT INTO t SELECT i, 'v' || i FROM generate_series(1, 100) i")
    cfg = parse_config({"stream": name, "source": {"connection": f"{name}_src", "publication": f"pub_{name}",
                                                   "slot": f"slot_{name}", "tables": ["public.t"]},
                        "control": {"connection": f"{name}_ctl"}, "landing": {"url": str(tmp_path / "landing")},
                        "lake": {"path": str(tmp_path / "lake")}})
    snapshot_stream(cfg)
    conn.close()
    yield cfg
    conn = psycopg2.connect(own_pg.dsn("postgres"))
    conn.autocommit = True
    _exec(conn, f"SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = '{name}'")
    conn.close()


def _source(own_pg, cfg):
    conn = psycopg2.connect(own_pg.dsn(cfg.stream))
    conn.autocommit = True
    return conn


def restart_immediate(cluster: LocalCluster) -> None:
    cluster._run([str(pg_bin_dir() / "pg_ctl"), "-D", str(cluster.datadir), "-m", "immediate", "-w", "restart",
                  "-o", f"-p {cluster.port}", "-l", str(cluster.logfile)])
    cluster._wait_ready()


def test_postgres_restarted_during_a_drain(own_pg, own_stream, spark):
    from tidemark.capture.drain import drain_stream

    cfg = own_stream
    conn = _source(own_pg, cfg)
    _exec(conn, "INSERT INTO t SELECT i, 'big' FROM generate_series(10001, 300000) i")
    conn.close()
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(_catch(lambda: drain_stream(cfg))))
    thread.start()
    deadline = time.monotonic() + 60
    while (info := slot_info(cfg)) is None or not info.active:
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.01)
    restart_immediate(own_pg)
    thread.join(120)
    [err] = outcome
    assert isinstance(err, TidemarkError), repr(err)          # a clear error, not a driver traceback
    assert any(s in str(err) for s in ("lost", "ended replication")), str(err)
    with Control(control_dsn(cfg)) as ctl:
        assert ctl.segments(cfg.stream, status=None) == []
    conn = _source(own_pg, cfg)
    _workload(conn)
    conn.close()
    recover_and_compare(cfg, spark)


def test_postgres_restarted_during_a_consolidation(own_pg, own_stream, spark, monkeypatch):
    from tidemark.consolidate import committed as committed_mod, job as job_mod

    cfg = own_stream
    conn = _source(own_pg, cfg)
    _workload(conn)
    conn.close()
    drain_until_current(cfg)
    real = committed_mod._commit_table

    def commit_then_restart(*args, **kwargs):
        out = real(*args, **kwargs)
        restart_immediate(own_pg)                            # right after the table's Delta commit
        return out

    monkeypatch.setattr(committed_mod, "_commit_table", commit_then_restart)
    with pytest.raises(TidemarkError, match="lost"):
        job_mod.consolidate_stream(cfg, spark=spark)
    monkeypatch.setattr(committed_mod, "_commit_table", real)
    with Control(control_dsn(cfg)) as ctl:
        assert ctl.stream(cfg.stream).frontier is None or ctl.stream(cfg.stream).frontier < ctl.stream(cfg.stream).landed_upper
    recover_and_compare(cfg, spark)                          # run it again: the lake commit is not repeated


def test_slot_invalidated_by_max_slot_wal_keep_size_is_resent(own_pg, own_stream, spark):
    cfg = own_stream
    conn = _source(own_pg, cfg)
    _workload(conn)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    _exec(conn, "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'", "SELECT pg_reload_conf()")
    try:
        for _ in range(30):                                    # changes the slot can no longer replay
            _exec(conn, "UPDATE t SET v = v || 'x' WHERE id % 2 = 0", "SELECT pg_switch_wal()", "CHECKPOINT")
            if slot_info(cfg).wal_status == "lost":
                break
        assert slot_info(cfg).wal_status == "lost"
    finally:
        _exec(conn, "ALTER SYSTEM RESET max_slot_wal_keep_size", "SELECT pg_reload_conf()")
    report = detect(cfg)
    assert report.decision == "resend", report                 # the consolidate DAG's resend branch
    resend(cfg)
    _exec(conn, "INSERT INTO t SELECT i, 'after' FROM generate_series(2001, 2020) i", "DELETE FROM t WHERE id % 7 = 0")
    conn.close()
    drain_until_current(cfg)
    consolidate(cfg, spark)
    assert_lake_equals_source(cfg)


def _catch(fn):
    try:
        return fn()
    except BaseException as exc:      # handed to the test thread
        return exc


# -- a snapshot, killed mid-chunk (a child process SIGKILLs itself in its third chunk) --------------

SNAPSHOT_CHILD = r"""
import json, os, signal, sys
from tidemark.config import parse_config
from tidemark.capture.snapshot import snapshot_stream

cfg = parse_config(json.loads(sys.argv[1]))
mode, tables = sys.argv[2], json.loads(sys.argv[3]) or None
seen = []

def hook(chunk, attempt):
    seen.append(chunk)
    if len(seen) == 3:
        os.kill(os.getpid(), signal.SIGKILL)

snapshot_stream(cfg, tables=tables, mode=mode, chunk_pages=4, parallelism=1, chunk_hook=hook)
raise SystemExit("the snapshot finished without reaching the kill point")
"""


def _kill_snapshot(cfg, mode: str, tables: list[str] | None = None) -> None:
    proc = subprocess.run([sys.executable, "-c", SNAPSHOT_CHILD, json.dumps(cfg.as_dict()), mode,
                           json.dumps(tables)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-2000:])


def _changes(conn, n: int) -> None:
    _exec(conn, f"INSERT INTO t SELECT i, 'n' || i FROM generate_series({n * 10000}, {n * 10000 + 49}) i",
          f"UPDATE t SET v = v || '+' WHERE id % 7 = {n % 7}", f"DELETE FROM t WHERE id % 11 = {n % 11}")


@pytest.mark.parametrize("mode", ["initial", "table"])
def test_snapshot_killed_mid_copy_runs_again(make_stream, source_conn, spark, mode):
    """kill -9 of a snapshot in the middle of its copy, then the same snapshot again: it starts over
    cleanly (the exported snapshot died with the process; a new consistent point is taken), and the
    lake equals the source after the next drain and consolidation."""
    _exec(source_conn, "CREATE TABLE t (id int PRIMARY KEY, v text)",
          "INSERT INTO t SELECT i, repeat('v', 200) || i FROM generate_series(1, 3000) i")
    cfg = make_stream(["public.t"])
    rounds = iter(range(1, 10))
    if mode == "table":       # an online re-snapshot of a captured table, killed; the stream goes on
        snapshot_stream(cfg)
        _changes(source_conn, next(rounds))
        drain_until_current(cfg)
        consolidate(cfg, spark)
    _kill_snapshot(cfg, mode, ["public.t"])
    with Control(control_dsn(cfg)) as ctl:
        [killed] = ctl.running_snapshots(cfg.stream)         # the dead process left its row running
    store, prefix = landing_store(cfg), f"{cfg.stream}/snapshots/{killed}/"
    assert list(store.list(prefix)), "the killed copy left chunk files"
    _changes(source_conn, next(rounds))
    snapshot_stream(cfg, tables=["public.t"], mode=mode)        # the same command again
    with Control(control_dsn(cfg)) as ctl:                      # which says what happened to the dead one
        assert ctl.running_snapshots(cfg.stream) == []
        with ctl.tx() as cur:
            cur.execute("SELECT status, tables->>'_error' FROM tidemark.snapshots WHERE stream = %s AND "
                        "snapshot_id = %s", (cfg.stream, killed))
            status, why = cur.fetchone()
    assert status == "failed" and "died" in why
    assert list(store.list(prefix)) == [], "its files are removed"
    _changes(source_conn, next(rounds))
    recover_and_compare(cfg, spark)


def test_a_long_open_transaction_does_not_hold_the_drains_back(own_pg, own_stream, spark):
    """A transaction left open in the source (an idle session, a long report) while the stream runs:
    each drain lands what committed around it and returns (it does not wait for it), the lake
    equals what other sessions see; once it commits, the next drain lands it whole, at its commit."""
    from tidemark.capture.drain import drain_stream
    from tidemark.lsn import parse_lsn

    cfg = own_stream
    holder = psycopg2.connect(own_pg.dsn(cfg.stream))      # its BEGIN came first: its changes precede theirs
    _exec(holder, "INSERT INTO t SELECT i, 'open' FROM generate_series(5001, 5100) i",
          "UPDATE t SET v = 'held' WHERE id <= 10")
    conn = _source(own_pg, cfg)
    for round_ in range(3):
        _exec(conn, f"INSERT INTO t SELECT i, 'r{round_}' FROM generate_series({2000 + 100 * round_}, "
                    f"{2049 + 100 * round_}) i", f"UPDATE t SET v = v || '{round_}' WHERE id BETWEEN 20 AND 40")
        with conn.cursor() as cur:
            cur.execute("SELECT pg_current_wal_lsn()")
            committed = cur.fetchone()[0]
        started = time.monotonic()
        drain_stream(cfg)
        assert time.monotonic() - started < 60, "the drain waited for the open transaction"
        with Control(control_dsn(cfg)) as ctl:
            assert ctl.stream(cfg.stream).landed_upper >= parse_lsn(committed), "a committed change was not landed"
        consolidate(cfg, spark)
        assert_lake_equals_source(cfg)                   # the source as other sessions see it: without the open one
    holder.commit()
    holder.close()
    recover_and_compare(cfg, spark)
    conn.close()


# -- the lake's disk fills up (a real tmpfs) ---------------------------------------------------------

@pytest.fixture
def small_lake(tmp_path):
    from dbkit import small_tmpfs

    with small_tmpfs(tmp_path / "lake") as where:
        yield where


def test_a_full_lake_stops_the_consolidation_named_and_not_retried_and_the_run_after_space_is_back_succeeds(
        small_lake, make_stream, source_conn, spark, tmp_path):
    """The lake (a 1 MiB tmpfs) fills up while the merge tasks write a batch's Parquet files (in
    Spark's Python workers): ``tidemark consolidate`` prints one line naming the lake's file and the
    bytes it needs, the remedy on a line of its own, no traceback; the failure is deterministic (the
    Airflow task fails at once, not retried as transient), the incident's cause says the lake is full,
    nothing is committed (table version, frontier); once space is back the next run succeeds, resolves
    the incident, and the lake equals the source."""
    import yaml

    from tidemark.consolidate import consolidate_stream
    from tidemark.consolidate.job import ConsolidateFailed
    from tidemark.errors import describe
    from tidemark.failures import failure_class, is_transient
    from tidemark.lake import committed_frontier, open_delta, table_uri

    ROOT = Path(__file__).resolve().parents[2]
    _exec(source_conn, "CREATE TABLE t (id int PRIMARY KEY, v text)",
          "INSERT INTO t SELECT i, 'v' || i FROM generate_series(1, 100) i")
    cfg = make_stream(["public.t"], lake={"path": str(small_lake)})
    snapshot_stream(cfg)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    uri = table_uri(cfg, "public.t")
    version, done = open_delta(uri).version(), committed_frontier(open_delta(uri), cfg.stream)
    with Control(control_dsn(cfg)) as ctl:
        frontier = ctl.stream(cfg.stream).frontier
    # random text does not compress: more than the lake holds
    _exec(source_conn, "INSERT INTO t SELECT g, string_agg(md5(random()::text), '') FROM "
                       "generate_series(1000, 3000) g, generate_series(1, 40) GROUP BY g")
    drain_until_current(cfg)

    streams = tmp_path / "streams"
    streams.mkdir()
    (streams / f"{cfg.stream}.yaml").write_text(yaml.safe_dump(cfg.as_dict()))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "TIDEMARK_SPARK", "TIDEMARK_DEBUG"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "include"), str(ROOT)]), TIDEMARK_SPARK_CDS="off",
               TIDEMARK_DIST_DIR=str(tmp_path / "dist"), TIDEMARK_SPARK_CONF="spark.driver.memory=512m",
               TIDEMARK_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-m", "tidemark.cli", "--streams", str(streams), "consolidate", cfg.stream],
                         env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in out.stderr and "daemon.py" not in out.stderr, out.stderr[-3000:]
    what, remedy = lines
    assert what.startswith("tidemark: error: consolidation failed (incident ") and "table public.t" in what, what
    assert f"the lake is full: no space left for the file {small_lake}/" in what and "needs at least" in what, what
    assert remedy.startswith("tidemark: remedy: free space on the lake's volume") and str(small_lake) in remedy
    spark_log = (tmp_path / "home" / "logs" / f"spark-{cfg.stream}.log").read_text()   # Spark's own output
    assert "LakeFull: the lake is full" in spark_log and "\tat org.apache.spark" in spark_log, spark_log[-2000:]

    # the same failure in the library (what the Airflow task classifies): deterministic, one incident
    with pytest.raises(ConsolidateFailed) as err:
        consolidate_stream(cfg, spark=spark)
    assert not is_transient(err.value) and failure_class(err.value) == "deterministic"
    assert "needs at least" in describe(err.value)[0]
    with Control(control_dsn(cfg)) as ctl:
        assert ctl.stream(cfg.stream).frontier == frontier                     # nothing committed
        [incident] = [i for i in ctl.incidents(cfg.stream) if i["kind"] == "consolidate_failed"]
    assert incident["count"] == 2 and incident["detail"]["reason"].startswith("the lake is full: no space left")
    assert open_delta(uri).version() == version and committed_frontier(open_delta(uri), cfg.stream) == done

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_lake)], check=True)   # space is back
    consolidate(cfg, spark)
    with Control(control_dsn(cfg)) as ctl:
        assert not [i for i in ctl.incidents(cfg.stream) if i["kind"] == "consolidate_failed"]   # resolved
    assert_lake_equals_source(cfg)
