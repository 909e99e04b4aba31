"""Maintenance (`tidemark.maintain`) against PostgreSQL itself (real slot, real Spark).

A keyed table and a keyless one take several small batches (each leaves small files and replaced
ones behind); then `maintain` compacts, checkpoints and vacuums. Checked: the lake equals the
source and the changelog holds the same rows after the compaction (it changes no row); the data
files on disk are exactly those the versions inside the retention window reference, and every one
of those versions reads as before; a position below the window is refused by `read_tables(at=…)`,
`read_tables(frontier=…)` with one line naming the oldest readable one (`key_history` starts at the
window's first version); the landing
files below the floor are deleted and the archive and the feed record say which, while a lagging
subscriber keeps its segments (and the status data says how many bytes it holds), a changelog
rebuild inside the window still rebuilds the same rows and one below it (or a subscriber below it)
gets one line; a maintenance cannot start beside a consolidation (the lease); a maintenance killed
at named points leaves a readable lake and a re-run finishes the job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tidemark.capture.snapshot import snapshot_stream
from tidemark.control import open_control
from tidemark.control.db import StreamBusy
from tidemark.lake import LakeError, changelog_uri, open_delta, read_changelog, read_tables, storage_options, table_uri
from tidemark.maintain import maintain

from oracle import assert_lake_equals_source, consolidate, drain_until_current, rows

TABLES = ["public.m_keyed", "public.m_bag"]


def _setup(source_conn):
    with source_conn, source_conn.cursor() as cur:
        cur.execute("CREATE TABLE public.m_keyed (id int PRIMARY KEY, v text)")
        cur.execute("CREATE TABLE public.m_bag (g int, t text)")
        cur.execute("ALTER TABLE public.m_bag REPLICA IDENTITY FULL")
        cur.execute("INSERT INTO public.m_keyed SELECT i, 'v' || i FROM generate_series(1, 400) i")
        cur.execute("INSERT INTO public.m_bag SELECT i % 7, 'b' FROM generate_series(1, 50) i")


def _batch(source_conn, i: int) -> None:
    with source_conn, source_conn.cursor() as cur:
        cur.execute("UPDATE public.m_keyed SET v = v || %s WHERE id %% 9 = %s", (f".{i}", i % 9))
        cur.execute("INSERT INTO public.m_keyed VALUES (%s, 'new')", (1000 + i,))
        cur.execute("DELETE FROM public.m_keyed WHERE id = %s", (i * 3 + 1,))
        cur.execute("INSERT INTO public.m_bag VALUES (%s, 'x')", (i % 3,))


def _versions(cfg, table: str, versions: list[int] | None = None) -> dict[int, object]:
    """These versions (every listed one by default) of the lake table, read."""
    dt = open_delta(table_uri(cfg, table), storage_options(cfg))
    out = {}
    for v in versions if versions is not None else [int(h["version"]) for h in dt.history()]:
        dt.load_as_version(v)
        out[v] = rows(dt.to_pyarrow_table().drop_columns(["_bucket"]))
    return out


def _files(cfg, table: str) -> int:
    return len(open_delta(table_uri(cfg, table), storage_options(cfg)).file_uris())


def _on_disk(uri: str) -> set[str]:
    """The table's data files on disk (relative paths; the log's checkpoints are not data files)."""
    out = set()
    for d, _, fs in os.walk(uri):
        rel = os.path.relpath(d, uri)
        if rel.split(os.sep)[0] == "_delta_log":
            continue
        out |= {os.path.normpath(os.path.join(rel, f)) for f in fs if f.endswith(".parquet")}
    return out


def _window_files(cfg, table: str, start_ms: int) -> tuple[list[int], set[str]]:
    """(the versions inside the window starting at ``start_ms``: the one current at its start and every
    later one; the data files any of them references), from the table's log, not from `tidemark.maintain`."""
    from urllib.parse import unquote

    import pyarrow as pa

    dt = open_delta(table_uri(cfg, table), storage_options(cfg))
    stamps = sorted((int(h["version"]), int(h["timestamp"])) for h in dt.history())
    v0 = max((v for v, ts in stamps if ts <= start_ms), default=None)
    inside = [v for v, _ in stamps if v0 is None or v >= v0]
    files: set[str] = set()
    for v in inside:
        dt.load_as_version(v)
        files |= {os.path.normpath(unquote(f)) for f in pa.table(dt.get_add_actions(flatten=True))["path"].to_pylist()}
    return inside, files


@pytest.fixture
def stream(make_stream, source_conn, spark):
    _setup(source_conn)
    # a small target (32 rows a file): a few hundred rows make the layout questions real
    cfg = make_stream(TABLES, consolidate={"buckets": 2}, lake={"retention": "1 minute"})
    snapshot_stream(cfg)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    for i in range(6):
        _batch(source_conn, i)
        drain_until_current(cfg)
        consolidate(cfg, spark)
    return cfg


def test_maintain_compacts_vacuums_and_keeps_the_window(stream, source_conn, spark, monkeypatch):
    cfg = stream
    logs = {t: rows(read_changelog(cfg, t).drop_columns(["_commit_date"])) for t in TABLES}
    with open_control(cfg) as ctl:
        old_frontier = ctl.stream(cfg.stream).frontier      # the frontier before the last batch below
    keyed = table_uri(cfg, "public.m_keyed")
    log_dt = open_delta(changelog_uri(cfg, "public.m_keyed"), storage_options(cfg))
    log_files_before, disk_before = len(log_dt.file_uris()), _on_disk(keyed)
    # a compaction leaves bucket files behind it (replaced): more on disk than the current version lists
    assert len(disk_before) > _files(cfg, "public.m_keyed")
    # nothing is older than the window yet (1 minute): every version is inside it and must survive
    before = _versions(cfg, "public.m_keyed")
    report = maintain(cfg, target_rows=256)
    after = _versions(cfg, "public.m_keyed")
    assert all(after[v] == before[v] for v in before), "a version inside the window reads otherwise"
    for t in TABLES:
        assert_lake_equals_source(cfg, t)
        assert rows(read_changelog(cfg, t).drop_columns(["_commit_date"])) == logs[t], t
    log_dt = open_delta(changelog_uri(cfg, "public.m_keyed"), storage_options(cfg))
    assert len(log_dt.file_uris()) < log_files_before, report.as_dict()
    assert any(r.compacted for r in report.tables if r.kind == "changelog"), report.as_dict()
    # a window that starts between two batches: the versions inside it keep every file they reference
    # (and read as before), the files only older versions referenced are deleted
    stamps = sorted((int(h["version"]), int(h["timestamp"])) for h in
                    open_delta(keyed, storage_options(cfg)).history())
    mid = stamps[len(stamps) // 2][1] + 1
    inside, referenced = _window_files(cfg, "public.m_keyed", mid)
    assert 1 < len(inside) < len(stamps)
    maintain(cfg, now_ms=mid + 60_000, target_rows=256)
    assert _on_disk(keyed) == referenced, (sorted(_on_disk(keyed) - referenced), sorted(referenced - _on_disk(keyed)))
    after = _versions(cfg, "public.m_keyed", inside)
    assert all(after[v] == before[v] for v in inside if v in before), "a version inside the window reads otherwise"
    # later, the window has moved past every version but the current: the vacuum deletes the rest
    later = int(time.time() * 1000) + 120_000
    maintain(cfg, now_ms=later, target_rows=256)
    inside, referenced = _window_files(cfg, "public.m_keyed", later - 60_000)
    assert _on_disk(keyed) == referenced, (sorted(_on_disk(keyed) - referenced), sorted(referenced - _on_disk(keyed)))
    assert len(referenced) == _files(cfg, "public.m_keyed") and len(referenced) < len(disk_before)
    _versions(cfg, "public.m_keyed", inside)          # every version inside the window still loads
    for t in TABLES:
        assert_lake_equals_source(cfg, t)
        assert rows(read_changelog(cfg, t).drop_columns(["_commit_date"])) == logs[t], t
    # a batch after maintenance merges into the compacted layout
    _batch(source_conn, 50)
    drain_until_current(cfg)
    consolidate(cfg, spark)
    for t in TABLES:
        assert_lake_equals_source(cfg, t)
    # below the window: one line naming the oldest position that can be read, from every reader of
    # the past (on the maintenance's clock)
    from tidemark.lake import retention
    from tidemark.lake.history import key_history

    real = retention.window_start_ms
    monkeypatch.setattr(retention, "window_start_ms", lambda c, now_ms=None: real(c, later if now_ms is None else now_ms))
    one_line = r"^[^\n]*older than stream .* retention window \(lake.retention: 1 minute\); the oldest position it " \
               r"can read is [0-9A-F]+/[0-9A-F]+$"
    with pytest.raises(LakeError, match=one_line):
        read_tables(cfg, at=old_frontier)
    with pytest.raises(LakeError, match=one_line):
        read_tables(cfg, frontier=old_frontier)
    # a key's history starts at the window's first version when the load is older than the window
    oldest = retention.oldest_readable(cfg)
    versions = key_history(cfg, "public.m_keyed", {"id": "5"})
    assert versions and min(v["_valid_from_lsn"] for v in versions) >= oldest > old_frontier
    current = [v for v in versions if v["_is_current"]]
    with open_control(cfg) as ctl:
        now_frontier = ctl.stream(cfg.stream).frontier
    lake_row = [r for r in read_tables(cfg, frontier=now_frontier)["public.m_keyed"].to_pylist() if str(r["id"]) == "5"]
    assert [{k: v[k] for k in lake_row[0]} for v in current] == lake_row if lake_row else not current
    read_tables(cfg, frontier=now_frontier)                 # the current state is always inside


def test_landing_retention_keeps_a_lagging_subscribers_segments(stream, source_conn, spark, monkeypatch):
    import datetime as _dt

    import psycopg2

    from tidemark.consolidate.interval import ChangelogError, write_changelog
    from tidemark.status import stream_overview
    from tidemark.lake import retention
    from tidemark.subscribers import SubscriberError, add_subscriber, read_changes

    cfg = stream
    with open_control(cfg) as ctl:
        frontier = ctl.stream(cfg.stream).frontier
    add_subscriber(cfg, "lagger", from_frontier=True)
    # the window (1 minute) starts here: the versions of the batches below are inside it, and the
    # version current now (at the subscriber's checkpoint) is the oldest one inside
    time.sleep(0.05)
    start_ms = int(time.time() * 1000)
    time.sleep(0.05)
    t_batches = _dt.datetime.now(_dt.timezone.utc)
    for i in range(10, 13):
        _batch(source_conn, i)
        drain_until_current(cfg)
        consolidate(cfg, spark)
    logs = {t: rows(read_changelog(cfg, t).drop_columns(["_commit_date"])) for t in TABLES}
    _batch(source_conn, 13)
    drain_until_current(cfg)                     # landed, not consolidated: a consolidation (or repair) needs it
    now = start_ms + 60_000
    # everything that reads the past uses the same clock as the maintenance here
    real = retention.window_start_ms
    monkeypatch.setattr(retention, "window_start_ms", lambda c, now_ms=None: real(c, now if now_ms is None else now_ms))
    report = maintain(cfg, now_ms=now)
    assert report.floor == frontier, report.as_dict()       # the subscriber's checkpoint and the window hold it
    with open_control(cfg) as ctl:
        segs = ctl.segments(cfg.stream, status=None)
        with psycopg2.connect(ctl.dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT seq FROM tidemark.segments_archive WHERE stream = %s AND file_deleted_at IS NOT NULL",
                        (cfg.stream,))
            deleted = {r[0] for r in cur.fetchall()}
            cur.execute("SELECT key FROM tidemark.deleted_feed_files WHERE stream = %s", (cfg.stream,))
            feed_deleted = {r[0] for r in cur.fetchall()}
    assert deleted and deleted == set(report.deleted_segments)          # the archive says which went
    for s in segs:
        exists = os.path.exists(s.uri[len("file://"):])
        assert exists == (s.seq not in deleted), s
        if s.upper > frontier:                   # the subscriber has not acknowledged them, or not consolidated
            assert exists, s
    # every segment below the floor went, but the newest one (the manifest keeps it: `archive_segments`)
    below = [s.seq for s in segs if s.upper <= frontier]
    assert deleted == set(below) - {max(below)}
    assert report.deleted_feed_files and feed_deleted == {k for k in report.deleted_feed_files}
    assert not any(os.path.exists(os.path.join(cfg.landing.url, k)) for k in feed_deleted)
    with open_control(cfg) as ctl:
        subs = stream_overview(ctl, cfg.stream, tables=TABLES)["subscribers"]
    held = next(s for s in subs if s["name"] == "lagger")
    assert held["lagging"] and held["held_bytes"] > 0, held
    # the subscriber still reads what it has not acknowledged
    changes = read_changes(cfg, "lagger")
    assert changes.lower == frontier and changes.num_changes > 0
    # a rebuild of an interval inside the window still has its segments and its lake version: same rows
    out = write_changelog(cfg, start=t_batches, end=_dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(hours=1),
                          spark=spark)
    assert out["replaced"] == [] and sum(out["tables"].values()) > 0, out
    for t in TABLES:
        assert rows(read_changelog(cfg, t).drop_columns(["_commit_date"])) == logs[t], t
    # below the window: one line naming the oldest position, for a rebuild and for a subscriber
    with pytest.raises(ChangelogError, match=r"^[^\n]*older than .* retention window .* oldest position it can "
                                             r"read is [0-9A-F]+/[0-9A-F]+$"):
        write_changelog(cfg, start=_dt.datetime(2000, 1, 1), end=t_batches, spark=spark)
    add_subscriber(cfg, "late")                  # at checkpoint 0: its segments' files are deleted
    with pytest.raises(SubscriberError, match=r"^subscriber late: position 0/0 is older than .* the oldest "
                                              r"position it can read is [0-9A-F]+/[0-9A-F]+$"):
        read_changes(cfg, "late")
    # the landed batch consolidates after the maintenance: nothing it needed was deleted
    consolidate(cfg, spark)
    for t in TABLES:
        assert_lake_equals_source(cfg, t)


def test_maintain_excludes_a_consolidation(stream):
    cfg = stream
    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, "consolidate"):
        with pytest.raises(StreamBusy, match="maintain cannot run beside"):
            maintain(cfg)
    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, "drain"):
        maintain(cfg)          # a drain runs beside it


# Where a maintenance run is killed (SIGKILL from inside, at a named point): (module:function, which
# call: n, before the n-th call; -n, right after it returns). Run one after another on one stream,
# each run gets further before its kill.
KILL_POINTS = [
    ("tidemark.lake.writer:commit_files", 1),                  # compaction files written, no commit
    ("tidemark.lake.writer:checkpoint_and_vacuum", 2),         # one table done, the next compacted
    ("deltalake:DeltaTable.vacuum", 3),                               # a checkpoint written, no vacuum yet
    ("tidemark.control.db:Control.mark_segment_files_deleted", 1),    # segment files deleted, not recorded
    ("tidemark.control.db:Control.record_feed_files_deleted", 1),     # feed files listed, not recorded
    ("tidemark.control.db:Control.record_feed_files_deleted", -1),    # feed files recorded, not deleted yet
]

KILL_SCRIPT = """
import functools, importlib, json, os, signal, sys
from tidemark.config import parse_config
from tidemark.maintain import maintain
where, nth = sys.argv[2], int(sys.argv[3])
mod, path = where.split(":")
*parents, name = path.split(".")
owner = functools.reduce(getattr, parents, importlib.import_module(mod))
real, calls = getattr(owner, name), []
def kill():
    print("killed at", where, nth, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
def killing(*a, **k):
    calls.append(1)
    if len(calls) == nth:
        kill()
    out = real(*a, **k)
    if len(calls) == -nth:
        kill()
    return out
setattr(owner, name, killing)
cfg = parse_config(json.loads(open(sys.argv[1]).read()), origin="<test>")
maintain(cfg, now_ms=int(sys.argv[4]), target_rows=256)
print("finished", flush=True)
"""


def test_kill_of_maintenance_leaves_a_readable_lake(stream, tmp_path):
    import json

    import psycopg2

    cfg = stream
    with open_control(cfg) as ctl:
        frontier = ctl.stream(cfg.stream).frontier
    expected = {t: rows(v) for t, v in read_tables(cfg, frontier=frontier).items()}
    logs = {t: rows(read_changelog(cfg, t).drop_columns(["_commit_date"])) for t in TABLES}
    from tidemark.landing.store import landing_store
    from tidemark.landing.store import stream_keys

    def feed_files() -> set[str]:
        return {k for k in landing_store(cfg).list(stream_keys(cfg.stream)["changelog"]) if k.endswith(".avro")}

    feed_before = feed_files()
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.as_dict()))
    (tmp_path / "run.py").write_text(KILL_SCRIPT)
    later = int(time.time() * 1000) + 120_000        # every batch's version is outside the window: work for all
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for where, nth in KILL_POINTS:
        p = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "cfg.json"), where,
                            str(nth), str(later)], env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == -signal.SIGKILL and "killed at" in p.stdout, (where, p.stdout, p.stderr[-3000:])
        for t, want in expected.items():          # readable after each kill: the same rows, the same changelog
            assert rows(read_tables(cfg, frontier=frontier)[t]) == want, (where, t)
            assert rows(read_changelog(cfg, t).drop_columns(["_commit_date"])) == logs[t], (where, t)
    report = maintain(cfg, now_ms=later, target_rows=256)        # a re-run finishes the job
    for t in TABLES:
        assert_lake_equals_source(cfg, t)
        assert rows(read_changelog(cfg, t).drop_columns(["_commit_date"])) == logs[t], t
    # the archive says exactly which segment files are gone, the deleted feed files are all listed
    with open_control(cfg) as ctl, psycopg2.connect(ctl.dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT uri, file_deleted_at IS NOT NULL FROM tidemark.segments_archive WHERE stream = %s",
                    (cfg.stream,))
        archived = cur.fetchall()
        cur.execute("SELECT key FROM tidemark.deleted_feed_files WHERE stream = %s", (cfg.stream,))
        feed = [r[0] for r in cur.fetchall()]
    assert any(gone for _, gone in archived), (archived, report.as_dict())
    for uri, gone in archived:
        assert os.path.exists(uri[len("file://"):]) != gone, uri
    gone = feed_before - feed_files()
    assert gone and set(feed) == gone            # every feed file that went is recorded, and only those
