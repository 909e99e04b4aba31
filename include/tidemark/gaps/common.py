"""What the gap modules share: the report and result types, quarantine, file checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidemark.control import Segment
from tidemark.errors import SegmentError
from tidemark.landing.segments import SegmentContent, checksum, read_segment, segment_name
from tidemark.landing.store import Store, put_if_absent, segment_key
from tidemark.lsn import format_lsn

LOCK_PURPOSE = "repair"        # the stream lease of a repair (`tidemark.control.db.LOCK_PURPOSES`)
RESEND_LOCK_PURPOSE = "resend"
SWEEP_LOCK_PURPOSE = "sweep"   # excludes the drain: a sweep must not race its write-then-register


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
    orchestration step: consolidate | wait (when ok) | repair | resend (also when ok: the tables in
    ``resnapshot`` are re-snapshotted alone, see `tidemark.gaps.resend`)."""

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
    resnapshot: tuple[str, ...] = ()     # tables a consolidation found needing a re-snapshot of their own

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
    copies: dict = field(default_factory=dict)    # table -> rows re-copied of rows, key ranges compared/copied


@dataclass(frozen=True)
class SweepResult:
    stream: str
    scanned: int
    registered: tuple[int, ...]
    duplicates: tuple[str, ...]
    quarantined: tuple[dict, ...]


def move_aside(store: Store, stream: str, key: str) -> str | None:
    """Move ``key`` to the quarantine area, ``{stream}/quarantine/{name}.{sha256[:16]}`` (copy, then
    delete the original); return the new key."""
    if not store.exists(key):
        return None
    data = store.get(key)
    target = f"{stream}/quarantine/{key.rsplit('/', 1)[-1]}.{checksum(data)[:16]}"
    put_if_absent(store, target, data)
    store.delete(key)
    return target


def check_content(content: SegmentContent, seg: Segment, stream: str) -> str | None:
    """Return why a decoded file is not the registered segment ``seg``, or None if it is."""
    if (content.lower, content.upper) != (seg.lower, seg.upper):
        return (f"file covers [{format_lsn(content.lower)}, {format_lsn(content.upper)}) but the manifest says "
                f"[{format_lsn(seg.lower)}, {format_lsn(seg.upper)})")
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
            return f"counts unmet at time {t} ({format_lsn(t)}): progress says {n}, the file has {have} distinct records"
    return None


VERIFY_LEVELS = ("exists", "checksum", "full")


def inspect_file(store: Store, seg: Segment, stream: str, verify: str = "full") -> tuple[str, str, int | None] | None:
    """Check a registered segment's file; return (kind, reason, record) if it is not sound.

    ``verify``: ``exists`` (the file is there), ``checksum`` (and its bytes are the registered
    ones), ``full`` (and it decodes as exactly that segment with its counts met). A segment the
    manifest marks verified (decoded and found sound once: `Control.mark_verified`) is only checked
    for existence at any level: its file is immutable."""
    key = segment_key(stream, seg.seq, seg.lower, seg.upper)
    if not store.exists(key):
        return "missing_file", f"file {store.uri(key)} is missing", None
    if verify == "exists" or seg.verified:
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
