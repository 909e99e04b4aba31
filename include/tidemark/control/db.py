"""The control database: streams, subscribers, the segment manifest, snapshots, incidents, metrics.

All state lives in the ``tidemark`` schema of a PostgreSQL database. Migrations in
``control/migrations/NNNN_*.sql`` are applied once each, in order, under an advisory lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any, Iterator

import psycopg2
import psycopg2.extras
from psycopg2 import sql

from tidemark.config import StreamConfig
from tidemark.errors import LeaseLost, StreamBusy, TidemarkError
from tidemark.lsn import format_lsn

_MIGRATION_LOCK = 0x7469_6465  # 'tide'
_STREAM_LOCK_CLASS = 0x6D61_726B  # 'mark'


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


class Lease:
    """The stream lock as held by one job: `confirm` before each commit that moves a position."""

    def __init__(self, conn, stream: str, purpose: str):
        self.conn, self.stream, self.purpose = conn, stream, purpose
        self.pid = conn.get_backend_pid()

    def held(self) -> bool:
        """True if the lock's connection is alive and its backend still holds the lock."""
        try:
            with self.conn.cursor() as cur:
                cur.execute("""SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()
                                  AND classid = %s::oid AND objid = hashtext(%s)::oid AND granted""",
                            (_STREAM_LOCK_CLASS, f"{self.stream}/{self.purpose}"))
                return cur.fetchone()[0] > 0
        except psycopg2.Error:
            return False

    def confirm(self, before: str) -> None:
        """Raise `LeaseLost` unless the lock is still held (call right before committing ``before``)."""
        if not self.held():
            raise LeaseLost(f"stream {self.stream}: the {self.purpose} lock (control-database backend pid "
                            f"{self.pid}) was lost; stopped before: {before}. Nothing was committed past it; "
                            "another job may hold the stream now: run this one again later")


# What changes from one occurrence of the same failure to the next: never part of an incident's cause.
VOLATILE_DETAIL_KEYS = frozenset({"at", "when", "now", "opened_at", "last_seen", "last_seen_at", "since",
                                  "started_at", "finished_at", "elapsed", "elapsed_seconds", "duration",
                                  "attempt", "try_number", "seen", "pid"})
# Kinds whose detail carries the run's context (the tables already done, the remedy naming them): their
# cause is these keys only.
CAUSE_KEYS = {"consolidate_failed": ("table", "step", "segment", "position", "reason")}
# kinds whose every number is incidental to the cause (a drain's failure names the segment it wrote, the
# bytes it needed, an LSN: the same failure at the next scheduled drain has other numbers)
NUMBERS_BLANKED = {"drain_failed"}
_NUMBER = re.compile(r"[0-9A-Fa-f]*[0-9][0-9A-Fa-f]*")
_WALL_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2}| ?UTC)?")


def incident_cause(kind: str, detail: dict) -> Any:
    """The part of an incident's detail that names its cause: for the kinds of `CAUSE_KEYS` those keys,
    else every key but the `VOLATILE_DETAIL_KEYS`; inside strings, wall-clock times are blanked and
    what else changes between occurrences (attempt numbers, pids, Spark stage and task ids,
    temporary names, a stack trace below the first meaningful line) is normalized
    (`tidemark.errors.normalize_reason`); for the kinds of `NUMBERS_BLANKED`, every number."""
    keys = CAUSE_KEYS.get(kind)
    kept = _without_times({k: v for k, v in detail.items() if (k in keys if keys else k not in VOLATILE_DETAIL_KEYS)})
    if kind in NUMBERS_BLANKED:
        kept = {k: _NUMBER.sub("#", v) if isinstance(v, str) else v for k, v in kept.items()}
    return kept


def _without_times(value: Any) -> Any:
    if isinstance(value, str):
        from tidemark.errors import normalize_reason

        return normalize_reason(_WALL_TIME.sub("<time>", value))
    if isinstance(value, dict):
        return {k: _without_times(v) for k, v in value.items() if k not in VOLATILE_DETAIL_KEYS}
    if isinstance(value, (list, tuple)):
        return [_without_times(v) for v in value]
    return value


def cause_key(kind: str, table: str | None, cause: Any) -> str:
    """A stable digest of (kind, table, cause)."""
    text = json.dumps([kind, table, cause], sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# -- the stream lease: which jobs may run on one stream at the same time -------------------------------
# Every job that moves a stream's positions (the manifest, landed upper, frontier, slot, files) takes the
# stream's lease with its purpose. Two purposes exclude each other unless listed in COMPATIBLE_PURPOSES;
# a purpose not in LOCK_PURPOSES excludes everything.
CONNECT_TIMEOUT_SECONDS = 10     # control-database connections (a DSN's own connect_timeout wins)
# How long a job waits for a stream's lease held by a job it cannot run beside before it raises
# `StreamBusy`: 0 (the library's and the CLI's default) tries once; the Airflow tasks set it, so that a
# recovery step is not failed by a changelog rebuild or a drain that holds the lease for seconds.
LOCK_WAIT_ENV = "TIDEMARK_LOCK_WAIT_SECONDS"
LOCK_PURPOSES = ("drain", "feed-ingest", "sweep", "snapshot", "snapshot-add", "consolidate", "changelog", "repair",
                 "resend", "maintain")
# Pairs that run side by side: the drain (and a feed's ingest, and the sweep) only append to the manifest
# above the landed upper or register a sound file in a hole, while a consolidation or a changelog rebuild
# reads registered segments that nothing moves meanwhile.
COMPATIBLE_PURPOSES = frozenset(frozenset(pair) for pair in (
    ("drain", "consolidate"), ("drain", "changelog"),
    ("feed-ingest", "consolidate"), ("feed-ingest", "changelog"),
    ("sweep", "consolidate"), ("sweep", "changelog"),
    # a snapshot of tables added to a running stream copies them under a temporary slot of its own and
    # moves no position of the stream: its drains and consolidations go on meanwhile
    ("snapshot-add", "drain"), ("snapshot-add", "consolidate"), ("snapshot-add", "changelog"),
    ("snapshot-add", "sweep"),
    # maintenance (`tidemark.maintain`) rewrites lake files, vacuums and deletes landing files below the
    # frontier: it excludes every job that writes the lake or reads old segments (consolidate, changelog,
    # snapshots, repair, resend), so its compaction commits never race a batch's (the Delta log has no
    # conflict check for a file both remove) and nothing reads a file it deletes. A drain, a feed's
    # ingest and a sweep write only above the landed upper: they run beside it
    ("maintain", "drain"), ("maintain", "feed-ingest"), ("maintain", "sweep"),
))
# A job that runs another one inside it, in the same thread, under its own lease (no second lease).
NESTED_PURPOSES = {"resend": frozenset({"snapshot", "drain", "sweep"}), "repair": frozenset({"drain"}),
                   "snapshot": frozenset({"drain"})}


def lock_compatible(a: str, b: str) -> bool:
    """Whether jobs of purposes ``a`` and ``b`` may hold a stream's lease at the same time."""
    return a != b and frozenset((a, b)) in COMPATIBLE_PURPOSES


def exclusion_matrix() -> dict[tuple[str, str], bool]:
    """``{(a, b): excluded}`` for every pair of `LOCK_PURPOSES` (docs/concepts.md prints it)."""
    return {(a, b): not lock_compatible(a, b) for a in LOCK_PURPOSES for b in LOCK_PURPOSES}


def lock_wait_seconds() -> float:
    """How long `Control.stream_lock` waits for a lease held by an excluding job (`LOCK_WAIT_ENV`; 0: try once)."""
    text = os.environ.get(LOCK_WAIT_ENV, "").strip()
    try:
        wait = float(text) if text else 0.0
    except ValueError:
        raise TidemarkError(f"{LOCK_WAIT_ENV}={text!r} is not a number of seconds") from None
    if wait < 0:
        raise TidemarkError(f"{LOCK_WAIT_ENV}={text!r} is negative")
    return wait


def _take_locks(conn, stream: str, purpose: str, wait: float) -> None:
    """Take the advisory locks of ``purpose``'s lease (`_lock_plan`) on ``conn``, all or none. While an
    excluding job holds one, release what was taken and try again (every 0.5 s, backing off to 5 s)
    until ``wait`` seconds have passed; then raise `StreamBusy` naming the holder and the wait."""
    deadline, pause = time.monotonic() + wait, 0.5
    with conn.cursor() as cur:
        while True:
            for other, mode in _lock_plan(purpose):
                fn = "pg_try_advisory_lock" if mode == "exclusive" else "pg_try_advisory_lock_shared"
                cur.execute(sql.SQL("SELECT {}(%s, hashtext(%s))").format(sql.Identifier(fn)),
                            (_STREAM_LOCK_CLASS, f"{stream}/{other}"))
                if not cur.fetchone()[0]:
                    break
            else:
                return
            message = _busy_message(cur, stream, purpose, other)
            cur.execute("SELECT pg_advisory_unlock_all()")
            left = deadline - time.monotonic()
            if left <= 0:
                raise StreamBusy(message + (f" (waited {wait:g} s for it)" if wait else ""))
            time.sleep(min(pause, left))
            pause = min(pause * 2, 5.0)


def _lock_plan(purpose: str) -> list[tuple[str, str]]:
    """The advisory locks a lease of ``purpose`` takes, in order: its own key exclusive, then a shared
    lock on the key of every purpose it excludes."""
    others = [p for p in LOCK_PURPOSES if p != purpose and not lock_compatible(purpose, p)]
    return [(purpose, "exclusive")] + [(p, "shared") for p in others]


class _HeldLeases(threading.local):
    def __init__(self) -> None:
        self.leases: list[tuple[str, Lease]] = []


_HELD = _HeldLeases()


def _held_lease(dsn: str, stream: str, purpose: str) -> "Lease | None":
    """The lease this thread already holds on ``stream`` that covers ``purpose`` (`NESTED_PURPOSES`)."""
    for held_dsn, lease in reversed(_HELD.leases):
        if held_dsn == dsn and lease.stream == stream and _nests(lease.purpose, purpose):
            return lease
    return None


def _nests(outer: str, inner: str) -> bool:
    seen, todo = set(), [outer]
    while todo:
        p = todo.pop()
        for q in NESTED_PURPOSES.get(p, ()):
            if q == inner:
                return True
            if q not in seen:
                seen.add(q)
                todo.append(q)
    return False


def _busy_message(cur, stream: str, purpose: str, other: str) -> str:
    """Why ``purpose`` cannot start: who holds the key of ``other`` (its purpose from the lock's name)."""
    cur.execute("""SELECT a.pid, a.application_name, a.backend_start, l.mode
                     FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                    WHERE l.locktype = 'advisory' AND l.classid = %s::oid AND l.objid = hashtext(%s)::oid
                      AND l.granted AND a.pid <> pg_backend_pid()
                    ORDER BY l.mode DESC, a.backend_start""",
                (_STREAM_LOCK_CLASS, f"{stream}/{other}"))
    holder = cur.fetchone()
    running = other
    if holder and holder[1].startswith(f"tidemark-lock:{stream}:"):
        running = holder[1][len(f"tidemark-lock:{stream}:"):] or other
    who = f" (held by pid {holder[0]}, {holder[1]}, since {holder[2]:%Y-%m-%d %H:%M:%S})" if holder else ""
    if running == purpose:
        return f"stream {stream}: another {purpose} is already running{who}; wait for it to finish or stop it"
    return (f"stream {stream}: a {running} is running{who} and a {purpose} cannot run beside it; "
            "wait for it to finish or stop it")


def _migrations() -> list[tuple[int, str, str]]:
    out = []
    for entry in resources.files("tidemark.control").joinpath("migrations").iterdir():
        name = entry.name
        if name.endswith(".sql"):
            out.append((int(name.split("_", 1)[0]), name, entry.read_text()))
    return sorted(out)


class Control:
    """A connection to the control database. Each method commits its own transaction."""

    def __init__(self, dsn: str):
        self.dsn = dsn
        # an unreachable control database fails in seconds, not after the OS's TCP timeout
        timeout = {} if "connect_timeout" in dsn else {"connect_timeout": CONNECT_TIMEOUT_SECONDS}
        self.conn = psycopg2.connect(dsn, application_name="tidemark-control", **timeout)
        self.conn.autocommit = False

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "Control":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def tx(self) -> Iterator[psycopg2.extensions.cursor]:
        """A transaction: committed on success, rolled back on error."""
        try:
            with self.conn.cursor() as cur:
                yield cur
            self.conn.commit()
        except BaseException:
            self.conn.rollback()
            raise

    # -- schema ----------------------------------------------------------------------------------
    def migrate(self) -> list[str]:
        """Apply pending migrations; return the names applied (idempotent, safe concurrently)."""
        applied = []
        with self.tx() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            cur.execute("CREATE SCHEMA IF NOT EXISTS tidemark")
            cur.execute("""CREATE TABLE IF NOT EXISTS tidemark.schema_migrations (
                               version integer PRIMARY KEY, name text NOT NULL,
                               applied_at timestamptz NOT NULL DEFAULT now())""")
            cur.execute("SELECT version FROM tidemark.schema_migrations")
            done = {r[0] for r in cur.fetchall()}
            for version, name, text in _migrations():
                if version in done:
                    continue
                cur.execute(text)
                cur.execute("INSERT INTO tidemark.schema_migrations (version, name) VALUES (%s, %s)", (version, name))
                applied.append(name)
        return applied

    # -- streams ---------------------------------------------------------------------------------
    def upsert_stream(self, cfg: StreamConfig) -> StreamState:
        """Register a stream or update its configuration (positions are kept). On a stream that is
        capturing already (it has a consistent point), a table added to the file waits for its own
        snapshot (``awaiting_snapshot``) and a table removed from it is ``frozen`` at the frontier
        (`table_states`)."""
        with self.tx() as cur:
            cur.execute("SELECT config, consistent_lsn, frontier FROM tidemark.streams WHERE name = %s FOR UPDATE",
                        (cfg.stream,))
            before = cur.fetchone()
            cur.execute(
                """INSERT INTO tidemark.streams (name, config, slot_name, publication)
                   VALUES (%s, %s, %s, %s)
                   ON CONFLICT (name) DO UPDATE SET config = EXCLUDED.config, updated_at = now()
                   RETURNING slot_name, publication""",
                (cfg.stream, json.dumps(cfg.as_dict()), cfg.source.slot, cfg.source.publication),
            )
            slot, pub = cur.fetchone()
            if (slot, pub) != (cfg.source.slot, cfg.source.publication):
                raise TidemarkError(f"stream {cfg.stream}: slot/publication cannot change once registered "
                                    f"(registered {slot}/{pub}, config says {cfg.source.slot}/{cfg.source.publication})")
            if before is not None and before[1] is not None and not cfg.source.is_feed:
                stored = json.loads(before[0]) if isinstance(before[0], str) else (before[0] or {})
                # an entry is 'schema.table' or, with a column list or row filter, {name: 'schema.table', ...}
                old = {_qualified(t if isinstance(t, str) else t.get("name")) for t in
                       stored.get("source", {}).get("tables", [])
                       if isinstance(t, str) or (isinstance(t, dict) and isinstance(t.get("name"), str))}
                new = {t.qualified for t in cfg.source.tables}
                for table in sorted(new - old):
                    cur.execute("""INSERT INTO tidemark.stream_tables (stream, table_name, state, since_lsn)
                                   VALUES (%s, %s, 'awaiting_snapshot', NULL)
                                   ON CONFLICT (stream, table_name) DO UPDATE
                                   SET state = 'awaiting_snapshot', since_lsn = NULL, updated_at = now()""",
                                (cfg.stream, table))
                for table in sorted(old - new):
                    cur.execute("""INSERT INTO tidemark.stream_tables (stream, table_name, state, since_lsn)
                                   VALUES (%s, %s, 'frozen', %s)
                                   ON CONFLICT (stream, table_name) DO UPDATE
                                   SET state = 'frozen', since_lsn = EXCLUDED.since_lsn, updated_at = now()""",
                                (cfg.stream, table, before[2]))
            cur.execute("""INSERT INTO tidemark.subscribers (stream, name) VALUES (%s, 'consolidate')
                           ON CONFLICT DO NOTHING""", (cfg.stream,))
            cur.execute("INSERT INTO tidemark.metrics (stream) VALUES (%s) ON CONFLICT DO NOTHING", (cfg.stream,))
        return self.stream(cfg.stream)

    def stream(self, name: str) -> StreamState:
        with self.tx() as cur:
            cur.execute("""SELECT name, config, slot_name, publication, consistent_lsn, landed_upper, frontier,
                                  next_seq, state, archived_seq, archived_upper FROM tidemark.streams WHERE name = %s""", (name,))
            row = cur.fetchone()
        if row is None:
            raise TidemarkError(f"stream {name!r} is not registered; run: tidemark stream apply "
                                f"streams/{name}.yaml (the stream's file)")
        return StreamState(*row)

    def streams(self) -> list[StreamState]:
        with self.tx() as cur:
            cur.execute("""SELECT name, config, slot_name, publication, consistent_lsn, landed_upper, frontier,
                                  next_seq, state, archived_seq, archived_upper FROM tidemark.streams ORDER BY name""")
            return [StreamState(*r) for r in cur.fetchall()]

    def _update(self, table: str, key_column: str, key: str, allowed: set[str], fields: dict[str, Any]) -> None:
        """UPDATE one row of a tidemark table, only the ``allowed`` columns, stamping ``updated_at``."""
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"cannot update {table} columns {sorted(bad)}")
        sets = sql.SQL(", ").join(sql.SQL("{} = %s").format(sql.Identifier(k)) for k in fields)
        with self.tx() as cur:
            cur.execute(sql.SQL("UPDATE {} SET {}, updated_at = now() WHERE {} = %s").format(
                sql.Identifier("tidemark", table), sets, sql.Identifier(key_column)), (*fields.values(), key))

    def update_stream(self, name: str, **fields: Any) -> None:
        self._update("streams", "name", name, {"consistent_lsn", "landed_upper", "frontier", "next_seq", "state"},
                     fields)

    @contextlib.contextmanager
    def stream_lock(self, stream: str, purpose: str) -> Iterator["Lease"]:
        """Hold the stream's lease for ``purpose``; raise `StreamBusy` if a job it excludes is running.

        One lease per stream covers every job that moves its positions (`LOCK_PURPOSES`): two jobs may
        run on a stream at the same time only if `lock_compatible` says so (`COMPATIBLE_PURPOSES`), e.g.
        a drain beside a consolidation; everything else excludes each other, every purpose excludes
        itself. A job that starts another inside it (a resend's snapshot, a repair's re-drain) is
        covered by its own lease when `NESTED_PURPOSES` lists the inner purpose: the inner call gets a
        `Lease` on the outer one's connection.

        How: the holder of ``purpose`` keeps an exclusive session advisory lock on the key of its
        purpose and a shared one on the key of every purpose it excludes. A job of purpose Q needs the
        exclusive lock on Q's key, so it cannot start beside a holder that excludes Q; two holders that
        are compatible share their shared locks. Every lock is tried, never queued for: while a job it
        excludes holds the lease, the attempt is repeated for `lock_wait_seconds` (the Airflow tasks
        wait; the CLI and the library try once), then `StreamBusy` names the holder.

        The locks live on their own connection so that the caller's transactions do not release them.
        It is a lease, not a promise: if that connection drops (the backend terminated, the control
        database restarted) the locks are gone and another job may start. So the yielded `Lease` must
        be confirmed (`Lease.confirm`) before every commit that moves a position; it raises
        `LeaseLost` when the lock is no longer ours.
        """
        outer = _held_lease(self.dsn, stream, purpose)
        if outer is not None:
            yield outer
            return
        timeout = {} if "connect_timeout" in self.dsn else {"connect_timeout": CONNECT_TIMEOUT_SECONDS}
        conn = psycopg2.connect(self.dsn, application_name=f"tidemark-lock:{stream}:{purpose}"[:63], **timeout)
        conn.autocommit = True
        try:
            _take_locks(conn, stream, purpose, lock_wait_seconds())
            lease = Lease(conn, stream, purpose)
            _HELD.leases.append((self.dsn, lease))
            try:
                yield lease
            finally:
                _HELD.leases.remove((self.dsn, lease))
        finally:
            # release explicitly (a closed connection's backend may hold the locks a moment longer);
            # on a failed attempt the locks taken so far are released the same way
            with contextlib.suppress(psycopg2.Error), conn.cursor() as cur:
                cur.execute("SELECT pg_advisory_unlock_all()")
            with contextlib.suppress(psycopg2.Error):
                conn.close()

    # -- segments --------------------------------------------------------------------------------
    def register_segment(self, seg: Segment, *, table_uppers: dict[str, int] | None = None) -> bool:
        """Add a segment to the manifest and move ``landed_upper``/``next_seq``; ``table_uppers``
        (an external feed's tables this segment lands) moves their landed uppers in the same transaction.

        Returns False if exactly this segment is already registered (idempotent retry); raises if the
        sequence number is taken by a different segment or the segment does not start at the
        stream's landed upper.
        """
        with self.tx() as cur:
            cur.execute("SELECT landed_upper, next_seq FROM tidemark.streams WHERE name = %s FOR UPDATE", (seg.stream,))
            row = cur.fetchone()
            if row is None:
                raise TidemarkError(f"stream {seg.stream!r} is not registered")
            landed_upper, next_seq = row
            cur.execute("""SELECT lower_lsn, upper_lsn, checksum, record_count FROM tidemark.segments
                            WHERE stream = %s AND seq = %s
                           UNION ALL
                           SELECT lower_lsn, upper_lsn, checksum, record_count FROM tidemark.segments_archive
                            WHERE stream = %s AND seq = %s""", (seg.stream, seg.seq, seg.stream, seg.seq))
            existing = cur.fetchone()
            if existing is not None:
                if (existing[0], existing[1], existing[3]) == (seg.lower, seg.upper, seg.record_count):
                    return False
                raise TidemarkError(f"stream {seg.stream}: segment {seg.seq} is already registered as "
                                    f"[{format_lsn(existing[0])}, {format_lsn(existing[1])}) with {existing[3]} "
                                    f"records; refusing [{format_lsn(seg.lower)}, {format_lsn(seg.upper)}) with "
                                    f"{seg.record_count}")
            cur.execute("""INSERT INTO tidemark.segments (stream, seq, lower_lsn, upper_lsn, uri, record_count,
                               txn_count, byte_size, checksum, status, origin, min_commit_ts, max_commit_ts)
                           VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)""",
                        (seg.stream, seg.seq, seg.lower, seg.upper, seg.uri, seg.record_count, seg.txn_count,
                         seg.byte_size, seg.checksum, seg.status, seg.origin, seg.min_commit_ts, seg.max_commit_ts))
            if seg.seq >= next_seq:
                cur.execute("""UPDATE tidemark.streams SET next_seq = %s, landed_upper = GREATEST(COALESCE(landed_upper, 0), %s),
                                      updated_at = now() WHERE name = %s""", (seg.seq + 1, seg.upper, seg.stream))
                cur.execute("""UPDATE tidemark.metrics SET current_segment = %s, last_segment_at = now(),
                                      updated_at = now() WHERE stream = %s""", (seg.seq, seg.stream))
            for table, upper in sorted((table_uppers or {}).items()):
                self._advance_table_positions(cur, seg.stream, table, upper, None)
        return True

    def segments(self, stream: str, *, status: str | None = "landed", from_seq: int = 0,
                 lower_from: int | None = None, upper_to: int | None = None,
                 archived: bool = True) -> list[Segment]:
        """Segments of a stream in sequence order, optionally filtered; with ``archived`` (the default)
        the rows archived below the retention floor too (`archive_segments`)."""
        clauses = [sql.SQL("stream = %s"), sql.SQL("seq >= %s")]
        params: list[Any] = [stream, from_seq]
        if status is not None:
            clauses.append(sql.SQL("status = %s"))
            params.append(status)
        if lower_from is not None:
            clauses.append(sql.SQL("upper_lsn > %s"))
            params.append(lower_from)
        if upper_to is not None:
            clauses.append(sql.SQL("lower_lsn < %s"))
            params.append(upper_to)
        cols = sql.SQL("""stream, seq, lower_lsn, upper_lsn, uri, record_count, txn_count, byte_size, checksum,
                          status, origin, min_commit_ts, max_commit_ts, verified_at IS NOT NULL""")
        where = sql.SQL(" AND ").join(clauses)
        q = sql.SQL("SELECT {} FROM tidemark.segments WHERE {}").format(cols, where)
        if archived:
            q = sql.SQL("{} UNION ALL SELECT {} FROM tidemark.segments_archive WHERE {}").format(q, cols, where)
            params = params * 2
        with self.tx() as cur:
            cur.execute(sql.SQL("{} ORDER BY seq").format(q), params)
            return [Segment(*r) for r in cur.fetchall()]

    def segment(self, stream: str, seq: int) -> Segment | None:
        """One segment by its sequence number (archived or not), or None."""
        with self.tx() as cur:
            cur.execute("""SELECT stream, seq, lower_lsn, upper_lsn, uri, record_count, txn_count, byte_size, checksum,
                                  status, origin, min_commit_ts, max_commit_ts, verified_at IS NOT NULL
                             FROM tidemark.segments WHERE stream = %s AND seq = %s
                           UNION ALL
                           SELECT stream, seq, lower_lsn, upper_lsn, uri, record_count, txn_count, byte_size, checksum,
                                  status, origin, min_commit_ts, max_commit_ts, verified_at IS NOT NULL
                             FROM tidemark.segments_archive WHERE stream = %s AND seq = %s""",
                        (stream, seq, stream, seq))
            row = cur.fetchone()
        return Segment(*row) if row else None

    def mark_verified(self, stream: str, checked: list[tuple[int, str]]) -> int:
        """Mark segments verified: ``(seq, checksum)`` each, only while the manifest still has that
        checksum (a file replaced meanwhile stays unverified); return how many were marked."""
        if not checked:
            return 0
        with self.tx() as cur:
            cur.execute("""UPDATE tidemark.segments s SET verified_at = now()
                             FROM unnest(%s::bigint[], %s::text[]) AS v(seq, checksum)
                            WHERE s.stream = %s AND s.seq = v.seq AND s.checksum = v.checksum
                              AND s.verified_at IS NULL""",
                        ([c[0] for c in checked], [c[1] for c in checked], stream))
            return cur.rowcount

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
            cur.execute("""WITH moved AS (
                               DELETE FROM tidemark.segments WHERE stream = %s AND seq < %s
                               RETURNING stream, seq, lower_lsn, upper_lsn, uri, record_count, txn_count, byte_size,
                                         checksum, status, origin, created_at, min_commit_ts, max_commit_ts,
                                         verified_at)
                           INSERT INTO tidemark.segments_archive (stream, seq, lower_lsn, upper_lsn, uri,
                                  record_count, txn_count, byte_size, checksum, status, origin, created_at,
                                  min_commit_ts, max_commit_ts, verified_at)
                           SELECT * FROM moved
                           RETURNING seq, CASE WHEN status = 'forgotten' THEN NULL ELSE upper_lsn END""",
                        (stream, keep))
            moved = cur.fetchall()
            if moved:
                upper = max((u for _, u in moved if u is not None), default=None)
                cur.execute("""UPDATE tidemark.streams SET archived_seq = GREATEST(COALESCE(archived_seq, 0), %s),
                                      archived_upper = GREATEST(archived_upper, %s), updated_at = now()
                                WHERE name = %s""", (keep, upper, stream))
        return len(moved)

    def deletable_segments(self, stream: str, floor: int) -> list[Segment]:
        """Archived segments wholly below ``floor`` whose file is still there (`tidemark.maintain`)."""
        with self.tx() as cur:
            cur.execute("""SELECT stream, seq, lower_lsn, upper_lsn, uri, record_count, txn_count, byte_size, checksum,
                                  status, origin, min_commit_ts, max_commit_ts, verified_at IS NOT NULL
                             FROM tidemark.segments_archive
                            WHERE stream = %s AND upper_lsn <= %s AND file_deleted_at IS NULL ORDER BY seq""",
                        (stream, floor))
            return [Segment(*r) for r in cur.fetchall()]

    def mark_segment_files_deleted(self, stream: str, seqs: list[int]) -> None:
        """Record in the archive that these segments' files were deleted (landing retention)."""
        with self.tx() as cur:
            cur.execute("""UPDATE tidemark.segments_archive SET file_deleted_at = now()
                            WHERE stream = %s AND seq = ANY(%s) AND file_deleted_at IS NULL""", (stream, list(seqs)))

    def record_feed_files_deleted(self, stream: str, files: list[tuple[str, int, int | None]]) -> None:
        """Record changelog feed files deleted by the landing retention: ``(key, upper, byte_size)``."""
        with self.tx() as cur:
            for key, upper, size in files:
                cur.execute("""INSERT INTO tidemark.deleted_feed_files (stream, key, upper_lsn, byte_size)
                               VALUES (%s, %s, %s, %s) ON CONFLICT (stream, key) DO NOTHING""",
                            (stream, key, upper, size))

    def held_segment_bytes(self, stream: str, above: int, upto: int) -> int:
        """Bytes of the segment files kept with ``above < upper <= upto`` (what a lagging subscriber
        at checkpoint ``above`` holds back below the frontier ``upto``)."""
        with self.tx() as cur:
            cur.execute("""SELECT COALESCE(sum(byte_size), 0) FROM (
                               SELECT byte_size FROM tidemark.segments
                                WHERE stream = %s AND upper_lsn > %s AND upper_lsn <= %s
                               UNION ALL
                               SELECT byte_size FROM tidemark.segments_archive
                                WHERE stream = %s AND upper_lsn > %s AND upper_lsn <= %s
                                  AND file_deleted_at IS NULL) s""",
                        (stream, above, upto, stream, above, upto))
            return int(cur.fetchone()[0])

    # -- write cost, storage, maintenance runs (the status page) ---------------------------------------
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
                cur.execute(sql.SQL("INSERT INTO tidemark.write_costs (stream, {}) VALUES (%s, {}) "
                                    "ON CONFLICT (stream, table_name, frontier) DO NOTHING").format(
                    sql.SQL(", ").join(map(sql.Identifier, cols)), sql.SQL(", ").join(sql.Placeholder() * len(cols))),
                    (stream, *(row.get(c) for c in cols)))
                new += cur.rowcount
            cur.execute("""DELETE FROM tidemark.write_costs
                            WHERE stream = %s AND at < clock_timestamp() - make_interval(days => %s)""",
                        (stream, keep_days))
        return new

    def write_cost_versions(self, stream: str) -> dict[str, tuple[int, int]]:
        """{table: (the frontier, the last Delta version) of its newest recorded batch}."""
        with self.tx() as cur:
            cur.execute("""SELECT DISTINCT ON (table_name) table_name, frontier, version_to FROM tidemark.write_costs
                            WHERE stream = %s ORDER BY table_name, frontier DESC""", (stream,))
            return {t: (f, v) for t, f, v in cur.fetchall()}

    def write_costs(self, stream: str, *, batches: int = 60) -> dict[str, list[dict]]:
        """{table: its newest ``batches`` recorded batches, oldest first}, each row with ``at`` and the
        `WRITE_COST_COLUMNS`."""
        cols = ("at",) + self.WRITE_COST_COLUMNS
        with self.tx() as cur:
            # each table's newest rows through the primary key's index (a month of minutely batches is
            # tens of thousands of rows a table: the status page reads only these)
            cur.execute(sql.SQL("""SELECT {} FROM (SELECT DISTINCT table_name FROM tidemark.write_costs
                                                    WHERE stream = %s) t,
                                   LATERAL (SELECT * FROM tidemark.write_costs w
                                             WHERE w.stream = %s AND w.table_name = t.table_name
                                             ORDER BY w.frontier DESC LIMIT %s) w
                                    ORDER BY w.table_name, w.frontier""").format(
                sql.SQL(", ").join(sql.SQL("w.{}").format(sql.Identifier(c)) for c in cols)),
                (stream, stream, batches))
            out: dict[str, list[dict]] = {}
            for r in cur.fetchall():
                row = dict(zip(cols, r))
                out.setdefault(row["table_name"], []).append(row)
        return out

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
        with self.tx() as cur:
            cur.execute("""SELECT started_at, finished_at, report FROM tidemark.maintenance_runs WHERE stream = %s
                            ORDER BY finished_at DESC LIMIT 1""", (stream,))
            row = cur.fetchone()
        if row is None:
            return None
        report = json.loads(row[2]) if isinstance(row[2], str) else row[2]
        return {"started_at": row[0], "finished_at": row[1], "report": report}

    def record_storage(self, stream: str, figures: dict) -> None:
        """Keep the stream's storage figures as last computed (`tidemark.lake.storage.stream_storage`)."""
        with self.tx() as cur:
            cur.execute("""INSERT INTO tidemark.storage_figures (stream, figures) VALUES (%s, %s)
                           ON CONFLICT (stream) DO UPDATE SET figures = EXCLUDED.figures, at = clock_timestamp()""",
                        (stream, json.dumps(figures, default=str)))

    def storage(self, stream: str) -> dict | None:
        """The stream's storage figures as last recorded, with when (``at``); None if never."""
        with self.tx() as cur:
            cur.execute("SELECT at, figures FROM tidemark.storage_figures WHERE stream = %s", (stream,))
            row = cur.fetchone()
        if row is None:
            return None
        figures = json.loads(row[1]) if isinstance(row[1], str) else row[1]
        return {**figures, "at": row[0]}

    def set_segment_commit_bounds(self, stream: str, seq: int, min_commit_ts: int | None,
                                  max_commit_ts: int | None) -> None:
        """Record the commit-time bounds of a registered segment (read from its file)."""
        with self.tx() as cur:
            cur.execute("""UPDATE tidemark.segments SET min_commit_ts = %s, max_commit_ts = %s
                            WHERE stream = %s AND seq = %s""", (min_commit_ts, max_commit_ts, stream, seq))

    def set_segment_file(self, stream: str, seq: int, checksum: str, byte_size: int) -> None:
        """Record a segment's file as re-written with other bytes for the same records (a re-drain of a
        segment written with an earlier framing)."""
        with self.tx() as cur:
            cur.execute("""UPDATE tidemark.segments SET checksum = %s, byte_size = %s, verified_at = NULL
                            WHERE stream = %s AND seq = %s""",
                        (checksum, byte_size, stream, seq))

    def set_segment_status(self, stream: str, seqs: list[int], status: str) -> None:
        with self.tx() as cur:
            cur.execute("""UPDATE tidemark.segments SET status = %s, verified_at = NULL
                            WHERE stream = %s AND seq = ANY(%s) AND status IS DISTINCT FROM %s""",
                        (status, stream, list(seqs), status))

    # -- frontier and subscribers --------------------------------------------------------------------
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
        with self.tx() as cur:
            cur.execute("SELECT checkpoint FROM tidemark.subscribers WHERE stream = %s AND name = %s", (stream, name))
            row = cur.fetchone()
        return row[0] if row else None

    def set_subscriber_checkpoint(self, stream: str, name: str, checkpoint: int) -> None:
        with self.tx() as cur:
            cur.execute("""INSERT INTO tidemark.subscribers (stream, name, checkpoint) VALUES (%s, %s, %s)
                           ON CONFLICT (stream, name) DO UPDATE SET checkpoint = EXCLUDED.checkpoint, updated_at = now()""",
                        (stream, name, checkpoint))

    # -- incidents and metrics -----------------------------------------------------------------------
    # -- snapshots -----------------------------------------------------------------------------------

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
        with self.tx() as cur:
            cur.execute("""UPDATE tidemark.snapshot_chunks SET status = %s, uri = COALESCE(%s, uri),
                                  row_count = COALESCE(%s, row_count), error = %s, updated_at = now()
                            WHERE stream = %s AND snapshot_id = %s AND table_name = %s AND chunk_no = %s""",
                        (status, uri, rows, error, stream, snapshot_id, table, chunk_no))

    def running_snapshots(self, stream: str) -> list[str]:
        """The stream's snapshots still marked running, oldest first (under a snapshot lease, which
        excludes every other snapshot of the stream, these are the ones whose process died)."""
        with self.tx() as cur:
            cur.execute("""SELECT snapshot_id FROM tidemark.snapshots WHERE stream = %s AND status = 'running'
                            ORDER BY started_at""", (stream,))
            return [r[0] for r in cur.fetchall()]

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
            cur.execute("""UPDATE tidemark.snapshots SET status = 'complete', finished_at = now(), tables = %s
                            WHERE stream = %s AND snapshot_id = %s""", (json.dumps(tables), stream, snapshot_id))
            cur.execute("""UPDATE tidemark.streams SET consistent_lsn = %s, landed_upper = %s, state = 'capturing',
                                  updated_at = now() WHERE name = %s""", (lsn, lsn, stream))
            # every table of the stream is captured from the new consistent point (a frozen one stays)
            cur.execute("""DELETE FROM tidemark.stream_tables WHERE stream = %s AND state <> 'frozen'""", (stream,))

    def snapshot_tables_complete(self, stream: str, snapshot_id: str, lsn: int, tables: dict) -> None:
        """Mark a per-table snapshot (tables added to a running stream) complete and its tables
        ``capturing`` from ``lsn``, in one transaction; the stream's own positions do not move."""
        with self.tx() as cur:
            cur.execute("""UPDATE tidemark.snapshots SET status = 'complete', finished_at = now(), tables = %s
                            WHERE stream = %s AND snapshot_id = %s""", (json.dumps(tables), stream, snapshot_id))
            for table in tables:
                cur.execute("""INSERT INTO tidemark.stream_tables (stream, table_name, state, since_lsn)
                               VALUES (%s, %s, 'capturing', %s)
                               ON CONFLICT (stream, table_name) DO UPDATE
                               SET state = 'capturing', since_lsn = EXCLUDED.since_lsn, updated_at = now()""",
                            (stream, table, lsn))

    def set_table_states(self, stream: str, tables: list[str], state: str, since_lsn: int | None = None) -> None:
        """Put ``tables`` of the stream in ``state`` (`table_states`)."""
        with self.tx() as cur:
            for table in tables:
                cur.execute("""INSERT INTO tidemark.stream_tables (stream, table_name, state, since_lsn)
                               VALUES (%s, %s, %s, %s)
                               ON CONFLICT (stream, table_name) DO UPDATE
                               SET state = EXCLUDED.state, since_lsn = EXCLUDED.since_lsn, updated_at = now()""",
                            (stream, table, state, since_lsn))

    def table_states(self, stream: str) -> dict[str, tuple[str, int | None]]:
        """{table: (state, since_lsn)} of the stream's tables that are not simply captured since its
        consistent point: ``awaiting_snapshot``, ``capturing`` (from their own snapshot) or ``frozen``."""
        with self.tx() as cur:
            cur.execute("""SELECT table_name, state, since_lsn FROM tidemark.stream_tables WHERE stream = %s""",
                        (stream,))
            return {t: (st, lsn) for t, st, lsn in cur.fetchall()}

    def complete_snapshots(self, stream: str) -> list[tuple[str, int, str, dict]]:
        """Snapshots complete but not yet loaded into the lake, oldest first: (id, lsn, mode, tables)."""
        with self.tx() as cur:
            cur.execute("""SELECT snapshot_id, lsn, mode, tables FROM tidemark.snapshots
                            WHERE stream = %s AND status = 'complete' ORDER BY lsn, started_at""", (stream,))
            return [tuple(r) for r in cur.fetchall()]

    def last_table_snapshots(self, stream: str) -> dict[str, dict]:
        """{table: its entry in the latest snapshot (complete or loaded) that copied it}: what the
        lake's copy of each table was taken with (``published``: its column list and row filter)."""
        with self.tx() as cur:
            cur.execute("""SELECT tables FROM tidemark.snapshots WHERE stream = %s AND status IN ('complete', 'loaded')
                            ORDER BY lsn, started_at""", (stream,))
            out: dict[str, dict] = {}
            for (tables,) in cur.fetchall():
                tables = json.loads(tables) if isinstance(tables, str) else (tables or {})
                out.update({t: e for t, e in tables.items() if isinstance(e, dict)})
            return out

    def mark_snapshots_loaded(self, stream: str, snapshot_ids: list[str]) -> None:
        with self.tx() as cur:
            cur.execute("""UPDATE tidemark.snapshots SET status = 'loaded'
                            WHERE stream = %s AND snapshot_id = ANY(%s) AND status = 'complete'""",
                        (stream, list(snapshot_ids)))

    def first_landed_at(self, stream: str, time: int):
        """When the first landed segment that covers ``time`` was registered (None if none)."""
        with self.tx() as cur:
            cur.execute("""SELECT min(created_at) FROM tidemark.segments
                            WHERE stream = %s AND status = 'landed' AND lower_lsn <= %s AND %s < upper_lsn""",
                        (stream, time, time))
            row = cur.fetchone()
        return row[0] if row else None

    # -- incidents -----------------------------------------------------------------------------------
    def open_incident(self, stream: str, kind: str, detail: dict, *, table: str | None = None,
                      cause: Any = None) -> int:
        """Record an incident, one per cause: if an open incident of the same cause exists, count one
        more occurrence (``occurrences``, ``last_seen_at``, the latest ``detail``) and return its id.

        The cause is (stream, kind, table, cause key). ``table`` defaults to the detail's ``table``;
        the cause key is a digest of ``cause`` when given, else of the detail without what changes from
        one occurrence of the same failure to the next (`incident_cause`): wall-clock times, counts
        seen, attempt numbers."""
        from tidemark.errors import reason_line

        table = table if table is not None else (detail.get("table") if isinstance(detail.get("table"), str) else None)
        if isinstance(detail.get("reason"), str) and ("\n" in detail["reason"] or "\r" in detail["reason"]):
            # an incident's reason is one line: a Java stack trace or a Py4J dump is reduced to its first
            # meaningful line (the task's log keeps the whole text)
            detail = {**detail, "reason": reason_line(detail["reason"]) or detail["reason"].strip()}
        key = cause_key(kind, table, incident_cause(kind, detail) if cause is None else cause)
        step = detail.get("step") if isinstance(detail.get("step"), str) else None
        reason = detail.get("reason") if isinstance(detail.get("reason"), str) else None
        with self.tx() as cur:
            cur.execute("""INSERT INTO tidemark.incidents (stream, kind, detail, table_name, cause_key, step, reason)
                           VALUES (%s, %s, %s, %s, %s, %s, %s)
                           ON CONFLICT (stream, kind, cause_key) WHERE resolved_at IS NULL AND cause_key IS NOT NULL
                           DO UPDATE SET occurrences = tidemark.incidents.occurrences + 1,
                                         last_seen_at = clock_timestamp(), detail = EXCLUDED.detail,
                                         step = EXCLUDED.step, reason = EXCLUDED.reason
                           RETURNING id""",
                        (stream, kind, json.dumps(detail, default=str), table, key, step, reason))
            return cur.fetchone()[0]

    def incidents(self, stream: str, *, open_only: bool = True) -> list[dict]:
        """The stream's incidents (open ones only by default), oldest first, each with its ``count``
        of occurrences, when it was ``last_seen_at``, and the ``step`` and one-line ``reason`` of its
        cause (None for kinds whose detail has none)."""
        with self.tx() as cur:
            cur.execute("""SELECT id, kind, detail, opened_at, resolved_at, resolution, table_name, occurrences,
                                  last_seen_at, step, reason FROM tidemark.incidents
                            WHERE stream = %s AND (NOT %s OR resolved_at IS NULL) ORDER BY id""", (stream, open_only))
            cols = ["id", "kind", "detail", "opened_at", "resolved_at", "resolution", "table", "count", "last_seen_at",
                    "step", "reason"]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

    def classify_incident(self, incident_id: int, failure_class: str) -> None:
        """Record what the job that met the incident's failure said of it (``deterministic`` or
        ``transient``), for a task that cannot read the job's own result (`failure_class_since`)."""
        if failure_class not in ("deterministic", "transient"):
            raise ValueError(f"failure class {failure_class!r} is not 'deterministic' or 'transient'")
        with self.tx() as cur:
            cur.execute("UPDATE tidemark.incidents SET failure_class = %s WHERE id = %s", (failure_class, incident_id))

    def now(self):
        """The control database's clock (the one `last_seen_at` is on)."""
        with self.tx() as cur:
            cur.execute("SELECT clock_timestamp()")
            return cur.fetchone()[0]

    def failure_class_since(self, stream: str, kind: str, since) -> dict | None:
        """The newest open incident of ``kind`` seen on the stream at or after ``since`` (a time from
        `now`) whose job classified it: ``{"id", "class", "reason"}``, or None."""
        with self.tx() as cur:
            cur.execute("""SELECT id, failure_class, reason FROM tidemark.incidents
                            WHERE stream = %s AND kind = %s AND resolved_at IS NULL AND last_seen_at >= %s
                              AND failure_class IS NOT NULL ORDER BY last_seen_at DESC LIMIT 1""",
                        (stream, kind, since))
            row = cur.fetchone()
        return {"id": row[0], "class": row[1], "reason": row[2]} if row else None

    def resolve_incident(self, incident_id: int, resolution: str) -> None:
        with self.tx() as cur:
            cur.execute("UPDATE tidemark.incidents SET resolved_at = now(), resolution = %s WHERE id = %s AND resolved_at IS NULL",
                        (resolution, incident_id))

    def set_metric(self, stream: str, **fields: Any) -> None:
        self._update("metrics", "stream", stream, {"current_segment", "committed_segment", "committed_position",
                                                   "last_segment_at", "slot_lag_bytes"}, fields)

    def metrics(self, stream: str) -> dict:
        with self.tx() as cur:
            cur.execute("""SELECT current_segment, committed_segment, committed_position, last_segment_at,
                                  slot_lag_bytes, updated_at FROM tidemark.metrics WHERE stream = %s""", (stream,))
            row = cur.fetchone()
        cols = ["current_segment", "committed_segment", "committed_position", "last_segment_at", "slot_lag_bytes",
                "updated_at"]
        return dict(zip(cols, row)) if row else {}

    def activity(self, stream: str) -> dict:
        """When the stream's jobs last did something, on the control database's clock (``now``):
        ``last_landed_at`` (the newest landed segment: every drain run lands one), ``last_consolidated_at``
        (the consolidation's checkpoint last moved: `advance_frontier`, a resend's `reset_frontier`) and
        ``oldest_pending_at`` (the oldest landed segment above the frontier, None when none waits) and
        ``last_snapshot_at`` (the newest complete snapshot's end)."""
        with self.tx() as cur:
            cur.execute("""SELECT clock_timestamp(),
                                  (SELECT max(created_at) FROM tidemark.segments
                                    WHERE stream = s.name AND status = 'landed'),
                                  (SELECT updated_at FROM tidemark.subscribers
                                    WHERE stream = s.name AND name = 'consolidate'),
                                  (SELECT min(created_at) FROM tidemark.segments
                                    WHERE stream = s.name AND status = 'landed' AND upper_lsn > COALESCE(s.frontier, -1)),
                                  (SELECT max(finished_at) FROM tidemark.snapshots
                                    WHERE stream = s.name AND status IN ('complete', 'loaded'))
                             FROM tidemark.streams s WHERE s.name = %s""", (stream,))
            row = cur.fetchone()
        cols = ["now", "last_landed_at", "last_consolidated_at", "oldest_pending_at", "last_snapshot_at"]
        return dict(zip(cols, row)) if row else {}

    def commit_lag(self, stream: str, *, window_seconds: int = 3600) -> dict | None:
        """The commit -> lake lag of the transactions consolidated in the last ``window_seconds``: how
        long after its commit in the source each one was in the lake (the frontier passed it). Median,
        95th percentile and maximum in seconds, over ``transactions`` in ``batches`` frontier moves; None
        when no transaction was consolidated in the window.

        From the landed segments' commit-time bounds and ``txn_count`` and the time of the frontier move
        that consolidated each (`frontier_moves`): a segment's transactions are taken as spread evenly
        between its first and last commit (segments are a drain's worth: seconds), and the two clocks
        (the source's commit times, the control database's) as the same."""
        with self.tx() as cur:
            cur.execute("""SELECT extract(epoch FROM m.at) * 1e6, s.min_commit_ts, s.max_commit_ts, s.txn_count
                             FROM tidemark.frontier_moves m
                             JOIN tidemark.segments s
                               ON s.stream = m.stream AND s.upper_lsn > COALESCE(m.frontier_before, -1)
                              AND s.upper_lsn <= m.frontier_after
                            WHERE m.stream = %s AND m.at > clock_timestamp() - make_interval(secs => %s)
                              AND s.status = 'landed' AND s.txn_count > 0 AND s.min_commit_ts IS NOT NULL""",
                        (stream, window_seconds))
            rows = cur.fetchall()
        return lag_summary(rows, window_seconds)

    # -- metrics history (the status page) -----------------------------------------------------------
    def record_metrics_sample(self, stream: str, *, frontier: int | None, landed_upper: int | None,
                              source_lsn: int | None, confirmed_lsn: int | None, slot_lag_bytes: int | None,
                              current_segment: int | None, committed_segment: int | None,
                              keep_seconds: int = 7 * 86400, keep_rows: int = 20000) -> dict:
        """Append one metrics sample and prune the stream's history (older than ``keep_seconds``, beyond
        ``keep_rows``); return the sample.

        ``slot_lag_seconds`` is how long ago the source was first seen (in this history) at or past the
        slot's confirmed position: 0 when the slot is confirmed up to the source's position, None when
        no earlier sample shows it (the history is too short or the slot is unknown).
        """
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
            cur.execute("""INSERT INTO tidemark.metrics_history (stream, at, frontier, landed_upper, source_lsn,
                                  confirmed_lsn, slot_lag_bytes, slot_lag_seconds, landed_changes, current_segment,
                                  committed_segment)
                           VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)""",
                        (stream, at, frontier, landed_upper, source_lsn, confirmed_lsn, slot_lag_bytes, lag_seconds,
                         landed_changes, current_segment, committed_segment))
            cur.execute("""DELETE FROM tidemark.metrics_history
                            WHERE stream = %s AND (at < clock_timestamp() - make_interval(secs => %s)
                                  OR at < (SELECT at FROM tidemark.metrics_history WHERE stream = %s
                                            ORDER BY at DESC OFFSET %s LIMIT 1))""",
                        (stream, keep_seconds, stream, keep_rows - 1))
        return {"at": at, "frontier": frontier, "landed_upper": landed_upper, "source_lsn": source_lsn,
                "confirmed_lsn": confirmed_lsn, "slot_lag_bytes": slot_lag_bytes, "slot_lag_seconds": lag_seconds,
                "landed_changes": landed_changes, "current_segment": current_segment,
                "committed_segment": committed_segment}

    def metrics_history(self, stream: str, *, since_seconds: int = 6 * 3600, limit: int = 2000) -> list[dict]:
        """The stream's metrics samples of the last ``since_seconds`` (newest ``limit``), oldest first, each
        with ``changes_per_second``: change records landed since the previous sample per second."""
        with self.tx() as cur:
            cur.execute("""SELECT at, frontier, landed_upper, source_lsn, confirmed_lsn, slot_lag_bytes,
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
            cols = [d[0] for d in cur.description]
            rows = [dict(zip(cols, r)) for r in cur.fetchall()]
        rows.reverse()
        return rows

    def recent_segments(self, stream: str, *, limit: int = 10) -> list[dict]:
        """The newest ``limit`` segments of a stream (any status), newest first, with when they were registered."""
        with self.tx() as cur:
            cur.execute("""SELECT seq, lower_lsn, upper_lsn, record_count, txn_count, byte_size, status, origin,
                                  created_at FROM tidemark.segments WHERE stream = %s ORDER BY seq DESC LIMIT %s""",
                        (stream, limit))
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

    # -- subscribers (readers of the changes from their own checkpoint) ----------------------------
    def add_subscriber(self, stream: str, name: str, checkpoint: int) -> bool:
        """Register a subscriber at ``checkpoint``; False when it already exists (left unchanged)."""
        with self.tx() as cur:
            cur.execute("""INSERT INTO tidemark.subscribers (stream, name, checkpoint) VALUES (%s, %s, %s)
                           ON CONFLICT (stream, name) DO NOTHING RETURNING name""", (stream, name, checkpoint))
            return cur.fetchone() is not None

    def subscribers(self, stream: str) -> list[dict]:
        """Every subscriber of the stream (the consolidation's own included) with its checkpoint."""
        with self.tx() as cur:
            cur.execute("""SELECT name, checkpoint, updated_at FROM tidemark.subscribers WHERE stream = %s
                            ORDER BY name""", (stream,))
            return [{"name": n, "checkpoint": c, "updated_at": u} for n, c, u in cur.fetchall()]

    def drop_subscriber(self, stream: str, name: str) -> bool:
        with self.tx() as cur:
            cur.execute("DELETE FROM tidemark.subscribers WHERE stream = %s AND name = %s RETURNING name",
                        (stream, name))
            return cur.fetchone() is not None

    def ack_subscriber(self, stream: str, name: str, upper: int) -> int | None:
        """Move the subscriber's checkpoint forward to ``upper`` (never backward); the new checkpoint,
        None when there is no such subscriber."""
        with self.tx() as cur:
            cur.execute("""UPDATE tidemark.subscribers SET checkpoint = GREATEST(COALESCE(checkpoint, 0), %s),
                                  updated_at = now() WHERE stream = %s AND name = %s RETURNING checkpoint""",
                        (upper, stream, name))
            row = cur.fetchone()
        return row[0] if row else None

    # -- external feeds (source kind: feed) ---------------------------------------------------------
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
            cur.execute("""INSERT INTO tidemark.feed_files (stream, key, table_name, checksum, byte_size, update_count,
                               min_time, max_time, progress, status, detail)
                           VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)""",
                        (stream, key, table, checksum, byte_size, update_count, min_time, max_time,
                         json.dumps(progress), status, detail))
            return True

    def feed_files(self, stream: str, *, status: str | None = "registered") -> list[dict]:
        with self.tx() as cur:
            cur.execute("""SELECT key, table_name, checksum, byte_size, update_count, min_time, max_time, progress,
                                  status, detail, registered_at FROM tidemark.feed_files
                            WHERE stream = %s AND (%s IS NULL OR status = %s) ORDER BY registered_at, key""",
                        (stream, status, status))
            cols = ["key", "table", "checksum", "byte_size", "update_count", "min_time", "max_time", "progress",
                    "status", "detail", "registered_at"]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

    def set_feed_file_status(self, stream: str, key: str, status: str, detail: str | None = None) -> None:
        with self.tx() as cur:
            cur.execute("UPDATE tidemark.feed_files SET status = %s, detail = %s WHERE stream = %s AND key = %s",
                        (status, detail, stream, key))

    def table_frontiers(self, stream: str) -> dict[str, dict]:
        """Per-table positions of a feed stream: ``{table: {"landed_upper": l, "frontier": f}}``."""
        with self.tx() as cur:
            cur.execute("""SELECT table_name, landed_upper, frontier FROM tidemark.table_frontiers
                            WHERE stream = %s ORDER BY table_name""", (stream,))
            return {r[0]: {"landed_upper": r[1], "frontier": r[2]} for r in cur.fetchall()}

    def advance_table_positions(self, stream: str, table: str, *, landed_upper: int | None = None,
                                frontier: int | None = None) -> None:
        """Move a feed table's landed upper and/or frontier forward (never backward)."""
        with self.tx() as cur:
            self._advance_table_positions(cur, stream, table, landed_upper, frontier)

    @staticmethod
    def _advance_table_positions(cur, stream: str, table: str, landed_upper: int | None, frontier: int | None) -> None:
        cur.execute("""INSERT INTO tidemark.table_frontiers (stream, table_name, landed_upper, frontier)
                           VALUES (%s, %s, %s, %s)
                           ON CONFLICT (stream, table_name) DO UPDATE
                           SET landed_upper = GREATEST(tidemark.table_frontiers.landed_upper, EXCLUDED.landed_upper),
                               frontier = GREATEST(tidemark.table_frontiers.frontier, EXCLUDED.frontier),
                               updated_at = now()""", (stream, table, landed_upper, frontier))

    def forget_feed_time(self, stream: str, table: str, time: int, expected: int, seen: int, reason: str) -> None:
        with self.tx() as cur:
            cur.execute("""INSERT INTO tidemark.feed_forgotten (stream, table_name, time, expected, seen, reason)
                           VALUES (%s,%s,%s,%s,%s,%s) ON CONFLICT DO NOTHING""",
                        (stream, table, time, expected, seen, reason))

    def feed_forgotten(self, stream: str) -> list[dict]:
        with self.tx() as cur:
            cur.execute("""SELECT table_name, time, expected, seen, reason, at FROM tidemark.feed_forgotten
                            WHERE stream = %s ORDER BY time, table_name""", (stream,))
            cols = ["table", "time", "expected", "seen", "reason", "at"]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

    # -- lake history reads (folds helper: `tidemark.lake.history` as of a time before any change) ------

    def loaded_snapshots(self, stream: str) -> list[tuple[int, Any, dict]]:
        """(lsn, finished_at, tables) of the stream's snapshots complete or loaded, newest first."""
        with self.tx() as cur:
            cur.execute("""SELECT lsn, finished_at, tables FROM tidemark.snapshots WHERE stream = %s
                            AND status IN ('complete', 'loaded') ORDER BY lsn DESC""", (stream,))
            return [(int(lsn), finished, tables or {}) for lsn, finished, tables in cur.fetchall()]


def _qualified(name: str) -> str:
    """A table name from a stored stream file as the configuration spells it (``schema.name``)."""
    from tidemark.config import TableRef

    try:
        return TableRef.parse(name).qualified
    except Exception:  # noqa: BLE001 - an unusual stored name: compared as it is
        return name


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
