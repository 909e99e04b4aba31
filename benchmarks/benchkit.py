"""Shared set-up and tear-down for the benchmarks (not a benchmark itself: run_all.py runs bench_*.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tidemark.local.localpg import LocalCluster

FAST_PG = {"fsync": "off", "synchronous_commit": "off"}
# a cluster that takes one transaction of gigabytes of WAL (the memory benchmarks)
BIG_WAL_PG = {**FAST_PG, "full_page_writes": "off", "max_wal_size": "8GB", "wal_sender_timeout": "0"}


def tree_rss_mb(roots) -> tuple[float, int]:
    """(resident memory in MB, processes) of the ``roots`` (psutil processes) and all their descendants:
    a Spark Connect server's Python worker daemons leave its process group, so a group is not enough."""
    import psutil

    procs: dict = {}
    for root in roots:
        try:
            procs.update((p.pid, p) for p in (root, *root.children(recursive=True)))
        except psutil.Error:
            continue
    total = 0
    for p in procs.values():
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20, len(procs)


def work_dir(prefix: str) -> Path:
    """A new temporary directory the cluster's postgres user can enter."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(work, 0o755)
    return work


def started_cluster(prefix: str) -> tuple[Path, LocalCluster]:
    """A new `work_dir` and a started cluster under ``work / "pg"`` with durability off; return both."""
    work = work_dir(prefix)
    cluster = LocalCluster(work / "pg", settings=dict(FAST_PG))
    cluster.start()
    return work, cluster


def consolidate_databases(cluster: LocalCluster) -> None:
    """Create the control database and the source database the stream configs name."""
    cluster.ensure_database("tidemark_control")
    cluster.ensure_database("bench_source")


def local_spark(master: str, app: str, *conf: tuple[str, str]):
    """A quiet local SparkSession with the settings the library always gives one (`sparkconf.ALWAYS`:
    UTC, Arrow, Python workers over Unix domain sockets); ``conf`` adds (key, value) settings."""
    from pyspark.sql import SparkSession

    from tidemark.sparkconf import ALWAYS

    builder = SparkSession.builder.master(master).appName(app).config("spark.ui.enabled", "false")
    for key, value in [*ALWAYS.items(), *conf]:
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def teardown(cluster: LocalCluster, work: Path, spark=None, *, keep: bool = False) -> None:
    """Stop Spark (if any) and the cluster, then remove ``work`` unless ``keep``."""
    if spark is not None:
        spark.stop()
    cluster.stop()
    if not keep:
        shutil.rmtree(work, ignore_errors=True)


def drain_databases(cluster: LocalCluster) -> tuple[str, str, str]:
    """Create bench_src and bench_ctl, export their Airflow connections; return (src, ctl_db, ctl_dsn)."""
    src, ctl_db = "bench_src", "bench_ctl"
    cluster.ensure_database(src)
    ctl_dsn = cluster.ensure_database(ctl_db)
    os.environ["AIRFLOW_CONN_BENCH_SRC"] = cluster.uri(src)
    os.environ["AIRFLOW_CONN_BENCH_CTL"] = cluster.uri(ctl_db)
    return src, ctl_db, ctl_dsn


def land_segment(cfg, ctl, store, builder, seq: int, lower: int, upper: int) -> int:
    """Build, store and register one segment ``[lower, upper)`` of a `SegmentBuilder`; return its bytes."""
    from tidemark.control import Segment
    from tidemark.landing.segments import checksum
    from tidemark.landing.store import segment_key

    data = builder.build(upper)
    uri = store.put(segment_key(cfg.stream, seq, lower, upper), data)
    ctl.register_segment(Segment(cfg.stream, seq, lower, upper, uri, builder.records, builder.txns,
                                 len(data), checksum(data)))
    return len(data)


class TreePeaks:
    """Peak RSS (MB) of a running command's process tree, sampled every 0.2 s until it ends (a
    thread): ``jvm`` (the java processes under it), ``workers`` (the Python processes under the JVM,
    together), ``worker`` (the largest one), ``root`` (the command's own process). ``join()`` after
    the command ended."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.peaks = {"jvm": 0.0, "workers": 0.0, "worker": 0.0, "root": 0.0}
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        root = psutil.Process(self.proc.pid)
        mb = 2 ** 20
        while self.proc.poll() is None:
            try:
                jvm = [p for p in root.children(recursive=True) if p.name().startswith("java")]
                workers = []
                for j in jvm:
                    for p in j.children(recursive=True):
                        try:
                            workers.append(p.memory_info().rss)
                        except psutil.Error:
                            pass
                seen = {"jvm": sum(p.memory_info().rss for p in jvm) / mb, "workers": sum(workers) / mb,
                        "worker": max(workers, default=0) / mb, "root": root.memory_info().rss / mb}
                for k, v in seen.items():
                    self.peaks[k] = max(self.peaks[k], v)
            except psutil.Error:
                pass
            time.sleep(0.2)

    def join(self) -> dict[str, float]:
        self._thread.join()
        return self.peaks
