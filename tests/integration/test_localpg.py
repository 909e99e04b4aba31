"""The embedded PostgreSQL requires a password: a cluster made before passwords (``trust``) is
hardened at its next start, and a password file readable by others is refused."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import psycopg2
import pytest

from tidemark.errors import TidemarkError
from tidemark.local.localpg import LocalCluster


def test_a_trust_cluster_gets_a_password_at_its_next_start():
    base = Path(tempfile.mkdtemp(prefix="tidemark-lpg-"))
    os.chmod(base, 0o755)
    cluster = LocalCluster(base / "pg", settings={"fsync": "off"})
    try:
        cluster.start()
        cluster.stop()
        # what a cluster created by an older tidemark looked like: trust, no password file
        hba = cluster.datadir / "pg_hba.conf"
        hba.write_text("local all all trust\nhost all all 127.0.0.1/32 trust\n")
        cluster.pgpass.unlink()
        cluster.start()
        assert stat.S_IMODE(cluster.pgpass.stat().st_mode) == 0o600
        assert "trust" not in hba.read_text()
        with pytest.raises(psycopg2.OperationalError, match="password"):
            psycopg2.connect(host="127.0.0.1", port=cluster.port, user="postgres", dbname="postgres",
                             passfile="/dev/null")
        with psycopg2.connect(cluster.dsn()) as conn, conn.cursor() as cur:
            cur.execute("SELECT 1")
        # libpq programs find it through PGPASSFILE
        env = cluster.libpq_env()
        assert env["PGPASSFILE"] == str(cluster.pgpass)
        with psycopg2.connect(host=env["PGHOST"], port=env["PGPORT"], user=env["PGUSER"], dbname="postgres",
                              passfile=env["PGPASSFILE"]):
            pass
        os.chmod(cluster.pgpass, 0o644)
        with pytest.raises(TidemarkError, match="readable by others"):
            cluster.dsn()
        os.chmod(cluster.pgpass, 0o600)
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
