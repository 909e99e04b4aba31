"""spark-submit entry point: consolidate one stream's landed segments into its Delta Lake tables.

    spark-submit --master local[*] jobs/consolidate.py --stream-file include/streams/demo.yaml

The same command runs on a Spark cluster: ``spark-submit --master spark://HOST:7077 --conf
spark.pyspark.python=NODE_PYTHON jobs/consolidate.py --stream-file FILE``. The driver finds the
library in this checkout (``include/``) when it is not installed, and ships it to the executors
(`tidemark.sparkconf.ship_library`); all the work is in `tidemark.consolidate`. Connections resolve
as everywhere (`tidemark.connections`); under Airflow, `TidemarkSparkSubmitOperator` hands them over
as ``TIDEMARK_CONN_<ID>`` environment variables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

STARTED = time.perf_counter()

INCLUDE = Path(__file__).resolve().parents[1] / "include"


def _find_library() -> None:
    """Put this checkout's ``include/`` on the path when ``tidemark`` is not importable (spark-submit
    runs this file with the interpreter ``spark.pyspark.python`` names, which may not have it)."""
    try:
        import tidemark  # noqa: F401
    except ModuleNotFoundError:
        if (INCLUDE / "tidemark").is_dir():
            sys.path.insert(0, str(INCLUDE))


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, consolidate, print the result as JSON. A failure exits with
    `tidemark.failures.EXIT_DETERMINISTIC` (2: do not retry) or `EXIT_TRANSIENT` (75: retry) and, when
    ``TIDEMARK_RESULT_FILE`` names a file, writes its class and one-line reason there (the Airflow
    operator reads it: spark-submit itself only says "failed"); a success writes there what each table
    it committed got (`ConsolidateResult.table_events`: the operator's Asset events)."""
    from dataclasses import asdict

    _find_library()
    from tidemark.errors import TidemarkError, one_line
    from tidemark.failures import EXIT_DETERMINISTIC, EXIT_TRANSIENT, job_failure, write_job_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream-file", required=True, help="the stream's YAML file")
    parser.add_argument("--follow", action="store_true",
                        help="go on with the next batch while records landed meanwhile, for up to the stream's "
                             "consolidate.follow_seconds (`tidemark.consolidate.follow_stream`; the DAGs pass it)")
    args = parser.parse_args(argv)
    try:
        result, cfg = _run(args.stream_file, args.follow)
    except Exception as exc:  # noqa: BLE001 - every failure leaves with its class
        failure = job_failure(exc)
        if not isinstance(exc, TidemarkError):     # the stack trace stays in the task log, not the reason
            traceback.print_exc()
        text = one_line(str(exc)) if isinstance(exc, TidemarkError) else failure["reason"]
        print(f"tidemark: error: {text} [{failure['class']}]", file=sys.stderr, flush=True)
        write_job_result(failure)
        _classify_incident(args.stream_file, failure)
        return EXIT_DETERMINISTIC if failure["class"] == "deterministic" else EXIT_TRANSIENT
    from tidemark.lsn import format_lsn

    what = "nothing to consolidate" if result.skipped else (
        f"{len(result.segments)} segment(s), rows changed {result.rows_changed or {}}")
    print(f"stream {cfg.stream}: frontier {format_lsn(result.frontier_before)} -> "
          f"{format_lsn(result.frontier_after)}; {what}", flush=True)
    print("seconds: " + _seconds(), flush=True)
    print(json.dumps(asdict(result), default=str, sort_keys=True), flush=True)      # the last line: the result
    # the tables this run committed, as plain data (never rows): the task's Asset events (one per table)
    write_job_result({"outcome": "succeeded", "stream": cfg.stream, "tables": result.table_events()})
    return 0


def _classify_incident(stream_file: str, failure: dict) -> None:
    """Mark the failure's incident with its class in the control database: in cluster deploy mode the
    result file and the exit code do not reach the Airflow task, the control database does."""
    if "incident" not in failure:
        return
    try:
        from tidemark.config import load_config
        from tidemark.control import open_control

        with open_control(load_config(stream_file)) as ctl:
            ctl.classify_incident(failure["incident"], failure["class"])
    except Exception as exc:  # noqa: BLE001 - the control database may be what failed
        print(f"tidemark: the incident's class was not recorded: {exc}", file=sys.stderr, flush=True)


def _seconds() -> str:
    """Where this run's time went, for the task log: the job's start (imports), its Spark session, the
    batch's phases (`tidemark.consolidate.plan.PHASES`), the whole run."""
    from tidemark.consolidate.plan import PHASES

    parts = {**PHASES, "total": time.perf_counter() - STARTED}
    return ", ".join(f"{name} {value:.2f}" for name, value in parts.items())


def _run(stream_file: str, follow: bool = False):
    """Consolidate the stream of ``stream_file`` (an incident is recorded by the library on failure)."""
    from tidemark.config import load_config
    from tidemark.consolidate import consolidate_stream, follow_stream, spark_session
    from tidemark.consolidate.plan import phase

    cfg = load_config(stream_file)
    phase("start (imports, stream file)", time.perf_counter() - STARTED)
    t0 = time.perf_counter()
    spark = spark_session(f"tidemark-consolidate-{cfg.stream}", cfg=cfg)
    phase("job's Spark session", time.perf_counter() - t0)
    failed = True
    try:
        result = (follow_stream if follow else consolidate_stream)(cfg, spark=spark)
        failed = False
    finally:
        try:
            spark.stop()
        except Exception:  # noqa: BLE001 - a dead JVM cannot be stopped; the failure itself is what matters
            if not failed:
                raise
    return result, cfg


if __name__ == "__main__":
    sys.exit(main())
