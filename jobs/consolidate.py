"""spark-submit entry point: consolidate one stream's landed segments into its Delta Lake tables.

    spark-submit --master local[*] jobs/consolidate.py --stream-file include/streams/demo.yaml

The same command runs unchanged on a Spark cluster (``--master spark://...``); all the work is in
`tidemark.consolidate`. Connections resolve as everywhere (`tidemark.connections`); under Airflow,
`TidemarkSparkSubmitOperator` hands them over as ``TIDEMARK_CONN_<ID>`` environment variables.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, consolidate, print the result as JSON."""
    from dataclasses import asdict

    from tidemark.config import load_config
    from tidemark.consolidate import consolidate_stream, spark_session
    from tidemark.errors import TidemarkError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream-file", required=True, help="the stream's YAML file")
    args = parser.parse_args(argv)
    cfg = load_config(args.stream_file)
    spark = spark_session(f"tidemark-consolidate-{cfg.stream}")
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
