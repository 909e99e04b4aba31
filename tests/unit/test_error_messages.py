"""What an operator reads: a full disk is a named, deterministic error naming where and how many
bytes (in the driver and from a Python worker's failure text), a Tidemark error prints as one line of
what and where plus its remedy on a line of its own, no traceback, and LSNs are ``X/Y``."""

from __future__ import annotations

import errno
import io
import re
import sys
from pathlib import Path

import pytest

from tidemark import cli, sparkconf
from tidemark import failures
from tidemark.errors import LakeFull, TidemarkError, describe, facts_behind, normalize_reason, says_no_space
from tidemark.failures import failure_class, is_transient
from tidemark.landing.store import StoreFull

ROOT = Path(__file__).resolve().parents[2]


class Py4JJavaError(Exception):
    pass


Py4JJavaError.__module__ = "py4j.protocol"

# a merge task whose Parquet write met a full lake: what reaches the driver (the executor's Python
# traceback inside the JVM's failure), first as the raw OSError pyarrow raises, then as the LakeFull
# `layout.write_parquet` makes of it
WORKER_ENOSPC = """An error occurred while calling o212.collectAsArrowToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 1 in stage 5.0 failed 1 times, most \
recent failure: Lost task 1.0 in stage 5.0 (TID 11) (host executor driver): \
org.apache.spark.api.python.PythonException: Traceback (most recent call last):
  File "/work/include/tidemark/lake/layout.py", line 341, in write_parquet
    out.write(data)
  File "pyarrow/io.pxi", line 357, in pyarrow.lib.NativeFile.write
OSError: [Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(PythonRunner.scala:652)
"""


def worker_failure(inner: str) -> Py4JJavaError:
    return Py4JJavaError(WORKER_ENOSPC.replace(
        "OSError: [Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device", inner))


def test_a_lake_file_that_does_not_fit_is_lake_full_naming_the_file_and_its_bytes(tmp_path):
    """`layout.write_parquet` on a full disk: a LakeFull naming the file, its size and the bytes free,
    with no partial file left; deterministic (a retry meets the same full disk)."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    from tidemark.lake import layout

    fs = pafs.LocalFileSystem()
    path = str(tmp_path / "lake" / "s" / "tables" / "public.t" / "_bucket=0" / "part-x.parquet")
    Path(path).parent.mkdir(parents=True)

    class FullStream:
        def __init__(self, real):
            self.real = real

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.real.close()

        def write(self, data):
            self.real.write(data.to_pybytes()[:10])        # part of it made it to the disk
            raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    class FullFS:
        def open_output_stream(self, p):
            return FullStream(fs.open_output_stream(p))

        def delete_file(self, p):
            fs.delete_file(p)

    table = pa.table({"k": list(range(1000)), "v": [f"value {i}" for i in range(1000)]})
    with pytest.raises(LakeFull) as err:
        layout.write_parquet(table, path, FullFS())
    exc = err.value
    assert not Path(path).exists()                                   # nothing partial left
    assert exc.facts["path"] == path and exc.facts["needed"] > 1000 and exc.facts["free"] > 0
    what, remedy = describe(exc)
    assert what.startswith("the lake is full: no space left for the file " + path)
    assert f"needs at least {exc.facts['needed']:,} bytes" in what and "{" not in what
    assert remedy.startswith("free space on the lake's volume")
    assert isinstance(exc.__cause__, OSError) and not is_transient(exc) and failure_class(exc) == "deterministic"


def test_a_python_workers_enospc_is_classified_as_a_full_disk_not_transient():
    """The raw ``OSError: [Errno 28]`` of a Python worker (wrapped in a PySpark exception) and the
    LakeFull a worker raised both classify as a full disk, deterministic; with the LakeFull's facts
    the reason names the lake's file and the bytes it needs."""
    cfg = _cfg("/data/lake", "/data/landing")
    raw = worker_failure("OSError: [Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on "
                         "device")
    assert says_no_space(raw) and not is_transient(raw) and failure_class(raw) == "deterministic"
    reason, fix = failures.classify(raw, cfg, master="local[2]")
    assert reason.startswith("a disk is full (") and "No space left on device" in reason
    assert "/data/lake" in fix and "/data/landing" in fix and "spark.local.dir" in fix

    full = LakeFull({"path": "/data/lake/s/tables/public.t/_bucket=3/part-1.parquet", "what": "the file",
                     "needed": 1234567, "free": 4096})
    wrapped = worker_failure("tidemark.errors.LakeFull: " + str(full))
    assert facts_behind(wrapped, LakeFull) == full.facts and not is_transient(wrapped)
    reason, fix = failures.classify(wrapped, cfg, master="local[2]")
    assert reason == ("the lake is full: no space left for the file /data/lake/s/tables/public.t/_bucket=3/"
                      "part-1.parquet (it needs at least 1,234,567 bytes; 4,096 bytes free)")
    assert "lake.path /data/lake" in fix
    # the next run meets it in another task's file, with other amounts: the same cause (one incident counting)
    other = LakeFull({"path": "/data/lake/s/changelog/public.t/_commit_date=2026-11-27/part-2.parquet",
                      "what": "the file", "needed": 99, "free": 0})
    assert normalize_reason(LakeFull.describe(other.facts)) == normalize_reason(reason)
    # the driver's own: deltalake's commit says only "os error 28"
    delta = Exception("Failed to parse parquet: External: Generic LocalFileSystem error: Unable to copy data to "
                      "file: No space left on device (os error 28)")
    assert says_no_space(delta) and not is_transient(delta)


def test_a_full_landing_store_is_not_retried_as_transient(tmp_path):
    """StoreFull was raised in an ``except OSError`` (its context a bare OSError), which `is_transient`
    counted as an unknown, transient error."""
    from tidemark.landing.store import LocalStore

    store = LocalStore(str(tmp_path))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    import tidemark.landing.store as S

    real = S.os.fdopen
    S.os.fdopen = full
    try:
        with pytest.raises(StoreFull) as err:
            store.put("s/segments/a.avro", b"x" * 100)
    finally:
        S.os.fdopen = real
    assert not is_transient(err.value) and failure_class(err.value) == "deterministic"
    what, remedy = describe(err.value)
    assert "no space left for s/segments/a.avro" in what and "needs at least 100 bytes" in what
    assert remedy.startswith("free space there or point landing.url elsewhere")


def test_describe_splits_what_from_the_remedy_and_never_prints_frames():
    from tidemark.consolidate.job import ConsolidateFailed

    detail = {"remedy": "raise spark.driver.memory, then run `tidemark consolidate s` again"}
    exc = ConsolidateFailed(f"consolidation failed (incident 4): stream s, table public.t, while merging: out of "
                            f"memory; remedy: {detail['remedy']}", incident=4, detail=detail)
    assert describe(exc) == ("consolidation failed (incident 4): stream s, table public.t, while merging: out of "
                             "memory", detail["remedy"])
    assert describe(TidemarkError("stream s: bad; remedy: do this")) == ("stream s: bad", "do this")
    assert describe(TidemarkError("stream s: no remedy here")) == ("stream s: no remedy here", None)
    what, remedy = describe(worker_failure("ValueError: boom"))
    assert what == "Py4JJavaError: ValueError: boom" and remedy is None


def test_the_cli_prints_a_tidemark_error_as_one_line_and_its_remedy(monkeypatch):
    """A Tidemark error: one line of what and where, the remedy on its own line, no traceback (the
    traceback only with TIDEMARK_DEBUG=1); any other error: its first meaningful line, no frames."""
    from tidemark.consolidate.job import ConsolidateFailed

    def boom(args):
        raise ConsolidateFailed("consolidation failed (incident 7): stream s, table public.t: the lake is full: no "
                                "space left for the file /lake/x.parquet (it needs at least 10 bytes); remedy: free "
                                "space, then run `tidemark consolidate s` again", incident=7,
                                detail={"remedy": "free space, then run `tidemark consolidate s` again"})

    def spark_boom(args):
        raise worker_failure("ValueError: boom")

    parser = cli.build_parser()
    for fn, code in ((boom, 2), (spark_boom, 1)):
        monkeypatch.setattr(cli, "build_parser", lambda: _with_fn(parser, fn))
        monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
        err = io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        assert cli.main(["segments", "s"]) == code
        lines = err.getvalue().splitlines()
        assert "Traceback" not in err.getvalue() and "\tat " not in err.getvalue() and "File \"" not in err.getvalue()
        assert lines[0].startswith("tidemark: error: ") and len(lines[0]) <= 220, lines
        if fn is boom:
            assert lines == ["tidemark: error: consolidation failed (incident 7): stream s, table public.t: the lake "
                             "is full: no space left for the file /lake/x.parquet (it needs at least 10 bytes)",
                             "tidemark: remedy: free space, then run `tidemark consolidate s` again"]
        else:
            assert lines[0] == "tidemark: error: Py4JJavaError: ValueError: boom" and len(lines) == 2
        monkeypatch.setenv(cli.DEBUG_ENV, "1")
        err = io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        assert cli.main(["segments", "s"]) == code
        assert "Traceback (most recent call last)" in err.getvalue()


def _with_fn(parser, fn):
    import argparse

    class P(argparse.ArgumentParser):
        def parse_args(self, argv=None, namespace=None):
            args = parser.parse_args(argv)
            args.fn = fn
            return args

    return P()


def test_library_messages_write_lsns_as_x_slash_y():
    """No raise or log site formats an LSN variable as a raw integer: every ``{…lsn…}``,
    ``{…frontier…}``, ``{…upper…}``/``{…lower…}`` placeholder in an f-string of the library goes
    through `format_lsn` (segment file names and snapshot ids, hexadecimal on purpose, and the
    external feed's times excepted)."""
    # file names and keys in hexadecimal; an external feed's times; sensors.py's frontier is lsn_text's
    # already
    allowed = {"feeds.py", "segments.py", "lsn.py", "changelog.py", "feed_files.py", "snapshot.py", "merge.py", "layout.py",
               "sensors.py", "segment_format.py", "segment_reader.py", "feed_format.py"}
    bad = []
    for path in sorted((ROOT / "include" / "tidemark").rglob("*.py")) + sorted((ROOT / "plugins").rglob("*.py")):
        if path.name in allowed:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not re.search(r"\bf[\"']", line):
                continue
            for m in re.finditer(r"\{([^{}]*)\}", line):
                expr = m.group(1).split(":")[0].split("!")[0]
                if re.fullmatch(r"[A-Za-z_][\w.]*(\[\d\])?", expr.strip()) \
                        and re.search(r"(lsn|frontier|upper|lower|confirmed|covers)", expr, re.I):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_lost_lease_message_names_the_frontier_as_an_lsn():
    """`consolidate/job.py` confirmed its lease "before: advance the frontier to 38467464"."""
    text = (ROOT / "include" / "tidemark" / "consolidate" / "job.py").read_text()
    confirms = re.findall(r"lease\.confirm\((f\"[^\n]*)\)", text)
    assert confirms and all("{frontier}" not in c for c in confirms), confirms


def _cfg(lake: str, landing: str):
    from tidemark.config import parse_config

    return parse_config({"stream": "s", "source": {"connection": "src", "slot": "s_slot", "publication": "s_pub",
                                                   "tables": ["public.t"]},
                         "landing": {"url": landing}, "lake": {"path": lake}})
