"""Stream status: Ignite's CDC consumer metrics per stream, plus the slot's lag.

`stream_status` (``tidemark status``) reports the stream's positions and segments, the slot lag, open
incidents, subscribers, `freshness`, storage and write cost, and records the metrics in the control
database; it reads one catalog row of the source and never raises because the source or the slot is
down (the error is in the result). `record_metrics` is what the drain and consolidate tasks record.
`overview` is the CDC status page's data, read from the control database only (no source connection
while a page renders): the storage as last measured (the page walks no directory).

`freshness` is an alarm, not an incident: a stream whose DAGs have not run when their schedules say
(a dead scheduler, paused DAGs) has no job running to open one, so it is computed from when the drains
last landed and the consolidation last moved the frontier, against `tidemark.schedules`' allowances.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg2

from tidemark.config import StreamConfig
from tidemark.control import Control, open_control
from tidemark.pgtypes import session_options
from tidemark.capture.source import SlotInfo, slot_info, source_dsn
from tidemark.lake.storage import stream_storage
from tidemark.lsn import format_lsn
from tidemark.schedules import (DRAIN_SAFETY_SECONDS, GAP_SENSOR_TIMEOUT_SECONDS, consolidate_allowance,
                                drain_allowance)
from tidemark.words import ratio, seconds, size, when

CONNECT_TIMEOUT_SECONDS = 5
# the drain and consolidate tasks measure the storage at most this often (`stream_status`)
TASK_STORAGE_MAX_AGE_SECONDS = 600
STATEMENT_TIMEOUT_MS = 5000


def stream_status(cfg: StreamConfig, *, storage_max_age: float | None = None) -> dict[str, Any]:
    """Return the stream's consumer metrics, positions, slot lag and open incidents; record the metrics.

    ``storage_max_age``: measure the storage (a walk of the lake and the landing store, seconds on a
    large lake) only when the recorded figures are older than that many seconds, else report those
    (the drain and consolidate tasks record metrics on the way of every change: they pass it)."""
    # deferred: the tidemark.consolidate package imports the whole consolidation (fastavro) for one summary
    from tidemark.consolidate.writecost import summary

    with open_control(cfg) as ctl:
        state, segs, (slot, slot_exists, slot_error), sample = _record(cfg, ctl)
        incidents = ctl.incidents(cfg.stream)
        subs = _subscribers(ctl, cfg.stream, state.frontier)
        fresh = freshness(cfg, state, ctl.activity(cfg.stream))
        storage, storage_error = _storage(cfg, ctl, storage_max_age)
        return {
            "stream": cfg.stream,
            "state": state.state,
            "consistent_lsn": state.consistent_lsn,
            "landed_upper": state.landed_upper,
            "frontier": state.frontier,
            "table_frontiers": ctl.table_frontiers(cfg.stream),   # an external feed's tables: each one's own
            # tables added to the running stream (awaiting_snapshot, then capturing from their own snapshot's
            # LSN) or removed from it (frozen at the frontier then); the others are captured since consistent_lsn
            "table_states": {t: {"state": st, "since_lsn": lsn}
                             for t, (st, lsn) in ctl.table_states(cfg.stream).items()},
            "next_seq": state.next_seq,
            **segs,
            "committed_position": state.frontier,
            "source": "feed" if cfg.source.is_feed else "postgresql",     # a feed has no slot
            "slot": None if cfg.source.is_feed else cfg.source.slot,
            "slot_exists": slot_exists,
            "slot_wal_status": slot.wal_status if slot else None,
            "slot_confirmed_flush_lsn": slot.confirmed_flush_lsn if slot else None,
            "source_current_lsn": slot.current_lsn if slot else None,
            "slot_lag_bytes": slot.lag_bytes if slot else None,
            "slot_lag_seconds": sample["slot_lag_seconds"],
            "commit_lag": ctl.commit_lag(cfg.stream),       # commit -> lake, the last hour
            "slot_error": slot_error,
            "open_incidents": len(incidents),
            "incidents": [{"id": i["id"], "kind": i["kind"], "table": i["table"], "detail": i["detail"],
                           "opened_at": i["opened_at"], "count": i["count"], "last_seen_at": i["last_seen_at"]}
                          for i in incidents],
            "metrics_updated_at": ctl.metrics(cfg.stream).get("updated_at"),
            "subscribers": subs,
            "lagging_subscribers": [s["name"] for s in subs if s["lagging"]],
            "freshness": fresh,
            "storage": storage,
            "storage_error": storage_error,
            # {table: the latest and median write amplification of its recorded batches}
            "write_cost": {table: summary(rows) for table, rows in sorted(ctl.write_costs(cfg.stream).items())},
            "last_maintenance": ctl.last_maintenance_run(cfg.stream),
        }


def record_metrics(cfg: StreamConfig, *, storage_max_age: float | None = TASK_STORAGE_MAX_AGE_SECONDS) -> dict[str, Any]:
    """Record the stream's consumer metrics (as `stream_status` does, and the storage when the recorded
    figures are older than ``storage_max_age``) and return what was recorded: what the drain and
    consolidate tasks do after their work, without the reads only a status report needs (incidents,
    subscribers, freshness, the commit lag over the last hour, write costs)."""
    with open_control(cfg) as ctl:
        state, segs, (slot, _, slot_error), sample = _record(cfg, ctl)
        _, storage_error = _storage(cfg, ctl, storage_max_age)
    return {"stream": cfg.stream, "frontier": state.frontier, "landed_upper": state.landed_upper,
            "current_segment": segs["current_segment"], "committed_segment": segs["committed_segment"],
            "pending_segments": segs["pending_segments"], "source_current_lsn": slot.current_lsn if slot else None,
            "slot_lag_bytes": slot.lag_bytes if slot else None, "slot_lag_seconds": sample["slot_lag_seconds"],
            "slot_error": slot_error, "storage_error": storage_error}


def _record(cfg: StreamConfig, ctl: Control):
    """(state, segment positions, (slot, exists, error), metrics sample): the slot read from the source,
    the current metrics and a sample of their history written to the control database."""
    slot, slot_exists, slot_error = _slot(cfg)
    state = ctl.stream(cfg.stream)
    segs = _segment_positions(ctl, cfg.stream, state.frontier)
    lag = slot.lag_bytes if slot is not None else None
    ctl.set_metric(cfg.stream, current_segment=segs["current_segment"],
                   committed_segment=segs["committed_segment"], committed_position=state.frontier,
                   last_segment_at=segs["last_segment_at"], slot_lag_bytes=lag)
    sample = ctl.record_metrics_sample(
        cfg.stream, frontier=state.frontier, landed_upper=state.landed_upper,
        source_lsn=slot.current_lsn if slot else None, confirmed_lsn=slot.confirmed_flush_lsn if slot else None,
        slot_lag_bytes=lag, current_segment=segs["current_segment"], committed_segment=segs["committed_segment"])
    return state, segs, (slot, slot_exists, slot_error), sample


def _storage(cfg: StreamConfig, ctl: Control, max_age: float | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """(the stream's storage figures, computed now and recorded for the status page, or as recorded when
    younger than ``max_age`` seconds; None and the reason when the lake or the landing store cannot be
    read: never raised)."""
    if max_age is not None:
        recorded = ctl.storage(cfg.stream)
        if recorded is not None and (dt.datetime.now(dt.timezone.utc) - recorded["at"]).total_seconds() < max_age:
            return {k: v for k, v in recorded.items() if k != "at"}, None
    try:
        figures = stream_storage(cfg)
    except Exception as exc:  # noqa: BLE001 - an unreadable store is reported, not raised
        return None, f"cannot measure the storage: {_first_line(exc)}"
    ctl.record_storage(cfg.stream, figures)
    return figures, None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _slot(cfg: StreamConfig) -> tuple[SlotInfo | None, bool | None, str | None]:
    """(slot, exists, error): exists is None when the source cannot be asked. An external feed has
    no source database and no slot: (None, None, None)."""
    if cfg.source.is_feed:
        return None, None, None
    try:
        conn = psycopg2.connect(source_dsn(cfg), connect_timeout=CONNECT_TIMEOUT_SECONDS,
                                options=f"{session_options()} -c statement_timeout={STATEMENT_TIMEOUT_MS}",
                                application_name="tidemark-status")
    except Exception as exc:  # noqa: BLE001 - any failure to reach the source is reported, not raised
        return None, None, f"cannot connect to the source: {str(exc).strip()}"
    try:
        conn.autocommit = True
        info = slot_info(cfg, conn)
        if info is None:
            return None, False, f"replication slot {cfg.source.slot} does not exist"
        return info, True, None if info.usable else f"replication slot {cfg.source.slot} is invalidated"
    except psycopg2.Error as exc:
        return None, None, f"cannot read the slot: {str(exc).strip()}"
    finally:
        conn.close()


def _segment_positions(ctl: Control, stream: str, frontier: int | None) -> dict[str, Any]:
    """Newest landed segment, newest consolidated segment (upper <= frontier) and the last landing time."""
    with ctl.tx() as cur:
        cur.execute("""SELECT max(seq) FILTER (WHERE status = 'landed'),
                              max(seq) FILTER (WHERE status = 'landed' AND upper_lsn <= %s),
                              max(created_at) FILTER (WHERE status = 'landed'),
                              count(*) FILTER (WHERE status = 'landed' AND upper_lsn > COALESCE(%s, -1)),
                              count(*) FILTER (WHERE status = 'quarantined'),
                              count(*) FILTER (WHERE status = 'forgotten')
                         FROM tidemark.segments WHERE stream = %s""", (frontier, frontier, stream))
        current, committed, last_at, pending, quarantined, forgotten = cur.fetchone()
    return {"current_segment": current, "committed_segment": committed if frontier is not None else None,
            "last_segment_at": last_at, "pending_segments": pending, "quarantined_segments": quarantined,
            "forgotten_segments": forgotten}


TABLE_STATES = {   # the status page's words for `Control.table_states`
    "awaiting_snapshot": "loading: waits for its own snapshot (its changes wait in the segments)",
    "capturing": "capturing from its own snapshot",
    "frozen": "frozen: removed from the stream file, kept as of its last frontier",
}


def table_rows(ctl: Control, stream: str, tables: list[str], frontier: int | None) -> list[dict[str, Any]]:
    """Each table's own state and position: ``captured`` (at the stream's frontier), or its state in
    ``tidemark.stream_tables`` (added and loading, capturing from its own snapshot, frozen), and an
    external feed table's own frontier."""
    states = ctl.table_states(stream)
    feeds = ctl.table_frontiers(stream)
    out = []
    for t in sorted(set(tables) | set(states)):
        state, since = states.get(t, ("captured", None))
        own = feeds.get(t, {}).get("frontier")
        position = None if state == "awaiting_snapshot" else (own if own is not None else frontier)
        if state == "frozen":
            position = since if since is not None else position
        out.append({"table": t, "state": state, "since_lsn": since, "position": position,
                    "meaning": TABLE_STATES.get(state, "captured since the stream's consistent point")})
    return out


def stream_overview(ctl: Control, stream: str, *, tables: list[str] | None = None,
                    cfg: StreamConfig | None = None) -> dict[str, Any]:
    """One stream's page data, read from the control database only: the metrics as the last
    `stream_status` recorded them, the newest 10 segments, 6 hours of metrics history, each table's
    newest 60 batches; `freshness` only given ``cfg``."""
    state = ctl.stream(stream)
    history = ctl.metrics_history(stream, since_seconds=6 * 3600)
    latest = history[-1] if history else {}
    metrics = ctl.metrics(stream)
    return {
        "stream": stream,
        "registered": True,
        "state": state.state,
        "slot": state.slot_name,
        "publication": state.publication,
        "frontier": state.frontier,
        "landed_upper": state.landed_upper,
        "current_segment": metrics.get("current_segment"),
        "committed_segment": metrics.get("committed_segment"),
        "last_segment_at": metrics.get("last_segment_at"),
        "slot_lag_bytes": metrics.get("slot_lag_bytes"),
        "slot_lag_seconds": latest.get("slot_lag_seconds"),
        # what a change waits from its commit in the source to the lake, over the last hour
        "commit_lag": ctl.commit_lag(stream),
        "metrics_at": metrics.get("updated_at"),
        "incidents": ctl.incidents(stream),
        "segments": ctl.recent_segments(stream, limit=10),
        "history": history,
        "tables": table_rows(ctl, stream, tables or [], state.frontier),
        "subscribers": _subscribers(ctl, stream, state.frontier),
        "freshness": freshness(cfg, state, ctl.activity(stream)) if cfg is not None else None,
        "storage": ctl.storage(stream),        # as last measured: the page walks no directory
        "write_costs": ctl.write_costs(stream, batches=60),
        "last_maintenance": ctl.last_maintenance_run(stream),
    }


def overview(configs: list[StreamConfig]) -> list[dict[str, Any]]:
    """Page data for every configured stream (`stream_overview`), in name order. A stream that is not
    registered yet, or whose control database cannot be reached, is listed with the reason."""
    out = []
    for cfg in sorted(configs, key=lambda c: c.stream):
        try:
            with open_control(cfg) as ctl:
                if cfg.stream not in {s.name for s in ctl.streams()}:
                    out.append({"stream": cfg.stream, "registered": False,
                                "error": "not registered yet: trigger its snapshot DAG (or tidemark stream apply)"})
                    continue
                out.append(stream_overview(ctl, cfg.stream, tables=[t.qualified for t in cfg.source.tables], cfg=cfg))
        except Exception as exc:  # noqa: BLE001 - one unreachable control database must not hide the others
            out.append({"stream": cfg.stream, "registered": False,
                        "error": f"control database unavailable: {_first_line(exc)}"})
    return out


def _subscribers(ctl: Control, stream: str, frontier: int | None) -> list[dict[str, Any]]:
    """Subscribers (not the consolidation's own) with checkpoint and lag behind the frontier: what a
    lagging one has not acknowledged is kept for it (``held_bytes``: the landing bytes `tidemark.maintain`
    keeps; `tidemark.subscribers.retention_floor`)."""
    return [{"name": s["name"], "checkpoint": s["checkpoint"], "lag_bytes": s["lag_bytes"], "lagging": s["lagging"],
             "held_bytes": ctl.held_segment_bytes(stream, s["checkpoint"] or 0, frontier) if s["lagging"] else 0}
            for s in ctl.subscriber_lags(stream, frontier)]


def freshness(cfg: StreamConfig, state, activity: dict[str, Any]) -> dict[str, Any]:
    """Whether the stream's DAGs ran when their schedules say they should have: for the ``drain`` and
    the ``consolidation``, when each last did something (``last_at``), how long ago (``age_seconds``,
    on the control database's clock), how long a healthy stream allows (``allowance_seconds``,
    `tidemark.schedules`), ``late`` and, when late, the ``reason``; ``late`` lists the reasons.

    * drain: the newest landed segment (every drain run lands one), or the last snapshot's end when
      none landed since; not judged for an external feed (it lands only when its producers write).
    * consolidation: judged only while landed segments wait above the frontier, from the later of the
      oldest one's landing and the frontier's last move (a backlog is consolidated slice by slice).

    Neither is judged before the stream's first snapshot is complete, nor while a snapshot runs (it
    holds the drains back)."""
    now = activity.get("now")
    out: dict[str, Any] = {"drain": None, "consolidation": None, "late": []}
    if now is None or state.landed_upper is None or state.state == "snapshotting":
        return out
    drain_allowed = drain_allowance(cfg)
    if drain_allowed is not None:
        since = _latest(activity.get("last_landed_at"), activity.get("last_snapshot_at"))
        out["drain"] = _check(now, since, drain_allowed, activity.get("last_landed_at"),
                              f"no segment landed for {{age}} (allowed {{allowed}}: a drain on every change "
                              f"and every {DRAIN_SAFETY_SECONDS} s, failing after drain.stall_timeout_seconds "
                              f"{cfg.drain.stall_timeout_seconds:g} s without progress): is the Airflow scheduler "
                              f"running and tidemark_{cfg.stream}_drain unpaused?")
    pending = activity.get("oldest_pending_at")
    every = cfg.consolidate.check_every_minutes
    out["consolidation"] = _check(
        now, _latest(pending, activity.get("last_consolidated_at")) if pending is not None else None,
        consolidate_allowance(cfg), activity.get("last_consolidated_at"),
        f"landed segments wait above the frontier, none consolidated for {{age}} (allowed {{allowed}}: a consolidation on every "
        f"landing{f' and every {every} min (consolidate.check_every_minutes)' if every else ''}, its gap sensor "
        f"waiting up to {GAP_SENSOR_TIMEOUT_SECONDS} s): is the Airflow scheduler running and "
        f"tidemark_{cfg.stream}_consolidate unpaused?")
    out["late"] = [f"{job}: {out[job]['reason']}" for job in ("drain", "consolidation")
                   if out[job] and out[job]["late"]]
    return out


def _latest(*times):
    return max((t for t in times if t is not None), default=None)


def _check(now, since, allowed: float, last_at, reason: str) -> dict[str, Any]:
    """One job's freshness: late when ``since`` (None: nothing to judge) is more than ``allowed``
    seconds before ``now``."""
    age = None if since is None else max(0.0, (now - since).total_seconds())
    late = age is not None and age > allowed
    return {"last_at": last_at, "age_seconds": age, "allowance_seconds": allowed, "late": late,
            "reason": reason.format(age=seconds(age), allowed=seconds(allowed)) if late else None}


# -- the status in words: `tidemark status` and the CDC status page say the same (`tidemark.words`) ------

def freshness_text(check: dict[str, Any] | None) -> str:
    """One job's freshness (`freshness`) in one line."""
    if check is None:
        return "not judged (no snapshot yet, a snapshot running, or a feed's drain)"
    allowed = f"(allowed {seconds(check['allowance_seconds'])})"
    if check["age_seconds"] is None:
        return f"ok: nothing waits {allowed}"
    return f"{'LATE' if check['late'] else 'ok'}: last {seconds(check['age_seconds'])} ago {allowed}"


def commit_lag_text(lag: dict[str, Any] | None) -> str:
    """``median 12.0 s, p95 30.0 s, max 41.0 s (5,000 transactions in 60 batches)`` (`Control.commit_lag`), or "-"."""
    if not lag:
        return "-"
    return (f"median {seconds(lag['median_seconds'])}, p95 {seconds(lag['p95_seconds'])}, max "
            f"{seconds(lag['max_seconds'])} ({lag['transactions']:,} transactions in {lag['batches']} batches)")


def landing_text(land: dict[str, Any]) -> str:
    """The landing store's bytes and what they are (`tidemark.lake.storage`): all of them, the parts adding up."""
    return (f"{size(land.get('bytes'))}: segments {size(land.get('segment_bytes'))} in "
            f"{land.get('segment_files', 0):,} files, changelog feed {size(land.get('feed_bytes'))} in "
            f"{land.get('feed_files', 0):,} files, snapshots {size(land.get('snapshot_bytes'))}, "
            f"other {size(land.get('other_bytes'))}")


def storage_lines(status: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) lines of `stream_status`'s storage, write cost, subscribers and last maintenance,
    as ``tidemark status`` prints them."""
    out: list[tuple[str, str]] = []
    st = status.get("storage")
    if status.get("storage_error"):
        out.append(("storage", status["storage_error"]))
    if st:
        lake, land = st["lake"], st["landing"]
        out.append(("lake", f"{size(lake['live_bytes'])} live in {lake['live_files']:,} files, "
                            f"{size(lake['disk_bytes'])} on disk in {lake['disk_files']:,} files "
                            f"({ratio(lake['disk_bytes'] / lake['live_bytes'] if lake['live_bytes'] else None)} live; "
                            f"Delta log {size(lake['log_bytes'])} in {lake['log_files']:,} files)"))
        for table, kinds in sorted(st["tables"].items()):
            parts = [f"{kind} {size(f['live_bytes'])} live / {size(f['disk_bytes'])} on disk "
                     f"(log {size(f['log_bytes'])}), {f['live_files']:,}/{f['disk_files']:,} files"
                     for kind, f in kinds.items()]
            out.append((f"storage {table}", "; ".join(parts) or "no lake table yet"))
        out.append(("landing", landing_text(land)))
        oldest = st.get("oldest_readable")
        out.append(("oldest readable", (f"{format_lsn(oldest)} ({oldest})" if oldest is not None
                                        else "every version kept so far") + f" (lake.retention {st['retention']})"))
    for table, c in sorted((status.get("write_cost") or {}).items()):
        out.append((f"write amp. {table}",
                    f"latest {ratio(c['latest'])}, median {ratio(c['median'])} over {c['batches']} batch(es); "
                    f"the last one rewrote {size(c['latest_added_bytes'])} (replacing "
                    f"{size(c['latest_removed_bytes'])}) for {size(c['latest_change_bytes'])} of changes"))
    for s in status.get("subscribers") or []:
        out.append((f"subscriber {s['name']}", f"checkpoint {format_lsn(s['checkpoint'] or 0)}, "
                                                f"{size(s['lag_bytes'])} behind the frontier; holds "
                                                f"{size(s.get('held_bytes'))} of landing files back"))
    out.append(("last maintenance", maintenance_text(status.get("last_maintenance"))))
    return out


def maintenance_text(run: dict[str, Any] | None) -> str:
    """One line of what a maintenance run did (`Control.last_maintenance_run`)."""
    if not run:
        return "never (tidemark maintain STREAM, or its tidemark_<stream>_maintain DAG)"
    r = run["report"]
    tables = r.get("tables") or []
    at = run["finished_at"]
    at = when(at) if hasattr(at, "astimezone") else str(at)
    return (f"{at}, {r.get('seconds', 0):.1f} s: {sum(t.get('compacted', 0) for t in tables):,} files compacted, "
            f"{sum(t.get('vacuumed', 0) for t in tables):,} vacuumed over {len(tables)} Delta tables; "
            f"{r.get('deleted_segments', 0):,} segment files ({size(r.get('deleted_segment_bytes'))}) and "
            f"{r.get('deleted_feed_files', 0):,} feed files ({size(r.get('deleted_feed_bytes'))}) deleted")
