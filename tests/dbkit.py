"""Database housekeeping shared by the fixtures and the property tests."""

from __future__ import annotations

import psycopg2


def drop_database(cluster, name: str) -> None:
    """Drop database ``name`` of ``cluster`` with its replication slots (ending their walsenders)."""
    conn = psycopg2.connect(cluster.dsn("postgres"))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = %s", (name,))
        for slot, pid in cur.fetchall():
            if pid:
                cur.execute("SELECT pg_terminate_backend(%s)", (pid,))
            try:
                cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            except psycopg2.Error:
                pass
        cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    conn.close()
