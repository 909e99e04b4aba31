"""Avro binary encoding of Arrow columns, column by column with numpy (no Python object per value).

The changelog's CDC files hold one Avro record per update (the row's fields, each a union
``["null", T]``, then ``time`` and ``diff``): `encode_rows` returns every row's encoding as one ragged
byte array (``offsets``, ``data``), which `container` frames into an Avro object container file, byte
for byte what fastavro writes for the same values (tests/unit/test_avro_columns.py checks that).

Supported Arrow types (the `cdc_file._avro_type` cases): booleans, integers, float32, float64,
strings, binary, decimal128, date32, timestamps (as their integers) and lists of those.
"""

from __future__ import annotations

import io
from typing import Any

import fastavro
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tidemark.landing.segments import block_compressor

# a ragged byte array: (offsets, int64, n + 1 entries from 0; data, uint8): row i is data[offsets[i]:offsets[i + 1]]
Ragged = tuple[np.ndarray, np.ndarray]


def _ragged_from_lengths(lengths: np.ndarray, data: np.ndarray) -> Ragged:
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets, data


def _fixed(mat: np.ndarray) -> Ragged:
    """Rows of a (n, k) uint8 matrix, k bytes each."""
    n, k = mat.shape
    return np.arange(n + 1, dtype=np.int64) * k, np.ascontiguousarray(mat).reshape(-1)


def _varint(z: np.ndarray) -> Ragged:
    """Avro's base-128 varint of unsigned 64-bit values (already zig-zagged)."""
    z = z.astype(np.uint64, copy=False)
    n = len(z)
    if n == 0:
        return np.zeros(1, np.int64), np.zeros(0, np.uint8)
    top = int(z.max())
    width = 1
    while width < 10 and top >= 1 << (7 * width):
        width += 1
    nbytes = np.ones(n, np.int64)
    for k in range(1, width):
        nbytes += z >= np.uint64(1 << (7 * k))
    if width == 1:
        return np.arange(n + 1, dtype=np.int64), z.astype(np.uint8)
    shifts = np.arange(width, dtype=np.uint64) * np.uint64(7)
    mat = ((z[:, None] >> shifts[None, :]) & np.uint64(0x7F)).astype(np.uint8)
    k = np.arange(width)[None, :]
    mat |= np.where(k < (nbytes[:, None] - 1), np.uint8(0x80), np.uint8(0))
    return _ragged_from_lengths(nbytes, mat[k < nbytes[:, None]])


def long_values(v: np.ndarray) -> Ragged:
    """Avro ``int``/``long`` encodings of integers (zig-zag, then `_varint`)."""
    v = v.astype(np.int64, copy=False)
    return _varint(((v << 1) ^ (v >> 63)).view(np.uint64))


def concat_rows(parts: list[Ragged]) -> Ragged:
    """Row by row concatenation: row i of the result is row i of each part, in order (Arrow's
    element-wise join of the parts as binary arrays: each byte copied once, in C++)."""
    n = len(parts[0][0]) - 1
    arrays = []
    for off, data in parts:
        off = np.asarray(off, np.int64)
        if off[0]:
            data, off = data[off[0]:off[-1]], off - off[0]
        arrays.append(pa.LargeBinaryArray.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(off),
                                                                              pa.py_buffer(np.ascontiguousarray(data))]))
    joined = pc.binary_join_element_wise(*arrays, pa.scalar(b"", pa.large_binary()))
    bufs = joined.buffers()
    offsets = np.frombuffer(bufs[1], np.int64)[joined.offset:joined.offset + n + 1]
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    if offsets[0]:
        data, offsets = data[offsets[0]:offsets[-1]], offsets - offsets[0]
    return offsets, data


def take_rows(r: Ragged, mask: np.ndarray) -> Ragged:
    """The rows where ``mask`` is true; the others become empty (same row count)."""
    off, data = r
    lengths = np.diff(off)
    row_of_byte = np.repeat(np.arange(len(lengths)), lengths)
    keep = mask[row_of_byte] if len(row_of_byte) else np.zeros(0, bool)
    return _ragged_from_lengths(np.where(mask, lengths, 0), data[off[0]:off[-1]][keep])


def _var_bytes(arr) -> list[Ragged]:
    """Strings/binary: varint length + the bytes (null rows: empty), as two parts (`concat_rows`)."""
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    bufs = arr.buffers()
    off = np.frombuffer(bufs[1], np.int64 if large else np.int32)[arr.offset:arr.offset + len(arr) + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    raw = (off - off[0], data[off[0]:off[-1]])
    return [long_values(np.diff(off)), raw]


def _decimal_bytes(arr) -> Ragged:
    """decimal128: varint length + the unscaled value (fastavro's ``bytes`` ``decimal`` encoding)."""
    n = len(arr)
    words = np.frombuffer(arr.buffers()[1], np.uint64)[2 * arr.offset:2 * (arr.offset + n)].reshape(n, 2)
    lo, hi = words[:, 0], words[:, 1].view(np.int64)
    lo_signed = lo.view(np.int64)
    fits = hi == (lo_signed >> 63)            # the value fits in an int64
    mag = np.where(lo_signed < 0, (~lo) + np.uint64(1), lo)      # |v| as uint64 (2**63 for INT64_MIN)
    req = np.ones(n, np.int64)
    for k in range(1, 9):
        req += mag >= np.uint64(1 << (8 * k - 1))
    small = fits & (req <= 8)
    be = lo_signed.astype(">i8").view(np.uint8).reshape(n, 8)
    col = np.arange(8)[None, :]
    lengths = np.where(small, req, 0)
    data = be[col >= (8 - lengths)[:, None]]
    body = _ragged_from_lengths(lengths, data)
    if not small.all():                        # beyond 64 bits: Python ints, row by row
        big = np.nonzero(~small)[0]
        encoded = [((int(hi[i]) << 64) | int(lo[i])) for i in big]
        encoded = [v.to_bytes((abs(v).bit_length() + 8) // 8, "big", signed=True) for v in encoded]
        big_len = np.zeros(n, np.int64)
        big_len[big] = [len(b) for b in encoded]
        big_data = np.frombuffer(b"".join(encoded), np.uint8)
        body = concat_rows([body, _ragged_from_lengths(big_len, big_data)])
    return concat_rows([long_values(np.diff(body[0])), body])


def _list_values(arr) -> Ragged:
    """Avro arrays: one block ``count, items..., 0`` (just ``0`` when empty); items are nullable."""
    n = len(arr)
    large = pa.types.is_large_list(arr.type)
    bufs = arr.buffers()
    off = np.frombuffer(bufs[1], np.int64 if large else np.int32)[arr.offset:arr.offset + n + 1].astype(np.int64)
    items = arr.values.slice(int(off[0]), int(off[-1] - off[0]))
    off = off - off[0]
    item_off, item_data = concat_rows(_column_parts(items, nullable=True))
    counts = np.diff(off)
    prefix = take_rows(long_values(counts), counts > 0)
    chunk = (item_off[off], item_data)
    end = (np.arange(n + 1, dtype=np.int64), np.zeros(n, np.uint8))
    return concat_rows([prefix, chunk, end])


def _column_parts(arr, *, nullable: bool) -> list[Ragged]:
    """Each value of an Arrow array as Avro (a ``["null", T]`` union when ``nullable``, else ``T``: then
    the array must have no nulls), as parts whose row by row concatenation it is: `encode_rows`
    concatenates the parts of every column at once, so each byte is placed once."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    n = len(arr)
    valid = np.asarray(arr.is_valid()) if arr.null_count else np.ones(n, bool)
    if not nullable and arr.null_count:
        raise ValueError(f"null in a non-nullable {t} column")
    body: Ragged | list[Ragged]
    if pa.types.is_boolean(t):
        mat = np.asarray(pc.fill_null(arr, False)).astype(np.uint8).reshape(n, 1)
        body = _fixed(mat)
    elif pa.types.is_integer(t) or pa.types.is_date32(t) or pa.types.is_timestamp(t):
        if pa.types.is_date32(t):
            arr = arr.cast(pa.int32())
        elif pa.types.is_timestamp(t):
            arr = arr.cast(pa.int64())
        vals = np.asarray(pc.fill_null(arr, 0)).astype(np.int64)
        body = long_values(vals)
    elif pa.types.is_float32(t):
        body = _fixed(np.asarray(pc.fill_null(arr, 0.0)).astype("<f4").view(np.uint8).reshape(n, 4))
    elif pa.types.is_float64(t):
        body = _fixed(np.asarray(pc.fill_null(arr, 0.0)).astype("<f8").view(np.uint8).reshape(n, 8))
    elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        body = _var_bytes(arr)
    elif pa.types.is_decimal128(t):
        body = _decimal_bytes(arr)
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        body = _list_values(arr)
    else:
        raise TypeError(f"no Avro encoding for Arrow type {t}")
    parts = body if isinstance(body, list) else [body]
    if not nullable:
        return parts
    if arr.null_count:
        parts = [take_rows(part, valid) for part in parts]
    branch = _fixed(np.where(valid, np.uint8(2), np.uint8(0)).astype(np.uint8).reshape(n, 1))
    return [branch, *parts]


def encode_rows(columns: list[tuple[Any, bool]]) -> Ragged:
    """Records of the given fields, row by row: ``columns`` = [(Arrow array, nullable union?)]."""
    return concat_rows([part for a, u in columns for part in _column_parts(a, nullable=u)])


def array_datums(rows: Ragged, *, chunk: int) -> list[bytes]:
    """Avro arrays of up to ``chunk`` consecutive records each, as datum bytes, each after the union
    branch index 0."""
    off, data = rows
    n = len(off) - 1
    out = []
    head = b"\x00"                # the union branch 0 (a zigzag varint)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        count = bytes(long_values(np.array([b - a]))[1])
        out.append(head + count + data[off[a]:off[b]].tobytes() + b"\x00")
    return out


def header(schema, *, metadata: dict[str, str] | None = None, sync: bytes | None = None,
           codec: str = "null") -> bytes:
    """An Avro object container file's header (its blocks compressed under ``codec``: null,
    deflate or zstandard), as fastavro writes it, with the sync marker ``sync`` (16 bytes; None: a
    random one, the header's last 16 bytes)."""
    buf = io.BytesIO()
    fastavro.writer(buf, schema, [], metadata=metadata or {}, sync_marker=sync, codec=codec)
    return buf.getvalue()


def blocks(datums, sync: bytes, *, block_bytes: int = 1 << 20, codec: str = "null"):
    """Yield the container blocks (count, size, datums compressed under ``codec``, ``sync``) of already
    encoded ``datums``, about ``block_bytes`` of datums each. An item may also be ``(n, bytes)``: ``n``
    datums already concatenated. Blocks made with one file's sync marker and codec, anywhere, may be
    appended to its header (`header` with that codec) in any order."""
    compress = block_compressor(codec)

    def block_of(parts: list[bytes], count: int) -> bytes:
        raw = b"".join(parts)
        if compress is not None:
            raw = compress(raw)
        return b"".join([bytes(long_values(np.array([count]))[1]), bytes(long_values(np.array([len(raw)]))[1]),
                         raw, sync])

    block: list[bytes] = []
    size = count = 0
    for d in datums:
        n, d = d if isinstance(d, tuple) else (1, d)
        block.append(d)
        size += len(d)
        count += n
        if size >= block_bytes:
            yield block_of(block, count)
            block, size, count = [], 0, 0
    if block:
        yield block_of(block, count)


def container(schema, datums: list, *, metadata: dict[str, str] | None = None, codec: str = "null") -> bytes:
    """An Avro object container file (blocks compressed under ``codec``) of already encoded ``datums``
    (`blocks`): fastavro writes the header (schema, metadata, sync marker)."""
    head = header(schema, metadata=metadata, codec=codec)
    return b"".join([head, *blocks(datums, head[-16:], codec=codec)])
