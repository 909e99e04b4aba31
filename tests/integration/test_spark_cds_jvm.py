"""A new Spark JVM started by Tidemark maps the class-data-sharing archive (`tidemark.cds`),
and an archive it cannot use never stops it. ``-Xshare:on`` (through ``JAVA_TOOL_OPTIONS``) makes a
JVM fail when it cannot map its archive, which turns "was it used?" into a start that fails or not."""

import os
import subprocess
import sys

from tidemark import cds

CHILD = """
from tidemark.consolidate.job import spark_session
spark = spark_session(master="local[1]")
print("OPTIONS", spark.conf.get("spark.driver.defaultJavaOptions", ""))
print("COUNT", spark.range(5).count())
"""


def _start(env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_TOOL_OPTIONS", "TIDEMARK_SPARK_REMOTE")}
    return subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                          env={**env, "PYSPARK_PYTHON": sys.executable, **env_extra})


def test_a_new_jvm_maps_the_archive_and_a_bad_archive_never_stops_it(tmp_path):
    built = cds.build()           # scripts/setup.sh built it already: then this returns at once
    path = cds.archive_path()
    assert path is not None and path.is_file() and built["bytes"] > 10_000_000
    ok = _start({"JAVA_TOOL_OPTIONS": "-Xshare:on"})
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert f"OPTIONS -XX:SharedArchiveFile={path}" in ok.stdout and "COUNT 5" in ok.stdout
    assert "-XX:TieredStopAtLevel=1" in ok.stdout      # the first JIT tier only, with the archive mapped

    bad = tmp_path / "corrupt.jsa"
    bad.write_bytes(os.urandom(1 << 20))
    strict = _start({cds.ENV: str(bad), "JAVA_TOOL_OPTIONS": "-Xshare:on"})
    assert strict.returncode != 0 and "shared archive" in strict.stdout + strict.stderr      # the check can fail
    lenient = _start({cds.ENV: str(bad)})
    assert lenient.returncode == 0 and "COUNT 5" in lenient.stdout, lenient.stderr[-3000:]
