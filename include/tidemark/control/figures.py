"""The figures the status page shows: a stream's metrics (the current figures, when its jobs last did
something, the commit -> lake lag, the history of samples behind the page's charts), each batch's write
cost (`tidemark.consolidate.writecost`), the storage figures (`tidemark.lake.storage`) and what the
maintenance runs did (`tidemark.maintain`)."""

from __future__ import annotations

import itertools
import json
from typing import Any

from psycopg2 import sql

from tidemark.control.connection import Connection, from_json, insert


def lag_summary(rows, window_seconds: int, points: int = 20) -> dict | None:
    """Weighted percentiles of commit -> lake lag from ``(moved_at_us, min_commit_us, max_commit_us,
    txn_count)`` rows (one per consolidated segment): each segment's transactions spread evenly over
    its commit-time span, ``points`` samples at most per segment."""
    samples: list[tuple[float, float]] = []       # (lag seconds, weight)
    moves = set()
    for at, lo, hi, txns in rows:
        moves.add(at)
        at, lo, hi, txns = float(at), float(lo), float(hi if hi is not None else lo), int(txns)
        k = max(1, min(points, txns))
        for i in range(k):
            commit = lo + (hi - lo) * ((i + 0.5) / k)
            samples.append((max(0.0, (at - commit) / 1e6), txns / k))
    if not samples:
        return None
    samples.sort()
    total = sum(w for _, w in samples)

    def quantile(q: float) -> float:
        seen = 0.0
        for lag, w in samples:
            seen += w
            if seen >= q * total:
                return lag
        return samples[-1][0]

    return {"median_seconds": round(quantile(0.5), 1), "p95_seconds": round(quantile(0.95), 1),
            "max_seconds": round(samples[-1][0], 1), "transactions": int(round(total)), "batches": len(moves),
            "window_seconds": window_seconds}


class FiguresMixin(Connection):
    """The status page's figures of `Control`."""

    def set_metric(self, stream: str, **fields: Any) -> None:
        self._update("metrics", "stream", stream, {"current_segment", "committed_segment", "committed_position",
                                                   "last_segment_at", "slot_lag_bytes"}, fields)

    def metrics(self, stream: str) -> dict:
        rows = self._dicts("""SELECT current_segment, committed_segment, committed_position, last_segment_at,
                                     slot_lag_bytes, updated_at FROM tidemark.metrics WHERE stream = %s""", (stream,))
        return rows[0] if rows else {}

    def activity(self, stream: str) -> dict:
        """When the stream's jobs last did something, on the control database's clock (``now``):
        ``last_landed_at`` (the newest landed segment: every drain run lands one), ``last_consolidated_at``
        (the consolidation's checkpoint last moved: `advance_frontier`, a resend's `reset_frontier`) and
        ``oldest_pending_at`` (the oldest landed segment above the frontier, None when none waits) and
        ``last_snapshot_at`` (the newest complete snapshot's end)."""
        rows = self._dicts("""SELECT clock_timestamp(),
                                  (SELECT max(created_at) FROM tidemark.segments
                                    WHERE stream = s.name AND status = 'landed'),
                                  (SELECT updated_at FROM tidemark.subscribers
                                    WHERE stream = s.name AND name = 'consolidate'),
                                  (SELECT min(created_at) FROM tidemark.segments
                                    WHERE stream = s.name AND status = 'landed' AND upper_lsn > COALESCE(s.frontier, -1)),
                                  (SELECT max(finished_at) FROM tidemark.snapshots
                                    WHERE stream = s.name AND status IN ('complete', 'loaded'))
                             FROM tidemark.streams s WHERE s.name = %s""", (stream,),
                           ["now", "last_landed_at", "last_consolidated_at", "oldest_pending_at", "last_snapshot_at"])
        return rows[0] if rows else {}

    def commit_lag(self, stream: str, *, window_seconds: int = 3600) -> dict | None:
        """The commit -> lake lag of the transactions consolidated in the last ``window_seconds``: how
        long after its commit in the source each one was in the lake (the frontier passed it), as
        `lag_summary` gives it (how it is estimated: docs/internals/storage.md); None when no
        transaction was consolidated in the window."""
        # the window's segments may already be archived (`archive_segments`): read from both
        rows = self._all("""WITH moves AS (SELECT at, frontier_before, frontier_after FROM tidemark.frontier_moves
                                            WHERE stream = %s AND at > clock_timestamp() - make_interval(secs => %s)),
                                 segs AS (SELECT upper_lsn, min_commit_ts, max_commit_ts, txn_count, status
                                            FROM tidemark.segments WHERE stream = %s
                                          UNION ALL
                                          SELECT upper_lsn, min_commit_ts, max_commit_ts, txn_count, status
                                            FROM tidemark.segments_archive
                                           WHERE stream = %s AND upper_lsn > (SELECT min(COALESCE(frontier_before, -1))
                                                                               FROM moves))
                            SELECT extract(epoch FROM m.at) * 1e6, s.min_commit_ts, s.max_commit_ts, s.txn_count
                              FROM moves m
                              JOIN segs s ON s.upper_lsn > COALESCE(m.frontier_before, -1)
                                         AND s.upper_lsn <= m.frontier_after
                             WHERE s.status = 'landed' AND s.txn_count > 0 AND s.min_commit_ts IS NOT NULL""",
                         (stream, window_seconds, stream, stream))
        return lag_summary(rows, window_seconds)

    def record_metrics_sample(self, stream: str, *, frontier: int | None, landed_upper: int | None,
                              source_lsn: int | None, confirmed_lsn: int | None, slot_lag_bytes: int | None,
                              current_segment: int | None, committed_segment: int | None,
                              keep_seconds: int = 7 * 86400, keep_rows: int = 20000) -> dict:
        """Append one metrics sample and prune the stream's history (older than ``keep_seconds``, beyond
        ``keep_rows``); return the sample. Its ``slot_lag_seconds``: how long ago the source was first
        seen (in this history) at or past the slot's confirmed position; 0 when the slot is confirmed up
        to the source's position, None when no earlier sample shows it."""
        with self.tx() as cur:
            cur.execute("""SELECT clock_timestamp(), COALESCE(sum(record_count), 0) FROM (
                               SELECT record_count FROM tidemark.segments WHERE stream = %s AND status = 'landed'
                               UNION ALL         -- archived rows still count: the rate is of a running total
                               SELECT record_count FROM tidemark.segments_archive
                                WHERE stream = %s AND status = 'landed') s""", (stream, stream))
            at, landed_changes = cur.fetchone()
            lag_seconds = None
            if confirmed_lsn is not None and source_lsn is not None:
                if confirmed_lsn >= source_lsn:
                    lag_seconds = 0.0
                else:
                    cur.execute("""SELECT extract(epoch FROM %s - min(at))::float8
                                     FROM tidemark.metrics_history WHERE stream = %s AND source_lsn >= %s""",
                                (at, stream, confirmed_lsn))
                    lag_seconds = cur.fetchone()[0]
            sample = {"at": at, "frontier": frontier, "landed_upper": landed_upper, "source_lsn": source_lsn,
                      "confirmed_lsn": confirmed_lsn, "slot_lag_bytes": slot_lag_bytes, "slot_lag_seconds": lag_seconds,
                      "landed_changes": landed_changes, "current_segment": current_segment,
                      "committed_segment": committed_segment}
            cur.execute(insert("metrics_history", ("stream", *sample)), (stream, *sample.values()))
            cur.execute("""DELETE FROM tidemark.metrics_history
                            WHERE stream = %s AND (at < clock_timestamp() - make_interval(secs => %s)
                                  OR at < (SELECT at FROM tidemark.metrics_history WHERE stream = %s
                                            ORDER BY at DESC OFFSET %s LIMIT 1))""",
                        (stream, keep_seconds, stream, keep_rows - 1))
        return sample

    def metrics_history(self, stream: str, *, since_seconds: int = 6 * 3600, limit: int = 2000) -> list[dict]:
        """The stream's metrics samples of the last ``since_seconds`` (newest ``limit``), oldest first, each
        with ``changes_per_second``: change records landed since the previous sample per second."""
        rows = self._dicts("""SELECT at, frontier, landed_upper, source_lsn, confirmed_lsn, slot_lag_bytes,
                                  slot_lag_seconds, landed_changes, current_segment, committed_segment,
                                  changes_per_second
                             FROM (SELECT h.*,
                                          (landed_changes - lag(landed_changes) OVER w)::float8
                                          / NULLIF(extract(epoch FROM at - lag(at) OVER w), 0)::float8
                                              AS changes_per_second
                                     FROM tidemark.metrics_history h WHERE stream = %s
                                   WINDOW w AS (ORDER BY at)) s
                            WHERE at >= clock_timestamp() - make_interval(secs => %s)
                            ORDER BY at DESC LIMIT %s""", (stream, since_seconds, limit))
        rows.reverse()
        return rows

    # -- write costs, storage, maintenance runs ----------------------------------------------------------
    WRITE_COST_COLUMNS = ("table_name", "frontier", "frontier_before", "version_from", "version_to", "added_files",
                          "added_bytes", "removed_files", "removed_bytes", "change_records", "change_bytes",
                          "changelog_bytes", "live_bytes", "snapshot_load")

    def record_write_costs(self, stream: str, rows: list[dict], *, keep_days: int = 30) -> int:
        """Record a batch's write cost, one row per table (`tidemark.consolidate.writecost`); a row of a
        (table, frontier) already recorded is left as it is (a retried frontier counts once). Return
        how many rows were new; the stream's rows older than ``keep_days`` are pruned."""
        cols = self.WRITE_COST_COLUMNS
        new = 0
        with self.tx() as cur:
            for row in rows:
                cur.execute(insert("write_costs", ("stream", *cols), "ON CONFLICT (stream, table_name, frontier) "
                                   "DO NOTHING"), (stream, *(row.get(c) for c in cols)))
                new += cur.rowcount
            cur.execute("""DELETE FROM tidemark.write_costs
                            WHERE stream = %s AND at < clock_timestamp() - make_interval(days => %s)""",
                        (stream, keep_days))
        return new

    def write_cost_versions(self, stream: str) -> dict[str, tuple[int, int]]:
        """{table: (the frontier, the last Delta version) of its newest recorded batch}."""
        rows = self._all("""SELECT DISTINCT ON (table_name) table_name, frontier, version_to FROM tidemark.write_costs
                             WHERE stream = %s ORDER BY table_name, frontier DESC""", (stream,))
        return {t: (f, v) for t, f, v in rows}

    def write_costs(self, stream: str, *, batches: int = 60) -> dict[str, list[dict]]:
        """{table: its newest ``batches`` recorded batches, oldest first}, each row with ``at`` and the
        `WRITE_COST_COLUMNS`."""
        cols = ("at",) + self.WRITE_COST_COLUMNS
        # each table's newest rows through the primary key's index (a month of minutely batches is
        # tens of thousands of rows a table: the status page reads only these)
        rows = self._dicts(sql.SQL("""SELECT {} FROM (SELECT DISTINCT table_name FROM tidemark.write_costs
                                                       WHERE stream = %s) t,
                                      LATERAL (SELECT * FROM tidemark.write_costs w
                                                WHERE w.stream = %s AND w.table_name = t.table_name
                                                ORDER BY w.frontier DESC LIMIT %s) w
                                       ORDER BY w.table_name, w.frontier""").format(
            sql.SQL(", ").join(sql.SQL("w.{}").format(sql.Identifier(c)) for c in cols)),
            (stream, stream, batches), cols)
        return {table: list(group) for table, group in itertools.groupby(rows, lambda r: r["table_name"])}

    def record_maintenance_run(self, stream: str, started_at, report: dict, *, keep: int = 100) -> None:
        """Record what a maintenance run did (`tidemark.maintain.MaintainReport.as_dict`); the stream's
        newest ``keep`` runs are kept."""
        with self.tx() as cur:
            cur.execute("""INSERT INTO tidemark.maintenance_runs (stream, started_at, report) VALUES (%s, %s, %s)""",
                        (stream, started_at, json.dumps(report, default=str)))
            cur.execute("""DELETE FROM tidemark.maintenance_runs WHERE stream = %s AND finished_at <
                               (SELECT finished_at FROM tidemark.maintenance_runs WHERE stream = %s
                                 ORDER BY finished_at DESC OFFSET %s LIMIT 1)""", (stream, stream, keep - 1))

    def last_maintenance_run(self, stream: str) -> dict | None:
        """The stream's newest maintenance run: ``{started_at, finished_at, report}``, or None."""
        row = self._one("""SELECT started_at, finished_at, report FROM tidemark.maintenance_runs WHERE stream = %s
                            ORDER BY finished_at DESC LIMIT 1""", (stream,))
        return None if row is None else {"started_at": row[0], "finished_at": row[1], "report": from_json(row[2])}

    def record_storage(self, stream: str, figures: dict) -> None:
        """Keep the stream's storage figures as last computed (`tidemark.lake.storage.stream_storage`)."""
        self._run("""INSERT INTO tidemark.storage_figures (stream, figures) VALUES (%s, %s)
                     ON CONFLICT (stream) DO UPDATE SET figures = EXCLUDED.figures, at = clock_timestamp()""",
                  (stream, json.dumps(figures, default=str)))

    def storage(self, stream: str) -> dict | None:
        """The stream's storage figures as last recorded, with when (``at``); None if never."""
        row = self._one("SELECT at, figures FROM tidemark.storage_figures WHERE stream = %s", (stream,))
        return None if row is None else {**from_json(row[1]), "at": row[0]}
