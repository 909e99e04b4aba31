"""The embedded default: Airflow 3 on the local PostgreSQL, started and stopped from the checkout.

`up` starts (or reuses) the local cluster in ``home/pg`` with its databases (`DATABASES`), migrates
Airflow's, and starts the Airflow components (`COMPONENTS`, LocalExecutor) and a Spark Connect server
(`tidemark.local.sparkconnect`; ``TIDEMARK_SPARK_CONNECT=off`` leaves it out), each in its own process
group with its log in ``home/airflow/logs``, then the supervisor (`tidemark.local.supervisor`). A second
`up` starts what is missing. What runs is recorded in ``home/airflow/pids.json``; `down` stops exactly
those processes, the supervisor first. Secrets (the admin password, Airflow's keys) are generated once,
mode 0600, under ``home/airflow``; every connection string handed to Airflow carries the PostgreSQL
superuser's password (``home/pg/pgpass``, `tidemark.local.localpg`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tidemark.errors import TidemarkError
from tidemark.local import sparkconnect
from tidemark.local.processes import alive, process_start, stop_groups
from tidemark.local.localpg import LocalCluster, free_port, replace_private, write_private
from tidemark.parity import parity_report  # noqa: F401 - the demo's and the DAG tests' comparison
from tidemark.sparkconf import MEMORY_ENV, resolve_settings

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
SPARK_CONNECT = "spark-connect"     # the Spark Connect server: a component when `up` gave it a port
SUPERVISOR = "supervisor"      # its pid is recorded with the components'
DATABASES = {"source": "demo", "control": "tidemark", "airflow": "airflow"}
USERNAME = "admin"
CHECKOUT = Path(__file__).resolve().parents[3]  # include/tidemark/local/embedded.py -> the checkout


# -- paths and environment --------------------------------------------------------------------------

def airflow_home(home: Path) -> Path:
    return Path(home).resolve() / "airflow"


def cluster_for(home: Path) -> LocalCluster:
    return LocalCluster(Path(home) / "pg")


def _secret_file(path: Path, make) -> str:
    """Read a generated secret, creating it (mode 0600) on first use."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, make())
    return path.read_text()


def admin_password(home: Path) -> str:
    """The admin password of the embedded Airflow (generated once, kept in the passwords file)."""
    path = airflow_home(home) / "passwords.json"
    doc = json.loads(_secret_file(path, lambda: json.dumps({USERNAME: secrets.token_urlsafe(12)})))
    return doc[USERNAME]


def components(info: dict[str, Any]) -> tuple[str, ...]:
    """The supervised components of what `up` recorded: Airflow's, and the Spark Connect server when
    it has a port."""
    return (*COMPONENTS, SPARK_CONNECT) if info.get("spark_connect_port") else COMPONENTS


def spark_connect_wanted() -> bool:
    return os.environ.get("TIDEMARK_SPARK_CONNECT", "on").strip().lower() not in ("off", "0", "false", "no")


def spark_connect_command(port: int) -> list[str]:
    """The embedded Spark Connect server: local mode on every core, with the driver memory and the
    Python allocators' settings a local spark-submit gets (`tidemark.sparkconf.resolve_settings`), so
    its memory stays bounded by the same configuration (``TIDEMARK_SPARK_CONF``, the machine's size)."""
    conf = {k: v for k, v in resolve_settings(None, master="local[*]", extras={}).items() if k != "spark.master"}
    # Spark's console output at WARN, as the spark-submitted jobs': at INFO a server that lives for days
    # logs lines for every session access
    log4j = CHECKOUT / "plugins" / "tidemark_airflow" / "spark-log4j2.properties"
    conf["spark.driver.extraJavaOptions"] = f"-Dlog4j2.configurationFile=file:{log4j} -Dtidemark.spark.level=WARN"
    return sparkconnect.server_command(port, master="local[*]", conf=conf)


def airflow_env(home: Path, cluster: LocalCluster, *, port: int, unpause: bool = True,
                connect_port: int | None = None) -> dict[str, str]:
    """The environment of every embedded Airflow process (connections as ``AIRFLOW_CONN_*``; with
    ``connect_port``, ``spark_connect_default`` names the embedded Spark Connect server)."""
    home = Path(home).resolve()
    ahome = airflow_home(home)
    jwt = _secret_file(ahome / "jwt_secret", lambda: secrets.token_urlsafe(32))
    api_key = _secret_file(ahome / "api_secret_key", lambda: secrets.token_urlsafe(32))
    admin_password(home)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    env.update({
        "AIRFLOW_HOME": str(ahome),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": cluster.sqlalchemy_url(DATABASES["airflow"]),
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(CHECKOUT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(CHECKOUT / "plugins"),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False" if unpause else "True",
        "AIRFLOW__CORE__AUTH_MANAGER":
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USERNAME}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(ahome / "passwords.json"),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__API__SECRET_KEY": api_key,
        "AIRFLOW__API_AUTH__JWT_SECRET": jwt,
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(ahome / "logs" / "tasks"),
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        "AIRFLOW_CONN_TIDEMARK_SOURCE": cluster.uri(DATABASES["source"]),
        "AIRFLOW_CONN_TIDEMARK_CONTROL": cluster.uri(DATABASES["control"]),
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[*]"}),
        **({"AIRFLOW_CONN_SPARK_CONNECT_DEFAULT": json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1",
                                                              "port": connect_port,
                                                              "extra": {"tidemark_installed": True}})} if connect_port else {}),
        "TIDEMARK_HOME": str(home),
        "TIDEMARK_STREAMS_DIR": str(Path(os.environ.get("TIDEMARK_STREAMS_DIR") or CHECKOUT / "include" / "streams")),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
    })
    return env


# -- lifecycle ---------------------------------------------------------------------------------------

def prepare(home: Path, cluster: LocalCluster | None = None) -> LocalCluster:
    """Start the local cluster (or use a running ``cluster``) and create the source, control and
    Airflow databases (idempotent)."""
    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    cluster = cluster or cluster_for(home).start()
    for db in DATABASES.values():
        cluster.ensure_database(db)
    # deferred: tidemark.control imports psycopg2, which `import tidemark.local.embedded` does not load
    from tidemark.control import Control

    with Control(cluster.dsn(DATABASES["control"])) as ctl:
        ctl.migrate()
    return cluster


def cli_env(home: Path) -> dict[str, str]:
    """The environment for running the ``airflow`` command line against the embedded Airflow."""
    cluster = prepare(home)
    info = read_info(home)
    env = airflow_env(home, cluster, port=info.get("port", 8080), connect_port=info.get("spark_connect_port"))
    migrate_airflow(env)  # idempotent; a headless demo never created Airflow's tables
    return env


def migrate_airflow(env: dict[str, str]) -> None:
    """Create or upgrade Airflow's metadata database."""
    proc = subprocess.run([airflow_bin(), "db", "migrate"], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise TidemarkError(f"airflow db migrate failed ({proc.returncode}): {proc.stderr[-2000:]}")


def airflow_bin() -> str:
    path = Path(sys.executable).parent / "airflow"
    if not path.exists():
        raise TidemarkError(f"the airflow command is not installed next to {sys.executable}; run: make setup")
    return str(path)


def _pidfile(home: Path) -> Path:
    return airflow_home(home) / "pids.json"


def read_info(home: Path) -> dict[str, Any]:
    """What `up` recorded (``pids``, each one's ``starts``, the port, the cluster, ...), or {}."""
    try:
        return json.loads(_pidfile(home).read_text())
    except FileNotFoundError:
        return {}


@contextlib.contextmanager
def _info_lock(home: Path):
    """Serialise the read-modify-writes of ``pids.json`` (`up`, `down` and the supervisor)."""
    path = airflow_home(home) / "pids.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_info(home: Path, info: dict[str, Any]) -> None:
    """Replace ``pids.json`` atomically (mode 0600: it holds the environment's extra variables)."""
    replace_private(_pidfile(home), json.dumps(info, indent=1))


def record_process(home: Path, name: str, pid: int, *, only_if: int | None = None) -> bool:
    """Record ``pid`` (and its start time) as component ``name``; False (nothing written) when nothing
    is recorded any more (`down` ran) or, with ``only_if``, when another pid than it is recorded."""
    with _info_lock(home):
        info = read_info(home)
        if not info or (only_if is not None and info["pids"].get(name) not in (None, only_if)):
            return False
        info["pids"][name] = pid
        info.setdefault("starts", {})[name] = process_start(pid)
        _write_info(home, info)
    return True


def running(home: Path) -> dict[str, int]:
    """The recorded processes (the Airflow components and the supervisor) still alive, by name."""
    info = read_info(home)
    starts = info.get("starts", {})
    return {name: pid for name, pid in info.get("pids", {}).items() if alive(pid, starts.get(name))}


def _spawn(home: Path, cmd: list[str], env: dict[str, str], name: str) -> subprocess.Popen:
    """Start ``cmd`` in its own session (process group), its output appended to ``logs/NAME.log``."""
    logs = airflow_home(home) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.log", "ab") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(airflow_home(home)))


def start_component(home: Path, name: str, env: dict[str, str]) -> subprocess.Popen:
    """Start component ``name`` (an Airflow component, or `SPARK_CONNECT` on the recorded port) in its
    own session (process group), its output appended to its log."""
    if name == SPARK_CONNECT:
        return _spawn(home, spark_connect_command(read_info(home)["spark_connect_port"]),
                      {**MEMORY_ENV, **sparkconnect.server_env(env)}, name)
    return _spawn(home, [airflow_bin(), name], env, name)


def start_supervisor(home: Path, env: dict[str, str], *, timeout: float = 60.0) -> int:
    """Start the supervisor (`tidemark.local.supervisor`) with the components' environment; return its
    pid once it has recorded itself."""
    proc = _spawn(home, [sys.executable, "-m", "tidemark.local.supervisor", str(airflow_home(home).parent)],
                  env, SUPERVISOR)
    deadline = time.monotonic() + timeout
    while read_info(home).get("pids", {}).get(SUPERVISOR) != proc.pid:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise TidemarkError(f"the embedded Airflow's supervisor did not start (exit {proc.poll()}); see "
                                f"{airflow_home(home) / 'logs' / 'supervisor.log'}")
        time.sleep(0.1)
    return proc.pid


def up(home: Path, *, port: int | None = None, unpause: bool = True, timeout: float = 240.0,
       cluster: LocalCluster | None = None, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start the local PostgreSQL and Airflow (four components and their supervisor); return the UI
    address and login. When some of what was recorded still runs, start only what is missing
    (`_resume`). ``cluster``: run on this running cluster instead of ``home/pg`` (the tests' cluster);
    ``extra_env``: added to every component's environment."""
    home = Path(home).resolve()
    if running(home):
        return _resume(home, timeout)
    if _pidfile(home).exists():     # all of it died: what is left in its process groups goes too
        down(home)
    cluster = prepare(home, cluster)
    port = port or (8080 if _port_free(8080) else free_port())
    connect_port = free_port() if spark_connect_wanted() else None
    env = {**airflow_env(home, cluster, port=port, unpause=unpause, connect_port=connect_port), **(extra_env or {})}
    migrate_airflow(env)
    with _info_lock(home):      # start_component reads the Spark Connect server's port from here
        _write_info(home, {"pids": {}, "spark_connect_port": connect_port})
    pids = {name: start_component(home, name, env).pid for name in components({"spark_connect_port": connect_port})}
    url = f"http://127.0.0.1:{port}"
    info = {"ui_url": url, "api_url": f"{url}/api/v2", "username": USERNAME, "pids": pids, "port": port,
            "spark_connect_port": connect_port,
            "spark_connect_url": sparkconnect.url(connect_port) if connect_port else None,
            "starts": {name: process_start(pid) for name, pid in pids.items()},
            "airflow_home": str(airflow_home(home)), "logs": str(airflow_home(home) / "logs"),
            "password_file": str(airflow_home(home) / "passwords.json"),
            # what a later `up` needs to start a supervisor with the same environment
            "cluster": str(cluster.home), "unpause": unpause, "extra_env": extra_env or {}}
    with _info_lock(home):
        _write_info(home, info)
    try:
        # the api-server answering is what `up` waits for; a Spark Connect server still starting (or
        # failing) only means spark-submit meanwhile, and the supervisor restarts it
        _wait_http(f"{url}/api/v2/version", timeout, {n: p for n, p in pids.items() if n != SPARK_CONNECT})
        start_supervisor(home, env)
    except BaseException:
        down(home)
        raise
    return {**read_info(home), "password": admin_password(home)}


def _resume(home: Path, timeout: float) -> dict[str, Any]:
    """Some recorded process runs: start what is missing. A dead supervisor is started again (with the
    recorded environment); a live one is told (SIGHUP) to restart the dead components now, whatever
    its backoff. Return once every component runs and the API answers."""
    info = read_info(home)
    alive_now = running(home)
    if SUPERVISOR in alive_now:
        os.kill(alive_now[SUPERVISOR], signal.SIGHUP)
    else:
        cluster = LocalCluster(Path(info["cluster"])) if info.get("cluster") else cluster_for(home)
        cluster.start()     # a running cluster is left as it is
        env = {**airflow_env(home, cluster, port=info["port"], unpause=info.get("unpause", True),
                             connect_port=info.get("spark_connect_port")), **info.get("extra_env", {})}
        start_supervisor(home, env)
    url = f"{info['ui_url']}/api/v2/version"
    deadline = time.monotonic() + timeout
    while True:
        missing = [n for n in (*components(info), SUPERVISOR) if n not in running(home)]
        if not missing and _answers(url):
            break
        if time.monotonic() > deadline:
            raise TidemarkError(f"the embedded Airflow did not come back within {timeout:.0f}s: "
                                f"{', '.join(missing) or 'the api-server does not answer'}; see the logs in "
                                f"{airflow_home(home) / 'logs'} (supervisor.log says what it restarted)")
        time.sleep(1.0)
    return {**read_info(home), "password": admin_password(home)}


def down(home: Path, *, timeout: float = 30.0) -> list[str]:
    """Stop what `up` started: the supervisor first (so that it restarts nothing), then the Airflow
    components (their process groups); return their names."""
    path = _pidfile(home)
    if not path.exists():
        return []
    supervisor = read_info(home).get("pids", {}).get(SUPERVISOR)
    if supervisor is not None:
        stop_groups(supervisor)
    pids = read_info(home).get("pids", {})     # as the supervisor left it
    stop_groups(*pids.values(), timeout=timeout)
    for pid in leftovers(home):  # e.g. a task process that left the group: ours by its AIRFLOW_HOME
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with _info_lock(home):
        path.unlink(missing_ok=True)
    return sorted(pids)


def leftovers(home: Path) -> list[int]:
    """Processes still running with this embedded default's AIRFLOW_HOME in their environment."""
    marker = f"AIRFLOW_HOME={airflow_home(home)}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _wait_http(url: str, timeout: float, pids: dict[str, int]) -> None:
    """Wait until ``url`` answers 200, failing early if a component died."""
    deadline = time.monotonic() + timeout
    while True:
        if _answers(url):
            return
        dead = [name for name, pid in pids.items() if not alive(pid)]
        if dead:
            raise TidemarkError(f"airflow {', '.join(dead)} exited during start-up; see the logs")
        if time.monotonic() > deadline:
            raise TidemarkError(f"airflow api-server did not answer {url} within {timeout:.0f}s")
        time.sleep(1.0)
