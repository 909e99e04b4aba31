"""The JVM class-data-sharing archive's bookkeeping (`tidemark.cds`): which file, when it
is used, and that a build never leaves half an archive where a JVM would look for it."""

import os
import subprocess
from pathlib import Path

import pytest

from tidemark import cds


@pytest.fixture
def spark_home(tmp_path, monkeypatch):
    """A fake Spark installation (jars only) and a private cache directory."""
    home = tmp_path / "spark"
    (home / "jars").mkdir(parents=True)
    for name in ("spark-core.jar", "spark-sql.jar"):
        (home / "jars" / name).write_bytes(b"jar " + name.encode())
    monkeypatch.setenv("SPARK_HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(cds.ENV, raising=False)
    return home


def test_the_archive_is_named_after_the_installation_and_its_jars(spark_home):
    first = cds.archive_path()
    assert first.parent == spark_home.parent / "cache" / "tidemark" and first.suffix == ".jsa"
    assert cds.archive_path() == first
    # pip reinstalling pyspark rewrites the jars: the JVM would refuse the old archive, so the name changes
    jar = spark_home / "jars" / "spark-sql.jar"
    os.utime(jar, ns=(jar.stat().st_atime_ns, jar.stat().st_mtime_ns + 1_000_000_000))
    second = cds.archive_path()
    assert second != first
    # ...but only its last part: the installation's part stays (stale archives of it are found)
    assert second.name.rsplit("-", 1)[0] == first.name.rsplit("-", 1)[0]


def test_the_option_is_given_only_when_the_archive_exists(spark_home, monkeypatch, tmp_path):
    assert cds.driver_java_options() == ""
    path = cds.archive_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"archive")
    assert cds.driver_java_options() == f"-XX:SharedArchiveFile={path}"
    monkeypatch.setenv(cds.ENV, "off")
    assert cds.archive_path() is None and cds.driver_java_options() == ""
    assert cds.build() == {"path": None, "built": False, "seconds": 0.0, "bytes": 0, "reason": f"{cds.ENV}=off"}
    monkeypatch.setenv(cds.ENV, str(tmp_path / "elsewhere.jsa"))
    assert cds.archive_path() == tmp_path / "elsewhere.jsa" and cds.driver_java_options() == ""


def test_a_driver_jvm_gets_the_archive_then_the_first_jit_tier_only(spark_home, tmp_path):
    assert cds.jvm_options() == "-XX:TieredStopAtLevel=1"
    path = cds.archive_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"archive")
    assert cds.jvm_options() == f"-XX:SharedArchiveFile={path} -XX:TieredStopAtLevel=1"


def test_a_build_renames_a_complete_archive_into_place_and_drops_stale_ones(spark_home, monkeypatch):
    path = cds.archive_path()
    path.parent.mkdir(parents=True)
    stale = path.with_name(path.name.rsplit("-", 1)[0] + "-0123456789.jsa")
    stale.write_bytes(b"old jars")
    other = path.with_name("spark-9.9.9-otherinstall-0123456789.jsa")     # another installation's: kept
    other.write_bytes(b"theirs")
    calls = []

    def child(cmd, **kwargs):
        calls.append(cmd)
        assert kwargs["env"][cds.ENV] == "off"           # the training JVM must not map an archive itself
        out = Path(cmd[-1])
        assert out.parent == path.parent and out.name.startswith(path.name) and out.name.endswith(".tmp")
        out.write_bytes(b"x" * 1000)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cds.subprocess, "run", child)
    res = cds.build()
    assert res["built"] and res["path"] == str(path) and res["bytes"] == 1000
    assert path.read_bytes() == b"x" * 1000
    assert not stale.exists() and other.exists()
    assert not list(path.parent.glob("*.tmp"))
    assert cds.build()["built"] is False and len(calls) == 1          # exists: nothing to do
    assert cds.build(force=True)["built"] and len(calls) == 2


def test_a_failed_build_says_why_and_leaves_nothing(spark_home, monkeypatch):
    def child(cmd, **kwargs):
        Path(cmd[-1]).write_bytes(b"half")
        return subprocess.CompletedProcess(cmd, 1, "", "Error occurred during initialization of VM")

    monkeypatch.setattr(cds.subprocess, "run", child)
    with pytest.raises(RuntimeError, match="initialization of VM") as err:
        cds.build()
    assert str(cds.archive_path()) in str(err.value)
    assert not cds.archive_path().exists() and not list(cds.archive_path().parent.glob("*"))
