"""The log clean-up of `tidemark.maintain` (`commit.checkpoint_and_vacuum`) never makes a version
inside the retention window unloadable: log entries go only once older than the table's log
retention, which `commit.set_log_retention` keeps above ``lake.retention`` (30 days unless set)."""

from __future__ import annotations

import os
import time

import pyarrow as pa
from deltalake import write_deltalake

from tidemark.lake.writer import checkpoint_and_vacuum, set_log_retention
from tidemark.lake import open_delta

DAY = 86400


def _table(path, versions: int, old: int, days: float):
    """A table of ``versions`` versions whose first ``old`` ones (and a checkpoint at the last of them)
    are ``days`` old: a log entry's age is its file's modification time."""
    for i in range(versions):
        write_deltalake(str(path), pa.table({"a": pa.array([i], pa.int64())}), mode="append")
        if i == old - 1:
            open_delta(str(path), None).create_checkpoint()
    log = path / "_delta_log"
    t = time.time() - days * DAY
    for f in [f"{v:020d}.json" for v in range(old)] + [f"{old - 1:020d}.checkpoint.parquet"]:
        os.utime(log / f, (t, t))
    return open_delta(str(path), None)


def _loadable(path, versions) -> list[int]:
    out = []
    for v in versions:
        dt = open_delta(str(path), None)
        try:
            dt.load_as_version(v)
            assert dt.to_pyarrow_table().num_rows == v + 1
            out.append(v)
        except Exception:  # noqa: BLE001 - a cleaned-up version
            pass
    return out


def test_the_default_window_keeps_its_versions_and_older_log_entries_go(tmp_path):
    # versions 0-2 are 40 days old (outside a 7-day window; 2, with its checkpoint, is the one current
    # at the window's start), 3-5 are young: the log entries before the old checkpoint go
    dt = _table(tmp_path, 6, 3, 40)
    checkpoint_and_vacuum(dt, retention_hours=7 * 24, keep_versions=[2, 3, 4, 5])
    assert _loadable(tmp_path, range(6)) == [2, 3, 4, 5]      # the clean-up ran, and kept the window


def test_a_window_longer_than_30_days_raises_the_log_retention(tmp_path):
    # a 60-day window: versions 40 days old are inside it and must stay loadable
    dt = _table(tmp_path, 6, 3, 40)
    set_log_retention(dt, 60 * DAY + DAY)
    dt = open_delta(str(tmp_path), None)
    assert dt.metadata().configuration["delta.logRetentionDuration"] == f"interval {61 * DAY} seconds"
    checkpoint_and_vacuum(dt, retention_hours=60 * 24, keep_versions=list(range(dt.version() + 1)))
    assert _loadable(tmp_path, range(6)) == list(range(6))


def test_a_feed_file_size_is_read_from_a_landing_directory_whose_path_needs_quoting(tmp_path):
    # store.uri percent-encodes the path (Path.as_uri): a space or a % in the landing directory
    from tidemark.landing.store import LocalStore
    from tidemark.maintain import _size

    store = LocalStore(tmp_path / "landing 100%")
    store.put("demo/changelog/public.t/feed-1.cdc", b"x" * 123)
    assert _size(store, "demo/changelog/public.t/feed-1.cdc") == 123
    assert _size(store, "demo/changelog/public.t/missing.cdc") is None
