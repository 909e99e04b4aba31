"""Streams: registering a stream's configuration, its positions (`StreamState`: the landed upper, the
frontier), the subscribers' checkpoints (the consolidation is the subscriber ``consolidate``), the state
of tables added to or removed from a stream that is capturing already (``stream_tables``), and its
snapshots (the stream's own, per-table ones of added tables; their chunks; which the lake has loaded)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import psycopg2.extras
from psycopg2 import sql

from tidemark.config import StreamConfig, TableRef
from tidemark.control.connection import Connection, from_json, insert
from tidemark.errors import TidemarkError


@dataclass(frozen=True)
class StreamState:
    name: str
    config: dict
    slot_name: str
    publication: str
    consistent_lsn: int | None
    landed_upper: int | None
    frontier: int | None
    next_seq: int
    state: str
    archived_seq: int | None = None      # the first seq left in the manifest (rows below are archived)
    archived_upper: int | None = None    # where the archived rows that cover the LSN line end


# snapshot modes that copy some tables at a consistent point of their own while the stream runs on
# (`tidemark.capture.snapshot.add_tables`): the stream is not 'snapshotting' meanwhile
TABLE_MODES = ("add", "table")
# the columns of ``tidemark.streams`` that `StreamState` holds (named as its fields)
_STREAM_COLUMNS = sql.SQL(", ").join(sql.Identifier(f.name) for f in fields(StreamState))
# a snapshot's end: its status, when, and the tables it copied (their entries: what `last_table_snapshots` reads)
_COMPLETE = """UPDATE tidemark.snapshots SET status = 'complete', finished_at = now(), tables = %s
                WHERE stream = %s AND snapshot_id = %s"""


def _set_table_state(cur, stream: str, table: str, state: str, since_lsn: int | None) -> None:
    """Put one table of the stream in ``state`` since ``since_lsn`` (in the caller's transaction)."""
    cur.execute("""INSERT INTO tidemark.stream_tables (stream, table_name, state, since_lsn)
                   VALUES (%s, %s, %s, %s)
                   ON CONFLICT (stream, table_name) DO UPDATE
                   SET state = EXCLUDED.state, since_lsn = EXCLUDED.since_lsn, updated_at = now()""",
                (stream, table, state, since_lsn))


def _qualified(name: str) -> str:
    """A table name from a stored stream file as the configuration spells it (``schema.name``)."""
    try:
        return TableRef.parse(name).qualified
    except Exception:  # noqa: BLE001 - an unusual stored name: compared as it is
        return name


class StreamsMixin(Connection):
    """The streams, their tables, frontiers, subscribers and snapshots of `Control`."""

    def upsert_stream(self, cfg: StreamConfig) -> StreamState:
        """Register a stream or update its configuration (positions are kept). On a stream that is
        capturing already (it has a consistent point), a table added to the file waits for its own
        snapshot (``awaiting_snapshot``) and a table removed from it is ``frozen`` at the frontier
        (`table_states`)."""
        with self.tx() as cur:
            cur.execute("SELECT config, consistent_lsn, frontier FROM tidemark.streams WHERE name = %s FOR UPDATE",
                        (cfg.stream,))
            before = cur.fetchone()
            cur.execute(insert("streams", ("name", "config", "slot_name", "publication"),
                               "ON CONFLICT (name) DO UPDATE SET config = EXCLUDED.config, updated_at = now() "
                               "RETURNING slot_name, publication"),
                        (cfg.stream, json.dumps(cfg.as_dict()), cfg.source.slot, cfg.source.publication))
            slot, pub = cur.fetchone()
            if (slot, pub) != (cfg.source.slot, cfg.source.publication):
                raise TidemarkError(f"stream {cfg.stream}: slot/publication cannot change once registered "
                                    f"(registered {slot}/{pub}, config says {cfg.source.slot}/{cfg.source.publication})")
            if before is not None and before[1] is not None and not cfg.source.is_feed:
                stored = from_json(before[0]) or {}
                # an entry is 'schema.table' or, with a column list or row filter, {name: 'schema.table', ...}
                old = {_qualified(t if isinstance(t, str) else t.get("name")) for t in
                       stored.get("source", {}).get("tables", [])
                       if isinstance(t, str) or (isinstance(t, dict) and isinstance(t.get("name"), str))}
                new = {t.qualified for t in cfg.source.tables}
                for table in sorted(new - old):
                    _set_table_state(cur, cfg.stream, table, "awaiting_snapshot", None)
                for table in sorted(old - new):
                    _set_table_state(cur, cfg.stream, table, "frozen", before[2])
            cur.execute("""INSERT INTO tidemark.subscribers (stream, name) VALUES (%s, 'consolidate')
                           ON CONFLICT DO NOTHING""", (cfg.stream,))
            cur.execute("INSERT INTO tidemark.metrics (stream) VALUES (%s) ON CONFLICT DO NOTHING", (cfg.stream,))
        return self.stream(cfg.stream)

    def stream(self, name: str) -> StreamState:
        row = self._one(sql.SQL("SELECT {} FROM tidemark.streams WHERE name = %s").format(_STREAM_COLUMNS), (name,))
        if row is None:
            raise TidemarkError(f"stream {name!r} is not registered; run: tidemark stream apply FILE (the "
                                f"stream's file, e.g. include/streams/{name}.yaml)")
        return StreamState(*row)

    def streams(self) -> list[StreamState]:
        rows = self._all(sql.SQL("SELECT {} FROM tidemark.streams ORDER BY name").format(_STREAM_COLUMNS))
        return [StreamState(*r) for r in rows]

    def update_stream(self, name: str, **fields: Any) -> None:
        self._update("streams", "name", name, {"consistent_lsn", "landed_upper", "frontier", "next_seq", "state"},
                     fields)

    def set_table_states(self, stream: str, tables: list[str], state: str, since_lsn: int | None = None) -> None:
        """Put ``tables`` of the stream in ``state`` (`table_states`)."""
        with self.tx() as cur:
            for table in tables:
                _set_table_state(cur, stream, table, state, since_lsn)

    def table_states(self, stream: str) -> dict[str, tuple[str, int | None]]:
        """{table: (state, since_lsn)} of the stream's tables that are not simply captured since its
        consistent point: ``awaiting_snapshot``, ``capturing`` (from their own snapshot) or ``frozen``."""
        rows = self._all("SELECT table_name, state, since_lsn FROM tidemark.stream_tables WHERE stream = %s", (stream,))
        return {t: (st, lsn) for t, st, lsn in rows}

    # -- the frontier and the subscribers' checkpoints ---------------------------------------------------
    def advance_frontier(self, stream: str, frontier: int, *, committed_segment: int | None = None,
                         subscriber: str = "consolidate") -> None:
        """Move the frontier and the subscriber's checkpoint forward (never backward), in one transaction;
        a move is recorded in ``frontier_moves`` (for `commit_lag`), a week of them kept."""
        with self.tx() as cur:
            cur.execute("SELECT frontier FROM tidemark.streams WHERE name = %s FOR UPDATE", (stream,))
            row = cur.fetchone()
            before = row[0] if row else None
            cur.execute("""UPDATE tidemark.streams SET frontier = GREATEST(COALESCE(frontier, 0), %s), updated_at = now()
                            WHERE name = %s""", (frontier, stream))
            if row is not None and (before is None or frontier > before):
                cur.execute("""INSERT INTO tidemark.frontier_moves (stream, frontier_before, frontier_after)
                               VALUES (%s, %s, %s)""", (stream, before, frontier))
                cur.execute("""DELETE FROM tidemark.frontier_moves
                                WHERE stream = %s AND at < clock_timestamp() - interval '7 days'""", (stream,))
            cur.execute("""INSERT INTO tidemark.subscribers (stream, name, checkpoint) VALUES (%s, %s, %s)
                           ON CONFLICT (stream, name) DO UPDATE
                           SET checkpoint = GREATEST(COALESCE(tidemark.subscribers.checkpoint, 0), EXCLUDED.checkpoint),
                               updated_at = now()""", (stream, subscriber, frontier))
            cur.execute("""UPDATE tidemark.metrics SET committed_position = GREATEST(COALESCE(committed_position, 0), %s),
                                  committed_segment = COALESCE(%s, committed_segment), updated_at = now()
                            WHERE stream = %s""", (frontier, committed_segment, stream))

    def reset_frontier(self, stream: str, frontier: int) -> None:
        """Set the frontier to exactly ``frontier`` (resend moves it to a new consistent point)."""
        with self.tx() as cur:
            cur.execute("UPDATE tidemark.streams SET frontier = %s, updated_at = now() WHERE name = %s", (frontier, stream))
            cur.execute("UPDATE tidemark.subscribers SET checkpoint = %s, updated_at = now() WHERE stream = %s AND name = 'consolidate'",
                        (frontier, stream))

    def subscriber_checkpoint(self, stream: str, name: str) -> int | None:
        row = self._one("SELECT checkpoint FROM tidemark.subscribers WHERE stream = %s AND name = %s", (stream, name))
        return row[0] if row else None

    def add_subscriber(self, stream: str, name: str, checkpoint: int) -> bool:
        """Register a subscriber at ``checkpoint``; False when it already exists (left unchanged)."""
        return self._one("""INSERT INTO tidemark.subscribers (stream, name, checkpoint) VALUES (%s, %s, %s)
                            ON CONFLICT (stream, name) DO NOTHING RETURNING name""",
                         (stream, name, checkpoint)) is not None

    def subscribers(self, stream: str) -> list[dict]:
        """Every subscriber of the stream (the consolidation's own included) with its checkpoint."""
        return self._dicts("""SELECT name, checkpoint, updated_at FROM tidemark.subscribers WHERE stream = %s
                               ORDER BY name""", (stream,))

    def subscriber_lags(self, stream: str, frontier: int | None) -> list[dict]:
        """The subscribers but the consolidation's own, each with its lag behind ``frontier`` (``lag_bytes``,
        frontier − checkpoint in LSN bytes) and whether it lags (``lagging``)."""
        out = []
        for s in self.subscribers(stream):
            if s["name"] != "consolidate":
                lag = max(0, frontier - (s["checkpoint"] or 0)) if frontier is not None else 0
                out.append({**s, "lag_bytes": lag, "lagging": lag > 0})
        return out

    def drop_subscriber(self, stream: str, name: str) -> bool:
        return self._one("DELETE FROM tidemark.subscribers WHERE stream = %s AND name = %s RETURNING name",
                         (stream, name)) is not None

    def ack_subscriber(self, stream: str, name: str, upper: int) -> int | None:
        """Move the subscriber's checkpoint forward to ``upper`` (never backward); the new checkpoint,
        None when there is no such subscriber."""
        row = self._one("""UPDATE tidemark.subscribers SET checkpoint = GREATEST(COALESCE(checkpoint, 0), %s),
                                  updated_at = now() WHERE stream = %s AND name = %s RETURNING checkpoint""",
                        (upper, stream, name))
        return row[0] if row else None

    # -- snapshots ---------------------------------------------------------------------------------------
    def snapshot_started(self, stream: str, snapshot_id: str, lsn: int, mode: str) -> None:
        """Record a running snapshot. The stream is ``snapshotting`` while a snapshot of its own runs
        (initial, resend: it holds the drains back, so `tidemark.status.freshness` judges nothing); a
        snapshot of some tables (`TABLE_MODES`) runs beside the drains and consolidations and leaves
        the stream's state alone."""
        with self.tx() as cur:
            cur.execute("""INSERT INTO tidemark.snapshots (stream, snapshot_id, lsn, mode, status)
                           VALUES (%s, %s, %s, %s, 'running')""", (stream, snapshot_id, lsn, mode))
            if mode not in TABLE_MODES:
                cur.execute("UPDATE tidemark.streams SET state = 'snapshotting', updated_at = now() WHERE name = %s",
                            (stream,))

    def snapshot_chunks_planned(self, stream: str, snapshot_id: str,
                                chunks: list[tuple[str, int, int, int]]) -> None:
        """Record a snapshot's chunks: ``(table, chunk_no, page_lo, page_hi)`` each."""
        with self.tx() as cur:
            psycopg2.extras.execute_values(
                cur, """INSERT INTO tidemark.snapshot_chunks (stream, snapshot_id, table_name, chunk_no, page_lo,
                        page_hi) VALUES %s""", [(stream, snapshot_id, *c) for c in chunks])

    def snapshot_chunk_done(self, stream: str, snapshot_id: str, table: str, chunk_no: int, *, status: str,
                            uri: str | None = None, rows: int | None = None, error: str | None = None) -> None:
        self._run("""UPDATE tidemark.snapshot_chunks SET status = %s, uri = COALESCE(%s, uri),
                            row_count = COALESCE(%s, row_count), error = %s, updated_at = now()
                      WHERE stream = %s AND snapshot_id = %s AND table_name = %s AND chunk_no = %s""",
                  (status, uri, rows, error, stream, snapshot_id, table, chunk_no))

    def running_snapshots(self, stream: str) -> list[str]:
        """The stream's snapshots still marked running, oldest first (under a snapshot lease, which
        excludes every other snapshot of the stream, these are the ones whose process died)."""
        return [r[0] for r in self._all("""SELECT snapshot_id FROM tidemark.snapshots
                                            WHERE stream = %s AND status = 'running' ORDER BY started_at""", (stream,))]

    def snapshot_failed(self, stream: str, snapshot_id: str, reason: str) -> None:
        with self.tx() as cur:
            cur.execute("""UPDATE tidemark.snapshots SET status = 'failed', finished_at = now(),
                                  tables = tables || jsonb_build_object('_error', %s::text)
                            WHERE stream = %s AND snapshot_id = %s""", (reason, stream, snapshot_id))
            cur.execute("""UPDATE tidemark.streams
                              SET state = CASE WHEN consistent_lsn IS NULL THEN 'new' ELSE 'capturing' END,
                                  updated_at = now() WHERE name = %s""", (stream,))

    def snapshot_complete(self, stream: str, snapshot_id: str, lsn: int, tables: dict) -> None:
        """Mark the snapshot complete and move the stream to its consistent point, in one transaction."""
        with self.tx() as cur:
            cur.execute(_COMPLETE, (json.dumps(tables), stream, snapshot_id))
            cur.execute("""UPDATE tidemark.streams SET consistent_lsn = %s, landed_upper = %s, state = 'capturing',
                                  updated_at = now() WHERE name = %s""", (lsn, lsn, stream))
            # every table of the stream is captured from the new consistent point (a frozen one stays)
            cur.execute("""DELETE FROM tidemark.stream_tables WHERE stream = %s AND state <> 'frozen'""", (stream,))

    def snapshot_tables_complete(self, stream: str, snapshot_id: str, lsn: int, tables: dict) -> None:
        """Mark a per-table snapshot (tables added to a running stream) complete and its tables
        ``capturing`` from ``lsn``, in one transaction; the stream's own positions do not move."""
        with self.tx() as cur:
            cur.execute(_COMPLETE, (json.dumps(tables), stream, snapshot_id))
            for table in tables:
                _set_table_state(cur, stream, table, "capturing", lsn)
            # a stream a per-table snapshot left 'snapshotting' (as Tidemark did before `TABLE_MODES`)
            # captures: no snapshot of its own runs
            cur.execute("""UPDATE tidemark.streams SET state = 'capturing', updated_at = now()
                            WHERE name = %s AND state = 'snapshotting' AND consistent_lsn IS NOT NULL
                              AND NOT EXISTS (SELECT 1 FROM tidemark.snapshots
                                               WHERE stream = %s AND status = 'running')""", (stream, stream))

    def complete_snapshots(self, stream: str) -> list[tuple[str, int, str, dict]]:
        """Snapshots complete but not yet loaded into the lake, oldest first: (id, lsn, mode, tables)."""
        return [tuple(r) for r in self._all("""SELECT snapshot_id, lsn, mode, tables FROM tidemark.snapshots
                                                WHERE stream = %s AND status = 'complete' ORDER BY lsn, started_at""",
                                            (stream,))]

    def last_table_snapshots(self, stream: str) -> dict[str, dict]:
        """{table: its entry in the latest snapshot (complete or loaded) that copied it}: what the
        lake's copy of each table was taken with (``published``: its column list and row filter)."""
        out: dict[str, dict] = {}
        for (tables,) in self._all("""SELECT tables FROM tidemark.snapshots
                                       WHERE stream = %s AND status IN ('complete', 'loaded')
                                       ORDER BY lsn, started_at""", (stream,)):
            out.update({t: e for t, e in (from_json(tables) or {}).items() if isinstance(e, dict)})
        return out

    def mark_snapshots_loaded(self, stream: str, snapshot_ids: list[str]) -> None:
        self._run("""UPDATE tidemark.snapshots SET status = 'loaded'
                      WHERE stream = %s AND snapshot_id = ANY(%s) AND status = 'complete'""",
                  (stream, list(snapshot_ids)))

    def loaded_snapshots(self, stream: str) -> list[tuple[int, Any, dict]]:
        """(lsn, finished_at, tables) of the stream's snapshots complete or loaded, newest first (what
        `tidemark.lake.history` reads as of a time before any change)."""
        rows = self._all("""SELECT lsn, finished_at, tables FROM tidemark.snapshots WHERE stream = %s
                             AND status IN ('complete', 'loaded') ORDER BY lsn DESC""", (stream,))
        return [(int(lsn), finished, tables or {}) for lsn, finished, tables in rows]
