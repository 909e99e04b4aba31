"""The slot drain: read whole transactions from the stream's replication slot and land them as segments.

One drain run lands everything committed before it started, in segments ``[lower, upper)`` that tile
the LSN line:

* the first ``lower`` is the stream's landed upper; replication starts there (``START_REPLICATION ...
  LOGICAL lower``: PostgreSQL skips every transaction that commits before it, whatever the slot's
  confirmed position).
* the drain reads until everything that committed before it started has arrived (the end position
  is taken inside a marker transaction that flushes the WAL, so the walsender always reaches it:
  `WalStream.identify`). ``max_changes`` / ``max_bytes`` bound each *segment*, not the run: when a
  segment reaches one, it is closed *between* transactions, landed and registered, and the next one
  starts at its upper on the same replication connection. A transaction is never split: one larger
  than the bounds is one segment. A segment's ``upper`` is a position no later transaction can commit
  below: the end LSN of the last transaction read, or the walsender's keepalive position when it has
  nothing more (an idle stream thus moves forward with a progress-only segment). Silence never ends a
  drain: a walsender decoding a huge transaction is waited for, its keepalives shown as progress;
  only no sign of progress at all for ``drain.stall_timeout_seconds`` fails it (`DrainStalled`,
  nothing of the segment being read landed).
* each segment spills to a local file as it is built (memory stays flat), is written atomically to
  the landing store from that file (`put_stream_if_absent`: a link locally, boto3's managed
  multipart transfer on S3), THEN registered in the manifest — after confirming that the drain
  still holds the stream's lock (`Lease`). Its bytes are a function of the range, so
  `redrain_range` writes the same file again.
* the slot is acknowledged only up to what the stream's ``drain.ack_policy`` allows: ``frontier``
  (default: the consolidated frontier; none while it is NULL) or ``landed`` (the upper of the last
  segment registered, after each one). A run that fails or is killed part-way leaves the segments it
  registered before; the next run goes on from the last of them. While a segment lands, the drain
  keeps telling the walsender it is alive (`_alive`), so a slow upload does not end the run.

The replication protocol is spoken through libpq directly (`tidemark.capture.replication`) rather than
psycopg2's ``LogicalReplicationConnection``: psycopg2 moves its reported flush position forward to a
keepalive's WAL end on its own (confirming the slot past what was landed, let alone consolidated),
and it costs a Python object per message. Here every status message is ours: its flush position is
the policy's position or 0 ("no change").

Records are encoded to Avro as they are decoded (`tidemark.capture.pgoutput.RelationCodec`) and appended
to a `tidemark.landing.segments.SegmentWriter`, the one framing every segment uses (`read_segment` reads it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import psycopg2

from tidemark.config import StreamConfig
from tidemark.control import Control, Segment
from tidemark.errors import DecodeError, DrainStalled, reason_line, StreamBusy, TidemarkError, TransientError
from tidemark.lsn import format_lsn
from tidemark.capture.replication import WalStream
from tidemark.capture.pgoutput import (
    PG_EPOCH_US,
    RelationCodec,
    Type,
    avro_long,
    avro_string,
    decode_message,
    decode_relation,
    table_from_relation,
)
from tidemark.pgtypes import BUILTIN_KINDS, TypeResolver
from tidemark.landing.segments import ARRAY_MAX_RECORDS, SegmentWriter, segment_name
from tidemark.control import open_control
from tidemark.capture.source import check_publication, connect_source, require_slot, source_dsn
from tidemark.failures import is_transient
from tidemark.landing.store import landing_store, put_stream_if_absent, stream_keys

ProgressFn = Callable[[dict], None]

PING_SECONDS = 0.2             # how often an idle drain asks the walsender for a keepalive
PROGRESS_SECONDS = 1.0
ALIVE_SECONDS = 0.25           # how often a landing segment's drain tells the walsender it is alive

_HDR = struct.Struct(">QQq").unpack_from          # 'w': data_start, wal_end, send_time
_KEEPALIVE = struct.Struct(">QqB").unpack_from    # 'k': wal_end, send_time, reply_requested
_STATUS = struct.Struct(">cQQQqB").pack          # 'r': write, flush, apply, now, reply
_BEGIN = struct.Struct(">QqI").unpack_from
_COMMIT_LSNS = struct.Struct(">QQ").unpack_from
_U32 = struct.Struct(">I").unpack_from
_I32 = struct.Struct(">i").unpack_from


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


def print_progress(info: dict, *, file=None) -> None:
    """Print one progress line of a drain (use as the ``progress`` callback)."""
    out = file or sys.stderr
    mb = info["bytes"] / 1e6
    rate = info["records"] / info["seconds"] if info.get("seconds") else 0.0
    line = (f"drain {info['stream']}: {info['records']:,} records in {info['txns']:,} transactions, "
            f"{mb:,.1f} MB read, at LSN {format_lsn(info['lsn'])} ({rate:,.0f} records/s)")
    if "waiting" in info:
        line += (f"; waiting for the walsender: decoded to {format_lsn(info['decoded'])} of "
                 f"{format_lsn(info['target'])}, no data for {info['waiting']:.0f}s")
    print(line, file=out, flush=True)


# -- reading the slot ------------------------------------------------------------------------------

@dataclass
class ReadOutcome:
    segment: SegmentWriter
    upper: int
    changes: int
    bytes_read: int
    reached: bool        # everything committing below the target has arrived (else a segment limit stopped it)


class _Reader:
    """Decode pgoutput from a `WalStream` into an `SegmentWriter`, whole transactions only."""

    def __init__(self, cfg: StreamConfig, stream: WalStream, segment: SegmentWriter,
                 progress: ProgressFn | None = None):
        self.cfg = cfg
        self.ws = stream
        self.seg = segment
        self.progress = progress
        self.codecs: dict[int, RelationCodec] = {}
        self.types: dict[int, Type] = {}
        self._resolver: TypeResolver | None = None
        self._catalog = None
        self._before = (0, 0, 0)          # records, txns, WAL bytes of the run's earlier segments
        self._t0 = time.monotonic()

    def next_segment(self, segment: SegmentWriter, bytes_read: int) -> None:
        """Go on into a new segment (after the previous one landed): the union indexes of the table
        shapes are the new segment's own."""
        self._before = (self._before[0] + self.seg.records, self._before[1] + self.seg.txns,
                        self._before[2] + bytes_read)
        self.seg = segment
        for codec in self.codecs.values():
            codec.branch = None

    def close(self) -> None:
        if self._catalog is not None:
            self._catalog.close()
            self._catalog = None

    # relation messages are rare: the generic decoder and the catalog are fine here
    def _relation(self, payload: bytes) -> None:
        rel = decode_relation(payload)
        resolver = self._resolver
        if resolver is None:
            if all(c.type_oid in BUILTIN_KINDS for c in rel.columns):
                resolver = TypeResolver(None)      # built-in types only: no catalog needed
            else:
                self._catalog = connect_source(self.cfg, application_name="tidemark-drain-catalog")
                resolver = self._resolver = TypeResolver(self._catalog)
        self.codecs[rel.oid] = RelationCodec(table_from_relation(rel, resolver, self.types))

    def _unknown(self, oid: int, lsn: int) -> DecodeError:
        return DecodeError(f"stream {self.cfg.stream}: change for relation OID {oid} at LSN {format_lsn(lsn)} "
                           "before any Relation message for it")

    def read(self, *, lower: int, target: int, exact_upper: bool, max_changes: int | None,
             max_bytes: int | None, idle_timeout: float, stall_timeout: float = 300.0) -> ReadOutcome:
        """Read from ``lower`` until everything committing below ``target`` has arrived (or a limit).

        The drain ends only between transactions: when a commit or a keepalive shows that nothing
        committing below ``target`` is still to come, or at ``max_changes``/``max_bytes``. Silence is
        never a reason to stop: a walsender decoding a huge transaction may send no data for long.
        Whenever nothing is buffered the drain asks for a keepalive (every `PING_SECONDS`), whose
        position shows how far the walsender has decoded; after ``idle_timeout`` seconds without
        data it reports that position (``decoded``, ``target``, ``waiting``). Only when there is no sign of progress at all (no data, no keepalive
        further on) for ``stall_timeout`` seconds does it give up with `DrainStalled`.

        With ``exact_upper`` the segment ends exactly at ``target`` (a re-drain): transactions
        committing at or after it are left out.
        """
        seg = self.seg
        ws = self.ws
        get = ws.pg.get_copy_data
        codecs = self.codecs
        append = seg.append
        counts = seg.counts
        max_changes = max_changes or (1 << 62)
        max_bytes = max_bytes or (1 << 62)
        stream_name = self.cfg.stream

        safe = lower          # every transaction committing below `safe` has been received
        heard = False         # a keepalive or a commit arrived since the start
        in_txn = False
        changes = 0
        nbytes = 0
        # per transaction
        time_enc = xid_enc = ts_full = ts_key = b""
        final_lsn = 0
        pos = 0
        arr: list[bytes] = []       # encoded records of the open array
        arr_n = 0
        txn_changes = 0
        now = time.monotonic()
        last_progress_at = now
        last_ping = 0.0
        last_activity = now   # when the last data or advancing keepalive arrived (set lazily)
        last_data = now       # when data last arrived (seen from the idle branch: nothing in the hot path)
        seen_bytes = 0
        active = False
        last_wal_end = 0
        ts_enc = b""
        done = False

        while not done:
            n, data = get(1)
            if n > 0:
                buf = bytes(data)
                data = None         # libpq's copy of the message freed now, not after it is encoded
                if buf[0] == 0x77:  # 'w' XLogData: header 25 bytes, then one pgoutput message
                    nbytes += n
                    tag = buf[25]
                    if tag == 0x49:  # 'I' insert
                        (oid,) = _U32(buf, 26)
                        codec = codecs.get(oid)
                        if codec is None:
                            raise self._unknown(oid, final_lsn)
                        parts, toast, _ = codec.encode_tuple(buf, 31)
                        branch = codec.branch or self._branch(codec)
                        rec = b"".join((branch, *parts, time_enc, codec.plus, xid_enc, avro_long(pos), ts_full,
                                        codec.toast_array(toast) if toast else b"\x00"))
                        arr += (b"\x01", avro_long(len(rec)), rec)
                        parts = rec = None      # a huge value: held once (in the array), not three times
                        pos += 1
                        arr_n += 1
                        txn_changes += 1
                    elif tag == 0x55:  # 'U' update
                        (oid,) = _U32(buf, 26)
                        codec = codecs.get(oid)
                        if codec is None:
                            raise self._unknown(oid, final_lsn)
                        kind = buf[30]
                        branch = codec.branch or self._branch(codec)
                        if kind == 0x4E:  # 'N': no old tuple, the key did not change
                            parts, toast, _ = codec.encode_tuple(buf, 31)
                            old = codec.key_parts(parts)
                            if toast and any(codec.key_mask[i] for i in toast):
                                raise DecodeError(f"stream {stream_name}: update of {codec.table.qualified} at "
                                                  f"LSN {format_lsn(final_lsn)} has an unchanged TOASTed key column "
                                                  "and no old key: the key is unknown")
                            old_image, old_toast = ts_key, b"\x00"
                        else:  # 'K' old key or 'O' old row, then 'N' new tuple
                            old, otoast, off = codec.encode_tuple(buf, 31)
                            if buf[off] != 0x4E:
                                raise DecodeError(f"stream {stream_name}: malformed update of "
                                                  f"{codec.table.qualified} at LSN {format_lsn(final_lsn)}")
                            parts, toast, _ = codec.encode_tuple(buf, off + 1)
                            old_image = ts_full if kind == 0x4F else ts_key
                            old_toast = codec.toast_array(otoast) if otoast else b"\x00"
                        rec = b"".join((branch, *old, time_enc, codec.minus, xid_enc, avro_long(pos), old_image,
                                        old_toast))
                        rec2 = b"".join((branch, *parts, time_enc, codec.plus, xid_enc, avro_long(pos + 1), ts_full,
                                         codec.toast_array(toast) if toast else b"\x00"))
                        arr += (b"\x01", avro_long(len(rec)), rec, b"\x01", avro_long(len(rec2)), rec2)
                        parts = old = rec = rec2 = None
                        pos += 2
                        arr_n += 2
                        txn_changes += 1
                    elif tag == 0x44:  # 'D' delete
                        (oid,) = _U32(buf, 26)
                        codec = codecs.get(oid)
                        if codec is None:
                            raise self._unknown(oid, final_lsn)
                        kind = buf[30]
                        old, otoast, _ = codec.encode_tuple(buf, 31)
                        branch = codec.branch or self._branch(codec)
                        rec = b"".join((branch, *old, time_enc, codec.minus, xid_enc, avro_long(pos),
                                        ts_full if kind == 0x4F else ts_key,
                                        codec.toast_array(otoast) if otoast else b"\x00"))
                        arr += (b"\x01", avro_long(len(rec)), rec)
                        pos += 1
                        arr_n += 1
                        txn_changes += 1
                    elif tag == 0x42:  # 'B' begin
                        final_lsn, ts, xid = _BEGIN(buf, 26)
                        if exact_upper and final_lsn >= target:
                            done = True      # commits at/after the requested upper: not ours
                            safe = max(safe, target)
                            break
                        if final_lsn < lower:
                            raise DecodeError(f"stream {stream_name}: transaction {xid} commits at "
                                              f"{format_lsn(final_lsn)}, before the drain's start {format_lsn(lower)}")
                        in_txn = True
                        active = True
                        time_enc = avro_long(final_lsn)
                        xid_enc = avro_long(xid)
                        ts_enc = avro_long(ts + PG_EPOCH_US)
                        ts_full, ts_key = ts_enc + b"\x00", ts_enc + b"\x02"
                        pos = 0
                        arr, arr_n, txn_changes = [], 0, 0
                    elif tag == 0x43:  # 'C' commit
                        commit_lsn, end_lsn = _COMMIT_LSNS(buf, 27)
                        if not in_txn or commit_lsn != final_lsn:
                            raise DecodeError(f"stream {stream_name}: Commit at {format_lsn(commit_lsn)} does not "
                                              f"match the open transaction ({format_lsn(final_lsn)})")
                        if arr_n:       # one copy of the array's bytes, its records freed before it is framed
                            datum = b"".join((b"\x00", *arr, b"\x00"))
                            arr.clear()
                            append(datum)
                            datum = None
                        if pos:
                            counts[final_lsn] = counts.get(final_lsn, 0) + pos
                            seg.records += pos
                            seg.txns += 1
                            cts = ts + PG_EPOCH_US
                            seg.min_commit_ts = cts if seg.min_commit_ts is None else min(seg.min_commit_ts, cts)
                            seg.max_commit_ts = cts if seg.max_commit_ts is None else max(seg.max_commit_ts, cts)
                            changes += txn_changes
                        arr, arr_n = [], 0
                        in_txn = False
                        heard = True
                        if end_lsn > safe:
                            safe = end_lsn
                        if safe >= target or changes >= max_changes or nbytes >= max_bytes:
                            if not exact_upper or safe >= target:
                                done = True
                        active = True
                        if self.progress and (now := time.monotonic()) - last_progress_at >= PROGRESS_SECONDS:
                            last_progress_at = now
                            self._report(safe, nbytes)
                        continue
                    elif tag == 0x52:  # 'R' relation
                        self._relation(buf[25:])
                    elif tag == 0x54:  # 'T' truncate
                        ntab = self._truncate(buf, pos, final_lsn, xid_enc, ts_enc, arr, arr_n)
                        arr, arr_n = [], 0
                        pos += ntab
                        txn_changes += ntab
                    elif tag == 0x59:  # 'Y' type
                        t = decode_message(buf[25:])
                        self.types[t.oid] = t
                    elif tag in (0x4F, 0x4D):  # 'O' origin, 'M' logical message: not row changes
                        pass
                    else:
                        raise DecodeError(f"stream {stream_name}: unknown pgoutput message {chr(tag)!r} "
                                          f"after LSN {format_lsn(final_lsn or safe)}")
                    if arr_n >= ARRAY_MAX_RECORDS:
                        datum = b"".join((b"\x00", *arr, b"\x00"))
                        arr.clear()
                        append(datum)
                        datum = None
                        arr, arr_n = [], 0
                        active = True
                elif buf[0] == 0x6B:  # 'k' keepalive
                    wal_end, _, reply = _KEEPALIVE(buf, 1)
                    if not in_txn:
                        heard = True
                        if wal_end > safe:
                            safe = wal_end
                    if wal_end > last_wal_end:
                        last_wal_end = wal_end
                        active = True
                    if reply:
                        ws.send_status()
                else:
                    raise DecodeError(f"stream {stream_name}: unknown replication message {chr(buf[0])!r}")
                continue
            if n < 0:
                why = ws.error_text()
                # a restart, a terminated walsender, a cut connection: the next drain resumes from the
                # slot (retried); an error of the decoding itself (a dropped publication) is not
                lost = not why or re.search(r"terminat|server closed|connection|shut ?down|EOF|lost|timed? ?out|"
                                            r"administrator command|recovery|starting up", why, re.I)
                raise (TransientError if lost else TidemarkError)(
                    f"stream {stream_name}: the server ended replication: {why or '(no message)'}")
            # nothing buffered: are we done, or wait for more
            now = time.monotonic()
            if active:
                last_activity = now
                active = False
            if not in_txn and heard and safe >= target:
                break
            if nbytes != seen_bytes:
                seen_bytes, last_data = nbytes, now
            silent = now - last_activity
            if silent >= stall_timeout:
                raise DrainStalled(self._stalled(lower, target, safe, last_wal_end, in_txn, silent))
            if self.progress and now - last_data >= idle_timeout and now - last_progress_at >= PROGRESS_SECONDS:
                last_progress_at = now
                self._report(safe, nbytes, decoded=last_wal_end, target=target,
                             waiting=now - last_data)
            if now - last_ping >= PING_SECONDS:
                ws.send_status(reply=True)
                last_ping = now
            ws.wait(PING_SECONDS)
        upper = target if exact_upper else safe
        if self.progress:
            self._report(upper, nbytes)
        return ReadOutcome(segment=seg, upper=upper, changes=changes, bytes_read=nbytes,
                           reached=exact_upper or safe >= target)

    def _branch(self, codec: RelationCodec) -> bytes:
        codec.branch = self.seg.branch(codec.table)
        return codec.branch

    def _truncate(self, buf: bytes, pos: int, time_lsn: int, xid_enc: bytes, ts_enc: bytes,
                  arr: list[bytes], arr_n: int) -> int:
        """Close the open array and append one event datum per truncated table; return how many."""
        msg = decode_message(buf[25:])
        if arr_n:
            datum = b"".join((b"\x00", *arr, b"\x00"))
            arr.clear()
            self.seg.append(datum)
            del datum
        detail = avro_string(json.dumps({"cascade": msg.cascade, "restart_identity": msg.restart_identity},
                                        sort_keys=True))
        for i, oid in enumerate(msg.oids):
            codec = self.codecs.get(oid)
            if codec is None:
                raise self._unknown(oid, time_lsn)
            self.seg.append(b"\x04" + avro_string("truncate") + codec.qualified_enc + avro_long(time_lsn)
                              + xid_enc + avro_long(pos + i) + ts_enc + detail)
        return len(msg.oids)

    def _report(self, lsn: int, nbytes: int, **waiting) -> None:
        """Progress of the whole run (its earlier segments included)."""
        records, txns, before = self._before
        self.progress({"stream": self.cfg.stream, "records": records + self.seg.records,
                       "txns": txns + self.seg.txns, "bytes": before + nbytes, "lsn": lsn,
                       "seconds": time.monotonic() - self._t0, **waiting})

    def _stalled(self, lower: int, target: int, safe: int, decoded: int, in_txn: bool, silent: float) -> str:
        """Why a drain gives up: where it stands, and what the walsender is doing (pg_stat_activity)."""
        state = ""
        try:
            conn = connect_source(self.cfg, application_name="tidemark-drain-check")
            try:
                with conn.cursor() as cur:
                    cur.execute("""SELECT state, wait_event_type, wait_event FROM pg_stat_activity
                                    WHERE pid = %s""", (self.ws.backend_pid,))
                    row = cur.fetchone()
                state = (f"; walsender pid {self.ws.backend_pid}: " +
                         (f"state={row[0]} wait_event={row[1]}/{row[2]}" if row else "gone"))
            finally:
                conn.close()
        except Exception as exc:  # the message must still be given
            state = f"; the walsender's state could not be read: {exc}"
        where = "inside a transaction" if in_txn else "between transactions"
        return (f"stream {self.cfg.stream}: the drain from {format_lsn(lower)} to {format_lsn(target)} made no "
                f"progress for {silent:.0f}s (no data and no keepalive past {format_lsn(decoded)}; stopped "
                f"{where}, whole transactions received up to {format_lsn(safe)}); nothing was landed and the "
                f"slot still holds everything from {format_lsn(lower)}{state}. Raise drain.stall_timeout_seconds "
                "if the source is only slow")


# -- landing ---------------------------------------------------------------------------------------

def _ack_position(cfg: StreamConfig, frontier: int | None, landed: int | None) -> int | None:
    """The furthest position the slot may be confirmed to under the stream's ack policy."""
    return landed if cfg.drain.ack_policy == "landed" else frontier


def _land(cfg: StreamConfig, ctl: Control, seg: SegmentWriter, upper: int, origin: str,
          lease=None) -> DrainResult:
    """Write the segment atomically, then register it. Nothing is written for an empty interval."""
    if upper == seg.lower:
        return DrainResult(cfg.stream, seg.seq, seg.lower, upper, 0, 0, None, 0, False, True)
    store = landing_store(cfg)
    key = stream_keys(cfg.stream)["segments"] + segment_name(seg.seq, seg.lower, upper)
    uri, _, size, digest = put_stream_if_absent(store, key, lambda fh: seg.write(fh, upper))
    if lease is not None:
        lease.confirm("register segment " + str(seg.seq))
    registered = ctl.register_segment(Segment(
        stream=cfg.stream, seq=seg.seq, lower=seg.lower, upper=upper, uri=uri, record_count=seg.records,
        txn_count=seg.txns, byte_size=size, checksum=digest, status="landed", origin=origin,
        min_commit_ts=seg.min_commit_ts, max_commit_ts=seg.max_commit_ts))
    return DrainResult(cfg.stream, seg.seq, seg.lower, upper, seg.records, seg.txns, uri, size, registered,
                       seg.records == 0)


def _read_segment_from_slot(cfg: StreamConfig, ctl: Control, *, seq: int, lower: int, target: int | None,
                            exact_upper: bool, max_changes: int | None, max_bytes: int | None,
                            progress: ProgressFn | None, origin: str,
                            extra_options: str = "", lease=None) -> DrainResult:
    """Read from ``lower`` up to ``target`` (the server's position at the start when None) and land
    it in as many segments as the limits make, each registered as it lands."""
    state = ctl.stream(cfg.stream)
    conn = connect_source(cfg, application_name="tidemark-drain-check")
    try:
        info = require_slot(cfg, covers=lower, conn=conn)
        check_publication(cfg, conn)        # a publication altered since `stream apply` would drop changes
    finally:
        conn.close()
    ack = _ack_position(cfg, state.frontier, state.landed_upper)
    ws = WalStream(source_dsn(cfg), extra_options=extra_options)
    reader = None
    landed: list[DrainResult] = []
    try:
        if target is None:
            target = ws.identify()
        # never move the slot backwards, nor past the policy
        confirmed = info.confirmed_flush_lsn or 0
        ws.ack = ack if ack is not None and ack > confirmed else 0
        ws.start(cfg.source.slot, lower, cfg.source.publication)
        seg = SegmentWriter(cfg.stream, seq, lower, codec=cfg.landing.codec)
        reader = _Reader(cfg, ws, seg, progress)
        while True:
            outcome = reader.read(lower=seg.lower, target=target, exact_upper=exact_upper,
                                  max_changes=max_changes, max_bytes=max_bytes,
                                  idle_timeout=cfg.drain.idle_timeout_seconds,
                                  stall_timeout=cfg.drain.stall_timeout_seconds)
            with _alive(ws):                # an upload may outlast the walsender's wal_sender_timeout
                landed_seg = _land(cfg, ctl, seg, outcome.upper, origin, lease)
            result = dataclasses.replace(landed_seg, changes=outcome.changes)
            landed.append(result)
            if cfg.drain.ack_policy == "landed" and result.registered and not exact_upper:
                if lease is not None:
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
        try:
            ws.send_status()
            while not stop.wait(ALIVE_SECONDS):
                ws.send_status()
        except Exception:  # noqa: BLE001 - the connection is gone: the next read on it says so
            return

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
    seconds; the run's totals) about once a second; `print_progress` prints it. Raises `StreamBusy` if
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
            result = _read_segment_from_slot(cfg, ctl, seq=state.next_seq, lower=state.landed_upper, target=None,
                                             exact_upper=False, max_changes=max_changes, max_bytes=max_bytes,
                                             progress=progress, origin="drain", extra_options=extra_options,
                                             lease=lease)
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


def redrain_range(cfg: StreamConfig, *, seq: int, lower: int, upper: int, origin: str = "repair",
                  progress: ProgressFn | None = None, extra_options: str = "") -> DrainResult:
    """Re-read exactly ``[lower, upper)`` from the slot and land it as the one segment ``seq``.

    Produces the same bytes as the drain that first wrote that range (an existing file with other
    bytes is an error). Raises `SlotLost` if the slot no longer reaches ``lower``.
    """
    if upper <= lower:
        raise TidemarkError(f"stream {cfg.stream}: cannot re-drain the empty range [{format_lsn(lower)}, {format_lsn(upper)})")
    with _connection_errors_named(cfg), open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, "drain") as lease:
        return _read_segment_from_slot(cfg, ctl, seq=seq, lower=lower, target=upper, exact_upper=True,
                                       max_changes=None, max_bytes=None, progress=progress, origin=origin,
                                       extra_options=extra_options, lease=lease)


__all__ = ["DrainResult", "drain_stream", "redrain_range", "print_progress", "WalStream"]
