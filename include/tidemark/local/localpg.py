"""Start and stop local PostgreSQL clusters with logical replication, for the demo and the tests.

`initdb` and the server refuse to run as root, so when we are root every PostgreSQL binary runs as
the ``postgres`` OS user (``runuser``), and the cluster's directory is handed to that user.

Authentication: superuser ``postgres`` needs a password (``scram-sha-256`` on TCP 127.0.0.1 and on
the Unix socket, for normal and replication connections; no ``trust``). The password is generated
at the first start and kept in ``home/pgpass`` (mode 0600, libpq's password-file format, so
``PGPASSFILE=home/pgpass psql -h 127.0.0.1 -p PORT -U postgres`` works); `dsn`, `uri`,
`sqlalchemy_url` and `libpq_env` carry it. A cluster created before this (``trust``) gets a
password and the strict ``pg_hba.conf`` at its next `start`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

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
    on_path = shutil.which("pg_ctl")
    candidates = [os.environ.get("TIDEMARK_PG_BIN"), *PG_BIN_CANDIDATES, on_path and str(Path(on_path).parent)]
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


HBA_CONF = """# written by tidemark: every connection authenticates with a password (scram-sha-256)
# TYPE  DATABASE     USER  ADDRESS        METHOD
local   all          all                  scram-sha-256
host    all          all   127.0.0.1/32   scram-sha-256
host    all          all   ::1/128        scram-sha-256
local   replication  all                  scram-sha-256
host    replication  all   127.0.0.1/32   scram-sha-256
host    replication  all   ::1/128        scram-sha-256
"""
SUPERUSER = "postgres"


def write_private(path: Path, text: str) -> None:
    """Create ``path`` with mode 0600 (refusing to overwrite) and write ``text``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def replace_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically with a file of mode 0600 holding ``text``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    write_private(tmp, text)
    os.replace(tmp, path)


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
        self.pgpass = self.home / "pgpass"
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
        password = self._password(create=True)
        # initdb reads the password from a file; it runs as the postgres user, so hand it a private copy
        pwfile = self.home / f".initdb-pw-{os.getpid()}"
        write_private(pwfile, password + "\n")
        try:
            self._chown(pwfile)
            self._run([str(bindir / "initdb"), "-D", str(self.datadir), "-U", SUPERUSER, "--auth=scram-sha-256",
                       f"--pwfile={pwfile}", "-E", "UTF8", "--locale=C.UTF-8", "--no-instructions"])
        finally:
            pwfile.unlink(missing_ok=True)
        self._write_hba()
        settings = {**DEFAULT_SETTINGS, **(self.settings or {}), "unix_socket_directories": f"'{self.datadir}'"}
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
            if not self.pgpass.exists():
                self._require_password()
            return self
        if self.port is None:
            self.port = free_port()
        self.portfile.write_text(str(self.port))
        self.logfile.touch()
        self._chown(self.logfile)
        self._run([str(pg_bin_dir() / "pg_ctl"), "-D", str(self.datadir), "-l", str(self.logfile),
                   "-o", f"-p {self.port}", "-w", "-t", "60", "start"])
        if not self.pgpass.exists():
            self._require_password()
        self._wait_ready()
        return self

    # -- authentication ------------------------------------------------------------------------
    def _password(self, *, create: bool = False) -> str:
        """The superuser's password from ``pgpass`` (generated there, mode 0600, when ``create``)."""
        if not self.pgpass.exists():
            if not create:
                raise TidemarkError(f"{self.pgpass} is missing: the cluster in {self.home} has no password file; "
                                    "start it once with tidemark (tidemark db start) to create one")
            self.home.mkdir(parents=True, exist_ok=True)
            write_private(self.pgpass, f"*:*:*:{SUPERUSER}:{secrets.token_urlsafe(24)}\n")
        mode = self.pgpass.stat().st_mode & 0o777
        if mode & 0o077:
            raise TidemarkError(f"{self.pgpass} is readable by others (mode {mode:o}); run: chmod 600 {self.pgpass}")
        for line in self.pgpass.read_text().splitlines():
            fields = line.split(":")
            if len(fields) == 5 and fields[3] == SUPERUSER:
                return fields[4]
        raise TidemarkError(f"{self.pgpass} has no line for user {SUPERUSER}")

    @property
    def password(self) -> str:
        return self._password()

    def _write_hba(self) -> None:
        hba = self.datadir / "pg_hba.conf"
        hba.write_text(HBA_CONF)
        self._chown(hba)
        os.chmod(hba, 0o600)

    def _require_password(self) -> None:
        """Give a cluster made with ``trust`` (before passwords) a password and the strict pg_hba.conf."""
        import psycopg2

        password = self._password(create=True)
        with closing(psycopg2.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, dbname="postgres",
                                      password=password)) as conn:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute("SET password_encryption = 'scram-sha-256'")
                cur.execute("ALTER ROLE postgres PASSWORD %s", (password,))
            self._write_hba()
            with conn.cursor() as cur:
                cur.execute("SELECT pg_reload_conf()")

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
    def _port(self) -> int:
        if self.port is None:
            raise TidemarkError(f"cluster in {self.home} has no port yet; start it first")
        return self.port

    def dsn(self, dbname: str = "postgres") -> str:
        """A libpq key=value DSN for ``dbname`` as the superuser (with the password)."""
        from psycopg2.extensions import make_dsn

        return make_dsn(host="127.0.0.1", port=self._port(), user=SUPERUSER, password=self.password, dbname=dbname)

    def uri(self, dbname: str = "postgres", *, scheme: str = "postgresql") -> str:
        """A ``postgresql://`` URI for ``dbname`` as the superuser (with the password)."""
        return (f"{scheme}://{SUPERUSER}:{quote(self.password, safe='')}@127.0.0.1:{self._port()}/"
                f"{quote(dbname, safe='')}")

    def sqlalchemy_url(self, dbname: str) -> str:
        """The URL SQLAlchemy (Airflow's metadata database) takes for ``dbname``."""
        return self.uri(dbname, scheme="postgresql+psycopg2")

    def libpq_env(self) -> dict[str, str]:
        """Environment for libpq programs (psql, pgbench, pg_recvlogical): host, port, user, password file."""
        return {"PGHOST": "127.0.0.1", "PGPORT": str(self._port()), "PGUSER": SUPERUSER,
                "PGPASSFILE": str(self.pgpass)}

    def ensure_database(self, name: str) -> str:
        """Create database ``name`` if missing; return its DSN."""
        import psycopg2
        from psycopg2 import sql

        with closing(psycopg2.connect(self.dsn("postgres"))) as conn:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cur.fetchone() is None:
                    cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.dsn(name)
