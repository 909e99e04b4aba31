"""Row identity by value bits: the one equality of rows Tidemark uses wherever rows are compared
(feed dedup, a changelog's integration, reads at a frontier, parity, consolidating keyless tables;
why: docs/internals/storage.md). Two floats are the same value when their bits are: a NaN equals a
NaN (every NaN one value, its bits canonical) and -0.0 is not 0.0.

`identity_table` makes Arrow's equality (``group_by``, joins, ``equal``) this identity; `row_keys`
gives one hashable key per row (equal exactly when the rows are the same); `rows_of` builds the
Arrow table of Python rows, so that Python rows and lake rows are keyed the same way.
"""

from __future__ import annotations

from typing import Any, Iterable

_BITS = {16: "int16", 32: "int32", 64: "int64"}


def _identity_type(t):
    """The Arrow type a column of type ``t`` is compared as (None: as itself)."""
    import pyarrow as pa

    if pa.types.is_floating(t):
        return getattr(pa, _BITS[t.bit_width])()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        inner = _identity_type(t.value_type)
        if inner is None:
            return None
        return pa.list_(inner) if pa.types.is_list(t) else pa.large_list(inner)
    if pa.types.is_timestamp(t) or pa.types.is_time64(t) or pa.types.is_duration(t) or pa.types.is_date64(t):
        return pa.int64()
    if pa.types.is_date32(t) or pa.types.is_time32(t):
        return pa.int32()
    return None


def _identity_array(arr):
    """One Arrow array (not chunked) in its identity type: the same bits, viewed as integers."""
    import pyarrow as pa

    t = arr.type
    target = _identity_type(t)
    if target is None:
        return arr
    if pa.types.is_floating(t):                        # the bits themselves, every NaN one value, nulls kept
        import numpy as np
        import pyarrow.compute as pc

        width = np.float16 if t.bit_width == 16 else np.float32 if t.bit_width == 32 else np.float64
        v = np.array(pc.fill_null(arr, 0).to_numpy(zero_copy_only=False), dtype=width)
        v[np.isnan(v)] = np.nan
        return pa.array(v.view(getattr(np, str(target))), type=target,
                        mask=np.asarray(arr.is_null()) if arr.null_count else None)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        cls = pa.ListArray if pa.types.is_list(t) else pa.LargeListArray
        values = _identity_array(arr.values)
        # offsets of a sliced list array are relative to its values: rebuild from the buffers
        return cls.from_buffers(target, len(arr), [arr.buffers()[0], arr.buffers()[1]], arr.null_count,
                                arr.offset, [values])
    return arr.view(target)                            # temporal: its integer storage


def identity_table(table):
    """``table`` with every column in its identity type (see the module doc): Arrow's equality and
    hashing on the result are equality by value bits."""
    import pyarrow as pa

    arrays, fields = [], []
    for f, col in zip(table.schema, table.columns):
        target = _identity_type(f.type)
        if target is None:
            arrays.append(col)
            fields.append(f)
            continue
        arrays.append(pa.chunked_array([_identity_array(c) for c in col.chunks], type=target))
        fields.append(pa.field(f.name, target, f.nullable))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _hashable(v: Any) -> Any:
    """A nested value (lists, a map's ``(key, value)`` entries, a struct's dict) as a hashable tuple;
    a float that `identity_table` left (inside a map or a struct) as its bits, every NaN one value."""
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple((k, _hashable(x)) for k, x in v.items())
    if isinstance(v, float):
        import struct

        return ("\x00f", struct.pack("<d", float("nan") if v != v else v))
    return v


def row_keys(table) -> list[tuple]:
    """One hashable key per row of ``table`` (an Arrow table or record batch): equal keys = the same
    row by value bits (floats compared as their bits, nulls equal to nulls)."""
    import pyarrow as pa

    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    ident = identity_table(table)
    if ident.num_columns == 0:
        return [()] * table.num_rows
    cols = []
    for f, col in zip(ident.schema, ident.columns):
        values = col.to_pylist()
        if pa.types.is_nested(f.type):
            values = [_hashable(v) for v in values]
        cols.append(values)
    return list(zip(*cols))


def rows_of(rows: Iterable[dict], schema):
    """The Arrow table of ``rows`` (dicts by column name, missing names null) with ``schema``."""
    import pyarrow as pa

    return pa.Table.from_pylist([{n: r.get(n) for n in schema.names} for r in rows], schema=schema)


def key_text(key: tuple) -> str:
    """A short stable text of a row key (for records and messages; floats show as their bits)."""
    import hashlib

    return hashlib.sha256(repr(key).encode()).hexdigest()[:16]
