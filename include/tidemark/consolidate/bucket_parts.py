"""One table shape's decoded updates cut into parts by bucket (`by_bucket`, Spark's bucket of each
update's key: `sparkhash`), the ``data`` row of each part (`data_row`), and what ties an update's
``+1`` with unchanged TOAST values to its own ``-1``: the bucket links the merge needs (`links`) and,
for a table without a key, the old row's values filled in before hashing (`filled_from_old_rows`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tidemark.consolidate import sparkhash
from tidemark.consolidate.work_area import META_COLUMNS, META_DIFF, META_POS, META_TIME, META_UNKNOWN, ipc


def data_row(table: str, part, info: str, bucket: int | None) -> dict:
    """The fields of one part's ``data`` row (`decode`'s module doc; for `work_area.add_rows`): its newest
    time, its number of updates, its ``+1`` with unchanged TOAST values, its bytes."""
    toasted = pc.sum(pc.and_(pc.greater(part.column(META_DIFF), 0),
                             pc.greater(pc.fill_null(pc.list_value_length(part.column(META_UNKNOWN)), 0), 0)))
    return dict(table=table, time=pc.max(part.column(META_TIME)).as_py(), position=part.num_rows,
                count=toasted.as_py() or 0, payload=ipc(part), info=info, bucket=bucket)


def by_bucket(table, n: int | None, hashed: list[str], keys: list[str]):
    """(``[(bucket, rows)]``, links): one table shape's updates cut into ``n`` buckets by the
    ``hashed`` columns (in their order within one), or ``[(None, table)]`` without ``n``; and the
    ``lnk`` pairs (`links`), None when there are none."""
    if n is None:
        return [(None, table)], links(table, None, keys)
    b = sparkhash.buckets(table, hashed, n)
    pairs = links(table, b, keys)
    order = np.argsort(b, kind="stable")
    b = b[order]
    table = table.take(order)
    starts = np.r_[0, np.nonzero(np.diff(b))[0] + 1]
    ends = np.r_[starts[1:], len(b)]
    return [(int(b[a]), table.slice(a, e - a)) for a, e in zip(starts.tolist(), ends.tolist())], pairs


def _toasted_after_own_minus(table):
    """Indices of the ``+1`` records that leave TOAST values unchanged and follow their own update's
    ``-1`` (the record just before them, at ``(time, position - 1)``, in segment order)."""
    if table.num_rows < 2:
        return np.zeros(0, np.int64)
    diff = table.column(META_DIFF).to_numpy()
    toasted = (diff > 0) & (pc.fill_null(pc.list_value_length(table.column(META_UNKNOWN)), 0).to_numpy() > 0)
    toasted[0] = False
    i = np.nonzero(toasted)[0]
    t = table.column(META_TIME).to_numpy()
    p = table.column(META_POS).to_numpy()
    return i[(diff[i - 1] < 0) & (t[i - 1] == t[i]) & (p[i - 1] == p[i] - 1)]


def links(table, buckets, keys: list[str]):
    """The distinct (bucket of the ``-1``, bucket of the ``+1``) pairs of the updates whose ``+1``
    leaves TOAST values unchanged and whose ``-1`` (at ``(time, position - 1)``, the record before
    it in segment order) is in another bucket; when ``buckets`` is None (not cut), ``[(-1, -1)]``
    if such an update changed its key (``keys``; a table without one: any such update); None when
    there are none. Such a ``+1`` takes its unchanged values from that ``-1``'s image, so the
    merge must see both."""
    i = _toasted_after_own_minus(table)
    if not len(i):
        return None
    if buckets is None:
        if keys:
            same = np.ones(len(i), bool)
            for k in keys:
                c = table.column(k).take(i)
                prev = table.column(k).take(i - 1)
                same &= pc.fill_null(pc.equal(c, prev), False).to_numpy(zero_copy_only=False)
            i = i[~same]
        return np.array([[-1, -1]], np.int32) if len(i) else None
    pairs = np.stack([buckets[i - 1], buckets[i]], axis=1).astype(np.int32)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    return np.unique(pairs, axis=0) if len(pairs) else None


def filled_from_old_rows(table):
    """A table without a key (REPLICA IDENTITY FULL): an update's ``+1`` that left TOAST values
    unchanged takes them from its own ``-1`` (the whole old row, the record just before it), so the
    row is whole before it is hashed into its bucket (a multiset's bucket is a hash of every
    column). A ``+1`` without such a ``-1`` is left as it is (the merge names it)."""
    n = table.num_rows
    unknown = table.column(META_UNKNOWN)
    i = _toasted_after_own_minus(table)
    i = i[pc.fill_null(pc.list_value_length(unknown), 0).to_numpy()[i - 1] == 0]    # a whole old row
    if not len(i):
        return table
    flat = pc.list_flatten(unknown).to_numpy(zero_copy_only=False)
    parent = pc.list_parent_indices(unknown).to_numpy()
    filled = np.zeros(n, bool)
    filled[i] = True
    cols = []
    for f in table.schema:
        rows = parent[(flat == f.name) & filled[parent]] if f.name not in META_COLUMNS else []
        if not len(rows):
            cols.append(table.column(f.name))
            continue
        idx = np.arange(n)
        idx[rows] = rows - 1
        cols.append(table.column(f.name).take(pa.array(idx, pa.int64())))
    out = pa.Table.from_arrays(cols, schema=table.schema)
    empty = pa.array([[] if filled[k] else v for k, v in enumerate(unknown.to_pylist())], unknown.type)
    return out.set_column(out.schema.get_field_index(META_UNKNOWN), META_UNKNOWN, empty)
