"""Which rows are identical, and the one pre-consolidation of ``(data, time, diff)`` updates built on
it (`consolidated_updates`; `cancel_zero` on changelog rows): the merge, the CDC files and the
snapshot bases all group rows this way (floats by their bits, nulls equal, lists by their row
identity: `tidemark.rowid`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tidemark.rowid import identity_table, row_keys


def plain(table):
    """``table`` with temporal columns as their integers (so infinities survive ``to_pylist``)."""
    def conv(t):
        if pa.types.is_date32(t):
            return pa.int32()
        if pa.types.is_timestamp(t) or pa.types.is_time64(t):
            return pa.int64()
        if pa.types.is_list(t):
            inner = conv(t.value_type)
            return pa.list_(inner) if inner is not None else None
        return None

    return table.cast(pa.schema([pa.field(f.name, conv(f.type) or f.type) for f in table.schema]))


def exactly_comparable(t) -> bool:
    """Whether Arrow's equality on values of type ``t`` is Python's on their `plain` values."""
    return (pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_decimal(t)
            or pa.types.is_date32(t) or pa.types.is_timestamp(t))


def same_as_previous(t, columns: list[str] | None = None):
    """For rows sorted so equal rows are adjacent: whether each row equals the previous one in
    ``columns`` (default: all; nulls equal nulls)."""
    n = t.num_rows
    same = np.ones(max(n - 1, 0), bool)
    for c in (t.columns if columns is None else [t.column(k) for k in columns]):
        a, b = c.slice(1), c.slice(0, n - 1)
        eq = pc.or_(pc.fill_null(pc.equal(a, b), False), pc.and_(a.is_null(), b.is_null()))
        same &= np.asarray(eq.combine_chunks() if hasattr(eq, "combine_chunks") else eq)
    return np.r_[False, same] if n else np.zeros(0, bool)


def identity_columns(rows) -> tuple[list, list[int]]:
    """The columns of ``rows`` that `consolidated_updates` groups by in Arrow (those whose Arrow
    equality is Python's; floats as their normalized bits), and the indices of the others (lists)."""
    cols, loose = [], []
    for i, f in enumerate(rows.schema):
        if exactly_comparable(f.type):
            cols.append(rows.column(i))
        elif pa.types.is_floating(f.type):
            cols.append(identity_table(rows.select([i])).column(0))     # its bits (`tidemark.rowid`)
        else:
            loose.append(i)
    return cols, loose


def consolidated_updates(rows, times, diffs):
    """Pre-consolidate updates: identical ``(data, time)`` summed into one, zero sums dropped.
    Return (row indices to write, their diffs), ordered by time then first occurrence.

    Rows are grouped in Arrow by time and `identity_columns`; the other columns (lists, maps,
    structs) make the groups coarser, and only the rows of groups with several members are then
    compared by their row identity (`rowid.row_keys`: value bits, nulls equal, at any depth)."""
    n = rows.num_rows
    times = np.asarray(times, np.int64)
    diffs = np.asarray(diffs, np.int64)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    comparable, loose = identity_columns(rows)
    cols = [pa.array(times), *comparable]
    key = pa.table({f"k{i}": c for i, c in enumerate(cols)})
    order = np.asarray(key.append_column("_i", pa.array(np.arange(n))).sort_by(
        [(f"k{i}", "ascending") for i in range(len(cols))] + [("_i", "ascending")]).column("_i"))
    starts = ~same_as_previous(key.take(pa.array(order)))
    group = np.cumsum(starts) - 1
    first_pos = np.nonzero(starts)[0]
    sizes = np.diff(np.r_[first_pos, n])
    sums = np.add.reduceat(diffs[order], first_pos)
    first = order[first_pos]                     # rows are sorted by original index within a group
    if loose and (sizes > 1).any():
        # groups equal on the comparable columns: compare the others value by value
        multi = np.nonzero(sizes[group] > 1)[0]
        idx = np.sort(order[multi])
        keys = row_keys(rows.take(pa.array(idx)))
        merged: dict = {}
        for r, i in enumerate(idx.tolist()):
            k = (int(times[i]), keys[r])
            if k in merged:
                merged[k][1] += int(diffs[i])
            else:
                merged[k] = [i, int(diffs[i])]
        single = sizes == 1
        first = np.r_[first[single], np.array([m[0] for m in merged.values()], np.int64)]
        sums = np.r_[sums[single], np.array([m[1] for m in merged.values()], np.int64)]
    keep = sums != 0
    first, sums = first[keep], sums[keep]
    by_time = np.lexsort((first, times[first]))
    return first[by_time].astype(np.int64), sums[by_time].astype(np.int64)


def cancel_zero(log):
    """Pre-consolidate: one diff per (data, time); zero sums are dropped (rows keep their order; a
    merged row is its first occurrence, ``_commit_ts`` included)."""
    data_cols = [c for c in log.column_names if c not in ("_diff", "_commit_ts", "_time")]
    keep, sums = consolidated_updates(log.select(data_cols), log.column("_time").to_numpy(),
                                      log.column("_diff").to_numpy())
    if len(keep) == log.num_rows:
        return log
    order = np.argsort(keep, kind="stable")
    out = log.take(pa.array(keep[order]))
    return out.set_column(out.column_names.index("_diff"), "_diff", pa.array(sums[order], pa.int64()))
