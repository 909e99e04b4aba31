"""Rows of one table found by their key in another (`key_lookup`, `key_match`): how the merge finds a
record's lake row and a lake file's rows of the changed keys."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def key_match(left, right, keys: list[str]):
    """Row indices ``(left_idx, right_idx)`` of a left outer join on the keys (only the key columns
    are joined, so any other column type is fine): unmatched right indices are -1. Keys are equal as
    PostgreSQL's key equality has them: a float ``-0.0`` is the key ``0.0`` (the join alone tells
    them by their bits; PostgreSQL sends an update from one to the other as a key change)."""
    # the keys under plain names: Arrow reads a name starting with '.' or '[' as a path of fields
    plain = [f"_tm_k{i}" for i in range(len(keys))]
    lt = _zero_signless(left.select(keys)).rename_columns(plain).append_column(
        "_tm_l", pa.array(np.arange(left.num_rows)))
    rt = _zero_signless(right.select(keys)).rename_columns(plain).append_column(
        "_tm_r", pa.array(np.arange(right.num_rows)))
    j = lt.join(rt, keys=plain, join_type="left outer").sort_by("_tm_l")
    return (j.column("_tm_l").to_numpy(), pc.fill_null(j.column("_tm_r"), -1).to_numpy())


def key_lookup(left, right, keys: list[str]):
    """For each row of ``left``, the index of the row of ``right`` with its key, or -1; ``right``
    holds each key at most once. A one-column key of a non-floating type is a hash lookup
    (``index_in``), anything else a left outer `key_match`."""
    if left.num_rows == 0 or right.num_rows == 0:
        return np.full(left.num_rows, -1)
    if len(keys) == 1 and not pa.types.is_floating(right.schema.field(keys[0]).type):
        (k,) = keys
        col, values = left.column(k), right.column(k)
        if col.type != values.type:
            col = col.cast(values.type)
        found = _sorted_lookup(col, values)
        if found is not None:
            return found
        if right.num_rows <= 2 * left.num_rows:
            return pc.fill_null(pc.index_in(col, value_set=values.combine_chunks()), -1).to_numpy(
                zero_copy_only=False).astype(np.int64)
        # a few keys looked up in many rows (a bucket's changes in its files): the hash table is built
        # on the few distinct keys, and the many rows are probed against it
        distinct = pc.unique(col.combine_chunks())
        where = pc.index_in(values, value_set=distinct).to_numpy(zero_copy_only=False)
        found = ~np.isnan(where) if where.dtype.kind == "f" else np.ones(len(where), bool)
        row_of = np.full(len(distinct), -1, np.int64)
        row_of[where[found].astype(np.int64)] = np.nonzero(found)[0]
        return row_of[pc.index_in(col, value_set=distinct).to_numpy(zero_copy_only=False).astype(np.int64)]
    _, idx = key_match(left, right, keys)
    return idx


def _zero_signless(table):
    """``table`` with its float columns' ``-0.0`` as ``0.0`` (IEEE: ``-0.0 + 0.0`` is ``0.0``; NaN stays)."""
    for i, f in enumerate(table.schema):
        if pa.types.is_floating(f.type):
            table = table.set_column(i, f, pc.add(table.column(i), pa.scalar(0.0, f.type)))
    return table


def _sorted_lookup(col, values):
    """`key_lookup` of integers ``col`` in ``values`` by binary search, when ``values`` (a bucket's
    file rows: written sorted by the key) are strictly ascending and neither holds a null; else None."""
    if not pa.types.is_integer(values.type) or col.null_count or values.null_count:
        return None
    v = values.to_numpy()
    if not (v[1:] > v[:-1]).all():
        return None
    c = col.to_numpy()
    at = np.minimum(np.searchsorted(v, c), len(v) - 1)
    return np.where(v[at] == c, at, -1).astype(np.int64)
