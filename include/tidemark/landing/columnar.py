"""Column-by-column decoding of Tidemark's own segments with numpy: the fast path of
`tidemark.landing.segments.read_segment_columns` (how: docs/internals/storage.md).

The result is exactly `segments._decode_fastavro`'s (``tests/unit/test_segment_columnar.py`` compares
them). Anything this module does not recognize (another writer schema than `segment_schema` of the
segment's relations, another codec, arrays in counted blocks, bytes that do not decode cleanly) raises
`_Fallback` or returns None, and fastavro decodes the segment (or names what is wrong with it).
"""

from __future__ import annotations

import io
import json
import struct
from typing import Any

import fastavro
import numpy as np
import pyarrow as pa
from fastavro.read import HEADER_SCHEMA

from tidemark.errors import SegmentError
from tidemark.landing.segment_format import (EVENT_SCHEMA, PROGRESS_SCHEMA, _relations, block_decompressor,
                                             event_from_record, segment_schema)
from tidemark.pgtypes import avro_type

PAD = 16                 # zero bytes after the data: a varint read near the end stays inside the buffer

# an Avro primitive column's values as both decoders give them
AVRO_ARROW = {"int": pa.int64(), "long": pa.int64(), "double": pa.float64(), "float": pa.float32(),
              "boolean": pa.bool_(), "string": pa.large_string(), "bytes": pa.large_binary()}


class _Fallback(Exception):
    """Not for this decoder: fastavro decodes the segment."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """A zig-zag varint (Avro int/long) at ``pos`` of ``buf``: (value, next position)."""
    b = buf[pos]
    if b < 0x80:
        return (b >> 1) ^ -(b & 1), pos + 1
    z, shift = b & 0x7F, 7
    pos += 1
    while True:
        b = buf[pos]
        pos += 1
        z |= (b & 0x7F) << shift
        if b < 0x80:
            return (z >> 1) ^ -(z & 1), pos
        shift += 7
        if shift > 63:
            raise _Fallback("varint longer than 10 bytes")


def _varints(B: np.ndarray, C: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The zig-zag varints at cursors ``C`` of the byte array ``B``: (int64 values, next cursors)."""
    first = B[C]
    if len(C) == 0 or int(first.max()) < 0x80:
        v = first.astype(np.int64)
        return (v >> 1) ^ -(v & 1), C + 1
    M = B[C[:, None] + np.arange(10)]
    more = M >= 0x80
    if more.all(axis=1).any():
        raise _Fallback("varint longer than 10 bytes")
    length = np.argmin(more, axis=1) + 1
    z = np.zeros(len(C), np.uint64)
    for k in range(int(length.max())):
        part = (M[:, k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
        z |= np.where(k < length, part, np.uint64(0))
    v = (z >> np.uint64(1)).view(np.int64) ^ -(z & np.uint64(1)).view(np.int64)
    return v, C + length


def _fixed(B: np.ndarray, C: np.ndarray, width: int, dtype: str) -> np.ndarray:
    return B[C[:, None] + np.arange(width)].view(dtype).reshape(-1)


def _blobs(B: np.ndarray, C: np.ndarray, text: bool) -> tuple[Any, np.ndarray]:
    """Length-prefixed strings (``text``) or bytes at cursors ``C``."""
    n, C = _varints(B, C)
    if len(n) and int(n.min()) < 0:
        raise _Fallback("negative length")
    offsets = np.zeros(len(C) + 1, np.int64)
    np.cumsum(n, out=offsets[1:])
    payload = _gather(B, C, n, offsets)
    arr = pa.Array.from_buffers(pa.large_string() if text else pa.large_binary(), len(C),
                                [None, pa.py_buffer(offsets), pa.py_buffer(payload)])
    try:
        arr.validate(full=True)         # UTF-8
    except pa.ArrowInvalid as exc:
        raise _Fallback(str(exc)) from exc
    return arr, C + n


GATHER_BYTES = 4 << 20   # bytes of values gathered per numpy step: its index arrays are 16x this, never the data's


def _gather(B: np.ndarray, C: np.ndarray, n: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The bytes ``B[C[i]:C[i] + n[i]]`` of every value one after another (``offsets``: their cumulative
    lengths), gathered `GATHER_BYTES` at a time (a numpy gather costs 16 bytes of indices per byte):
    a value longer than that is copied as one slice."""
    total = int(offsets[-1])
    out = np.empty(total, np.uint8)
    i, m = 0, len(C)
    while i < m:
        j = max(int(np.searchsorted(offsets, offsets[i] + GATHER_BYTES, "right")) - 1, i + 1)
        a, b = int(offsets[i]), int(offsets[j])
        if j == i + 1:
            out[a:b] = B[int(C[i]):int(C[i]) + b - a]
        elif b > a:
            out[a:b] = B[np.repeat(C[i:j] - offsets[i:j], n[i:j]) + np.arange(a, b)]
        i = j
    return out


def _primitives(B: np.ndarray, C: np.ndarray, prim: str) -> tuple[Any, np.ndarray]:
    """The values of an Avro primitive at cursors ``C``: numpy for numbers and booleans, Arrow for
    strings and bytes (`AVRO_ARROW` says which Arrow type each becomes); and the next cursors."""
    if prim in ("int", "long"):
        return _varints(B, C)
    if prim == "double":
        return _fixed(B, C, 8, "<f8"), C + 8
    if prim == "float":
        return _fixed(B, C, 4, "<f4"), C + 4
    if prim == "boolean":
        return B[C] == 1, C + 1
    if prim in ("string", "bytes"):
        return _blobs(B, C, prim == "string")
    raise _Fallback(f"type {prim}")


def _py_value(buf: bytes, pos: int, prim: str):
    """One primitive value decoded in Python (array items)."""
    if prim in ("int", "long"):
        return _varint(buf, pos)
    if prim == "double":
        return struct.unpack_from("<d", buf, pos)[0], pos + 8
    if prim == "float":
        return struct.unpack_from("<f", buf, pos)[0], pos + 4
    if prim == "boolean":
        return buf[pos] == 1, pos + 1
    if prim in ("string", "bytes"):
        n, pos = _varint(buf, pos)
        if n < 0 or pos + n > len(buf):
            raise _Fallback("bad length")
        raw = buf[pos:pos + n]
        try:
            return (raw.decode("utf-8") if prim == "string" else bytes(raw)), pos + n
        except UnicodeDecodeError as exc:
            raise _Fallback(str(exc)) from exc
    raise _Fallback(f"type {prim}")


def _py_array(buf: bytes, pos: int, item) -> tuple[list, int]:
    """An Avro array (any block framing) of ``item`` (a primitive or ``["null", primitive]``)."""
    out = []
    while True:
        count, pos = _varint(buf, pos)
        if count == 0:
            return out, pos
        if count < 0:
            count = -count
            _, pos = _varint(buf, pos)
        for _ in range(count):
            if isinstance(item, list):
                branch, pos = _varint(buf, pos)
                if branch == 0:
                    out.append(None)
                    continue
                if branch != 1:
                    raise _Fallback("union branch")
                v, pos = _py_value(buf, pos, item[1])
            else:
                v, pos = _py_value(buf, pos, item)
            out.append(v)


def _column(B: np.ndarray, buf: bytes, C: np.ndarray, atype) -> tuple[Any, np.ndarray]:
    """A column's values (Avro ``["null", T]``: an Arrow array of `AVRO_ARROW`'s type; an array
    column's ``["null", array, "string"]``: a list of lists, strings and None)."""
    m = len(C)
    branch, C = _varints(B, C)
    if len(atype) == 2 and isinstance(atype[1], str):
        prim = atype[1]
        present = branch == 1
        if ((branch != 0) & ~present).any():
            raise _Fallback("union branch")
        if present.all():
            values, C = _primitives(B, C, prim)
            return (values if isinstance(values, pa.Array) else pa.array(values, AVRO_ARROW[prim])), C
        idx = np.nonzero(present)[0]
        values, moved = _primitives(B, C[idx], prim)
        C = C.copy()
        C[idx] = moved
        if isinstance(values, pa.Array):          # strings, bytes: spread over the rows, null elsewhere
            at = np.full(m, -1, np.int64)
            at[idx] = np.arange(len(idx))
            return values.take(pa.array(at, mask=~present)), C
        full = np.zeros(m, values.dtype)
        full[idx] = values
        return pa.array(full, AVRO_ARROW[prim], mask=~present), C
    item = atype[1]["items"]            # an array column: the list, or its text form, or null
    out = [None] * m
    C = C.copy()
    for i in np.nonzero(branch != 0)[0].tolist():
        b = int(branch[i])
        if b == 1:
            out[i], C[i] = _py_array(buf, int(C[i]), item)
        elif b == 2:
            out[i], C[i] = _py_value(buf, int(C[i]), "string")
        else:
            raise _Fallback("union branch")
    return out, C


IMAGES = ("full", "key")


def _lists(n: int, at: np.ndarray, items: list) -> Any:
    """An Arrow list<string> array of ``n`` rows, empty but at the rows ``at`` (``items``, in order)."""
    lengths = np.zeros(n, np.int32)
    lengths[at] = [len(x) for x in items]
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = pa.array([v for x in items for v in x], pa.string())
    return pa.ListArray.from_arrays(pa.array(offsets), flat)


def _header(data: bytes):
    """The container header (fastavro's own header schema): metadata, sync marker, where blocks start."""
    bio = io.BytesIO(data)
    header = fastavro.schemaless_reader(bio, HEADER_SCHEMA, None)
    if header["magic"] != b"Obj\x01":
        raise _Fallback("not an Avro object container file")
    return header["meta"], header["sync"], bio.tell()


_SCHEMAS: dict = {}


def _read_datum(data: bytes, pos: int, schema: dict):
    key = schema["name"]
    parsed = _SCHEMAS.get(key)
    if parsed is None:
        parsed = _SCHEMAS[key] = fastavro.parse_schema(schema)
    bio = io.BytesIO(data)
    bio.seek(pos)
    return fastavro.schemaless_reader(bio, parsed, None), bio.tell()


def decode_columnar(data: bytes, name: str = "<segment>"):
    """``(metadata, relations, shapes, events, progress, updates)`` as `segments._decode_fastavro`
    returns them, or None when fastavro should decode this segment (see the module doc)."""
    try:
        (meta, relations, shapes, events, progress, n, _), = decode_columnar_pieces(data, name, None)
        return meta, relations, shapes, events, progress, n
    except SegmentError:     # a bad Tidemark header: what the fastavro path says too
        raise
    except Exception:  # noqa: BLE001 - anything unexpected in the bytes: fastavro decodes them or says why
        return None


def decode_columnar_pieces(data: bytes, name: str, max_records: int | None):
    """The segment decoded piece by piece (the pieces of `segments.read_segment_pieces`): ``(metadata,
    relations, shapes, events, progress, updates, first)`` per run of container blocks holding at least
    ``max_records`` updates (None: one piece), ``first`` the number of updates before the piece;
    ``events`` and ``progress`` come with the last piece only (else empty and None). Only the piece's
    own inflated blocks are held. Raises `_Fallback` or another exception (before the first piece or
    after some) when this decoder cannot read the segment; `SegmentError` for a bad Tidemark header."""
    raw_meta, sync, pos = _header(data)
    meta = {k: v.decode("utf-8") for k, v in raw_meta.items()}
    codec = meta.get("avro.codec", "null")
    relations = _relations(meta, name)
    schema = json.loads(meta["avro.schema"])
    names = [b["name"] for b in schema[0]["items"]["fields"][0]["type"]]
    tables = [] if names == ["no_rows"] else [relations[n] for n in names]
    if schema != json.loads(json.dumps(segment_schema(tables))):
        raise _Fallback("another writer schema")
    decompress = block_decompressor(codec)
    limit = max_records or (1 << 62)

    bodies: list[bytes] = []        # the piece's blocks, inflated
    base = 0                        # their bytes so far
    starts: list[int] = []          # where each update of the piece starts and ends in them
    ends: list[int] = []
    add_start, add_end = starts.append, ends.append
    events = []
    progress = None
    first = 0
    size_all = len(data)
    while pos < size_all:
        count, pos = _varint(data, pos)
        size, pos = _varint(data, pos)
        end = pos + size
        if count < 0 or size < 0 or end + 16 > size_all or data[end:end + 16] != sync:
            raise _Fallback("block framing")
        body = data[pos:end] if decompress is None else decompress(data[pos:end])
        pos = end + 16
        p, stop = 0, len(body)
        for _ in range(count):
            if progress is not None:
                raise _Fallback("a record after the progress record")
            branch, p = _varint(body, p)
            if branch == 0:
                while True:         # blocks of one update: 0x01 (count -1), its size, the update; 0x00 ends
                    c = body[p]
                    if c == 0x01:
                        z = body[p + 1]
                        if z < 0x80 and not z & 1:
                            s, p = z >> 1, p + 2
                        else:
                            s, p = _varint(body, p + 1)
                            if s < 0:
                                raise _Fallback("negative block size")
                        add_start(base + p)
                        p += s
                        add_end(base + p)
                    elif c == 0x00:
                        p += 1
                        break
                    else:
                        raise _Fallback("counted array blocks")
                if p > stop:
                    raise _Fallback("an update past its block")
            elif branch == 1:
                progress, p = _read_datum(body, p, PROGRESS_SCHEMA)
            elif branch == 2:
                rec, p = _read_datum(body, p, EVENT_SCHEMA)
                events.append(event_from_record(rec))
            else:
                raise _Fallback("union branch")
        if p != stop:
            raise _Fallback("block size")
        bodies.append(body)
        base += stop
        if len(starts) >= limit and pos < size_all:
            yield meta, relations, _shape_columns(bodies, starts, ends, tables, names, first), [], None, len(starts), \
                first
            first += len(starts)
            bodies, base, starts, ends = [], 0, [], []
            add_start, add_end = starts.append, ends.append
    yield meta, relations, _shape_columns(bodies, starts, ends, tables, names, first), events, progress, \
        len(starts), first


def _shape_columns(bodies: list[bytes], starts: list[int], ends: list[int], tables: list, names: list[str],
                   first: int) -> dict:
    """The updates at ``starts``/``ends`` of the inflated blocks ``bodies`` decoded column by column,
    per table shape (`segments.SegmentColumns.shapes`; ``order`` counted from ``first``)."""
    shapes: dict = {}
    if not starts:
        return shapes
    data = b"".join([*bodies, bytes(PAD)])
    bodies.clear()
    B = np.frombuffer(data, np.uint8)
    S = np.array(starts, np.int64)
    E = np.array(ends, np.int64)
    branch, C = _varints(B, S)
    found, first_at = np.unique(branch, return_index=True)
    if int(found.min()) < 0 or int(found.max()) >= len(tables):
        raise _Fallback("data union branch")
    for b in found[np.argsort(first_at)].tolist():
        table = tables[b]
        sel = np.nonzero(branch == b)[0]
        Cb = C[sel]
        row = {}
        for col in table.columns:
            row[col.name], Cb = _column(B, data, Cb, avro_type(col))
        cols: dict = {}
        cols["time"], Cb = _varints(B, Cb)
        cols["diff"], Cb = _varints(B, Cb)
        _, Cb = _blobs(B, Cb, True)                # the table's name: not kept (the shape says it), but UTF-8
        for f in ("xid", "position", "commit_ts"):
            cols[f], Cb = _varints(B, Cb)
        image, Cb = _varints(B, Cb)
        if len(image) and (int(image.min()) < 0 or int(image.max()) > 1):
            raise _Fallback("image symbol")
        cols["image"] = np.array(IMAGES)[image]
        at = Cb
        count, Cb = _varints(B, Cb)
        lists = np.nonzero(count != 0)[0]
        toast: list = []
        Cb = Cb.copy()
        for i in lists.tolist():      # decoded from its start, blocks of any framing
            names_i, Cb[i] = _py_array(data, int(at[i]), "string")
            toast.append(names_i)
        cols["unchanged_toast"] = _lists(len(sel), lists, toast)
        if not np.array_equal(Cb, E[sel]):
            raise _Fallback("an update's fields do not end where its block does")
        cols["order"] = sel + first
        cols["row"] = row
        shapes[names[b]] = cols
    return shapes
