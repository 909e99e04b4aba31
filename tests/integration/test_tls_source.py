"""A source PostgreSQL that accepts TLS connections only (``ssl = on``, ``hostssl``-only pg_hba.conf,
normal and replication), with a self-signed certificate made here with openssl. A stream whose source
connection carries ``sslmode=verify-ca`` and ``sslrootcert`` in its extras (Airflow's JSON form) is
applied (normal queries), snapshotted and drained (a logical replication connection) through it; the
same connection with another root certificate fails with one line that names the connection and says
the certificate did not verify (not retried), and a connection without TLS is refused by the server.

Before issue 22 point 11, the extras were dropped from the DSN: libpq fell back to ``sslmode=prefer``
(no verification), so the wrong root certificate was not noticed at all."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg2
import pytest
import yaml
from psycopg2.extensions import parse_dsn

from dbkit import TEST_SETTINGS
from tidemark.local.localpg import LocalCluster

HBA_TLS_ONLY = """# TLS only: no host (plain TCP) and no local (socket) lines
hostssl  all          all  127.0.0.1/32  scram-sha-256
hostssl  replication  all  127.0.0.1/32  scram-sha-256
"""


def _openssl_self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    key, crt = directory / f"{name}.key", directory / f"{name}.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                    f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True)
    return key, crt


@pytest.fixture(scope="module")
def tls_cluster():
    """A cluster of its own with TLS required; yields (cluster, server certificate, another certificate)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    home = Path(tempfile.mkdtemp(prefix="tidemark-tls-"))
    os.chmod(home, 0o755)
    cluster = LocalCluster(home / "cluster", settings=dict(TEST_SETTINGS, max_replication_slots="10",
                                                           max_wal_senders="10", max_connections="50"))
    cluster.init()
    certs = home / "certs"
    certs.mkdir()
    os.chmod(certs, 0o755)
    key, crt = _openssl_self_signed(certs, "127.0.0.1")
    _, other = _openssl_self_signed(certs, "someone-else")
    for path in (key, crt):
        target = cluster.datadir / path.name.replace("127.0.0.1", "server")
        shutil.copy(path, target)
        if os.geteuid() == 0:
            shutil.chown(target, "postgres", "postgres")
        os.chmod(target, 0o600)
    with open(cluster.datadir / "postgresql.conf", "a") as fh:
        fh.write("ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n")
    (cluster.datadir / "pg_hba.conf").write_text(HBA_TLS_ONLY)
    cluster._write_hba = lambda: None        # keep the TLS-only rules (start() would rewrite them)
    try:
        cluster.start()
        yield cluster, crt, other
    finally:
        cluster.destroy()
        shutil.rmtree(home, ignore_errors=True)


def _conn_json(cluster: LocalCluster, dbname: str, **extra) -> str:
    return json.dumps({"conn_type": "postgres", "host": "127.0.0.1", "port": cluster.port, "login": "postgres",
                       "password": cluster.password, "schema": dbname, "extra": extra})


@pytest.fixture
def tls_stream(tls_cluster, control_dsn, tmp_path, monkeypatch):
    """A source database on the TLS cluster with a table, and a stream file whose source connection
    verifies the server's certificate (``verify-ca``); returns (cfg, stream file, cluster, certs)."""
    import secrets

    from tidemark.config import parse_config

    from dbkit import dsn_uri

    cluster, crt, other = tls_cluster
    name = f"s_{secrets.token_hex(4)}"
    dsn = cluster.ensure_database(f"src_{name}")
    with psycopg2.connect(dsn, sslmode="require") as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
        cur.execute("INSERT INTO items SELECT g, 'v' || g FROM generate_series(1, 5) g")
    conn.close()
    monkeypatch.setenv(f"AIRFLOW_CONN_TLS_{name.upper()}",
                       _conn_json(cluster, f"src_{name}", sslmode="verify-ca", sslrootcert=str(crt)))
    monkeypatch.setenv(f"AIRFLOW_CONN_CTL_{name.upper()}", dsn_uri(control_dsn))
    doc = {"stream": name, "source": {"connection": f"tls_{name}", "publication": f"pub_{name}",
                                      "slot": f"slot_{name}", "tables": ["public.items"]},
           "control": {"connection": f"ctl_{name}"}, "landing": {"url": str(tmp_path / "landing")},
           "lake": {"path": str(tmp_path / "lake")}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = parse_config(doc, origin=str(path))
    yield cfg, path, cluster, crt, other, dsn
    conn = psycopg2.connect(cluster.dsn("postgres"), sslmode="require")
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                        (f"slot_{name}",))
            cur.execute(f'DROP DATABASE IF EXISTS "src_{name}" WITH (FORCE)')
    finally:
        conn.close()


def test_verify_ca_reaches_a_tls_only_source_for_queries_and_logical_replication(tls_stream):
    from tidemark.capture.drain import drain_stream
    from tidemark.capture.snapshot import snapshot_stream
    from tidemark.capture.source import apply_stream, connect_source, source_dsn

    cfg, _, cluster, crt, _, dsn = tls_stream
    assert (parse_dsn(source_dsn(cfg))["sslmode"], parse_dsn(source_dsn(cfg))["sslrootcert"]) == ("verify-ca", str(crt))
    # the server refuses a connection without TLS: what follows went through TLS
    with pytest.raises(psycopg2.OperationalError, match="no encryption"):
        psycopg2.connect(dsn, sslmode="disable")
    conn = connect_source(cfg)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            assert cur.fetchone() == (True,)
    finally:
        conn.close()
    state = apply_stream(cfg)                                  # normal queries: validate, publication
    assert state.publication == cfg.source.publication
    snapshot_stream(cfg)                                       # the slot, made on a replication connection
    with psycopg2.connect(dsn, sslmode="require") as c, c.cursor() as cur:
        cur.execute("INSERT INTO items VALUES (6, 'six'), (7, 'seven')")
        cur.execute("UPDATE items SET v = 'one' WHERE id = 1")
    c.close()
    result = drain_stream(cfg)                                 # the walsender, over TLS
    assert result.changes == 3 and result.registered


def test_a_wrong_root_certificate_fails_in_one_clear_line(tls_stream, monkeypatch):
    from tidemark.capture.replication import WalStream
    from tidemark.capture.source import source_dsn
    from tidemark.errors import TidemarkError
    from tidemark.failures import is_transient

    cfg, path, cluster, _, other, _ = tls_stream
    env_name = f"AIRFLOW_CONN_{cfg.source.connection.upper()}"
    monkeypatch.setenv(env_name, _conn_json(cluster, parse_dsn(source_dsn(cfg))["dbname"], sslmode="verify-ca",
                                            sslrootcert=str(other)))
    proc = subprocess.run([sys.executable, "-m", "tidemark.cli", "stream", "apply", str(path)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = lines[0]
    print(line)
    assert line.startswith(f"tidemark: error: stream {cfg.stream}: cannot connect to the source "
                           f"(connection '{cfg.source.connection}', 127.0.0.1:{cluster.port})"), line
    assert "certificate verify failed" in line and "sslrootcert" in line, line
    assert cluster.password not in line
    # the replication connection too: one line, and not retried (the same certificate fails the same way)
    with pytest.raises(TidemarkError) as caught:
        WalStream(source_dsn(cfg))
    assert "certificate verify failed" in str(caught.value) and "\n" not in str(caught.value)
    assert not is_transient(caught.value)
