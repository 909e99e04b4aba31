"""Sweep: register or quarantine files that were written but never registered (K2View's "zombies")."""

from __future__ import annotations

import contextlib

from tidemark.config import StreamConfig
from tidemark.control import Control, Segment, open_control
from tidemark.errors import SegmentError
from tidemark.landing.segments import SegmentContent, checksum, parse_segment_name, read_segment
from tidemark.landing.store import Store, landing_store, stream_keys
from tidemark.lsn import format_lsn
from tidemark.gaps.common import SWEEP_LOCK_PURPOSE, SweepResult, move_aside, unmet_counts


def sweep(cfg: StreamConfig) -> SweepResult:
    """Register segment files that were written but never registered when they fit the tiling;
    leave identical duplicates; move anything else aside with an incident (never deletes)."""
    store = landing_store(cfg)
    registered, duplicates, quarantined = [], [], []
    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, SWEEP_LOCK_PURPOSE) as lease:
        seqs = {key: _seq(key) for key in store.list(stream_keys(cfg.stream)["segments"])}
        known = _known(ctl, cfg.stream, [seq for seq in seqs.values() if seq >= 0])
        for key in sorted(seqs, key=lambda k: (seqs[k], k)):      # sequence order
            verdict, reason = _sweep_one(ctl, store, cfg.stream, key, lease, known)
            if verdict == "registered":
                registered.append(seqs[key])
            elif verdict == "duplicate":
                duplicates.append(key)
            elif verdict == "quarantine":
                target = move_aside(store, cfg.stream, key)
                inc = ctl.open_incident(cfg.stream, "orphan_segment", {"key": key, "moved_to": target, "reason": reason})
                quarantined.append({"key": key, "moved_to": target, "reason": reason, "incident": inc})
    return SweepResult(stream=cfg.stream, scanned=len(seqs), registered=tuple(registered),
                       duplicates=tuple(duplicates), quarantined=tuple(quarantined))


def _seq(key: str) -> int:
    """The sequence number a segment key names; -1 for a name that is not a segment's (sorted
    first: it is quarantined)."""
    with contextlib.suppress(ValueError):
        return parse_segment_name(key)[0]
    return -1


def _known(ctl: Control, stream: str, seqs: list[int]) -> dict[int, Segment]:
    """The manifest's rows from the lowest of ``seqs`` up, by sequence number: one query for the
    whole listing."""
    if not seqs:
        return {}
    return {s.seq: s for s in ctl.segments(stream, status=None, from_seq=min(seqs))}


def _sweep_one(ctl: Control, store: Store, stream: str, key: str, lease,
               known: dict[int, Segment]) -> tuple[str, str]:
    """Classify one landed file: known | duplicate | registered | quarantine, with a reason (``known``:
    the manifest's rows by sequence number, read once for the listing)."""
    base = key.rsplit("/", 1)[-1]
    try:
        seq, lower, upper = parse_segment_name(base)
    except ValueError:
        return "quarantine", f"{base!r} is not a segment file name"
    if key != stream_keys(stream)["segments"] + base:
        return "quarantine", "segment file in a sub-directory of the segments area"
    row = known.get(seq)
    if row is not None and row.uri == store.uri(key):
        return "known", ""
    data = store.get(key)
    if row is not None:
        if checksum(data) == row.checksum:
            return "duplicate", f"identical to registered segment {seq}"
        return "quarantine", (f"segment {seq} is registered as [{format_lsn(row.lower)}, {format_lsn(row.upper)}) with other "
                              "bytes; this file is not part of the stream's history")
    try:
        content = read_segment(data, base)
    except SegmentError as exc:
        return "quarantine", str(exc)
    why = _orphan_problem(ctl, stream, content, seq, lower, upper)
    if why:
        return "quarantine", why
    lease.confirm(f"register segment {seq} found by the sweep")
    ok = ctl.register_segment(_segment_row(stream, store.uri(key), data, content, seq))
    known[seq] = ctl.segment(stream, seq)      # a later file of the listing under the same number meets this row
    return ("registered", "") if ok else ("known", "")


def _orphan_problem(ctl: Control, stream: str, content: SegmentContent, seq: int, lower: int,
                    upper: int) -> str | None:
    """Return why an unregistered file (decoded: ``content``; its name says ``seq``, ``lower``,
    ``upper``) cannot be registered, or None if it fits the tiling."""
    if (content.seq, content.lower, content.upper) != (seq, lower, upper) or content.stream != stream:
        return (f"content is segment {content.seq} [{format_lsn(content.lower)}, {format_lsn(content.upper)}) of stream "
                f"{content.stream!r}; its name says {seq} [{format_lsn(lower)}, {format_lsn(upper)}) of {stream!r}")
    why = unmet_counts(content)
    if why:
        return why
    state = ctl.stream(stream)
    if seq == state.next_seq and lower == state.landed_upper:
        return None
    prev, nxt = ctl.segment(stream, seq - 1), ctl.segment(stream, seq + 1)
    if seq < state.next_seq and prev is not None and nxt is not None and prev.upper == lower and nxt.lower == upper:
        return None
    return (f"does not fit the tiling: next segment is {state.next_seq} at {format_lsn(state.landed_upper)}, "
            f"this file is {seq} at {format_lsn(lower)}")


def _segment_row(stream: str, uri: str, data: bytes, content: SegmentContent, seq: int) -> Segment:
    txns = len({u.xid for u in content.updates} | {e.xid for e in content.events})
    low, high = content.commit_span
    return Segment(stream, seq, content.lower, content.upper, uri, len(content.updates) + len(content.events),
                   txns, len(data), checksum(data), origin="sweep", min_commit_ts=low, max_commit_ts=high)
