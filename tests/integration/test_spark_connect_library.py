"""A Spark Connect server whose executors lack the library (a cluster's endpoint): a consolidation
that ships it (``TIDEMARK_SPARK_SHIP=1``, what the operator sets unless the connection says
``tidemark_installed``) gives the lake the reference applier computes; one that does not fails in one
line naming the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
import yaml

from consolidate_kit import Lander, shape, up
from refapply import apply_capture, arrow_rows
from test_spark_cluster import node_python
from tidemark.landing.segments import read_segment
from tidemark.lake import read_table

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory):
    """A local Spark Connect server whose Python workers run a Python without the library."""
    from tidemark.local import sparkconnect

    tmp = tmp_path_factory.mktemp("bare-connect")
    python = node_python(tmp / "node")
    before = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = str(python)        # the server's Python workers (`sparkconnect.server_env`)
    try:
        proc, url = sparkconnect.start(tmp / "server.log", master="local[2]", library=False,
                                       conf={"spark.sql.shuffle.partitions": "2"})
    finally:
        if before is None:
            os.environ.pop("PYSPARK_PYTHON")
        else:
            os.environ["PYSPARK_PYTHON"] = before
    yield url
    sparkconnect.stop(proc)


def _consolidate(cfg, tmp_path, url: str, ship: str) -> subprocess.CompletedProcess:
    streams = tmp_path / "streams"
    streams.mkdir(exist_ok=True)
    (streams / f"{cfg.stream}.yaml").write_text(yaml.safe_dump(cfg.as_dict()))
    env = {**os.environ, "TIDEMARK_SPARK_REMOTE": url, "TIDEMARK_SPARK_SHIP": ship,
           "TIDEMARK_DIST_DIR": str(tmp_path / "dist")}
    return subprocess.run([sys.executable, "-m", "tidemark.cli", "--streams", str(streams), "consolidate", cfg.stream],
                          env=env, capture_output=True, text=True, timeout=600)


def test_a_server_without_the_library_gets_it_shipped_by_the_session(bare_server, make_stream, control, tmp_path):
    t = shape("t", [("k", "int64", True), ("v", "text")], oid=21)
    cfg = make_stream(["public.t"], consolidate={"buckets": 2})
    control.upsert_stream(cfg)
    control.update_stream(cfg.stream, consistent_lsn=0, landed_upper=0)
    lander = Lander(cfg, control)
    txns = [([up(t, {"k": k, "v": f"v{k}"}, 10 + k, 1, 0)], []) for k in range(1, 40)]
    data = lander.build(0, 100, txns, seq=0)
    lander.land(0, 100, txns, data=data)

    out = _consolidate(cfg, tmp_path, bare_server, ship="0")
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("tidemark: error:")]
    assert len(errors) == 1 and "No module named 'tidemark'" in errors[0], out.stderr[-3000:]
    assert "spark_connect_default" in out.stderr, out.stderr[-3000:]        # the remedy names the connection

    out = _consolidate(cfg, tmp_path, bare_server, ship="1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert control.stream(cfg.stream).frontier == 100
    expected = apply_capture({"public.t": (t, [])}, 0, [read_segment(data, "seg")])
    assert Counter(arrow_rows(read_table(cfg, "public.t"))) == expected["public.t"]
