"""Thin operators over `TidemarkHook`: ``__init__`` stores arguments, ``execute`` builds the hook.

What a task's outcome means:

- *success*: it did its work (the result is the task's XCom, LSNs in the log as ``0/16B3748``);
- *skipped*: there was nothing to do; the reason is the last line of its log;
- *failed at once* (``AirflowFailException``, no retries): a deterministic error (a bad stream file, a
  state conflict such as a second initial snapshot, a bad segment): retrying cannot help, the message
  says what to do;
- *up for retry*: a transient error (connection lost, another run holds the stream's lock).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from tidemark_airflow.hooks import TidemarkHook, airflow_extras, lsn_text

from tidemark.connections import CONN_FILE_ENV, REDACTION_REGEX, write_connection_file

SPARK_LOG_CONFIG = Path(__file__).resolve().parent / "spark-log4j2.properties"
# A task waits this long for the stream's lease while a job it cannot run beside holds it (a changelog
# rebuild, a sweep: seconds), before `StreamBusy` hands it to the task's retries; the deployment's own
# TIDEMARK_LOCK_WAIT_SECONDS wins.
TASK_LOCK_WAIT_SECONDS = 300


def task_lock_wait() -> str:
    from tidemark.control.db import LOCK_WAIT_ENV

    return os.environ.get(LOCK_WAIT_ENV) or str(TASK_LOCK_WAIT_SECONDS)


@contextlib.contextmanager
def library_errors(log) -> Iterator[None]:
    """Map what the library raises to Airflow's outcomes: deterministic → `AirflowFailException`
    (no retries), transient → re-raised (the task's retries apply). The library's stream leases are
    waited for (`TASK_LOCK_WAIT_SECONDS`) inside it."""
    from tidemark.control.db import LOCK_WAIT_ENV

    before = os.environ.get(LOCK_WAIT_ENV)
    os.environ[LOCK_WAIT_ENV] = task_lock_wait()
    try:
        yield
    except (AirflowFailException, AirflowSkipException):
        raise
    except Exception as exc:
        from tidemark.errors import TidemarkError, describe
        from tidemark.failures import is_transient

        if is_transient(exc):
            log.warning("transient error, the task will be retried: %s: %s", type(exc).__name__, exc)
            raise
        # (a full disk, a bad configuration …: said as the CLI says it, without a traceback's text)
        what, remedy = describe(exc)         # (another error's type is in its `what` already)
        name = f"{type(exc).__name__}: " if isinstance(exc, TidemarkError) else ""
        raise AirflowFailException(f"{name}{what}{'; remedy: ' + remedy if remedy else ''} "
                                   "(deterministic: not retried)") from exc
    finally:     # a task run in-process (dag.test) leaves its process's environment as it was
        if before is None:
            os.environ.pop(LOCK_WAIT_ENV, None)
        else:
            os.environ[LOCK_WAIT_ENV] = before


def skip(log, reason: str) -> None:
    """Mark the task skipped, with the reason in its log."""
    log.info("skipped: %s", reason)
    raise AirflowSkipException(reason)


class TidemarkStreamOperator(BaseOperator):
    """Base of the stream operators: holds the stream file, builds the hook, maps library errors."""

    template_fields: Sequence[str] = ("stream_file",)
    ui_color = "#d8ecf3"

    def __init__(self, *, stream_file: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stream_file = stream_file

    def get_hook(self) -> TidemarkHook:
        """Build the hook for this stream."""
        return TidemarkHook(stream_file=self.stream_file)

    def execute(self, context: Context) -> Any:
        with library_errors(self.log):
            return self.run(self.get_hook(), context)

    def run(self, hook: TidemarkHook, context: Context) -> Any:
        raise NotImplementedError

    def report(self, what: str, result: Any) -> Any:
        """Log a result with its LSNs as text; return it unchanged (the XCom keeps integers)."""
        self.log.info("%s: %s", what, lsn_text(result))
        return result


class TidemarkApplyOperator(TidemarkStreamOperator):
    """Validate the stream against its source, align its publication and register it."""

    def run(self, hook: TidemarkHook, context: Context) -> dict:
        return self.report("registered", hook.apply())


class TidemarkSnapshotOperator(TidemarkStreamOperator):
    """Snapshot the stream (``initial``) or re-snapshot it at a new consistent point (``resend``).

    ``resend`` without a gap is skipped (nothing was lost) unless ``force``; ``force`` belongs to
    ``resend`` only (an initial snapshot of a stream that has one is refused)."""

    template_fields: Sequence[str] = ("stream_file", "tables", "mode", "force", "chunk_pages", "parallelism")

    def __init__(self, *, stream_file: str, tables: list[str] | str | None = None, mode: str = "initial",
                 force: bool | str = False, chunk_pages: int | str | None = None,
                 parallelism: int | str | None = None, **kwargs: Any) -> None:
        super().__init__(stream_file=stream_file, **kwargs)
        self.tables = tables
        self.mode = mode
        self.force = force
        self.chunk_pages = chunk_pages
        self.parallelism = parallelism

    def run(self, hook: TidemarkHook, context: Context) -> dict:
        force = _bool(self.force)
        if self.mode not in ("initial", "resend", "add", "table"):
            raise AirflowFailException(f"snapshot mode {self.mode!r} is not 'initial', 'resend', 'add' or 'table'")
        if self.mode == "initial" and force:
            raise AirflowFailException("force applies to mode 'resend' (re-snapshot even without a gap); an "
                                       "initial snapshot is never forced over an existing one")
        if self.mode == "resend":
            result = hook.resend(tables=self.tables, force=force)
            if result.get("skipped"):
                skip(self.log, f"stream {hook.config.stream}: {result.get('reason')}; nothing was re-snapshotted. "
                               "Trigger again with force: true to re-snapshot anyway")
            return self.report("resend", result)
        return self.report("snapshot", hook.snapshot(
            tables=self.tables, mode=self.mode, chunk_pages=_int_or_none(self.chunk_pages),
            parallelism=_int_or_none(self.parallelism)))


def record_metrics(op, hook: TidemarkHook) -> None:
    """Record the stream's consumer metrics and slot lag after the task's work (`TidemarkHook.record_metrics`),
    in the same task: a separate task would cost a task start (seconds) on the path of every change. A
    failure here is logged, not raised: the work is done and committed, and the next run records them."""
    try:
        op.log.info("metrics: %s", lsn_text(hook.record_metrics()))
    except Exception as exc:  # noqa: BLE001 - observability must not fail (and re-run) committed work
        op.log.warning("the stream's metrics were not recorded (the next run records them): %s: %s",
                       type(exc).__name__, exc)


class TidemarkDrainOperator(TidemarkStreamOperator):
    """Sweep, then drain the replication slot into new landing segments, then record the metrics, in one
    task: every task start costs seconds on the way from a commit to the lake. The sweep registers or
    discards segments written and never registered (a drain killed between). The landing Asset's event
    (its outlet) carries ``{segments, records, upper}``. Skipped when nothing was written (no new WAL)."""

    ui_color = "#c9e4ca"

    def run(self, hook: TidemarkHook, context: Context) -> list[dict]:
        from tidemark.lsn import format_lsn

        self.report("swept", hook.sweep())
        results = [r for r in hook.drain() if r.get("uri")]
        record_metrics(self, hook)
        if not results:
            skip(self.log, f"stream {hook.config.stream}: the slot had no new WAL; no segment was written")
        extra = {"segments": len(results), "records": sum(int(r["records"]) for r in results),
                 "upper": format_lsn(max(int(r["upper"]) for r in results))}
        for asset in self.outlets:
            context["outlet_events"][asset].extra = extra
        self.log.info("landing asset event: %s", extra)
        return self.report("drained", results)


class TidemarkRepairOperator(TidemarkStreamOperator):
    """Re-drain exactly the missing LSN ranges the slot still covers and write the missing segments."""

    ui_color = "#f3d2c1"

    def run(self, hook: TidemarkHook, context: Context) -> dict:
        return self.report("repaired", hook.repair())


class TidemarkResendOperator(TidemarkStreamOperator):
    """Forget lost segments, re-snapshot the tables at a new consistent point, move the frontier."""

    template_fields: Sequence[str] = ("stream_file", "tables")
    ui_color = "#f3c1c1"

    def __init__(self, *, stream_file: str, tables: list[str] | str | None = None, **kwargs: Any) -> None:
        super().__init__(stream_file=stream_file, **kwargs)
        self.tables = tables

    def run(self, hook: TidemarkHook, context: Context) -> dict:
        result = hook.resend(tables=self.tables)
        if result.get("skipped"):
            skip(self.log, f"stream {hook.config.stream}: {result.get('reason')}")
        return self.report("resend", result)


class TidemarkConsolidateOperator(TidemarkStreamOperator):
    """Consolidate in the worker's process (local Spark); the DAGs use `TidemarkSparkSubmitOperator`."""

    def run(self, hook: TidemarkHook, context: Context) -> dict:
        return self.report("consolidated", hook.consolidate())


class TidemarkSparkSubmitOperator(SparkSubmitOperator):
    """spark-submit the consolidation job with the stream's connections resolved by Airflow.

    First, in the task's own process: when only progress landed since the frontier, the frontier,
    checkpoint and slot move in the control database and the task is skipped (no Spark job, no JVM).
    After the job, the stream's metrics are recorded (`record_metrics`).

    The job runs outside Airflow (on a Spark cluster it has no Airflow at all), so connections
    defined in Airflow's metadata database or a secrets backend would be invisible to it: this
    operator resolves them through `TidemarkHook.connection_env` when it runs and hands them to
    spark-submit as ``TIDEMARK_CONN_<ID>`` environment variables (masked in logs). On YARN and on
    Kubernetes, where the provider would turn environment variables into
    ``--conf`` values (visible in ``ps``, the Spark UI and event logs), they go instead in a file only
    its owner can read, shipped with ``--files`` and named by ``TIDEMARK_CONN_FILE``, deleted after
    the run; ``spark.redaction.regex`` also names our variables. Spark's console output is kept at
    ``spark_log_level`` (WARN; ``INFO`` to see it all).

    A warm engine first: when the Spark Connect connection ``connect_conn_id`` (the Spark provider's
    ``spark_connect`` type; the embedded default runs a supervised server and defines it, a cluster
    points it at the cluster's Spark Connect endpoint) is defined and its server accepts connections,
    the job runs as a thin client of that long-running server (``TIDEMARK_SPARK_REMOTE``, a Python
    process on this worker: no JVM starts, see `run_connect`). Otherwise, and when the server went
    away during the run (killed, crashed), it is spark-submitted as before. The job is idempotent
    (the lake commit records the frontier), so a batch cut short on a dead server is simply done
    again."""

    template_fields: Sequence[str] = (*SparkSubmitOperator.template_fields, "stream_file")

    def __init__(self, *, stream_file: str, spark_log_level: str = "WARN",
                 connect_conn_id: str | None = "spark_connect_default", skip_if_idle: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stream_file = stream_file
        self.spark_log_level = spark_log_level
        self.connect_conn_id = connect_conn_id
        self.skip_if_idle = skip_if_idle     # False: always run the job (it handles an idle stream itself)

    def connect_url(self) -> str | None:
        """The Spark Connect server to use (``sc://host:port/;...``), or None: no connection
        ``connect_conn_id``, not of the ``spark_connect`` type, or its server does not accept
        connections now (logged: the run falls back to spark-submit)."""
        if not self.connect_conn_id:
            return None
        from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook
        from airflow.sdk import BaseHook
        from airflow.sdk.exceptions import AirflowNotFoundException

        try:
            conn = BaseHook.get_connection(self.connect_conn_id)
        except AirflowNotFoundException:
            return None
        if conn.conn_type != SparkConnectHook.conn_type:
            self.log.warning("connection %s is of type %s, not %s: spark-submit", self.connect_conn_id,
                             conn.conn_type, SparkConnectHook.conn_type)
            return None
        # as for spark_default: a server whose executors have the library says so; else it is shipped
        self._connect_ship = not conn.extra_dejson.get("tidemark_installed")
        url = SparkConnectHook(self.connect_conn_id).get_connection_url()
        if not connect_server_answers(url):
            self.log.warning("the Spark Connect server of connection %s (%s) does not accept connections: "
                             "falling back to spark-submit", self.connect_conn_id, url.split(";")[0])
            return None
        return url

    def run_connect(self, context: Context, url: str) -> Any:
        """Run the job (``application`` with ``application_args``) with this worker's Python as a
        Spark Connect client of ``url``; its output goes to the task log. Return None on success; raise
        as a spark-submit failure would (the job's result file and exit code classify it)."""
        import subprocess
        import sys
        import threading

        from airflow.sdk.exceptions import AirflowException

        from tidemark.control.db import LOCK_WAIT_ENV
        from tidemark.sparkconf import SHIP_ENV

        with library_errors(self.log):
            hook = TidemarkHook(stream_file=self.stream_file)
            self._tidemark_config = hook.config
            conns = hook.connection_env()
        env = {**os.environ, **conns, "TIDEMARK_SPARK_REMOTE": url, "TIDEMARK_SPARK_LOG_LEVEL": self.spark_log_level,
               SHIP_ENV: "1" if getattr(self, "_connect_ship", True) else "0",
               LOCK_WAIT_ENV: task_lock_wait(), **(self.env_vars or {})}
        self.log.info("consolidating through the Spark Connect server %s (connection %s) with connections %s",
                      url.split(";")[0], self.connect_conn_id, sorted(conns))
        cmd = [sys.executable, self.application, *(self.application_args or [])]
        self._connect_proc = proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     stdin=subprocess.DEVNULL, text=True, errors="replace")
        # the client retries an unreachable server for minutes (gRPC's backoff): a server that stopped
        # answering is watched for here, and the client is stopped so that the run goes on without it
        watcher = threading.Thread(target=self._watch_server, args=(proc, url), daemon=True)
        watcher.start()
        for line in proc.stdout:
            self.log.info("%s", line.rstrip())
        proc.wait()
        watcher.join()
        if proc.returncode:
            raise AirflowException(f"the Spark Connect client run failed. Error code is: {proc.returncode}")
        return None

    def _watch_server(self, proc, url: str, every: float = 2.0, misses: int = 2) -> None:
        """While the client ``proc`` runs: when the server has not accepted a connection ``misses``
        times in a row, stop the client (its batch is lost with the server; the run goes on)."""
        import subprocess

        missed = 0
        while True:
            try:
                proc.wait(timeout=every)     # (not a sleep: the task waits for this thread at the client's end)
                return
            except subprocess.TimeoutExpired:
                pass
            missed = 0 if connect_server_answers(url) else missed + 1
            if missed >= misses and proc.poll() is None:
                self.log.warning("the Spark Connect server %s stopped answering: stopping its client",
                                 url.split(";")[0])
                proc.kill()
                return

    def on_kill(self) -> None:
        proc = getattr(self, "_connect_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
        super().on_kill()

    def prepare(self) -> None:
        """Fill in what spark-submit passes: the stream's connections (environment), the Spark settings
        of `tidemark.sparkconf.submit_settings` (``--conf``: machine defaults in local mode, the
        connection's ``spark.*`` extras, the stream file's ``consolidate.spark_conf``,
        ``TIDEMARK_SPARK_CONF``; this operator's own ``conf`` wins) and, on a cluster whose nodes do
        not have the library (connection extra ``tidemark_installed``), its zip as ``--py-files``."""
        from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

        from tidemark.sparkconf import submit_settings

        with library_errors(self.log):
            hook = TidemarkHook(stream_file=self.stream_file)
            self._tidemark_config = hook.config
            env = hook.connection_env()
            spark_conn = SparkSubmitHook(conn_id=self._conn_id, deploy_mode=self._deploy_mode)._connection
            settings, py_files = submit_settings(hook.config, spark_conn["master"], airflow_extras(self._conn_id) or {},
                                                 spark_conn["deploy_mode"])
        java = f"-Dlog4j2.configurationFile=file:{SPARK_LOG_CONFIG} -Dtidemark.spark.level={self.spark_log_level}"
        self.conf = {**settings, "spark.driver.extraJavaOptions": java, "spark.executor.extraJavaOptions": java,
                     **(self.conf or {})}
        from tidemark.cds import jvm_options   # not at import: DAG parsing stays light

        if "spark.driver.defaultJavaOptions" not in self.conf:
            self.conf["spark.driver.defaultJavaOptions"] = jvm_options()   # faster JVM start (tidemark spark-cds), first JIT tier
        if py_files:
            self.py_files = ",".join([*([self.py_files] if self.py_files else []), *py_files])
        # Spark's UI and event logs redact settings and environment variables by name: add ours
        self.conf.setdefault("spark.redaction.regex", REDACTION_REGEX)
        master, mode = spark_conn["master"] or "", spark_conn["deploy_mode"]
        if master.startswith(("yarn", "k8s://")) or mode == "cluster":
            # there the provider turns environment variables into --conf values (visible in ps and
            # the Spark UI): the connections go in a file of their own (mode 0600) shipped with
            # --files, and only its name travels (`tidemark.connections` reads TIDEMARK_CONN_FILE)
            self._conn_file = write_connection_file(env)
            self.files = ",".join([*([self.files] if self.files else []), self._conn_file])
            env = {CONN_FILE_ENV: os.path.basename(self._conn_file)}
        from tidemark.control.db import LOCK_WAIT_ENV
        from tidemark.sparkconf import MEMORY_ENV

        # the driver's JVM (and, in local mode, its Python workers) gets the allocators' settings too,
        # unless the worker's environment or the task's own env_vars set them
        memory = {k: v for k, v in MEMORY_ENV.items() if k not in os.environ}
        self.env_vars = {**memory, **(self.env_vars or {}), **env, "TIDEMARK_SPARK_LOG_LEVEL": self.spark_log_level,
                         LOCK_WAIT_ENV: task_lock_wait()}
        self.log.info("spark-submit to %s with connections %s (resolved through Airflow%s)%s", master,
                      sorted(hook.connection_env()) if CONN_FILE_ENV in env else sorted(env),
                      ", in a file shipped with --files" if CONN_FILE_ENV in env else "",
                      f", shipping the library {py_files[0]}" if py_files else "")

    def execute(self, context: Context) -> Any:
        hook = TidemarkHook(stream_file=self.stream_file)
        idle = None
        if self.skip_if_idle:
            with library_errors(self.log):
                idle = hook.advance_if_idle()
        if idle is not None:
            # only progress landed (or nothing): the frontier, checkpoint and slot moved in the control
            # database; no Spark job, no client process, no JVM
            record_metrics(self, hook)
            before, after = (lsn_text(idle[k], "frontier") for k in ("frontier_before", "frontier_after"))
            if before != after:
                skip(self.log, f"no records landed above the frontier: it moved {before} -> {after} in the control "
                               "database, no Spark job")
            held = f" (held, waiting for {idle.get('waiting')})" if idle.get("held") else ""
            skip(self.log, f"nothing to consolidate at the frontier {before} now{held}")
        result = self._consolidate(context)
        record_metrics(self, hook)
        return result

    def _consolidate(self, context: Context) -> Any:
        """The Spark job: through the Spark Connect server when one answers, else spark-submit."""
        import tempfile

        from tidemark.failures import RESULT_FILE_ENV

        self._conn_file = None
        url = self.connect_url()
        # the job writes its outcome here (client deploy mode: the driver runs on this worker)
        fd, self._result_file = tempfile.mkstemp(prefix="tidemark-result-", suffix=".json")
        os.close(fd)
        try:
            if url is not None:
                self.env_vars = {**(self.env_vars or {}), RESULT_FILE_ENV: self._result_file}
                try:
                    result = self.run_connect(context, url)
                    self.publish_tables(context)
                    return result
                except (AirflowFailException, AirflowSkipException):
                    raise
                except Exception as exc:
                    self.classify_failure(exc)           # deterministic: raised here, not retried
                    if connect_server_answers(url):
                        raise                            # transient, the server is up: the task's retries
                    # the server went away during the run (killed, crashed): this run is spark-submitted
                    self.log.warning("the Spark Connect server went away during the run; consolidating "
                                     "again with spark-submit (the job is idempotent)")
                    with open(self._result_file, "w"):  # the client's outcome is not this run's
                        pass
                    self._connect_proc = None
            self.prepare()
            self.env_vars = {**(self.env_vars or {}), RESULT_FILE_ENV: self._result_file}
            self._since = self._control_now()
            result = super().execute(context)
            self.publish_tables(context)
            return result
        except (AirflowFailException, AirflowSkipException):
            raise
        except Exception as exc:  # spark-submit failed (the provider's AirflowException) or could not run
            self.classify_failure(exc)
            raise
        finally:
            for path in (self._conn_file, self._result_file):
                if path:
                    with contextlib.suppress(OSError):
                        os.unlink(path)

    def publish_tables(self, context: Context) -> dict:
        """After a successful job: an event for the Asset of each table it gave a new Delta version
        (`tidemark_airflow.assets.table_asset`), through the task's `AssetAlias` outlets, with the
        extra the job wrote in its result file (`ConsolidateResult.table_events`: frontier, version,
        rows inserted/updated/deleted); a table the batch left alone gets none. Return the tables."""
        from airflow.sdk import AssetAlias

        from tidemark.failures import read_job_result
        from tidemark_airflow.assets import table_asset

        aliases = [o for o in self.outlets if isinstance(o, AssetAlias)]
        if not aliases:
            return {}
        result = read_job_result(getattr(self, "_result_file", None)) or {}
        if "tables" not in result:
            # cluster deploy mode: the driver wrote its result where it ran, not on this worker
            self.log.warning("the job's result did not reach this worker (its driver ran elsewhere: cluster deploy "
                             "mode?): no lake table Asset event for this run; the tables' Delta logs say what changed")
            return {}
        tables = result["tables"]
        for table, extra in sorted(tables.items()):
            asset = table_asset(result["stream"], table)
            for alias in aliases:
                context["outlet_events"][alias].add(asset, extra=extra)
            self.log.info("lake table asset event %s: %s", asset.uri, extra)
        if not tables:
            self.log.info("no table got a new Delta version: no lake table Asset event")
        return tables

    def classify_failure(self, exc: BaseException) -> None:
        """spark-submit failed: raise `AirflowFailException` (no retries) when the job said its failure
        is deterministic (its result file, else its exit code: spark-submit exits with the driver's
        code in client deploy mode, else, in cluster deploy mode where neither reaches this worker,
        the class it recorded on its incident in the control database); return (the plain failure is
        retried) when it is transient or unknown."""
        import re

        from tidemark.failures import job_failure_class, read_job_result

        result = read_job_result(getattr(self, "_result_file", None))
        proc = getattr(getattr(self, "_hook", None), "_submit_sp", None) or getattr(self, "_connect_proc", None)
        returncode = getattr(proc, "returncode", None)
        if returncode is None and (m := re.search(r"Error code is: (\d+)", str(exc))):
            returncode = int(m.group(1))
        recorded = None
        if not result and returncode not in (2, 75):
            # cluster deploy mode: the driver's file and exit code stayed where it ran; the class it
            # recorded on its incident in the control database did not
            recorded = self._recorded_failure()
            if recorded:
                result = {"reason": recorded.get("reason"), "incident": recorded["id"]}
        kind = job_failure_class(result, returncode, (recorded or {}).get("class"))
        reason = (result or {}).get("reason") or f"spark-submit exited with code {returncode}"
        incident = f" (incident {result['incident']})" if result and result.get("incident") else ""
        if kind == "deterministic":
            raise AirflowFailException(f"consolidation failed{incident}: {reason} (deterministic: not retried; "
                                       "fix the cause, then clear the task)") from exc
        self.log.warning("transient failure, the task will be retried: %s%s (spark-submit exit code %s)", reason,
                         incident, returncode)

    def _control_now(self):
        """The control database's time before the job starts (None when it cannot be read)."""
        try:
            from tidemark.control import open_control

            with open_control(self._tidemark_config) as ctl:
                return ctl.now()
        except Exception as exc:  # noqa: BLE001 - only the cluster-mode fallback needs it
            self.log.info("control database time not read (%s): a failure without the job's result is retried",
                          type(exc).__name__)
            return None

    def _recorded_failure(self) -> dict | None:
        """The class the job recorded on its ``consolidate_failed`` incident during this run, or None."""
        if getattr(self, "_since", None) is None:
            return None
        try:
            from tidemark.control import open_control

            cfg = self._tidemark_config
            with open_control(cfg) as ctl:
                found = ctl.failure_class_since(cfg.stream, "consolidate_failed", self._since)
        except Exception as exc:  # noqa: BLE001 - unknown: retried
            self.log.warning("the job's recorded failure class could not be read: %s", exc)
            return None
        return found


def connect_server_answers(url: str, timeout: float = 3.0) -> bool:
    """Whether the Spark Connect server of ``url`` (``sc://host:port/...``) accepts a TCP connection."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url.split(";")[0])
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 15002), timeout=timeout):
            return True
    except OSError:
        return False


class TidemarkChangelogOperator(TidemarkStreamOperator):
    """Write the changelog partition of the run's data interval from retained segments."""

    def run(self, hook: TidemarkHook, context: Context) -> dict:
        start, end = context.get("data_interval_start"), context.get("data_interval_end")
        if start is None or end is None:
            raise AirflowFailException("the changelog needs a data interval; trigger it with a logical date")
        result = hook.changelog(start=start, end=end)
        if result.get("frontier") is None:
            skip(self.log, f"stream {hook.config.stream}: {result.get('reason')}; no changelog for [{start}, {end})")
        return self.report(f"changelog [{start}, {end})", result)


class TidemarkMaintainOperator(TidemarkStreamOperator):
    """Table maintenance and landing retention of the stream (`tidemark.maintain`)."""

    def run(self, hook: TidemarkHook, context: Context) -> dict:
        return self.report("maintain", hook.maintain())


class TidemarkMetricsOperator(TidemarkStreamOperator):
    """Record the consumer metrics and slot lag in the control database."""

    def run(self, hook: TidemarkHook, context: Context) -> dict:
        return self.report("metrics", hook.record_metrics())


def _int_or_none(value: int | str | None) -> int | None:
    """Read an optional integer that may arrive as a rendered template string."""
    if value is None or value == "" or value == "None":
        return None
    return int(value)


def _bool(value: bool | str | None) -> bool:
    """Read a flag that may arrive as a rendered template string."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on")
    return bool(value)
