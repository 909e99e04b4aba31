"""`tidemark status` and the CDC status page say the same figures the same way: the storage (the CLI
said 217.2 kB where the page said 217,179 B (212.1 KiB)), the landing store's parts (the page left the
snapshots out, so its parts did not add up), freshness (ok: last 20 s ago (allowed 600 s) beside ok:
27.4 s ago (allowed 10.0 min)), times (the CLI printed the control database's session time zone with
microseconds, the last maintenance with %Z of that zone), the commit lag (a dict) and the slot lag."""

from __future__ import annotations

import datetime as dt
import html
import re
import sys
from pathlib import Path

from tidemark import cli, status

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))

from tidemark_status.page import render_page  # noqa: E402

BERLIN = dt.timezone(dt.timedelta(hours=1))       # a control database whose TimeZone is not UTC
SEGMENT_AT = dt.datetime(2026, 11, 22, 13, 0, 5, 123456, tzinfo=BERLIN)
MEASURED = dt.datetime(2026, 11, 22, 13, 1, 0, tzinfo=BERLIN)
LAG = {"median_seconds": 17.9, "p95_seconds": 18.2, "max_seconds": 130.0, "transactions": 254, "batches": 1,
       "window_seconds": 3600}
STORAGE = {"retention": "7 days", "oldest_readable": None,
           "lake": {"live_bytes": 217179, "live_files": 36, "disk_bytes": 523843, "disk_files": 104,
                    "log_bytes": 64530, "log_files": 12, "unlisted_bytes": 0},
           "landing": {"bytes": 163759, "segment_bytes": 25985, "segment_files": 1, "feed_bytes": 39588,
                       "feed_files": 4, "snapshot_bytes": 98186, "snapshot_files": 2, "other_bytes": 0},
           "tables": {"public.t": {"table": {"live_bytes": 96840, "live_files": 8, "disk_bytes": 250031,
                                             "disk_files": 26, "log_bytes": 14150, "log_files": 4}}}}
MAINTAINED = {"started_at": MEASURED, "finished_at": MEASURED, "report": {"seconds": 0.4, "tables": []}}
FRESH = {"late": [], "drain": {"late": False, "age_seconds": 27.4, "allowance_seconds": 600.0, "last_at": None},
         "consolidation": {"late": False, "age_seconds": None, "allowance_seconds": 600.0, "last_at": None}}


def _cli(monkeypatch, capsys) -> str:
    figures = {"stream": "s", "state": "capturing", "frontier": 16, "incidents": [], "freshness": FRESH,
               "last_segment_at": SEGMENT_AT, "metrics_updated_at": MEASURED, "commit_lag": LAG,
               "slot_lag_bytes": 7544, "slot_lag_seconds": 95.0, "storage": STORAGE, "storage_error": None,
               "write_cost": {}, "subscribers": [], "last_maintenance": MAINTAINED}
    monkeypatch.setattr(cli, "find_stream", lambda name, where: type("Cfg", (), {"stream": name})())
    monkeypatch.setattr(status, "stream_status", lambda cfg: figures)
    assert cli.main(["status", "s"]) == 0
    return capsys.readouterr().out


def _page() -> str:
    page = render_page([{"stream": "s", "registered": True, "state": "capturing", "slot": "s", "publication": "p",
                         "frontier": 16, "landed_upper": 16, "last_segment_at": SEGMENT_AT, "metrics_at": MEASURED,
                         "commit_lag": LAG, "slot_lag_bytes": 7544, "slot_lag_seconds": 95.0, "freshness": FRESH,
                         "storage": {**STORAGE, "at": MEASURED}, "last_maintenance": MAINTAINED, "incidents": [],
                         "segments": [], "history": []}], now=MEASURED)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def test_the_status_command_and_the_status_page_word_each_figure_alike(monkeypatch, capsys):
    out, page = _cli(monkeypatch, capsys), re.sub(r"\s+", " ", _page())
    said = {
        "last segment": "2026-11-22 12:00:05 UTC", "measured": "2026-11-22 12:01:00 UTC",
        "commit lag": "median 17.9 s, p95 18.2 s, max 2.2 min (254 transactions in 1 batches)",
        "slot lag": "7,544 B (7.4 KiB)", "slot lag time": "95.0 s",
        "lake live": "217,179 B (212.1 KiB)", "lake on disk": "523,843 B (511.6 KiB)", "ratio": "2.41×",
        "landing": ("163,759 B (159.9 KiB): segments 25,985 B (25.4 KiB) in 1 files, changelog feed 39,588 B "
                    "(38.7 KiB) in 4 files, snapshots 98,186 B (95.9 KiB), other 0 B"),
        "table live": "96,840 B (94.6 KiB)", "drain freshness": "ok: last 27.4 s ago (allowed 10.0 min)",
        "consolidation freshness": "ok: nothing waits (allowed 10.0 min)",
        "last maintenance": "2026-11-22 12:01:00 UTC, 0.4 s: 0 files compacted",
    }
    for what, text in said.items():
        assert text in out, (what, text, out)
        assert text in page, (what, text, page)
    assert "+01:00" not in out and ".123456" not in out and "{" not in out
