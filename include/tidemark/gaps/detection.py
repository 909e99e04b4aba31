"""Detect gaps: walk the manifest and the landing store, check the slot, decide repair or resend."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from tidemark.capture.snapshot import refiltered_tables
from tidemark.capture.source import SlotInfo, slot_info
from tidemark.config import StreamConfig
from tidemark.control import Control, Segment, StreamState, open_control
from tidemark.landing.segments import parse_segment_name, segment_name
from tidemark.landing.store import Store, landing_store
from tidemark.lsn import format_lsn
from tidemark.gaps.common import Gap, GapReport, VERIFY_LEVELS, inspect_file


class _Tiler:
    """Walk a stream's manifest in sequence order and collect the gaps of its tiling."""

    def __init__(self, state: StreamState, rows: list[Segment]):
        """``rows``: the manifest from ``state.archived_seq`` on (the rows below it are archived: they
        tiled the line up to ``state.archived_upper`` when they were archived, below the frontier)."""
        self.state = state
        self.gaps: list[Gap] = []
        self.start = state.consistent_lsn if state.consistent_lsn is not None else (rows[0].lower if rows else 0)
        history = [r for r in rows if r.upper <= self.start and r.lower < self.start]   # entirely below
        self.tiling = [r for r in rows if not (r.upper <= self.start and r.lower < self.start)]
        if history:
            first = max(r.seq for r in history) + 1
        elif state.archived_seq is not None:
            first = state.archived_seq
        elif self.tiling and state.consistent_lsn is None:
            first = self.tiling[0].seq
        else:
            first = 0
        self.tiling = [r for r in self.tiling if r.seq >= first]
        self.expect = first
        self.pos = self.start if state.archived_upper is None else max(self.start, state.archived_upper)

    def walk(self) -> list[Segment]:
        """Find sequence and LSN gaps; return the segments that cover the tiling (not forgotten)."""
        covering = []
        for row in self.tiling:
            if row.seq > self.expect:
                self._missing(list(range(self.expect, row.seq)), row.lower)
            self.expect = row.seq + 1
            if row.status == "forgotten":
                continue
            if row.lower > self.pos:
                self._add("lsn_hole", self.pos, row.lower, None,
                          f"no segment covers [{format_lsn(self.pos)}, {format_lsn(row.lower)}) before segment {row.seq} "
                          "and no sequence number is free for it")
            elif row.lower < self.pos:
                self._add("lsn_overlap", row.lower, self.pos, None,
                          f"segment {row.seq} starts at {format_lsn(row.lower)}, inside the range already covered "
                          f"up to {format_lsn(self.pos)}")
            self.pos = max(self.pos, row.upper)
            covering.append(row)
        self._trailing()
        return covering

    def _missing(self, seqs: list[int], until: int) -> None:
        if until < self.pos:
            self._add("lsn_overlap", until, self.pos, None,
                      f"segments {seqs[0]}..{seqs[-1]} are missing and segment {seqs[-1] + 1} starts at "
                      f"{format_lsn(until)}, inside the range already covered up to {format_lsn(self.pos)}")
            return
        names = f"segment {seqs[0]} is" if len(seqs) == 1 else f"segments {seqs[0]}..{seqs[-1]} are"
        self._add("missing_seq", self.pos, until, seqs[0],
                  f"{names} missing from the manifest: [{format_lsn(self.pos)}, {format_lsn(until)})",
                  extra_seqs=tuple(seqs[1:]), needs_wal=until > self.pos)
        self.pos = until

    def _trailing(self) -> None:
        landed = self.state.landed_upper
        if self.expect < self.state.next_seq:
            until = landed if landed is not None and landed > self.pos else self.pos
            self._missing(list(range(self.expect, self.state.next_seq)), until)
        elif landed is not None and landed > self.pos:
            self._add("lsn_hole", self.pos, landed, self.state.next_seq,
                      f"landed upper is {format_lsn(landed)} but the segments end at {format_lsn(self.pos)}")
            self.pos = landed

    def _add(self, kind: str, lower: int, upper: int, seq: int | None, reason: str, **kw) -> None:
        self.gaps.append(Gap(kind=kind, lower=lower, upper=upper, seq=seq, reason=reason, **kw))


def _file_gaps(ctl: Control, store: Store, cfg: StreamConfig, covering: list[Segment],
               frontier: int | None, verify: str) -> tuple[list[Gap], int]:
    """Check the files of covering segments not yet consolidated; quarantine bad ones. A file found
    sound at level ``full`` is marked verified in the manifest and only checked for existence later."""
    gaps, checked, verified = [], 0, []
    unmet = _open_counts_unmet(ctl, cfg.stream, covering)
    for seg in covering:
        if frontier is not None and seg.upper <= frontier and seg.seq not in unmet:
            continue
        checked += 1
        name = segment_name(seg.seq, seg.lower, seg.upper)
        problem = inspect_file(store, seg, cfg.stream, verify)
        if problem is None and verify == "full" and not seg.verified and seg.status == "landed":
            verified.append((seg.seq, seg.checksum))
        if problem is None and seg.status == "quarantined":
            problem = ("quarantined", "segment is quarantined (its file was replaced but not yet re-registered)", None)
        if problem is None and seg.seq in unmet:
            ids, reason = unmet[seg.seq]
            gaps.append(Gap("counts_unmet", seg.lower, seg.upper, seg.seq, reason, incidents=ids))
            continue
        if problem is None:
            continue
        kind, reason, record = problem
        ids: tuple[int, ...] = unmet.get(seg.seq, ((), ""))[0]
        if kind == "bad_file":
            if seg.status != "quarantined":
                ctl.set_segment_status(cfg.stream, [seg.seq], "quarantined")
            ids += (ctl.open_incident(cfg.stream, "bad_segment",
                                      {"segment": name, "seq": seg.seq, "record": record, "reason": reason}),)
        gaps.append(Gap(kind, seg.lower, seg.upper, seg.seq, f"segment {name}: {reason}", incidents=ids))
    ctl.mark_verified(cfg.stream, verified)
    return gaps, checked


def _open_counts_unmet(ctl: Control, stream: str, covering: list[Segment]) -> dict[int, tuple[tuple[int, ...], str]]:
    """Open ``counts_unmet`` incidents of the consolidation, by the sequence number of the segment
    they name (``seq`` or ``segment``) or whose range holds their ``time``."""
    out: dict[int, tuple[tuple[int, ...], str]] = {}
    for inc in ctl.incidents(stream):
        if inc["kind"] != "counts_unmet":
            continue
        seq = _incident_seq(inc["detail"], covering)
        if seq is None:
            continue
        ids, _ = out.get(seq, ((), ""))
        out[seq] = (ids + (inc["id"],), f"consolidation could not meet the counts of segment {seq}: {inc['detail']}")
    return out


def _incident_seq(detail: dict, covering: list[Segment]) -> int | None:
    if isinstance(detail.get("seq"), int):
        return detail["seq"]
    name = detail.get("segment")
    if isinstance(name, str):
        with contextlib.suppress(ValueError):
            return parse_segment_name(name)[0]
    t = detail.get("time")
    if isinstance(t, int):
        return next((s.seq for s in covering if s.lower <= t < s.upper), None)
    return None


def _slot_gaps(cfg: StreamConfig, info: SlotInfo | None, end: int) -> list[Gap]:
    """Gaps of the slot itself: missing, invalidated, or confirmed past the first missing position."""
    if info is None:
        return [Gap("slot_lost", end, end, None, f"replication slot {cfg.source.slot} does not exist")]
    if not info.usable:
        return [Gap("slot_lost", end, end, None,
                    f"replication slot {cfg.source.slot} is invalidated (wal_status={info.wal_status})")]
    confirmed = info.confirmed_flush_lsn
    if confirmed is not None and confirmed > end:
        return [Gap("slot_ahead", end, confirmed, None,
                    f"slot {cfg.source.slot} is confirmed up to {format_lsn(confirmed)}, past the landed end "
                    f"{format_lsn(end)}: [{format_lsn(end)}, {format_lsn(confirmed)}) can no longer be drained")]
    return []


def _slot_dict(info: SlotInfo | None) -> dict | None:
    if info is None:
        return None
    return {"name": info.name, "active": info.active, "restart_lsn": info.restart_lsn,
            "confirmed_flush_lsn": info.confirmed_flush_lsn, "wal_status": info.wal_status,
            "current_lsn": info.current_lsn, "usable": info.usable}


def decide(gaps: list[Gap], info: SlotInfo | None) -> tuple[str, list[str]]:
    """Return (decision, reasons): ok, repair (the slot covers every missing range) or resend."""
    if not gaps:
        return "ok", []
    reasons = [g.reason for g in gaps]
    fixed = [g for g in gaps if not g.in_place]
    if fixed:
        return "resend", reasons + [f"{len(fixed)} gap(s) cannot be filled in place"]
    wal = [g for g in gaps if g.needs_wal]
    if not wal:
        return "repair", reasons
    low = min(g.lower for g in wal)
    if info is None or not info.usable:
        return "resend", reasons + ["the slot cannot replay the missing ranges"]
    if info.confirmed_flush_lsn is not None and info.confirmed_flush_lsn > low:
        return "resend", reasons + [f"slot is confirmed up to {format_lsn(info.confirmed_flush_lsn)}, past the first "
                                    f"missing position {format_lsn(low)}"]
    return "repair", reasons + [f"slot still covers everything from {format_lsn(low)}"]


def _record_gap_incidents(ctl: Control, stream: str, gaps: list[Gap]) -> list[Gap]:
    """Open one incident per gap (identical open incidents are reused); return gaps with their ids."""
    out = []
    for g in gaps:
        if g.kind in ("bad_file", "counts_unmet", "quarantined"):
            out.append(g)
            continue
        kind = "slot_lost" if g.kind in ("slot_lost", "slot_ahead") else "gap"
        detail = {"gap": g.kind, "seq": g.seq, "lower": g.lower, "upper": g.upper, "reason": g.reason}
        out.append(replace(g, incidents=g.incidents + (ctl.open_incident(stream, kind, detail),)))
    return out


def _pending(state: StreamState) -> bool:
    """Whether landed changes wait for the consolidation."""
    return state.landed_upper is not None and (state.frontier is None or state.landed_upper > state.frontier)


def detect(cfg: StreamConfig, *, verify: str = "full") -> GapReport:
    """Find the gaps of a stream and decide ok | repair | resend (records incidents; quarantines
    bad files in the manifest; idempotent).

    Files of segments not yet consolidated are checked at level ``verify`` (see `inspect_file`), each
    decoded once: a sound one is marked verified and then only checked for existence (segment files
    are immutable; a replaced one is re-registered unverified). Consolidated ones are in the lake and
    their WAL is released, so they are not read; manifest rows below the retention floor are archived
    first (`Control.archive_segments`), so what is read stays the backlog, not the history."""
    if verify not in VERIFY_LEVELS:
        raise ValueError(f"verify must be one of {VERIFY_LEVELS}, not {verify!r}")
    if cfg.source.is_feed:       # no slot, nothing to re-drain: the producer resends (tidemark.feeds)
        return _detect_feed(cfg)
    store = landing_store(cfg)
    info = slot_info(cfg)
    with open_control(cfg) as ctl:
        ctl.archive_segments(cfg.stream)
        state = ctl.stream(cfg.stream)
        rows = ctl.segments(cfg.stream, status=None, from_seq=state.archived_seq or 0, archived=False)
        tiler = _Tiler(state, rows)
        covering = tiler.walk()
        file_gaps, checked = _file_gaps(ctl, store, cfg, covering, state.frontier, verify)
        gaps = sorted(tiler.gaps + file_gaps, key=lambda g: (g.lower, g.upper))
        gaps += _slot_gaps(cfg, info, tiler.pos)
        gaps = _record_gap_incidents(ctl, cfg.stream, gaps)
        decision, reasons = decide(gaps, info)
        action = decision
        if decision == "ok":
            action = "consolidate" if _pending(state) or ctl.complete_snapshots(state.name) else "wait"
        wanted = resnapshots_wanted(cfg, ctl) if decision == "ok" else {}
        if wanted:
            action = "resend"
            reasons = reasons + [f"table {t}: {why}; it is re-snapshotted alone while the stream runs"
                                 for t, why in wanted.items()]
        return GapReport(stream=cfg.stream, decision=decision, action=action,
                         reasons=tuple(reasons), gaps=tuple(gaps), consistent_lsn=state.consistent_lsn,
                         landed_upper=state.landed_upper, frontier=state.frontier, next_seq=state.next_seq,
                         slot=_slot_dict(info), checked_segments=checked, resnapshot=tuple(wanted))


def resnapshots_wanted(cfg: StreamConfig, ctl: Control) -> dict[str, str]:
    """{table: reason} of the tables that need a re-snapshot of their own and have none complete and
    waiting to be loaded: those an open consolidation incident names (`TableNeedsSnapshot`: a change
    PostgreSQL sent nothing for), then those whose column list or row filter changed since their copy
    (`refiltered_tables`). A per-table cause known, the orchestration re-snapshots that table, not the
    stream."""
    waiting = {t for _, _, mode, tables in ctl.complete_snapshots(cfg.stream) if mode == "table" for t in tables}
    out = {}
    for i in ctl.incidents(cfg.stream):
        detail = i["detail"] if isinstance(i["detail"], dict) else {}
        if i["kind"] != "consolidate_failed":
            continue
        for t in detail.get("resnapshot") or ():
            if t not in waiting:
                out.setdefault(t, detail.get("reason") or "its lake copy cannot follow a schema change")
    for t, why in refiltered_tables(cfg, ctl).items():
        if t not in out and t not in waiting:
            out[t] = why
    return out


def _detect_feed(cfg: StreamConfig) -> GapReport:
    """The gap sensor's view of a feed (`detect` for ``kind: feed``, `tidemark.feeds`): there is no slot and
    nothing to re-drain, so the decision is ``ok`` (action ``consolidate`` when landed times wait, else
    ``wait``) or ``producer``: open ``counts_unmet`` / ``feed_file_bad`` incidents or holes in the
    manifest that only the producer can mend (action ``wait``; each reason says what to resend, and
    ``tidemark feed forget`` gives a time up)."""
    with open_control(cfg) as ctl:
        state = ctl.stream(cfg.stream)
        tiler = _Tiler(state, ctl.segments(cfg.stream, status=None))
        tiler.walk()
        open_incidents = [i for i in ctl.incidents(cfg.stream) if i["kind"] in ("counts_unmet", "feed_file_bad")]
        positions = ctl.table_frontiers(cfg.stream)
    # a feed's segments overlap by design (a table landing a time later than another: `_land`)
    holes = [g for g in tiler.gaps if g.kind != "lsn_overlap"]
    reasons = [g.reason for g in holes]
    reasons += [f"incident {i['id']} ({i['kind']}): {(i['detail'] or {}).get('action', i['detail'])}"
                for i in open_incidents]
    if positions:       # some table landed past its own frontier
        pending = any((p["landed_upper"] or 0) > (p["frontier"] or 0) for p in positions.values())
    else:
        pending = _pending(state)
    decision = "producer" if reasons else "ok"
    action = "consolidate" if pending else "wait"
    return GapReport(stream=cfg.stream, decision=decision, action=action, reasons=tuple(reasons),
                     gaps=tuple(holes), consistent_lsn=state.consistent_lsn, landed_upper=state.landed_upper,
                     frontier=state.frontier, next_seq=state.next_seq, slot=None, checked_segments=0)
