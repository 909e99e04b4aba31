"""The tidemark command line over a real PostgreSQL."""

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg2
import pytest
import yaml

from tidemark import cli


def _write_stream(tmp_path: Path, cfg) -> Path:
    path = tmp_path / "streams" / f"{cfg.stream}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.as_dict()))
    return path


def test_db_start_status_stop():
    base = Path(tempfile.mkdtemp(prefix="tidemark-cli-"))
    os.chmod(base, 0o755)  # the postgres OS user must reach the cluster directory
    home = base / "home"
    try:
        assert cli.main(["--home", str(home), "db", "start"]) == 0
        pgpass = home / "pg" / "pgpass"
        assert stat.S_IMODE(pgpass.stat().st_mode) == 0o600 and stat.S_IMODE((home / "env").stat().st_mode) == 0o600
        password = pgpass.read_text().strip().split(":")[-1]
        assert len(password) >= 24
        env = (home / "env").read_text()
        assert f"AIRFLOW_CONN_TIDEMARK_SOURCE=postgresql://postgres:{password}@127.0.0.1:" in env
        port = int((home / "pg" / "port").read_text())
        conn = psycopg2.connect(host="127.0.0.1", port=port, user="postgres", dbname="demo", password=password)
        with conn.cursor() as cur:
            cur.execute("SHOW wal_level")
            assert cur.fetchone()[0] == "logical"
            cur.execute("SELECT rolpassword LIKE 'SCRAM-SHA-256$%' FROM pg_authid WHERE rolname = 'postgres'")
            assert cur.fetchone()[0]
            cur.execute("SELECT DISTINCT auth_method FROM pg_hba_file_rules")
            assert [r[0] for r in cur.fetchall()] == ["scram-sha-256"]
        conn.close()
        # no password, a wrong one, over TCP or the Unix socket, normal or replication: refused
        for kw in ({}, {"password": "wrong"}, {"host": str(home / "pg" / "data")},
                   {"replication": "database", "password": "wrong"}):
            args = {"host": "127.0.0.1", "port": port, "user": "postgres", "dbname": "demo", "passfile": "/dev/null",
                    **kw}
            with pytest.raises(psycopg2.OperationalError, match="password"):
                psycopg2.connect(**args)
        assert cli.main(["--home", str(home), "db", "start"]) == 0      # idempotent
        assert cli.main(["--home", str(home), "db", "status"]) == 0
    finally:
        cli.main(["--home", str(home), "db", "stop"])
    assert cli.main(["--home", str(home), "db", "status"]) == 3
    shutil.rmtree(base, ignore_errors=True)


def test_stream_apply_list_and_errors(tmp_path, source_conn, make_stream, capsys):
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE items (id int PRIMARY KEY, v text); CREATE TABLE loose (v int)")
    good = make_stream(["public.items"])
    path = _write_stream(tmp_path, good)
    assert cli.main(["--streams", str(path.parent), "stream", "apply", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"publication {good.source.publication} covers public.items" in out
    with source_conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_publication_tables WHERE pubname = %s", (good.source.publication,))
        assert cur.fetchone()[0] == 1
    assert cli.main(["--streams", str(path.parent), "stream", "list"]) == 0
    assert good.stream in capsys.readouterr().out

    bad = make_stream(["public.items", "public.loose"])
    bad_path = _write_stream(tmp_path, bad)
    assert cli.main(["stream", "apply", str(bad_path)]) == 2
    err = capsys.readouterr().err
    assert "source.tables[1]" in err and "no primary key" in err

    assert cli.main(["--streams", str(path.parent), "status", "nope"]) == 2
    assert "no stream named 'nope'" in capsys.readouterr().err


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "tidemark.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("snapshot", "drain", "segments", "status", "consolidate", "read", "gaps", "sweep", "demo"):
        assert command in out.stdout
