"""Has the source committed changes to the stream's tables since we last looked? The cheap question
behind the event-driven drain (the ``tidemark_airflow`` trigger behind the drain DAG's AssetWatcher).

Why not the WAL position: ``pg_current_wal_lsn()`` is the whole cluster's, and it moves for reasons
that are not the stream's work: other databases (the embedded default keeps the control and Airflow
databases in the same cluster), the drain's own marker transaction, checkpoints, vacuum. Nor the
slot's ``confirmed_flush_lsn``: it is acknowledged only up to the consolidated frontier (the default
``drain.ack_policy``), so it trails the landed work by design. And a replication peek decodes from the
slot's restart position every time, which is everything not yet acknowledged.

What is cheap and says "these tables changed": PostgreSQL's cumulative statistics. Each of the
stream's tables has counters of rows inserted, updated and deleted (``pg_stat_user_tables``), which
backends publish at the end of a transaction (at most once a second, when they go idle), and a file
node that a TRUNCATE (or a rewrite) replaces. `change_signature` reads them for the stream's tables in
one catalog query without touching the tables; when it differs from the last one seen, there is work
(or, rarely, a false alarm: the counters also count rolled-back rows, a rewrite changes the file node;
a drain that finds nothing lands a progress-only segment and no Spark job runs). A source with
``track_counts`` off has no counters: the watcher then says so and the timed safety drain remains.

`Debouncer` turns signatures into events: at once for the first change after a quiet spell, then at
most one per ``min_interval`` while changes keep coming, so a busy source gets a drain per interval (the
runs queue in Airflow and coalesce) rather than one per transaction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
    events: int = field(default=0)

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
