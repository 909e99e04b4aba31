"""Resend: forget what cannot be replayed (Ignite's ``delete_lost_segment_links``) and re-snapshot."""

from __future__ import annotations

import logging

from tidemark.capture import snapshot
from tidemark.capture.ranges import describe_copy
from tidemark.config import StreamConfig
from tidemark.control import Control, open_control
from tidemark.lsn import format_lsn
from tidemark.gaps.common import GapReport, RESEND_LOCK_PURPOSE, ResendResult
from tidemark.gaps.detection import detect

log = logging.getLogger(__name__)


def resend(cfg: StreamConfig, *, tables: list[str] | None = None, force: bool = False) -> ResendResult:
    """Forget the segments that cannot be replayed, re-snapshot at a new consistent point (new
    slot), and leave the stream for the consolidation to load that snapshot (idempotent: a
    stream without gaps is left alone unless ``force``).

    Without a gap, the tables a consolidation found needing a copy of their own (`GapReport.resnapshot`:
    a change PostgreSQL sent nothing for) are re-snapshotted alone at their own consistent LSN
    (mode ``table``, after the resend lock is released: it excludes that snapshot) while the other
    tables keep flowing; a second call finds that snapshot waiting to be loaded and skips."""
    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, RESEND_LOCK_PURPOSE):
        report = detect(cfg)
        if report.decision == "ok" and not force:
            if not report.resnapshot or tables:
                return ResendResult(stream=cfg.stream, skipped=True, reason="no gaps: nothing to resend")
        else:
            forgotten = forget_lost(ctl, cfg.stream, report)
            # the snapshot drops the old slot (under the drain lock) and creates a new consistent point
            result = snapshot.snapshot_stream(cfg, tables=tables, mode="resend")
            copied = "; ".join(f"{t}: {describe_copy(c, result.tables.get(t, 0))}" for t, c in sorted(result.copies.items()))
            note = (f"resend: snapshot {result.snapshot_id} at {format_lsn(result.lsn)} of {sorted(result.tables)}; "
                    f"segments forgotten: {list(forgotten) or 'none'}; copied: {copied or 'nothing'}")
            log.info("stream %s: %s", cfg.stream, note)
            resolved = _resolve_all(ctl, cfg.stream, note)
            return ResendResult(stream=cfg.stream, skipped=False, reason="; ".join(report.reasons) or "forced",
                                forgotten=forgotten, snapshot_id=result.snapshot_id, lsn=result.lsn,
                                tables=dict(result.tables), resolved_incidents=resolved, copies=dict(result.copies))
    result = snapshot.snapshot_stream(cfg, tables=list(report.resnapshot), mode="table")
    reason = "; ".join(report.reasons)
    log.info("stream %s: %s: snapshot %s at %s", cfg.stream, reason, result.snapshot_id, format_lsn(result.lsn))
    return ResendResult(stream=cfg.stream, skipped=False, reason=reason, snapshot_id=result.snapshot_id,
                        lsn=result.lsn, tables=dict(result.tables))


def forget_lost(ctl: Control, stream: str, report: GapReport) -> tuple[int, ...]:
    """Mark every landed/quarantined segment from the first gap on as forgotten (files are kept)."""
    first = report.first_missing
    if first is None:
        return ()
    start = report.consistent_lsn if report.consistent_lsn is not None else 0
    lost = [s.seq for s in ctl.segments(stream, status=None)
            if s.status in ("landed", "quarantined") and s.upper > start and s.upper > first]
    if lost:
        ctl.set_segment_status(stream, lost, "forgotten")
    return tuple(lost)


def _resolve_all(ctl: Control, stream: str, note: str) -> tuple[int, ...]:
    kinds = ("gap", "slot_lost", "bad_segment", "counts_unmet")
    ids = tuple(i["id"] for i in ctl.incidents(stream) if i["kind"] in kinds)
    for i in ids:
        ctl.resolve_incident(i, note)
    return ids
