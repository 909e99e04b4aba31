"""``spark-submit --master local[2] jobs/consolidate.py --stream-file FILE`` consolidates a stream."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from consolidate_kit import Lander, rows_counter, shape, up
from tidemark.lake import read_table

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_spark_submit_entry_point(make_stream, control, tmp_path):
    submit = Path(sys.executable).parent / "spark-submit"
    if not submit.exists():
        submit = Path(shutil.which("spark-submit") or "")
    if not submit.is_file():
        pytest.skip("spark-submit is not installed")
    cfg = make_stream(["public.t"])
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=0, landed_upper=0)
    t = shape("t", [("k", "int32", True), ("v", "text")], oid=5)
    Lander(cfg, control).land(0, 10, [([up(t, {"k": 1, "v": "x"}, 5, 1, 0)], [])])
    stream_file = tmp_path / "stream.yaml"
    stream_file.write_text(yaml.safe_dump(cfg.as_dict()))
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    out = subprocess.run([str(submit), "--master", "local[2]", "--conf", "spark.ui.enabled=false",
                          "--conf", "spark.sql.shuffle.partitions=4", str(ROOT / "jobs" / "consolidate.py"),
                          "--stream-file", str(stream_file)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["frontier_after"] == 10 and result["stream"] == cfg.stream
    assert rows_counter(read_table(cfg, "public.t")) == Counter({(1, "x"): 1})
