"""The PostgreSQL source: connections, the stream's publication, and its replication slot.

The slot itself is created by the snapshot (`tidemark.capture.snapshot`), because its consistent point and
the exported snapshot must be the same instant.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import psycopg2
import psycopg2.errors
import psycopg2.extras
from psycopg2 import sql

from tidemark.config import (NO_FILTER, StreamConfig, TableRef, publication_table, trial_filter,
                             validate_against_source)
from tidemark.connections import connect_failure, resolve_dsn, with_connect_timeout
from tidemark.control import Control, StreamState, control_dsn
from tidemark.errors import SlotLost, TidemarkError
from tidemark.landing.store import landing_store, probe_store
from tidemark.lsn import format_lsn
from tidemark.pgtypes import session_options
from tidemark.pgtypes.catalog import relation

_log = logging.getLogger(__name__)


def source_dsn(cfg: StreamConfig) -> str:
    return resolve_dsn(cfg.source.connection)


def connect_source(cfg: StreamConfig, *, autocommit: bool = True, application_name: str = "tidemark"):
    """A regular connection to the source with Tidemark's canonical session settings. One that cannot
    be opened is one `TidemarkError` line naming the stream, the connection id, host:port and what to
    do (`connect_failure`), raised from libpq's error (a refused connection is still retried, a wrong
    password is not: `tidemark.failures.is_transient`)."""
    dsn = source_dsn(cfg)
    try:
        conn = psycopg2.connect(with_connect_timeout(dsn), options=session_options(), application_name=application_name)
    except psycopg2.OperationalError as exc:
        raise connect_failure(exc, stream=cfg.stream, role="the source", conn_id=cfg.source.connection,
                              dsn=dsn) from exc
    conn.autocommit = autocommit
    return conn


def _connection(cfg: StreamConfig, conn=None):
    """``conn``, or a source connection of its own (closed after), as a context manager."""
    return contextlib.nullcontext(conn) if conn is not None else contextlib.closing(connect_source(cfg))


def connect_replication(cfg: StreamConfig, *, application_name: str):
    """A logical replication connection to the source with canonical session settings."""
    return psycopg2.connect(source_dsn(cfg), options=session_options(),
                            application_name=application_name,
                            connection_factory=psycopg2.extras.LogicalReplicationConnection)


PUBLISH = ("insert", "update", "delete", "truncate")


def publication_problems(cfg: StreamConfig, conn, filters: dict | None = None) -> list[str]:
    """What makes the stream's existing publication publish other than exactly its tables' insert,
    update, delete and truncate through partition roots, each with the column list and row filter of
    the stream file (`TableFilter`) and none other (empty: as required; None: no publication).
    ``filters``: {TableRef: the row filter as PostgreSQL stores it (`trial_filter`)}; without it a row
    filter is checked for being there (or not), not for its text (that needs a trial publication)."""
    pub = cfg.source.publication
    with conn.cursor() as cur:
        cur.execute("""SELECT oid, puballtables, pubinsert, pubupdate, pubdelete, pubtruncate, pubviaroot
                         FROM pg_publication WHERE pubname = %s""", (pub,))
        row = cur.fetchone()
        if row is None:
            return None
        oid, alltables, *flags, viaroot = row
        problems = []
        if alltables:
            problems.append(f"publication {pub} is FOR ALL TABLES")
        missing = [op for op, on in zip(PUBLISH, flags) if not on]
        if missing:
            problems.append(f"publication {pub} does not publish {', '.join(missing)} "
                            f"(publish = '{', '.join(op for op, on in zip(PUBLISH, flags) if on)}')")
        if not viaroot:
            problems.append(f"publication {pub} has publish_via_partition_root = false (changes to partitions "
                            "would arrive under the partitions' names)")
        cur.execute("""SELECT n.nspname, c.relname, pg_get_expr(pr.prqual, pr.prrelid),
                              CASE WHEN pr.prattrs IS NOT NULL THEN
                                   ARRAY(SELECT a.attname::text FROM pg_attribute a WHERE a.attrelid = pr.prrelid
                                            AND a.attnum = ANY (pr.prattrs::int2[]) ORDER BY a.attnum) END
                         FROM pg_publication_rel pr JOIN pg_class c ON c.oid = pr.prrelid
                         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE pr.prpubid = %s""", (oid,))
        rels = cur.fetchall()
        cur.execute("""SELECT n.nspname FROM pg_publication_namespace pn JOIN pg_namespace n ON n.oid = pn.pnnspid
                        WHERE pn.pnpubid = %s""", (oid,))
        schemas = [r[0] for r in cur.fetchall()]
    want = {(t.schema, t.name) for t in cfg.source.tables}
    have = {(r[0], r[1]) for r in rels}
    name = lambda st: f"{st[0]}.{st[1]}"  # noqa: E731
    if want - have:
        problems.append(f"publication {pub} lacks {', '.join(sorted(map(name, want - have)))}")
    if have - want:
        problems.append(f"publication {pub} also publishes {', '.join(sorted(map(name, have - want)))}, "
                        "which the stream does not capture")
    if schemas:
        problems.append(f"publication {pub} publishes every table of schema(s) {', '.join(sorted(schemas))}")
    for nsp, rel, where, columns in rels:
        if (nsp, rel) not in want:
            continue
        ref = TableRef(nsp, rel)
        filt = cfg.source.filter_of(ref)
        if filt.where is None and where is not None:
            problems.append(f"publication {pub} has a row filter on {ref} (rows outside it would be lost)")
        elif filt.where is not None and where is None:
            problems.append(f"publication {pub} has no row filter on {ref} (the stream file says where: "
                            f"{filt.where!r})")
        elif filt.where is not None and filters is not None and filters.get(ref) != where:
            problems.append(f"publication {pub} filters {ref} by {where!r}, not by the stream file's {filt.where!r}")
        if filt.columns is None and columns is not None:
            problems.append(f"publication {pub} has a column list on {ref} (other columns would be lost)")
        elif filt.columns is not None and (columns is None or set(columns) != set(filt.columns)):
            problems.append(f"publication {pub} publishes {'every column' if columns is None else ', '.join(columns)} "
                            f"of {ref}, not the stream file's columns {', '.join(filt.columns)}")
    return problems


def ensure_publication(cfg: StreamConfig, conn) -> list[str]:
    """Create the stream's publication, or align it: exactly the stream's tables, each with its
    column list and row filter (`TableFilter`), publishing insert, update, delete and truncate,
    through partition roots (a partition's changes, also of one attached later, arrive as the
    partitioned table's). Returns what was wrong and aligned (empty when nothing was); raises
    `TidemarkError` naming what cannot be aligned (FOR ALL TABLES), `ConfigError` naming a column list
    or row filter PostgreSQL refuses (`trial_filter`)."""
    pub = sql.Identifier(cfg.source.publication)
    tables = sql.SQL(", ").join(publication_table(t, cfg.source.filter_of(t)) for t in cfg.source.tables)
    options = sql.SQL("publish = 'insert, update, delete, truncate', publish_via_partition_root = true")
    filters = {ref: trial_filter(cfg, conn, ref, relation(conn, ref.schema, ref.name)[0], f"source.tables[{i}]")
               for i, ref in enumerate(cfg.source.tables) if cfg.source.filter_of(ref) != NO_FILTER}
    problems = publication_problems(cfg, conn, filters)
    with conn.cursor() as cur:
        if problems is None:
            cur.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH ({})").format(pub, tables, options))
            return []
        if any("FOR ALL TABLES" in p for p in problems):
            raise TidemarkError(f"stream {cfg.stream}: {'; '.join(problems)}: it cannot be narrowed to the stream's "
                                f"tables; drop it or name another publication in source.publication")
        if problems:
            cur.execute(sql.SQL("ALTER PUBLICATION {} SET ({})").format(pub, options))
            cur.execute(sql.SQL("ALTER PUBLICATION {} SET TABLE {}").format(pub, tables))
            left = publication_problems(cfg, conn, filters)
            if left:
                raise TidemarkError(f"stream {cfg.stream}: publication {cfg.source.publication} could not be "
                                    f"aligned: {'; '.join(left)}")
    return problems


def check_publication(cfg: StreamConfig, conn=None) -> None:
    """Raise `TidemarkError` naming what is wrong if the publication is missing or not as required."""
    with _connection(cfg, conn) as conn:
        problems = publication_problems(cfg, conn)
        gone = [t for t in cfg.source.tables if relation(conn, t.schema, t.name) is None]
        if gone:
            _gone(cfg, conn, gone)
    if problems is None:
        raise TidemarkError(f"stream {cfg.stream}: publication {cfg.source.publication} does not exist; "
                            f"run: tidemark stream apply {_stream_file(cfg)}")
    if problems:
        raise TidemarkError(f"stream {cfg.stream}: {'; '.join(problems)}; run: tidemark stream apply "
                            f"{_stream_file(cfg)} (it aligns the publication), then tidemark gaps {cfg.stream} "
                            "--resend (changes written while the publication was so were not published)")


def _gone(cfg: StreamConfig, conn, gone: list[TableRef]) -> None:
    """Raise `TidemarkError` for tables of the stream that are not in the source any more: dropped, or
    renamed (a renamed table keeps its place in the publication; its changes come under the new name),
    naming what the publication holds in their place and the remedy (`tidemark stream apply` alone
    would refuse a table that does not exist)."""
    want = {(t.schema, t.name) for t in cfg.source.tables}
    with conn.cursor() as cur:
        cur.execute("""SELECT n.nspname, c.relname
                         FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
                         JOIN pg_class c ON c.oid = pr.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace
                        WHERE p.pubname = %s ORDER BY 1, 2""", (cfg.source.publication,))
        other = [str(TableRef(s, n)) for s, n in cur.fetchall() if (s, n) not in want]
    names = ", ".join(str(t) for t in gone)
    instead = (f"; publication {cfg.source.publication} publishes {', '.join(other)} in its place, which the stream "
               "does not capture (a table renamed keeps its place in the publication)" if other else "")
    raise TidemarkError(f"stream {cfg.stream}: table(s) {names} of the stream do not exist in the source any more "
                        f"(renamed or dropped){instead}; nothing was drained. A renamed table: name its new name in "
                        f"the stream file in place of the old one, run tidemark stream apply {_stream_file(cfg)}, "
                        f"then tidemark snapshot {cfg.stream} --mode add --tables NEW_NAME (the lake keeps the old "
                        "table as it was); a dropped one: remove it from the stream file and apply it")


def apply_stream(cfg: StreamConfig, *, aligned: list[str] | None = None,
                 notes: list[str] | None = None) -> StreamState:
    """Validate a stream against its source, create/align its publication, register it (idempotent).
    What was wrong with an existing publication (and aligned) is appended to ``aligned``; what will
    not be captured (generated columns), to ``notes``. Everything is checked before the source is
    changed: the tables, the landing store (an object written and deleted, so a store that cannot be
    written is found here, not by the snapshot) and the control database; a failed apply leaves no
    publication behind.

    A source or control database that cannot be reached, or a step that fails there, is one
    `TidemarkError` line naming the connection id, host:port, what failed and what to do."""
    conn = connect_source(cfg)
    try:
        found = _on_source(cfg, "validating the stream's tables", validate_against_source, conn)
        probe_store(landing_store(cfg), cfg.stream)
        ctl_dsn = control_dsn(cfg)
        try:
            ctl = Control(ctl_dsn)
        except psycopg2.OperationalError as exc:
            raise connect_failure(exc, stream=cfg.stream, role="the control database",
                                  conn_id=cfg.control_connection, dsn=ctl_dsn) from exc
        with ctl:
            ctl.migrate()
            fixed = _on_source(cfg, f"creating or aligning publication {cfg.source.publication}",
                               ensure_publication, conn)
            state = ctl.upsert_stream(cfg)
    finally:
        conn.close()
    if notes is not None:
        notes.extend(found)
    if aligned is not None:
        aligned.extend(fixed)
    return state


def _on_source(cfg: StreamConfig, step: str, call, conn):
    """``call(cfg, conn)``; a PostgreSQL error of it is one line naming the step and the connection."""
    try:
        return call(cfg, conn)
    except psycopg2.Error as exc:
        raise TidemarkError(f"stream {cfg.stream}: {step} failed on the source (connection "
                            f"'{cfg.source.connection}'): {' '.join(str(exc).split())}; fix that in the source "
                            "(or give the connection's user the privilege it needs) and apply again") from exc


@dataclass(frozen=True)
class SlotInfo:
    name: str
    active: bool
    active_pid: int | None
    restart_lsn: int | None
    confirmed_flush_lsn: int | None
    wal_status: str | None          # reserved | extended | unreserved | lost
    current_lsn: int               # pg_current_wal_lsn() when asked

    @property
    def usable(self) -> bool:
        return self.wal_status != "lost" and self.restart_lsn is not None

    @property
    def lag_bytes(self) -> int | None:
        if self.confirmed_flush_lsn is None:
            return None
        return max(0, self.current_lsn - self.confirmed_flush_lsn)


_LSN = "(({0} - '0/0'::pg_lsn)::numeric)::bigint"


def slot_info(cfg: StreamConfig, conn=None) -> SlotInfo | None:
    """The stream's slot as the source sees it, or None if it does not exist."""
    with _connection(cfg, conn) as conn:
        with conn.cursor() as cur:
            cur.execute(f"""SELECT slot_name, active, active_pid,
                                   {_LSN.format('restart_lsn')}, {_LSN.format('confirmed_flush_lsn')}, wal_status,
                                   {_LSN.format('pg_current_wal_lsn()')}
                              FROM pg_replication_slots WHERE slot_name = %s""", (cfg.source.slot,))
            row = cur.fetchone()
            if row is None:
                return None
            return SlotInfo(*row)


def require_slot(cfg: StreamConfig, *, covers: int, conn) -> SlotInfo:
    """Return the slot, or raise `SlotLost` if it is missing, invalidated, or cannot replay from
    ``covers`` (its confirmed position is already past it)."""
    info = slot_info(cfg, conn)
    if info is None:
        raise SlotLost(f"stream {cfg.stream}: replication slot {cfg.source.slot} does not exist "
                       "(run a snapshot to create it, or a resend if it was dropped)")
    if not info.usable:
        raise SlotLost(f"stream {cfg.stream}: replication slot {cfg.source.slot} is invalidated "
                       f"(wal_status={info.wal_status}); a resend (re-snapshot) is needed")
    if info.confirmed_flush_lsn is not None and info.confirmed_flush_lsn > covers:
        raise SlotLost(f"stream {cfg.stream}: slot {cfg.source.slot} is confirmed up to "
                       f"{format_lsn(info.confirmed_flush_lsn)}, past {format_lsn(covers)}; that range can no longer be replayed")
    return info


def advance_slot(cfg: StreamConfig, lsn: int) -> int | None:
    """Advance the slot to ``lsn`` (never backwards; WAL before it can be recycled). Returns the
    slot's confirmed position afterwards, or None if the slot does not exist.

    It runs after a consolidation has committed everything, so it never fails that run because of the
    slot's state: when a walsender (a drain) holds the slot, already when asked or between the check
    and the advance, the slot is left as it is (the drain confirms on its own feedback, and the next
    consolidation advances it) and its current confirmed position is returned; a slot dropped in
    between (a resend) gives None. Any other error of the source is raised."""
    with contextlib.closing(connect_source(cfg)) as conn:
        info = slot_info(cfg, conn)
        if info is None:
            return None
        if info.confirmed_flush_lsn is not None and info.confirmed_flush_lsn >= lsn:
            return info.confirmed_flush_lsn
        if info.active:
            _log.warning("stream %s: slot %s is in use by pid %s (a drain); not advanced to %s now: the drain "
                         "confirms on its own feedback", cfg.stream, cfg.source.slot, info.active_pid, format_lsn(lsn))
            return info.confirmed_flush_lsn
        try:
            with conn.cursor() as cur:
                cur.execute(f"SELECT {_LSN.format('end_lsn')} FROM pg_replication_slot_advance(%s, %s::pg_lsn)",
                            (cfg.source.slot, format_lsn(lsn)))
                return cur.fetchone()[0]
        except (psycopg2.errors.ObjectInUse, psycopg2.errors.UndefinedObject) as exc:
            # the race: a drain took the slot (or a resend dropped it) after the check above
            now = slot_info(cfg, conn)
            _log.warning("stream %s: slot %s not advanced to %s: %s", cfg.stream, cfg.source.slot, format_lsn(lsn),
                         " ".join(str(exc).split()))
            return None if now is None else now.confirmed_flush_lsn


def drop_slot(cfg: StreamConfig) -> bool:
    """Drop the stream's slot if it exists (terminating a walsender that holds it)."""
    with contextlib.closing(connect_source(cfg)) as conn:
        info = slot_info(cfg, conn)
        if info is None:
            return False
        with conn.cursor() as cur:
            if info.active_pid:
                cur.execute("SELECT pg_terminate_backend(%s)", (info.active_pid,))
            cur.execute("SELECT pg_drop_replication_slot(%s)", (cfg.source.slot,))
        return True


def current_lsn(cfg: StreamConfig) -> int:
    with contextlib.closing(connect_source(cfg)) as conn, conn.cursor() as cur:
        cur.execute(f"SELECT {_LSN.format('pg_current_wal_flush_lsn()')}")
        return cur.fetchone()[0]


def _stream_file(cfg: StreamConfig) -> str:
    """The stream's file as its messages name it (the path it was read from, when known)."""
    return cfg.origin if cfg.origin and not str(cfg.origin).startswith("<") else f"streams/{cfg.stream}.yaml"
