"""Gap detection, repair, resend and sweep: Tidemark notices and mends holes in its own history.

A stream's segments tile the LSN line from its latest snapshot's consistent point
(``consistent_lsn``): sequence numbers are contiguous and ``upper[n] == lower[n + 1]``. Segments
entirely below the consistent point are *history*. `detect` walks the manifest and finds:

* a missing sequence number (rows ``landed``/``quarantined``/``forgotten`` account for a number;
  ``forgotten`` ones are settled but cover no LSN range);
* an LSN hole or overlap between neighbouring segments;
* a registered, not yet consolidated segment whose file is missing, whose checksum no longer
  matches, that fails `read_segment`, that is not the segment its name says, or whose progress
  counts are not met — such a file is *quarantined* (status ``quarantined``, file kept, incident
  naming segment, record and reason); an open ``counts_unmet`` incident of the consolidation
  counts too;
* a slot that no longer reaches the frontier: missing, ``wal_status = 'lost'``, or confirmed past
  the first missing position.

It decides ``repair`` when the slot still covers every missing range (`repair` re-drains exactly
those ranges with their original sequence numbers), else ``resend`` (`resend` forgets what cannot
be replayed, as Ignite's ``delete_lost_segment_links``, and re-snapshots at a new consistent
point). `sweep` finds files that were written but never registered (K2View's "zombies").

Nothing is ever deleted: bad or foreign files are moved to ``{stream}/quarantine/``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Iterator

from tidemark.config import StreamConfig
from tidemark.control import Control, Segment, StreamState
from tidemark.errors import GapError, SegmentError
from tidemark.segments import (SegmentBuilder, SegmentContent, checksum, lsn_to_str, parse_segment_name,
                               read_segment, segment_name)
from tidemark.source import SlotInfo, open_control, slot_info
from tidemark.store import Store, open_store, put_if_absent, stream_keys

LOCK_PURPOSE = "gaps"
SWEEP_LOCK_PURPOSE = "drain"   # a sweep must not race the drain's write-then-register
GAP_KINDS = ("missing_seq", "lsn_hole", "lsn_overlap", "missing_file", "bad_file", "quarantined",
             "counts_unmet", "slot_lost", "slot_ahead")
_FILE_KINDS = ("missing_file", "bad_file", "quarantined", "counts_unmet")


@dataclass(frozen=True)
class Gap:
    """One hole in a stream's history: ``[lower, upper)`` and the sequence number that fills it.

    ``seq`` is None when no sequence number is free for the range (a hole or overlap between
    contiguous numbers, a lost slot): it cannot be filled in place. ``extra_seqs`` are further
    missing numbers, filled with empty segments at ``upper``. ``needs_wal`` is False when the
    range is empty (nothing to replay).
    """

    kind: str
    lower: int
    upper: int
    seq: int | None
    reason: str
    extra_seqs: tuple[int, ...] = ()
    needs_wal: bool = True
    incidents: tuple[int, ...] = ()

    @property
    def in_place(self) -> bool:
        return self.seq is not None


@dataclass(frozen=True)
class GapReport:
    """What `detect` found and decided. ``decision``: ok | repair | resend; ``action`` is the next
    orchestration step: consolidate | wait (when ok) | repair | resend."""

    stream: str
    decision: str
    action: str
    reasons: tuple[str, ...]
    gaps: tuple[Gap, ...]
    consistent_lsn: int | None
    landed_upper: int | None
    frontier: int | None
    next_seq: int
    slot: dict | None
    checked_segments: int

    @property
    def first_missing(self) -> int | None:
        return min((g.lower for g in self.gaps), default=None)


@dataclass(frozen=True)
class RepairResult:
    stream: str
    repaired: tuple[dict, ...]
    skipped: tuple[dict, ...]
    quarantined: tuple[str, ...]
    resolved_incidents: tuple[int, ...]


@dataclass(frozen=True)
class ResendResult:
    stream: str
    skipped: bool
    reason: str
    forgotten: tuple[int, ...] = ()
    snapshot_id: str | None = None
    lsn: int | None = None
    tables: dict = field(default_factory=dict)
    resolved_incidents: tuple[int, ...] = ()


@dataclass(frozen=True)
class SweepResult:
    stream: str
    scanned: int
    registered: tuple[int, ...]
    duplicates: tuple[str, ...]
    quarantined: tuple[dict, ...]


# -- helpers -----------------------------------------------------------------------------------------

def landing_store(cfg: StreamConfig) -> Store:
    """The stream's landing store."""
    return open_store(cfg.landing.url, endpoint_url=cfg.landing.endpoint_url, region=cfg.landing.region)


def segment_key(stream: str, seq: int, lower: int, upper: int) -> str:
    """The landing key of a segment: ``{stream}/segments/{segment_name}``."""
    return stream_keys(stream)["segments"] + segment_name(seq, lower, upper)


def quarantine_key(stream: str, key: str, data: bytes) -> str:
    """Where a bad file is kept for inspection: ``{stream}/quarantine/{name}.{sha256[:16]}``."""
    return f"{stream}/quarantine/{key.rsplit('/', 1)[-1]}.{checksum(data)[:16]}"


def move_aside(store: Store, stream: str, key: str) -> str | None:
    """Move ``key`` to the quarantine area (copy, then delete the original); return the new key."""
    if not store.exists(key):
        return None
    data = store.get(key)
    target = quarantine_key(stream, key, data)
    put_if_absent(store, target, data)
    store.delete(key)
    return target


def _fmt(lsn: int | None) -> str:
    return "-" if lsn is None else lsn_to_str(lsn)


def _slot_dict(info: SlotInfo | None) -> dict | None:
    if info is None:
        return None
    return {"name": info.name, "active": info.active, "restart_lsn": info.restart_lsn,
            "confirmed_flush_lsn": info.confirmed_flush_lsn, "wal_status": info.wal_status,
            "current_lsn": info.current_lsn, "usable": info.usable}


def check_content(content: SegmentContent, seg: Segment, stream: str) -> str | None:
    """Return why a decoded file is not the registered segment ``seg``, or None if it is."""
    if (content.lower, content.upper) != (seg.lower, seg.upper):
        return (f"file covers [{_fmt(content.lower)}, {_fmt(content.upper)}) but the manifest says "
                f"[{_fmt(seg.lower)}, {_fmt(seg.upper)})")
    if content.seq != seg.seq or content.stream != stream:
        return f"file is segment {content.seq} of stream {content.stream!r}, not {seg.seq} of {stream!r}"
    return unmet_counts(content)


def unmet_counts(content: SegmentContent) -> str | None:
    """Return why the progress counts of a segment are not met by its records, or None."""
    found: dict[int, set[int]] = {}
    for r in [*content.updates, *content.events]:
        found.setdefault(r.time, set()).add(r.position)
    for t, n in sorted(content.counts.items()):
        have = len(found.get(t, ()))
        if have != n:
            return f"counts unmet at time {t} ({_fmt(t)}): progress says {n}, the file has {have} distinct records"
    return None


VERIFY_LEVELS = ("exists", "checksum", "full")


def inspect_file(store: Store, seg: Segment, stream: str, verify: str = "full") -> tuple[str, str, int | None] | None:
    """Check a registered segment's file; return (kind, reason, record) if it is not sound.

    ``verify``: ``exists`` (the file is there), ``checksum`` (and its bytes are the registered
    ones), ``full`` (and it decodes as exactly that segment with its counts met)."""
    key = segment_key(stream, seg.seq, seg.lower, seg.upper)
    if not store.exists(key):
        return "missing_file", f"file {store.uri(key)} is missing", None
    if verify == "exists":
        return None
    data = store.get(key)
    if checksum(data) != seg.checksum:
        return "bad_file", f"checksum {checksum(data)[:16]}… does not match the manifest's {seg.checksum[:16]}…", None
    if verify == "checksum":
        return None
    try:
        content = read_segment(data, segment_name(seg.seq, seg.lower, seg.upper))
    except SegmentError as exc:
        return "bad_file", exc.reason, exc.record
    why = check_content(content, seg, stream)
    return ("bad_file", why, None) if why else None


# -- detect ------------------------------------------------------------------------------------------

class _Tiler:
    """Walk a stream's manifest in sequence order and collect the gaps of its tiling."""

    def __init__(self, state: StreamState, rows: list[Segment]):
        self.state = state
        self.gaps: list[Gap] = []
        self.start = state.consistent_lsn if state.consistent_lsn is not None else (rows[0].lower if rows else 0)
        history = [r for r in rows if r.upper <= self.start and r.lower < self.start]   # entirely below
        self.tiling = [r for r in rows if not (r.upper <= self.start and r.lower < self.start)]
        if history:
            first = max(r.seq for r in history) + 1
        elif self.tiling and state.consistent_lsn is None:
            first = self.tiling[0].seq
        else:
            first = 0
        self.tiling = [r for r in self.tiling if r.seq >= first]
        self.expect = first
        self.pos = self.start

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
                          f"no segment covers [{_fmt(self.pos)}, {_fmt(row.lower)}) before segment {row.seq} "
                          "and no sequence number is free for it")
            elif row.lower < self.pos:
                self._add("lsn_overlap", row.lower, self.pos, None,
                          f"segment {row.seq} starts at {_fmt(row.lower)}, inside the range already covered "
                          f"up to {_fmt(self.pos)}")
            self.pos = max(self.pos, row.upper)
            covering.append(row)
        self._trailing()
        return covering

    def _missing(self, seqs: list[int], until: int) -> None:
        if until < self.pos:
            self._add("lsn_overlap", until, self.pos, None,
                      f"segments {seqs[0]}..{seqs[-1]} are missing and segment {seqs[-1] + 1} starts at "
                      f"{_fmt(until)}, inside the range already covered up to {_fmt(self.pos)}")
            return
        names = f"segment {seqs[0]} is" if len(seqs) == 1 else f"segments {seqs[0]}..{seqs[-1]} are"
        self._add("missing_seq", self.pos, until, seqs[0],
                  f"{names} missing from the manifest: [{_fmt(self.pos)}, {_fmt(until)})",
                  extra_seqs=tuple(seqs[1:]), needs_wal=until > self.pos)
        self.pos = until

    def _trailing(self) -> None:
        landed = self.state.landed_upper
        if self.expect < self.state.next_seq:
            until = landed if landed is not None and landed > self.pos else self.pos
            self._missing(list(range(self.expect, self.state.next_seq)), until)
        elif landed is not None and landed > self.pos:
            self._add("lsn_hole", self.pos, landed, self.state.next_seq,
                      f"landed upper is {_fmt(landed)} but the segments end at {_fmt(self.pos)}")
            self.pos = landed

    def _add(self, kind: str, lower: int, upper: int, seq: int | None, reason: str, **kw) -> None:
        self.gaps.append(Gap(kind=kind, lower=lower, upper=upper, seq=seq, reason=reason, **kw))


def _file_gaps(ctl: Control, store: Store, cfg: StreamConfig, covering: list[Segment],
               frontier: int | None, verify: str) -> tuple[list[Gap], int]:
    """Check the files of covering segments not yet consolidated; quarantine bad ones."""
    gaps, checked = [], 0
    unmet = _open_counts_unmet(ctl, cfg.stream, covering)
    for seg in covering:
        if frontier is not None and seg.upper <= frontier and seg.seq not in unmet:
            continue
        checked += 1
        name = segment_name(seg.seq, seg.lower, seg.upper)
        problem = inspect_file(store, seg, cfg.stream, verify)
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


def _slot_gaps(cfg: StreamConfig, info: SlotInfo | None, end: int, gaps: list[Gap]) -> list[Gap]:
    """Gaps of the slot itself: missing, invalidated, or confirmed past the first missing position."""
    if info is None:
        return [Gap("slot_lost", end, end, None, f"replication slot {cfg.source.slot} does not exist")]
    if not info.usable:
        return [Gap("slot_lost", end, end, None,
                    f"replication slot {cfg.source.slot} is invalidated (wal_status={info.wal_status})")]
    confirmed = info.confirmed_flush_lsn
    if confirmed is not None and confirmed > end:
        return [Gap("slot_ahead", end, confirmed, None,
                    f"slot {cfg.source.slot} is confirmed up to {_fmt(confirmed)}, past the landed end "
                    f"{_fmt(end)}: [{_fmt(end)}, {_fmt(confirmed)}) can no longer be drained")]
    return []


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
        return "resend", reasons + [f"slot is confirmed up to {_fmt(info.confirmed_flush_lsn)}, past the first "
                                    f"missing position {_fmt(low)}"]
    return "repair", reasons + [f"slot still covers everything from {_fmt(low)}"]


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


def _action(decision: str, state: StreamState, ctl: Control) -> str:
    if decision != "ok":
        return decision
    pending = state.landed_upper is not None and (state.frontier is None or state.landed_upper > state.frontier)
    return "consolidate" if pending or _unloaded_snapshot(ctl, state.name) else "wait"


def _unloaded_snapshot(ctl: Control, stream: str) -> bool:
    with ctl.tx() as cur:
        cur.execute("SELECT 1 FROM tidemark.snapshots WHERE stream = %s AND status = 'complete' LIMIT 1", (stream,))
        return cur.fetchone() is not None


def detect(cfg: StreamConfig, *, verify: str = "full", source_conn=None) -> GapReport:
    """Find the gaps of a stream and decide ok | repair | resend (records incidents; quarantines
    bad files in the manifest; idempotent).

    Files of segments not yet consolidated are checked at level ``verify`` (see `inspect_file`);
    consolidated ones are in the lake and their WAL is released, so they are not read."""
    if verify not in VERIFY_LEVELS:
        raise ValueError(f"verify must be one of {VERIFY_LEVELS}, not {verify!r}")
    store = landing_store(cfg)
    info = slot_info(cfg, source_conn)
    with open_control(cfg) as ctl:
        state = ctl.stream(cfg.stream)
        rows = ctl.segments(cfg.stream, status=None)
        tiler = _Tiler(state, rows)
        covering = tiler.walk()
        file_gaps, checked = _file_gaps(ctl, store, cfg, covering, state.frontier, verify)
        gaps = sorted(tiler.gaps + file_gaps, key=lambda g: (g.lower, g.upper))
        gaps += _slot_gaps(cfg, info, tiler.pos, gaps)
        gaps = _record_gap_incidents(ctl, cfg.stream, gaps)
        decision, reasons = decide(gaps, info)
        return GapReport(stream=cfg.stream, decision=decision, action=_action(decision, state, ctl),
                         reasons=tuple(reasons), gaps=tuple(gaps), consistent_lsn=state.consistent_lsn,
                         landed_upper=state.landed_upper, frontier=state.frontier, next_seq=state.next_seq,
                         slot=_slot_dict(info), checked_segments=checked)


# -- repair ------------------------------------------------------------------------------------------

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
                raise GapError(f"stream {cfg.stream}: gap {gap.kind} [{_fmt(gap.lower)}, {_fmt(gap.upper)}) "
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
    seg = _registered(ctl, cfg.stream, gap.seq)
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
    _redrain(cfg, seg.seq, seg.lower, seg.upper)
    _adopt_redrained(ctl, store, cfg, seg)
    return True, f"segment {seg.seq} re-drained [{_fmt(seg.lower)}, {_fmt(seg.upper)})", [aside] if aside else []


def _fill_missing(cfg: StreamConfig, ctl: Control, store: Store, gap: Gap) -> tuple[bool, str, list[str]]:
    """Write and register the missing segments of a sequence gap (empty ones for extra numbers)."""
    changed = False
    if _registered(ctl, cfg.stream, gap.seq) is None:
        if gap.needs_wal:
            _redrain(cfg, gap.seq, gap.lower, gap.upper)
        else:
            _register_empty(ctl, store, cfg.stream, gap.seq, gap.lower)
        changed = True
    for seq in gap.extra_seqs:
        if _registered(ctl, cfg.stream, seq) is None:
            _register_empty(ctl, store, cfg.stream, seq, gap.upper)
            changed = True
    seqs = (gap.seq, *gap.extra_seqs)
    note = f"segment(s) {', '.join(map(str, seqs))} written for [{_fmt(gap.lower)}, {_fmt(gap.upper)})"
    return changed, note if changed else f"segment(s) {seqs} already registered", []


def _redrain(cfg: StreamConfig, seq: int, lower: int, upper: int) -> None:
    from tidemark import drain

    drain.redrain_range(cfg, seq=seq, lower=lower, upper=upper, origin="repair")


def _adopt_redrained(ctl: Control, store: Store, cfg: StreamConfig, seg: Segment) -> None:
    """Check the re-drained file is the registered segment and mark it landed."""
    problem = inspect_file(store, seg, cfg.stream)
    if problem is not None:
        raise GapError(f"stream {cfg.stream}: re-drained segment {seg.seq} is still not sound: {problem[1]}")
    ctl.set_segment_status(cfg.stream, [seg.seq], "landed")


def _register_empty(ctl: Control, store: Store, stream: str, seq: int, at: int) -> None:
    """Write and register an empty segment ``[at, at)`` (progress only) with number ``seq``."""
    data = SegmentBuilder(stream, seq, at).build(at)
    uri, _ = put_if_absent(store, segment_key(stream, seq, at, at), data)
    ctl.register_segment(Segment(stream, seq, at, at, uri, 0, 0, len(data), checksum(data), origin="repair"))


def _registered(ctl: Control, stream: str, seq: int) -> Segment | None:
    rows = ctl.segments(stream, status=None, from_seq=seq)
    return rows[0] if rows and rows[0].seq == seq else None


# -- resend ------------------------------------------------------------------------------------------

def resend(cfg: StreamConfig, *, tables: list[str] | None = None, force: bool = False) -> ResendResult:
    """Forget the segments that cannot be replayed, re-snapshot at a new consistent point (new
    slot), and leave the stream for the consolidation to load that snapshot (idempotent: a
    stream without gaps is left alone unless ``force``)."""
    from tidemark import snapshot

    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, LOCK_PURPOSE):
        report = detect(cfg)
        if report.decision == "ok" and not force:
            return ResendResult(stream=cfg.stream, skipped=True, reason="no gaps: nothing to resend")
        forgotten = forget_lost(ctl, cfg.stream, report)
        # the snapshot drops the old slot (under the drain lock) and creates a new consistent point
        result = snapshot.snapshot_stream(cfg, tables=tables, mode="resend")
        note = (f"resend: snapshot {result.snapshot_id} at {_fmt(result.lsn)} of {sorted(result.tables)}; "
                f"segments forgotten: {list(forgotten) or 'none'}")
        resolved = _resolve_all(ctl, cfg.stream, note)
        return ResendResult(stream=cfg.stream, skipped=False, reason="; ".join(report.reasons) or "forced",
                            forgotten=forgotten, snapshot_id=result.snapshot_id, lsn=result.lsn,
                            tables=dict(result.tables), resolved_incidents=resolved)


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


# -- sweep -------------------------------------------------------------------------------------------

def sweep(cfg: StreamConfig) -> SweepResult:
    """Register segment files that were written but never registered when they fit the tiling;
    leave identical duplicates; move anything else aside with an incident (never deletes)."""
    store = landing_store(cfg)
    registered, duplicates, quarantined = [], [], []
    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, SWEEP_LOCK_PURPOSE):
        keys = sorted(store.list(stream_keys(cfg.stream)["segments"]))
        for key in _by_seq(keys):
            verdict, reason = _sweep_one(ctl, store, cfg.stream, key)
            if verdict == "registered":
                registered.append(parse_segment_name(key)[0])
            elif verdict == "duplicate":
                duplicates.append(key)
            elif verdict == "quarantine":
                target = move_aside(store, cfg.stream, key)
                inc = ctl.open_incident(cfg.stream, "orphan_segment", {"key": key, "moved_to": target, "reason": reason})
                quarantined.append({"key": key, "moved_to": target, "reason": reason, "incident": inc})
    return SweepResult(stream=cfg.stream, scanned=len(keys), registered=tuple(registered),
                       duplicates=tuple(duplicates), quarantined=tuple(quarantined))


def _by_seq(keys: list[str]) -> Iterator[str]:
    """Segment keys in sequence order (unparseable names first, they are quarantined)."""
    def order(k: str) -> tuple[int, str]:
        with contextlib.suppress(ValueError):
            return parse_segment_name(k)[0], k
        return -1, k
    yield from sorted(keys, key=order)


def _sweep_one(ctl: Control, store: Store, stream: str, key: str) -> tuple[str, str]:
    """Classify one landed file: known | duplicate | registered | quarantine, with a reason."""
    base = key.rsplit("/", 1)[-1]
    try:
        seq, lower, upper = parse_segment_name(base)
    except ValueError:
        return "quarantine", f"{base!r} is not a segment file name"
    if key != stream_keys(stream)["segments"] + base:
        return "quarantine", "segment file in a sub-directory of the segments area"
    row = _registered(ctl, stream, seq)
    if row is not None and row.uri == store.uri(key):
        return "known", ""
    data = store.get(key)
    if row is not None:
        if checksum(data) == row.checksum:
            return "duplicate", f"identical to registered segment {seq}"
        return "quarantine", (f"segment {seq} is registered as [{_fmt(row.lower)}, {_fmt(row.upper)}) with other "
                              "bytes; this file is not part of the stream's history")
    why = _orphan_problem(ctl, stream, data, base, seq, lower, upper)
    if why:
        return "quarantine", why
    ok = ctl.register_segment(_segment_row(stream, store.uri(key), data, read_segment(data, base), seq))
    return ("registered", "") if ok else ("known", "")


def _orphan_problem(ctl: Control, stream: str, data: bytes, name: str, seq: int, lower: int, upper: int) -> str | None:
    """Return why an unregistered file cannot be registered, or None if it fits the tiling."""
    try:
        content = read_segment(data, name)
    except SegmentError as exc:
        return str(exc)
    if (content.seq, content.lower, content.upper) != (seq, lower, upper) or content.stream != stream:
        return (f"content is segment {content.seq} [{_fmt(content.lower)}, {_fmt(content.upper)}) of stream "
                f"{content.stream!r}; its name says {seq} [{_fmt(lower)}, {_fmt(upper)}) of {stream!r}")
    why = unmet_counts(content)
    if why:
        return why
    state = ctl.stream(stream)
    if seq == state.next_seq and lower == state.landed_upper:
        return None
    prev, nxt = _registered(ctl, stream, seq - 1), _registered(ctl, stream, seq + 1)
    if seq < state.next_seq and prev is not None and nxt is not None and prev.upper == lower and nxt.lower == upper:
        return None
    return (f"does not fit the tiling: next segment is {state.next_seq} at {_fmt(state.landed_upper)}, "
            f"this file is {seq} at {_fmt(lower)}")


def _segment_row(stream: str, uri: str, data: bytes, content: SegmentContent, seq: int) -> Segment:
    txns = len({u.xid for u in content.updates} | {e.xid for e in content.events})
    stamps = [u.commit_ts for u in content.updates] + [e.commit_ts for e in content.events]
    return Segment(stream, seq, content.lower, content.upper, uri, len(content.updates) + len(content.events),
                   txns, len(data), checksum(data), origin="sweep", min_commit_ts=min(stamps, default=None),
                   max_commit_ts=max(stamps, default=None))
