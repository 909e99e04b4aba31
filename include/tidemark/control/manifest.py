"""The landing manifest: registering a landed segment (moving the landed upper), reading them, marking
them verified, quarantined or re-written, archiving the rows below the retention floor and recording the
landing files the retention deleted; and an external feed's (source kind: feed) files as registered,
each feed table's own positions (landed upper, frontier) and the times a feed forgot."""

from __future__ import annotations

import json
from dataclasses import astuple, dataclass

from psycopg2 import sql

from tidemark.control.connection import Connection, insert
from tidemark.errors import TidemarkError
from tidemark.lsn import format_lsn


@dataclass(frozen=True)
class Segment:
    stream: str
    seq: int
    lower: int
    upper: int
    uri: str
    record_count: int
    txn_count: int
    byte_size: int
    checksum: str
    status: str = "landed"
    origin: str = "drain"
    min_commit_ts: int | None = None     # commit-time bounds of its transactions (µs, UTC); None: unknown
    max_commit_ts: int | None = None
    verified: bool = False               # its file was decoded and found to be exactly this segment


# the columns of the fields of `Segment` but the last (``verified``), in order
_SEGMENT_FIELDS = ("stream", "seq", "lower_lsn", "upper_lsn", "uri", "record_count", "txn_count", "byte_size",
                   "checksum", "status", "origin", "min_commit_ts", "max_commit_ts")
_SEGMENT_COLUMNS = sql.SQL(", ").join([*map(sql.Identifier, _SEGMENT_FIELDS), sql.SQL("verified_at IS NOT NULL")])
_MANIFEST = ("segments", "segments_archive")       # the manifest and the rows archived below the floor
_BY_SEQ = sql.SQL("stream = %s AND seq = %s")
# what moves to the archive, every column
_ARCHIVED = sql.SQL(", ").join(map(sql.Identifier, _SEGMENT_FIELDS + ("created_at", "verified_at")))


def _select_segments(where: sql.Composable, tables: tuple[str, ...] = _MANIFEST) -> sql.Composed:
    """SELECT the `Segment` rows of ``tables`` that match ``where`` (its parameters once a table) in seq order."""
    return sql.SQL("{} ORDER BY seq").format(sql.SQL(" UNION ALL ").join(sql.SQL("SELECT {} FROM {} WHERE {}").format(
        _SEGMENT_COLUMNS, sql.Identifier("tidemark", t), where) for t in tables))


def move_table_positions(cur, stream: str, table: str, landed_upper: int | None, frontier: int | None) -> None:
    """Move a feed table's landed upper and/or frontier forward, never backward (in the caller's transaction)."""
    cur.execute("""INSERT INTO tidemark.table_frontiers (stream, table_name, landed_upper, frontier)
                       VALUES (%s, %s, %s, %s)
                       ON CONFLICT (stream, table_name) DO UPDATE
                       SET landed_upper = GREATEST(tidemark.table_frontiers.landed_upper, EXCLUDED.landed_upper),
                           frontier = GREATEST(tidemark.table_frontiers.frontier, EXCLUDED.frontier),
                           updated_at = now()""", (stream, table, landed_upper, frontier))


class ManifestMixin(Connection):
    """The landing manifest (segments, feed files) of `Control`."""

    def _segment_rows(self, where: sql.Composable, params: list, tables: tuple[str, ...] = _MANIFEST) -> list[Segment]:
        """The segments of ``tables`` that match ``where`` (its ``params`` once a table), in sequence order."""
        return [Segment(*r) for r in self._all(_select_segments(where, tables), list(params) * len(tables))]

    def register_segment(self, seg: Segment, *, table_uppers: dict[str, int] | None = None) -> bool:
        """Add a segment to the manifest and move ``landed_upper``/``next_seq``; ``table_uppers``
        (an external feed's tables this segment lands) moves their landed uppers in the same transaction.
        Returns False if exactly this segment is already registered (idempotent retry); raises if the
        stream is not registered or the sequence number is taken by a different segment."""
        with self.tx() as cur:
            cur.execute("SELECT landed_upper, next_seq FROM tidemark.streams WHERE name = %s FOR UPDATE", (seg.stream,))
            row = cur.fetchone()
            if row is None:
                raise TidemarkError(f"stream {seg.stream!r} is not registered")
            landed_upper, next_seq = row
            cur.execute(_select_segments(_BY_SEQ), (seg.stream, seg.seq) * len(_MANIFEST))
            row = cur.fetchone()
            if row is not None:
                old = Segment(*row)
                if (old.lower, old.upper, old.record_count) == (seg.lower, seg.upper, seg.record_count):
                    return False
                raise TidemarkError(f"stream {seg.stream}: segment {seg.seq} is already registered as "
                                    f"[{format_lsn(old.lower)}, {format_lsn(old.upper)}) with {old.record_count} "
                                    f"records; refusing [{format_lsn(seg.lower)}, {format_lsn(seg.upper)}) with "
                                    f"{seg.record_count}")
            cur.execute(insert("segments", _SEGMENT_FIELDS), astuple(seg)[:len(_SEGMENT_FIELDS)])
            if seg.seq >= next_seq:
                cur.execute("""UPDATE tidemark.streams SET next_seq = %s, landed_upper = GREATEST(COALESCE(landed_upper, 0), %s),
                                      updated_at = now() WHERE name = %s""", (seg.seq + 1, seg.upper, seg.stream))
                cur.execute("""UPDATE tidemark.metrics SET current_segment = %s, last_segment_at = now(),
                                      updated_at = now() WHERE stream = %s""", (seg.seq, seg.stream))
            for table, upper in sorted((table_uppers or {}).items()):
                move_table_positions(cur, seg.stream, table, upper, None)
        return True

    def segments(self, stream: str, *, status: str | None = "landed", from_seq: int = 0,
                 lower_from: int | None = None, upper_to: int | None = None,
                 archived: bool = True) -> list[Segment]:
        """Segments of a stream in sequence order, optionally filtered; with ``archived`` (the default)
        the rows archived below the retention floor too (`archive_segments`)."""
        filters = [("stream = %s", stream), ("seq >= %s", from_seq)] + [(c, v) for c, v in (
            ("status = %s", status), ("upper_lsn > %s", lower_from), ("lower_lsn < %s", upper_to)) if v is not None]
        return self._segment_rows(sql.SQL(" AND ").join(sql.SQL(c) for c, _ in filters), [v for _, v in filters],
                                  _MANIFEST if archived else _MANIFEST[:1])

    def records_above(self, stream: str, position: int) -> bool:
        """Whether a landed segment reaching above ``position`` holds records: work for a Spark batch
        (progress alone moves the frontier without one). One indexed query, no rows read back."""
        return bool(self._one("""SELECT EXISTS (SELECT 1 FROM tidemark.segments WHERE stream = %s AND status = 'landed'
                                    AND upper_lsn > %s AND record_count > 0)""", (stream, position))[0])

    def segment(self, stream: str, seq: int) -> Segment | None:
        """One segment by its sequence number (archived or not), or None."""
        return next(iter(self._segment_rows(_BY_SEQ, [stream, seq])), None)

    def mark_verified(self, stream: str, checked: list[tuple[int, str]]) -> int:
        """Mark segments verified: ``(seq, checksum)`` each, only while the manifest still has that
        checksum (a file replaced meanwhile stays unverified); return how many were marked."""
        if not checked:
            return 0
        return self._run("""UPDATE tidemark.segments s SET verified_at = now()
                              FROM unnest(%s::bigint[], %s::text[]) AS v(seq, checksum)
                             WHERE s.stream = %s AND s.seq = v.seq AND s.checksum = v.checksum
                               AND s.verified_at IS NULL""",
                         ([c[0] for c in checked], [c[1] for c in checked], stream))

    def archive_segments(self, stream: str, *, floor: int | None = None) -> int:
        """Move the manifest rows below the retention floor to ``tidemark.segments_archive``; return how
        many moved.

        The floor is the frontier, or the lowest subscriber checkpoint when lower, or ``floor`` when
        lower still. Only a prefix of sequence numbers moves: every row before the first one that ends
        above the floor or is quarantined, and never the newest row below the floor (the status page's
        committed segment). The stream's ``archived_seq``/``archived_upper`` say where the manifest
        resumes, so gap detection tiles from there."""
        with self.tx() as cur:
            cur.execute("""SELECT frontier, next_seq FROM tidemark.streams WHERE name = %s FOR UPDATE""", (stream,))
            row = cur.fetchone()
            if row is None or row[0] is None:
                return 0
            frontier, next_seq = row
            cur.execute("""SELECT min(checkpoint) FROM tidemark.subscribers WHERE stream = %s AND name <> 'consolidate'""",
                        (stream,))
            bound = min(p for p in (frontier, cur.fetchone()[0], floor) if p is not None)
            cur.execute("""SELECT min(seq) FILTER (WHERE upper_lsn > %s OR status = 'quarantined'),
                                  max(seq) FILTER (WHERE upper_lsn <= %s)
                             FROM tidemark.segments WHERE stream = %s""", (bound, bound, stream))
            first_kept, newest_below = cur.fetchone()
            keep = min(s for s in (first_kept, newest_below, next_seq) if s is not None)
            cur.execute(sql.SQL("""WITH moved AS (DELETE FROM tidemark.segments WHERE stream = %s AND seq < %s
                                                  RETURNING {0})
                                   INSERT INTO tidemark.segments_archive ({0}) SELECT * FROM moved
                                   RETURNING seq, CASE WHEN status = 'forgotten' THEN NULL ELSE upper_lsn END""").format(
                _ARCHIVED), (stream, keep))
            moved = cur.fetchall()
            if moved:
                upper = max((u for _, u in moved if u is not None), default=None)
                cur.execute("""UPDATE tidemark.streams SET archived_seq = GREATEST(COALESCE(archived_seq, 0), %s),
                                      archived_upper = GREATEST(archived_upper, %s), updated_at = now()
                                WHERE name = %s""", (keep, upper, stream))
        return len(moved)

    def deletable_segments(self, stream: str, floor: int) -> list[Segment]:
        """Archived segments wholly below ``floor`` whose file is still there (`tidemark.maintain`)."""
        return self._segment_rows(sql.SQL("stream = %s AND upper_lsn <= %s AND file_deleted_at IS NULL"),
                                  [stream, floor], _MANIFEST[1:])

    def mark_segment_files_deleted(self, stream: str, seqs: list[int]) -> None:
        """Record in the archive that these segments' files were deleted (landing retention)."""
        self._run("""UPDATE tidemark.segments_archive SET file_deleted_at = now()
                      WHERE stream = %s AND seq = ANY(%s) AND file_deleted_at IS NULL""", (stream, list(seqs)))

    def record_feed_files_deleted(self, stream: str, files: list[tuple[str, int, int | None]]) -> None:
        """Record changelog feed files deleted by the landing retention: ``(key, upper, byte_size)``."""
        with self.tx() as cur:
            cur.executemany("""INSERT INTO tidemark.deleted_feed_files (stream, key, upper_lsn, byte_size)
                               VALUES (%s, %s, %s, %s) ON CONFLICT (stream, key) DO NOTHING""",
                            [(stream, key, upper, size) for key, upper, size in files])

    def held_segment_bytes(self, stream: str, above: int, upto: int) -> int:
        """Bytes of the segment files kept with ``above < upper <= upto`` (what a lagging subscriber
        at checkpoint ``above`` holds back below the frontier ``upto``)."""
        return int(self._one("""SELECT COALESCE(sum(byte_size), 0) FROM (
                                    SELECT byte_size FROM tidemark.segments
                                     WHERE stream = %s AND upper_lsn > %s AND upper_lsn <= %s
                                    UNION ALL
                                    SELECT byte_size FROM tidemark.segments_archive
                                     WHERE stream = %s AND upper_lsn > %s AND upper_lsn <= %s
                                       AND file_deleted_at IS NULL) s""",
                             (stream, above, upto, stream, above, upto))[0])

    def set_segment_commit_bounds(self, stream: str, seq: int, min_commit_ts: int | None,
                                  max_commit_ts: int | None) -> None:
        """Record the commit-time bounds of a registered segment (read from its file)."""
        self._run("""UPDATE tidemark.segments SET min_commit_ts = %s, max_commit_ts = %s
                      WHERE stream = %s AND seq = %s""", (min_commit_ts, max_commit_ts, stream, seq))

    def set_segment_file(self, stream: str, seq: int, checksum: str, byte_size: int) -> None:
        """Record a segment's file as re-written with other bytes for the same records (a re-drain of a
        segment written with an earlier framing)."""
        self._run("""UPDATE tidemark.segments SET checksum = %s, byte_size = %s, verified_at = NULL
                      WHERE stream = %s AND seq = %s""", (checksum, byte_size, stream, seq))

    def set_segment_status(self, stream: str, seqs: list[int], status: str) -> None:
        self._run("""UPDATE tidemark.segments SET status = %s, verified_at = NULL
                      WHERE stream = %s AND seq = ANY(%s) AND status IS DISTINCT FROM %s""",
                  (status, stream, list(seqs), status))

    def first_landed_at(self, stream: str, time: int):
        """When the first landed segment that covers ``time`` was registered (None if none)."""
        row = self._one("""SELECT min(created_at) FROM tidemark.segments
                            WHERE stream = %s AND status = 'landed' AND lower_lsn <= %s AND %s < upper_lsn""",
                        (stream, time, time))
        return row[0] if row else None

    def recent_segments(self, stream: str, *, limit: int = 10) -> list[dict]:
        """The newest ``limit`` segments of a stream (any status), newest first, with when they were registered."""
        return self._dicts("""SELECT seq, lower_lsn, upper_lsn, record_count, txn_count, byte_size, status, origin,
                                     created_at FROM tidemark.segments WHERE stream = %s ORDER BY seq DESC LIMIT %s""",
                           (stream, limit))

    # -- external feeds (source kind: feed) ------------------------------------------------------------
    def register_feed_file(self, stream: str, key: str, table: str, checksum: str, byte_size: int,
                           update_count: int, min_time: int | None, max_time: int | None, progress: list,
                           status: str = "registered", detail: str | None = None) -> bool:
        """Record a producer's file once (same key and checksum: nothing to do); False if known.
        A key seen before with other bytes is an error: a feed file is immutable."""
        with self.tx() as cur:
            cur.execute("SELECT checksum FROM tidemark.feed_files WHERE stream = %s AND key = %s", (stream, key))
            row = cur.fetchone()
            if row is not None:
                if row[0] != checksum:
                    raise TidemarkError(f"stream {stream}: feed file {key} changed after it was registered "
                                        f"(checksum {row[0]}, now {checksum}); feed files are immutable")
                return False
            cur.execute(insert("feed_files", ("stream", "key", "table_name", "checksum", "byte_size", "update_count",
                                              "min_time", "max_time", "progress", "status", "detail")),
                        (stream, key, table, checksum, byte_size, update_count, min_time, max_time,
                         json.dumps(progress), status, detail))
            return True

    def feed_files(self, stream: str, *, status: str | None = "registered") -> list[dict]:
        return self._dicts("""SELECT key, table_name AS "table", checksum, byte_size, update_count, min_time, max_time,
                                     progress, status, detail, registered_at FROM tidemark.feed_files
                               WHERE stream = %s AND (%s IS NULL OR status = %s) ORDER BY registered_at, key""",
                           (stream, status, status))

    def set_feed_file_status(self, stream: str, key: str, status: str, detail: str | None = None) -> None:
        self._run("UPDATE tidemark.feed_files SET status = %s, detail = %s WHERE stream = %s AND key = %s",
                  (status, detail, stream, key))

    def table_frontiers(self, stream: str) -> dict[str, dict]:
        """Per-table positions of a feed stream: ``{table: {"landed_upper": l, "frontier": f}}``."""
        rows = self._all("""SELECT table_name, landed_upper, frontier FROM tidemark.table_frontiers
                             WHERE stream = %s ORDER BY table_name""", (stream,))
        return {r[0]: {"landed_upper": r[1], "frontier": r[2]} for r in rows}

    def advance_table_positions(self, stream: str, table: str, *, landed_upper: int | None = None,
                                frontier: int | None = None) -> None:
        """Move a feed table's landed upper and/or frontier forward (never backward)."""
        with self.tx() as cur:
            move_table_positions(cur, stream, table, landed_upper, frontier)

    def forget_feed_time(self, stream: str, table: str, time: int, expected: int, seen: int, reason: str) -> None:
        self._run("""INSERT INTO tidemark.feed_forgotten (stream, table_name, time, expected, seen, reason)
                     VALUES (%s,%s,%s,%s,%s,%s) ON CONFLICT DO NOTHING""",
                  (stream, table, time, expected, seen, reason))

    def feed_forgotten(self, stream: str) -> list[dict]:
        return self._dicts("""SELECT table_name AS "table", time, expected, seen, reason, at
                                FROM tidemark.feed_forgotten WHERE stream = %s ORDER BY time, table_name""", (stream,))
