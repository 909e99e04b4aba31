"""Stream status: Ignite's CDC consumer metrics per stream, plus the slot's lag.

`stream_status` reports the current segment (newest landed), the committed segment (newest
consolidated), the committed position (the frontier), when the last segment was processed, the
slot lag in bytes (source ``pg_current_wal_lsn()`` minus the slot's ``confirmed_flush_lsn``), the
stream's positions and open incidents, and records the metrics in the control database. It reads
only the control database and one catalog row of the source, and it never raises because the
source or the slot is down: the error is reported in the result.
"""

from __future__ import annotations

from typing import Any

import psycopg2

from tidemark.config import StreamConfig
from tidemark.control import Control
from tidemark.pgtypes import session_options
from tidemark.control import open_control
from tidemark.capture.source import SlotInfo, slot_info, source_dsn

CONNECT_TIMEOUT_SECONDS = 5
STATEMENT_TIMEOUT_MS = 5000


def stream_status(cfg: StreamConfig) -> dict[str, Any]:
    """Return the stream's consumer metrics, positions, slot lag and open incidents; record the metrics."""
    slot, slot_exists, slot_error = _slot(cfg)
    with open_control(cfg) as ctl:
        state = ctl.stream(cfg.stream)
        segs = _segment_positions(ctl, cfg.stream, state.frontier)
        lag = slot.lag_bytes if slot is not None else None
        ctl.set_metric(cfg.stream, current_segment=segs["current_segment"],
                       committed_segment=segs["committed_segment"], committed_position=state.frontier,
                       last_segment_at=segs["last_segment_at"], slot_lag_bytes=lag)
        incidents = ctl.incidents(cfg.stream)
        metrics = ctl.metrics(cfg.stream)
        subs = _subscribers(ctl, cfg.stream, state.frontier)
    return {
        "stream": cfg.stream,
        "state": state.state,
        "consistent_lsn": state.consistent_lsn,
        "landed_upper": state.landed_upper,
        "frontier": state.frontier,
        "next_seq": state.next_seq,
        **segs,
        "committed_position": state.frontier,
        "slot": cfg.source.slot,
        "slot_exists": slot_exists,
        "slot_wal_status": slot.wal_status if slot else None,
        "slot_confirmed_flush_lsn": slot.confirmed_flush_lsn if slot else None,
        "source_current_lsn": slot.current_lsn if slot else None,
        "slot_lag_bytes": lag,
        "slot_error": slot_error,
        "open_incidents": len(incidents),
        "incidents": [{"id": i["id"], "kind": i["kind"], "detail": i["detail"], "opened_at": i["opened_at"]}
                      for i in incidents],
        "metrics_updated_at": metrics.get("updated_at"),
        "subscribers": subs,
        "lagging_subscribers": [s["name"] for s in subs if s["lagging"]],
    }


def _slot(cfg: StreamConfig) -> tuple[SlotInfo | None, bool | None, str | None]:
    """(slot, exists, error): exists is None when the source cannot be asked."""
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


def _subscribers(ctl: Control, stream: str, frontier: int | None) -> list[dict[str, Any]]:
    """Subscribers (not the consolidation's own) with checkpoint and lag behind the frontier: what a
    lagging one has not acknowledged is kept for it (`tidemark.subscribers.retention_floor`)."""
    out = []
    for s in ctl.subscribers(stream):
        if s["name"] == "consolidate":
            continue
        lag = max(0, frontier - (s["checkpoint"] or 0)) if frontier is not None else 0
        out.append({"name": s["name"], "checkpoint": s["checkpoint"], "lag_bytes": lag, "lagging": lag > 0})
    return out
