"""One epoch of a merge group's records (`merge._merge_part`; epochs are cut by the table's truncates):
the records' full images and exact changelog rows over the lake rows they name, and the rows after
them, for a keyed table (`_keyed`) or a multiset of whole rows (`_multiset`); and the order and
identities of records these rely on (`_deduped`, `_identity`, `_linked`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tidemark.consolidate.key_lookup import key_lookup
from tidemark.consolidate.work_area import (META_CTS, META_DIFF, META_FULL, META_POS, META_TIME, META_UNKNOWN,
                                            RELOAD_POSITION)
from tidemark.consolidate.merge_plan import META_BUCKET, MergeError, RowImageUnknown, TablePlan
from tidemark.consolidate.preconsolidate import (cancel_zero, consolidated_updates, exactly_comparable,
                                                 identity_columns, plain, same_as_previous)
from tidemark.lake.delta import conform
from tidemark.lake.layout import ascending
from tidemark.lake.scd2 import log_schema


def _identity(times, positions):
    """One int64 per record identity ``(time, position)``, exact: the rank of its time among
    ``times`` in the high 32 bits and its (int32) position added, so ``identity - 1`` is ``(time,
    position - 1)``. (A time itself shifted by 32 bits wraps: times 2^32 apart would be one.)"""
    _, rank = np.unique(np.asarray(times), return_inverse=True)
    return rank.reshape(-1).astype(np.int64) * (1 << 32) + np.asarray(positions).astype(np.int64)


def _linked(unit, units: int, times, positions, diffs, unknown):
    """Which neighbouring units of records (``unit``: each record's, in ``[0, units)``; the records'
    times, positions, diffs and unknown columns) are merged together: an update that moved a key and
    left TOAST values alone takes them from the -1 at its (time, position - 1), so the units from one
    to the other, and those between, are one. Return a bool per pair of units (i, i + 1)."""
    toasted = (np.asarray(diffs) > 0) & (pc.fill_null(pc.list_value_length(unknown), 0).to_numpy() > 0)
    if not toasted.any():
        return np.zeros(units - 1, bool)
    ident = _identity(times, positions)
    order = np.argsort(ident, kind="stable")
    want = ident[toasted] - 1
    at = np.minimum(np.searchsorted(ident[order], want), len(order) - 1)
    hit = ident[order][at] == want
    a, b = unit[toasted][hit], unit[order[at]][hit]
    spans = np.zeros(units, np.int64)
    np.add.at(spans, np.minimum(a, b), 1)
    np.add.at(spans, np.maximum(a, b), -1)
    return np.cumsum(spans)[:-1] > 0


def _deduped(recs, keys: list[str]):
    """Records in key order (then time, position), each identity ``(time, position)`` once."""
    recs = recs.sort_by(ascending(keys) + [(META_TIME, "ascending"), (META_POS, "ascending")])
    if recs.num_rows < 2:
        return recs
    pos = recs.column(META_POS).to_numpy()
    ident = _identity(recs.column(META_TIME).to_numpy(), pos)
    _, first = np.unique(ident, return_index=True)
    if len(first) == recs.num_rows:
        return recs
    keep = np.zeros(recs.num_rows, bool)
    keep[first] = True
    keep |= pos == RELOAD_POSITION          # a re-snapshot's rows share one identity and are all kept
    return recs.filter(pa.array(keep))


def _epochs(recs, truncs) -> Any:
    """How many of the table's truncates come before each record (by ``(time, position)``)."""
    n = recs.num_rows
    if not truncs or not n:
        return np.zeros(n, np.int64)
    t = recs.column(META_TIME).to_numpy()
    p = recs.column(META_POS).to_numpy()
    e = np.zeros(n, np.int64)
    for tt, tp, _ in truncs:
        e += (t > tt) | ((t == tt) & (p > tp))
    return e


def _keyed(plan: TablePlan, recs, lake, lake_bucket):
    """One epoch of a keyed table: records (key order, deduped) over the rows ``lake`` (with their
    buckets: the lake rows of the records' keys, `_named`, or the rows after the epoch before).
    Return (its changelog rows, the rows after it, their buckets)."""
    bp, keys = plan.bucket_plan, plan.bucket_plan.keys
    target = bp.schema
    n = recs.num_rows
    if n == 0:
        return _empty_log(target), lake, lake_bucket
    t_np = recs.column(META_TIME).to_numpy()
    diff = recs.column(META_DIFF).to_numpy()
    full = recs.column(META_FULL).to_numpy(zero_copy_only=False)
    same_key = same_as_previous(recs, keys)
    if ((diff > 0) & ~full).any():
        i = int(np.nonzero((diff > 0) & ~full)[0][0])
        raise MergeError(f"table {plan.table} key {_key_of(recs, keys, i)} at time {t_np[i]}: an insert or "
                         "update carries only the key (a +1 must carry the row's values)")
    # each record's key looked up in the lake rows once (-1: not there): the values taken from the
    # lake, the rows an insert replaces and the rows the net effect replaces all come from it
    rec_lake = (key_lookup(recs.select(keys), lake.select(keys), keys) if lake.num_rows
                else np.full(n, -1, np.int64))
    images = _images(plan, recs, same_key, lake, rec_lake)
    cts = recs.column(META_CTS).to_numpy()
    log = _as_log(images, t_np, diff, cts, target)
    # an insert of a key the lake holds (its first record in the batch a +1) replaces that row: the
    # changelog takes the lake's row out at the insert's time, so it always sums to the lake
    first_in = np.nonzero(~same_key & (diff > 0))[0]
    hit = rec_lake[first_in]
    fi, li = first_in[hit >= 0], hit[hit >= 0]
    same_key_log, times_log = same_key, t_np
    if len(fi):        # each lake row's -1 goes just before its key's first record
        gone = _as_log(lake.select(target.names).take(pa.array(li, pa.int64())), t_np[fi],
                       np.full(len(fi), -1, np.int64), cts[fi], target)
        order = np.argsort(np.r_[2 * np.arange(n) + 1, 2 * fi], kind="stable")
        log = pa.concat_tables([log, gone]).take(pa.array(order, pa.int64()))
        sk = same_key.copy()
        sk[fi] = True
        same_key_log = np.r_[sk, np.zeros(len(fi), bool)][order]
        times_log = np.r_[t_np, t_np[fi]][order]
    log = _consolidate_log(log, same_key_log, times_log, keys)
    # the net effect: each key's last record; the lake's rows of other keys stay
    last = np.r_[~same_key[1:], True]
    final = images.filter(pa.array(last))
    up = diff[last] > 0
    # the lake rows of the batch's keys are replaced by their last records (or deleted)
    stays = np.ones(lake.num_rows, bool)
    replaced = rec_lake[last]
    stays[replaced[replaced >= 0]] = False
    rb = recs.column(META_BUCKET).to_numpy()
    state = pa.concat_tables([(lake if stays.all() else lake.filter(pa.array(stays))).select(target.names),
                              final.filter(pa.array(up)).select(target.names)])
    return log, state, np.r_[lake_bucket[stays], rb[last][up]].astype(np.int32)


def _images(plan: TablePlan, recs, same_key, lake, rec_lake):
    """Every record's full row (`_keyed`), column by column: its own value, else its key's latest
    known value earlier in the epoch, else the lake row's (``rec_lake``: each record's row of
    ``lake``, or -1); an update that moved the key and left TOAST values unchanged takes them from
    its old key's image (`_moved`)."""
    keys, target, n = plan.bucket_plan.keys, plan.bucket_plan.schema, recs.num_rows
    t_np = recs.column(META_TIME).to_numpy()
    diff = recs.column(META_DIFF).to_numpy()
    full = recs.column(META_FULL).to_numpy(zero_copy_only=False)
    unknown = recs.column(META_UNKNOWN)
    unknown_len = pc.fill_null(pc.list_value_length(unknown), 0).to_numpy()
    if unknown_len.any():
        flat = pc.list_flatten(unknown).to_numpy(zero_copy_only=False)
        parent = pc.list_parent_indices(unknown).to_numpy()
    moved, dep = _moved(plan, recs, same_key, (diff > 0) & (unknown_len > 0))
    arange = np.arange(n)
    group_start = np.maximum.accumulate(np.where(~same_key, arange, 0))
    # each cell's value source: a record's own value (index < n) or the lake row of a record's key
    # (n + that record); unchanged cells of moved +1s are placeholders resolved through their -1
    sources = {}
    lake_of = np.zeros(n, bool)
    for name in target.names:
        if name in keys:
            continue
        own = full.copy()
        if unknown_len.any():
            own[parent[flat == name]] = False
        hole = moved & ~own
        src = np.maximum.accumulate(np.where(own | hole, arange, -1))
        res = np.where(src >= group_start, src, n + arange)
        if hole.any():
            target_of = np.full(n, -1)
            target_of[hole] = res[dep[hole]]
            for _ in range(n + 1):       # sources point strictly back in time: chains end
                ph = (res < n) & hole[np.minimum(res, n - 1)]
                if not ph.any():
                    break
                res[ph] = target_of[res[ph]]
        sources[name] = res
        lake_of[res[res >= n] - n] = True
    # the lake rows of the keys whose values come from the lake
    lake_idx = np.full(n, -1)
    if lake_of.any():
        need = np.nonzero(lake_of)[0]
        lake_idx[need] = rec_lake[need]
        missing = need[lake_idx[need] < 0]
        if len(missing):
            k = int(missing[0])
            if diff[k] > 0:
                raise _image_unknown(plan, recs, k, "of a row whose previous image is neither earlier in the batch "
                                                    "nor in the lake")
            raise MergeError(f"table {plan.table} key {_key_of(recs, keys, k)} at time {t_np[k]}: a delete or update "
                             "of a row whose previous image is neither earlier in the batch nor in the lake")
    data = conform(recs, target)
    cols = []
    for f in target:
        if f.name in keys:          # a record's key is its own, wherever its other values come from
            cols.append(data.column(f.name))
            continue
        res = sources[f.name]
        mine = data.column(f.name).take(pa.array(np.where(res < n, res, 0), pa.int64()))
        from_lake = res >= n
        if not from_lake.any():
            cols.append(mine)
            continue
        li = lake_idx[np.where(from_lake, res - n, 0)]
        theirs = lake.column(f.name).take(pa.array(np.where(from_lake, li, 0), pa.int64()))
        cols.append(pc.if_else(pa.array(from_lake), theirs, mine))
    return pa.Table.from_arrays(cols, schema=target)


def _moved(plan: TablePlan, recs, same_key, toasted):
    """Of the +1s that left TOAST values unchanged (``toasted``), those of an update that changed the
    key: their +1 is not right after their own -1 in the key's records; the old image is the -1 at
    (time, position - 1), under the old key. Return (whether each record is one, the record its
    old image is: -1 for none)."""
    n, keys = recs.num_rows, plan.bucket_plan.keys
    t_np = recs.column(META_TIME).to_numpy()
    p_np = recs.column(META_POS).to_numpy()
    diff = recs.column(META_DIFF).to_numpy()
    moved = np.zeros(n, bool)
    dep = np.full(n, -1)
    if not toasted.any():
        return moved, dep
    i = np.nonzero(toasted)[0]
    j = np.maximum(i - 1, 0)
    paired = (i > 0) & same_key[i] & (diff[j] < 0) & (t_np[j] == t_np[i]) & (p_np[j] == p_np[i] - 1)
    mi = i[~paired]
    if not len(mi):
        return moved, dep
    moved[mi] = True
    ident = _identity(t_np, p_np)
    order = np.argsort(ident)
    want = ident[mi] - 1                  # (time, position - 1)
    at = np.minimum(np.searchsorted(ident[order], want), n - 1)
    hit = ident[order][at] == want
    dep[mi] = np.where(hit, order[at], -1)
    bad = mi[~hit | (diff[np.maximum(dep[mi], 0)] > 0)]
    if len(bad) and not hit[np.searchsorted(mi, bad[0])]:
        # no change at all before it in its transaction: an INSERT without them
        raise _image_unknown(plan, recs, int(bad[0]), "and no old image before it")
    if len(bad):
        k = int(bad[0])
        raise MergeError(f"table {plan.table} key {_key_of(recs, keys, k)} at time {t_np[k]}: an update "
                         "that changed the key left TOAST values unchanged, but the old key's -1 is not in "
                         "the batch's group (it names no old image to take them from)")
    return moved, dep


def _image_unknown(plan: TablePlan, recs, k: int, why: str) -> RowImageUnknown:
    """`RowImageUnknown` for record ``k``, a change with unchanged TOAST values ``why``."""
    key, t = _key_of(recs, plan.bucket_plan.keys, k), int(recs.column(META_TIME)[k].as_py())
    return RowImageUnknown(f"{RowImageUnknown.MARK}table {plan.table} key {key} at time {t}: a change with unchanged "
                           f"TOAST values {why} (as PostgreSQL sends an UPDATE that moved a row into the "
                           "publication's row filter and left its TOAST values alone)", key=key, time=t)


def _multiset(plan: TablePlan, recs, lake, lake_bucket):
    """One epoch of a table without a key: whole-row inserts and deletes over the multiset ``lake``
    (the lake rows equal to a changed row, `_named`, or the rows after the epoch before). Return (its
    changelog rows, the rows after it, their buckets)."""
    target = plan.bucket_plan.schema
    if not recs.num_rows:
        return _empty_log(target), lake, lake_bucket
    recs = recs.sort_by([(META_TIME, "ascending"), (META_POS, "ascending")])
    diff = recs.column(META_DIFF).to_numpy()
    full = recs.column(META_FULL).to_numpy(zero_copy_only=False)
    unknown_len = pc.fill_null(pc.list_value_length(recs.column(META_UNKNOWN)), 0).to_numpy()
    t_np = recs.column(META_TIME).to_numpy()
    p_np = recs.column(META_POS).to_numpy()
    # an update's +1 that left TOAST values unchanged was filled from its own -1 while decoding
    # (`bucket_parts.filled_from_old_rows`); one still lacking values has no old row to take them from
    bad = ~full | (unknown_len > 0)
    if bad.any():
        k = int(np.nonzero(bad)[0][0])
        raise MergeError(f"table {plan.table} (no key: REPLICA IDENTITY FULL) at time {t_np[k]} position "
                         f"{p_np[k]}: a change without the whole row (unchanged TOAST values but no old image "
                         "before it: a table without a primary key needs REPLICA IDENTITY FULL)")
    data = conform(recs, target)
    log = cancel_zero(_as_log(data, t_np, diff, recs.column(META_CTS).to_numpy(), target))
    # the rows after the epoch: the lake's and the records', counted per identical row
    rb = recs.column(META_BUCKET).to_numpy()
    both = pa.concat_tables([lake.select(target.names), data.select(target.names)])
    counts = np.r_[np.ones(lake.num_rows, np.int64), diff.astype(np.int64)]
    keep, sums = consolidated_updates(both, np.zeros(both.num_rows, np.int64), counts)
    if (sums < 0).any():
        row = plain(both.take(pa.array(keep[sums < 0][:1]))).to_pylist()[0]
        raise MergeError(f"table {plan.table} (no key): cannot delete row {row}: its changes take it out more "
                         "often than the lake holds it")
    reps = np.repeat(keep, sums)
    buckets = np.r_[lake_bucket, rb].astype(np.int32)
    return log, both.take(pa.array(reps, pa.int64())), buckets[reps]


def _as_log(rows, times, diffs, cts, target):
    """Changelog rows: the table's columns, ``_time``, ``_diff`` and ``_commit_ts`` (µs)."""
    return (conform(rows, target).append_column("_time", pa.array(np.asarray(times, np.int64)))
            .append_column("_diff", pa.array(np.asarray(diffs, np.int64)))
            .append_column("_commit_ts", pa.array(np.asarray(cts, np.int64))))


def _taken_out(rows, t: int, cts: int, target):
    """Changelog rows taking ``rows`` out (a ``-1`` each) at time ``t`` (a truncate's), commit time ``cts``."""
    n = rows.num_rows
    return _as_log(rows, np.full(n, t, np.int64), np.full(n, -1, np.int64), np.full(n, cts, np.int64), target)


def _empty_log(target):
    return _as_log(target.empty_table(), np.zeros(0), np.zeros(0), np.zeros(0), target)


def _log_form(log, target):
    """The changelog rows in `lake.scd2.log_schema` (``_commit_ts`` as a UTC timestamp)."""
    cts = log.column("_commit_ts").cast(pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    return conform(log.set_column(log.column_names.index("_commit_ts"), "_commit_ts", cts), log_schema(target))


def _key_of(recs, keys: list[str], i: int) -> dict:
    return {k: recs.column(k)[i].as_py() for k in keys}


def _consolidate_log(log, same_key, times, keys: list[str]):
    """One diff per (data, time): rows of one key and time are summed as identical images and zero
    sums dropped (rows are ordered by key, time, position). Only keys with several records at one
    time are compared value by value."""
    n = log.num_rows
    if n < 2:
        return log
    multi = same_key[1:] & (times[1:] == times[:-1])
    if not multi.any():
        return log
    flag = np.zeros(n, bool)
    flag[1:] |= multi
    flag[:-1] |= multi
    idx = np.nonzero(flag)[0]
    shared = log.take(pa.array(idx, pa.int64()))
    merged = shared if _pairs_apart(shared, np.r_[False, multi][idx], keys) else cancel_zero(shared)
    rest = log.filter(pa.array(~flag))
    return pa.concat_tables([rest, merged.select(rest.column_names)])


def _pairs_apart(rows, cont, keys: list[str]) -> bool:
    """Whether `cancel_zero` would leave ``rows`` as they are, known cheaply: the rows come in
    runs of one key and time (``cont``: the row continues the previous one's run), every run is two
    rows (an update's -1 and +1) and the two differ in a column `consolidated_updates`
    groups by (so no diff is summed; rows of different runs differ in the key or the time). Keys
    that Arrow's equality may split but the grouping joins (floats: NaN) are left to `cancel_zero`."""
    n = rows.num_rows
    if n % 2 or cont[0::2].any() or not cont[1::2].all():
        return False
    if (rows.column("_diff").to_numpy() == 0).any():
        return False
    if not all(exactly_comparable(rows.schema.field(k).type) for k in keys):
        return False
    data = rows.select([c for c in rows.column_names if c not in ("_diff", "_commit_ts", "_time")])
    cols, _ = identity_columns(data)
    if not cols:
        return False
    same = same_as_previous(pa.table({f"k{i}": c for i, c in enumerate(cols)}))
    return not np.asarray(same[1::2]).any()
