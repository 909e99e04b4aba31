"""Database housekeeping shared by the fixtures and the property tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import psycopg2

from tidemark.local.localpg import LocalCluster


# the test clusters' settings: no durability (tests do not need it), room for many slots and senders
TEST_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off", "max_connections": "300",
                 "max_replication_slots": "60", "max_wal_senders": "60"}


def start_own_cluster(prefix: str, settings: dict) -> tuple[Path, LocalCluster]:
    """A dedicated cluster (``settings``) under a new temporary directory, started; return (home, cluster)."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(home, 0o755)
    cluster = LocalCluster(home / "cluster", settings=settings)
    cluster.start()
    return home, cluster


def destroy_own_cluster(home: Path, cluster: LocalCluster) -> None:
    """Undo `start_own_cluster`: destroy the cluster, remove its directory."""
    cluster.destroy()
    shutil.rmtree(home, ignore_errors=True)


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


def dsn_uri(dsn: str) -> str:
    """The ``postgresql://`` form of a libpq DSN (the test cluster's carry its password)."""
    from urllib.parse import quote

    from psycopg2.extensions import parse_dsn

    parts = parse_dsn(dsn)
    auth = quote(parts["user"], safe="") + (f":{quote(parts['password'], safe='')}" if parts.get("password") else "")
    return f"postgresql://{auth}@{parts['host']}:{parts['port']}/{quote(parts['dbname'], safe='')}"


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "1m"):
    """A tmpfs of ``size`` mounted at ``where`` (a disk that fills up for real), unmounted afterwards;
    skips the test where it cannot be mounted (mounting needs root; the CI machine runs as root)."""
    import subprocess

    import pytest

    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (the CI machine runs as root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
