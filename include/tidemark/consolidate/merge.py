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
* **the net effect** — the group's bucket files to remove and the new ones, written here, and its
  counts (`_count_changes`): rows inserted, updated and deleted between the lake before and after.

It writes the changelog's Parquet files and CDC parts (`_Logged`) and returns file actions and
counts only: nothing proportional to the data goes back to the driver. Its memory follows the
configuration, not the table: the group's records and a few lake files' rows at a time, the files
read one by one (`merge_records`). A keyed table's group of more records than
`TablePlan.max_records` (one huge transaction: all its records are one lake commit) is merged key
range by key range (`merge_group_by_ranges`): ranges cut between key values and outside every lake
file's key range (by the files' statistics), so each holds every record of its keys and every file
they may be in, and an update that moved a key and left TOAST values unchanged has its old key's
``-1`` in its range; each range is a `merge_records` over its own files, its changelog given part by
part like the others.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tidemark.consolidate import layout
from tidemark.consolidate.decode import (META_CTS, META_DIFF, META_FULL, META_POS, META_TIME, META_UNKNOWN,
                                         RELOAD_POSITION)
from tidemark.errors import TidemarkError

META_BUCKET = "_tm_bucket"           # a record's bucket, beside the meta columns (`decode.META_COLUMNS`)
# a merge group's net effect on its table (`_count_changes`), in its ``changes`` result row's ``stats``
CHANGE_COUNTS = ("inserted", "updated", "deleted")
# the records a keyed table's merge group holds at once (or ``consolidate.max_batch_records``, if fewer;
# `TablePlan.max_records`): a group of more (one huge transaction) is merged key range by key range
MERGE_RECORDS = layout.TARGET_ROWS
OUT_DDL = ("table string, target string, op string, path string, size long, rows long, stats string, "
           "partition string, bucket int, time long, count long, log binary, problem string, cdc binary")


class MergeError(TidemarkError):
    """A group's records cannot be applied (bad input: names the table, key or row and the time)."""


class RowImageUnknown(MergeError):
    """A keyed table's change left TOAST values unchanged but the row's previous image is neither in
    the batch nor in the lake. PostgreSQL does so when an UPDATE moves a row into a publication's row
    filter without changing its TOASTed columns: it sends an INSERT lacking them. Only a copy of the
    table mends it: the driver turns it into `TableNeedsSnapshot` (`MARK` survives the executor's
    problem text)."""

    MARK = "[needs a re-snapshot] "

    def __init__(self, message: str, *, key: dict | None = None, time: int | None = None):
        super().__init__(message)
        self.key, self.time = key, time


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
    codec: str = "zstandard"         # the feed file's Avro block codec (the stream's ``landing.codec``)


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
    max_records: int | None = None   # a group of more records is merged key range by key range (`_key_ranges`)


def merge_tasks(batches, tasks: list, plans: dict[str, TablePlan], work):
    """``mapInArrow`` body over a ``spark.range``: task ids in; each of the task's groups
    (`batch.Group`) merged (`merge_group`), its parts read from the run's work area
    (`decode.read_parts`); file actions and counts out (`_rows_out`)."""
    from tidemark.consolidate.decode import read_parts

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
                yield from merge_group(plans[g.table], g.buckets, [(b, blob) for (*_, b), blob in
                                                                   zip(g.parts, blobs)]).to_batches()


def merge_group(plan: TablePlan, buckets: list[int], parts: list[tuple[int, bytes]]):
    """One group of a table's buckets: its parts (``(bucket, Arrow IPC bytes)``, as the decoding cut
    them: in a shape of the table's, each record in its part's bucket) merged; file actions and counts
    out (`_rows_out`: the group's rows inserted, updated and deleted as a ``changes`` row), the
    changelog written on the way (`_Logged`). A bucket without parts still takes the table's truncates
    (its rows all get a ``-1``)."""
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
    logged = None if plan.replay else _Logged(table, plan)
    changed = None if plan.replay else _ChangeData(plan)
    # a re-snapshot of the table merged in this batch (its rows at L after a truncate at (L, RELOAD_POSITION - 1))
    reload_at = max((tr[0] for tr in plan.truncates if tr[1] == RELOAD_POSITION - 1), default=None)
    while True:
        counts = dict.fromkeys(CHANGE_COUNTS, 0)       # (a retry after RowImageUnknown counts anew)
        try:
            actions, log = merge_records(plan, rb, recs, buckets=np.array(buckets, np.int32), write=not plan.replay,
                                         out=logged, counts=counts, change_data=changed)
            break
        except RowImageUnknown as exc:
            if reload_at is None or exc.time is None or exc.time >= reload_at:
                return _rows_out(table, [], problem=str(exc))
            # values only the re-snapshot has (`RowImageUnknown`): that key's changes below it are left out,
            # the re-snapshot's rows at L bring the row in (its changelog shows it from L on)
            logged = None if plan.replay else _Logged(table, plan)
            if changed is not None:
                changed.discard()
                changed = _ChangeData(plan)
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
    if plan.replay:
        return _replayed(table, log)
    if plan.history is not None:
        # the group's exact changelog rows are every change of its buckets: folded into the history
        # buckets here, with no second read of them (`history.fold_merged`)
        from tidemark.consolidate.history import fold_merged

        actions = actions + [{**a, "target": "history"} for a in fold_merged(plan.history, logged.all())]
    changes = {"target": "changes", "op": "counts", "stats": json.dumps(counts, sort_keys=True)}
    return _rows_out(table, actions + changed.close() + logged.close() + [changes])


def _part_records(plan: TablePlan, blob, within=None):
    """One part's records (``blob``: Arrow IPC) in the table's schema now, those in ``[lower,
    frontier)`` and, with ``within`` (``(lo, hi)`` of the first sort column: from ``lo``, before ``hi``;
    None: open), in that key range."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from tidemark.consolidate.decode import conform_payload

    single = pa.ipc.IpcReadOptions(use_threads=False)
    recs = conform_payload(pa.ipc.open_stream(blob, options=single).read_all(), plan.full, plan.table, plan.fill,
                           plan.bucket_plan.renames)
    t = recs.column(META_TIME)
    keep = pc.and_(pc.greater_equal(t, plan.lower), pc.less(t, plan.frontier))
    if within is not None:
        col = recs.column(plan.bucket_plan.sort[0])
        lo, hi = within
        if lo is not None:
            keep = pc.and_(keep, pc.greater_equal(col, pa.scalar(lo).cast(col.type)))
        if hi is not None:
            keep = pc.and_(keep, pc.less(col, pa.scalar(hi).cast(col.type)))
    return recs if not keep.null_count and pc.all(keep).as_py() else recs.filter(keep)


def merge_group_by_ranges(plan: TablePlan, buckets: list[int], part_buckets: list[int], load):
    """One group of a keyed table's buckets with more records than ``plan.max_records`` (one huge
    transaction), merged key range by key range (`_key_ranges`), so a task holds one range's records
    and the few lake files `merge_records` reads, not the group's records: each part (bucket
    ``part_buckets[k]``, bytes ``load(k)``) is read once to find the ranges, then again for each
    range. The result is `merge_group`'s (the same rows after the batch and changelog: a range holds
    every record of its keys and every lake file its keys may be in); None when the group cannot be
    cut (no key; a first key column of another type than integer or text, or without statistics on a
    file; a re-play): then it is merged whole."""
    import numpy as np
    import pyarrow as pa

    bp = plan.bucket_plan
    if not bp.keys or not bp.sort or plan.replay or bp.truncate:
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
    logged, changed = _Logged(plan.table, plan), _ChangeData(plan)

    def records(within):
        got = [(b, _part_records(plan, load(k), within)) for k, b in enumerate(part_buckets)]
        got = [(b, t) for b, t in got if t.num_rows]
        if not got:
            return plan.full.empty_table(), np.zeros(0, np.int32)
        return (pa.concat_tables([t for _, t in got]),
                np.repeat(np.array([b for b, _ in got], np.int32), [t.num_rows for _, t in got]))

    counts = dict.fromkeys(CHANGE_COUNTS, 0)
    try:
        actions = merge_ranges(plan, buckets, ranges, records, logged, counts, changed)
    except MergeError as exc:         # bad input: the driver raises it
        changed.discard()
        return _rows_out(plan.table, [], problem=str(exc))
    if plan.history is not None:
        from tidemark.consolidate.history import fold_merged

        actions = actions + [{**a, "target": "history"} for a in fold_merged(plan.history, logged.all())]
    changes = {"target": "changes", "op": "counts", "stats": json.dumps(counts, sort_keys=True)}
    return _rows_out(plan.table, actions + changed.close() + logged.close() + [changes])


def merge_ranges(plan: TablePlan, buckets: list[int], ranges: list, records, out, counts: dict | None = None,
                 change_data=None) -> list[dict]:
    """`merge_records` range by range (``ranges``: `_key_ranges`; ``records(range)``: the range's
    records and their buckets), each over the lake files of its key range only (and its own file
    names), its changelog rows to ``out``: the file actions of all."""
    import dataclasses

    import numpy as np

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
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n, bound, first = info.num_rows, plan.max_records, plan.bucket_plan.sort[0]
    key = info.column("key")
    if n <= bound or key.null_count:
        return None
    order = pc.sort_indices(key).to_numpy()
    sk = key.take(pa.array(order)).to_numpy(zero_copy_only=False)
    if sk.dtype == object:
        sk = np.array(list(sk), dtype=object)
    # a cut before sorted record i (its key the next range's lo): between two key values, outside files
    ok = np.r_[False, sk[1:] != sk[:-1]]
    for f in files:      # no cut at a value v with min < v <= max
        ok[np.searchsorted(sk, f["min"][first], side="right"):np.searchsorted(sk, f["max"][first], side="right")] = False
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
    toasted = (info.column("diff").to_numpy() > 0) & (pc.fill_null(pc.list_value_length(
        info.column("unknown")), 0).to_numpy() > 0)
    together = np.zeros(len(cuts), bool)         # range i and i + 1 merged together
    if toasted.any():
        ident = _identity(info.column("time").to_numpy(), info.column("pos").to_numpy())
        iorder = np.argsort(ident, kind="stable")
        want = ident[toasted] - 1
        at = np.minimum(np.searchsorted(ident[iorder], want), n - 1)
        hit = ident[iorder][at] == want
        a, b = unit[toasted][hit], unit[iorder[at]][hit]
        spans = np.zeros(len(cuts) + 1, np.int64)
        np.add.at(spans, np.minimum(a, b), 1)
        np.add.at(spans, np.maximum(a, b), -1)
        together = np.cumsum(spans)[:-1] > 0
    bounds = [sk[c].item() if hasattr(sk[c], "item") else sk[c] for c, t in zip(cuts, together) if not t]
    if not bounds:
        return None
    return list(zip([None] + bounds, bounds + [None]))


def merge_records(plan: TablePlan, bucket, recs, *, buckets=None, write: bool = True, out=None,
                  counts: dict | None = None, change_data=None):
    """Apply records (meta + table columns, any order, duplicates allowed) of one bucket (``bucket``
    an int) or of several (``bucket``: each record's, an int array): return (file actions, exact
    changelog rows in `changelog.log_schema`). ``buckets``: every bucket of the group (a bucket
    without records still takes its truncates); ``write``: False to write no file (no actions);
    ``out``: called with each part of the changelog rows as it is made (then None is returned for
    them): the records' rows, then a truncate's ``-1`` s of the lake rows they do not name, window by
    window; ``counts``: a dict of `CHANGE_COUNTS` the net effect's counts are added to
    (`_count_changes`); ``change_data``: a `_ChangeData` given the net effect's rows (Delta's change
    data feed). Only the files are per bucket: a key's records are in one group, so the images, the
    changelog and the net effect are worked out for all at once.

    A task holds the records and at most a few files' rows, whatever the size of its buckets. The
    group is merged part by part (`_parts`: files in key order by their statistics, as many together
    as hold ``target_rows`` rows, with the records of their key range), each part's files read one
    at a time, twice: first for the lake rows the records name (`_named`: the changed keys' rows;
    for a table without a key, the rows equal to a changed one), the part's lake; then, once the
    rows after the batch are known, window by window (`_windows`: one file, or files whose key
    ranges touch), each written with the new rows of its key range (`_rewrite`) into its bucket's
    `layout.SortedWriter`. The last files read the first time are kept for the second (`_Held`):
    up to ``target_rows`` rows, so a part's files are read once."""
    import numpy as np
    import pyarrow as pa

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
    # changed key (a deleted row, for a table without a key) by their statistics, and the small ones,
    # merged on the way (inserts into a table without a key: these only)
    probe, probe_bucket = None, rb
    if keys or deletes:
        probe = recs if keys else recs.filter(pa.array(diff < 0))
        probe, probe_bucket = (probe.select(bp.sort) if bp.sort else probe), (rb if keys else rb[diff < 0])
    rewrite = {}
    for b in group.tolist():
        mine = probe if probe is None or len(group) == 1 else probe.filter(pa.array(probe_bucket == b))
        rewrite[b] = list(bp.files.get(b, [])) if truncs else layout.touched(bp, b, mine)[0]
    parts = []
    emit = out if out is not None else parts.append
    writers = {b: layout.SortedWriter(bp, b, [] if truncs else layout.kept(bp, bp.files.get(b, []), rewrite[b]))
               for b in group.tolist()} if write else {}
    for files, mine in _parts(plan, recs, rb, rewrite):
        _merge_part(plan, recs if mine is None else recs.filter(pa.array(mine)), files, truncs, emit, writers,
                    match=bool(keys or truncs or deletes), counts=counts, change_data=change_data)
    actions = [a for b, w in writers.items() for a in layout.removes(rewrite[b], b) + w.close()]
    if out is not None:
        return actions, None
    return actions, pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def _merge_part(plan: TablePlan, recs, rewrite: dict, truncs: list, emit, writers: dict, *, match: bool,
                counts: dict | None = None, change_data=None) -> None:
    """Merge one part of a group (`_parts`): its records (key order) over its files to rewrite
    (bucket -> actions); its changelog rows to ``emit``, its buckets' rows after the batch to
    ``writers`` (bucket -> `layout.SortedWriter`; none: nothing written); its net effect's counts
    added to ``counts`` (`_count_changes`)."""
    import numpy as np
    import pyarrow as pa

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
            logs.append(_as_log(state, np.full(state.num_rows, t, np.int64), np.full(state.num_rows, -1, np.int64),
                                np.full(state.num_rows, cts, np.int64), bp.schema))
            state, state_bucket = state.schema.empty_table(), np.zeros(0, np.int32)
    log = pa.concat_tables(logs) if len(logs) > 1 else logs[0]
    if len(logs) > 1:          # a truncate's -1s and the records at its time are one (data, time) set
        log = layout.cancel_zero(log)
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


def _count_changes(bp, before, after, counts: dict, change_data=None, before_bucket=None, after_bucket=None
                   ) -> None:
    """Add a part's net effect to ``counts`` (`CHANGE_COUNTS`): ``before``, the lake rows its records
    name (`_named`), against ``after``, those rows after the batch. A keyed table: a key only after is
    inserted, only before deleted, in both with other values updated (a key changed back, or updated
    to its own values, is no change); a table without a key (a multiset of whole rows): each identical
    row's net count, up inserted, down deleted (it has no updates to tell). The counts are of the
    lake's rows, as a reader of the table's versions before and after sees them, not of the source's
    statements (a row inserted and deleted in the batch is not counted).

    With ``change_data`` (a `_ChangeData`), the same net effect's rows go to it, with their buckets
    (``before_bucket``, ``after_bucket``): a keyed table's inserted rows, deleted rows and updated
    rows' pre- and postimages (a changed key: a delete and an insert); a table without a key's rows,
    each as many times as its net count, inserts up and deletes down (a multiset: a row inserted
    twice is two inserts)."""
    import numpy as np
    import pyarrow as pa

    names = bp.schema.names
    if bp.keys:
        at = layout.key_lookup(after.select(bp.keys), before.select(bp.keys), bp.keys)
        kept = at >= 0
        counts["inserted"] += int((~kept).sum())
        counts["deleted"] += before.num_rows - int(kept.sum())
        if change_data is not None:
            gone = np.ones(before.num_rows, bool)
            gone[at[kept]] = False
            change_data.add(after.filter(pa.array(~kept)), np.asarray(after_bucket)[~kept], "insert")
            change_data.add(before.filter(pa.array(gone)), np.asarray(before_bucket)[gone], "delete")
        if not kept.any():
            return
        if change_data is not None:
            before_bucket, after_bucket = np.asarray(before_bucket)[at[kept]], np.asarray(after_bucket)[kept]
        before = before.take(pa.array(at[kept], pa.int64()))
        after = after.filter(pa.array(kept))
    both = pa.concat_tables([before.select(names), after.select(names)])
    pair = np.arange(before.num_rows, dtype=np.int64)
    # with the change data, a keyed table's rows are compared pair by pair (each key its own "time")
    times = np.r_[pair, pair] if change_data is not None and bp.keys else np.zeros(both.num_rows, np.int64)
    first, sums = layout.consolidated_updates(both, times, np.r_[np.full(before.num_rows, -1, np.int64),
                                                                 np.ones(after.num_rows, np.int64)])
    if bp.keys:       # a changed key's old and new rows: a -1 and a +1
        counts["updated"] += int(sums[sums > 0].sum())
        if change_data is not None and len(first):
            pairs = np.unique(times[first])
            change_data.add(before.take(pa.array(pairs)), before_bucket[pairs], "update_preimage")
            change_data.add(after.take(pa.array(pairs)), after_bucket[pairs], "update_postimage")
    else:
        counts["inserted"] += int(sums[sums > 0].sum())
        counts["deleted"] -= int(sums[sums < 0].sum())
        if change_data is not None and len(first):
            every = np.repeat(first, np.abs(sums))
            up = np.repeat(sums > 0, np.abs(sums))
            buckets = np.r_[np.asarray(before_bucket), np.asarray(after_bucket)][every]
            rows = both.take(pa.array(every))
            change_data.add(rows.filter(pa.array(up)), buckets[up], "insert")
            change_data.add(rows.filter(pa.array(~up)), buckets[~up], "delete")


def _parts(plan: TablePlan, recs, rb, rewrite: dict):
    """The parts a group is merged in, one after the other: (files to rewrite per bucket, mask of the
    records; None: all). Each bucket's files in key order by the statistics of the first sort column
    (files whose ranges overlap or touch together: rows equal there may be in either), each with the
    records from its first key to the next one's; as many of them, in order, as hold
    ``target_rows`` rows together, and those an update that moved a key and left TOAST values
    unchanged links (its old image in another), with those between. A bucket whose files lack the
    statistics (or, for a table without a key, whose records or files may hold nulls there) is one."""
    import itertools

    import numpy as np
    import pyarrow.compute as pc

    bp, keys = plan.bucket_plan, plan.bucket_plan.keys
    first = bp.sort[0] if bp.sort else None
    units, unit = [], np.zeros(recs.num_rows, np.int64)     # (bucket, files) in order; each record's
    for b, files in sorted(rewrite.items()):
        mine = rb == b
        values = recs.column(first).filter(mine) if first else None
        known = first is not None and all(first in f["min"] and first in f["max"] for f in files) and (
            bool(keys) or (not values.null_count and all(f.get("nulls", {}).get(first) == 0 for f in files)))
        if len(files) < 2 or not known:
            unit[mine] = len(units)
            units.append((b, files))
            continue
        files = sorted(files, key=lambda f: f["min"][first])
        lo = [f["min"][first] for f in files]
        reach = list(itertools.accumulate((f["max"][first] for f in files), max))
        begin = [0] + [i for i in range(1, len(files)) if lo[i] > reach[i - 1]]
        unit[mine] = len(units) + np.searchsorted(np.array([lo[i] for i in begin[1:]], dtype=object),
                                                  values.to_numpy(zero_copy_only=False).astype(object), side="right")
        units += [(b, files[i:j]) for i, j in zip(begin, begin[1:] + [len(files)])]
    if len(units) == 1:
        return [({units[0][0]: units[0][1]}, None)]
    together = np.zeros(len(units) - 1, bool)             # unit i and i + 1 in one part
    held = 0
    for i, (_, files) in enumerate(units):
        rows = sum(f["rows"] or 0 for f in files)
        if i and held + rows <= bp.target_rows:
            together[i - 1] = True
        else:
            held = 0
        held += rows
    # an update that moved a key and left TOAST values alone takes them from the -1 at its (time,
    # position - 1): the units from one to the other in one part
    toasted = (recs.column(META_DIFF).to_numpy() > 0) & (pc.fill_null(pc.list_value_length(
        recs.column(META_UNKNOWN)), 0).to_numpy() > 0)
    if toasted.any():
        ident = _identity(recs.column(META_TIME).to_numpy(), recs.column(META_POS).to_numpy())
        order = np.argsort(ident, kind="stable")
        want = ident[toasted] - 1
        at = np.minimum(np.searchsorted(ident[order], want), len(order) - 1)
        hit = ident[order][at] == want
        a, b = unit[toasted][hit], unit[order[at]][hit]
        spans = np.zeros(len(units), np.int64)
        np.add.at(spans, np.minimum(a, b), 1)
        np.add.at(spans, np.maximum(a, b), -1)
        together |= np.cumsum(spans)[:-1] > 0
    part = np.r_[0, np.cumsum(~together)]
    out = []
    for k in range(part[-1] + 1):
        members = np.nonzero(part == k)[0]
        files: dict = {}
        for i in members.tolist():
            files.setdefault(units[i][0], []).extend(units[i][1])
        out.append((files, None if len(members) == len(units) else (unit >= members[0]) & (unit <= members[-1])))
    return out


def _identity(times, positions):
    """One int64 per record identity ``(time, position)``, exact: the rank of its time among
    ``times`` in the high 32 bits and its (int32) position added, so ``identity - 1`` is ``(time,
    position - 1)``. (A time itself shifted by 32 bits wraps: times 2^32 apart would be one.)"""
    import numpy as np

    _, rank = np.unique(np.asarray(times), return_inverse=True)
    return rank.reshape(-1).astype(np.int64) * (1 << 32) + np.asarray(positions).astype(np.int64)


def _deduped(recs, keys: list[str]):
    """Records in key order (then time, position), each identity ``(time, position)`` once."""
    import numpy as np
    import pyarrow as pa

    recs = recs.sort_by(layout.ascending(keys) + [(META_TIME, "ascending"), (META_POS, "ascending")])
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


class _Held:
    """A part's lake files as `merge_records` reads them, each twice: the last ones read the first
    time are kept for the second (at most ``target_rows`` rows in all), so that a part whose files
    hold no more rows than one full file reads each of them once."""

    def __init__(self, bp):
        self.bp, self.files, self.rows = bp, {}, 0

    def read(self, path: str, keep: bool = False):
        rows = self.files.pop(path, None)
        if rows is not None:
            self.rows -= rows.num_rows
            return rows
        rows = layout.read_files(self.bp, [path])
        if keep and rows.num_rows <= self.bp.target_rows:
            self.files[path] = rows
            self.rows += rows.num_rows
            while self.rows > self.bp.target_rows:          # the oldest go first
                self.rows -= self.files.pop(next(iter(self.files))).num_rows
        return rows


@dataclass
class _File:
    """A lake file the batch rewrites: its add action, its number of rows, the positions of the rows
    the records name (in the merge's lake) and its first and last rows in the sort columns (its key
    range; None without rows or sort columns, or for its bucket's only file)."""

    action: dict
    rows: int
    named: Any
    edges: Any


def _named(plan: TablePlan, recs, rewrite: dict, held: _Held, *, match: bool):
    """Read the files to rewrite (``rewrite``: bucket -> actions) one at a time: per bucket its
    `_File` s, and the rows the records name with their buckets, the merge's lake. With ``match``:
    a keyed table's rows of the changed keys; else the rows equal to a changed row (`_equal_to`)."""
    import numpy as np
    import pyarrow as pa

    bp, keys = plan.bucket_plan, plan.bucket_plan.keys
    probe = recs.select(keys) if keys else layout.conform(recs, bp.schema)
    files, lake, lake_bucket = {}, [], []
    first = bp.sort[0] if bp.sort else None
    # in the reverse of `_rewrite`'s order (buckets, then keys by the files' statistics): the files
    # `held` keeps are the first it reads again
    for b in sorted(rewrite, reverse=True):
        files[b] = []
        for f in sorted(rewrite[b], key=lambda f: (first in f["min"], f["min"].get(first)), reverse=True):
            rows = held.read(f["path"], keep=True)
            named = np.zeros(0, np.int64)
            if match and rows.num_rows and keys:
                at = layout.key_lookup(probe, rows.select(keys), keys)
                named = np.unique(at[at >= 0])
            elif match and rows.num_rows:
                named = np.nonzero(_equal_to(rows, probe))[0]
            edges = (rows.select(bp.sort).take(pa.array([0, rows.num_rows - 1]))
                     if rows.num_rows and bp.sort and len(rewrite[b]) > 1 else None)
            files[b].append(_File(f, rows.num_rows, named, edges))
            if len(named):
                lake.append(rows.take(pa.array(named)))
                lake_bucket.append(np.full(len(named), b, np.int32))
    return (files, pa.concat_tables(lake) if lake else bp.schema.empty_table(),
            np.concatenate(lake_bucket) if lake_bucket else np.zeros(0, np.int32))


def _equal_to(rows, probe):
    """Whether each row of ``rows`` equals a row of ``probe`` (the same columns) in every column
    `layout.identity_columns` compares in Arrow (floats by their bits, nulls equal): the rows equal
    to one in every column, and maybe a few more (lists are not compared)."""
    import numpy as np
    import pyarrow as pa

    n = probe.num_rows
    cols, _ = layout.identity_columns(pa.concat_tables([probe, rows]))
    if not cols:
        return np.ones(rows.num_rows, bool)
    key = pa.table({f"k{i}": c for i, c in enumerate(cols)})
    order = np.asarray(key.append_column("_i", pa.array(np.arange(key.num_rows))).sort_by(
        [(f"k{i}", "ascending") for i in range(len(cols))]).column("_i"))
    group = np.cumsum(~layout.same_as_previous(key.take(pa.array(order)))) - 1
    hit = np.zeros(group[-1] + 1, bool)
    hit[group[order < n]] = True
    out = np.empty(len(order), bool)
    out[order] = hit[group]
    return out[n:]


def _windows(bp, entries: list[_File]) -> list[list[_File]]:
    """A bucket's files to rewrite in key order (by their first rows) as windows: one file, or files
    whose key ranges overlap or touch (rows equal in the sort columns in two files), so that each
    window's rows come after those of the windows before. Files without rows are in none."""
    import numpy as np
    import pyarrow as pa

    live = [e for e in entries if e.edges is not None]
    loose = [[e] for e in entries if e.rows and e.edges is None]       # alone, or no sort columns: no order
    if len(live) < 2:
        return [[e] for e in live] + loose
    ends = pa.concat_tables([e.edges for e in live])                  # file i: rows 2i (first), 2i + 1 (last)
    ends = ends.append_column("_tm_end", pa.array(np.tile(np.array([0, 1], np.int8), len(live)))).append_column(
        "_tm_at", pa.array(np.arange(ends.num_rows)))
    at = ends.sort_by(layout.ascending(bp.sort + ["_tm_end"])).column("_tm_at").to_numpy()
    opens = at % 2 == 0
    depth = np.cumsum(np.where(opens, 1, -1))
    window = np.r_[0, np.cumsum(depth[:-1] == 0)][opens]
    out: list = []
    for i, w in zip((at[opens] // 2).tolist(), window.tolist()):
        if w == len(out):
            out.append([])
        out[-1].append(live[i])
    return out + loose


def _shares(bp, rows, windows: list) -> list:
    """``rows`` (a bucket's rows after the batch) cut by the windows' key ranges: each window takes
    those from its first row to the next window's first (the first window also those before it)."""
    import numpy as np
    import pyarrow as pa

    if len(windows) < 2 or not rows.num_rows or not bp.sort:
        return [rows] + [rows.slice(0, 0)] * (len(windows) - 1)
    firsts = pa.concat_tables([w[0].edges.slice(0, 1) for w in windows[1:]])
    m = firsts.num_rows
    both = pa.concat_tables([firsts, rows.select(bp.sort)])
    at = both.append_column("_tm_at", pa.array(np.arange(both.num_rows))).sort_by(
        layout.ascending(bp.sort + ["_tm_at"])).column("_tm_at").to_numpy()
    mine = at >= m                                     # a row equal to a window's first row is its
    window = np.cumsum(~mine)[mine]
    ordered = rows.take(pa.array(at[mine] - m))
    cuts = np.searchsorted(window, np.arange(len(windows) + 1))
    return [ordered.slice(a, b - a) for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist())]


def _unnamed(bp, held: _Held, window: list[_File]):
    """A window's lake rows that the records do not name (read again)."""
    import numpy as np
    import pyarrow as pa

    parts = []
    for e in window:
        rows = held.read(e.action["path"])
        if len(e.named):
            keep = np.ones(rows.num_rows, bool)
            keep[e.named] = False
            rows = rows.filter(pa.array(keep))
        parts.append(rows)
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0] if parts else bp.schema.empty_table()


def _rewrite(plan: TablePlan, entries: list[_File], rows, held: _Held, truncate, emit, writer,
             counts: dict | None = None, change_data=None, bucket: int | None = None) -> None:
    """One bucket's files of a part after the batch, window by window (`_windows`): each window's
    lake rows the records do not name, with the rows after the batch in its key range (`_shares`),
    given to ``writer`` in key order (None: nothing written). At a truncate (``truncate``: the first
    one's (time, position, commit time)) the windows' rows take a ``-1`` at it instead, given to
    ``emit`` window by window, and ``rows`` alone are written (those ``-1`` s are rows deleted, added
    to ``counts`` and, as deletes in ``bucket``, to ``change_data``)."""
    import numpy as np
    import pyarrow as pa

    bp = plan.bucket_plan
    windows = _windows(bp, entries)
    if truncate is not None:
        t, _, cts = truncate
        for window in windows:
            gone = _unnamed(bp, held, window)
            n = gone.num_rows
            if counts is not None:
                counts["deleted"] += n
            if change_data is not None:
                change_data.add(gone, np.full(n, bucket, np.int32), "delete")
            log = _as_log(gone, np.full(n, t, np.int64), np.full(n, -1, np.int64), np.full(n, cts, np.int64),
                          bp.schema)
            emit(_log_form(log if bp.keys else layout.cancel_zero(log), bp.schema))
        if writer is not None:
            writer.add(rows)
        return
    if writer is None:
        return
    for window, share in zip(windows or [[]], _shares(bp, rows, windows)):
        writer.add(pa.concat_tables([_unnamed(bp, held, window), share]))


def _keyed(plan: TablePlan, recs, lake, lake_bucket):
    """One epoch of a keyed table: records (key order, deduped) over the rows ``lake`` (with their
    buckets: the lake rows of the records' keys, `_named`, or the rows after the epoch before).
    Return (its changelog rows, the rows after it, their buckets)."""
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
            ident = _identity(t_np, p_np)
            order = np.argsort(ident)
            want = ident[mi] - 1                  # (time, position - 1)
            at = np.minimum(np.searchsorted(ident[order], want), n - 1)
            hit = ident[order][at] == want
            dep[mi] = np.where(hit, order[at], -1)
            bad = mi[~hit | (diff[np.maximum(dep[mi], 0)] > 0)]
            if len(bad) and not hit[np.searchsorted(mi, bad[0])]:
                k = int(bad[0])      # no change at all before it in its transaction: an INSERT without them
                raise RowImageUnknown(f"{RowImageUnknown.MARK}table {plan.table} key {_key_of(recs, keys, k)} at "
                                      f"time {t_np[k]}: a change with unchanged TOAST values and no old image before "
                                      "it (as PostgreSQL sends an UPDATE that moved a row into the publication's row "
                                      "filter and left its TOAST values alone)",
                                      key=_key_of(recs, keys, k), time=int(t_np[k]))
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
            if diff[k] > 0:
                raise RowImageUnknown(f"{RowImageUnknown.MARK}table {plan.table} key {_key_of(recs, keys, k)} at "
                                      f"time {t_np[k]}: a change with unchanged TOAST values of a row whose previous "
                                      "image is neither earlier in the batch nor in the lake (as PostgreSQL sends an "
                                      "UPDATE that moved a row into the publication's row filter and left its TOAST "
                                      "values alone)", key=_key_of(recs, keys, k), time=int(t_np[k]))
            raise MergeError(f"table {plan.table} key {_key_of(recs, keys, k)} at time {t_np[k]}: a delete or update "
                             "of a row whose previous image is neither earlier in the batch nor in the lake")
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
    (the lake rows equal to a changed row, `_named`, or the rows after the epoch before). Return (its
    changelog rows, the rows after it, their buckets)."""
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

    from tidemark.consolidate.log_evolution import log_schema

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


class _Logged:
    """A group's changelog rows as `merge_records` gives them, part by part: those with ``time >=
    plan.log.lo`` written as the changelog's Parquet files and a CDC part (`_log_out`) whenever
    ``target_rows`` of them are held (a truncate's ``-1`` s come file by file), the rest at `close`.
    With the table's history, every part is kept for `all` (the history folds the group's rows at
    once)."""

    def __init__(self, table: str, plan: TablePlan):
        self.table, self.plan, self.held, self.kept, self.rows = table, plan, [], [], []

    def __call__(self, log) -> None:
        import pyarrow.compute as pc

        if self.plan.history is not None:
            self.kept.append(log)
        lp = self.plan.log
        if lp is None or not log.num_rows:
            return
        at = pc.greater_equal(log.column("_time"), lp.lo)
        self.held.append(log if not at.null_count and pc.all(at).as_py() else log.filter(at))
        if sum(t.num_rows for t in self.held) >= self.plan.bucket_plan.target_rows:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        log = pa.concat_tables(self.held) if len(self.held) > 1 else self.held[0] if self.held else None
        self.held = []
        if log is not None and log.num_rows:
            self.rows += _log_out(self.table, self.plan, log)

    def all(self):
        import pyarrow as pa

        return pa.concat_tables(self.kept) if self.kept else None

    def close(self) -> list[dict]:
        """The result rows of every changelog file and CDC part written."""
        self._flush()
        return self.rows


def _log_out(table: str, plan: TablePlan, log) -> list[dict]:
    """Write changelog rows (their times at or after ``plan.log.lo``): the changelog Parquet files and
    a CDC part (the rows' Materialize CDC updates, `cdc_file.encode_updates`, as container blocks of
    the table's file, put in the landing store); return their result rows: the files' actions, then
    the part's key and size with, in ``log``, the number of updates per time (int64 times, then
    int64 counts)."""
    import uuid

    import numpy as np

    from tidemark.consolidate import avro_columns as AC
    from tidemark.consolidate.cdc_file import encode_updates
    from tidemark.consolidate.changelog import write_log_files
    from tidemark.landing.store import open_store

    lp = plan.log
    tag = f"{plan.frontier:016X}-{uuid.uuid4().hex[:12]}"
    rows = list(write_log_files(lp.uri, plan.bucket_plan.options, log, tag=tag))
    datums = encode_updates(plan.bucket_plan.schema, log, log.column("_time"), log.column("_diff"))
    part = b"".join(AC.blocks(datums, lp.sync, codec=lp.codec))
    url, endpoint, region = lp.store
    key = f"{lp.parts}{tag}.blocks"
    # a part lives until the driver copies it into the committed feed file (a crash: made again)
    open_store(url, endpoint_url=endpoint, region=region).put(key, part, durable=False)
    times, counts = np.unique(log.column("_time").to_numpy(), return_counts=True)
    return rows + [{"target": "cdc", "op": "part", "path": key, "size": len(part), "count": len(datums),
                    "log": times.astype(np.int64).tobytes() + counts.astype(np.int64).tobytes()}]


class _ChangeData:
    """A group's net effect on its table as Delta's change data feed: rows with their buckets and
    ``_change_type`` (`_count_changes`), written as Parquet files under the table's `_change_data`
    directory, one per bucket (the ``_bucket`` partition value their ``cdc`` action carries),
    whenever ``target_rows`` of them are held, the rest at `close`. A file no committed version
    references is invisible to readers (`lake.writer.discard_uncommitted` deletes it after a failure)."""

    def __init__(self, plan: TablePlan):
        import uuid

        self.plan, self.held, self.n, self.rows = plan, [], 0, []
        self.tag = f"{plan.frontier:016X}-{uuid.uuid4().hex[:12]}"

    def add(self, rows, buckets, kind: str) -> None:
        import numpy as np
        import pyarrow as pa

        if not rows.num_rows:
            return
        t = rows.select(self.plan.bucket_plan.schema.names)
        self.held.append((t.append_column("_change_type", pa.array([kind] * t.num_rows, pa.string())),
                          np.asarray(buckets, np.int32)))
        self.n += t.num_rows
        if self.n >= self.plan.bucket_plan.target_rows:
            self._flush()

    def _flush(self) -> None:
        import os

        import numpy as np
        import pyarrow as pa

        from tidemark.lake.writer import CHANGE_DIR

        if not self.held:
            return
        rows = pa.concat_tables([t for t, _ in self.held])
        where = np.concatenate([b for _, b in self.held])
        self.held, self.n = [], 0
        bp = self.plan.bucket_plan
        fs, base = layout.filesystem(bp.uri, bp.options), layout.fs_path(bp.uri)
        for b in np.unique(where).tolist():
            mine = rows.filter(pa.array(where == b))
            rel = f"{CHANGE_DIR}/_bucket={b}/cdc-{self.tag}-{len(self.rows):05d}.parquet"
            if not bp.uri.startswith("s3://"):
                os.makedirs(os.path.dirname(base + "/" + rel), exist_ok=True)
            size = layout.write_parquet(mine, base + "/" + rel, fs)
            self.rows.append({"target": "table", "op": "cdc", "path": rel, "size": size, "rows": mine.num_rows,
                              "partition": str(b), "bucket": b})

    def close(self) -> list[dict]:
        """The ``cdc`` file actions of every file written."""
        self._flush()
        return self.rows

    def discard(self) -> None:
        """Delete the files written so far (the group is merged again, or not at all)."""
        from tidemark.lake.writer import discard_files

        self.held = []
        discard_files(self.plan.bucket_plan.uri, self.plan.bucket_plan.options, [a["path"] for a in self.rows])
        self.rows = []


def _rows_out(table: str, actions: list[dict], problem: str | None = None):
    """The group's result rows, file actions and counts only (never data): its table file actions,
    the changelog's files and CDC parts (`_log_out`), the history's, and a problem. Each group's
    changelog rows hold whole keys (keyless: identical rows), so they are consolidated per ``(data,
    time)`` across the batch and the driver only frames the parts."""
    import pyarrow as pa

    schema = _out_schema()
    rows = [{**{name: a.get(name) for name in schema.names}, "table": table} for a in actions]
    if problem is not None:
        rows.append({"table": table, "target": "table", "op": "problem", "problem": problem})
    return pa.Table.from_pylist(rows, schema=schema)
