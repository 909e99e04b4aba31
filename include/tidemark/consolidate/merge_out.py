"""What a merge group gives back and writes on the way (`merge.merge_group`): its net effect's counts
and Delta change data (`_count_changes`, `_ChangeData`), its changelog files and CDC parts
(`_Logged`, `_log_out`) and its result rows (`_rows_out`): file actions and counts, never data."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tidemark.consolidate import avro_columns as AC
from tidemark.consolidate.cdc_file import encode_updates
from tidemark.consolidate.key_lookup import key_lookup
from tidemark.consolidate.log_evolution import write_log_files
from tidemark.consolidate.merge_plan import OUT_DDL, TablePlan
from tidemark.consolidate.preconsolidate import consolidated_updates
from tidemark.lake import filesystem, layout, strip_scheme
from tidemark.landing.store import open_store
from tidemark.lake.writer import CHANGE_DIR, discard_files


def _count_changes(bp, before, after, counts: dict, change_data, before_bucket, after_bucket) -> None:
    """Add a part's net effect to ``counts`` (`CHANGE_COUNTS`): ``before``, the lake rows its records
    name (`_named`), against ``after``, those rows after the batch. A keyed table: a key only after is
    inserted, only before deleted, in both with other values updated; a table without a key: each
    identical row's net count, up inserted, down deleted. The counts are of the lake's rows before and
    after, not of the source's statements (a row inserted and deleted in the batch is not counted).
    With ``change_data`` (a `_ChangeData`), the same net effect's rows go to it, with their buckets
    (``before_bucket``, ``after_bucket``): inserts, deletes and updates' pre- and postimages (a changed
    key: a delete and an insert; a keyless row as many times as its net count)."""
    names = bp.schema.names
    if bp.keys:
        at = key_lookup(after.select(bp.keys), before.select(bp.keys), bp.keys)
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
    first, sums = consolidated_updates(both, times, np.r_[np.full(before.num_rows, -1, np.int64),
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


class _Logged:
    """A group's changelog rows as `merge_records` gives them, part by part: those with ``time >=
    plan.log.lo`` written as the changelog's Parquet files and a CDC part (`_log_out`) whenever
    ``target_rows`` of them are held, the rest at `close`. With the table's history, every part is
    kept for `all`."""

    def __init__(self, plan: TablePlan):
        self.plan, self.held, self.kept, self.rows = plan, [], [], []

    def __call__(self, log) -> None:
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
        log = pa.concat_tables(self.held) if len(self.held) > 1 else self.held[0] if self.held else None
        self.held = []
        if log is not None and log.num_rows:
            self.rows += _log_out(self.plan, log)

    def all(self):
        return pa.concat_tables(self.kept) if self.kept else None

    def close(self) -> list[dict]:
        """The result rows of every changelog file and CDC part written."""
        self._flush()
        return self.rows


def _log_out(plan: TablePlan, log) -> list[dict]:
    """Write changelog rows (their times at or after ``plan.log.lo``): the changelog Parquet files and
    a CDC part (the rows' Materialize CDC updates, `cdc_file.encode_updates`, as container blocks of
    the table's file, put in the landing store); return their result rows: the files' actions, then
    the part's key and size with, in ``log``, the number of updates per time (int64 times, then
    int64 counts)."""
    lp = plan.log
    tag = layout.plan_tag(plan.frontier)
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
        self.plan, self.held, self.n, self.rows = plan, [], 0, []
        self.tag = layout.plan_tag(plan.frontier)

    def add(self, rows, buckets, kind: str) -> None:
        if not rows.num_rows:
            return
        t = rows.select(self.plan.bucket_plan.schema.names)
        self.held.append((t.append_column("_change_type", pa.array([kind] * t.num_rows, pa.string())),
                          np.asarray(buckets, np.int32)))
        self.n += t.num_rows
        if self.n >= self.plan.bucket_plan.target_rows:
            self._flush()

    def _flush(self) -> None:
        if not self.held:
            return
        rows = pa.concat_tables([t for t, _ in self.held])
        where = np.concatenate([b for _, b in self.held])
        self.held, self.n = [], 0
        bp = self.plan.bucket_plan
        fs, base = filesystem(bp.uri, bp.options), strip_scheme(bp.uri)
        for b in np.unique(where).tolist():
            mine = rows.filter(pa.array(where == b))
            rel = f"{CHANGE_DIR}/_bucket={b}/cdc-{self.tag}-{len(self.rows):05d}.parquet"
            size = layout.write_parquet(mine, base + "/" + rel, fs)
            self.rows.append({"target": "table", "op": "cdc", "path": rel, "size": size, "rows": mine.num_rows,
                              "partition": str(b), "bucket": b})

    def close(self) -> list[dict]:
        """The ``cdc`` file actions of every file written."""
        self._flush()
        return self.rows

    def discard(self) -> None:
        """Delete the files written so far (the group is merged again, or not at all)."""
        self.held = []
        discard_files(self.plan.bucket_plan.uri, self.plan.bucket_plan.options, [a["path"] for a in self.rows])
        self.rows = []


def _rows_out(table: str, actions: list[dict], problem: str | None = None):
    """The group's result rows (`OUT_DDL`), file actions and counts only (never data): its table file
    actions, the changelog's files and CDC parts (`_log_out`), the history's, and a problem."""
    schema = layout.ddl_schema(OUT_DDL)
    rows = [{**{name: a.get(name) for name in schema.names}, "table": table} for a in actions]
    if problem is not None:
        rows.append({"table": table, "target": "table", "op": "problem", "problem": problem})
    return pa.Table.from_pylist(rows, schema=schema)
