"""Segments, written (`SegmentWriter`, `SegmentBuilder`) and read (`tidemark.landing.segment_reader`) in the
format of `tidemark.landing.segment_format`; every importer of a segment name imports it from here.
The writer reads `BLOCK_BYTES` and `ARRAY_MAX_RECORDS` from this module (tests make them small)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from typing import Any, BinaryIO, Iterable, Iterator

import fastavro

from tidemark.errors import SegmentError
from tidemark.landing.segment_format import (  # noqa: F401 - the format's names, re-exported
    ARRAY_MAX_RECORDS, BLOCK_BYTES, CODECS, COPY_BYTES, DEFAULT_CODEC, FORMAT_VERSION, PROGRESS_SCHEMA, VARINT14,
    Event, SegmentContent, Update, avro_bytes, avro_long, avro_string, block_compressor, checksum,
    parse_segment_name, segment_name, segment_schema)
from tidemark.landing.segment_reader import (  # noqa: F401 - the reader's names, re-exported
    PIECE_RECORDS, SegmentColumns, _checked, _decode_fastavro, _pylist, read_segment, read_segment_at,
    read_segment_columns, read_segment_pieces)
from tidemark.pgtypes import avro_field_names, TableSchema


class SegmentWriter:
    """A segment's records as Avro-encoded datums (whole transactions), its table shapes, and the
    container framing. The drain appends datums it encoded itself; `SegmentBuilder` encodes
    `Update`/`Event` objects. Memory stays bounded: full blocks of about `BLOCK_BYTES`, each compressed
    with ``codec`` (`CODECS`), spill to an anonymous temporary file (``$TIDEMARK_SPILL_DIR`` or the
    system's temporary directory). `write` streams the file to a file object; `build` returns its bytes."""

    def __init__(self, stream: str, seq: int, lower: int, *, codec: str = DEFAULT_CODEC):
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
        self._spill_dir = os.environ.get("TIDEMARK_SPILL_DIR") or None
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
            out += (avro_string(k), avro_bytes(v))
        yield b"".join([*out, b"\x00", self._sync])
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

    def add_transaction(self, updates: list[Update], events: Iterable[Event] = ()) -> None:
        """Append one whole transaction (updates and events, any order: stored by position)."""
        datums: list[Any] = []
        batch: list[dict] = []
        prev = None
        for item in sorted([*updates, *events], key=lambda x: x.position):
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
            if isinstance(d, list):     # an array of updates: one block (count -1, byte size) per update
                parts = [b"\x00"]
                for rec in (_encoded(self._update_schema, u) for u in d):
                    parts += (b"\x01", avro_long(len(rec)), rec)
                self.append(b"".join([*parts, b"\x00"]))
            else:
                self.append(_encoded(self._schema, d))
        self.txns += 1

    def encode_update(self, u: Update) -> dict:
        rname = u.table.record_name
        if rname not in self._field_names:      # a new table shape: the schema grows a branch
            self.branch(u.table)
            self._field_names[rname] = avro_field_names(u.table.columns)
            self._schema = None
        fnames = self._field_names[rname]
        data = {f: u.row.get(c.name) for f, c in zip(fnames, u.table.columns)}
        return {"data": (f"tidemark.data.{rname}", data), "time": u.time, "diff": u.diff,
                "table": u.table.qualified, "xid": u.xid, "position": u.position, "commit_ts": u.commit_ts,
                "image": u.image, "unchanged_toast": list(u.unchanged_toast)}


def _encoded(schema, datum) -> bytes:
    """``datum`` in Avro's binary encoding of the parsed ``schema``."""
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, schema, datum)
    return buf.getvalue()
