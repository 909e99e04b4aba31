"""Merge: one group of a table's buckets, in an executor: every change shape in one pass.

`merge_tasks` (a ``mapInArrow`` body) reads its groups' parts from the run's work area and
`merge_group` merges each group's records in ``[lower, frontier)`` (`merge_records`; a keyed group of
more records than `TablePlan.max_records` key range by key range, `merge_group_by_ranges`), writes
the changelog's files and CDC parts on the way (`_Logged`) and returns file actions and counts only.
What a merge works out, how and why: docs/internals/merge.md.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tidemark.consolidate.preconsolidate import cancel_zero
from tidemark.consolidate.recut import conform_payload
from tidemark.consolidate.work_area import META_DIFF, META_POS, META_TIME, META_UNKNOWN, RELOAD_POSITION, read_parts
from tidemark.consolidate.history import fold_merged
from tidemark.consolidate.merge_epoch import _deduped, _epochs, _keyed, _linked, _log_form, _multiset, _taken_out
from tidemark.consolidate.merge_files import _named, _parts, _rewrite, _Held
# the merge's names as other modules and tests use them (`merge_plan`, `merge_out`)
from tidemark.consolidate.merge_out import _ChangeData, _count_changes, _Logged, _rows_out
from tidemark.consolidate.merge_plan import (CHANGE_COUNTS, MERGE_RECORDS, META_BUCKET, OUT_DDL,  # noqa: F401
                                             LogPlan, MergeError, RowImageUnknown, TablePlan)
from tidemark.lake import layout


def merge_tasks(batches, tasks: list, plans: dict[str, TablePlan], work):
    """``mapInArrow`` body over a ``spark.range``: task ids in; each of the task's groups
    (`batch.Group`) merged (`merge_group`), its parts read from the run's work area
    (`work_area.read_parts`); file actions and counts out (`_rows_out`)."""
    store = work.open()
    for batch in batches:
        for i in batch.column("id").to_pylist():
            for g in tasks[i]:
                plan = plans[g.table]
                if plan.max_records and g.records > plan.max_records:
                    # a huge group: its parts read again for each key range, one at a time
                    def load(k, g=g):
                        name, offset, size, _ = g.parts[k]
                        return read_parts(store, work, [(name, offset, size)])[0]

                    ranged = merge_group_by_ranges(plan, g.buckets, [b for *_, b in g.parts], load)
                    if ranged is not None:
                        yield from ranged.to_batches()
                        continue
                blobs = read_parts(store, work, [(name, offset, size) for name, offset, size, _ in g.parts])
                yield from merge_group(plan, g.buckets, [(b, blob) for (*_, b), blob in
                                                         zip(g.parts, blobs)]).to_batches()

def merge_group(plan: TablePlan, buckets: list[int], parts: list[tuple[int, bytes]]):
    """One group of a table's buckets: its parts (``(bucket, Arrow IPC bytes)``, as the decoding cut
    them) merged; file actions and counts out (`_rows_out`), the changelog written on the way
    (`_Logged`). A bucket without parts still takes the table's truncates."""
    table = plan.table
    tables = [_ipc_table(blob) for _, blob in parts]
    if not tables:
        recs = plan.full.empty_table()
    elif all(t.schema.equals(tables[0].schema) for t in tables[1:]):      # conformed once
        recs = conform_payload(pa.concat_tables(tables) if len(tables) > 1 else tables[0], plan.full, table,
                               plan.bucket_plan.fill, plan.bucket_plan.renames)
    else:
        recs = pa.concat_tables([conform_payload(t, plan.full, table, plan.bucket_plan.fill, plan.bucket_plan.renames)
                                 for t in tables])
    rb = np.repeat(np.array([b for b, _ in parts], np.int32), [t.num_rows for t in tables])
    keep = _in_window(plan, recs)
    if not _every(keep):
        recs = recs.filter(keep)
        rb = rb[keep.to_numpy(zero_copy_only=False)]
    if not recs.num_rows and not plan.truncates:
        return _rows_out(table, [])
    # a re-snapshot of the table merged in this batch (its rows at L after a truncate at (L, RELOAD_POSITION - 1))
    reload_at = max((tr[0] for tr in plan.truncates if tr[1] == RELOAD_POSITION - 1), default=None)
    while True:       # (a retry after RowImageUnknown writes and counts anew)
        logged = None if plan.replay else _Logged(plan)
        changed = None if plan.replay else _ChangeData(plan)
        counts = dict.fromkeys(CHANGE_COUNTS, 0)
        try:
            actions, log = merge_records(plan, rb, recs, buckets=np.array(buckets, np.int32), write=not plan.replay,
                                         out=logged, counts=counts, change_data=changed)
            break
        except RowImageUnknown as exc:
            if reload_at is None or exc.time >= reload_at:
                return _rows_out(table, [], problem=str(exc))
            # values only the re-snapshot has (`RowImageUnknown`): that key's changes below it are left out,
            # the re-snapshot's rows at L bring the row in (its changelog shows it from L on)
            if changed is not None:
                changed.discard()
            drop = pc.less(recs.column(META_TIME), reload_at)
            for k, v in exc.key.items():
                drop = pc.and_(drop, pc.fill_null(pc.equal(recs.column(k), pa.scalar(v, recs.schema.field(k).type)),
                                                  False))
            keep_np = ~drop.to_numpy(zero_copy_only=False)
            recs, rb = recs.filter(pa.array(keep_np)), rb[keep_np]
        except MergeError as exc:         # bad input: nothing written, the driver raises it
            if changed is not None:
                changed.discard()
            return _rows_out(table, [], problem=str(exc))
    if plan.replay:         # the changelog rows as one Arrow IPC stream in a ``log`` row (`batch.replay`)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, log.schema) as w:
            w.write_table(log)
        return _rows_out(table, [{"target": "changelog", "op": "log", "log": sink.getvalue().to_pybytes()}])
    return _finished(plan, actions, logged, changed, counts)


def _finished(plan: TablePlan, actions: list[dict], logged: _Logged, changed: _ChangeData, counts: dict):
    """A merged group's result rows (`_rows_out`): its file actions, its history's (with the table's
    history), its change data and changelog files and its counts as a ``changes`` row."""
    if plan.history is not None:
        # the group's exact changelog rows are every change of its buckets (`history.fold_merged`)
        actions = actions + [{**a, "target": "history"} for a in fold_merged(plan.history, logged.all())]
    changes = {"target": "changes", "op": "counts", "stats": json.dumps(counts, sort_keys=True)}
    return _rows_out(plan.table, actions + changed.close() + logged.close() + [changes])


def _ipc_table(blob):
    """A part's records from its Arrow IPC bytes, read on one thread (a task's parts are small)."""
    return pa.ipc.open_stream(blob, options=pa.ipc.IpcReadOptions(use_threads=False)).read_all()


def _in_window(plan: TablePlan, recs):
    """Which records have a time in ``[lower, frontier)``."""
    t = recs.column(META_TIME)
    return pc.and_(pc.greater_equal(t, plan.lower), pc.less(t, plan.frontier))


def _every(mask) -> bool:
    return not mask.null_count and pc.all(mask).as_py()

def _part_records(plan: TablePlan, blob, within=None):
    """One part's records (``blob``: Arrow IPC) in the table's schema now, those in ``[lower,
    frontier)`` and, with ``within`` (``(lo, hi)`` of the first sort column: from ``lo``, before ``hi``;
    None: open), in that key range."""
    recs = conform_payload(_ipc_table(blob), plan.full, plan.table, plan.bucket_plan.fill, plan.bucket_plan.renames)
    keep = _in_window(plan, recs)
    if within is not None:
        col = recs.column(plan.bucket_plan.sort[0])
        lo, hi = within
        if lo is not None:
            keep = pc.and_(keep, pc.greater_equal(col, pa.scalar(lo).cast(col.type)))
        if hi is not None:
            keep = pc.and_(keep, pc.less(col, pa.scalar(hi).cast(col.type)))
    return recs if _every(keep) else recs.filter(keep)

def merge_group_by_ranges(plan: TablePlan, buckets: list[int], part_buckets: list[int], load):
    """A keyed group with more records than ``plan.max_records``, merged key range by key range
    (`_key_ranges`): each part (bucket ``part_buckets[k]``, bytes ``load(k)``) is read once to find the
    ranges, then again for each range. The result is `merge_group`'s; None when the group cannot be
    cut (no key, a re-play, a first key column other than integer or text or without statistics on a
    file): then it is merged whole."""
    bp = plan.bucket_plan
    if not bp.keys or not bp.sort or plan.replay:
        return None
    first = bp.sort[0]
    files = [f for b in buckets for f in bp.files.get(b, [])]
    # cut by an integer or text first key column (the types files have statistics of), every file's known
    if not layout._stat_ok(bp.schema.field(first).type) or any(first not in f["min"] or first not in f["max"]
                                                                 for f in files):
        return None
    info = []
    for k in range(len(part_buckets)):
        recs = _part_records(plan, load(k))
        info.append(pa.table({"key": recs.column(first), "time": recs.column(META_TIME),
                              "pos": recs.column(META_POS), "diff": recs.column(META_DIFF),
                              "unknown": recs.column(META_UNKNOWN)}))
    info = pa.concat_tables(info)
    ranges = _key_ranges(plan, info, files)
    del info
    if ranges is None:
        return None
    logged, changed = _Logged(plan), _ChangeData(plan)

    def records(within):
        got = [_part_records(plan, load(k), within) for k in range(len(part_buckets))]
        return pa.concat_tables(got), np.repeat(np.array(part_buckets, np.int32), [t.num_rows for t in got])

    counts = dict.fromkeys(CHANGE_COUNTS, 0)
    try:
        actions = merge_ranges(plan, buckets, ranges, records, logged, counts, changed)
    except MergeError as exc:         # bad input: the driver raises it
        changed.discard()
        return _rows_out(plan.table, [], problem=str(exc))
    return _finished(plan, actions, logged, changed, counts)

def merge_ranges(plan: TablePlan, buckets: list[int], ranges: list, records, out, counts: dict | None = None,
                 change_data=None) -> list[dict]:
    """`merge_records` range by range (``ranges``: `_key_ranges`; ``records(range)``: the range's
    records and their buckets), each over the lake files of its key range only (and its own file
    names), its changelog rows to ``out``: the file actions of all."""
    bp, first = plan.bucket_plan, plan.bucket_plan.sort[0]
    actions: list[dict] = []
    for k, (lo, hi) in enumerate(ranges):
        mine = {b: [f for f in fs if (lo is None or f["min"][first] >= lo) and (hi is None or f["max"][first] < hi)]
                for b, fs in bp.files.items()}
        sub = dataclasses.replace(plan, bucket_plan=dataclasses.replace(bp, files=mine, tag=f"{bp.tag}-r{k}"))
        recs, rb = records((lo, hi))
        if not recs.num_rows and not plan.truncates and not any(mine.get(b) for b in buckets):
            continue
        acts, _ = merge_records(sub, rb, recs, buckets=np.array(buckets, np.int32), out=out, counts=counts,
                                change_data=change_data)
        actions += acts
    return actions

def _key_ranges(plan: TablePlan, info, files: list[dict]) -> list | None:
    """The key ranges a keyed group's records (``info``: each one's first sort column ``key``, and
    ``time``, ``pos``, ``diff``, ``unknown``) are merged in, in key order: ``[(lo, hi)]`` of the first
    sort column (from ``lo``, before ``hi``; None: open), each of about ``plan.max_records`` records
    (more where one key value or a lake file's key range holds more: a range never cuts one). A cut
    never falls inside a file's ``[min, max]`` (``files``, the group's buckets' files), so each file
    is in one range with every record of its keys; an update that moved a key and left TOAST values
    unchanged has its old key's ``-1`` in its range (the ranges between are joined). None: one range."""
    n, bound, first = info.num_rows, plan.max_records, plan.bucket_plan.sort[0]
    key = info.column("key")
    if n <= bound or key.null_count:
        return None
    order = pc.sort_indices(key).to_numpy()
    sk = key.take(pa.array(order)).to_numpy(zero_copy_only=False)
    # a cut before sorted record i (its key the next range's lo): between two key values, outside files
    ok = np.r_[False, sk[1:] != sk[:-1]]
    for f in files:      # no cut at a value v with min < v <= max
        ok[np.searchsorted(sk, f["min"][first], side="right"):
           np.searchsorted(sk, f["max"][first], side="right")] = False
    cuts, start = [], 0
    allowed = np.nonzero(ok)[0]
    while True:
        nxt = allowed[allowed > start]
        if not len(nxt) or n - start <= bound:
            break
        within = nxt[nxt <= start + bound]
        start = int(within[-1] if len(within) else nxt[0])
        cuts.append(start)
    if not cuts:
        return None
    # each record's range; an update's +1 with unchanged TOAST values joins the range of its -1's key
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n)
    unit = np.searchsorted(np.array(cuts), rank, side="right")
    together = _linked(unit, len(cuts) + 1, info.column("time").to_numpy(), info.column("pos").to_numpy(),
                       info.column("diff").to_numpy(), info.column("unknown"))      # range i and i + 1 together
    bounds = [sk[c].item() if hasattr(sk[c], "item") else sk[c] for c, t in zip(cuts, together) if not t]
    if not bounds:
        return None
    return list(zip([None] + bounds, bounds + [None]))

def merge_records(plan: TablePlan, bucket, recs, *, buckets=None, write: bool = True, out=None,
                  counts: dict | None = None, change_data=None):
    """Apply records (meta + table columns, any order, duplicates allowed) of one bucket (``bucket``
    an int) or of several (``bucket``: each record's, an int array): return (file actions, exact
    changelog rows in `lake.scd2.log_schema`). ``buckets``: every bucket of the group (a bucket
    without records still takes its truncates); ``write``: False to write no file (no actions);
    ``out``: called with each part of the changelog rows as it is made (then None is returned for
    them): the records' rows, then a truncate's ``-1`` s of the lake rows they do not name, window by
    window; ``counts``: a dict of `CHANGE_COUNTS` the net effect's counts are added to
    (`_count_changes`); ``change_data``: a `_ChangeData` given the net effect's rows (Delta's change
    data feed). The group is merged part by part (`_parts`, `_merge_part`), a task holding the
    records and at most a few files' rows (docs/internals/merge.md)."""
    bp, keys = plan.bucket_plan, plan.bucket_plan.keys
    rb = np.broadcast_to(np.asarray(bucket, np.int32), recs.num_rows).copy()
    recs = recs.append_column(META_BUCKET, pa.array(rb))
    recs = _deduped(recs, keys)
    rb = recs.column(META_BUCKET).to_numpy()
    group = np.unique(np.r_[rb, np.asarray(buckets if buckets is not None else [], np.int32)]).astype(np.int32)
    truncs = sorted(plan.truncates)
    diff = recs.column(META_DIFF).to_numpy()
    deletes = bool((diff < 0).any())
    # the files rewritten: every one of the group's buckets at a truncate; else those that may hold a
    # changed key (a deleted row, for a table without a key) and, in a bucket with a -1, its small ones
    probe, probe_bucket = None, rb
    if keys or deletes:
        probe = recs if keys else recs.filter(pa.array(diff < 0))
        probe, probe_bucket = (probe.select(bp.sort) if bp.sort else probe), (rb if keys else rb[diff < 0])
    retracted = set(np.unique(rb[diff < 0]).tolist())
    rewrite, stay = {}, {}
    for b in group.tolist():
        mine = probe if probe is None or len(group) == 1 else probe.filter(pa.array(probe_bucket == b))
        appends = not truncs and b not in retracted
        files = bp.files.get(b, [])
        rewrite[b] = list(files) if truncs else layout.touched(bp, b, mine, small=not appends)
        # new files never span a kept file's key range (a keyless table's appended rows are one run)
        stay[b] = [] if truncs or (appends and not keys) else layout.kept(files, rewrite[b])
    parts = []
    emit = out if out is not None else parts.append
    writers = {b: layout.SortedWriter(bp, b, stay[b]) for b in group.tolist()} if write else {}
    for files, mine in _parts(plan, recs, rb, rewrite):
        _merge_part(plan, recs if mine is None else recs.filter(pa.array(mine)), files, truncs, emit, writers,
                    match=bool(keys or truncs or deletes), counts=counts, change_data=change_data)
    actions = [a for b, w in writers.items() for a in layout.removes(rewrite[b], b) + w.close()]
    return actions, None if out is not None else pa.concat_tables(parts)


def _merge_part(plan: TablePlan, recs, rewrite: dict, truncs: list, emit, writers: dict, *, match: bool,
                counts: dict | None = None, change_data=None) -> None:
    """Merge one part of a group (`_parts`): its records (key order) over its files to rewrite
    (bucket -> actions); its changelog rows to ``emit``, its buckets' rows after the batch to
    ``writers`` (bucket -> `layout.SortedWriter`; none: nothing written); its net effect's counts
    added to ``counts`` (`_count_changes`)."""
    bp, keys = plan.bucket_plan, plan.bucket_plan.keys
    held = _Held(bp)
    files, lake, lake_bucket = _named(plan, recs, rewrite, held, match=match)
    epoch = _epochs(recs, truncs)
    logs, state, state_bucket = [], lake, lake_bucket
    for e in range(len(truncs) + 1):
        part = recs.filter(pa.array(epoch == e)) if truncs else recs
        if keys:
            log, state, state_bucket = _keyed(plan, part, state, state_bucket)
        else:
            log, state, state_bucket = _multiset(plan, part, state, state_bucket)
        logs.append(log)
        if e < len(truncs):
            t, _, cts = truncs[e]
            logs.append(_taken_out(state, t, cts, bp.schema))
            state, state_bucket = state.schema.empty_table(), np.zeros(0, np.int32)
    log = pa.concat_tables(logs) if len(logs) > 1 else logs[0]
    if len(logs) > 1:          # a truncate's -1s and the records at its time are one (data, time) set
        log = cancel_zero(log)
    emit(_log_form(log, bp.schema))
    if counts is not None:
        _count_changes(bp, lake, state, counts, change_data, lake_bucket, state_bucket)
    # the lake rows the records do not name are distinct from every row above (another key; for a
    # table without a key, unequal to every changed row): a truncate's -1s of them join no other
    for b in sorted(files):
        mine = state_bucket == b
        rows = (state if mine.all() else state.filter(pa.array(mine))).select(bp.schema.names)
        _rewrite(plan, files[b], rows, held, truncs[0] if truncs else None, emit, writers.get(b), counts,
                 change_data, b)
