"""Merge: one group of a table's buckets, in an executor — every change shape, one pass.

`merge_tasks` (a ``mapInArrow`` body) reads each of its groups' parts from the run's work area and
`merge_group` takes the group's records (meta columns + the table's columns, as the decoding cut
them), keeps those in ``[lower, frontier)``, and `merge_records` works out, for all of them at once:

* **images** — every record's full row, column by column: its own value, else the key's latest
  known value earlier in the batch, else the lake row's. An update that changed the key and left
  TOAST values unchanged takes them from the old key's image just before it (the ``-1`` at its
  ``(time, position - 1)``), followed across chains of key changes; the driver puts the buckets
  such updates join into one group (`batch._groups`), so the old key is always in the group;
* **truncates** — the batch is cut into epochs by the table's truncates: at a truncate every row
  present then gets a ``-1`` at its time and the epoch after it starts from an empty table;
* **tables without a key** (REPLICA IDENTITY FULL: multisets of whole rows) — inserts and deletes
  are counted per identical row (floats by their bits: every NaN one value, ``-0.0`` apart from
  ``0.0``); a delete of a row the lake does not hold is an error that names it;
* **the exact changelog** — one diff per ``(data, time)``, zero sums dropped;
* **the net effect** — the group's bucket files to remove and the new ones, written here.

It then writes the changelog's Parquet files and CDC part (`_rows_out`) and returns file actions
and counts only: nothing proportional to the data goes back to the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tidemark.consolidate import layout
from tidemark.consolidate.decode import META_CTS, META_DIFF, META_FULL, META_POS, META_TIME, META_UNKNOWN
from tidemark.errors import TidemarkError

META_BUCKET = "_tm_bucket"           # a record's bucket, beside the meta columns (`decode.META_COLUMNS`)
# a re-snapshot's rows come as inserts at its LSN with this position (before any change committed at
# that LSN, after the truncate at RELOAD_POSITION - 1): synthetic records, each one kept (not deduped)
RELOAD_POSITION = -1
OUT_DDL = ("table string, target string, op string, path string, size long, rows long, stats string, "
           "partition string, bucket int, time long, count long, log binary, problem string, cdc binary")


class MergeError(TidemarkError):
    """A group's records cannot be applied (bad input: names the table, key or row and the time)."""


@dataclass
class LogPlan:
    """Where a merge group writes its changelog rows with ``time >= lo``: Parquet files into the
    changelog Delta table's directory, CDC updates as container blocks framed with ``sync`` into the
    landing store under ``parts`` (`changelog.Written`); the driver commits and frames them."""

    uri: str
    lo: int
    sync: bytes
    parts: str
    store: tuple                     # (url, endpoint_url, region) of the landing store


@dataclass
class TablePlan:
    """What the executors need to merge one table's buckets (picklable)."""

    table: str
    bucket_plan: layout.BucketPlan
    values: list[str]
    lower: int
    frontier: int
    full: Any = None                 # pyarrow schema: meta columns + the table's columns
    log: LogPlan | None = None       # where the executors write the table's changelog (None: committed already)
    truncates: list = field(default_factory=list)   # [(time, position, commit_ts)] in [lower, frontier), in order
    replay: bool = False             # only the changelog rows, to the driver; no file written (`batch.replay`)
    fill: dict = field(default_factory=dict)        # column -> the value rows lacking it hold (ADD ... DEFAULT)
    history: Any = None              # `history.HistorySpec`: its history kept in the same tasks (`history.in_merge`)


def merge_tasks(batches, tasks: list, plans: dict[str, TablePlan], work):
    """``mapInArrow`` body over a ``spark.range``: task ids in; each of the task's groups
    (`batch.Group`) merged (`merge_group`), its parts read from the run's work area
    (`decode.read_parts`); file actions and counts out (`_rows_out`)."""
    from tidemark.consolidate.decode import read_parts

    store = work.open()
    for batch in batches:
        for i in batch.column("id").to_pylist():
            for g in tasks[i]:
                blobs = read_parts(store, work, [(name, offset, size) for name, offset, size, _ in g.parts])
                yield from merge_group(plans[g.table], g.buckets, [(b, blob) for (*_, b), blob in
                                                                   zip(g.parts, blobs)]).to_batches()


def merge_group(plan: TablePlan, buckets: list[int], parts: list[tuple[int, bytes]]):
    """One group of a table's buckets: its parts (``(bucket, Arrow IPC bytes)``, as the decoding cut
    them: in a shape of the table's, each record in its part's bucket) merged; file actions and counts
    out (`_rows_out`). A bucket without parts still takes the table's truncates (its rows all get a
    ``-1``)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from tidemark.consolidate.decode import conform_payload

    table = plan.table
    # one thread: a task's parts are small, and the executor's other tasks use the other cores
    single = pa.ipc.IpcReadOptions(use_threads=False)
    tables = [pa.ipc.open_stream(blob, options=single).read_all() for _, blob in parts]
    if not tables:
        recs = plan.full.empty_table()
    elif all(t.schema.equals(tables[0].schema) for t in tables[1:]):      # conformed once
        recs = conform_payload(pa.concat_tables(tables) if len(tables) > 1 else tables[0], plan.full, table,
                               plan.fill, plan.bucket_plan.renames)
    else:
        recs = pa.concat_tables([conform_payload(t, plan.full, table, plan.fill, plan.bucket_plan.renames)
                                 for t in tables])
    rb = np.repeat(np.array([b for b, _ in parts], np.int32), [t.num_rows for t in tables])
    t = recs.column(META_TIME)
    keep = pc.and_(pc.greater_equal(t, plan.lower), pc.less(t, plan.frontier))
    if keep.null_count or not pc.all(keep).as_py():
        recs = recs.filter(keep)
        rb = rb[keep.to_numpy(zero_copy_only=False)]
    if not recs.num_rows and not plan.truncates:
        return _rows_out(table, [])
    try:
        actions, log = merge_records(plan, rb, recs, buckets=np.array(buckets, np.int32), write=not plan.replay)
    except MergeError as exc:         # bad input: nothing written, the driver raises it
        return _rows_out(table, [], problem=str(exc))
    if plan.replay:
        return _replayed(table, log)
    if plan.history is not None:
        # the group's exact changelog rows are every change of its buckets: folded into the history
        # buckets here, with no second read of them (`history.fold_merged`)
        from tidemark.consolidate.history import fold_merged

        actions = actions + [{**a, "target": "history"} for a in fold_merged(plan.history, log)]
    return _rows_out(table, actions, log, plan=plan)


def merge_records(plan: TablePlan, bucket, recs, *, buckets=None, write: bool = True):
    """Apply records (meta + table columns, any order, duplicates allowed) of one bucket (``bucket``
    an int) or of several (``bucket``: each record's, an int array): return (file actions, exact
    changelog rows in `changelog.log_schema`). ``buckets``: every bucket of the group (a bucket
    without records still takes its truncates); ``write``: False to write no file (no actions). Only the files are per bucket: a key's records are
    in one group, so the images, the changelog and the net effect are worked out for all at once."""
    import numpy as np
    import pyarrow as pa

    bp, keys = plan.bucket_plan, plan.bucket_plan.keys
    rb = np.broadcast_to(np.asarray(bucket, np.int32), recs.num_rows).copy()
    recs = recs.append_column(META_BUCKET, pa.array(rb))
    recs = _deduped(recs, keys)
    rb = recs.column(META_BUCKET).to_numpy()
    group = np.unique(np.r_[rb, np.asarray(buckets if buckets is not None else [], np.int32)]).astype(np.int32)
    truncs = sorted(plan.truncates)
    # the lake rows the batch needs: the changed keys' (a keyed table, no truncate); every row of the
    # group's buckets for a truncate or a delete from a table without a key; else (inserts into a
    # table without a key) none but the small files', merged on the way
    everything = bool(truncs) or (not keys and bool((recs.column(META_DIFF).to_numpy() < 0).any()))
    probe = recs.select(keys) if keys and not truncs else None
    files, old, old_bucket = _group_files(bp, group, rb, probe, everything=everything)
    epoch = _epochs(recs, truncs)
    logs, state, state_bucket = [], old, old_bucket
    for e in range(len(truncs) + 1):
        part = recs.filter(pa.array(epoch == e)) if truncs else recs
        if keys:
            log, state, state_bucket = _keyed(plan, part, state, state_bucket, restrict=not truncs)
        else:
            log, state, state_bucket = _multiset(plan, part, state, state_bucket)
        logs.append(log)
        if e < len(truncs):
            t, _, cts = truncs[e]
            logs.append(_as_log(state, np.full(state.num_rows, t, np.int64), np.full(state.num_rows, -1, np.int64),
                                np.full(state.num_rows, cts, np.int64), bp.schema))
            state, state_bucket = state.schema.empty_table(), np.zeros(0, np.int32)
    log = pa.concat_tables(logs) if len(logs) > 1 else logs[0]
    if len(logs) > 1:          # a truncate's -1s and the records at its time are one (data, time) set
        log = layout.cancel_zero(log)
    actions = _write(bp, files, state, state_bucket, rewrite_all=everything) if write else []
    return actions, _log_form(log, bp.schema)


def _deduped(recs, keys: list[str]):
    """Records in key order (then time, position), each identity ``(time, position)`` once."""
    import numpy as np
    import pyarrow as pa

    recs = recs.sort_by(layout.ascending(keys) + [(META_TIME, "ascending"), (META_POS, "ascending")])
    if recs.num_rows < 2:
        return recs
    pos = recs.column(META_POS).to_numpy()
    ident = recs.column(META_TIME).to_numpy().astype(np.int64) * (1 << 32) + pos
    _, first = np.unique(ident, return_index=True)
    if len(first) == recs.num_rows:
        return recs
    keep = np.zeros(recs.num_rows, bool)
    keep[first] = True
    keep |= pos == RELOAD_POSITION          # a re-snapshot's rows share one identity and are all kept
    return recs.filter(pa.array(keep))


def _epochs(recs, truncs) -> Any:
    """How many of the table's truncates come before each record (by ``(time, position)``)."""
    import numpy as np

    n = recs.num_rows
    if not truncs or not n:
        return np.zeros(n, np.int64)
    t = recs.column(META_TIME).to_numpy()
    p = recs.column(META_POS).to_numpy()
    e = np.zeros(n, np.int64)
    for tt, tp, _ in truncs:
        e += (t > tt) | ((t == tt) & (p > tp))
    return e


def _group_files(bp, group, rb, probe, *, everything: bool):
    """Per bucket of the group: its (files to rewrite, all files); and the rows of the files to
    rewrite, with each row's bucket. ``everything``: every file (a truncate, a multiset); else the
    files that may hold the changed keys ``probe`` (and the small ones, merged on the way)."""
    import numpy as np
    import pyarrow as pa

    files, olds = {}, []
    for b in group.tolist():
        if everything:
            all_files = bp.files.get(b, [])
            files[b] = (list(all_files), all_files)
        else:
            mine = probe if probe is None or len(group) == 1 else probe.filter(pa.array(rb == b))
            files[b] = layout.touched(bp, b, mine)
        olds.append(layout.read_files(bp, [f["path"] for f in files[b][0]]))
    old = pa.concat_tables(olds) if len(olds) > 1 else olds[0]
    return files, old, np.repeat(np.array(group, np.int32), [t.num_rows for t in olds])


def _keyed(plan: TablePlan, recs, lake, lake_bucket, *, restrict: bool):
    """One epoch of a keyed table: records (key order, deduped) over the rows ``lake`` (with their
    buckets). Return (its changelog rows, the rows after it, their buckets). ``restrict``: ``lake``
    holds only the rows of the files the batch rewrites (others stay as they are)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    bp, keys = plan.bucket_plan, plan.bucket_plan.keys
    target = bp.schema
    n = recs.num_rows
    if n == 0:
        return _empty_log(target), lake, lake_bucket
    t_np = recs.column(META_TIME).to_numpy()
    p_np = recs.column(META_POS).to_numpy()
    diff = recs.column(META_DIFF).to_numpy()
    full = recs.column(META_FULL).to_numpy(zero_copy_only=False)
    same_key = layout.same_as_previous(recs, keys)
    if ((diff > 0) & ~full).any():
        i = int(np.nonzero((diff > 0) & ~full)[0][0])
        raise MergeError(f"table {plan.table} key {_key_of(recs, keys, i)} at time {t_np[i]}: an insert or "
                         "update carries only the key (a +1 must carry the row's values)")
    unknown = recs.column(META_UNKNOWN)
    unknown_len = pc.fill_null(pc.list_value_length(unknown), 0).to_numpy()
    if unknown_len.any():
        flat = pc.list_flatten(unknown).to_numpy(zero_copy_only=False)
        parent = pc.list_parent_indices(unknown).to_numpy()
    # an update that changed the key and left TOAST values unchanged: its +1 is not right after its
    # own -1 in this key's records; the old image is the -1 at (time, position - 1), under the old key
    toasted = (diff > 0) & (unknown_len > 0)
    moved = np.zeros(n, bool)
    dep = np.full(n, -1)
    if toasted.any():
        i = np.nonzero(toasted)[0]
        j = np.maximum(i - 1, 0)
        paired = (i > 0) & same_key[i] & (diff[j] < 0) & (t_np[j] == t_np[i]) & (p_np[j] == p_np[i] - 1)
        mi = i[~paired]
        if len(mi):
            moved[mi] = True
            ident = t_np.astype(np.int64) * (1 << 32) + p_np
            order = np.argsort(ident)
            want = t_np[mi].astype(np.int64) * (1 << 32) + p_np[mi] - 1
            at = np.minimum(np.searchsorted(ident[order], want), n - 1)
            hit = ident[order][at] == want
            dep[mi] = np.where(hit, order[at], -1)
            bad = mi[~hit | (diff[np.maximum(dep[mi], 0)] > 0)]
            if len(bad):
                k = int(bad[0])
                raise MergeError(f"table {plan.table} key {_key_of(recs, keys, k)} at time {t_np[k]}: an update "
                                 "that changed the key left TOAST values unchanged, but the old key's -1 is not in "
                                 "the batch's group (it names no old image to take them from)")
    arange = np.arange(n)
    group_start = np.maximum.accumulate(np.where(~same_key, arange, 0))
    # each record's key looked up in the lake rows once (-1: not there): the values taken from the
    # lake, the rows an insert replaces and the rows the net effect replaces all come from it
    rec_lake = (layout.key_lookup(recs.select(keys), lake.select(keys), keys) if lake.num_rows
                else np.full(n, -1, np.int64))
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
            what = "a delete or update of" if diff[k] < 0 else "a change with unchanged TOAST values of"
            raise MergeError(f"table {plan.table} key {_key_of(recs, keys, k)} at time {t_np[k]}: {what} a row "
                             "whose previous image is neither earlier in the batch nor in the lake")
    data = layout.conform(recs, target)
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
    images = pa.Table.from_arrays(cols, schema=target)
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


def _multiset(plan: TablePlan, recs, lake, lake_bucket):
    """One epoch of a table without a key: whole-row inserts and deletes over the multiset ``lake``
    (every row of the group's buckets). Return (its changelog rows, the rows after it, buckets)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    target = plan.bucket_plan.schema
    n = recs.num_rows
    if n == 0:
        return _empty_log(target), lake, lake_bucket
    recs = recs.sort_by([(META_TIME, "ascending"), (META_POS, "ascending")])
    diff = recs.column(META_DIFF).to_numpy()
    full = recs.column(META_FULL).to_numpy(zero_copy_only=False)
    unknown = recs.column(META_UNKNOWN)
    unknown_len = pc.fill_null(pc.list_value_length(unknown), 0).to_numpy()
    t_np = recs.column(META_TIME).to_numpy()
    p_np = recs.column(META_POS).to_numpy()
    # an update's +1 that left TOAST values unchanged was filled from its own -1 while decoding
    # (`decode._filled_from_old_rows`); one still lacking values has no old row to take them from
    bad = ~full | (unknown_len > 0)
    if bad.any():
        k = int(np.nonzero(bad)[0][0])
        raise MergeError(f"table {plan.table} (no key: REPLICA IDENTITY FULL) at time {t_np[k]} position "
                         f"{p_np[k]}: a change without the whole row (unchanged TOAST values but no old image "
                         "before it: a table without a primary key needs REPLICA IDENTITY FULL)")
    data = layout.conform(recs, target)
    log = layout.cancel_zero(_as_log(data, t_np, diff, recs.column(META_CTS).to_numpy(), target))
    # the rows after the epoch: the lake's and the records', counted per identical row
    rb = recs.column(META_BUCKET).to_numpy()
    both = pa.concat_tables([lake.select(target.names), data.select(target.names)])
    counts = np.r_[np.ones(lake.num_rows, np.int64), diff.astype(np.int64)]
    keep, sums = layout.consolidated_updates(both, np.zeros(both.num_rows, np.int64), counts)
    if (sums < 0).any():
        row = layout.plain(both.take(pa.array(keep[sums < 0][:1]))).to_pylist()[0]
        raise MergeError(f"table {plan.table} (no key): cannot delete row {row}: its changes take it out more "
                         "often than the lake holds it")
    reps = np.repeat(keep, sums)
    buckets = np.r_[lake_bucket, rb].astype(np.int32)
    return log, both.take(pa.array(reps, pa.int64())), buckets[reps]


def _write(bp, files, state, state_bucket, *, rewrite_all: bool) -> list[dict]:
    """Each bucket's new files: the rows after the batch that belong to it (``state``: the rewritten
    files' rows still wanted and the new rows); the remove actions of the rewritten files first."""
    import pyarrow as pa

    names = bp.schema.names
    actions = []
    for b, (touched, all_files) in files.items():
        mine = state_bucket == b
        rows = (state if mine.all() else state.filter(pa.array(mine))).select(names)
        kept = [] if rewrite_all else layout.kept(bp, all_files, touched)
        if rewrite_all or touched or rows.num_rows:
            actions += layout.removes(touched, b)
            actions += layout.write_sorted(bp, rows, b, kept)
    return actions


def _as_log(rows, times, diffs, cts, target):
    """Changelog rows: the table's columns, ``_time``, ``_diff`` and ``_commit_ts`` (µs)."""
    import numpy as np
    import pyarrow as pa

    return (layout.conform(rows, target).append_column("_time", pa.array(np.asarray(times, np.int64)))
            .append_column("_diff", pa.array(np.asarray(diffs, np.int64)))
            .append_column("_commit_ts", pa.array(np.asarray(cts, np.int64))))


def _empty_log(target):
    import numpy as np

    return _as_log(target.empty_table(), np.zeros(0), np.zeros(0), np.zeros(0), target)


def _log_form(log, target):
    """The changelog rows in `changelog.log_schema` (``_commit_ts`` as a UTC timestamp)."""
    import pyarrow as pa

    from tidemark.consolidate.changelog import log_schema

    cts = log.column("_commit_ts").cast(pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    return layout.conform(log.set_column(log.column_names.index("_commit_ts"), "_commit_ts", cts), log_schema(target))


def _key_of(recs, keys: list[str], i: int) -> dict:
    return {k: recs.column(k)[i].as_py() for k in keys}


def _consolidate_log(log, same_key, times, keys: list[str]):
    """One diff per (data, time): rows of one key and time are summed as identical images and zero
    sums dropped (rows are ordered by key, time, position). Only keys with several records at one
    time are compared value by value."""
    import numpy as np
    import pyarrow as pa

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
    merged = shared if _pairs_apart(shared, np.r_[False, multi][idx], keys) else layout.cancel_zero(shared)
    rest = log.filter(pa.array(~flag))
    return pa.concat_tables([rest, merged.select(rest.column_names)])


def _pairs_apart(rows, cont, keys: list[str]) -> bool:
    """Whether `layout.cancel_zero` would leave ``rows`` as they are, known cheaply: the rows come in
    runs of one key and time (``cont``: the row continues the previous one's run), every run is two
    rows (an update's -1 and +1) and the two differ in a column `layout.consolidated_updates`
    groups by (so no diff is summed; rows of different runs differ in the key or the time). Keys
    that Arrow's equality may split but the grouping joins (floats: NaN) are left to `cancel_zero`."""
    import numpy as np
    import pyarrow as pa

    n = rows.num_rows
    if n % 2 or cont[0::2].any() or not cont[1::2].all():
        return False
    if (rows.column("_diff").to_numpy() == 0).any():
        return False
    if not all(layout.exactly_comparable(rows.schema.field(k).type) for k in keys):
        return False
    data = rows.select([c for c in rows.column_names if c not in ("_diff", "_commit_ts", "_time")])
    cols, _ = layout.identity_columns(data)
    if not cols:
        return False
    same = layout.same_as_previous(pa.table({f"k{i}": c for i, c in enumerate(cols)}))
    return not np.asarray(same[1::2]).any()


def _out_schema():
    import pyarrow as pa

    return pa.schema([("table", pa.string()), ("target", pa.string()), ("op", pa.string()), ("path", pa.string()),
                      ("size", pa.int64()), ("rows", pa.int64()), ("stats", pa.string()), ("partition", pa.string()),
                      ("bucket", pa.int32()), ("time", pa.int64()), ("count", pa.int64()), ("log", pa.binary()),
                      ("problem", pa.string()), ("cdc", pa.binary())])


def _replayed(table: str, log):
    """A replayed group's changelog rows as one Arrow IPC stream in a ``log`` row (`batch.replay`)."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, log.schema) as w:
        w.write_table(log)
    return pa.Table.from_pylist([{"table": table, "target": "changelog", "op": "log", "log": sink.getvalue().to_pybytes()}],
                                schema=_out_schema())


def _rows_out(table: str, actions: list[dict], log=None, plan: TablePlan | None = None, problem: str | None = None):
    """The group's result rows, file actions and counts only (never data): its table file actions,
    then, with ``log`` (its exact changelog rows), the actions of the changelog Parquet files it
    wrote for the times at or after ``plan.log.lo``, the key and size of its CDC part (the rows'
    Materialize CDC updates, `changelog.encode_updates`, as container blocks of the table's file,
    put in the landing store) and, in ``log``, the number of updates per time (int64 times, then
    int64 counts). Each group's rows hold whole keys (keyless: identical rows), so they are
    consolidated per ``(data, time)`` across the batch and the driver only frames the parts."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = [{**{k: a.get(k) for k in ("target", "op", "path", "size", "rows", "stats", "partition", "bucket",
                                       "time", "count", "problem")}, "table": table, "log": None}
            for a in actions]
    lp = plan.log if plan is not None else None
    if log is not None and lp is not None:
        at = pc.greater_equal(log.column("_time"), lp.lo)
        if at.null_count or not pc.all(at).as_py():
            log = log.filter(at)
    if log is not None and lp is not None and log.num_rows:
        import uuid

        from tidemark.consolidate import avro_columns as AC
        from tidemark.consolidate.changelog import encode_updates, write_log_files
        from tidemark.landing.store import open_store

        tag = f"{plan.frontier:016X}-{uuid.uuid4().hex[:12]}"
        rows += [{**a, "table": table, "log": None, "problem": None, "bucket": None, "time": None, "count": None}
                 for a in write_log_files(lp.uri, plan.bucket_plan.options, log, tag=tag)]
        datums = encode_updates(plan.bucket_plan.schema, log, log.column("_time"), log.column("_diff"))
        part = b"".join(AC.blocks(datums, lp.sync))
        url, endpoint, region = lp.store
        key = f"{lp.parts}{tag}.blocks"
        # a part lives until the driver copies it into the committed feed file (a crash: made again)
        open_store(url, endpoint_url=endpoint, region=region).put(key, part, durable=False)
        times, counts = np.unique(log.column("_time").to_numpy(), return_counts=True)
        rows.append({"table": table, "target": "cdc", "op": "part", "path": key, "size": len(part),
                     "count": len(datums), "log": times.astype(np.int64).tobytes() + counts.astype(np.int64).tobytes()})
    if problem is not None:
        rows.append({"table": table, "target": "table", "op": "problem", "problem": problem})
    return pa.Table.from_pylist(rows, schema=_out_schema())
