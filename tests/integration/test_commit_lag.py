"""The commit -> lake lag the status page shows (`Control.commit_lag`): from the landed segments'
commit-time bounds and the time of the frontier move that consolidated them, over the last hour."""

from __future__ import annotations

import datetime as dt
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))

from tidemark.control.db import Segment, lag_summary  # noqa: E402
from tidemark.status import overview  # noqa: E402
from tidemark_status.page import render_page  # noqa: E402


def _segment(cfg, seq, lower, upper, txns, first_ago, last_ago):
    now_us = int(time.time() * 1e6)
    return Segment(stream=cfg.stream, seq=seq, lower=lower, upper=upper, uri=f"file:///x/{seq}", record_count=txns,
                   txn_count=txns, byte_size=1, checksum="x", min_commit_ts=now_us - int(first_ago * 1e6),
                   max_commit_ts=now_us - int(last_ago * 1e6))


def test_commit_lag_of_the_consolidated_transactions(make_stream, control):
    cfg = make_stream(["public.items"])
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=100, landed_upper=100)
    assert control.commit_lag(cfg.stream) is None                 # nothing consolidated yet
    # 100 transactions committed 20..10 s ago and 100 committed 4..2 s ago, consolidated now in two moves;
    # a progress-only segment (no transactions) counts for nothing; one not consolidated yet neither
    control.register_segment(_segment(cfg, 0, 100, 200, 100, 20, 10))
    control.register_segment(Segment(stream=cfg.stream, seq=1, lower=200, upper=300, uri="file:///x/1",
                                     record_count=0, txn_count=0, byte_size=1, checksum="x"))
    control.register_segment(_segment(cfg, 2, 300, 400, 100, 4, 2))
    control.register_segment(_segment(cfg, 3, 400, 500, 1000, 1, 0))
    control.advance_frontier(cfg.stream, 300)
    control.advance_frontier(cfg.stream, 400)
    control.advance_frontier(cfg.stream, 350)                      # not a move: the frontier never goes back
    lag = control.commit_lag(cfg.stream)
    assert lag["transactions"] == 200 and lag["batches"] == 2
    assert 2.0 <= lag["median_seconds"] <= 10.5                    # half of them waited 2..4 s, half 10..20 s
    assert 17.0 <= lag["p95_seconds"] <= 20.5 and 18.5 <= lag["max_seconds"] <= 21.0
    (entry,) = overview([cfg])
    assert entry["commit_lag"] == control.commit_lag(cfg.stream) or entry["commit_lag"]["transactions"] == 200
    page = render_page([entry], now=dt.datetime.now(dt.timezone.utc))
    assert "commit → lake lag (last hour)" in page and "200 transactions in 2 batches" in page
    from tidemark.status import stream_status

    assert stream_status(cfg)["commit_lag"]["transactions"] == 200          # tidemark status (--json)
    # the gap sensor archives the consolidated rows at once (`archive_segments`): the lag still counts them
    # (it read only the live manifest, and showed nothing a minute into a running stream)
    assert control.archive_segments(cfg.stream) > 0
    assert control.commit_lag(cfg.stream) == lag


def test_lag_summary_weights_segments_by_their_transactions():
    # one segment of 1 transaction that waited 100 s, one of 99 that waited 1 s: the median is 1 s
    rows = [(200e6, 100e6, 100e6, 1), (200e6, 199e6, 199e6, 99)]
    lag = lag_summary(rows, 3600)
    assert lag["median_seconds"] == 1.0 and lag["max_seconds"] == 100.0 and lag["transactions"] == 100
    assert lag_summary([], 3600) is None
