"""The SCD type 2 fold, in Arrow and numpy: the one fold of Tidemark, for the history tables the
consolidation keeps (`consolidate.history`) and a key's versions read from the lake
(`lake.history.key_history`).

A version is a row's columns plus `HISTORY_META`: the source commit LSNs that opened and closed it
(``_valid_to_lsn`` null while current), their commit timestamps (null where unknown, e.g. a load),
``_is_current`` and ``_deleted`` (it ended because its key stopped existing: a delete, the key
changing, a load without it). The changelog rows in time order: a ``-1`` closes the key's open
version, a ``+1`` opens one (a ``-1`` and a ``+1`` of one key at one time: an update, not deleted);
a time's commit timestamp is the first non-null one of its rows. A full load at ``reset`` closes
every open version that differs from its key's loaded row (rows compared by value bits,
`tidemark.rowid`) or whose key it lacks, and opens one for every loaded row left without. A
changelog that contradicts the versions is a problem named in words, nothing folded.

Keys become dense integer ids (`ids`); sorted by (key, time, diff), a consistent changelog
alternates ``-1``/``+1`` per key, starting with a ``-1`` exactly when the key has an open version.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tidemark.lake.delta import conform
from tidemark.lsn import format_lsn
from tidemark.rowid import identity_table, row_keys

HISTORY_META = ("_valid_from_lsn", "_valid_to_lsn", "_valid_from", "_valid_to", "_is_current", "_deleted")
LOG_META = ("_time", "_diff", "_commit_ts", "_commit_date")     # the changelog's own columns


def history_schema(data):
    """The versions' schema: the data columns (``data``, a pyarrow schema), then `HISTORY_META`."""
    ts = pa.timestamp("us", tz="UTC")
    return pa.schema(list(data) + [pa.field("_valid_from_lsn", pa.int64()), pa.field("_valid_to_lsn", pa.int64()),
                                   pa.field("_valid_from", ts), pa.field("_valid_to", ts),
                                   pa.field("_is_current", pa.bool_()), pa.field("_deleted", pa.bool_())])


def log_schema(data):
    """The changelog rows' schema (the fold's input; the changelog's Delta schema without its
    partition): the data columns (``data``), then ``_time``, ``_diff``, ``_commit_ts``."""
    return pa.schema(list(data) + [pa.field("_time", pa.int64()), pa.field("_diff", pa.int64()),
                                   pa.field("_commit_ts", pa.timestamp("us", tz="UTC"))])


def _versions(rows, hs, start=None, end=None, deleted=None):
    """``rows`` as versions in ``hs``: opened at ``start`` (``(lsns, commit times)``; None: ``rows``
    have their ``_valid_from_lsn``, ``_valid_from``), current when ``end`` is None, else closed
    at ``end`` (``(lsns, commit times)``), ``deleted`` or not."""
    n = rows.num_rows
    data = [f for f in hs if f.name not in HISTORY_META]
    rows = conform(rows, pa.schema(data + ([hs.field("_valid_from_lsn"), hs.field("_valid_from")] if start is None
                                           else [])))
    ts = hs.field("_valid_to").type
    more = {"_valid_to_lsn": pa.nulls(n, pa.int64()) if end is None else pa.array(end[0], pa.int64()),
            "_valid_to": pa.nulls(n, ts) if end is None else end[1], "_is_current": pa.array(np.full(n, end is None)),
            "_deleted": pa.array(np.zeros(n, bool) if deleted is None else deleted)}
    if start is not None:
        more.update({"_valid_from_lsn": pa.array(start[0], pa.int64()), "_valid_from": start[1]})
    for name, col in more.items():
        rows = rows.append_column(hs.field(name), col)
    return rows.select(hs.names)


def opened_at_load(rows, lsn: int, hs=None):
    """``rows`` (the data columns) as current versions opened by a load at ``lsn`` (no commit time)."""
    hs = hs if hs is not None else history_schema(rows.schema)
    n = rows.num_rows
    return _versions(rows, hs, (np.full(n, lsn, np.int64), pa.nulls(n, hs.field("_valid_from").type)))


def fold(open_rows, log, keys: list[str], hs, *, base=None, reset: int | None = None
         ) -> tuple[Any, Any, Any, str | None]:
    """Fold the changelog rows ``log`` into the open versions ``open_rows`` (in ``hs``, a
    `history_schema`), and the loaded rows ``base`` at ``reset`` when given (see the module doc):
    (the open versions left as they were, the new open versions, the versions closed now, a
    problem or None), each an Arrow table in ``hs``. With a load, every open version is in the new
    ones (the loaded rows are compared with all of them)."""
    if base is None:
        return _fold_changes(open_rows, log, keys, hs)
    times = log.column("_time")
    early, late = log.filter(pc.less(times, reset)), log.filter(pc.greater_equal(times, reset))
    kept, opened, closed, problem = _fold_changes(open_rows, early, keys, hs)
    if problem is None:
        state, at_load = _load(_concat([kept, opened], hs), base, reset, keys, hs)
        kept, opened, late_closed, problem = _fold_changes(state, late, keys, hs)
    if problem is not None:
        return None, None, None, problem
    return hs.empty_table(), _concat([kept, opened], hs), _concat([closed, at_load, late_closed], hs), None


def _concat(parts, hs):
    parts = [conform(p, hs) for p in parts if p.num_rows]
    return pa.concat_tables(parts) if parts else hs.empty_table()


def ids(*tables):
    """Dense int64 ids of the rows of ``tables`` (the same columns, in the same order): equal ids
    exactly for the same rows by value bits (nulls equal); one numpy array per table."""
    both = pa.concat_tables([conform(t, tables[0].schema) for t in tables])
    try:
        out = np.zeros(both.num_rows, np.int64)
        for i, col in enumerate(identity_table(both).columns):
            enc = pc.dictionary_encode(col.combine_chunks(), null_encoding="encode")
            codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
            out = codes if i == 0 else np.unique(out * len(enc.dictionary) + codes, return_inverse=True)[1]
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError, pa.ArrowInvalid):
        seen: dict = {}
        out = np.array([seen.setdefault(k, len(seen)) for k in row_keys(both)], np.int64)
    return np.split(out.astype(np.int64).reshape(-1), np.cumsum([t.num_rows for t in tables])[:-1])


def _fold_changes(open_rows, log, keys: list[str], hs):
    """`fold` without a load."""
    n = log.num_rows
    if n == 0:
        return open_rows, hs.empty_table(), hs.empty_table(), None
    oid, lid = ids(open_rows.select(keys), log.select(keys))
    order = np.lexsort((log.column("_diff").to_numpy(), log.column("_time").to_numpy(), lid))
    s = log.take(pa.array(order, pa.int64()))
    kid = lid[order]
    universe = int(max(kid.max(initial=-1), oid.max(initial=-1))) + 1
    open_at = np.full(universe, -1, np.int64)          # the open version of each key id (its row)
    open_at[oid] = np.arange(len(oid))
    same = np.r_[False, kid[1:] == kid[:-1]]           # the row's key is the one of the row before
    t = s.column("_time").to_numpy()
    d = s.column("_diff").to_numpy()
    prev = np.r_[0, d[:-1]]
    ok = np.isin(d, (-1, 1)) & np.where(same, prev == -d, np.where(open_at[kid] >= 0, d == -1, d == 1))
    if not ok.all():
        return None, None, None, _problem(s, keys, ok, same, prev, t, d)
    ts_at = _commit_times(log)
    later = np.r_[same[1:], False]                     # the row after is of the same key
    nxt = np.minimum(np.arange(n) + 1, n - 1)
    minus = np.nonzero(d == -1)[0]
    from_open, from_log = minus[~same[minus]], minus[same[minus]]
    m = np.r_[from_open, from_log].astype(np.int64)
    ended = pa.concat_tables([                         # the versions the -1s end: open ones, and opened in the log
        _versions(open_rows.take(pa.array(open_at[kid[from_open]], pa.int64())), hs),
        _versions(s.take(pa.array(from_log - 1, pa.int64())), hs, (t[from_log - 1], ts_at(t[from_log - 1])))])
    closed = _versions(ended, hs, None, (t[m], ts_at(t[m])), ~(later[m] & (t[nxt[m]] == t[m]) & (d[nxt[m]] == 1)))
    plus = np.nonzero((d == 1) & ~later)[0]            # a key's last +1 opens its current version
    opened = _versions(s.take(pa.array(plus, pa.int64())), hs, (t[plus], ts_at(t[plus])))
    in_log = np.zeros(universe, bool)
    in_log[kid] = True
    touched = in_log[oid]
    return (open_rows.filter(pa.array(~touched)) if touched.any() else open_rows), opened, closed, None


def _commit_times(log):
    """A function giving each time's commit timestamp: the first non-null one of its rows in
    ``log``'s order (null where none)."""
    t0 = log.column("_time").to_numpy()
    stamps = log.column("_commit_ts")
    valid = np.nonzero(~stamps.is_null().to_numpy(zero_copy_only=False))[0]
    times, first = np.unique(t0[valid], return_index=True)
    stamps = stamps.take(pa.array(valid[first], pa.int64())).combine_chunks()

    def ts_at(q):
        if not len(times):
            return pa.nulls(len(q), stamps.type)
        pos = np.minimum(np.searchsorted(times, q), len(times) - 1)
        return stamps.take(pa.array(pos, pa.int64(), mask=times[pos] != q))
    return ts_at


def _problem(s, keys: list[str], ok, same, prev, t, d) -> str:
    """The words for the first row (in time order) of the sorted changelog ``s`` that breaks the rules."""
    bad = np.nonzero(~ok)[0]
    i = int(bad[np.argmin(t[bad])])
    k, at = str(dict(zip(keys, (s.column(c)[i].as_py() for c in keys)))), format_lsn(int(t[i]))
    if d[i] > 1 or (d[i] == 1 and same[i] and prev[i] == 1 and t[i - 1] == t[i]):
        return f"key {k} is added twice at {at} in the changelog"
    if d[i] < 0:
        return f"the changelog takes key {k} out at {at} but no version of it is open"
    return f"the changelog adds key {k} at {at} while a version of it is open"


def _load(state, base, reset: int, keys: list[str], hs):
    """A full load of ``base`` (the data columns) at ``reset`` over the current versions ``state``:
    (the current versions after it, the versions it closed)."""
    names = [n for n in hs.names if n not in HISTORY_META]
    base = conform(base, pa.schema([hs.field(n) for n in names]))
    sid, bid = ids(state.select(keys), base.select(keys))
    srow, brow = ids(state.select(names), base)
    loaded = np.full(int(max(sid.max(initial=-1), bid.max(initial=-1))) + 1, -1, np.int64)
    loaded[bid] = np.arange(len(bid))                  # the loaded row of each key id
    match = loaded[sid]
    same = (match >= 0) & (brow[np.maximum(match, 0)] == srow if len(brow) else np.zeros(len(sid), bool))
    n = int((~same).sum())
    closed = _versions(state.filter(pa.array(~same)), hs, None,
                       (np.full(n, reset, np.int64), pa.nulls(n, hs.field("_valid_to").type)), match[~same] < 0)
    going = np.zeros(len(loaded), bool)
    going[sid[same]] = True
    fresh = base.filter(pa.array(~going[bid])) if len(bid) else base
    return _concat([state.filter(pa.array(same)), opened_at_load(fresh, reset, hs)], hs), closed
