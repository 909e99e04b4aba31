"""A class-data-sharing archive for the Spark driver's JVM: faster cold starts (the manual:
docs/operations/cluster.md, "A faster cold JVM").

`build` creates the archive once, in a child process running a throwaway Spark job with
``-XX:ArchiveClassesAtExit`` (what consolidation uses: Arrow-Python stages, shuffles, aggregations,
Parquet), written to a temporary file and renamed into place, so concurrent builders and readers never
see half an archive. Its file name carries a key of the JDK and the Spark installation (`archive_path`);
a JVM that cannot use an archive ignores it with a warning: it can make a start faster, never wrong.
`jvm_options` is what a Spark driver JVM Tidemark starts is given: the archive, and the JIT's first
tier only (`JIT_OPTIONS`). ``TIDEMARK_SPARK_CDS`` names another archive file, or ``off``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ENV = "TIDEMARK_SPARK_CDS"


def _spark_identity() -> tuple[str, str, str]:
    """Spark's version, its installation directory and a fingerprint of its jars: the JVM refuses an
    archive when a jar on the class path changed (size or modification time), e.g. after pip
    reinstalled pyspark."""
    import pyspark

    home = os.path.realpath(os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__))
    jars = []
    with os.scandir(os.path.join(home, "jars")) as it:
        for e in it:
            st = e.stat()
            jars.append(f"{e.name}:{st.st_size}:{st.st_mtime_ns}")
    return pyspark.__version__, home, "\0".join(sorted(jars))


def _digest(*parts: str) -> str:
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:10]


def archive_path() -> Path | None:
    """Where the archive of this JDK and Spark installation is (whether or not it exists yet):
    ``~/.cache/tidemark/spark-VERSION-INSTALLATION-JARS.jsa``; None when ``TIDEMARK_SPARK_CDS=off``."""
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    if setting:
        return Path(setting).expanduser()
    version, home, jars = _spark_identity()
    java_home = os.environ.get("JAVA_HOME")
    java = os.path.realpath(os.path.join(java_home, "bin", "java") if java_home else shutil.which("java") or "java")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tidemark"
    return cache / f"spark-{version}-{_digest(home, java)}-{_digest(jars)}.jsa"


def driver_java_options() -> str:
    """``-XX:SharedArchiveFile=...`` when the archive exists, else "" (a JVM without it starts as usual)."""
    path = archive_path()
    if path is None or not path.is_file():
        return ""
    return f"-XX:SharedArchiveFile={path}"


JIT_OPTIONS = "-XX:TieredStopAtLevel=1"


def jvm_options() -> str:
    """The options of a Spark driver JVM Tidemark starts: the archive's (`driver_java_options`), then
    `JIT_OPTIONS` (module doc)."""
    return " ".join(o for o in (driver_java_options(), JIT_OPTIONS) if o)


def build(*, force: bool = False, timeout: float = 600.0) -> dict:
    """Create the archive (unless it exists and not ``force``) in a child process; return
    ``{"path", "built", "seconds", "bytes"}``. Raises `RuntimeError` with the child's output
    when the JVM could not write it."""
    path = archive_path()
    if path is None:
        return {"path": None, "built": False, "seconds": 0.0, "bytes": 0, "reason": f"{ENV}=off"}
    if path.is_file() and not force:
        return {"path": str(path), "built": False, "seconds": 0.0, "bytes": path.stat().st_size}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "tidemark.cds", str(tmp)], capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, ENV: "off"})
        if proc.returncode != 0 or not tmp.is_file() or tmp.stat().st_size == 0:
            raise RuntimeError(f"could not build the Spark class-data-sharing archive {path} (exit "
                               f"{proc.returncode}): {(proc.stderr or proc.stdout).strip()[-2000:]}")
        os.replace(tmp, path)
        if not os.environ.get(ENV):      # this installation's archives of jars that are gone
            for stale in path.parent.glob(path.name.rsplit("-", 1)[0] + "-*.jsa"):
                if stale != path:
                    stale.unlink(missing_ok=True)
    finally:
        tmp.unlink(missing_ok=True)
    return {"path": str(path), "built": True, "seconds": round(time.perf_counter() - t0, 1),
            "bytes": path.stat().st_size}


def _training_job(out: str) -> None:
    """The child process of `build`: start Spark with ``-XX:ArchiveClassesAtExit=out`` and use what
    consolidation uses, so those classes are loaded (and archived) when the JVM exits."""
    import tempfile

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession, Window
    from pyspark.sql import functions as F

    spark = (SparkSession.builder.master("local[2]").appName("tidemark-cds")
             .config("spark.driver.defaultJavaOptions", f"-XX:ArchiveClassesAtExit={out}")
             .config("spark.sql.session.timeZone", "UTC").config("spark.sql.execution.arrow.pyspark.enabled", "true")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")

    def same(batches):
        yield from batches

    def whole(table):
        return table

    src = spark.createDataFrame([(f"u{i}",) for i in range(8)], "uri string").repartition(2)
    df = (src.mapInArrow(same, "uri string").persist()
          .withColumn("k", F.xxhash64("uri")).withColumn("b", F.pmod(F.col("k"), F.lit(4)).cast("int")))
    df.filter(F.col("b") >= 0).select("uri", F.when(F.col("b") == 1, F.col("k")).alias("k")).toArrow()
    df.repartition(2, "b").groupBy("b").applyInArrow(whole, df.schema).toArrow()
    (df.groupBy("b").agg(F.countDistinct("k").alias("n"), F.max("k").alias("m"), F.sum("b").alias("s"))
     .orderBy("b").limit(3).collect())
    w = Window.partitionBy("b").orderBy("k")
    df.withColumn("prev", F.lag("k").over(w)).withColumn("last", F.last("k", ignorenulls=True).over(w)) \
        .join(df.select("uri"), "uri").count()
    with tempfile.TemporaryDirectory() as d:
        df.write.parquet(d + "/p")
        spark.read.parquet(d + "/p").count()
    gateway = spark.sparkContext._gateway
    spark.stop()
    # the JVM writes the archive as it exits, which it does when its stdin closes: wait for that
    proc = getattr(gateway, "proc", None)
    if proc is not None:
        proc.stdin.close()
        proc.wait(timeout=300)


if __name__ == "__main__":
    _training_job(sys.argv[1])
