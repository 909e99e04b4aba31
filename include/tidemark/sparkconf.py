"""Spark settings in one place: the session the CLI starts, the settings the DAGs' spark-submit passes,
and the library the executors import (a Spark failure's one-line reason is `tidemark.failures`'). The
manual: docs/configuration.md, "Spark settings and memory"; docs/operations/cluster.md.

Settings (`resolve_settings`) come from, later ones winning: defaults suited to this machine in local
mode (`local_driver_memory`), the settings Tidemark always uses (`ALWAYS`) and the executors' Python
allocators (`MEMORY_ENV`); the ``spark_default`` connection's ``spark.*`` extras (`connection_extras`);
the stream file's ``consolidate.spark_conf``; ``TIDEMARK_SPARK_CONF``. Under spark-submit, its own
``--conf`` wins over all of them. ``spark.driver.memory`` only takes effect before the driver's JVM
starts: `spark_session` passes it through the session builder (which launches spark-submit).

The executors' Python: in local mode this interpreter; on a cluster Spark's own ``spark.pyspark.python``.
The library on a cluster: unless the connection's extras say ``tidemark_installed: true``, a zip of the
imported package (`library_zip`, cached by content hash) is shipped with ``addPyFile`` / ``--py-files``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import sys
import uuid
import warnings
import zipfile
from pathlib import Path
from typing import Any, Mapping

from tidemark.cds import jvm_options
from tidemark.connections import connection_extras as extras
from tidemark.errors import ConfigError
from tidemark.failures import is_local, remember_master

ENV = "TIDEMARK_SPARK_CONF"
# "1": a Spark Connect session (``TIDEMARK_SPARK_REMOTE``) ships the library to the server's executors
SHIP_ENV = "TIDEMARK_SPARK_SHIP"
DIST_ENV = "TIDEMARK_DIST_DIR"
INSTALLED_EXTRA = "tidemark_installed"
# Unix domain sockets between the executors and their Python workers (always on their own host): over
# loopback TCP a delayed ACK held each Python task's end back
ALWAYS = {"spark.sql.session.timeZone": "UTC", "spark.sql.execution.arrow.pyspark.enabled": "true",
          "spark.ui.showConsoleProgress": "false", "spark.python.unix.domain.socket.enabled": "true"}
RUNTIME = ("spark.sql.session.timeZone", "spark.sql.execution.arrow.pyspark.enabled")   # settable on a running session
PYTHON_KEYS = ("spark.pyspark.python", "spark.pyspark.driver.python")
# glibc malloc (two arenas, fixed mmap and trim thresholds) and Arrow's buffers from it, not from mimalloc:
# freed memory is given back (docs/configuration.md, "Spark settings and memory")
MEMORY_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 20),
              "ARROW_DEFAULT_MEMORY_POOL": "system"}
EXECUTOR_ENV = "spark.executorEnv."


# -- settings --------------------------------------------------------------------------------------

def machine_memory_mb() -> int:
    """This machine's memory in MB, or its cgroup's limit when lower (a container)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total // (1024 * 1024)


def local_driver_memory(memory_mb: int | None = None) -> str:
    """The default ``spark.driver.memory`` in local mode: a quarter of the machine, 512 MB to 4 GB."""
    mb = memory_mb if memory_mb is not None else machine_memory_mb()
    return f"{max(512, min(4096, mb // 4))}m"


def connection_extras() -> dict[str, Any]:
    """The extras of the ``spark_default`` connection (empty when it is not defined or not readable)."""
    try:
        return extras("spark_default")
    except Exception:  # noqa: BLE001 - an unreadable connection has no settings to add
        return {}


def env_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``TIDEMARK_SPARK_CONF``: ``key=value`` pairs separated by spaces, commas or new lines."""
    text = (environ if environ is not None else os.environ).get(ENV, "")
    out = {}
    for item in re.split(r"[\s,]+", text.strip()):
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq or not key.startswith("spark.") or not value:
            raise ConfigError(ENV, f"{item!r} is not spark.KEY=VALUE")
        out[key] = value
    return out


def setting_value(value: Any) -> str:
    """A setting as Spark reads it: booleans as ``true``/``false``, numbers as written."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def resolve_settings(cfg=None, *, master: str | None = None, extras: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Spark settings of a consolidation run on ``master`` (see module doc for the order).
    ``extras``: the Spark connection's extras (looked up through `connection_extras` when None)."""
    settings = dict(ALWAYS)
    settings.update({EXECUTOR_ENV + name: value for name, value in MEMORY_ENV.items()})
    if is_local(master):
        settings["spark.driver.memory"] = local_driver_memory()
    if extras is None:
        extras = connection_extras()
    settings.update({k: setting_value(v) for k, v in extras.items() if k.startswith("spark.")})
    if cfg is not None:
        settings.update({k: setting_value(v) for k, v in cfg.consolidate.spark_conf.items()})
    settings.update(env_settings(environ))
    if is_local(master):
        # local mode: the Python workers are this interpreter (a node's path from the connection is not)
        for key in PYTHON_KEYS:
            settings.pop(key, None)
    return settings


_MALLOPT = {"MALLOC_ARENA_MAX": -8, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}   # M_* of malloc.h


def tune_memory() -> dict[str, str]:
    """Apply `MEMORY_ENV` to this process now, except what its environment sets (the user's value
    being in force already): glibc's settings through ``mallopt`` (glibc reads the environment only
    when a process starts; nothing without glibc) and pyarrow's default pool. Returns what was applied."""
    import ctypes
    import ctypes.util

    done = {}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):     # not glibc (macOS, musl without mallopt)
        mallopt = None
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        for name, code in _MALLOPT.items():
            if name not in os.environ and mallopt(code, int(MEMORY_ENV[name])) == 1:
                done[name] = MEMORY_ENV[name]
    if "ARROW_DEFAULT_MEMORY_POOL" not in os.environ:
        import pyarrow as pa

        pa.set_memory_pool(pa.system_memory_pool())
        done["ARROW_DEFAULT_MEMORY_POOL"] = MEMORY_ENV["ARROW_DEFAULT_MEMORY_POOL"]
    return done


def library_installed(extras: Mapping[str, Any]) -> bool:
    """Whether the connection's extras say the nodes have the tidemark library installed."""
    value = extras.get(INSTALLED_EXTRA, False)
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"))


# -- the library for the executors -------------------------------------------------------------------

def library_zip(directory: Path | str | None = None) -> Path:
    """A zip of the imported ``tidemark`` package (what ``--py-files`` / ``addPyFile`` ship), named
    by the hash of its content: built once per version of the code, reused after, in ``directory``
    (default: ``TIDEMARK_DIST_DIR`` or ``~/.cache/tidemark/dist``). Written to a temporary file and
    renamed, so concurrent builders never see half a zip."""
    root = Path(__file__).resolve().parent       # this module is at the package's top
    files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                   and p.suffix not in (".pyc", ".pyo"))
    digest = hashlib.sha256()
    for p in files:
        digest.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    if directory is None:
        directory = os.environ.get(DIST_ENV) or Path.home() / ".cache" / "tidemark" / "dist"
    out_dir = Path(directory)
    target = out_dir / f"tidemark-{digest.hexdigest()[:16]}.zip"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for p in files:
            info = zipfile.ZipInfo(f"tidemark/{p.relative_to(root).as_posix()}", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, p.read_bytes())
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, target)
    for old in out_dir.glob("tidemark-*.zip"):   # earlier versions of the code
        if old != target:
            with contextlib.suppress(OSError):
                old.unlink()
    return target


def ship_library(spark, extras: Mapping[str, Any]) -> Path | None:
    """On a cluster, add the library zip to the session's SparkContext (the executors import it),
    unless it is already among ``spark.submit.pyFiles`` or the nodes have it installed. Returns the
    zip added, or None."""
    if is_connect(spark):
        return None
    sc = spark.sparkContext
    if is_local(sc.master) or library_installed(extras):
        return None
    shipped = sc.getConf().get("spark.submit.pyFiles", "") or ""
    if any(Path(f).name.startswith("tidemark-") and f.endswith(".zip") for f in shipped.split(",") if f):
        return None
    path = library_zip()
    sc.addPyFile(str(path))
    return path


# -- the session -----------------------------------------------------------------------------------

def _submitted_conf() -> dict[str, str]:
    """The settings spark-submit started this driver with (``--conf``, ``--master`` ...), when it
    did (``PYSPARK_GATEWAY_PORT`` is set), else empty."""
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        return {}
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()
    return dict(SparkConf().getAll())


def stream_session_url(remote: str, stream: str) -> str:
    """``remote`` (``sc://host:port[/;params]``) with the session id of ``stream`` (unless it names one):
    the same id for every run of the stream, so that its runs share one session of the server (and
    its warm Python workers: the server keeps a worker daemon per session until it stops)."""
    if "session_id=" in remote:
        return remote
    sid = uuid.UUID(bytes=uuid.uuid5(uuid.NAMESPACE_URL, f"tidemark-stream:{stream}").bytes, version=4)
    return f"{remote};session_id={sid}" if "/;" in remote else f"{remote.rstrip('/')}/;session_id={sid}"


def _connect(url: str, app: str, must: bool = False):
    """A Spark Connect session to ``url`` with Tidemark's runtime settings; None when the session the
    URL names was closed on the server (its id cannot be used again), unless ``must``."""
    from pyspark.sql import SparkSession

    try:
        # (a new session object each time: a failed one stays the builder's default otherwise)
        spark = SparkSession.builder.remote(url).appName(app).create()
        for key in RUNTIME:         # the server's own settings hold the others (`sparkconnect.server_conf`)
            spark.conf.set(key, ALWAYS[key])
    except Exception as exc:
        if must or "SESSION_CLOSED" not in str(exc):
            raise
        return None
    return spark


def spark_session(app: str = "tidemark-consolidate", master: str | None = None, cfg=None):
    """The active SparkSession, or a new one with Tidemark's settings (`resolve_settings`); on a
    cluster the library is shipped to the executors (`ship_library`).

    With ``TIDEMARK_SPARK_REMOTE`` set (``sc://host:port``), a Spark Connect session to that
    long-running server (`tidemark.local.sparkconnect`): no JVM starts in this process; with
    ``TIDEMARK_SPARK_SHIP=1`` the session ships the library's zip to the server's executors. A JVM that
    starts here uses the class-data-sharing archive when ``tidemark spark-cds`` built it (`cds`)."""
    from pyspark.sql import SparkSession

    remote = os.environ.get("TIDEMARK_SPARK_REMOTE")
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    # Tidemark moves data as Arrow (mapInArrow); pandas 3 is only used by PySpark's own checks
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    if remote:
        ship = os.environ.get(SHIP_ENV) == "1"
        # a stream's runs share one session of the server (`stream_session_url`), unless each ships its library
        shared = stream_session_url(remote, cfg.stream) if cfg is not None and not ship else None
        spark = _connect(shared or remote, app)
        if shared and spark is None:
            print(f"tidemark: the stream's Spark Connect session was closed on the server (its idle timeout, "
                  f"spark.connect.session.manager.defaultSessionTimeout?): this run uses a session of its own",
                  file=sys.stderr, flush=True)
            shared, spark = None, None
        spark = spark or _connect(remote, app, must=True)
        spark.release_session_on_close = not shared      # stop() leaves the shared session to the next run
        if ship:
            # the server's executors lack the library (a cluster's endpoint): this session's Python
            # workers get the client's own code, as spark-submit's --py-files gives it
            spark.addArtifacts(str(library_zip()), pyfile=True)
        return spark
    submitted = _submitted_conf()
    master = master or submitted.get("spark.master") or os.environ.get("MASTER")
    extras = connection_extras()
    settings = resolve_settings(cfg, master=master, extras=extras)
    tune_memory()
    if is_local(master):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        for name, value in MEMORY_ENV.items():     # the driver's JVM about to start here inherits them
            os.environ.setdefault(name, value)
    builder = SparkSession.builder
    if "spark.app.name" not in submitted:      # spark-submit's --name wins
        builder = builder.appName(app)
    for key, value in settings.items():
        if key not in submitted:          # spark-submit's own --conf wins
            builder = builder.config(key, value)
    if master and not submitted:
        builder = builder.master(master)

    if "spark.driver.defaultJavaOptions" not in submitted:
        builder = builder.config("spark.driver.defaultJavaOptions", jvm_options())   # a JVM that starts here maps Spark's classes
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("TIDEMARK_SPARK_LOG_LEVEL", "ERROR"))
    remember_master(spark.sparkContext.master)
    ship_library(spark, extras)
    return spark


def is_connect(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session (no SparkContext in this process)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def submit_settings(cfg, master: str, extras: Mapping[str, Any],
                    deploy_mode: str | None = None) -> tuple[dict[str, str], list[str]]:
    """What spark-submit of the consolidation job on ``master`` passes: (``--conf`` settings,
    ``--py-files``). In local mode the Python is this interpreter; on a cluster in client mode the
    driver (this machine) keeps this interpreter while the executors use ``spark.pyspark.python``."""
    conf = resolve_settings(cfg, master=master, extras=extras)
    py_files: list[str] = []
    if is_local(master):
        conf["spark.pyspark.python"] = sys.executable
    else:
        if (deploy_mode or "client") == "client":
            conf.setdefault("spark.pyspark.driver.python", sys.executable)
        if not library_installed(extras):
            py_files.append(str(library_zip()))
    return conf, py_files


if __name__ == "__main__":     # `make dist`: build (or find) the library zip and print its path
    print(library_zip())


def default_parallelism(spark) -> int:
    """The session's default parallelism (from the SparkContext; over Spark Connect, from the
    ``spark.default.parallelism`` setting or a ``local[N]`` master, else 2)."""
    if not is_connect(spark):
        return spark.sparkContext.defaultParallelism
    for key in ("spark.default.parallelism", "spark.master"):
        try:
            value = spark.conf.get(key, None)
        except Exception:  # noqa: BLE001 - a server that does not expose it
            value = None
        if not value:
            continue
        if value.isdigit():
            return int(value)
        if value.startswith("local["):
            n = value[len("local["):].split(",")[0].rstrip("]")
            return (os.cpu_count() or 2) if n == "*" else int(n)
    return 2


S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
          "AWS_ENDPOINT_URL", "TIDEMARK_S3_ENDPOINT_URL")


def propagate_s3_env(spark) -> None:
    """Let Python workers read an S3 landing store with the driver's S3 environment (the AWS_*
    variables boto3 reads), unless the executors' environment already sets them."""
    if is_connect(spark):     # the server's executors have the environment the server was started with
        return
    env = spark.sparkContext.environment
    for name in S3_ENV:
        if name in os.environ and name not in env:
            env[name] = os.environ[name]
