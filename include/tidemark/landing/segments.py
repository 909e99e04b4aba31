"""Segments: immutable Avro object container files in the Materialize CDC format.

Each datum of a segment file is one branch of the union (seed 000, plus one Tidemark extension):

* an **array of updates** — one array per transaction (a very large transaction may use several
  consecutive arrays). Each update is its own array block: count ``-1`` then the update's byte size,
  as the Avro specification allows (any Avro reader reads it); it lets `read_segment_columns` find
  every update without decoding the ones before it, and decode them field by field with numpy.
  An update is ``{data, time, diff}`` as in the Materialize CDC format, where ``data`` is a record
  of the table's shape (a union over the table shapes in the segment), plus
  Tidemark's fields: ``table``, ``xid``, ``position`` (index of the record inside its transaction;
  ``(time, position)`` identifies an update), ``commit_ts`` (µs since the epoch, UTC), ``image``
  (``full`` when ``data`` is the whole row; ``key`` when only the replica-identity columns are
  known, the others null) and ``unchanged_toast`` (columns whose value did not change and was not
  sent: their ``data`` value is null and means "as before", never "null").
* a **progress** record ``{lower, upper, counts}`` exactly as in seed 000: every record (update or
  event) with ``lower <= time < upper`` is in this segment, and ``counts`` says how many distinct
  records there are at each time. The last datum of every segment.
* an **event** (Tidemark extension) for what is not a row change: ``truncate`` of a table, with the
  same ``time``/``position``/``xid``/``commit_ts`` so it is ordered among the updates.

The header metadata carries ``tidemark.format`` (``1``), ``tidemark.stream``, ``tidemark.seq`` and
``tidemark.relations``: a JSON map from Avro record name to the table shape (`TableSchema.to_json`),
which gives the original column names, PostgreSQL types and keys.

A segment's bytes are a function of its content and codec: the sync marker is derived from
(stream, lower), so re-draining the same range writes the same bytes.

Blocks are compressed with the Avro container's own codec (``avro.codec``, the stream's
``landing.codec``): ``zstandard`` (the default), ``deflate`` or ``null``; every Avro reader with the
codec reads them, and every reader here reads segments of any of them (older segments are ``null``).
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import tempfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterable, Iterator
import fastavro

from tidemark.errors import SegmentError
from tidemark.pgtypes import avro_field_names, avro_record_schema, avro_type, TableSchema

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


def block_compressor(codec: str):
    """The function compressing one block's bytes under Avro ``codec`` (deterministic)."""
    if codec == "null":
        return None
    if codec == "deflate":          # raw deflate (RFC 1951), as the Avro specification says
        def deflate(raw: bytes) -> bytes:
            c = zlib.compressobj(DEFLATE_LEVEL, zlib.DEFLATED, -15)
            return c.compress(raw) + c.flush()
        return deflate
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


# -- the writer: one Avro container framing for every segment ------------------------------------------------------------------------------

class SegmentWriter:
    """A segment's records as Avro-encoded datums (whole transactions), its table shapes, and the
    container framing. The drain appends datums it encoded itself (the fast path); `SegmentBuilder`
    encodes `Update`/`Event` objects with fastavro and appends them here.

    Memory stays bounded whatever the segment's size: datums are framed into Avro blocks of about
    `BLOCK_BYTES` as they arrive, and each full block is spilled to an anonymous temporary file (in
    ``spill_dir``, ``$TIDEMARK_SPILL_DIR`` or the system's temporary directory; it vanishes with the
    process). `write` streams the file (header, spilled blocks, last block with the progress
    record) to a file object; `build` returns the same bytes in memory, for small segments. Each block
    is compressed with ``codec`` (`CODECS`) as it is framed."""

    def __init__(self, stream: str, seq: int, lower: int, *, spill_dir: str | None = None,
                 codec: str = DEFAULT_CODEC):
        self.stream = stream
        self.seq = seq
        self.lower = lower
        self.tables: list[TableSchema] = []
        self._branches: dict[str, bytes] = {}
        self.counts: dict[int, int] = {}
        self.records = 0
        self.txns = 0
        self.min_commit_ts: int | None = None    # commit-time bounds of its transactions (µs, UTC)
        self.max_commit_ts: int | None = None
        self._sync = hashlib.sha256(f"{stream}/{lower}".encode()).digest()[:16]
        self._block: list[bytes] = []
        self._block_size = 0
        self._spill = None
        self._spill_dir = spill_dir or os.environ.get("TIDEMARK_SPILL_DIR") or None
        self.spilled_bytes = 0
        self.codec = codec
        self._compress = block_compressor(codec)

    def branch(self, table: TableSchema) -> bytes:
        """The encoded union index of ``table``'s record in this segment (registered on first use)."""
        name = table.record_name
        b = self._branches.get(name)
        if b is None:
            b = avro_long(len(self.tables))
            self._branches[name] = b
            self.tables.append(table)
        return b

    def append(self, datum: bytes) -> None:
        """Add one encoded datum (an array of updates or an event) after the others."""
        self._block.append(datum)
        self._block_size += len(datum)
        if self._block_size >= BLOCK_BYTES:
            self._spill_block()

    def _spill_block(self) -> None:
        if self._spill is None:
            self._spill = tempfile.TemporaryFile(dir=self._spill_dir, prefix="tidemark-segment-")
        framed = self._frame(self._block, self._block_size)
        self._block, self._block_size = [], 0
        self._spill.write(framed)
        self.spilled_bytes += len(framed)

    def _frame(self, datums: list[bytes], size: int) -> bytes:
        """One container block: datum count, byte size, the (compressed) datums, the sync marker."""
        if self._compress is None:
            return b"".join([avro_long(len(datums)), avro_long(size), *datums, self._sync])
        body = self._compress(datums[0] if len(datums) == 1 else b"".join(datums))   # a huge datum: not copied
        return b"".join([avro_long(len(datums)), avro_long(len(body)), body, self._sync])

    def close(self) -> None:
        """Drop the spill file (also done when the writer is garbage-collected or the process dies)."""
        if self._spill is not None:
            self._spill.close()
            self._spill = None

    def _chunks(self, upper: int) -> Iterator[bytes]:
        """The segment file's bytes for ``[lower, upper)`` in pieces (deterministic)."""
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
            "avro.codec": self.codec.encode(),
            "tidemark.format": FORMAT_VERSION.encode(),
            "tidemark.stream": self.stream.encode(),
            "tidemark.seq": str(self.seq).encode(),
            "tidemark.relations": json.dumps({t.record_name: t.to_json() for t in self.tables},
                                             sort_keys=True).encode(),
        }
        out = [b"Obj\x01", avro_long(len(metadata))]
        for k, v in metadata.items():
            out.append(avro_string(k))
            out.append(avro_bytes(v))
        out.append(b"\x00")
        out.append(self._sync)
        yield b"".join(out)
        if self._spill is not None:
            self._spill.flush()
            self._spill.seek(0)
            while chunk := self._spill.read(COPY_BYTES):
                yield chunk
            self._spill.seek(0, os.SEEK_END)
        yield self._frame([*self._block, progress], self._block_size + len(progress))

    def write(self, fh: BinaryIO, upper: int) -> None:
        """Write the segment file for ``[lower, upper)`` to ``fh`` (memory: one block at a time)."""
        for chunk in self._chunks(upper):
            fh.write(chunk)

    def build(self, upper: int) -> bytes:
        """The segment file's bytes for ``[lower, upper)`` (deterministic)."""
        return b"".join(self._chunks(upper))


class SegmentBuilder(SegmentWriter):
    """Collect a segment's records from `Update` and `Event` objects (whole transactions), then
    `build` its bytes with the same framing as the drain's fast path."""

    def __init__(self, stream: str, seq: int, lower: int, *, codec: str = DEFAULT_CODEC):
        super().__init__(stream, seq, lower, codec=codec)
        self._field_names: dict[str, list[str]] = {}
        self._schema = None
        self._update_schema = None

    @property
    def record_count(self) -> int:
        return self.records

    @property
    def txn_count(self) -> int:
        return self.txns

    def add_table(self, table: TableSchema) -> str:
        name = table.record_name
        if name not in self._field_names:
            self.branch(table)
            self._field_names[name] = avro_field_names(table.columns)
            self._schema = None
        return name

    def add_transaction(self, updates: list[Update], events: Iterable[Event] = ()) -> None:
        """Append one whole transaction (updates and events, any order: stored by position)."""
        items: list[tuple[int, Any]] = [(u.position, u) for u in updates] + [(e.position, e) for e in events]
        items.sort(key=lambda x: x[0])
        datums: list[Any] = []
        batch: list[dict] = []
        prev = None
        for _, item in items:
            if isinstance(item, Update):
                # an array holds at most ARRAY_MAX_RECORDS updates (as the drain writes them), never
                # parting an update's +1 from its -1 just before it
                if len(batch) >= ARRAY_MAX_RECORDS and not (
                        item.diff > 0 and isinstance(prev, Update) and prev.diff < 0
                        and prev.position == item.position - 1 and prev.time == item.time):
                    datums.append(batch)
                    batch = []
                batch.append(self.encode_update(item))
            else:
                if batch:
                    datums.append(batch)
                    batch = []
                datums.append(("com.tidemark.event", {
                    "kind": item.kind, "table": item.table, "time": item.time, "xid": item.xid,
                    "position": item.position, "commit_ts": item.commit_ts,
                    "detail": json.dumps(item.detail, sort_keys=True)}))
            prev = item
            self.counts[item.time] = self.counts.get(item.time, 0) + 1
            self.records += 1
            cts = item.commit_ts
            self.min_commit_ts = cts if self.min_commit_ts is None else min(self.min_commit_ts, cts)
            self.max_commit_ts = cts if self.max_commit_ts is None else max(self.max_commit_ts, cts)
        if batch:
            datums.append(batch)
        if self._schema is None:
            full = segment_schema(self.tables)
            self._schema = fastavro.parse_schema(full)
            self._update_schema = fastavro.parse_schema(full[0]["items"])
        for d in datums:
            buf = io.BytesIO()
            if isinstance(d, list):     # an array of updates: one block (count -1, byte size) per update
                parts = [b"\x00"]
                for u in d:
                    one = io.BytesIO()
                    fastavro.schemaless_writer(one, self._update_schema, u)
                    rec = one.getvalue()
                    parts += (b"\x01", avro_long(len(rec)), rec)
                parts.append(b"\x00")
                self.append(b"".join(parts))
                continue
            fastavro.schemaless_writer(buf, self._schema, d)
            self.append(buf.getvalue())
        self.txns += 1

    def encode_update(self, u: Update) -> dict:
        rname = self.add_table(u.table)
        fnames = self._field_names[rname]
        data = {f: u.row.get(c.name) for f, c in zip(fnames, u.table.columns)}
        return {"data": (rname if "." in rname else f"tidemark.data.{rname}", data), "time": u.time, "diff": u.diff,
                "table": u.table.qualified, "xid": u.xid, "position": u.position, "commit_ts": u.commit_ts,
                "image": u.image, "unchanged_toast": list(u.unchanged_toast)}


@dataclass
class SegmentColumns(SegmentHeader):
    """What a segment says, decoded column by column (`read_segment_columns`): per table shape
    (Avro record name), its updates' fields as arrays in file order, and the row values per column."""

    # record name -> {"time", "diff", "xid", "position", "commit_ts", "order"}: int64 numpy arrays ("order":
    # each update's index among the segment's updates); "image": a numpy array of "full" / "key";
    # "unchanged_toast": an Arrow list<string> array; "row": {column name: an Arrow array of the Avro
    # primitive's type (`columnar.AVRO_ARROW`), or for an array column a list of lists, strings and None}
    shapes: dict[str, dict[str, Any]]
    events: list[Event]
    n_updates: int = 0
    first: int = 0          # `read_segment_pieces`: the updates of the segment before this piece
    last: bool = True       # `read_segment_pieces`: the last piece (events, progress)


UPDATE_FIELDS = ("time", "diff", "xid", "position", "commit_ts", "image", "unchanged_toast")


def read_segment_columns(data: bytes, name: str = "<segment>") -> SegmentColumns:
    """Decode a segment's bytes into columns, checking the invariants a consumer relies on (the
    checks of `read_segment`, which is built on this).

    Segments whose updates are framed one per array block (as Tidemark writes them) are decoded
    column by column (`tidemark.landing.columnar`); any other valid segment (an external producer's,
    or one written before that framing) by fastavro, with the same result.

    Raises `SegmentError` naming the segment, the record number and the reason.
    """
    from tidemark.landing.columnar import decode_columnar

    decoded = decode_columnar(data, name) if os.environ.get("TIDEMARK_SEGMENT_DECODER") != "fastavro" else None
    try:
        meta, relations, shapes, events, progress, n = decoded or _decode_fastavro(data, name)
        return _checked(name, meta, relations, shapes, events, progress, n)
    except (KeyError, TypeError) as exc:     # a writer schema whose records lack the format's fields
        raise SegmentError(name, f"cannot decode: a record lacks the field {exc} (not the segment schema)") from exc


def _relations(meta: dict, name: str) -> dict[str, TableSchema]:
    if meta.get("tidemark.format") != FORMAT_VERSION:
        raise SegmentError(name, f"unknown tidemark.format {meta.get('tidemark.format')!r}")
    try:
        return {k: TableSchema.from_json(v) for k, v in json.loads(meta["tidemark.relations"]).items()}
    except (KeyError, ValueError, TypeError) as exc:
        raise SegmentError(name, f"bad tidemark.relations header: {exc}") from exc


def _decode_fastavro(data: bytes, name: str):
    try:
        reader = fastavro.reader(io.BytesIO(data), return_record_name=True)
    except Exception as exc:  # fastavro raises ValueError/EOFError/SchemaParseException variants
        raise SegmentError(name, f"not an Avro object container file: {exc}") from exc
    meta = reader.metadata
    relations = _relations(meta, name)
    groups: dict[str, list] = {}        # full Avro record name -> its updates (fastavro dicts), in file order
    orders: dict[str, list] = {}
    first: dict[str, int] = {}          # full record name -> the record number of its first update
    events: list[Event] = []
    progress = None
    idx = -1
    n = 0
    try:
        for datum in reader:
            idx += 1
            if progress is not None:
                raise SegmentError(name, "a record follows the progress record", record=idx)
            if isinstance(datum, list):
                for u in datum:
                    full = u["data"][0]
                    group = groups.get(full)
                    if group is None:
                        group = groups[full] = []
                        orders[full] = []
                        first[full] = idx
                    group.append(u)
                    orders[full].append(n)
                    n += 1
            else:
                rname, rec = datum
                if rname == "com.materialize.cdc.progress":
                    progress = rec
                elif rname == "com.tidemark.event":
                    events.append(Event(kind=rec["kind"], table=rec["table"], time=rec["time"], xid=rec["xid"],
                                        position=rec["position"], commit_ts=rec["commit_ts"],
                                        detail=json.loads(rec["detail"])))
                else:
                    raise SegmentError(name, f"unexpected record type {rname}", record=idx)
    except SegmentError:
        raise
    except Exception as exc:
        raise SegmentError(name, f"cannot decode: {exc}", record=idx + 1) from exc
    shapes: dict[str, dict[str, Any]] = {}
    for full in sorted(groups, key=lambda f: first[f]):
        rname = full.rsplit(".", 1)[-1]
        table = relations.get(rname)
        if table is None:
            raise SegmentError(name, f"update for unknown table shape {rname}", record=first[full])
        ups = groups[full]
        cols: dict[str, Any] = {f: [u[f] for u in ups] for f in UPDATE_FIELDS}
        cols["order"] = orders[full]
        rows = [u["data"][1] for u in ups]
        try:
            cols["row"] = {col: [r[f] for r in rows] for f, col in zip(avro_field_names(table.columns),
                                                                      (c.name for c in table.columns))}
        except KeyError as exc:
            raise SegmentError(name, f"cannot decode: shape {rname} lacks field {exc}", record=first[full]) from exc
        if rname in shapes:         # one shape written under two full names: keep them together
            for f in (*UPDATE_FIELDS, "order"):
                shapes[rname][f] += cols[f]
            for c, v in cols["row"].items():
                shapes[rname]["row"][c] += v
        else:
            shapes[rname] = cols
    return meta, relations, {r: _as_columns(cols, relations[r]) for r, cols in shapes.items()}, events, progress, n


def _as_columns(cols: dict, table: TableSchema) -> dict:
    """fastavro's lists in the form `columnar` decodes into (`SegmentColumns.shapes`)."""
    import numpy as np
    import pyarrow as pa

    from tidemark.landing.columnar import AVRO_ARROW

    out = {f: np.array(cols[f], np.int64) for f in ("time", "diff", "xid", "position", "commit_ts")}
    out["image"] = np.array(cols["image"], "<U4")
    out["unchanged_toast"] = pa.array(cols["unchanged_toast"], pa.list_(pa.string()))
    out["order"] = np.array(cols["order"], np.int64)
    row = {}
    for col in table.columns:
        atype = avro_type(col)
        values = cols["row"][col.name]
        row[col.name] = pa.array(values, AVRO_ARROW[atype[1]]) if isinstance(atype[1], str) else values
    out["row"] = row
    return out


def _time_counts(shapes: dict, seen: Counter, first_at: dict[int, int]) -> None:
    """Add the updates of ``shapes`` to ``seen`` (records per time) and ``first_at`` (per time, the
    number of its first update in the segment)."""
    import numpy as np

    for cols in shapes.values():
        at, idx, many = np.unique(cols["time"], return_index=True, return_counts=True)
        seen.update(dict(zip(at.tolist(), many.tolist())))
        for t, o in zip(at.tolist(), cols["order"][idx].tolist()):
            if o < first_at.get(t, o + 1):
                first_at[t] = o


def _checked_times(name: str, progress, seen: Counter, first_at: dict[int, int], events: list):
    """(lower, upper, counts) of the progress record, once every update's time is in ``seen`` and
    ``first_at`` (`_time_counts`): raises `SegmentError` for a record outside ``[lower, upper)`` or more
    records at a time than the progress counts say."""
    if progress is None:
        raise SegmentError(name, "no progress record (truncated file?)")
    if len(progress["lower"]) != 1 or len(progress["upper"]) != 1:
        raise SegmentError(name, "progress lower/upper must have exactly one element")
    lower, upper = progress["lower"][0], progress["upper"][0]
    counts = {c["time"]: c["count"] for c in progress["counts"]}
    outside = [(o, t) for t, o in first_at.items() if not (lower <= t < upper)]    # the first such update
    if outside:
        raise SegmentError(name, f"record at time {min(outside)[1]} outside [{lower}, {upper})")
    seen = Counter(seen)
    for e in events:
        if not (lower <= e.time < upper):
            raise SegmentError(name, f"record at time {e.time} outside [{lower}, {upper})")
        seen[e.time] += 1
    for t, c in seen.items():
        if counts.get(t, 0) < c:
            raise SegmentError(name, f"{c} records at time {t} but progress counts say {counts.get(t, 0)}")
    return lower, upper, counts


def _checked(name: str, meta: dict, relations: dict, shapes: dict, events: list, progress, n: int) -> SegmentColumns:
    seen: Counter = Counter()
    first_at: dict[int, int] = {}
    _time_counts(shapes, seen, first_at)
    lower, upper, counts = _checked_times(name, progress, seen, first_at, events)
    return SegmentColumns(stream=meta.get("tidemark.stream", ""), seq=int(meta.get("tidemark.seq", "-1")),
                          lower=lower, upper=upper, counts=counts, relations=relations, shapes=shapes,
                          events=events, n_updates=n)


PIECE_RECORDS = 65_536     # updates per piece of `read_segment_pieces` unless told


def read_segment_pieces(data: bytes, name: str = "<segment>", max_records: int = PIECE_RECORDS
                        ) -> Iterator[SegmentColumns]:
    """`read_segment_columns` piece by piece, so that one huge segment (one huge transaction) is never
    decoded at once: `SegmentColumns` of runs of container blocks holding at least ``max_records``
    updates each (`columnar.decode_columnar_pieces`: at most ``max_records`` plus one block's), each
    shape's ``order`` counting from the segment's first update, ``first`` the number of updates before
    the piece. Only the last piece (``last``) carries the events and the progress record's ``lower``,
    ``upper`` and ``counts`` (-1, -1 and ``{}`` before). The checks of `read_segment_columns` are made
    when the last piece is decoded, so a segment that fails them raises `SegmentError` after its
    earlier pieces were given (a consumer must not take them as the whole). A segment the columnar
    decoder cannot read is decoded whole by fastavro, as `read_segment_columns` does (after pieces
    already given: only its updates from the first one not given yet)."""
    from tidemark.landing.columnar import decode_columnar_pieces

    done = 0
    seen: Counter = Counter()
    first_at: dict[int, int] = {}
    if os.environ.get("TIDEMARK_SEGMENT_DECODER") != "fastavro":
        pieces = decode_columnar_pieces(data, name, max_records)
        try:
            for meta, relations, shapes, events, progress, n, first in pieces:
                _time_counts(shapes, seen, first_at)
                stream, seq = meta.get("tidemark.stream", ""), int(meta.get("tidemark.seq", "-1"))
                if progress is None:
                    yield SegmentColumns(stream=stream, seq=seq, lower=-1, upper=-1, counts={}, relations=relations,
                                         shapes=shapes, events=[], n_updates=n, first=first, last=False)
                    done = first + n
                    continue
                lower, upper, counts = _checked_times(name, progress, seen, first_at, events)
                yield SegmentColumns(stream=stream, seq=seq, lower=lower, upper=upper, counts=counts,
                                     relations=relations, shapes=shapes, events=events, n_updates=n, first=first)
                return
        except SegmentError:
            raise
        except Exception:  # noqa: BLE001 - as `columnar.decode_columnar`: fastavro decodes it or says why
            pass
    whole = read_segment_columns(data, name) if not done else _decoded_by_fastavro(data, name)
    if done:
        whole.shapes = {r: _from_order(cols, done) for r, cols in whole.shapes.items()}
        whole.shapes = {r: cols for r, cols in whole.shapes.items() if len(cols["time"])}
        whole.first = done
    yield whole


def _decoded_by_fastavro(data: bytes, name: str) -> SegmentColumns:
    try:
        return _checked(name, *_decode_fastavro(data, name))
    except (KeyError, TypeError) as exc:     # a writer schema whose records lack the format's fields
        raise SegmentError(name, f"cannot decode: a record lacks the field {exc} (not the segment schema)") from exc


def _from_order(cols: dict, done: int) -> dict:
    """A shape's columns (`SegmentColumns.shapes`) without its updates before update number ``done``."""
    import numpy as np
    import pyarrow as pa

    keep = np.nonzero(cols["order"] >= done)[0]
    out = {}
    for k, v in cols.items():
        if k == "row":
            out[k] = {c: (a.take(pa.array(keep)) if isinstance(a, (pa.Array, pa.ChunkedArray))
                          else [a[i] for i in keep.tolist()]) for c, a in v.items()}
        elif isinstance(v, (pa.Array, pa.ChunkedArray)):
            out[k] = v.take(pa.array(keep))
        else:
            out[k] = v[keep]
    return out


def read_segment(data: bytes, name: str = "<segment>") -> SegmentContent:
    """Decode a segment's bytes into `Update` and `Event` objects (updates in file order), checking
    the invariants a consumer relies on (`read_segment_columns`).

    Raises `SegmentError` naming the segment, the record number and the reason.
    """
    content = read_segment_columns(data, name)
    updates: list[Any] = [None] * content.n_updates
    for rname, cols in content.shapes.items():
        table = content.relations[rname]
        names = list(cols["row"])
        values = list(zip(*(_pylist(v) for v in cols["row"].values()))) if names else [()] * len(cols["time"])
        f = {k: _pylist(cols[k]) for k in (*UPDATE_FIELDS, "order")}
        for i, o in enumerate(f["order"]):
            updates[o] = Update(table=table, row=dict(zip(names, values[i])), time=f["time"][i],
                                diff=f["diff"][i], xid=f["xid"][i], position=f["position"][i],
                                commit_ts=f["commit_ts"][i], image=f["image"][i],
                                unchanged_toast=tuple(f["unchanged_toast"][i]))
    return SegmentContent(stream=content.stream, seq=content.seq, lower=content.lower, upper=content.upper,
                          counts=content.counts, relations=content.relations, updates=updates,
                          events=content.events)


def _pylist(values) -> list:
    """A column of `SegmentColumns` (numpy, Arrow or a list) as a list of Python values."""
    if hasattr(values, "to_pylist"):         # Arrow
        return values.to_pylist()
    return values.tolist() if hasattr(values, "tolist") else list(values)


def checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
