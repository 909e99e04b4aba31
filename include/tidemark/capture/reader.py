"""Reading the slot: decode pgoutput from a `WalStream` into a `SegmentWriter`, whole transactions only.
`SlotReader._decode` is the drain's hot loop (its shape: docs/internals/capture.md);
`tidemark.capture.drain` lands what is read."""

from __future__ import annotations

import json
import re
import struct
import time
from contextlib import closing
from dataclasses import dataclass
from typing import Callable

from tidemark.capture.pgoutput import (_BEGIN, _U32, PG_EPOCH_US, RelationCodec, Type, avro_long, avro_string,
                                       decode_message, decode_relation, table_from_relation)
from tidemark.capture.replication import WalStream
from tidemark.capture.source import connect_source
from tidemark.config import StreamConfig
from tidemark.errors import DecodeError, DrainStalled, TidemarkError, TransientError
from tidemark.landing.segments import ARRAY_MAX_RECORDS, SegmentWriter
from tidemark.lsn import format_lsn
from tidemark.pgtypes import BUILTIN_KINDS, TypeResolver

ProgressFn = Callable[[dict], None]

PING_SECONDS = 0.2             # how often an idle drain asks the walsender for a keepalive
PROGRESS_SECONDS = 1.0

_KEEPALIVE = struct.Struct(">QqB").unpack_from    # 'k': wal_end, send_time, reply_requested
_COMMIT_LSNS = struct.Struct(">QQ").unpack_from   # 'C' after its flags: commit_lsn, end_lsn


@dataclass
class ReadOutcome:
    upper: int
    changes: int
    bytes_read: int
    reached: bool        # everything committing below the target has arrived (else a segment limit stopped it)


@dataclass(slots=True)
class _Read:
    """Where one `SlotReader.read` stands between transactions (`SlotReader._decode` keeps what changes
    per message in locals), and the clock of its waits."""

    lower: int
    target: int
    begin_limit: int          # a re-drain ends at its upper exactly (a transaction committing there is not ours)
    max_changes: int
    max_bytes: int
    idle_timeout: float
    stall_timeout: float
    safe: int = 0             # every transaction committing below `safe` has been received
    heard: bool = False       # a keepalive or a commit arrived since the start
    in_txn: bool = False
    active: bool = False      # a sign of progress since the last wait (data, a commit, a keepalive further on)
    changes: int = 0
    last_wal_end: int = 0     # the furthest keepalive position: how far the walsender has decoded
    last_activity: float = 0.0
    last_data: float = 0.0    # when data last arrived (seen from the waits: nothing in the hot path)
    seen_bytes: int = 0
    last_progress_at: float = 0.0
    last_ping: float = 0.0


class SlotReader:
    """Decode pgoutput from a `WalStream` into a `SegmentWriter`, whole transactions only."""

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

    def read(self, *, lower: int, target: int, exact_upper: bool, max_changes: int | None,
             max_bytes: int | None, idle_timeout: float, stall_timeout: float = 300.0) -> ReadOutcome:
        """Read from ``lower`` until everything committing below ``target`` has arrived (or a limit).

        The read ends only between transactions: when a commit or a keepalive shows that nothing
        committing below ``target`` is still to come, or at ``max_changes``/``max_bytes``; never on
        silence. Whenever nothing is buffered it asks for a keepalive (every `PING_SECONDS`); after
        ``idle_timeout`` seconds without data it reports the decoded position (``decoded``, ``target``,
        ``waiting``); after ``stall_timeout`` seconds without any sign of progress it raises
        `DrainStalled`. With ``exact_upper`` the segment ends exactly at ``target`` (a re-drain):
        transactions committing at or after it are left out.
        """
        now = time.monotonic()
        begin_limit, max_changes, max_bytes = (target, None, None) if exact_upper else (1 << 64, max_changes, max_bytes)
        run = _Read(lower, target, begin_limit, max_changes or (1 << 62), max_bytes or (1 << 62), idle_timeout,
                    stall_timeout, safe=lower, last_activity=now, last_data=now, last_progress_at=now)
        nbytes = self._decode(run)
        upper = target if exact_upper else run.safe
        if self.progress:
            self._report(upper, nbytes)
        return ReadOutcome(upper=upper, changes=run.changes, bytes_read=nbytes,
                           reached=exact_upper or run.safe >= target)

    def _decode(self, run: _Read) -> int:
        """The hot loop: decode and encode messages until the read is done; return the WAL bytes read.
        What changes per message is in locals here; what changes per transaction or rarer is in ``run``."""
        codecs, get, lower, begin_limit = self.codecs, self.ws.pg.get_copy_data, run.lower, run.begin_limit
        nbytes = 0
        time_enc = xid_enc = ts_enc = ts_full = ts_key = b""      # the open transaction's
        final_lsn = ts = pos = arr_n = txn_changes = 0
        arr: list[bytes] = []       # encoded records of the open array
        while True:
            n, data = get(1)
            if n <= 0:      # nothing buffered, or the end of the stream
                if self._idle(run, n, nbytes):
                    return nbytes
                continue
            buf = bytes(data)
            data = None         # libpq's copy of the message freed now, not after it is encoded
            if buf[0] != 0x77:  # not 'w' XLogData: a keepalive
                self._keepalive(run, buf)
                continue
            nbytes += n         # 'w' XLogData: header 25 bytes, then one pgoutput message
            tag = buf[25]
            if tag == 0x49:  # 'I' insert
                codec = codecs.get(_U32(buf, 26)[0]) or self._unknown(_U32(buf, 26)[0], final_lsn)
                parts, toast, _ = codec.encode_tuple(buf, 31)
                branch = codec.branch or self._branch(codec)
                rec = b"".join((branch, *parts, time_enc, codec.plus, xid_enc, avro_long(pos), ts_full,
                                codec.toast_array(toast) if toast else b"\x00"))
                arr += (b"\x01", avro_long(len(rec)), rec)
                parts = rec = None      # a huge value: held once (in the array), not three times
                pos, arr_n, txn_changes = pos + 1, arr_n + 1, txn_changes + 1
            elif tag == 0x55:  # 'U' update
                codec = codecs.get(_U32(buf, 26)[0]) or self._unknown(_U32(buf, 26)[0], final_lsn)
                kind = buf[30]
                branch = codec.branch or self._branch(codec)
                if kind == 0x4E:  # 'N': no old tuple, the key did not change
                    parts, toast, _ = codec.encode_tuple(buf, 31)
                    old = codec.key_parts(parts)
                    if toast and any(codec.key_mask[i] for i in toast):
                        raise self._bad_update(codec, final_lsn, toasted_key=True)
                    old_image, old_toast = ts_key, b"\x00"
                else:  # 'K' old key or 'O' old row, then 'N' new tuple
                    old, otoast, off = codec.encode_tuple(buf, 31)
                    if buf[off] != 0x4E:
                        raise self._bad_update(codec, final_lsn, toasted_key=False)
                    parts, toast, _ = codec.encode_tuple(buf, off + 1)
                    if toast and kind == 0x4B:   # a key stored out of line: sent whole in the old key only
                        toast = codec.key_from_old(parts, toast, old)
                    old_image = ts_full if kind == 0x4F else ts_key
                    old_toast = codec.toast_array(otoast) if otoast else b"\x00"
                rec = b"".join((branch, *old, time_enc, codec.minus, xid_enc, avro_long(pos), old_image,
                                old_toast))
                rec2 = b"".join((branch, *parts, time_enc, codec.plus, xid_enc, avro_long(pos + 1), ts_full,
                                 codec.toast_array(toast) if toast else b"\x00"))
                arr += (b"\x01", avro_long(len(rec)), rec, b"\x01", avro_long(len(rec2)), rec2)
                parts = old = rec = rec2 = None
                pos, arr_n, txn_changes = pos + 2, arr_n + 2, txn_changes + 1
            elif tag == 0x44:  # 'D' delete
                codec = codecs.get(_U32(buf, 26)[0]) or self._unknown(_U32(buf, 26)[0], final_lsn)
                kind = buf[30]
                old, otoast, _ = codec.encode_tuple(buf, 31)
                branch = codec.branch or self._branch(codec)
                rec = b"".join((branch, *old, time_enc, codec.minus, xid_enc, avro_long(pos),
                                ts_full if kind == 0x4F else ts_key,
                                codec.toast_array(otoast) if otoast else b"\x00"))
                arr += (b"\x01", avro_long(len(rec)), rec)
                pos, arr_n, txn_changes = pos + 1, arr_n + 1, txn_changes + 1
            elif tag == 0x42:  # 'B' begin
                final_lsn, ts, xid = _BEGIN(buf, 26)
                if final_lsn >= begin_limit or final_lsn < lower:
                    self._outside(run, final_lsn, xid)
                    return nbytes
                run.in_txn = run.active = True
                time_enc, xid_enc, ts_enc = avro_long(final_lsn), avro_long(xid), avro_long(ts + PG_EPOCH_US)
                ts_full, ts_key = ts_enc + b"\x00", ts_enc + b"\x02"
                pos = arr_n = txn_changes = 0
                arr = []
            elif tag == 0x43:  # 'C' commit
                if self._commit(run, buf, final_lsn, ts, pos, arr, arr_n, txn_changes, nbytes):
                    return nbytes
                arr, arr_n = [], 0
                continue
            elif tag == 0x54:  # 'T' truncate
                ntab = self._truncate(buf, pos, final_lsn, xid_enc, ts_enc, arr, arr_n)
                arr, arr_n, pos, txn_changes = [], 0, pos + ntab, txn_changes + ntab
            else:
                self._other(tag, buf, final_lsn or run.safe)
            if arr_n >= ARRAY_MAX_RECORDS:
                self._flush(arr)
                arr, arr_n, run.active = [], 0, True

    def _commit(self, run: _Read, buf: bytes, final_lsn: int, ts: int, records: int, arr: list[bytes], arr_n: int,
                changes: int, nbytes: int) -> bool:
        """A Commit: the open transaction's last array and its counts into the segment; whether the read is
        done (everything committing below the target has arrived, or a limit is reached)."""
        commit_lsn, end_lsn = _COMMIT_LSNS(buf, 27)
        if not run.in_txn or commit_lsn != final_lsn:
            raise DecodeError(f"stream {self.cfg.stream}: Commit at {format_lsn(commit_lsn)} does "
                              f"not match the open transaction ({format_lsn(final_lsn)})")
        seg = self.seg
        if arr_n:
            self._flush(arr)
        if records:
            seg.counts[final_lsn] = seg.counts.get(final_lsn, 0) + records
            seg.records += records
            seg.txns += 1
            cts = ts + PG_EPOCH_US
            seg.min_commit_ts = cts if seg.min_commit_ts is None else min(seg.min_commit_ts, cts)
            seg.max_commit_ts = cts if seg.max_commit_ts is None else max(seg.max_commit_ts, cts)
            run.changes += changes
        run.in_txn, run.heard, run.active = False, True, True
        if end_lsn > run.safe:
            run.safe = end_lsn
        if self.progress and (now := time.monotonic()) - run.last_progress_at >= PROGRESS_SECONDS:
            run.last_progress_at = now
            self._report(run.safe, nbytes)
        return run.safe >= run.target or run.changes >= run.max_changes or nbytes >= run.max_bytes

    def _outside(self, run: _Read, final_lsn: int, xid: int) -> None:
        """A Begin the read must not take: at or after a re-drain's upper, the end; before the start, an error."""
        if final_lsn >= run.begin_limit:
            run.safe = max(run.safe, run.target)
            return
        raise DecodeError(f"stream {self.cfg.stream}: transaction {xid} commits at "
                          f"{format_lsn(final_lsn)}, before the drain's start {format_lsn(run.lower)}")

    # -- rare messages -------------------------------------------------------------------------

    def _flush(self, arr: list[bytes]) -> None:
        """Append the open array: one copy of its bytes, its records freed before it is framed."""
        datum = b"".join((b"\x00", *arr, b"\x00"))
        arr.clear()
        self.seg.append(datum)

    def _unknown(self, oid: int, lsn: int) -> RelationCodec:
        raise DecodeError(f"stream {self.cfg.stream}: change for relation OID {oid} at LSN {format_lsn(lsn)} "
                          "before any Relation message for it")

    def _branch(self, codec: RelationCodec) -> bytes:
        codec.branch = self.seg.branch(codec.table)
        return codec.branch

    def _bad_update(self, codec: RelationCodec, lsn: int, *, toasted_key: bool) -> DecodeError:
        update = f"update of {codec.table.qualified} at LSN {format_lsn(lsn)}"
        return DecodeError(f"stream {self.cfg.stream}: " + (f"{update} has an unchanged TOASTed key column and no "
                                                            "old key: the key is unknown" if toasted_key else
                                                            f"malformed {update}"))

    def _truncate(self, buf: bytes, pos: int, time_lsn: int, xid_enc: bytes, ts_enc: bytes,
                  arr: list[bytes], arr_n: int) -> int:
        """Close the open array and append one event datum per truncated table; return how many."""
        msg = decode_message(buf[25:])
        if arr_n:
            self._flush(arr)
        detail = avro_string(json.dumps({"cascade": msg.cascade, "restart_identity": msg.restart_identity},
                                        sort_keys=True))
        for i, oid in enumerate(msg.oids):
            codec = self.codecs.get(oid) or self._unknown(oid, time_lsn)
            self.seg.append(b"\x04" + avro_string("truncate") + codec.qualified_enc + avro_long(time_lsn)
                            + xid_enc + avro_long(pos + i) + ts_enc + detail)
        return len(msg.oids)

    def _other(self, tag: int, buf: bytes, lsn: int) -> None:
        """Relation and Type messages (rare: the generic decoder and the catalog are fine here);
        Origin and logical messages are not row changes."""
        if tag == 0x52:  # 'R' relation
            rel = decode_relation(buf[25:])
            resolver = self._resolver
            if resolver is None:
                if all(c.type_oid in BUILTIN_KINDS for c in rel.columns):
                    resolver = TypeResolver(None)      # built-in types only: no catalog needed
                else:
                    self._catalog = connect_source(self.cfg, application_name="tidemark-drain-catalog")
                    resolver = self._resolver = TypeResolver(self._catalog)
            self.codecs[rel.oid] = RelationCodec(table_from_relation(rel, resolver, self.types))
        elif tag == 0x59:  # 'Y' type
            t = decode_message(buf[25:])
            self.types[t.oid] = t
        elif tag not in (0x4F, 0x4D):  # 'O' origin, 'M' logical message
            raise DecodeError(f"stream {self.cfg.stream}: unknown pgoutput message {chr(tag)!r} "
                              f"after LSN {format_lsn(lsn)}")

    def _keepalive(self, run: _Read, buf: bytes) -> None:
        """A keepalive (no other message is sent): how far the walsender has decoded (safe between transactions)."""
        if buf[0] != 0x6B:  # 'k'
            raise DecodeError(f"stream {self.cfg.stream}: unknown replication message {chr(buf[0])!r}")
        wal_end, _, reply = _KEEPALIVE(buf, 1)
        if not run.in_txn:
            run.heard, run.safe = True, max(run.safe, wal_end)
        if wal_end > run.last_wal_end:
            run.last_wal_end, run.active = wal_end, True
        if reply:
            self.ws.send_status()

    def _ended(self) -> TidemarkError:
        """The server ended the stream: a restart, a terminated walsender, a cut connection is transient
        (the next drain resumes from the slot); an error of the decoding itself (a dropped publication)
        is not."""
        why = self.ws.error_text()
        lost = not why or re.search(r"terminat|server closed|connection|shut ?down|EOF|lost|timed? ?out|"
                                    r"administrator command|recovery|starting up", why, re.I)
        return (TransientError if lost else TidemarkError)(
            f"stream {self.cfg.stream}: the server ended replication: {why or '(no message)'}")

    # -- once per wait -------------------------------------------------------------------------

    def _idle(self, run: _Read, n: int, nbytes: int) -> bool:
        """Nothing buffered (``n`` 0; -1: the server ended the stream, `_ended`): whether the read is
        done; else report progress, ask for a keepalive and wait for more (`DrainStalled` after no sign
        of progress for the stall timeout)."""
        if n < 0:
            raise self._ended()
        now = time.monotonic()
        if run.active:
            run.last_activity = now
        if not run.in_txn and run.heard and run.safe >= run.target:
            return True
        if nbytes != run.seen_bytes:
            run.seen_bytes, run.last_data = nbytes, now
        silent = now - run.last_activity
        if silent >= run.stall_timeout:
            raise DrainStalled(self._stalled(run, silent))
        if self.progress and now - run.last_data >= run.idle_timeout and now - run.last_progress_at >= PROGRESS_SECONDS:
            run.last_progress_at = now
            self._report(run.safe, nbytes, decoded=run.last_wal_end, target=run.target, waiting=now - run.last_data)
        if now - run.last_ping >= PING_SECONDS:
            self.ws.send_status(reply=True)
            run.last_ping = now
        self.ws.wait(PING_SECONDS)
        run.active = False
        return False

    def _report(self, lsn: int, nbytes: int, **waiting) -> None:
        """Progress of the whole run (its earlier segments included)."""
        records, txns, before = self._before
        self.progress({"stream": self.cfg.stream, "records": records + self.seg.records,
                       "txns": txns + self.seg.txns, "bytes": before + nbytes, "lsn": lsn,
                       "seconds": time.monotonic() - self._t0, **waiting})

    def _stalled(self, run: _Read, silent: float) -> str:
        """Why a drain gives up: where it stands, and what the walsender is doing (pg_stat_activity)."""
        try:
            with closing(connect_source(self.cfg, application_name="tidemark-drain-check")) as conn, \
                    conn.cursor() as cur:
                cur.execute("""SELECT state, wait_event_type, wait_event FROM pg_stat_activity
                                WHERE pid = %s""", (self.ws.backend_pid,))
                row = cur.fetchone()
            state = (f"; walsender pid {self.ws.backend_pid}: " +
                     (f"state={row[0]} wait_event={row[1]}/{row[2]}" if row else "gone"))
        except Exception as exc:  # the message must still be given
            state = f"; the walsender's state could not be read: {exc}"
        where = "inside a transaction" if run.in_txn else "between transactions"
        return (f"stream {self.cfg.stream}: the drain from {format_lsn(run.lower)} to {format_lsn(run.target)} "
                f"made no progress for {silent:.0f}s (no data and no keepalive past {format_lsn(run.last_wal_end)}; "
                f"stopped {where}, whole transactions received up to {format_lsn(run.safe)}); nothing was landed "
                f"and the slot still holds everything from {format_lsn(run.lower)}{state}. Raise "
                "drain.stall_timeout_seconds if the source is only slow")
