"""Snapshots: a stream's initial (or re-) snapshot and the per-table snapshots of tables added to a
running stream, their chunks, and which of them the lake has loaded."""

from __future__ import annotations

import json
from typing import Any

import psycopg2.extras

from tidemark.control.connection import Connection, from_json
from tidemark.control.streams import set_table_state

# a snapshot's end: its status, when, and the tables it copied (their entries: what `last_table_snapshots` reads)
_COMPLETE = """UPDATE tidemark.snapshots SET status = 'complete', finished_at = now(), tables = %s
                WHERE stream = %s AND snapshot_id = %s"""


class SnapshotsMixin(Connection):
    """The snapshots of `Control`."""

    def snapshot_started(self, stream: str, snapshot_id: str, lsn: int, mode: str) -> None:
        with self.tx() as cur:
            cur.execute("""INSERT INTO tidemark.snapshots (stream, snapshot_id, lsn, mode, status)
                           VALUES (%s, %s, %s, %s, 'running')""", (stream, snapshot_id, lsn, mode))
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
                set_table_state(cur, stream, table, "capturing", lsn)

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
