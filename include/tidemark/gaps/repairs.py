"""Repair: re-drain exactly the missing ``[lower, upper)`` ranges from the slot, under their original seq."""

from __future__ import annotations

from tidemark.capture import drain
from tidemark.config import StreamConfig
from tidemark.control import Control, Segment, open_control
from tidemark.errors import GapError, SegmentError
from tidemark.landing.segments import SegmentBuilder, checksum, read_segment, segment_name
from tidemark.landing.store import Store, landing_store, put_if_absent
from tidemark.lsn import format_lsn
from tidemark.gaps.common import Gap, GapReport, LOCK_PURPOSE, RepairResult, check_content, inspect_file, move_aside, segment_key


def repair(cfg: StreamConfig, report: GapReport) -> RepairResult:
    """Re-drain exactly each missing range with its original sequence number, replacing missing or
    bad files (moved aside, never deleted) and resolving the incidents fixed (idempotent)."""
    if report.stream != cfg.stream:
        raise GapError(f"report is for stream {report.stream}, not {cfg.stream}")
    if report.decision == "resend":
        raise GapError(f"stream {cfg.stream}: the slot cannot replay the missing ranges; a resend is needed: "
                       + "; ".join(report.reasons))
    store = landing_store(cfg)
    repaired, skipped, moved, resolved = [], [], [], []
    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, LOCK_PURPOSE):
        for gap in report.gaps:
            if not gap.in_place:
                raise GapError(f"stream {cfg.stream}: gap {gap.kind} [{format_lsn(gap.lower)}, {format_lsn(gap.upper)}) "
                               "cannot be filled in place; run a resend")
            open_ids = {i["id"] for i in ctl.incidents(cfg.stream)}
            done, note, aside = _repair_one(cfg, ctl, store, gap, open_ids)
            moved += aside
            (repaired if done else skipped).append({"kind": gap.kind, "seq": gap.seq, "lower": gap.lower,
                                                    "upper": gap.upper, "note": note})
            for inc in gap.incidents:
                if inc in open_ids:
                    ctl.resolve_incident(inc, f"repaired: {note}")
                    resolved.append(inc)
    return RepairResult(stream=cfg.stream, repaired=tuple(repaired), skipped=tuple(skipped),
                        quarantined=tuple(moved), resolved_incidents=tuple(resolved))


def _repair_one(cfg: StreamConfig, ctl: Control, store: Store, gap: Gap,
                open_ids: set[int]) -> tuple[bool, str, list[str]]:
    """Fill one gap; return (changed anything, note, keys moved aside)."""
    if gap.kind in ("missing_seq", "lsn_hole"):
        return _fill_missing(cfg, ctl, store, gap)
    seg = ctl.segment(cfg.stream, gap.seq)
    if seg is None:
        raise GapError(f"stream {cfg.stream}: segment {gap.seq} is no longer in the manifest; detect again")
    problem = inspect_file(store, seg, cfg.stream)
    unmet_open = gap.kind == "counts_unmet" and any(i in open_ids for i in gap.incidents)
    if problem is None and not unmet_open:
        if seg.status == "quarantined":
            ctl.set_segment_status(cfg.stream, [seg.seq], "landed")
            return True, f"segment {seg.seq} file is sound again; status landed", []
        return False, f"segment {seg.seq} is already sound", []
    aside = move_aside(store, cfg.stream, segment_key(cfg.stream, seg.seq, seg.lower, seg.upper))
    drain.redrain_range(cfg, seq=seg.seq, lower=seg.lower, upper=seg.upper)
    _adopt_redrained(ctl, store, cfg, seg)
    return True, f"segment {seg.seq} re-drained [{format_lsn(seg.lower)}, {format_lsn(seg.upper)})", [aside] if aside else []


def _fill_missing(cfg: StreamConfig, ctl: Control, store: Store, gap: Gap) -> tuple[bool, str, list[str]]:
    """Write and register the missing segments of a sequence gap (empty ones for extra numbers)."""
    changed = False
    if ctl.segment(cfg.stream, gap.seq) is None:
        if gap.needs_wal:
            drain.redrain_range(cfg, seq=gap.seq, lower=gap.lower, upper=gap.upper)
        else:
            _register_empty(ctl, store, cfg.stream, gap.seq, gap.lower)
        changed = True
    for seq in gap.extra_seqs:
        if ctl.segment(cfg.stream, seq) is None:
            _register_empty(ctl, store, cfg.stream, seq, gap.upper)
            changed = True
    seqs = (gap.seq, *gap.extra_seqs)
    note = f"segment(s) {', '.join(map(str, seqs))} written for [{format_lsn(gap.lower)}, {format_lsn(gap.upper)})"
    return changed, note if changed else f"segment(s) {seqs} already registered", []


def _adopt_redrained(ctl: Control, store: Store, cfg: StreamConfig, seg: Segment) -> None:
    """Check the re-drained file is the registered segment and mark it landed. A segment written
    before each update was framed as its own array block is re-drained with other bytes: if the new
    file is exactly the registered segment's range, counts and records, its checksum is recorded."""
    problem = inspect_file(store, seg, cfg.stream, verify="exists")
    why = problem[1] if problem else None
    if why is None:
        data = store.get(segment_key(cfg.stream, seg.seq, seg.lower, seg.upper))
        try:
            content = read_segment(data, segment_name(seg.seq, seg.lower, seg.upper))
        except SegmentError as exc:
            why = exc.reason
        else:
            why = check_content(content, seg, cfg.stream)
            if why is None and checksum(data) != seg.checksum:
                found = len(content.updates) + len(content.events)
                if found != seg.record_count:
                    why = f"re-drained with {found} records, registered with {seg.record_count}"
                else:
                    ctl.set_segment_file(cfg.stream, seg.seq, checksum(data), len(data))
    if why is not None:
        raise GapError(f"stream {cfg.stream}: re-drained segment {seg.seq} is still not sound: {why}")
    ctl.set_segment_status(cfg.stream, [seg.seq], "landed")


def _register_empty(ctl: Control, store: Store, stream: str, seq: int, at: int) -> None:
    """Write and register an empty segment ``[at, at)`` (progress only) with number ``seq``."""
    data = SegmentBuilder(stream, seq, at).build(at)
    uri, _ = put_if_absent(store, segment_key(stream, seq, at, at), data)
    ctl.register_segment(Segment(stream, seq, at, at, uri, 0, 0, len(data), checksum(data), origin="repair"))
