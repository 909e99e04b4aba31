"""Segments: immutable Avro object container files in the Materialize CDC format, extended (the
format: docs/segment-format.md; its header and framing: docs/internals/storage.md).

A segment's datums are a union of: an **array of updates** (``{data, time, diff}`` plus ``table``,
``xid``, ``position``, ``commit_ts``, ``image`` and ``unchanged_toast``; each update its own array
block, count ``-1`` then its byte size), the **progress** record ``{lower, upper, counts}`` (the last
datum: every record with ``lower <= time < upper`` is in the segment, ``counts`` records per time),
and an **event** (``truncate``). ``(time, position)`` identifies a record. A segment's bytes are a
function of its content and codec (`CODECS`), so re-draining a range writes the same bytes.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import zlib
from dataclasses import dataclass, field
from typing import Any

from tidemark.errors import SegmentError
from tidemark.pgtypes import avro_record_schema, TableSchema

# -- Avro binary encoding (the spec's primitives; the drain's codecs build on them) ---------------

# avro_long of every zig-zag value below 2**14, precomputed (the drain encodes millions of small ints)
VARINT14 = [bytes([n]) if n < 0x80 else bytes([(n & 0x7F) | 0x80, n >> 7]) for n in range(1 << 14)]
_VARINT14_CONT = [bytes([(n & 0x7F) | 0x80, (n >> 7) | 0x80]) for n in range(1 << 14)]


def avro_long(n: int) -> bytes:
    """Avro's zig-zag varint encoding of an int/long."""
    z = (n << 1) ^ (n >> 63)
    if z < 16384:
        return VARINT14[z]
    parts = []
    while z >= 16384:
        parts.append(_VARINT14_CONT[z & 16383])
        z >>= 14
    parts.append(VARINT14[z])
    return b"".join(parts)


def avro_bytes(b: bytes) -> bytes:
    return avro_long(len(b)) + b


def avro_string(s: str) -> bytes:
    return avro_bytes(s.encode("utf-8"))


FORMAT_VERSION = "1"
CODECS = ("zstandard", "deflate", "null")     # the Avro block codecs segments are written with
DEFAULT_CODEC = "zstandard"
ZSTD_LEVEL = 3                 # zstandard's own default level (~280 MB/s of blocks per core here)
DEFLATE_LEVEL = 6
BLOCK_BYTES = 1 << 20          # Avro container block size (datums are never split)
ARRAY_MAX_RECORDS = 10_000     # a transaction larger than this is written as consecutive arrays (datums)
COPY_BYTES = 8 << 20           # read size when streaming a spilled segment

PROGRESS_SCHEMA = {
    "type": "record", "name": "progress", "namespace": "com.materialize.cdc",
    "fields": [
        {"name": "lower", "type": {"type": "array", "items": "long"}},
        {"name": "upper", "type": {"type": "array", "items": "long"}},
        {"name": "counts", "type": {"type": "array", "items": {
            "type": "record", "name": "counts", "namespace": "com.materialize.cdc",
            "fields": [{"name": "time", "type": "long"}, {"name": "count", "type": "long"}]}}},
    ],
}

EVENT_SCHEMA = {
    "type": "record", "name": "event", "namespace": "com.tidemark",
    "fields": [
        {"name": "kind", "type": "string"},          # truncate
        {"name": "table", "type": "string"},         # schema.name
        {"name": "time", "type": "long"},
        {"name": "xid", "type": "long"},
        {"name": "position", "type": "int"},
        {"name": "commit_ts", "type": "long"},
        {"name": "detail", "type": "string"},        # JSON (truncate: {"cascade": bool, "restart_identity": bool})
    ],
}

# Used as the only `data` branch of a segment that has no updates (Avro unions cannot be empty).
_EMPTY_DATA = {"type": "record", "name": "no_rows", "namespace": "tidemark.data", "fields": []}


def segment_schema(tables: list[TableSchema]) -> dict:
    """The writer schema of a segment holding updates of the given table shapes."""
    data_branches = [avro_record_schema(t) for t in tables] or [_EMPTY_DATA]
    update = {
        "type": "record", "name": "update", "namespace": "com.materialize.cdc",
        "fields": [
            {"name": "data", "type": data_branches},
            {"name": "time", "type": "long"},
            {"name": "diff", "type": "long"},
            {"name": "table", "type": "string"},
            {"name": "xid", "type": "long"},
            {"name": "position", "type": "int"},
            {"name": "commit_ts", "type": "long"},
            {"name": "image", "type": {"type": "enum", "name": "image", "namespace": "com.tidemark",
                                       "symbols": ["full", "key"]}},
            {"name": "unchanged_toast", "type": {"type": "array", "items": "string"}},
        ],
    }
    return [{"type": "array", "items": update}, PROGRESS_SCHEMA, EVENT_SCHEMA]


def segment_name(seq: int, lower: int, upper: int) -> str:
    """``00000000000000000042_000000000169A3B8_000000000169B000.avro``: sorts by seq, names the range."""
    return f"{seq:020d}_{lower:016X}_{upper:016X}.avro"


def parse_segment_name(name: str) -> tuple[int, int, int]:
    """Inverse of `segment_name`; raises ValueError for other names."""
    base = name.rsplit("/", 1)[-1]
    if not base.endswith(".avro"):
        raise ValueError(f"{name!r} is not a segment file name")
    seq, lower, upper = base[:-5].split("_")
    return int(seq), int(lower, 16), int(upper, 16)


@dataclass
class Update:
    """One row change. ``row`` is a dict column name -> canonical value (see `tidemark.pgtypes`)."""

    table: TableSchema
    row: dict[str, Any]
    time: int
    diff: int
    xid: int
    position: int
    commit_ts: int
    image: str = "full"
    unchanged_toast: tuple[str, ...] = ()


@dataclass
class Event:
    kind: str
    table: str
    time: int
    xid: int
    position: int
    commit_ts: int
    detail: dict = field(default_factory=dict)


@dataclass
class SegmentHeader:
    """What every decoded form of a segment says: its place in the stream, its progress counts and
    its table shapes (by record name)."""

    stream: str
    seq: int
    lower: int
    upper: int
    counts: dict[int, int]
    relations: dict[str, TableSchema]


@dataclass
class SegmentContent(SegmentHeader):
    """What a segment says, decoded: tables (by record name), records in file order, progress."""

    updates: list[Update]
    events: list[Event]

    @property
    def commit_span(self) -> tuple[int | None, int | None]:
        """(min, max) commit_ts over its updates and events; (None, None) when it has none."""
        stamps = [r.commit_ts for r in (*self.updates, *self.events)]
        return min(stamps, default=None), max(stamps, default=None)


def block_compressor(codec: str):
    """The function compressing one block's bytes under Avro ``codec`` (deterministic)."""
    if codec == "null":
        return None
    if codec == "deflate":          # raw deflate (RFC 1951), as the Avro specification says
        return lambda raw: zlib.compress(raw, DEFLATE_LEVEL, -15)
    if codec == "zstandard":
        zstd = _zstd()
        return lambda raw: zstd.compress(raw, level=ZSTD_LEVEL)       # one frame, with its content size
    raise ValueError(f"unknown segment codec {codec!r} (one of {', '.join(CODECS)})")


def block_decompressor(codec: str):
    """The function decompressing one block's bytes under Avro ``codec``, or None for ``null``;
    raises ValueError for a codec Tidemark does not write."""
    if codec == "null":
        return None
    if codec == "deflate":
        return lambda raw: zlib.decompress(raw, -15)
    if codec == "zstandard":
        return _zstd().decompress
    raise ValueError(f"codec {codec!r}")


def _zstd():
    """Zstandard as fastavro reads it: the standard library's ``compression.zstd`` (Python 3.14), or
    its backport before (the ``backports.zstd`` package)."""
    try:
        from backports import zstd
    except ImportError:         # Python 3.14 and later: in the standard library
        zstd = importlib.import_module("compression.zstd")
    return zstd


def _relations(meta: dict, name: str) -> dict[str, TableSchema]:
    """The table shapes (by Avro record name) a segment's header metadata names; `SegmentError` for
    another ``tidemark.format`` or a bad ``tidemark.relations``."""
    if meta.get("tidemark.format") != FORMAT_VERSION:
        raise SegmentError(name, f"unknown tidemark.format {meta.get('tidemark.format')!r}")
    try:
        return {k: TableSchema.from_json(v) for k, v in json.loads(meta["tidemark.relations"]).items()}
    except (KeyError, ValueError, TypeError) as exc:
        raise SegmentError(name, f"bad tidemark.relations header: {exc}") from exc


def event_from_record(rec: dict) -> Event:
    """An `Event` from its Avro record (`EVENT_SCHEMA`) as fastavro reads it."""
    return Event(kind=rec["kind"], table=rec["table"], time=rec["time"], xid=rec["xid"], position=rec["position"],
                 commit_ts=rec["commit_ts"], detail=json.loads(rec["detail"]))


def checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
