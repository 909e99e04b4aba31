"""The stream lease: which jobs may run on one stream at the same time, and `Control.stream_lock`,
which takes it (session advisory locks on a connection of its own, tried, never queued for)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator

import psycopg2
from psycopg2 import sql

from tidemark.control.connection import Connection, connect
from tidemark.errors import LeaseLost, StreamBusy, TidemarkError

_STREAM_LOCK_CLASS = 0x6D61_726B  # 'mark'


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


# Every job that moves a stream's positions takes the stream's lease with its purpose. Two purposes
# exclude each other unless listed in COMPATIBLE_PURPOSES (why each pair may: docs/concepts.md); a
# purpose not in LOCK_PURPOSES excludes everything.
# How long a job waits for a lease an excluding job holds before `StreamBusy` (0, the default: try once).
LOCK_WAIT_ENV = "TIDEMARK_LOCK_WAIT_SECONDS"
LOCK_PURPOSES = ("drain", "feed-ingest", "sweep", "snapshot", "snapshot-add", "consolidate", "changelog", "repair",
                 "resend", "maintain")
COMPATIBLE_PURPOSES = frozenset(frozenset(pair) for pair in (
    ("drain", "consolidate"), ("drain", "changelog"),
    ("feed-ingest", "consolidate"), ("feed-ingest", "changelog"),
    ("sweep", "consolidate"), ("sweep", "changelog"),
    ("snapshot-add", "drain"), ("snapshot-add", "consolidate"), ("snapshot-add", "changelog"),
    ("snapshot-add", "sweep"),
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
    """Take the advisory locks of ``purpose``'s lease on ``conn``, all or none: its own key exclusive,
    then a shared lock on the key of every purpose it excludes. While an excluding job holds one,
    release what was taken and try again (every 0.5 s, backing off to 5 s) until ``wait`` seconds have
    passed; then raise `StreamBusy` naming the holder and the wait."""
    excluded = [p for p in LOCK_PURPOSES if p != purpose and not lock_compatible(purpose, p)]
    plan = [(purpose, "pg_try_advisory_lock")] + [(p, "pg_try_advisory_lock_shared") for p in excluded]
    deadline, pause = time.monotonic() + wait, 0.5
    with conn.cursor() as cur:
        while True:
            for other, fn in plan:
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


class _HeldLeases(threading.local):
    def __init__(self) -> None:
        self.leases: list[tuple[str, Lease]] = []


_HELD = _HeldLeases()


def _held_lease(dsn: str, stream: str, purpose: str) -> "Lease | None":
    """The lease this thread already holds on ``stream`` that covers ``purpose`` (`NESTED_PURPOSES`)."""
    return next((lease for held_dsn, lease in reversed(_HELD.leases)
                 if held_dsn == dsn and lease.stream == stream and _nests(lease.purpose, purpose)), None)


def _nests(outer: str, inner: str, seen: frozenset = frozenset()) -> bool:
    """Whether a job of ``outer`` runs one of ``inner`` inside it, directly or through another one."""
    return any(q == inner or (q not in seen and _nests(q, inner, seen | {q})) for q in NESTED_PURPOSES.get(outer, ()))


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


class LeaseMixin(Connection):
    """`Control.stream_lock`."""

    @contextlib.contextmanager
    def stream_lock(self, stream: str, purpose: str) -> Iterator["Lease"]:
        """Hold the stream's lease for ``purpose``; raise `StreamBusy` if a job it excludes
        (`lock_compatible`) is still running after `lock_wait_seconds`. Inside a lease this thread holds
        whose purpose runs ``purpose`` inside it (`NESTED_PURPOSES`), yield that lease instead.

        The yielded `Lease` must be confirmed (`Lease.confirm`) before every commit that moves a
        position: its locks live on a connection of their own, and are gone if that connection drops
        (how the locks work: docs/internals/storage.md).
        """
        outer = _held_lease(self.dsn, stream, purpose)
        if outer is not None:
            yield outer
            return
        conn = connect(self.dsn, f"tidemark-lock:{stream}:{purpose}")
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
