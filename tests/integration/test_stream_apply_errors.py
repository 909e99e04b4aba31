"""`tidemark stream apply` on bad connections and an unusable landing store: one line on stderr naming
the stream, the connection id, host:port, what failed and what to do; exit code 2; no Python
traceback. Run as an operator runs it: the command line in a subprocess. Before: a wrong password,
an unreachable host or a malformed port printed a psycopg2 traceback (rc 1), and an unwritable
landing store was found only by the snapshot."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml
from psycopg2.extensions import parse_dsn

from tidemark.local.localpg import free_port


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tidemark.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def _yaml(tmp_path: Path, cfg, **changes) -> Path:
    doc = cfg.as_dict()
    for section, values in changes.items():
        doc[section] = {**doc.get(section, {}), **values}
    path = tmp_path / f"{cfg.stream}-{len(list(tmp_path.glob('*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _one_clear_line(proc: subprocess.CompletedProcess) -> str:
    print(proc.stderr.strip())
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tidemark: error: "), lines[0]
    return lines[0]


@pytest.fixture
def stream(make_stream, source_conn, source_db):
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
    cfg = make_stream(["public.items"])
    return cfg, parse_dsn(source_db)


def _uri(parts: dict, **override) -> str:
    p = {**parts, **override}
    return (f"postgresql://{quote(p['user'], safe='')}:{quote(p['password'], safe='')}@{p['host']}:{p['port']}/"
            f"{quote(p['dbname'], safe='')}")


@pytest.mark.parametrize("fault", ["wrong-password", "unreachable-host", "malformed-port", "unknown-host",
                                   "malformed-json"])
def test_stream_apply_names_a_bad_source_connection(stream, tmp_path, fault):
    cfg, parts = stream
    conn_id = f"bad_{fault.replace('-', '_')}_{cfg.stream}"
    port = free_port()   # nothing listens there
    value = {"wrong-password": _uri(parts, password="not-the-password"),
             "unreachable-host": _uri(parts, port=port),
             "malformed-port": _uri(parts, port="54x32"),
             "unknown-host": _uri(parts, host="no-such-host.invalid"),
             "malformed-json": '{"conn_type": "postgres", "host": '}[fault]
    path = _yaml(tmp_path, cfg, source={"connection": conn_id})
    env = {"AIRFLOW_CONN_" + conn_id.upper(): value}
    line = _one_clear_line(_cli("stream", "apply", str(path), env=env))
    assert conn_id in line, line
    if fault == "malformed-json":
        assert "AIRFLOW_CONN_" + conn_id.upper() in line and "JSON" in line, line
        return
    assert f"stream {cfg.stream}" in line and "cannot connect to the source" in line, line
    host_port = {"wrong-password": f"{parts['host']}:{parts['port']}", "unreachable-host": f"{parts['host']}:{port}",
                 "malformed-port": f"{parts['host']}:54x32", "unknown-host": f"no-such-host.invalid:{parts['port']}"}
    assert host_port[fault] in line, line
    what, todo = {"wrong-password": ("password authentication failed", "fix the login or password"),
                  "unreachable-host": ("Connection refused", "check that PostgreSQL runs at"),
                  "malformed-port": ("54x32", "fix the port"),
                  "unknown-host": ("no-such-host.invalid", "fix the host")}[fault]
    assert what in line and todo in line, line
    assert "not-the-password" not in line and parts["password"] not in line      # never a password


def test_stream_apply_names_a_bad_control_connection(stream, tmp_path, control_dsn):
    cfg, _ = stream
    conn_id = f"badctl_{cfg.stream}"
    path = _yaml(tmp_path, cfg, control={"connection": conn_id})
    env = {"AIRFLOW_CONN_" + conn_id.upper(): _uri(parse_dsn(control_dsn), password="wrong")}
    line = _one_clear_line(_cli("stream", "apply", str(path), env=env))
    assert "cannot connect to the control database" in line and conn_id in line, line
    assert "password authentication failed" in line and "fix the login or password" in line, line
    assert not _publication_exists(stream[1], cfg.source.publication)      # nothing changed in the source


def _publication_exists(parts: dict, name: str) -> bool:
    import psycopg2

    with psycopg2.connect(_uri(parts)) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_publication WHERE pubname = %s", (name,))
        found = cur.fetchone()[0] == 1
    conn.close()
    return found


def test_stream_apply_probes_the_landing_store(stream, tmp_path):
    cfg, _ = stream
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the landing directory's parent should be\n")
    path = _yaml(tmp_path, cfg, landing={"url": str(blocker / "landing")})
    started = time.monotonic()
    line = _one_clear_line(_cli("stream", "apply", str(path)))
    assert f"stream {cfg.stream}" in line and "landing store" in line and str(blocker / "landing") in line, line
    assert "writing a probe object" in line and "fix landing.url" in line, line
    assert time.monotonic() - started < 60
    assert not _publication_exists(stream[1], cfg.source.publication)      # a failed apply changes no source
    # a read-only directory: the same
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() != 0:            # root writes anywhere
        line = _one_clear_line(_cli("stream", "apply", str(_yaml(tmp_path, cfg, landing={"url": str(ro)}))))
        assert "PermissionError" in line and "landing store" in line, line
    # a writable store: the probe leaves nothing behind
    good = _yaml(tmp_path, cfg, landing={"url": str(tmp_path / "landing-ok")})
    proc = _cli("stream", "apply", str(good))
    assert proc.returncode == 0, proc.stderr
    assert [p for p in (tmp_path / "landing-ok").rglob("*") if p.is_file()] == []
    assert _publication_exists(stream[1], cfg.source.publication)


def test_control_connection_times_out_instead_of_hanging(stream, tmp_path):
    """A control database host that accepts TCP but never answers (a dead server behind a live
    port): the connection fails after the connect timeout, with the usual line."""
    cfg, parts = stream
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)              # the kernel completes the handshake; nobody ever answers
    try:
        conn_id = f"silent_{cfg.stream}"
        path = _yaml(tmp_path, cfg, control={"connection": conn_id})
        env = {"AIRFLOW_CONN_" + conn_id.upper(): _uri(parts, port=silent.getsockname()[1])}
        started = time.monotonic()
        try:
            proc = _cli("stream", "apply", str(path), env=env)
        except subprocess.TimeoutExpired:
            pytest.fail("stream apply hung on a control database that never answers (no connect_timeout)")
        line = _one_clear_line(proc)
        assert time.monotonic() - started < 60
        assert "cannot connect to the control database" in line and "timeout" in line.lower(), line
    finally:
        silent.close()


@pytest.mark.parametrize("command", ["drain", "parity"])
def test_a_wrong_source_password_is_named_by_the_drain_and_the_parity_check(stream, tmp_path, command):
    """After a good apply, the source's password changes under the stream: the drain and the parity
    check each say so in one line with the fix (the drain called it a lost connection to run again,
    the parity check printed libpq's error as one it did not know)."""
    cfg, parts = stream
    assert _cli("stream", "apply", str(_yaml(tmp_path, cfg))).returncode == 0
    conn_id = cfg.source.connection
    env = {"AIRFLOW_CONN_" + conn_id.upper(): _uri(parts, password="not-the-password")}
    streams = tmp_path / "streams"
    streams.mkdir()
    (streams / f"{cfg.stream}.yaml").write_text(yaml.safe_dump(cfg.as_dict()))
    snap = _cli("--streams", str(streams), "snapshot", cfg.stream)
    assert snap.returncode == 0, snap.stderr
    line = _one_clear_line(_cli("--streams", str(streams), command, cfg.stream, env=env))
    assert f"stream {cfg.stream}: cannot connect to the source (connection '{conn_id}'" in line, line
    assert "password authentication failed" in line and "fix the login or password" in line, line
    assert "run the drain again" not in line and "not-the-password" not in line, line
