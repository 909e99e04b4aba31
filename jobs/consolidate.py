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
from pathlib import Path

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
    """Parse arguments, consolidate, print the result as JSON."""
    from dataclasses import asdict

    _find_library()
    from tidemark.config import load_config
    from tidemark.consolidate import consolidate_stream, spark_session
    from tidemark.errors import TidemarkError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream-file", required=True, help="the stream's YAML file")
    args = parser.parse_args(argv)
    cfg = load_config(args.stream_file)
    spark = spark_session(f"tidemark-consolidate-{cfg.stream}", cfg=cfg)
    try:
        result = consolidate_stream(cfg, spark=spark)
    except TidemarkError as exc:   # already an incident (consolidate_failed): one line, no traceback
        print(f"tidemark: error: {exc}", file=sys.stderr)
        return 2
    finally:
        spark.stop()
    from tidemark.lsn import format_lsn

    what = "nothing to consolidate" if result.skipped else (
        f"{len(result.segments)} segment(s), rows changed {result.rows_changed or {}}")
    print(f"stream {cfg.stream}: frontier {format_lsn(result.frontier_before)} -> "
          f"{format_lsn(result.frontier_after)}; {what}", flush=True)
    print(json.dumps(asdict(result), default=str, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
