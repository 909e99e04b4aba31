"""The slot drain: read whole transactions from the stream's replication slot and land them as segments
``[lower, upper)`` that tile the LSN line, each written atomically, then registered. How a run reads,
bounds and acknowledges: docs/internals/capture.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass

import psycopg2

from tidemark.capture.reader import ProgressFn, SlotReader
from tidemark.capture.replication import WalStream
from tidemark.capture.source import check_publication, connect_source, require_slot, source_dsn
from tidemark.config import StreamConfig
from tidemark.control import Control, Segment, open_control
from tidemark.connections import connect_failure
from tidemark.errors import permanent_connect_failure, reason_line, StreamBusy, TidemarkError, TransientError
from tidemark.failures import is_transient
from tidemark.landing.segments import SegmentWriter
from tidemark.landing.store import landing_store, put_stream_if_absent, segment_key
from tidemark.lsn import format_lsn

ALIVE_SECONDS = 0.25           # how often a landing segment's drain tells the walsender it is alive
# how long a drain asks again for a slot another process holds (a consolidation advancing it, the last
# drain's walsender exiting: moments) before it fails as busy (a retry of the task comes much later)
SLOT_BUSY_WAIT_SECONDS = 15.0


@dataclass(frozen=True)
class DrainResult:
    """What one drain run (or re-drain) did, over all the segments it landed.

    ``segments`` holds one `DrainResult` per segment, in order (each with ``segments == ()``); the
    run's own fields sum them up: ``seq``/``lower`` of the first, ``upper`` of the last, ``records``,
    ``txns``, ``byte_size`` and ``changes`` summed, ``uri`` of the last segment written, ``registered`` when every
    segment written was registered by this run. ``empty`` = no records (progress-only segments, or
    nothing at all when ``upper == lower``: then nothing is written and ``uri`` is None). A re-drain
    (`redrain_range`) always lands exactly one segment."""

    stream: str
    seq: int
    lower: int
    upper: int
    records: int
    txns: int
    uri: str | None
    byte_size: int
    registered: bool
    empty: bool
    segments: tuple["DrainResult", ...] = ()
    changes: int = 0        # row changes and truncated tables read (an update is one change, two records)

    @classmethod
    def of_run(cls, parts: list["DrainResult"]) -> "DrainResult":
        """The run's result over its segments' results (at least one)."""
        written = [p for p in parts if p.uri is not None]
        records = sum(p.records for p in parts)
        return cls(parts[0].stream, parts[0].seq, parts[0].lower, parts[-1].upper, records,
                   sum(p.txns for p in parts), written[-1].uri if written else None,
                   sum(p.byte_size for p in parts), bool(written) and all(p.registered for p in written),
                   records == 0, tuple(parts), sum(p.changes for p in parts))


def _land(cfg: StreamConfig, ctl: Control, seg: SegmentWriter, upper: int, origin: str, lease) -> DrainResult:
    """Write the segment atomically, then register it. Nothing is written for an empty interval."""
    if upper == seg.lower:
        return DrainResult(cfg.stream, seg.seq, seg.lower, upper, 0, 0, None, 0, False, True)
    store = landing_store(cfg)
    key = segment_key(cfg.stream, seg.seq, seg.lower, upper)
    uri, _, size, digest = put_stream_if_absent(store, key, lambda fh: seg.write(fh, upper))
    lease.confirm("register segment " + str(seg.seq))
    registered = ctl.register_segment(Segment(
        stream=cfg.stream, seq=seg.seq, lower=seg.lower, upper=upper, uri=uri, record_count=seg.records,
        txn_count=seg.txns, byte_size=size, checksum=digest, status="landed", origin=origin,
        min_commit_ts=seg.min_commit_ts, max_commit_ts=seg.max_commit_ts))
    return DrainResult(cfg.stream, seg.seq, seg.lower, upper, seg.records, seg.txns, uri, size, registered,
                       seg.records == 0)


def _read_segment_from_slot(cfg: StreamConfig, ctl: Control, lease, *, seq: int, lower: int, upper: int | None = None,
                            max_changes: int | None = None, max_bytes: int | None = None,
                            progress: ProgressFn | None = None, extra_options: str = "") -> DrainResult:
    """Read from ``lower`` up to the server's position at the start and land it in as many segments
    as the limits make, each registered as it lands (origin ``drain``); or, given ``upper`` (a
    re-drain), exactly ``[lower, upper)`` as the one segment ``seq`` (origin ``repair``)."""
    exact_upper = upper is not None
    state = ctl.stream(cfg.stream)
    with contextlib.closing(connect_source(cfg, application_name="tidemark-drain-check")) as conn:
        info = require_slot(cfg, covers=lower, conn=conn)
        check_publication(cfg, conn)        # a publication altered since `stream apply` would drop changes
    # the furthest position the slot may be confirmed to under the stream's ack policy
    ack = state.landed_upper if cfg.drain.ack_policy == "landed" else state.frontier
    ws = WalStream(source_dsn(cfg), extra_options=extra_options)
    reader = None
    landed: list[DrainResult] = []
    try:
        target = upper if exact_upper else ws.identify()
        # never move the slot backwards, nor past the policy
        confirmed = info.confirmed_flush_lsn or 0
        ws.ack = ack if ack is not None and ack > confirmed else 0
        ws.start(cfg.source.slot, lower, cfg.source.publication, busy_wait=SLOT_BUSY_WAIT_SECONDS)
        seg = SegmentWriter(cfg.stream, seq, lower, codec=cfg.landing.codec)
        reader = SlotReader(cfg, ws, seg, progress)
        while True:
            outcome = reader.read(lower=seg.lower, target=target, exact_upper=exact_upper,
                                  max_changes=max_changes, max_bytes=max_bytes,
                                  idle_timeout=cfg.drain.idle_timeout_seconds,
                                  stall_timeout=cfg.drain.stall_timeout_seconds)
            with _alive(ws):                # an upload may outlast the walsender's wal_sender_timeout
                landed_seg = _land(cfg, ctl, seg, outcome.upper, "repair" if exact_upper else "drain", lease)
            result = dataclasses.replace(landed_seg, changes=outcome.changes)
            landed.append(result)
            if cfg.drain.ack_policy == "landed" and result.registered and not exact_upper:
                lease.confirm(f"acknowledge slot {cfg.source.slot} to {format_lsn(result.upper)}")
                ws.ack = max(ws.ack, result.upper)
            if ws.ack:
                ws.send_status()
            if outcome.reached or outcome.upper <= seg.lower:
                break
            seg.close()
            seg = SegmentWriter(cfg.stream, seg.seq + 1, outcome.upper, codec=cfg.landing.codec)
            reader.next_segment(seg, outcome.bytes_read)
        return DrainResult.of_run(landed)
    finally:
        if reader is not None:
            reader.close()
            reader.seg.close()
        ws.close()


@contextlib.contextmanager
def _alive(ws: WalStream):
    """Send the walsender a status update every `ALIVE_SECONDS` while the body runs, so that a
    segment landing slowly (a large upload) does not look like a dead client (``wal_sender_timeout``)
    and the run can go on with its next segment. The body must not use ``ws``."""
    stop = threading.Event()

    def beat() -> None:
        with contextlib.suppress(Exception):    # the connection is gone: the next read on it says so
            ws.send_status()
            while not stop.wait(ALIVE_SECONDS):
                ws.send_status()

    thread = threading.Thread(target=beat, name="tidemark-drain-alive", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def _connection_errors_named(cfg: StreamConfig):
    """A PostgreSQL connection lost mid-drain (a restart, a network cut) becomes a `TransientError`
    (retried) that says so and what to do, instead of a driver traceback."""
    try:
        yield
    except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
        if permanent_connect_failure(str(exc)):     # a wrong password or host: no retry mends it
            raise connect_failure(exc, stream=cfg.stream, role="the source", conn_id=cfg.source.connection,
                                  dsn=source_dsn(cfg)) from exc
        raise TransientError(f"stream {cfg.stream}: the drain lost its connection to PostgreSQL "
                             f"({' '.join(str(exc).split()) or type(exc).__name__}); nothing past the last "
                             "registered segment was registered and the slot still holds it: "
                             "run the drain again") from exc


def drain_stream(cfg: StreamConfig, *, max_changes: int | None = None, max_bytes: int | None = None,
                 progress: ProgressFn | None = None, extra_options: str = "") -> DrainResult:
    """Drain the stream's slot from its landed upper up to the server's position at the start, into
    as many new segments as that takes, each registered as it lands (`DrainResult.segments`).

    ``max_changes`` / ``max_bytes`` (a segment's size, not the run's) default to the stream's ``drain``
    settings; a transaction is never split, so a segment's last one may exceed them. A transaction
    still open in the source does not hold the run back: it commits after the run's end position and
    is left for the next run. ``progress`` is called with a dict (stream, records, txns, bytes, lsn,
    seconds; the run's totals) about once a second (`tidemark drain` prints it). Raises `StreamBusy` if
    another drain of the stream is running, `SlotLost` if the slot cannot replay from the landed upper.
    ``extra_options`` are added to the replication connection's options (e.g. ``-c
    logical_decoding_work_mem=64kB``).
    """
    max_changes = max_changes if max_changes is not None else cfg.drain.max_changes
    max_bytes = max_bytes if max_bytes is not None else cfg.drain.max_bytes
    with _connection_errors_named(cfg), open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, "drain") as lease:
        state = ctl.stream(cfg.stream)
        if state.landed_upper is None:
            raise TidemarkError(f"stream {cfg.stream} has no consistent point yet: run its snapshot first "
                                "(it creates the slot and sets where the drain starts)")
        try:
            result = _read_segment_from_slot(cfg, ctl, lease, seq=state.next_seq, lower=state.landed_upper,
                                             max_changes=max_changes, max_bytes=max_bytes, progress=progress,
                                             extra_options=extra_options)
        except Exception as exc:
            _record_failure(ctl, cfg, exc)
            raise
        for incident in ctl.incidents(cfg.stream):
            if incident["kind"] == DRAIN_FAILED:
                ctl.resolve_incident(incident["id"], f"drained to {format_lsn(result.upper)}")
        return result


DRAIN_FAILED = "drain_failed"


def _record_failure(ctl: Control, cfg: StreamConfig, exc: BaseException) -> None:
    """A drain failure that a retry a moment later does not mend (not a lost connection, not another
    drain holding the slot or the lease) is an incident, one per cause (each scheduled run that meets it
    counts one more), so the status page shows it beside the task's state: a lost slot, a full landing
    store, a stalled walsender, a bad publication. The next drain that lands resolves it."""
    if isinstance(exc, (StreamBusy, TransientError)) or (is_transient(exc) and not isinstance(exc, TidemarkError)):
        return
    reason = reason_line(f"{type(exc).__name__}: {exc}")
    with contextlib.suppress(Exception):     # the control database itself may be what failed
        # one cause whatever the numbers in it (`control.db.NUMBERS_BLANKED`)
        ctl.open_incident(cfg.stream, DRAIN_FAILED, {"step": "drain", "reason": reason})


def redrain_range(cfg: StreamConfig, *, seq: int, lower: int, upper: int) -> DrainResult:
    """Re-read exactly ``[lower, upper)`` from the slot and land it as the one segment ``seq`` (origin
    ``repair``).

    Produces the same bytes as the drain that first wrote that range (an existing file with other
    bytes is an error). Raises `SlotLost` if the slot no longer reaches ``lower``.
    """
    if upper <= lower:
        raise TidemarkError(f"stream {cfg.stream}: cannot re-drain the empty range "
                            f"[{format_lsn(lower)}, {format_lsn(upper)})")
    with _connection_errors_named(cfg), open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, "drain") as lease:
        return _read_segment_from_slot(cfg, ctl, lease, seq=seq, lower=lower, upper=upper)


__all__ = ["DrainResult", "drain_stream", "redrain_range"]
