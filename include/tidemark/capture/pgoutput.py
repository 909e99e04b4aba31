"""pgoutput decoding: logical replication protocol version 1 messages, tuples, and table shapes.

Two ways in:

* `decode_message` turns one pgoutput message into a small dataclass (Begin, Commit, Origin,
  Relation, Type, Insert, Update, Delete, Truncate, Message). Tuple values are ``None`` (``n``,
  SQL null), `UNCHANGED` (``u``, an unchanged TOASTed value that was not sent: never a value) or
  the raw text bytes (``t``). `RelationCodec.row` turns such a tuple into canonical values.
* the drain's fast path: `RelationCodec.encode_tuple` reads a tuple straight out of a message
  buffer and returns each column already encoded as the Avro value of its segment field (see
  `tidemark.landing.segments` and `tidemark.pgtypes`).

Text values arrive in the canonical form of `tidemark.pgtypes.SESSION_SETTINGS` because the
replication connection sets those options; kinds, type names and parsers come from
`tidemark.pgtypes`. The Avro encoders here produce exactly what fastavro would write for the
same canonical value (a unit test compares them).
"""

from __future__ import annotations

import binascii
import struct
from dataclasses import dataclass
from typing import Any, Callable

from tidemark.errors import DecodeError
from tidemark.landing.segments import VARINT14, avro_bytes, avro_long, avro_string
from tidemark.lsn import format_lsn
from tidemark.pgtypes import (
    Column,
    TableSchema,
    TypeResolver,
    parse_date,
    parse_time,
    parse_timestamp,
    parse_timestamptz,
    text_parser,
)
from tidemark.pgtypes.catalog import array_dims

PG_EPOCH_US = 946_684_800_000_000  # 2000-01-01 in µs since 1970-01-01
PROTO_VERSION = "1"

_I16 = struct.Struct(">h").unpack_from
_I32 = struct.Struct(">i").unpack_from
_U32 = struct.Struct(">I").unpack_from
_U64 = struct.Struct(">Q").unpack_from
_BEGIN = struct.Struct(">QqI").unpack_from           # final_lsn, commit_ts, xid
_COMMIT = struct.Struct(">BQQq").unpack_from         # flags, commit_lsn, end_lsn, commit_ts
_F32 = struct.Struct("<f").pack
_F64 = struct.Struct("<d").pack


class _Unchanged:
    """The marker of an unchanged TOASTed value (tuple kind ``u``): one instance, `UNCHANGED` (a copy
    or an unpickled one is that instance)."""

    def __repr__(self) -> str:
        return "UNCHANGED"

    def __reduce__(self) -> str:
        return "UNCHANGED"


UNCHANGED = _Unchanged()


# -- messages ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Begin:
    final_lsn: int      # LSN of the commit record: the transaction's `time`
    commit_ts: int      # µs since 1970-01-01 UTC
    xid: int


@dataclass(frozen=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int        # end of the commit record: a later transaction commits at or after it
    commit_ts: int


@dataclass(frozen=True)
class Origin:
    commit_lsn: int
    name: str


@dataclass(frozen=True)
class RelationColumn:
    flags: int          # 1 = part of the replica identity key
    name: str
    type_oid: int
    typmod: int


@dataclass(frozen=True)
class Relation:
    oid: int
    namespace: str      # '' on the wire means pg_catalog; decoded as 'pg_catalog'
    name: str
    replica_identity: str
    columns: tuple[RelationColumn, ...]


@dataclass(frozen=True)
class Type:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True)
class Insert:
    oid: int
    new: tuple


@dataclass(frozen=True)
class Update:
    oid: int
    old_kind: str | None   # 'K' (old key), 'O' (old row, REPLICA IDENTITY FULL) or None
    old: tuple | None
    new: tuple


@dataclass(frozen=True)
class Delete:
    oid: int
    old_kind: str
    old: tuple


@dataclass(frozen=True)
class Truncate:
    options: int
    oids: tuple[int, ...]

    @property
    def cascade(self) -> bool:
        return bool(self.options & 1)

    @property
    def restart_identity(self) -> bool:
        return bool(self.options & 2)


@dataclass(frozen=True)
class Message:
    flags: int          # 1 = transactional
    lsn: int
    prefix: str
    content: bytes


def _cstring(buf: bytes, off: int) -> tuple[str, int]:
    end = buf.index(b"\0", off)
    return buf[off:end].decode("utf-8"), end + 1


def decode_tuple(buf, off: int) -> tuple[tuple, int]:
    """Decode a TupleData at ``off``; return (values, offset after it)."""
    (n,) = _I16(buf, off)
    off += 2
    out = []
    for _ in range(n):
        kind = buf[off]
        if kind == 0x74:  # 't'
            (ln,) = _I32(buf, off + 1)
            out.append(bytes(buf[off + 5:off + 5 + ln]))
            off += 5 + ln
        elif kind == 0x6E:  # 'n'
            out.append(None)
            off += 1
        elif kind == 0x75:  # 'u'
            out.append(UNCHANGED)
            off += 1
        else:
            raise DecodeError(f"tuple column {len(out)}: unknown value kind {chr(kind)!r} "
                              "(binary tuples are not requested)")
    return tuple(out), off


def decode_message(buf, lsn: int | None = None) -> Any:
    """Decode one pgoutput (protocol version 1) message; raise `DecodeError` naming the type and LSN."""
    where = f" at LSN {format_lsn(lsn)}" if lsn else ""
    buf = bytes(buf)
    if not buf:
        raise DecodeError(f"empty pgoutput message{where}")
    tag = chr(buf[0])
    try:
        if tag == "B":
            final_lsn, ts, xid = _BEGIN(buf, 1)
            return Begin(final_lsn, ts + PG_EPOCH_US, xid)
        if tag == "C":
            flags, commit_lsn, end_lsn, ts = _COMMIT(buf, 1)
            return Commit(flags, commit_lsn, end_lsn, ts + PG_EPOCH_US)
        if tag == "O":
            (olsn,) = _U64(buf, 1)
            name, _ = _cstring(buf, 9)
            return Origin(olsn, name)
        if tag == "R":
            return decode_relation(buf)
        if tag == "Y":
            (oid,) = _U32(buf, 1)
            ns, off = _cstring(buf, 5)
            name, _ = _cstring(buf, off)
            return Type(oid, ns or "pg_catalog", name)
        if tag == "I":
            (oid,) = _U32(buf, 1)
            if buf[5] != 0x4E:
                raise DecodeError(f"Insert{where}: expected 'N', got {chr(buf[5])!r}")
            new, _ = decode_tuple(buf, 6)
            return Insert(oid, new)
        if tag == "U":
            (oid,) = _U32(buf, 1)
            kind = chr(buf[5])
            old = None
            off = 6
            if kind in ("K", "O"):
                old, off = decode_tuple(buf, 6)
                if buf[off] != 0x4E:
                    raise DecodeError(f"Update{where}: expected 'N' after the old tuple, got {chr(buf[off])!r}")
                off += 1
            elif kind != "N":
                raise DecodeError(f"Update{where}: unexpected tuple kind {kind!r}")
            new, _ = decode_tuple(buf, off)
            return Update(oid, kind if old is not None else None, old, new)
        if tag == "D":
            (oid,) = _U32(buf, 1)
            kind = chr(buf[5])
            if kind not in ("K", "O"):
                raise DecodeError(f"Delete{where}: unexpected tuple kind {kind!r}")
            old, _ = decode_tuple(buf, 6)
            return Delete(oid, kind, old)
        if tag == "T":
            (n,) = _I32(buf, 1)
            options = buf[5]
            oids = tuple(_U32(buf, 6 + 4 * i)[0] for i in range(n))
            return Truncate(options, oids)
        if tag == "M":
            flags = buf[1]
            (mlsn,) = _U64(buf, 2)
            prefix, off = _cstring(buf, 10)
            (ln,) = _I32(buf, off)
            return Message(flags, mlsn, prefix, bytes(buf[off + 4:off + 4 + ln]))
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as exc:
        raise DecodeError(f"malformed pgoutput message {tag!r}{where}: {exc}") from exc
    raise DecodeError(f"unknown pgoutput message type {tag!r}{where} (only protocol version 1 is supported)")


def decode_relation(buf) -> Relation:
    """Decode a Relation ('R') message."""
    (oid,) = _U32(buf, 1)
    ns, off = _cstring(buf, 5)
    name, off = _cstring(buf, off)
    ident = chr(buf[off])
    (ncols,) = _I16(buf, off + 1)
    off += 3
    cols = []
    for _ in range(ncols):
        flags = buf[off]
        cname, off = _cstring(buf, off + 1)
        type_oid, typmod = _U32(buf, off)[0], _I32(buf, off + 4)[0]
        off += 8
        cols.append(RelationColumn(flags, cname, type_oid, typmod))
    return Relation(oid, ns or "pg_catalog", name, ident, tuple(cols))


# -- relations -> table shapes ----------------------------------------------------------------

def table_from_relation(rel: Relation, resolver: TypeResolver, types: dict[int, Type]) -> TableSchema:
    """The table shape a Relation message describes (kinds resolved through the catalog, a type the
    catalog does not know named by its Type message in ``types``).

    pgoutput does not send nullability, so every column is ``nullable=True``.
    """
    cols = []
    dims = resolver.dims(rel.oid) if any(resolver.resolve(c.type_oid)[0] == "array" for c in rel.columns) else {}
    for c in rel.columns:
        kind, type_name, elem_kind = resolver.resolve(c.type_oid)
        if type_name.startswith("oid:") and c.type_oid in types:
            t = types[c.type_oid]
            type_name = t.name if t.namespace in ("pg_catalog", "public") else f"{t.namespace}.{t.name}"
        cols.append(Column(name=c.name, kind=kind, type_name=type_name, type_oid=c.type_oid, typmod=c.typmod,
                           key=bool(c.flags & 1), elem_kind=elem_kind, dims=array_dims(kind, dims.get(c.name))))
    return TableSchema(schema=rel.namespace, name=rel.name, oid=rel.oid, columns=tuple(cols),
                       replica_identity=rel.replica_identity)


NULL = b"\x00"          # branch 0 of ["null", T]
_SOME = b"\x02"         # branch 1 of ["null", T]
_TRUE = b"\x02\x01"
_FALSE = b"\x02\x00"


def _value_encoder(kind: str) -> Callable[[Any], bytes]:
    """Encoder of a canonical (non-null) value of ``kind`` to its Avro bytes (no union index)."""
    if kind in ("int16", "int32", "int64", "date", "time", "timestamp", "timestamptz"):
        return avro_long
    if kind == "float32":
        return _F32
    if kind == "float64":
        return _F64
    if kind == "bool":
        return lambda v: b"\x01" if v else b"\x00"
    if kind == "bytes":
        return avro_bytes
    return avro_string


def encode_value(col: Column, value: Any) -> bytes:
    """Avro bytes of a canonical value in the column's nullable field (union index included)."""
    if value is None:
        return NULL
    if col.kind == "array" and col.dims:        # its text (the lake parses it)
        return _SOME + avro_string(value)
    if col.kind == "array":
        if isinstance(value, str):
            return b"\x04" + avro_string(value)
        elem = _value_encoder(col.elem_kind or "text")
        if not value:
            return b"\x02\x00"
        return (b"\x02" + avro_long(len(value))
                + b"".join(NULL if v is None else _SOME + elem(v) for v in value) + b"\x00")
    return _SOME + _value_encoder(col.kind)(value)


def _enc_int(raw: bytes) -> bytes:
    return _SOME + avro_long(int(raw))


def _enc_f32(raw: bytes) -> bytes:
    return _SOME + _F32(float(raw))


def _enc_f64(raw: bytes) -> bytes:
    return _SOME + _F64(float(raw))


def _enc_bool(raw: bytes) -> bytes:
    return _TRUE if raw == b"t" else _FALSE


def _enc_text(raw: bytes) -> bytes:
    n = len(raw)
    return _SOME + (VARINT14[n << 1] if n < 8192 else avro_long(n)) + raw


def _enc_bytea(raw: bytes) -> bytes:
    if raw[:2] != b"\\x":
        raise ValueError(f"bytea value is not in hex format: {bytes(raw[:20])!r}")
    data = binascii.unhexlify(memoryview(raw)[2:])       # the hex digits in place (a huge value: no copy)
    return b"".join((_SOME, avro_long(len(data)), data))


_VIEW_ENCODERS = (_enc_text, _enc_bytea)     # encoders that take a memoryview as well as bytes
_BIG_VALUE = 1 << 20                         # a value this long is encoded from the message in place


def _enc_date(raw: bytes) -> bytes:
    return _SOME + avro_long(parse_date(raw.decode()))


def _enc_time(raw: bytes) -> bytes:
    return _SOME + avro_long(parse_time(raw.decode()))


def _us_long(us: int, raw: bytes) -> bytes:
    """A timestamp's Avro long; PostgreSQL's timestamps reach the year 294276, 64-bit microseconds
    since 1970 the year 294247: a value beyond cannot be landed (an Avro long would wrap it), nor one
    on the bounds themselves, which are ±infinity's (the snapshot refuses it too)."""
    if not -(2**63) < us < 2**63 - 1 and raw not in (b"infinity", b"-infinity"):
        raise OverflowError(f"{raw.decode()} is beyond the lake's range (64-bit microseconds since 1970: up to the "
                            "year 294247); correct the value in the source, then resend the stream (snapshot "
                            "--mode resend): its slot holds this change")
    return _SOME + avro_long(us)


def _enc_timestamp(raw: bytes) -> bytes:
    return _us_long(parse_timestamp(raw.decode()), raw)


def _enc_timestamptz(raw: bytes) -> bytes:
    return _us_long(parse_timestamptz(raw.decode()), raw)


_RAW_ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "int16": _enc_int, "int32": _enc_int, "int64": _enc_int, "float32": _enc_f32, "float64": _enc_f64,
    "bool": _enc_bool, "numeric": _enc_text, "text": _enc_text, "bytes": _enc_bytea, "date": _enc_date,
    "time": _enc_time, "timetz": _enc_text, "timestamp": _enc_timestamp, "timestamptz": _enc_timestamptz,
    "interval": _enc_text, "uuid": _enc_text, "json": _enc_text, "jsonb": _enc_text,
}
# kinds whose parse is costly enough that remembering recent values pays (same now() in a batch, ...)
_MEMO_KINDS = {"date", "time", "timestamp", "timestamptz", "bool", "int16", "int32"}
_MEMO_LIMIT = 4096


def raw_encoder(col: Column) -> Callable[[bytes], bytes]:
    """A function from the column's text bytes (pgoutput 't' value) to its Avro field bytes."""
    if col.kind == "array" and col.dims:        # its text as pgoutput sends it: the lake parses it
        return _enc_text
    if col.kind == "array":
        parse = text_parser(col)
        return lambda raw: encode_value(col, parse(raw.decode("utf-8")))
    return _RAW_ENCODERS[col.kind]


# -- per-relation codec -----------------------------------------------------------------------------

class RelationCodec:
    """Everything the drain needs about one Relation message: its table shape, its Avro record, and
    per-column decoders. A new Relation message for the same OID makes a new codec (schema change)."""

    __slots__ = ("table", "ncols", "encoders", "memos", "key_mask", "toast_names",
                 "branch", "qualified_enc", "plus", "minus", "parsers", "names")

    def __init__(self, table: TableSchema):
        self.table = table
        self.ncols = len(table.columns)
        self.encoders = [raw_encoder(c) for c in table.columns]
        self.memos = [{} if c.kind in _MEMO_KINDS else None for c in table.columns]
        self.key_mask = [c.key for c in table.columns]
        self.toast_names = [avro_string(c.name) for c in table.columns]
        self.branch: bytes | None = None    # union index of this shape in the segment being built
        self.qualified_enc = avro_string(table.qualified)
        self.plus = b"\x02" + self.qualified_enc    # diff +1, then table (fields of an update record)
        self.minus = b"\x01" + self.qualified_enc   # diff -1, then table
        self.parsers = [text_parser(c) for c in table.columns]
        self.names = [c.name for c in table.columns]

    # generic path ------------------------------------------------------------------------------
    def row(self, values: tuple) -> tuple[dict[str, Any], tuple[str, ...]]:
        """Canonical row (column -> value) and unchanged-TOAST column names of a decoded tuple."""
        self._check_width(len(values))
        row: dict[str, Any] = {}
        unchanged = []
        for name, parse, v in zip(self.names, self.parsers, values):
            if v is None:
                row[name] = None
            elif v is UNCHANGED:
                row[name] = None
                unchanged.append(name)
            else:
                try:
                    row[name] = parse(v.decode("utf-8"))
                except (ValueError, UnicodeDecodeError) as exc:
                    raise DecodeError(f"table {self.table.qualified} column {name}: cannot parse "
                                      f"{v[:60]!r} as {self.table.columns[self.names.index(name)].type_name}: "
                                      f"{exc}") from exc
        return row, tuple(unchanged)

    def _check_width(self, n: int) -> None:
        if n != self.ncols:
            raise DecodeError(f"table {self.table.qualified}: tuple has {n} columns, the relation has "
                              f"{self.ncols}")

    # fast path ---------------------------------------------------------------------------------
    def encode_tuple(self, buf: bytes, off: int) -> tuple[list[bytes], list[int] | None, int]:
        """Read a TupleData at ``off``: (Avro bytes per column, indexes of unchanged TOAST columns or
        None, offset after the tuple)."""
        (n,) = _I16(buf, off)
        if n != self.ncols:
            self._check_width(n)
        off += 2
        parts: list[bytes] = []
        append = parts.append
        toast = None
        encoders = self.encoders
        memos = self.memos
        i = 0
        try:
            for i in range(n):
                kind = buf[off]
                if kind == 0x74:  # 't'
                    (ln,) = _I32(buf, off + 1)
                    start = off + 5
                    off = start + ln
                    memo = memos[i]
                    if ln >= _BIG_VALUE and encoders[i] in _VIEW_ENCODERS:
                        # a huge text or bytea value: read in place, not copied out of the message first
                        append(encoders[i](memoryview(buf)[start:off]))
                        continue
                    raw = buf[start:off]
                    if memo is None:
                        append(encoders[i](raw))
                    else:
                        enc = memo.get(raw)
                        if enc is None:
                            enc = encoders[i](raw)
                            if len(memo) >= _MEMO_LIMIT:
                                memo.clear()
                            memo[raw] = enc
                        append(enc)
                elif kind == 0x6E:  # 'n'
                    append(NULL)
                    off += 1
                elif kind == 0x75:  # 'u'
                    append(NULL)
                    if toast is None:
                        toast = [i]
                    else:
                        toast.append(i)
                    off += 1
                else:
                    raise DecodeError(f"table {self.table.qualified} column {self.names[i]}: unknown tuple "
                                      f"value kind {chr(kind)!r}")
        except (ValueError, UnicodeDecodeError, OverflowError) as exc:
            col = self.table.columns[i]
            raise DecodeError(f"table {self.table.qualified} column {col.name}: cannot decode value as "
                              f"{col.type_name}: {exc}") from exc
        return parts, toast, off

    def key_from_old(self, parts: list[bytes], toast: list[int], old: list[bytes]) -> list[int] | None:
        """An update's new tuple whose key column was left unchanged TOASTed (``u``: a key value stored out
        of line, which PostgreSQL sends whole in the old key instead): that column takes the old key's
        value in ``parts``; return the other unchanged TOAST columns (None: none)."""
        rest = []
        for i in toast:
            if self.key_mask[i]:
                parts[i] = old[i]
            else:
                rest.append(i)
        return rest or None

    def key_parts(self, parts: list[bytes]) -> list[bytes]:
        """Only the key columns of an encoded tuple (others null): a ``key`` image."""
        return [p if k else NULL for p, k in zip(parts, self.key_mask)]

    def toast_array(self, toast: list[int] | None) -> bytes:
        """The Avro ``unchanged_toast`` array for column indexes ``toast``."""
        if not toast:
            return b"\x00"
        return avro_long(len(toast)) + b"".join(self.toast_names[i] for i in toast) + b"\x00"
