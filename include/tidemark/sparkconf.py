"""Spark settings in one place: the session the CLI starts, the settings the DAGs' spark-submit passes,
the library the executors import, and the one-line reason of a Spark failure.

Settings (`resolve_settings`) come from, later ones winning:

1. defaults suited to this machine in local mode (the master ``local[...]`` or unset): an explicit
   ``spark.driver.memory`` of a quarter of the machine's memory (its cgroup limit when lower), at
   least 512 MB and at most 4 GB (`local_driver_memory`) — in local mode the executors are threads of
   the driver's JVM, so this is all the memory Spark has; plus the settings Tidemark always uses
   (UTC session time zone, Arrow, the Python workers reached over Unix domain sockets) and the allocators of the executors' Python workers
   (``spark.executorEnv.*`` of `MEMORY_ENV`);
2. the ``spark_default`` connection's extras whose keys start with ``spark.`` (`connection_extras`:
   Airflow's connection when the plugin registered it, else ``AIRFLOW_CONN_SPARK_DEFAULT`` /
   ``TIDEMARK_CONN_SPARK_DEFAULT`` in JSON or URI form);
3. the stream file's ``consolidate.spark_conf`` mapping;
4. the environment: ``TIDEMARK_SPARK_CONF="spark.driver.memory=6g spark.executor.memory=2g"``
   (and ``PYSPARK_SUBMIT_ARGS``, which Spark itself applies over all of these).

Under spark-submit, a setting given with ``--conf`` on its command line wins over all of them.

``spark.driver.memory`` only takes effect before the driver's JVM starts: `spark_session` passes it
through the session builder, which launches spark-submit (so the JVM starts with it); the
DAGs' `TidemarkSparkSubmitOperator` passes the same settings as ``--conf``.

Memory that follows the configuration, not the number of slices (measured with
``bench_consolidate_memory.py``): left alone, glibc's allocator keeps up to eight arenas per core and
raises its mmap threshold to the largest block freed, and pyarrow's default pool (mimalloc) keeps
what it freed, so each slice's buffers stay in the process and the resident size of the CLI and of
the Python workers grows slice after slice. `MEMORY_ENV` (two glibc arenas, fixed mmap and trim
thresholds, Arrow's buffers from the system allocator so that they are given back) is given to the
executors' Python workers (``spark.executorEnv.*``), to the driver's JVM that `spark_session`
starts (its environment, which its Python workers inherit in local mode) and to this process
(`tune_memory`); a value the user set wins everywhere.

The executors' Python: in local mode it is this interpreter (``PYSPARK_PYTHON``); on a cluster it is
Spark's own ``spark.pyspark.python`` (settings above, or the environment): a node's path, not ours.

The library on a cluster: unless the connection's extras say ``tidemark_installed: true``, the
session ships a zip of the imported ``tidemark`` package (`library_zip`, cached by content hash) to
the executors with ``SparkContext.addPyFile``; the operator passes it as ``--py-files``.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Any, Mapping

CONNECTION = "spark_default"
ENV = "TIDEMARK_SPARK_CONF"
DIST_ENV = "TIDEMARK_DIST_DIR"
INSTALLED_EXTRA = "tidemark_installed"
# the executors talk to their Python workers over Unix domain sockets, not loopback TCP: over TCP each
# Python task waited ~40 ms at its end (a small write held back until the peer's delayed ACK), about a
# tenth of a small batch's consolidation; a node's workers are always on its own host
PYTHON_WORKERS = {"spark.python.unix.domain.socket.enabled": "true"}
ALWAYS = {"spark.sql.session.timeZone": "UTC", "spark.sql.execution.arrow.pyspark.enabled": "true",
          "spark.ui.showConsoleProgress": "false", **PYTHON_WORKERS}
RUNTIME = ("spark.sql.session.timeZone", "spark.sql.execution.arrow.pyspark.enabled")   # settable on a running session
PYTHON_KEYS = ("spark.pyspark.python", "spark.pyspark.driver.python")
# glibc malloc: two arenas (not eight per core), blocks of 1 MiB and more mmapped and given back when
# freed (a fixed threshold: glibc's own rises to the largest block freed), free heap tops beyond 4 MiB
# trimmed; Arrow's buffers from that allocator, not from mimalloc, which keeps what was freed (module doc)
MEMORY_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 20),
              "ARROW_DEFAULT_MEMORY_POOL": "system"}
EXECUTOR_ENV = "spark.executorEnv."

_MASTER: str | None = None     # the master of the last session `spark_session` returned (for `classify`)


# -- settings --------------------------------------------------------------------------------------

def is_local(master: str | None) -> bool:
    """Whether Spark runs in this process's JVM: ``local``, ``local[N]``, ``local[N,F]`` or unset."""
    return not master or master == "local" or master.startswith("local[") or master.startswith("local-cluster[")


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


def connection_extras(conn_id: str = CONNECTION) -> dict[str, Any]:
    """The extras of Spark connection ``conn_id`` (empty when it is not defined)."""
    from tidemark.connections import connection_extras as extras

    return extras(conn_id)


def env_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``TIDEMARK_SPARK_CONF``: ``key=value`` pairs separated by spaces, commas or new lines."""
    from tidemark.errors import ConfigError

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
        try:
            extras = connection_extras()
        except Exception:  # noqa: BLE001 - an unreadable connection has no settings to add
            extras = {}
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


def tune_memory(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Apply `MEMORY_ENV` to this process now, except what ``environ`` (the process's environment)
    sets, the user's value being in force already: glibc's settings through ``mallopt`` (glibc reads
    the environment only when a process starts; nothing without glibc) and pyarrow's default pool.
    Returns what was applied."""
    import ctypes
    import ctypes.util

    env = environ if environ is not None else os.environ
    done = {}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):     # not glibc (macOS, musl without mallopt)
        mallopt = None
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        for name, code in _MALLOPT.items():
            if name not in env and mallopt(code, int(MEMORY_ENV[name])) == 1:
                done[name] = MEMORY_ENV[name]
    if "ARROW_DEFAULT_MEMORY_POOL" not in env:
        import pyarrow as pa

        pa.set_memory_pool(pa.system_memory_pool())
        done["ARROW_DEFAULT_MEMORY_POOL"] = MEMORY_ENV["ARROW_DEFAULT_MEMORY_POOL"]
    return done


def library_installed(extras: Mapping[str, Any] | None = None) -> bool:
    """Whether the connection's extras say the nodes have the tidemark library installed."""
    if extras is None:
        try:
            extras = connection_extras()
        except Exception:  # noqa: BLE001
            extras = {}
    value = extras.get(INSTALLED_EXTRA, False)
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"))


# -- the library for the executors -------------------------------------------------------------------

def _package_dir() -> Path:
    import tidemark

    return Path(tidemark.__file__).resolve().parent


def _library_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix not in (".pyc", ".pyo"))


def dist_dir() -> Path:
    """Where built library zips are kept: ``TIDEMARK_DIST_DIR`` or ``~/.cache/tidemark/dist``."""
    env = os.environ.get(DIST_ENV)
    return Path(env) if env else Path.home() / ".cache" / "tidemark" / "dist"


def library_zip(directory: Path | str | None = None) -> Path:
    """A zip of the imported ``tidemark`` package (what ``--py-files`` / ``addPyFile`` ship), named
    by the hash of its content: built once per version of the code, reused after. Written to a
    temporary file and renamed, so concurrent builders never see half a zip."""
    root = _package_dir()
    files = _library_files(root)
    digest = hashlib.sha256()
    for p in files:
        digest.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    out_dir = Path(directory) if directory is not None else dist_dir()
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
            try:
                old.unlink()
            except OSError:
                pass
    return target


def ship_library(spark, extras: Mapping[str, Any] | None = None) -> Path | None:
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


def spark_session(app: str = "tidemark-consolidate", master: str | None = None, cfg=None):
    """The active SparkSession, or a new one with Tidemark's settings (`resolve_settings`: UTC,
    Arrow, driver memory suited to this machine in local mode, the connection's and the stream
    file's ``spark_conf``, ``TIDEMARK_SPARK_CONF``); on a cluster the library is shipped to the
    executors (`ship_library`).

    With ``TIDEMARK_SPARK_REMOTE`` set (``sc://host:port``), a Spark Connect session to that
    long-running server (`tidemark.local.sparkconnect`): no JVM starts in this process. A JVM that
    starts here uses the class-data-sharing archive when ``tidemark spark-cds`` built it (`cds`)."""
    global _MASTER
    from pyspark.sql import SparkSession

    remote = os.environ.get("TIDEMARK_SPARK_REMOTE")
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    import warnings

    # Tidemark moves data as Arrow (mapInArrow); pandas 3 is only used by PySpark's own checks
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    if remote:
        spark = SparkSession.builder.remote(remote).appName(app).getOrCreate()
        for key in RUNTIME:         # the server's own settings hold the others (`sparkconnect.server_conf`)
            spark.conf.set(key, ALWAYS[key])
        return spark
    submitted = _submitted_conf()
    master = master or submitted.get("spark.master") or os.environ.get("MASTER")
    try:
        extras = connection_extras()
    except Exception:  # noqa: BLE001 - an unreadable connection has no settings to add
        extras = {}
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
    from tidemark.consolidate.cds import jvm_options

    if "spark.driver.defaultJavaOptions" not in submitted:
        builder = builder.config("spark.driver.defaultJavaOptions", jvm_options())   # a JVM that starts here maps Spark's classes
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("TIDEMARK_SPARK_LOG_LEVEL", "ERROR"))
    _MASTER = spark.sparkContext.master
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


# -- failures --------------------------------------------------------------------------------------

LOST_EXECUTOR = "a Spark executor was lost"
UNREACHABLE_MASTER = "the Spark master"
RETRYABLE = (LOST_EXECUTOR, UNREACHABLE_MASTER)     # a node or master may come back; memory does not grow
SPARK_OOM_EXIT = 52     # SparkExitCode.OOM: the JVM's exit code after an uncaught OutOfMemoryError
_MEMORY = ("consolidate.spark_conf in the stream file or the spark_default connection's extras")


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or what can be said without it: a Py4J error's ``str`` asks the JVM for its
    message and fails when the JVM is gone."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - e.g. ConnectionRefusedError from a dead JVM
        return getattr(exc, "errmsg", "") or "(its message is in the JVM, which is gone)"


def _chain_text(exc: BaseException) -> tuple[str, list[BaseException]]:
    seen, chain = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    text = "\n".join(f"{type(e).__name__}: {safe_str(e)}" for e in chain)
    return text, chain


def jvm_exit_code(wait: float = 2.0) -> int | None:
    """The exit code of the driver JVM this process started (None: still running, or not started
    here, e.g. under spark-submit). Spark exits with 52 after an OutOfMemoryError."""
    import time

    try:
        from pyspark import SparkContext

        proc = getattr(SparkContext._gateway, "proc", None)
    except Exception:  # noqa: BLE001 - no pyspark, no gateway
        return None
    if proc is None:
        return None
    deadline = time.monotonic() + wait
    while (rc := proc.poll()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return rc


def _through_py4j(exc: BaseException) -> bool:
    """Whether ``exc`` was raised talking to the JVM (a frame of py4j in its traceback)."""
    tb = exc.__traceback__
    while tb is not None:
        if "py4j" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _local_path(url: str | None) -> bool:
    return bool(url) and ("://" not in url or url.startswith("file://"))


def _under(path: str | None, root: str | None) -> bool:
    """Whether ``path`` lies in the store at ``root`` (a directory, ``file://`` or ``s3://`` URI)."""
    if not path or not root:
        return False
    strip = (lambda p: p[len("file://"):] if p.startswith("file://") else p)
    path, root = strip(path), strip(root).rstrip("/")
    return path == root or path.startswith(root + "/")


def _no_space(exc: BaseException, text: str, chain: list[BaseException], cfg) -> tuple[str, str] | None:
    """A full disk as (reason, fix), or None: a `LakeFull` (raised in the driver, or in a Python worker
    whose failure text carries its facts) names the lake's file and the bytes it needs; the landing
    store's `StoreFull` says its own; any other ENOSPC (an ``OSError: [Errno 28]`` from a Python worker,
    deltalake's ``os error 28``) names the store its path lies in, else the places it may be."""
    from tidemark.errors import LakeFull, NoSpace, describe, lake_full, says_no_space

    if not says_no_space(exc) and lake_full(exc) is None:
        return None
    lake = cfg.lake_path if cfg is not None else None
    landing = cfg.landing.url if cfg is not None else None
    fix = (f"free space on the lake's volume (lake.path {lake}) or move the lake to a larger one" if lake
           else "free space on the lake's volume (or move lake.path to a larger one)")
    facts = lake_full(exc)
    if facts is not None:
        return LakeFull.describe(facts), fix
    own = next((e for e in chain if isinstance(e, NoSpace)), None)
    if own is not None:        # the landing store's StoreFull: its own words
        what, remedy = describe(own)
        return f"{type(own).__name__}: {what}", (remedy or "free space there").split(", then run")[0]
    path = next((e.filename for e in chain if isinstance(e, OSError) and isinstance(e.filename, str)), None)
    said = next((re.sub(r"^(Caused by:|:)\s*", "", ln.strip()) for ln in text.splitlines()
                 if re.search(r"No space left|Disk quota|Errno (28|122)|os error (28|122)", ln, re.I)), "")
    said = said[:200]
    if _under(path, lake) or lake and lake in text:
        return (f"the lake is full: no space left on {lake} ({said})", fix)
    if _under(path, landing) or landing and landing in text:
        return (f"the landing store is full: no space left on {landing} ({said})",
                "free space there or point landing.url elsewhere")
    where = ", ".join(p for p in (f"the lake ({lake})" if lake else "the lake",
                                  f"the landing store ({landing})" if landing else "the landing store",
                                  "Spark's local directory (spark.local.dir)"))
    return (f"a disk is full ({said or 'no space left on device'})",
            f"free space where the consolidation writes: {where}")


def classify(exc: BaseException, cfg=None, master: str | None = None) -> tuple[str, str] | None:
    """A Spark failure as (one-line reason, fix), or None when it is not one this knows: a full disk
    (`_no_space`: the lake, the landing store, Spark's local directory; in the driver or a Python
    worker), out of
    memory in a JVM or in the Python workers (naming the setting to raise), a lost executor or driver JVM, the library or Python
    missing on the executors, a local landing/lake path the executors of a cluster cannot reach."""
    master = master if master is not None else _MASTER
    text, chain = _chain_text(exc)
    full = _no_space(exc, text, chain, cfg)
    if full is not None:
        return full
    local = is_local(master)
    where = "the driver (local mode: the executors run in it)" if local else "the driver or an executor"
    setting = "spark.driver.memory" if local else "spark.executor.memory (or spark.driver.memory)"
    if "java.lang.OutOfMemoryError" in text or "OutOfMemoryError" in text:
        kind = re.search(r"java\.lang\.OutOfMemoryError: ([^\n\r]*)", text)
        what = f" ({kind.group(1).strip()})" if kind and kind.group(1).strip() else ""
        return (f"Spark ran out of memory in {where}: java.lang.OutOfMemoryError{what}",
                f"raise {setting} with {_MEMORY}")
    py_oom = re.search(r"\b(\w*MemoryError)\b(?::[ \t]*([^\n\r]*))?", text)
    if py_oom and ("Python worker" in text or "PythonException" in text or isinstance(exc, MemoryError)):
        # the decoded parts and the merge live in the Python workers: a slice's share per task
        said = (py_oom.group(2) or "").strip()[:160]
        return (f"Spark's Python workers ran out of memory: {py_oom.group(1)}{': ' + said if said else ''}",
                f"raise spark.executor.pyspark.memory (or give the machine more memory), or lower "
                f"consolidate.max_batch_bytes / max_batch_records, with {_MEMORY}")
    dead = any(type(e).__name__ == "Py4JNetworkError" or (isinstance(e, ConnectionError) and _through_py4j(e))
               for e in chain) or "Answer from Java side is empty" in text or "which is gone)" in text \
        or "py4j.reflection does not exist in the JVM" in text     # a call after the JVM died
    if not dead and any(type(e).__module__.split(".")[0] == "py4j" or _through_py4j(e) for e in chain):
        # whatever py4j made of it ("An error occurred while calling z:py4j.reflection…"): the driver
        # JVM this process started has exited
        dead = jvm_exit_code(wait=1.0) is not None
    if dead:
        if jvm_exit_code() == SPARK_OOM_EXIT:
            return (f"Spark ran out of memory in {where}: java.lang.OutOfMemoryError (the driver's JVM exited "
                    f"with code {SPARK_OOM_EXIT})", f"raise spark.driver.memory with {_MEMORY}")
        return ("the Spark driver's JVM died (most often it ran out of memory; the Python side lost its "
                "connection to it)", f"raise spark.driver.memory with {_MEMORY}")
    lost = re.search(r"(ExecutorLostFailure[^\n]*|Lost executor[^\n]*|Executor heartbeat timed out[^\n]*|"
                     r"Python worker exited unexpectedly \(crashed\)[^\n]*)", text)
    if lost:
        return (f"{LOST_EXECUTOR} ({lost.group(1).strip()[:200]}): most often it ran out of memory",
                f"raise spark.executor.memory (and spark.executor.pyspark.memory for its Python) with {_MEMORY}")
    if re.search(r"All masters are unresponsive|Failed to connect to master|Could not connect to spark://", text):
        return (f"{UNREACHABLE_MASTER} {master or '(spark.master)'} is unreachable (the driver could not register with it)",
                "check the spark_default connection's master (host and port) and that the master runs")
    if re.search(r"No module named '?tidemark", text):
        return ("the Spark executors cannot import the tidemark library (ModuleNotFoundError: No module named "
                "'tidemark')", "ship the library: leave the spark_default connection's extra "
                "tidemark_installed unset (Tidemark then ships a zip of it, see `make dist`) or install it on "
                "the nodes")
    missing = re.search(r"Cannot run program \"([^\"]+)\"[^\n]*error=2", text)
    if missing:
        return (f"the Spark executors have no Python at {missing.group(1)}",
                "set spark.pyspark.python to the nodes' Python (consolidate.spark_conf or the spark_default "
                "connection's extras)")
    if cfg is not None and not local and (_local_path(cfg.lake_path) or _local_path(cfg.landing.url)) and (
            any(isinstance(e, FileNotFoundError) for e in chain)
            or re.search(r"No such file or directory|FileNotFoundError|not found|does not exist", text)):
        paths = [p for p in (cfg.landing.url, cfg.lake_path) if _local_path(p)]
        return (f"the Spark executors on {master} cannot reach the local path {', '.join(paths)}",
                "use a shared store (S3) for landing and lake")
    return None


def short_reason(exc: BaseException) -> str:
    """One line for a Spark exception whose text is a JVM or Python stack trace: the JVM's top error
    line (``org.apache.spark.SparkException: Job aborted …``) or the Python worker's last one
    (``ValueError: …``), never the frames."""
    text = safe_str(exc)
    lines = [ln.strip().lstrip(": ").strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) <= 1:
        return " ".join(text.split())
    err = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.$]*(Error|Exception|Failure)\b:?", ln)]
    java = any(ln.startswith("at ") for ln in lines)
    pick = (err[0] if java else err[-1]) if err else lines[0]
    return pick[:500]


def failure_reason(exc: BaseException, cfg=None) -> tuple[str, str | None]:
    """The one-line reason of a consolidation failure, and the fix when it is a Spark failure
    `classify` knows (else None): never a Java or Python stack trace."""
    from tidemark.errors import TidemarkError, one_line, reason_line

    found = classify(exc, cfg)
    if found is not None:
        return found
    # a Py4J dump or a Java/Python stack trace (in any exception's text) becomes its first meaningful
    # line: an executor's own error (ModuleNotFoundError: …), the deepest Java cause, never the frames
    text = safe_str(exc)
    reason = (one_line(text) if isinstance(exc, TidemarkError) else reason_line(text)) or type(exc).__name__
    if not isinstance(exc, TidemarkError):
        reason = f"{type(exc).__name__}: {reason}"
    return reason, None


if __name__ == "__main__":     # `make dist`: build (or find) the library zip and print its path
    print(library_zip())


def default_parallelism(spark) -> int:
    """The session's default parallelism (from the SparkContext; over Spark Connect, from the
    ``spark.default.parallelism`` setting or a ``local[N]`` master, else 2)."""
    import os

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
    import os

    if is_connect(spark):     # the server's executors have the environment the server was started with
        return
    env = spark.sparkContext.environment
    for name in S3_ENV:
        if name in os.environ and name not in env:
            env[name] = os.environ[name]
