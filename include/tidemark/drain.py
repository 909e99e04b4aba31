"""The slot drain: read whole transactions from the stream's replication slot and land them as a segment.

One drain = one segment ``[lower, upper)``:

* ``lower`` is the stream's landed upper; replication starts there (``START_REPLICATION ... LOGICAL
  lower``: PostgreSQL skips every transaction that commits before it, whatever the slot's
  confirmed position).
* the drain reads until everything that committed before it started (the server's WAL insert
  position taken at the start) has arrived, or until ``max_changes`` / ``max_bytes`` is reached, and always stops *between*
  transactions. ``upper`` is then a position no later transaction can commit below: the end LSN of
  the last transaction read, or the walsender's keepalive position when it is idle (an idle stream
  thus moves forward with a progress-only segment).
* the segment is written atomically to the landing store (``put_if_absent``), THEN registered in the
  manifest. Its bytes are a function of the range, so `redrain_range` writes the same file again.
* the slot is acknowledged only up to what the stream's ``drain.ack_policy`` allows: ``frontier``
  (default: the consolidated frontier; none while it is NULL) or ``landed`` (the landed upper).

The replication protocol is spoken through libpq directly (psycopg 3's ``pq`` layer) rather than
psycopg2's ``LogicalReplicationConnection``: psycopg2 moves its reported flush position forward to a
keepalive's WAL end on its own (confirming the slot past what was landed, let alone consolidated),
and it costs a Python object per message. Here every status message is ours: its flush position is
the policy's position or 0 ("no change").

Records are encoded to Avro as they are decoded (`tidemark.pgoutput.RelationCodec`) and the object
container file is assembled here in the format `tidemark.segments` defines (`read_segment` reads it).
"""

from __future__ import annotations

import hashlib
import json
import select
import struct
import sys
import time
from dataclasses import dataclass
from typing import Callable

from psycopg import pq
from psycopg.conninfo import make_conninfo

from tidemark.config import StreamConfig
from tidemark.control import Control, Segment
from tidemark.errors import DecodeError, SegmentError, StreamBusy, TidemarkError
from tidemark.pgoutput import (
    PG_EPOCH_US,
    PROTO_VERSION,
    RelationCodec,
    Type,
    avro_bytes,
    avro_long,
    avro_string,
    decode_message,
    decode_relation,
    lsn_str,
    table_from_relation,
)
from tidemark.pgtypes import BUILTIN_KINDS, TableSchema, TypeResolver, session_options
from tidemark.segments import FORMAT_VERSION, checksum, segment_name, segment_schema
from tidemark.source import connect_source, open_control, require_slot, source_dsn
from tidemark.store import open_store, put_if_absent, stream_keys

ProgressFn = Callable[[dict], None]

ARRAY_MAX_RECORDS = 10_000     # a transaction larger than this is written as consecutive arrays
BLOCK_BYTES = 1 << 20          # Avro container block size (datums are never split)
PING_SECONDS = 0.2             # how often an idle drain asks the walsender for a keepalive
PROGRESS_SECONDS = 1.0

_HDR = struct.Struct(">QQq").unpack_from          # 'w': data_start, wal_end, send_time
_KEEPALIVE = struct.Struct(">QqB").unpack_from    # 'k': wal_end, send_time, reply_requested
_STATUS = struct.Struct(">cQQQqB").pack          # 'r': write, flush, apply, now, reply
_BEGIN = struct.Struct(">QqI").unpack_from
_COMMIT_LSNS = struct.Struct(">QQ").unpack_from
_U32 = struct.Struct(">I").unpack_from
_I32 = struct.Struct(">i").unpack_from


@dataclass(frozen=True)
class DrainResult:
    """What one drain (or re-drain) did. ``empty`` = no records (a progress-only segment, or
    nothing at all when ``upper == lower``: then nothing is written and ``uri`` is None)."""

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


def print_progress(info: dict, *, file=None) -> None:
    """Print one progress line of a drain (use as the ``progress`` callback)."""
    out = file or sys.stderr
    mb = info["bytes"] / 1e6
    rate = info["records"] / info["seconds"] if info.get("seconds") else 0.0
    print(f"drain {info['stream']}: {info['records']:,} records in {info['txns']:,} transactions, "
          f"{mb:,.1f} MB read, at LSN {lsn_str(info['lsn'])} ({rate:,.0f} records/s)", file=out, flush=True)


# -- the replication connection ----------------------------------------------------------------------

def _parse_lsn(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class WalStream:
    """A logical replication connection (libpq through psycopg's ``pq``) that never confirms more than
    it is told to: every status message carries ``ack`` (or 0 = no change) as its flush position."""

    def __init__(self, dsn: str, *, application_name: str = "tidemark-drain", extra_options: str = ""):
        options = (session_options() + " " + extra_options).strip()
        conninfo = make_conninfo(dsn, replication="database", application_name=application_name,
                                 options=options, client_encoding="UTF8")
        self.pg = pq.PGconn.connect(conninfo.encode())
        if self.pg.status != pq.ConnStatus.OK:
            msg = self.pg.get_error_message().decode(errors="replace").strip()
            self.pg.finish()
            raise TidemarkError(f"cannot open a replication connection to the source: {msg}")
        self.ack = 0
        self.streaming = False

    def identify(self) -> int:
        """The end of the server's WAL now: every transaction committed before this call is below it.

        That is the insert position rather than IDENTIFY_SYSTEM's flush position, so that transactions
        committed with ``synchronous_commit = off`` (not flushed yet) are waited for too; the walsender
        decodes them as soon as the WAL writer flushes them (bounded by the drain's idle timeout).
        """
        res = self.pg.exec_(b"IDENTIFY_SYSTEM")
        if res.status != pq.ExecStatus.TUPLES_OK:
            raise TidemarkError(f"IDENTIFY_SYSTEM failed: {self._error(res)}")
        flushed = _parse_lsn(res.get_value(0, 2).decode())
        res = self.pg.exec_(b"SELECT pg_current_wal_insert_lsn()::text")
        if res.status != pq.ExecStatus.TUPLES_OK:   # e.g. a standby: its replay position is the end
            return flushed
        return max(flushed, _parse_lsn(res.get_value(0, 0).decode()))

    def start(self, slot: str, lsn: int, publication: str) -> None:
        """START_REPLICATION of the slot at ``lsn`` with pgoutput protocol version 1."""
        pub = _quote_ident(publication).replace("'", "''")
        cmd = (f"START_REPLICATION SLOT {_quote_ident(slot)} LOGICAL {lsn_str(lsn)} "
               f"(proto_version '{PROTO_VERSION}', publication_names '{pub}')")
        self.pg.send_query(cmd.encode())
        res = self.pg.get_result()
        if res is None or res.status != pq.ExecStatus.COPY_BOTH:
            msg = self._error(res)
            if "is active for PID" in msg:
                raise StreamBusy(f"replication slot {slot} is in use by another process: {msg}")
            raise TidemarkError(f"START_REPLICATION of slot {slot} at {lsn_str(lsn)} failed: {msg}")
        self.pg.nonblocking = 1
        self.streaming = True

    def _error(self, res) -> str:
        text = res.error_message if res is not None else b""
        return (text or self.pg.get_error_message()).decode(errors="replace").strip()

    def send_status(self, *, reply: bool = False) -> None:
        """Send a standby status update: write = flush = apply = ``self.ack`` (0 = no change)."""
        now = int(time.time() * 1_000_000) - PG_EPOCH_US
        msg = _STATUS(b"r", self.ack, self.ack, self.ack, now, 1 if reply else 0)
        if self.pg.put_copy_data(msg) != 1:
            raise TidemarkError(f"cannot send a status update: {self.pg.get_error_message().decode(errors='replace')}")
        self._flush()

    def _flush(self) -> None:
        while self.pg.flush() == 1:
            select.select([], [self.pg.socket], [], 1.0)

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for data, then pull it into libpq's buffer."""
        select.select([self.pg.socket], [], [], timeout)
        try:
            self.pg.consume_input()
        except Exception as exc:
            raise TidemarkError(f"replication connection lost: {exc}") from exc

    def close(self, timeout: float = 10.0) -> None:
        """End replication cleanly (so the slot is released when this returns), then disconnect."""
        if self.pg.status == pq.ConnStatus.OK and self.streaming:
            try:
                self._end_copy(time.monotonic() + timeout)
            except Exception:  # closing anyway: the server ends the walsender on disconnect
                pass
        self.pg.finish()

    def _end_copy(self, deadline: float) -> None:
        """Send CopyDone, discard what the walsender still sends, wait for the command to finish."""
        self.pg.put_copy_end()
        self._flush()
        while time.monotonic() < deadline:
            n, _ = self.pg.get_copy_data(1)
            if n == -1:
                break
            if n == 0:
                self.wait(0.2)
            elif n < -1:
                return
        while time.monotonic() < deadline:
            self.pg.consume_input()
            if self.pg.is_busy():
                select.select([self.pg.socket], [], [], 0.2)
                continue
            if self.pg.get_result() is None:
                self.streaming = False
                return


# -- segment assembly ------------------------------------------------------------------------------

class EncodedSegment:
    """A segment's records, already Avro-encoded datums (whole transactions), and its table shapes."""

    def __init__(self, stream: str, seq: int, lower: int):
        self.stream = stream
        self.seq = seq
        self.lower = lower
        self.tables: list[TableSchema] = []
        self._branches: dict[str, bytes] = {}
        self.datums: list[bytes] = []
        self.counts: dict[int, int] = {}
        self.records = 0
        self.txns = 0
        self.min_commit_ts: int | None = None    # commit-time bounds of its transactions (µs, UTC)
        self.max_commit_ts: int | None = None

    def branch(self, table: TableSchema) -> bytes:
        """The encoded union index of ``table``'s record in this segment (registered on first use)."""
        name = table.record_name
        b = self._branches.get(name)
        if b is None:
            b = avro_long(len(self.tables))
            self._branches[name] = b
            self.tables.append(table)
        return b

    def build(self, upper: int) -> bytes:
        """The segment file's bytes for ``[lower, upper)`` (deterministic)."""
        name = segment_name(self.seq, self.lower, upper)
        if upper < self.lower:
            raise SegmentError(name, f"upper {upper} < lower {self.lower}")
        for t in self.counts:
            if not (self.lower <= t < upper):
                raise SegmentError(name, f"record at time {t} is outside [{self.lower}, {upper})")
        counts = sorted(self.counts.items())
        progress = (b"\x02" + b"\x02" + avro_long(self.lower) + b"\x00" + b"\x02" + avro_long(upper) + b"\x00"
                    + (avro_long(len(counts)) + b"".join(avro_long(t) + avro_long(c) for t, c in counts) + b"\x00"
                       if counts else b"\x00"))
        metadata = {
            "avro.schema": json.dumps(segment_schema(self.tables), separators=(",", ":")).encode(),
            "avro.codec": b"null",
            "tidemark.format": FORMAT_VERSION.encode(),
            "tidemark.stream": self.stream.encode(),
            "tidemark.seq": str(self.seq).encode(),
            "tidemark.relations": json.dumps({t.record_name: t.to_json() for t in self.tables},
                                             sort_keys=True).encode(),
        }
        sync = hashlib.sha256(f"{self.stream}/{self.lower}".encode()).digest()[:16]
        out = [b"Obj\x01", avro_long(len(metadata))]
        for k, v in metadata.items():
            out.append(avro_string(k))
            out.append(avro_bytes(v))
        out.append(b"\x00")
        out.append(sync)
        block: list[bytes] = []
        size = 0
        for d in [*self.datums, progress]:
            block.append(d)
            size += len(d)
            if size >= BLOCK_BYTES:
                out += [avro_long(len(block)), avro_long(size), *block, sync]
                block, size = [], 0
        if block:
            out += [avro_long(len(block)), avro_long(size), *block, sync]
        return b"".join(out)


# -- reading the slot ------------------------------------------------------------------------------

@dataclass
class ReadOutcome:
    segment: EncodedSegment
    upper: int
    changes: int
    bytes_read: int


class _Reader:
    """Decode pgoutput from a `WalStream` into an `EncodedSegment`, whole transactions only."""

    def __init__(self, cfg: StreamConfig, stream: WalStream, segment: EncodedSegment,
                 progress: ProgressFn | None = None):
        self.cfg = cfg
        self.ws = stream
        self.seg = segment
        self.progress = progress
        self.codecs: dict[int, RelationCodec] = {}
        self.types: dict[int, Type] = {}
        self._resolver: TypeResolver | None = None
        self._catalog = None

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
        return DecodeError(f"stream {self.cfg.stream}: change for relation OID {oid} at LSN {lsn_str(lsn)} "
                           "before any Relation message for it")

    def read(self, *, lower: int, target: int, exact_upper: bool, max_changes: int | None,
             max_bytes: int | None, idle_timeout: float) -> ReadOutcome:
        """Read from ``lower`` until everything committing below ``target`` has arrived (or a limit).

        With ``exact_upper`` the segment ends exactly at ``target`` (a re-drain): transactions
        committing at or after it are left out, and not reaching it is an error.
        """
        seg = self.seg
        ws = self.ws
        get = ws.pg.get_copy_data
        codecs = self.codecs
        datums = seg.datums
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
        txn_datums: list[bytes] = []
        txn_changes = 0
        t_start = now = time.monotonic()
        last_progress_at = now
        last_ping = 0.0
        last_activity = now   # when the last data or advancing keepalive arrived (set lazily)
        active = False
        last_wal_end = 0
        ts_enc = b""
        done = False

        while not done:
            n, data = get(1)
            if n > 0:
                buf = bytes(data)
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
                        arr.append(branch)
                        arr.extend(parts)
                        arr += (time_enc, codec.plus, xid_enc, avro_long(pos), ts_full,
                                codec.toast_array(toast) if toast else b"\x00")
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
                                                  f"LSN {lsn_str(final_lsn)} has an unchanged TOASTed key column "
                                                  "and no old key: the key is unknown")
                            old_image, old_toast = ts_key, b"\x00"
                        else:  # 'K' old key or 'O' old row, then 'N' new tuple
                            old, otoast, off = codec.encode_tuple(buf, 31)
                            if buf[off] != 0x4E:
                                raise DecodeError(f"stream {stream_name}: malformed update of "
                                                  f"{codec.table.qualified} at LSN {lsn_str(final_lsn)}")
                            parts, toast, _ = codec.encode_tuple(buf, off + 1)
                            old_image = ts_full if kind == 0x4F else ts_key
                            old_toast = codec.toast_array(otoast) if otoast else b"\x00"
                        arr.append(branch)
                        arr.extend(old)
                        arr += (time_enc, codec.minus, xid_enc, avro_long(pos), old_image, old_toast, branch)
                        arr.extend(parts)
                        arr += (time_enc, codec.plus, xid_enc, avro_long(pos + 1), ts_full,
                                codec.toast_array(toast) if toast else b"\x00")
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
                        arr.append(branch)
                        arr.extend(old)
                        arr += (time_enc, codec.minus, xid_enc, avro_long(pos),
                                ts_full if kind == 0x4F else ts_key,
                                codec.toast_array(otoast) if otoast else b"\x00")
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
                                              f"{lsn_str(final_lsn)}, before the drain's start {lsn_str(lower)}")
                        in_txn = True
                        active = True
                        time_enc = avro_long(final_lsn)
                        xid_enc = avro_long(xid)
                        ts_enc = avro_long(ts + PG_EPOCH_US)
                        ts_full, ts_key = ts_enc + b"\x00", ts_enc + b"\x02"
                        pos = 0
                        arr, arr_n, txn_datums, txn_changes = [], 0, [], 0
                    elif tag == 0x43:  # 'C' commit
                        commit_lsn, end_lsn = _COMMIT_LSNS(buf, 27)
                        if not in_txn or commit_lsn != final_lsn:
                            raise DecodeError(f"stream {stream_name}: Commit at {lsn_str(commit_lsn)} does not "
                                              f"match the open transaction ({lsn_str(final_lsn)})")
                        if arr_n:
                            txn_datums.append(b"\x00" + avro_long(arr_n) + b"".join(arr) + b"\x00")
                        if pos:
                            datums.extend(txn_datums)
                            counts[final_lsn] = counts.get(final_lsn, 0) + pos
                            seg.records += pos
                            seg.txns += 1
                            cts = ts + PG_EPOCH_US
                            seg.min_commit_ts = cts if seg.min_commit_ts is None else min(seg.min_commit_ts, cts)
                            seg.max_commit_ts = cts if seg.max_commit_ts is None else max(seg.max_commit_ts, cts)
                            changes += txn_changes
                        arr, arr_n, txn_datums = [], 0, []
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
                            self._report(safe, nbytes, now - t_start)
                        continue
                    elif tag == 0x52:  # 'R' relation
                        self._relation(buf[25:])
                    elif tag == 0x54:  # 'T' truncate
                        ntab = self._truncate(buf, pos, final_lsn, xid_enc, ts_enc, arr, arr_n, txn_datums)
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
                                          f"after LSN {lsn_str(final_lsn or safe)}")
                    if arr_n >= ARRAY_MAX_RECORDS:
                        txn_datums.append(b"\x00" + avro_long(arr_n) + b"".join(arr) + b"\x00")
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
                raise TidemarkError(f"stream {stream_name}: the server ended replication: "
                                    f"{ws.pg.get_error_message().decode(errors='replace').strip()}")
            # nothing buffered: are we done, or wait for more
            now = time.monotonic()
            if active:
                last_activity = now
                active = False
            if not in_txn and heard and safe >= target:
                break
            if now - last_activity >= idle_timeout:
                if exact_upper:
                    raise TidemarkError(f"stream {stream_name}: re-drain did not reach {lsn_str(target)} "
                                        f"within {idle_timeout:g}s of silence (reached {lsn_str(safe)})")
                break     # cut at the last safe position; a partial transaction is dropped
            if now - last_ping >= PING_SECONDS:
                ws.send_status(reply=True)
                last_ping = now
            ws.wait(min(PING_SECONDS, max(0.0, idle_timeout - (now - last_activity))))
        upper = target if exact_upper else safe
        if self.progress:
            self._report(upper, nbytes, time.monotonic() - t_start)
        return ReadOutcome(segment=seg, upper=upper, changes=changes, bytes_read=nbytes)

    def _branch(self, codec: RelationCodec) -> bytes:
        codec.branch = self.seg.branch(codec.table)
        return codec.branch

    def _truncate(self, buf: bytes, pos: int, time_lsn: int, xid_enc: bytes, ts_enc: bytes,
                  arr: list[bytes], arr_n: int, txn_datums: list[bytes]) -> int:
        """Close the open array and append one event datum per truncated table; return how many."""
        msg = decode_message(buf[25:])
        if arr_n:
            txn_datums.append(b"\x00" + avro_long(arr_n) + b"".join(arr) + b"\x00")
        detail = avro_string(json.dumps({"cascade": msg.cascade, "restart_identity": msg.restart_identity},
                                        sort_keys=True))
        for i, oid in enumerate(msg.oids):
            codec = self.codecs.get(oid)
            if codec is None:
                raise self._unknown(oid, time_lsn)
            txn_datums.append(b"\x04" + avro_string("truncate") + codec.qualified_enc + avro_long(time_lsn)
                              + xid_enc + avro_long(pos + i) + ts_enc + detail)
        return len(msg.oids)

    def _report(self, lsn: int, nbytes: int, seconds: float) -> None:
        self.progress({"stream": self.cfg.stream, "records": self.seg.records, "txns": self.seg.txns,
                       "bytes": nbytes, "lsn": lsn, "seconds": seconds})


# -- landing ---------------------------------------------------------------------------------------

def _ack_position(cfg: StreamConfig, frontier: int | None, landed: int | None) -> int | None:
    """The furthest position the slot may be confirmed to under the stream's ack policy."""
    return landed if cfg.drain.ack_policy == "landed" else frontier


def _land(cfg: StreamConfig, ctl: Control, seg: EncodedSegment, upper: int, origin: str) -> DrainResult:
    """Write the segment atomically, then register it. Nothing is written for an empty interval."""
    if upper == seg.lower:
        return DrainResult(cfg.stream, seg.seq, seg.lower, upper, 0, 0, None, 0, False, True)
    data = seg.build(upper)
    store = open_store(cfg.landing.url, endpoint_url=cfg.landing.endpoint_url, region=cfg.landing.region)
    key = stream_keys(cfg.stream)["segments"] + segment_name(seg.seq, seg.lower, upper)
    uri, _ = put_if_absent(store, key, data)
    registered = ctl.register_segment(Segment(
        stream=cfg.stream, seq=seg.seq, lower=seg.lower, upper=upper, uri=uri, record_count=seg.records,
        txn_count=seg.txns, byte_size=len(data), checksum=checksum(data), status="landed", origin=origin,
        min_commit_ts=seg.min_commit_ts, max_commit_ts=seg.max_commit_ts))
    return DrainResult(cfg.stream, seg.seq, seg.lower, upper, seg.records, seg.txns, uri, len(data), registered,
                       seg.records == 0)


def _read_segment_from_slot(cfg: StreamConfig, ctl: Control, *, seq: int, lower: int, target: int | None,
                            exact_upper: bool, max_changes: int | None, max_bytes: int | None,
                            progress: ProgressFn | None, origin: str,
                            extra_options: str = "") -> DrainResult:
    state = ctl.stream(cfg.stream)
    info = require_slot(cfg, covers=lower)
    ack = _ack_position(cfg, state.frontier, state.landed_upper)
    ws = WalStream(source_dsn(cfg), extra_options=extra_options)
    reader = None
    try:
        if target is None:
            target = ws.identify()
        # never move the slot backwards, nor past the policy
        confirmed = info.confirmed_flush_lsn or 0
        ws.ack = ack if ack is not None and ack > confirmed else 0
        ws.start(cfg.source.slot, lower, cfg.source.publication)
        seg = EncodedSegment(cfg.stream, seq, lower)
        reader = _Reader(cfg, ws, seg, progress)
        outcome = reader.read(lower=lower, target=target, exact_upper=exact_upper, max_changes=max_changes,
                              max_bytes=max_bytes, idle_timeout=cfg.drain.idle_timeout_seconds)
        result = _land(cfg, ctl, seg, outcome.upper, origin)
        if cfg.drain.ack_policy == "landed" and result.registered and not exact_upper:
            ws.ack = max(ws.ack, result.upper)
        if ws.ack:
            ws.send_status()
        return result
    finally:
        if reader is not None:
            reader.close()
        ws.close()


def drain_stream(cfg: StreamConfig, *, max_changes: int | None = None, max_bytes: int | None = None,
                 progress: ProgressFn | None = None, extra_options: str = "") -> DrainResult:
    """Drain the stream's slot from its landed upper into one new segment and register it.

    ``max_changes`` / ``max_bytes`` default to the stream's ``drain`` settings; a transaction is never
    split, so the last one may exceed them. ``progress`` is called with a dict (stream, records, txns,
    bytes, lsn, seconds) about once a second; `print_progress` prints it. Raises `StreamBusy` if
    another drain of the stream is running, `SlotLost` if the slot cannot replay from the landed upper.
    ``extra_options`` are added to the replication connection's options (e.g. ``-c
    logical_decoding_work_mem=64kB``).
    """
    max_changes = max_changes if max_changes is not None else cfg.drain.max_changes
    max_bytes = max_bytes if max_bytes is not None else cfg.drain.max_bytes
    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, "drain"):
        state = ctl.stream(cfg.stream)
        if state.landed_upper is None:
            raise TidemarkError(f"stream {cfg.stream} has no consistent point yet: run its snapshot first "
                                "(it creates the slot and sets where the drain starts)")
        return _read_segment_from_slot(cfg, ctl, seq=state.next_seq, lower=state.landed_upper, target=None,
                                       exact_upper=False, max_changes=max_changes, max_bytes=max_bytes,
                                       progress=progress, origin="drain", extra_options=extra_options)


def redrain_range(cfg: StreamConfig, *, seq: int, lower: int, upper: int, origin: str = "repair",
                  progress: ProgressFn | None = None, extra_options: str = "") -> DrainResult:
    """Re-read exactly ``[lower, upper)`` from the slot and land it as segment ``seq``.

    Produces the same bytes as the drain that first wrote that range (an existing file with other
    bytes is an error). Raises `SlotLost` if the slot no longer reaches ``lower``.
    """
    if upper <= lower:
        raise TidemarkError(f"stream {cfg.stream}: cannot re-drain the empty range [{lower}, {upper})")
    with open_control(cfg) as ctl, ctl.stream_lock(cfg.stream, "drain"):
        return _read_segment_from_slot(cfg, ctl, seq=seq, lower=lower, target=upper, exact_upper=True,
                                       max_changes=None, max_bytes=None, progress=progress, origin=origin,
                                       extra_options=extra_options)


__all__ = ["DrainResult", "drain_stream", "redrain_range", "print_progress", "WalStream", "EncodedSegment"]
