"""Start and stop local PostgreSQL clusters with logical replication, for the demo and the tests.

`initdb` and the server refuse to run as root, so when we are root every PostgreSQL binary runs as
the ``postgres`` OS user (``runuser``), and the cluster's directory is handed to that user.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tidemark.errors import TidemarkError

PG_BIN_CANDIDATES = ("/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/17/bin")

DEFAULT_SETTINGS = {
    "wal_level": "logical",
    "max_wal_senders": "20",
    "max_replication_slots": "20",
    "max_connections": "200",
    "shared_buffers": "256MB",
    "listen_addresses": "'127.0.0.1'",
    "timezone": "'UTC'",
    "log_min_messages": "warning",
    "wal_sender_timeout": "0",
}


def pg_bin_dir() -> Path:
    """Return the directory of the PostgreSQL server binaries (``TIDEMARK_PG_BIN`` overrides)."""
    env = os.environ.get("TIDEMARK_PG_BIN")
    candidates = [env] if env else []
    candidates += list(PG_BIN_CANDIDATES)
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(str(Path(on_path).parent))
    for cand in candidates:
        if cand and (Path(cand) / "pg_ctl").exists():
            return Path(cand)
    raise TidemarkError(f"PostgreSQL server binaries not found (looked in {', '.join(c for c in candidates if c)}); "
                        "set TIDEMARK_PG_BIN")


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(cmd: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


@dataclass
class LocalCluster:
    """A PostgreSQL cluster in ``home`` (data in ``home/data``, log in ``home/postgres.log``)."""

    home: Path
    port: int | None = None
    settings: dict[str, str] | None = None

    def __post_init__(self) -> None:
        self.home = Path(self.home).resolve()
        self.datadir = self.home / "data"
        self.logfile = self.home / "postgres.log"
        self.portfile = self.home / "port"
        if self.port is None and self.portfile.exists():
            self.port = int(self.portfile.read_text().strip())

    # -- lifecycle ---------------------------------------------------------------------------
    def _run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run(_as_postgres(cmd), capture_output=True, text=True, **kw)
        if proc.returncode != 0:
            raise TidemarkError(f"{' '.join(cmd[:2])} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
                                + (f"\nsee {self.logfile}" if self.logfile.exists() else ""))
        return proc

    def _chown(self, path: Path) -> None:
        if os.geteuid() == 0:
            shutil.chown(path, "postgres", "postgres")

    def initialized(self) -> bool:
        return (self.datadir / "PG_VERSION").exists()

    def init(self) -> None:
        """Create the cluster if it does not exist yet (idempotent)."""
        if self.initialized():
            return
        self.home.mkdir(parents=True, exist_ok=True)
        self._chown(self.home)
        # postgres must be able to reach the directory through every parent
        for parent in self.home.parents:
            if os.geteuid() == 0 and parent.stat().st_mode & 0o001 == 0:
                raise TidemarkError(f"{parent} is not searchable by the postgres user; choose another TIDEMARK_HOME")
        bindir = pg_bin_dir()
        self._run([str(bindir / "initdb"), "-D", str(self.datadir), "-U", "postgres", "--auth=trust",
                   "-E", "UTF8", "--locale=C.UTF-8", "--no-instructions"])
        settings = dict(DEFAULT_SETTINGS)
        settings.update(self.settings or {})
        settings["unix_socket_directories"] = f"'{self.datadir}'"
        conf = "\n# tidemark\n" + "".join(f"{k} = {v}\n" for k, v in settings.items())
        with open(self.datadir / "postgresql.conf", "a") as fh:
            fh.write(conf)

    def running(self) -> bool:
        if not self.initialized():
            return False
        proc = subprocess.run(_as_postgres([str(pg_bin_dir() / "pg_ctl"), "-D", str(self.datadir), "status"]),
                              capture_output=True, text=True)
        return proc.returncode == 0

    def start(self) -> "LocalCluster":
        """Initialise if needed and start on a free port; a running cluster is left as it is."""
        self.init()
        if self.running():
            return self
        if self.port is None:
            self.port = free_port()
        self.portfile.write_text(str(self.port))
        if not self.logfile.exists():
            self.logfile.touch()
        self._chown(self.logfile)
        self._run([str(pg_bin_dir() / "pg_ctl"), "-D", str(self.datadir), "-l", str(self.logfile),
                   "-o", f"-p {self.port}", "-w", "-t", "60", "start"])
        self._wait_ready()
        return self

    def _wait_ready(self, timeout: float = 30.0) -> None:
        import psycopg2

        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg2.connect(self.dsn("postgres")).close()
                return
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        """Stop the server (fast shutdown); a stopped cluster is left as it is."""
        if self.running():
            self._run([str(pg_bin_dir() / "pg_ctl"), "-D", str(self.datadir), "-m", "fast", "-w", "stop"])

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.home, ignore_errors=True)

    # -- access -------------------------------------------------------------------------------
    def dsn(self, dbname: str = "postgres") -> str:
        if self.port is None:
            raise TidemarkError(f"cluster in {self.home} has no port yet; start it first")
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    def uri(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def ensure_database(self, name: str) -> str:
        """Create database ``name`` if missing; return its DSN."""
        import psycopg2
        from psycopg2 import sql

        conn = psycopg2.connect(self.dsn("postgres"))
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cur.fetchone() is None:
                    cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        finally:
            conn.close()
        return self.dsn(name)
