"""The status page's storage and write-cost sections: one sparkline per table with one point per batch
that has an amplification (a snapshot load's batch is a gap), the latest and median, the storage
figures as recorded (the Delta log's share, landing bytes, the oldest readable position) and the last
maintenance run; everything escaped."""

from __future__ import annotations

import datetime as dt
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))

from tidemark_status.page import render_page, sparkline  # noqa: E402

NOW = dt.datetime(2026, 11, 22, 12, 0, tzinfo=dt.timezone.utc)
EVIL = '"><script>alert(1)</script>'


def _batch(i: int, added: int, changed: int, snapshot: bool = False) -> dict:
    return {"at": NOW, "table_name": "public.t", "frontier": 100 + i, "frontier_before": 99 + i, "version_from": i,
            "version_to": i, "added_files": 2, "added_bytes": added, "removed_files": 2, "removed_bytes": added,
            "change_records": 10, "change_bytes": changed, "changelog_bytes": 50, "live_bytes": 5000,
            "snapshot_load": snapshot}


def _stream(**kw) -> dict:
    base = {"stream": "demo", "registered": True, "state": "capturing", "slot": "s", "publication": "p",
            "frontier": 0x16B3748, "landed_upper": 0x16B3748, "incidents": [], "segments": [], "history": []}
    base.update(kw)
    return base


STORAGE = {"at": NOW, "retention": "7 days", "oldest_readable": 0x16B0000,
           "lake": {"live_bytes": 1000, "live_files": 4, "disk_bytes": 3000, "disk_files": 20, "log_bytes": 700,
                    "log_files": 9, "unlisted_bytes": 0},
           "landing": {"bytes": 900, "segment_bytes": 600, "segment_files": 3, "feed_bytes": 300, "feed_files": 2,
                       "snapshot_bytes": 0, "snapshot_files": 0, "other_bytes": 0},
           "tables": {EVIL: {"table": {"live_bytes": 1000, "live_files": 4, "disk_bytes": 3000, "disk_files": 20,
                                       "log_bytes": 700, "log_files": 9}}}}
MAINTAINED = {"started_at": NOW, "finished_at": NOW, "report": {
    "stream": "demo", "seconds": 2.5, "tables": [{"compacted": 6, "vacuumed": 11}, {"compacted": 0, "vacuumed": 3}],
    "deleted_segments": 4, "deleted_segment_bytes": 4000, "deleted_feed_files": 1, "deleted_feed_bytes": 100}}


def test_one_sparkline_per_table_with_a_point_per_measured_batch():
    costs = {"public.t": [_batch(0, 9000, 0, snapshot=True), _batch(1, 400, 100), _batch(2, 900, 100),
                          _batch(3, 200, 100)],
             "public.u": [_batch(0, 300, 100)]}
    page = render_page([_stream(write_costs=costs, storage=STORAGE, last_maintenance=MAINTAINED)], now=NOW)
    assert page.count('class="sparkline"') == 2
    row = page.split('data-table="public.t"')[1].split("</tr>")[0]
    points = re.search(r'points="([^"]+)"', row).group(1).split()
    assert len(points) == 3                                   # the snapshot load's batch is a gap
    ys = [float(p.split(",")[1]) for p in points]
    assert ys[1] < ys[0] < ys[2]                              # 9x highest on screen, then 4x, then 2x
    assert '<td class="num latest">2.00×</td>' in row and '<td class="num median">4.00×</td>' in row
    assert "public.u" in page and "3.00×" in page.split('data-table="public.u"')[1]


def test_storage_figures_and_the_last_maintenance_run():
    page = render_page([_stream(storage=STORAGE, last_maintenance=MAINTAINED, write_costs={})], now=NOW)
    assert "3,000 B" in page and "(3.00× live)" in page and "700 B in 9 files" in page     # the log's share
    assert "segments 600 B in 3 files, changelog feed 300 B in 2 files" in page
    assert ">0/16B0000<" in page and "lake.retention 7 days" in page
    assert "6 files compacted, 14 vacuumed over 2 Delta tables" in page and "4 segment files" in page
    assert "no batch recorded yet" in page
    assert "<script" not in page and "&quot;&gt;&lt;script&gt;" in page


def test_nothing_measured_yet():
    page = render_page([_stream()], now=NOW)
    assert "not measured yet" in page and "last maintenance: never" in page and "no batch recorded yet" in page
    assert sparkline([None, None], title="t").endswith("</svg>")
