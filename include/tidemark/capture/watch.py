"""Has the source committed changes to the stream's tables since we last looked? `change_signature`
reads the tables' cumulative statistics (rows inserted, updated, deleted) and file nodes in one catalog
query; `Debouncer` turns signatures into events. Used by the ``tidemark_airflow`` trigger behind the
drain DAG's AssetWatcher (docs/operations/airflow.md; why these counters: docs/internals/capture.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from psycopg2 import sql

from tidemark.config import StreamConfig

# one row per table of the stream that exists: its identity, its counters, its file node
_SIGNATURE = sql.SQL("""
    SELECT t.name, c.oid::bigint, pg_relation_filenode(c.oid),
           COALESCE(pg_stat_get_tuples_inserted(c.oid), 0) + COALESCE(pg_stat_get_tuples_updated(c.oid), 0)
             + COALESCE(pg_stat_get_tuples_deleted(c.oid), 0)
      FROM unnest(%s::text[]) AS t(name)
      JOIN pg_class c ON c.oid = to_regclass(t.name)
     ORDER BY t.name""")


def stream_tables(cfg: StreamConfig) -> list[str]:
    """The stream's tables as qualified names, quoted where needed (what ``to_regclass`` reads)."""
    return [t.qualified for t in cfg.source.tables]


def change_signature(conn, tables: list[str]) -> tuple:
    """The tables' change counters and file nodes, one comparable value. ``conn`` is a regular
    autocommit connection to the source: each call is its own transaction, so the statistics are
    read fresh (``stats_fetch_consistency`` caches them within one)."""
    with conn.cursor() as cur:
        cur.execute(_SIGNATURE, (tables,))
        return tuple(cur.fetchall())


def counts_tracked(conn) -> bool:
    """Whether the source keeps the per-table counters (``track_counts``)."""
    with conn.cursor() as cur:
        cur.execute("SELECT current_setting('track_counts')::boolean")
        return bool(cur.fetchone()[0])


@dataclass
class Debouncer:
    """Decide when a change becomes an event: the first change after a quiet spell fires at once;
    while changes keep coming, at most one event per ``min_interval`` seconds. ``clock``: for tests."""

    min_interval: float = 5.0
    clock: object = time.monotonic
    last_seen: tuple | None = None       # the signature when we last looked
    fired_at: float | None = None        # when the last event fired
    pending: bool = False                # a change seen and not yet fired
    events: int = 0

    def observe(self, signature: tuple) -> bool:
        """Record a signature; True when an event should fire now."""
        now = self.clock()
        if self.last_seen is None:        # the first look: a baseline, not a change
            self.last_seen = signature
            return False
        if signature != self.last_seen:
            self.last_seen = signature
            self.pending = True
        if self.pending and (self.fired_at is None or now - self.fired_at >= self.min_interval):
            self.pending = False
            self.fired_at = now
            self.events += 1
            return True
        return False
