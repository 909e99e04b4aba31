"""What a failure means: whether a retry can mend it (`is_transient`, `failure_class`), and a Spark
failure in one line with its fix (`classify`, `failure_reason`: a full disk, out of memory in a JVM or
in the Python workers, a lost executor or driver, the library or Python missing on the executors, a
local path a cluster cannot reach). The exceptions themselves and their facts are `tidemark.errors`'s;
this module sits just above it and below everything that retries or reports (the stores, the control
database, the drain, the consolidation, the operators), so it imports nothing else of Tidemark's.
"""

from __future__ import annotations

import json
import os
import re
import time

from tidemark.errors import (DrainStalled, LakeFull, NoSpace, StreamBusy, TidemarkError, TransientError, describe,
                             exception_chain, facts_behind, one_line, permanent_connect_failure, reason_line,
                             safe_str, says_no_space)

_MASTER: str | None = None     # the master of the last session `sparkconf.spark_session` returned (for `classify`)


def remember_master(master: str | None) -> None:
    """Record the master of the session `sparkconf.spark_session` just made: `classify` names it."""
    global _MASTER
    _MASTER = master


def is_local(master: str | None) -> bool:
    """Whether Spark runs in this process's JVM: ``local``, ``local[N]``, ``local[N,F]`` or unset."""
    return not master or master == "local" or master.startswith("local[") or master.startswith("local-cluster[")


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same call later can succeed: a lost or refused connection, a timeout,
    another process holding the stream's lock (or a lost lease), a stalled walsender. Everything
    Tidemark raises on purpose otherwise (bad configuration, a bad segment, a state conflict such as a
    second initial snapshot), a full disk (`says_no_space`) and programming errors (ValueError,
    TypeError, KeyError) are deterministic: the same input fails the same way. An error caused by a
    transient one (``raise … from``) is transient, except a Spark failure that the same settings repeat
    (`classify`: out of memory, a dead driver JVM, the library or Python missing on the executors; a
    lost executor or an unreachable master is transient). Unknown errors count as transient (a retry
    is the safe default)."""
    try:
        import psycopg2

        lost = (psycopg2.OperationalError, psycopg2.InterfaceError)
    except ImportError:  # pragma: no cover - psycopg2 is a dependency
        lost = ()

    if says_no_space(exc):      # a full disk stays full until someone frees space
        return False
    spark = classify(exc)
    if spark is not None and not spark[0].startswith(RETRYABLE):
        return False
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (StreamBusy, DrainStalled, TransientError)):   # LeaseLost is a StreamBusy
            return not (isinstance(exc, TransientError) and permanent_connect_failure(safe_str(exc)))
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        if lost and isinstance(exc, lost) or type(exc).__name__ in ("OperationalError", "InterfaceError") \
                and type(exc).__module__.split(".")[0] in ("psycopg", "psycopg2"):
            # a connection error: a refused or lost one comes back, a wrong password does not
            return not permanent_connect_failure(safe_str(exc))
        cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if cause is None:
            return not isinstance(exc, (TidemarkError, ValueError, TypeError, KeyError, AttributeError,
                                        NotImplementedError))
        exc = cause
    return False


def failure_class(exc: BaseException) -> str:
    """``"transient"`` (retry) or ``"deterministic"`` (do not) for a failure (`is_transient`): what
    a job reports to the task that started it (`jobs/consolidate.py` writes it in its result file)."""
    return "transient" if is_transient(exc) else "deterministic"


# -- Spark's failures --------------------------------------------------------------------------------------

LOST_EXECUTOR = "a Spark executor was lost"
UNREACHABLE_MASTER = "the Spark master"
RETRYABLE = (LOST_EXECUTOR, UNREACHABLE_MASTER)     # a node or master may come back; memory does not grow
SPARK_OOM_EXIT = 52     # SparkExitCode.OOM: the JVM's exit code after an uncaught OutOfMemoryError
_MEMORY = ("consolidate.spark_conf in the stream file or the spark_default connection's extras")


def jvm_exit_code(wait: float = 2.0) -> int | None:
    """The exit code of the driver JVM this process started (None: still running, or not started
    here, e.g. under spark-submit). Spark exits with 52 after an OutOfMemoryError."""
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
    facts = facts_behind(exc, LakeFull)
    if not says_no_space(exc) and facts is None:
        return None
    lake = cfg.lake_path if cfg is not None else None
    landing = cfg.landing.url if cfg is not None else None
    fix = (f"free space on the lake's volume (lake.path {lake}) or move the lake to a larger one" if lake
           else "free space on the lake's volume (or move lake.path to a larger one)")
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
    (`_no_space`), out of memory in a JVM or in the Python workers (naming the setting to raise), a
    lost executor or driver JVM, the library or Python missing on the executors, a local landing/lake
    path the executors of a cluster cannot reach."""
    master = master if master is not None else _MASTER
    chain = exception_chain(exc)
    text = "\n".join(f"{type(e).__name__}: {safe_str(e)}" for e in chain)
    full = _no_space(exc, text, chain, cfg)
    if full is not None:
        return full
    local = is_local(master)
    where = "the driver (local mode: the executors run in it)" if local else "the driver or an executor"
    setting = "spark.driver.memory" if local else "spark.executor.memory (or spark.driver.memory)"
    if "OutOfMemoryError" in text:
        kind = re.search(r"java\.lang\.OutOfMemoryError: ([^\n\r]*)", text)
        what = f" ({kind.group(1).strip()})" if kind and kind.group(1).strip() else ""
        return (f"Spark ran out of memory in {where}: java.lang.OutOfMemoryError{what}",
                f"raise {setting} with {_MEMORY}")
    in_python = "Python worker" in text or "PythonException" in text
    py_oom = re.search(r"\b(\w*MemoryError)\b(?::[ \t]*([^\n\r]*))?", text)
    # a worker at its address-space limit that loads a C extension late: dlopen's mmap fails (ENOMEM)
    unmapped = re.search(r"([^/\s:]+\.so[\w.]*): failed to map segment from shared object", text)
    if py_oom and (in_python or isinstance(exc, MemoryError)) or unmapped and in_python:
        # the decoded parts and the merge live in the Python workers: a slice's share per task
        said = f"ImportError: {unmapped.group(1)} failed to map segment from shared object" if not py_oom \
            else py_oom.group(1) + (f": {py_oom.group(2).strip()[:160]}" if (py_oom.group(2) or "").strip() else "")
        return (f"Spark's Python workers ran out of memory: {said}",
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
                "'tidemark')", "ship the library: leave the extra tidemark_installed of the spark_default "
                "connection (spark-submit) or of the spark_connect_default connection (a Spark Connect server) "
                "unset (Tidemark then ships a zip of it, see `make dist`) or install it on the nodes")
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


def failure_reason(exc: BaseException, cfg=None) -> tuple[str, str | None]:
    """The one-line reason of a consolidation failure, and the fix when it is a Spark failure
    `classify` knows (else None): never a Java or Python stack trace."""
    found = classify(exc, cfg)
    if found is not None:
        return found
    text = safe_str(exc)
    reason = (one_line(text) if isinstance(exc, TidemarkError) else reason_line(text)) or type(exc).__name__
    if not isinstance(exc, TidemarkError):
        reason = f"{type(exc).__name__}: {reason}"
    return reason, None


# -- a job's outcome across spark-submit --------------------------------------------------------------
# spark-submit turns any non-zero exit of the job into a plain failure. The job says which failure it
# was twice: in its exit code (client mode: spark-submit exits with the Python driver's own code) and
# in a small JSON file named by `RESULT_FILE_ENV` (written where the driver runs); the task that
# started it reads them (`job_failure_class`).
EXIT_DETERMINISTIC = 2       # the same input fails the same way: do not retry
EXIT_TRANSIENT = 75          # EX_TEMPFAIL: retrying later can succeed
RESULT_FILE_ENV = "TIDEMARK_RESULT_FILE"


def job_failure(exc: BaseException) -> dict:
    """What a failed job reports: its class (`failure_class`), its one-line reason (never a stack
    trace: `reason_line`), the exception's type and the incident it opened (if any)."""
    reason = reason_line(safe_str(exc)) if not isinstance(exc, TidemarkError) else one_line(safe_str(exc))
    out = {"outcome": "failed", "class": failure_class(exc), "error": type(exc).__name__,
           "reason": reason or type(exc).__name__}
    incident = getattr(exc, "incident", None)
    if isinstance(incident, int):
        out["incident"] = incident
    return out


def write_job_result(result: dict, path: str | None = None) -> bool:
    """Write ``result`` as JSON to ``path`` (default: `RESULT_FILE_ENV`), atomically; False when there
    is no such file to write or it cannot be written (then the exit code alone tells)."""
    path = path or os.environ.get(RESULT_FILE_ENV)
    if not path:
        return False
    try:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(result, fh, default=str, sort_keys=True)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def read_job_result(path: str | None) -> dict | None:
    """The result a job wrote (`write_job_result`), or None (not written: the job died first, or its
    driver ran on another machine, as in cluster deploy mode)."""
    if not path:
        return None
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def job_failure_class(result: dict | None, returncode: int | None, recorded: str | None = None) -> str:
    """``"deterministic"`` or ``"transient"`` for a job that failed: its result file's class when it
    wrote one, else its exit code (`EXIT_DETERMINISTIC`; `EXIT_TRANSIENT`), else the class the job
    recorded on its incident in the control database (``recorded``: cluster deploy mode, where neither
    the file nor the driver's code reaches spark-submit); anything else (spark-submit's own failure, a
    killed driver) is transient: a retry is the safe default."""
    if result and result.get("class") in ("deterministic", "transient"):
        return result["class"]
    if returncode in (EXIT_DETERMINISTIC, EXIT_TRANSIENT):
        return "deterministic" if returncode == EXIT_DETERMINISTIC else "transient"
    return recorded if recorded in ("deterministic", "transient") else "transient"
