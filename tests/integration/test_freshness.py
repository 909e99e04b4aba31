"""The freshness alarm: a stream whose DAGs have not run when their schedules say they should have (a
dead scheduler: no job runs, so no incident opens) is shown late by `tidemark status` and the status
page, with allowances derived from the DAGs' schedules and the stream's config; a fresh one is not."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

import psycopg2
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))

from test_gaps_kit import create_items, land_chain, start_stream, items_schema  # noqa: E402
from tidemark import cli  # noqa: E402
from tidemark.control import Control, control_dsn  # noqa: E402
from tidemark.status import overview  # noqa: E402
from tidemark.schedules import DRAIN_SAFETY_SECONDS, GAP_SENSOR_TIMEOUT_SECONDS  # noqa: E402
from tidemark_status.page import render_page  # noqa: E402


@pytest.fixture
def live_stream(make_stream, source_conn, tmp_path):
    """A stream (drain stall timeout 90 s, a timed consolidation every 2 min) with three landed
    segments, the first consolidated; its stream file in a streams dir."""
    create_items(source_conn)
    cfg = make_stream(["public.items"], drain={"stall_timeout_seconds": 90},
                      consolidate={"check_every_minutes": 2})
    start = start_stream(cfg)
    chain = land_chain(cfg, items_schema(cfg), start, 3)
    with Control(control_dsn(cfg)) as ctl:
        ctl.advance_frontier(cfg.stream, chain[0].upper, committed_segment=0)
    streams = tmp_path / "streams"
    streams.mkdir()
    (streams / f"{cfg.stream}.yaml").write_text(yaml.safe_dump(cfg.as_dict()))
    return cfg, streams


def _age(cfg, seconds: float) -> None:
    """Make every segment's landing and the consolidation's last move ``seconds`` old."""
    with psycopg2.connect(control_dsn(cfg)) as conn, conn.cursor() as cur:
        cur.execute("UPDATE tidemark.segments SET created_at = now() - make_interval(secs => %s) WHERE stream = %s",
                    (seconds, cfg.stream))
        cur.execute("""UPDATE tidemark.subscribers SET updated_at = now() - make_interval(secs => %s)
                        WHERE stream = %s AND name = 'consolidate'""", (seconds, cfg.stream))
    conn.close()


def _shown(cfg, streams: Path, capsys) -> tuple[str, dict, str]:
    """What `tidemark status` prints, the page data and the page; it exits `cli.EXIT_LATE` when late."""
    code = cli.main(["--streams", str(streams), "status", cfg.stream])
    out = capsys.readouterr().out
    (entry,) = overview([cfg])
    assert code == (cli.EXIT_LATE if entry["freshness"]["late"] else 0)
    return out, entry, render_page([entry], now=dt.datetime.now(dt.timezone.utc))


def test_a_stream_whose_dags_have_not_run_is_shown_late(live_stream, capsys):
    cfg, streams = live_stream
    drain_allowed = DRAIN_SAFETY_SECONDS + 90                # the safety drain + drain.stall_timeout_seconds
    consolidate_allowed = 2 * 60 + GAP_SENSOR_TIMEOUT_SECONDS  # check_every_minutes + the gap sensor's wait

    out, entry, page = _shown(cfg, streams, capsys)          # just landed and consolidated: fresh
    fresh = entry["freshness"]
    assert fresh["late"] == [] and "LATE" not in out and "late:" not in page
    assert fresh["drain"]["allowance_seconds"] == drain_allowed
    assert fresh["consolidation"]["allowance_seconds"] == consolidate_allowed
    assert "drain freshness: ok" in out and "consolidation freshness: ok" in out

    _age(cfg, drain_allowed - 30)                            # within both allowances
    out, entry, page = _shown(cfg, streams, capsys)
    assert entry["freshness"]["late"] == [] and "LATE" not in out and "late:" not in page

    _age(cfg, drain_allowed + 15)                            # the drain is late, the consolidation not yet
    out, entry, page = _shown(cfg, streams, capsys)
    (late,) = entry["freshness"]["late"]
    assert late.startswith("drain: no segment landed for") and f"tidemark_{cfg.stream}_drain unpaused" in late
    assert out.splitlines()[0].strip() == f"LATE: {late}"
    assert page.count('class="err late"') == 2               # the alarm above the stream, and its row
    assert not entry["freshness"]["consolidation"]["late"]

    _age(cfg, consolidate_allowed + 30)                      # both: a scheduler dead for 7.5 minutes
    out, entry, page = _shown(cfg, streams, capsys)
    drain, consolidation = entry["freshness"]["late"]
    assert consolidation.startswith("consolidation: landed segments wait above the frontier, none consolidated for")
    assert "every 2 min (consolidate.check_every_minutes)" in consolidation
    assert [ln.strip() for ln in out.splitlines()[:2]] == [f"LATE: {drain}", f"LATE: {consolidation}"]
    assert "consolidation freshness: LATE" in out and page.count('class="err late"') == 4
    assert "late: consolidation: landed segments wait above the frontier" in page

    with Control(control_dsn(cfg)) as ctl:                   # all consolidated: nothing waits, not late
        ctl.advance_frontier(cfg.stream, ctl.stream(cfg.stream).landed_upper, committed_segment=2)
    _age(cfg, consolidate_allowed + 30)
    out, entry, page = _shown(cfg, streams, capsys)
    assert entry["freshness"]["consolidation"]["late"] is False and entry["freshness"]["drain"]["late"]
    assert "consolidation freshness: ok: nothing waits" in out
