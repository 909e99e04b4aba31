"""The stream DAGs' schedules, in one place: `dags/tidemark_streams.py` builds its DAGs with them, and
the freshness alarm (`tidemark.status.freshness`) derives from them how long a healthy stream
may go without a drain landing a segment or a consolidation moving the frontier.

Nothing here imports Airflow: the library, the command line and the status page read it too.
"""

from __future__ import annotations

from tidemark.config import StreamConfig

DRAIN_CRON = "* * * * *"           # an external feed's drain DAG: every minute
DRAIN_EVERY_SECONDS = 60           # ... its period
# a PostgreSQL stream's drain DAG runs when the source watcher (an AssetWatcher's trigger,
# `tidemark.capture.watch`) sees its tables change, and besides on this timed safety run: it moves an
# idle stream's slot forward and drains what no watcher reported (triggerer down, track_counts off)
DRAIN_SAFETY_CRON = "*/5 * * * *"
DRAIN_SAFETY_SECONDS = 300         # ... its period
WATCH_POLL_SECONDS = 2.0           # the watcher reads the tables' change counters this often
WATCH_MIN_INTERVAL_SECONDS = 5.0   # ... and fires at most this often while changes keep coming
GAP_SENSOR_POKE_SECONDS = 20       # the consolidate DAG's gap sensor: how often it looks
GAP_SENSOR_TIMEOUT_SECONDS = 300   # ... and how long it waits for complete segments before it fails


def drain_allowance(cfg: StreamConfig) -> float | None:
    """Seconds a healthy stream may go without a drain landing a segment, or None when that says
    nothing (an external feed lands only when its producers write).

    A drain run starts on every change the source watcher reports and at least every
    `DRAIN_SAFETY_SECONDS` (its timed safety run), and lands at least a progress-only segment (its end
    position is taken in a marker transaction, so the slot always moves); a run that lands nothing
    for ``drain.stall_timeout_seconds`` fails (a ``drain_failed`` incident). Longer than both
    together without a landing: no drain has run."""
    if cfg.source.is_feed:
        return None
    return DRAIN_SAFETY_SECONDS + cfg.drain.stall_timeout_seconds


def consolidate_allowance(cfg: StreamConfig) -> float:
    """Seconds a landed segment may wait before a consolidation moves the frontier (or since the last
    move, while a backlog is consolidated slice by slice).

    The consolidate DAG runs on every landing (the drain's Asset event) and, besides, every
    ``consolidate.check_every_minutes`` (without it, the next landing's event: a safety drain period
    later); a run's gap sensor waits up to `GAP_SENSOR_TIMEOUT_SECONDS` for complete segments before
    it fails. Longer than both together: no consolidation has run."""
    every = cfg.consolidate.check_every_minutes * 60 or (DRAIN_EVERY_SECONDS if cfg.source.is_feed else DRAIN_SAFETY_SECONDS)
    return every + GAP_SENSOR_TIMEOUT_SECONDS
