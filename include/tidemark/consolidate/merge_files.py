"""The lake files a merge group rewrites (`merge.merge_records`): the parts a group is merged in
(`_parts`), the files read once or twice (`_Held`, `_named`) and written again window by window in
key order with the rows after the batch (`_windows`, `_shares`, `_rewrite`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tidemark.consolidate.key_lookup import key_lookup
from tidemark.consolidate.work_area import META_DIFF, META_POS, META_TIME, META_UNKNOWN
from tidemark.consolidate.merge_epoch import _linked, _log_form, _taken_out
from tidemark.consolidate.merge_plan import TablePlan
from tidemark.consolidate.preconsolidate import cancel_zero, identity_columns, same_as_previous
from tidemark.lake import layout
from tidemark.lake.delta import conform


def _parts(plan: TablePlan, recs, rb, rewrite: dict):
    """The parts a group is merged in, one after the other: (files to rewrite per bucket, mask of the
    records; None: all). Each bucket's files in key order by the statistics of the first sort column
    (files whose ranges overlap or touch together), each with the records from its first key to the
    next one's; as many of them as hold ``target_rows`` rows together, and those an update that moved
    a key and left TOAST values unchanged links, with those between. A bucket whose files lack the
    statistics (or, keyless, whose records or files may hold nulls there) is one."""
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
    together |= _linked(unit, len(units), recs.column(META_TIME).to_numpy(), recs.column(META_POS).to_numpy(),
                        recs.column(META_DIFF).to_numpy(), recs.column(META_UNKNOWN))
    part = np.r_[0, np.cumsum(~together)]
    out = []
    for k in range(part[-1] + 1):
        members = np.nonzero(part == k)[0]
        files: dict = {}
        for i in members.tolist():
            files.setdefault(units[i][0], []).extend(units[i][1])
        out.append((files, None if len(members) == len(units) else (unit >= members[0]) & (unit <= members[-1])))
    return out


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
    bp, keys = plan.bucket_plan, plan.bucket_plan.keys
    probe = recs.select(keys) if keys else conform(recs, bp.schema)
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
                at = key_lookup(probe, rows.select(keys), keys)
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
    `identity_columns` compares in Arrow (floats by their bits, nulls equal): the rows equal
    to one in every column, and maybe a few more (lists are not compared)."""
    n = probe.num_rows
    cols, _ = identity_columns(pa.concat_tables([probe, rows]))
    if not cols:
        return np.ones(rows.num_rows, bool)
    key = pa.table({f"k{i}": c for i, c in enumerate(cols)})
    order = np.asarray(key.append_column("_i", pa.array(np.arange(key.num_rows))).sort_by(
        [(f"k{i}", "ascending") for i in range(len(cols))]).column("_i"))
    group = np.cumsum(~same_as_previous(key.take(pa.array(order)))) - 1
    hit = np.zeros(group[-1] + 1, bool)
    hit[group[order < n]] = True
    out = np.empty(len(order), bool)
    out[order] = hit[group]
    return out[n:]


def _windows(bp, entries: list[_File]) -> list[list[_File]]:
    """A bucket's files to rewrite in key order (by their first rows) as windows: one file, or files
    whose key ranges overlap or touch (rows equal in the sort columns in two files), so that each
    window's rows come after those of the windows before. Files without rows are in none."""
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
            log = _taken_out(gone, t, cts, bp.schema)
            emit(_log_form(log if bp.keys else cancel_zero(log), bp.schema))
        if writer is not None:
            writer.add(rows)
        return
    if writer is None:
        return
    for window, share in zip(windows or [[]], _shares(bp, rows, windows)):
        writer.add(pa.concat_tables([_unnamed(bp, held, window), share]))
