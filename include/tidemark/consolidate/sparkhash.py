"""A lake row's bucket computed in Arrow, equal to Spark's ``pmod(xxhash64(keys...), buckets)``
(`transform.bucket_expr`), which placed every row of the lake's files.

Spark's ``xxhash64(c1, c2, ...)`` is XXH64 chained over the columns: the seed starts at 42 and each
non-null value's hash becomes the seed of the next (a null leaves it unchanged). Per type:

* byte, short, int, date, boolean (1/0): ``hashInt``, XXH64 of the 4-byte little-endian value;
* long, timestamp, timestamp_ntz (microseconds), decimal of precision <= 18 (its unscaled long):
  ``hashLong``, XXH64 of the 8-byte little-endian value;
* float: ``hashInt`` of its IEEE bits, double: ``hashLong`` of its bits (``-0.0`` hashed as ``0.0``,
  every NaN as Java's one NaN);
* a wider decimal: ``hashUnsafeBytes`` of its unscaled value as Java's ``BigInteger.toByteArray``
  (big-endian two's complement, shortest form);
* string (UTF-8 bytes) and binary: ``hashUnsafeBytes``, XXH64 of the bytes;
* an array: its elements chained in order (a null element leaves the seed as it is).

Every lake type (`tidemark.pgtypes.arrow_type`) is covered. Integers and floats are hashed with numpy
(the two one-block cases of XXH64 written out below), bytes through the ``xxhash`` package
(``tests/unit/test_sparkhash.py`` compares both with Spark on generated values of every type).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pt
import xxhash

SEED = 42
_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)


def _rotl(x, r: int):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _avalanche(h):
    h = (h ^ (h >> np.uint64(33))) * _P2
    h = (h ^ (h >> np.uint64(29))) * _P3
    return h ^ (h >> np.uint64(32))


def _hash_int(v: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """XXH64 of 4 bytes (Spark's ``XXH64.hashInt``)."""
    v = v.astype(np.int32).view(np.uint32).astype(np.uint64)
    h = seed + _P5 + np.uint64(4)
    h ^= v * _P1
    h = _rotl(h, 23) * _P2 + _P3
    return _avalanche(h)


def _hash_long(v: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """XXH64 of 8 bytes (Spark's ``XXH64.hashLong``)."""
    v = v.astype(np.int64).view(np.uint64)
    h = seed + _P5 + np.uint64(8)
    h ^= _rotl(v * _P2, 31) * _P1
    h = _rotl(h, 27) * _P1 + _P4
    return _avalanche(h)


def _hash_bytes(values: list, seed: np.ndarray) -> np.ndarray:
    out = seed.copy()
    h = xxhash.xxh64_intdigest
    for i, v in enumerate(values):
        if v is not None:
            out[i] = h(v, int(seed[i]))
    return out


def kind(t) -> str | None:
    """How Spark hashes a value of the Arrow type ``t`` (module doc), or None for a type no lake column has."""
    if pt.is_int8(t) or pt.is_int16(t) or pt.is_int32(t) or pt.is_date32(t) or pt.is_boolean(t):
        return "int"
    if pt.is_int64(t) or (pt.is_timestamp(t) and t.unit == "us"):
        return "long"
    if pt.is_float32(t):
        return "float"
    if pt.is_float64(t):
        return "double"
    if isinstance(t, pa.Decimal128Type):
        return "decimal" if t.precision <= 18 else "wide"
    if pt.is_string(t) or pt.is_large_string(t):
        return "string"
    if pt.is_binary(t) or pt.is_large_binary(t):
        return "binary"
    if (pt.is_list(t) or pt.is_large_list(t)) and kind(t.value_type) is not None:
        return "list"
    return None


def _fixed(col, kind: str) -> np.ndarray:
    """A fixed-width column's values as int64 (nulls as 0; their rows keep the seed)."""
    if kind == "decimal":                 # the unscaled value: the low 8 bytes of the 16-byte two's complement
        arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
        raw = np.frombuffer(arr.buffers()[1], dtype="<i8")[arr.offset * 2:(arr.offset + len(arr)) * 2]
        return raw[0::2].copy()
    t = col.type
    if pa.types.is_boolean(t):
        return pc.fill_null(col, False).to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_date32(t):
        col = col.cast(pa.int32())
    elif pa.types.is_timestamp(t):
        col = col.cast(pa.int64())
    return pc.fill_null(col, 0).to_numpy(zero_copy_only=False).astype(np.int64)


def _float_bits(col, kind: str) -> np.ndarray:
    """Java's ``floatToIntBits`` / ``doubleToLongBits`` of a float column as int64 (``-0.0`` as
    ``0.0``, every NaN as Java's canonical one; nulls as 0)."""
    v = pc.fill_null(col, 0.0).to_numpy(zero_copy_only=False)
    v = np.where(v == 0.0, 0.0, v).astype(np.float32 if kind == "float" else np.float64)
    bits = v.view(np.int32 if kind == "float" else np.int64).astype(np.int64)
    return np.where(np.isnan(v), 0x7FC00000 if kind == "float" else 0x7FF8000000000000, bits)


def _java_bytes(col) -> list:
    """A wide decimal's unscaled values as Java's ``BigInteger.toByteArray`` (None for a null)."""
    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    words = np.frombuffer(arr.buffers()[1], dtype="<u8")[arr.offset * 2:(arr.offset + len(arr)) * 2]
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    out = []
    for lo, hi, ok in zip(words[0::2].tolist(), words[1::2].tolist(), valid.tolist()):
        if not ok:
            out.append(None)
            continue
        v = int.from_bytes((lo | hi << 64).to_bytes(16, "little"), "little", signed=True)
        out.append(v.to_bytes((v if v >= 0 else ~v).bit_length() // 8 + 1, "big", signed=True))
    return out


def _hash_column(col, h: np.ndarray) -> np.ndarray:
    """``h`` (each row's running seed) chained over one column's values."""
    how = kind(col.type)
    if how is None:
        raise TypeError(f"no Arrow form of Spark's hash for {col.type}")
    if how == "list":
        arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
        starts = arr.offsets.to_numpy()[:-1] if len(arr) else np.zeros(0, np.int64)
        values = arr.values
        for k in range(int(lengths.max()) if len(lengths) else 0):   # element k of every row that has one
            rows = np.nonzero(lengths > k)[0]
            h[rows] = _hash_column(values.take(pa.array(starts[rows] + k)), h[rows].copy())
        return h
    if how in ("string", "binary", "wide"):
        if how == "wide":
            values = _java_bytes(col)
        else:
            values = col.to_pylist()
            if how == "string":
                values = [None if v is None else v.encode() for v in values]
        return _hash_bytes(values, h)
    valid = pc.is_valid(col).to_numpy(zero_copy_only=False)
    if how in ("float", "double"):
        v = _float_bits(col, how)
        new = _hash_int(v, h) if how == "float" else _hash_long(v, h)
    else:
        v = _fixed(col, how)
        new = _hash_int(v, h) if how == "int" else _hash_long(v, h)
    return np.where(valid, new, h)


def xxhash64(table, columns: list[str]) -> np.ndarray:
    """Spark's ``xxhash64(columns...)`` of each row of ``table`` (int64)."""
    h = np.full(table.num_rows, SEED, dtype=np.int64).view(np.uint64)
    for name in columns:
        try:
            h = _hash_column(table.column(name), h)
        except TypeError as exc:
            raise TypeError(f"column {name}: {exc}") from None
    return h.view(np.int64)


def buckets(table, columns: list[str], n: int) -> np.ndarray:
    """``pmod(xxhash64(columns), n)`` of each row (int32), as `transform.bucket_expr` gives it."""
    return np.mod(xxhash64(table, columns), n).astype(np.int32)
