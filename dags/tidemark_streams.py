"""
# Tidemark streams

Every stream file in `include/streams/*.yaml` (or `$TIDEMARK_STREAMS_DIR`) becomes five DAGs (an external
feed, `source.kind: feed`, has no snapshot DAG, and its consolidation has no repair or resend branch):

| DAG | runs | does |
|---|---|---|
| `tidemark_<stream>_snapshot` | manual, with a form | registers the stream, snapshots tables (`initial`) or re-snapshots them (`resend`) |
| `tidemark_<stream>_drain` | when the source's tables change (an AssetWatcher), and every 5 minutes (a feed: every minute) | one task: sweeps orphan segments, drains the slot into landing segments (a feed: registers and ingests the producers' files), records the metrics, publishes the landing Asset |
| `tidemark_<stream>_consolidate` | on the landing Asset | gap sensor, branching to *consolidate*, or *repair* / *resend* first; Spark writes the Delta tables (the task is skipped, the frontier moved without Spark, when only progress landed); each table it changed gets an event of its Asset `tidemark://<stream>/<schema>.<table>` |
| `tidemark_<stream>_changelog` | hourly, per data interval | writes the interval's changelog partition; backfill rebuilds past ones |
| `tidemark_<stream>_maintain` | `lake.maintain` (daily, 03:30 UTC) | compacts, checkpoints and vacuums every lake table (`lake.retention`), deletes landing files below the floor |

This file is wiring only: every task calls the Tidemark library through the `tidemark_airflow`
operators (in `plugins/`). Nothing here opens a connection or imports Spark at parse time. The path
of a change (watcher → drain → sensor → consolidate) is as few tasks as the branches allow: each task
start costs seconds of commit → lake lag.

A broken stream file does not take the other streams down: it is left out here, and
`tidemark_stream_files.py` reports it as that DAG file's import error, naming the file and the key.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import (DAG, Asset, AssetOrTimeSchedule, AssetWatcher, CronDataIntervalTimetable,
                         CronTriggerTimetable, Param, TriggerRule)
from tidemark.config import StreamConfig, scan_stream_dir
from tidemark.schedules import (DRAIN_CRON, DRAIN_SAFETY_CRON, GAP_SENSOR_POKE_SECONDS, GAP_SENSOR_TIMEOUT_SECONDS,
                                WATCH_MIN_INTERVAL_SECONDS, WATCH_POLL_SECONDS)
from tidemark_airflow.operators import (
    TidemarkApplyOperator,
    TidemarkChangelogOperator,
    TidemarkDrainOperator,
    TidemarkMaintainOperator,
    TidemarkMetricsOperator,
    TidemarkRepairOperator,
    TidemarkResendOperator,
    TidemarkSnapshotOperator,
    TidemarkSparkSubmitOperator,
)
from tidemark_airflow.assets import tables_alias
from tidemark_airflow.sensors import TidemarkGapSensor
from tidemark_airflow.triggers import TidemarkSourceChangesTrigger

REPO = Path(__file__).resolve().parent.parent
STREAMS_DIR = Path(os.environ.get("TIDEMARK_STREAMS_DIR") or REPO / "include" / "streams")
CONSOLIDATE_JOB = str(REPO / "jobs" / "consolidate.py")
START = datetime(2024, 1, 1)
DEFAULT_ARGS = {"owner": "tidemark", "retries": 2, "retry_delay": timedelta(seconds=30)}


def landing_asset(cfg: StreamConfig) -> Asset:
    """The Asset a drain publishes: the stream's segment area in the landing store."""
    url = cfg.landing.url if "://" in cfg.landing.url else f"file://{cfg.landing.url}"
    return Asset(name=f"tidemark_{cfg.stream}_landing", uri=f"{url.rstrip('/')}/{cfg.stream}/segments",
                 group="tidemark")


def source_asset(cfg: StreamConfig) -> Asset:
    """The Asset the source watcher updates when the stream's tables change: the drain's trigger."""
    watch = TidemarkSourceChangesTrigger(stream_file=cfg.origin, poll_seconds=WATCH_POLL_SECONDS,
                                         min_interval_seconds=WATCH_MIN_INTERVAL_SECONDS)
    return Asset(name=f"tidemark_{cfg.stream}_source", uri=f"tidemark://{cfg.stream}/source", group="tidemark",
                 watchers=[AssetWatcher(name=f"tidemark_{cfg.stream}_source_watch", trigger=watch)])


def drain_schedule(cfg: StreamConfig):
    """A feed: every minute. A PostgreSQL stream: on the source watcher's events (new committed changes,
    debounced), or on the timed safety run (`DRAIN_SAFETY_CRON`) that moves an idle slot on."""
    if cfg.source.is_feed:
        return CronTriggerTimetable(DRAIN_CRON, timezone="UTC")
    return AssetOrTimeSchedule(timetable=CronTriggerTimetable(DRAIN_SAFETY_CRON, timezone="UTC"),
                               assets=[source_asset(cfg)])


def snapshot_dag(cfg: StreamConfig) -> DAG:
    """Manual snapshot (or resend) with a trigger form."""
    tables = [t.qualified for t in cfg.source.tables]
    with DAG(
        dag_id=f"tidemark_{cfg.stream}_snapshot",
        doc_md=f"Snapshot stream `{cfg.stream}`: creates the slot at a consistent point and copies the chosen "
               "tables under its exported snapshot (parallel ctid chunks). Mode `resend` forgets lost "
               "segments and re-snapshots the tables at a new consistent point.",
        schedule=None, start_date=START, catchup=False, max_active_runs=1, default_args=DEFAULT_ARGS,
        tags=["tidemark", f"stream:{cfg.stream}", "snapshot"], render_template_as_native_obj=True,
        params={
            "tables": Param(tables, type="array", items={"type": "string", "enum": tables}, minItems=1,
                            title="Tables", description="Tables to copy (all tables of the stream by default)."),
            "mode": Param("initial", type="string", enum=["initial", "resend", "add", "table"], title="Mode",
                          values_display={"initial": "initial: the first snapshot (creates the slot)",
                                          "resend": "resend: every table again after lost segments",
                                          "add": "add: tables added to a running stream, each on its own",
                                          "table": "table: re-snapshot these tables online (corrections)"},
                          description="`initial`: first snapshot, creates the slot (fails if the stream has "
                                      "one; tables added to a running stream are taken as with `add`). "
                                      "`resend`: when segments were lost, re-snapshot every table at a "
                                      "new consistent point and move the frontier there (a subset is refused: "
                                      "it would lose changes); without a gap the run is skipped unless `force`. "
                                      "`add`: tables added to the stream file of a running stream: each is "
                                      "copied at a consistent point of its own while the stream goes on; the "
                                      "lake takes its changes from there. `table`: copy captured tables again "
                                      "that way (online); the lake is corrected at that point and the changelog "
                                      "records only the difference."),
            "force": Param(False, type="boolean", title="Force",
                           description="With mode `resend`: re-snapshot even when no gap was detected."),
            "chunk_pages": Param(cfg.snapshot.chunk_pages, type="integer", minimum=1, title="Chunk size (pages)",
                                 description="Heap pages per parallel copy chunk (ctid range)."),
            "parallelism": Param(cfg.snapshot.parallelism, type="integer", minimum=1, maximum=32,
                                 title="Parallel copies", description="Chunks copied at the same time."),
        },
    ) as dag:
        register = TidemarkApplyOperator(task_id="register", stream_file=cfg.origin)
        copy = TidemarkSnapshotOperator(
            task_id="snapshot_copy", stream_file=cfg.origin, tables="{{ params.tables }}",
            mode="{{ params.mode }}", force="{{ params.force }}", chunk_pages="{{ params.chunk_pages }}",
            parallelism="{{ params.parallelism }}",
        )
        metrics = TidemarkMetricsOperator(task_id="record_metrics", stream_file=cfg.origin,
                                          trigger_rule=TriggerRule.NONE_FAILED)
        register >> copy >> metrics
    return dag


def drain_dag(cfg: StreamConfig) -> DAG:
    """On new source changes (a feed: every minute): sweep orphans, drain the slot (or ingest a feed's
    files), publish the landing Asset."""
    if cfg.source.is_feed:
        doc = (f"Ingest feed `{cfg.stream}`: register the producers' Materialize CDC files under "
               f"`{cfg.stream}/feed/TABLE/`, deduplicate them by the format's rules and land the complete times "
               "as a segment; an unmet count holds the frontier and, after the timeout, opens a `counts_unmet` "
               "incident asking the producer to resend.")
    else:
        doc = (f"Drain stream `{cfg.stream}`: whole transactions from slot `{cfg.source.slot}` into immutable "
               "segments; an orphan segment (written, never registered) is registered or discarded first.")
    with DAG(
        dag_id=f"tidemark_{cfg.stream}_drain", doc_md=doc,
        schedule=drain_schedule(cfg), start_date=START, catchup=False,
        max_active_runs=1, default_args=DEFAULT_ARGS, tags=["tidemark", f"stream:{cfg.stream}", "drain"],
    ) as dag:
        if cfg.source.is_feed:     # no snapshot DAG registers a feed: its drain does (idempotent)
            register = TidemarkApplyOperator(task_id="register", stream_file=cfg.origin)
            register >> TidemarkDrainOperator(task_id="ingest_feed", stream_file=cfg.origin,
                                              outlets=[landing_asset(cfg)])
        else:
            TidemarkDrainOperator(task_id="drain", stream_file=cfg.origin, outlets=[landing_asset(cfg)])
    return dag


def consolidate_schedule(cfg: StreamConfig):
    """On every landing (the drain's Asset event), and every ``consolidate.check_every_minutes``: a fault
    that stops the drains (a lost slot) sends no event, and the timed run's gap sensor finds and mends it."""
    minutes = cfg.consolidate.check_every_minutes
    if not minutes:
        return [landing_asset(cfg)]
    return AssetOrTimeSchedule(timetable=CronTriggerTimetable(f"*/{minutes} * * * *", timezone="UTC"),
                               assets=[landing_asset(cfg)])


def consolidate_dag(cfg: StreamConfig) -> DAG:
    """On new segments (and every few minutes): gap sensor, then consolidate, or repair / resend before
    consolidating."""
    with DAG(
        dag_id=f"tidemark_{cfg.stream}_consolidate",
        doc_md=f"Consolidate stream `{cfg.stream}` into the lake at `{cfg.lake_path}`. The gap sensor waits for "
               "complete segments; a missing segment is re-drained (*repair*) when the slot still covers it, "
               "otherwise the tables are re-snapshotted (*resend*). Then Spark consolidates."
               + (f" It also runs every {cfg.consolidate.check_every_minutes} minutes (`consolidate.check_every_minutes`), "
                  "new segments or not, to find and mend what stops the drains (a lost slot); with nothing to do it "
                  "skips." if cfg.consolidate.check_every_minutes else ""),
        schedule=consolidate_schedule(cfg), start_date=START, catchup=False, max_active_runs=1,
        default_args=DEFAULT_ARGS, tags=["tidemark", f"stream:{cfg.stream}", "consolidate"],
    ) as dag:
        # decides and branches: consolidate, or repair / resend first (a feed: consolidate only)
        wait = TidemarkGapSensor(task_id="wait_for_segments", stream_file=cfg.origin,
                                 poke_interval=GAP_SENSOR_POKE_SECONDS, timeout=GAP_SENSOR_TIMEOUT_SECONDS)
        # only progress landed: the frontier, checkpoint and slot move in the control database, no Spark
        # (the task is skipped); else batch after batch while records keep landing (`follow_stream`); then
        # the stream's metrics are recorded
        consolidate = TidemarkSparkSubmitOperator(
            task_id="consolidate", stream_file=cfg.origin, conn_id="spark_default", application=CONSOLIDATE_JOB,
            name=f"tidemark-{cfg.stream}", application_args=["--stream-file", cfg.origin, "--follow"],
            trigger_rule=TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS,
            # the Assets of the tables it gave a new version (`tidemark_airflow.assets.table_asset`), only those
            outlets=[tables_alias(cfg.stream)],
        )
        if cfg.source.is_feed:
            # nothing to re-drain or re-snapshot: what only the producer can mend is an incident (the sensor
            # logs it), and complete times are consolidated meanwhile
            wait >> consolidate
            return dag
        repair = TidemarkRepairOperator(task_id="repair", stream_file=cfg.origin)
        resend = TidemarkResendOperator(task_id="resend", stream_file=cfg.origin)
        wait >> [consolidate, repair, resend]
        [repair, resend] >> consolidate
    return dag


def changelog_dag(cfg: StreamConfig) -> DAG:
    """Hourly: the changelog partition of each data interval (backfill rebuilds past ones)."""
    with DAG(
        dag_id=f"tidemark_{cfg.stream}_changelog",
        doc_md=f"Changelog of stream `{cfg.stream}`: one run per hour writes that hour's partition of the "
               "consolidated `(data, time, diff)` changelog; a backfill over past hours rebuilds them from "
               "retained segments.",
        schedule=CronDataIntervalTimetable("0 * * * *", timezone="UTC"), start_date=START, catchup=False,
        max_active_runs=2, default_args=DEFAULT_ARGS, tags=["tidemark", f"stream:{cfg.stream}", "changelog"],
    ) as dag:
        # one interval at a time per stream (the library holds a per-stream changelog lock): backfill runs
        # queue for the task instead of failing on the lock
        TidemarkChangelogOperator(task_id="write_changelog", stream_file=cfg.origin, max_active_tis_per_dag=1)
    return dag


def maintain_dag(cfg: StreamConfig) -> DAG:
    """On `lake.maintain` (daily by default): table maintenance and landing retention (its own lease
    purpose: a consolidation waits)."""
    with DAG(
        dag_id=f"tidemark_{cfg.stream}_maintain",
        doc_md=f"Maintenance of stream `{cfg.stream}`: compacts small files, writes checkpoints and vacuums "
               "what no version inside `lake.retention` references, in every lake, changelog and history "
               "table; deletes landing segments and changelog feed files below the floor (frontier, "
               "subscribers' checkpoints, the retention window).",
        schedule=CronTriggerTimetable(cfg.lake_maintain_cron, timezone="UTC"), start_date=START, catchup=False,
        max_active_runs=1, default_args=DEFAULT_ARGS, tags=["tidemark", f"stream:{cfg.stream}", "maintain"],
    ) as dag:
        TidemarkMaintainOperator(task_id="maintain", stream_file=cfg.origin)
    return dag


for _cfg in scan_stream_dir(STREAMS_DIR)[0]:
    # a feed (source.kind: feed) has no PostgreSQL to snapshot: no snapshot DAG
    for _build in ((drain_dag, consolidate_dag, changelog_dag, maintain_dag) if _cfg.source.is_feed else
                   (snapshot_dag, drain_dag, consolidate_dag, changelog_dag, maintain_dag)):
        _dag = _build(_cfg)
        globals()[_dag.dag_id] = _dag
