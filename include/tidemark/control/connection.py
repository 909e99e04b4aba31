"""The control database connection every part of `tidemark.control.db.Control` shares: its
transactions, the few statement helpers (one row, all rows, rows as dicts, a guarded UPDATE) and the
schema migrations (``migrations/NNNN_*.sql``, applied once each, in order, under an advisory lock)."""

from __future__ import annotations

import contextlib
import json
from importlib import resources
from typing import Any, Iterator, Self, Sequence

import psycopg2
from psycopg2 import sql

from tidemark.connections import with_connect_timeout

_MIGRATION_LOCK = 0x7469_6465  # 'tide'


def connect(dsn: str, application_name: str):
    """A new connection to the control database named ``application_name`` (in ``pg_stat_activity``);
    an unreachable one fails in seconds (`with_connect_timeout`), not after the OS's TCP timeout."""
    return psycopg2.connect(with_connect_timeout(dsn), application_name=application_name[:63])


def insert(table: str, columns: Sequence[str], tail: str = "") -> sql.Composed:
    """``INSERT INTO tidemark.<table> (<columns>) VALUES (<a placeholder each>) <tail>``."""
    return sql.SQL("INSERT INTO {} ({}) VALUES ({}) " + tail).format(
        sql.Identifier("tidemark", table), sql.SQL(", ").join(map(sql.Identifier, columns)),
        sql.SQL(", ").join(sql.Placeholder() * len(columns)))


def from_json(value: Any) -> Any:
    """A stored JSON value as Python (a ``jsonb`` column arrives decoded, a ``json`` text as a string)."""
    return json.loads(value) if isinstance(value, str) else value


def _migrations() -> list[tuple[int, str, str]]:
    """(version, file name, text) of each ``migrations/NNNN_*.sql``, in version order."""
    files = resources.files("tidemark.control").joinpath("migrations").iterdir()
    return sorted((int(f.name.split("_", 1)[0]), f.name, f.read_text()) for f in files if f.name.endswith(".sql"))


class Connection:
    """A connection to the control database. Each method commits its own transaction."""

    def __init__(self, dsn: str):
        self.dsn = dsn
        self.conn = connect(dsn, "tidemark-control")
        self.conn.autocommit = False

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Self:
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

    # -- one statement, one transaction ----------------------------------------------------------------
    def _run(self, query, params: Any = None) -> int:
        """Run one statement in its own transaction; the rows it touched."""
        with self.tx() as cur:
            cur.execute(query, params)
            return cur.rowcount

    def _one(self, query, params: Any = None) -> tuple | None:
        """The first row of one statement in its own transaction (None: no row)."""
        return next(iter(self._all(query, params)), None)

    def _all(self, query, params: Any = None) -> list[tuple]:
        """Every row of one statement in its own transaction."""
        with self.tx() as cur:
            cur.execute(query, params)
            return cur.fetchall()

    def _dicts(self, query, params: Any = None, cols: Sequence[str] | None = None) -> list[dict]:
        """Every row of one statement as a dict keyed by ``cols`` (default: the statement's column names)."""
        with self.tx() as cur:
            cur.execute(query, params)
            names = cols or [d[0] for d in cur.description]
            return [dict(zip(names, r)) for r in cur.fetchall()]

    def _update(self, table: str, key_column: str, key: str, allowed: set[str], fields: dict[str, Any]) -> None:
        """UPDATE one row of a tidemark table, only the ``allowed`` columns, stamping ``updated_at``."""
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"cannot update {table} columns {sorted(bad)}")
        sets = sql.SQL(", ").join(sql.SQL("{} = %s").format(sql.Identifier(k)) for k in fields)
        self._run(sql.SQL("UPDATE {} SET {}, updated_at = now() WHERE {} = %s").format(
            sql.Identifier("tidemark", table), sets, sql.Identifier(key_column)), (*fields.values(), key))

    def now(self):
        """The control database's clock (the one `last_seen_at` is on)."""
        return self._one("SELECT clock_timestamp()")[0]

    # -- schema ----------------------------------------------------------------------------------------
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
