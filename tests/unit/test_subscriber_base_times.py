"""A subscriber's rows at a re-snapshot's LSN: the base (the lake's difference at that LSN) and the
changelog's rows at the same time are one update per row (`subscribers._table_changes`); rows at
other times are left as the changelog holds them."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa

from tidemark import subscribers

DATA = pa.schema([pa.field("x", pa.int32()), pa.field("s", pa.string())])
LOG = pa.schema(list(DATA) + [pa.field("_time", pa.int64()), pa.field("_diff", pa.int64()),
                              pa.field("_commit_ts", pa.int64())])
L = 1000


def _rows(*rows) -> pa.Table:
    return pa.Table.from_pylist([dict(zip(LOG.names, r)) for r in rows], schema=LOG)


def test_a_change_committed_at_the_snapshots_lsn_is_summed_with_the_base(monkeypatch):
    base = _rows((4, "live", L, 24, None), (3, "b", L, -39, None))
    # a transaction whose commit is at L itself, and later ones (one of them the same row again)
    log = _rows((4, "live", L, 1, 77), (4, "live", L + 5, 1, 78), (9, "z", L + 6, 1, 79)).append_column(
        "_commit_date", pa.array([None] * 3, pa.date32()))
    for name, value in {"storage_options": lambda cfg: {}, "table_uri": lambda cfg, t: "lake/t",
                        "changelog_uri": lambda cfg, t: "lake/t_changelog", "open_delta": lambda uri, options: object(),
                        "exact_schema": lambda dt: DATA, "log_schema": lambda data: LOG,
                        "snapshot_versions": lambda dt, stream: [(3, L)],
                        "base_changes": lambda uri, options, version, lsn, data: base,
                        "changelog_between": lambda cfg, table, lower, upper: log}.items():
        monkeypatch.setattr(subscribers, name, value)
    out = subscribers._table_changes(SimpleNamespace(stream="s"), "public.bag", 0, 2000)
    got = sorted((r["x"], r["s"], r["_time"], r["_diff"]) for r in out.to_pylist())
    assert got == [(3, "b", L, -39), (4, "live", L, 25), (4, "live", L + 5, 1), (9, "z", L + 6, 1)]
