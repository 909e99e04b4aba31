"""The install: pinned versions, and pyspark's files are its own (pyspark-client writes into pyspark/)."""

import base64
import os
import hashlib
import importlib.metadata as md
import re
from pathlib import Path

import pytest

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements.txt"
# imported only where present, never required: croniter (comes with Airflow; without it a stream file's
# `lake.maintain` cron is checked by its shape)
OPTIONAL = {"croniter"}


def _pins() -> dict[str, str]:
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line.strip())
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def test_every_requirement_is_pinned():
    lines = [ln.strip() for ln in REQUIREMENTS.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    unpinned = [ln for ln in lines if "==" not in ln]
    assert unpinned == []
    assert {"apache-airflow", "pyspark", "deltalake", "fastavro", "psycopg2-binary", "boto3"} <= set(_pins())


def test_pyspark_reports_the_pinned_version():
    import pyspark

    want = _pins()["pyspark"]
    assert pyspark.__version__ == want
    assert md.version("pyspark") == want


def test_pyspark_files_are_its_own():
    dist = md.distribution("pyspark")
    checked = mismatched = 0
    for f in dist.files or []:
        if not f.hash or not str(f).startswith("pyspark/") or not str(f).endswith(".py"):
            continue
        data = Path(f.locate()).read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.new(f.hash.mode, data).digest()).rstrip(b"=").decode()
        checked += 1
        mismatched += digest != f.hash.value
    assert checked > 500, "pyspark's RECORD lists too few files: is pyspark installed?"
    assert mismatched == 0, f"{mismatched} of pyspark's files were overwritten (reinstall pyspark --no-deps)"


def test_installed_versions_match_the_pins():
    wrong = {}
    for name, version in _pins().items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            wrong[name] = (version, None)
            continue
        if have != version:
            wrong[name] = (version, have)
    assert wrong == {}


def _library_imports() -> set[str]:
    """Top-level names of every third-party package the library imports (also inside functions)."""
    import ast
    import sys

    names: set[str] = set()
    for path in (REQUIREMENTS.parent / "include" / "tidemark").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("tidemark", "__future__")} - OPTIONAL


def test_library_imports_are_known():
    # a new import must be declared in include/pyproject.toml; the slow test below proves it installs
    assert _library_imports() == {"psycopg2", "psycopg", "fastavro", "boto3", "pyarrow", "numpy",
                                  "pyspark", "yaml", "deltalake", "xxhash", "backports"}, _library_imports()


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(spec: str) -> str:
    return _norm(re.match(r"^\s*([A-Za-z0-9_.\-]+)", spec).group(1))


def test_every_package_the_library_imports_is_declared_by_include():
    """Each third-party package the library imports comes from a distribution that include/pyproject.toml
    declares, or that a declared one requires (botocore through boto3): `pip install ./include` alone
    brings it (the nightly profile runs that install)."""
    import tomllib

    declared = {_requirement_name(d) for d in
                tomllib.loads((REQUIREMENTS.parent / "include" / "pyproject.toml").read_text())["project"]["dependencies"]}
    reachable = set(declared)
    for name in declared:
        for req in md.requires(name) or []:
            if "extra ==" not in req:
                reachable.add(_requirement_name(req))
    providers = md.packages_distributions()
    missing = {mod: providers.get(mod) for mod in _library_imports()
               if not {_norm(d) for d in providers.get(mod, [])} & reachable}
    assert missing == {}, f"imported by the library, not declared in include/pyproject.toml: {missing}"


@pytest.mark.slow
@pytest.mark.nightly(reason="the declared list is checked above in a second; installing it (a minute of pip) "
                            "is the nightly profile's")
def test_pip_install_include_alone_gives_a_working_cli(tmp_path):
    """A fresh virtualenv, ``pip install ./include`` (its declared dependencies only, at the pinned
    versions through ``--constraint``; pip's wheel cache keeps it to about a minute): the CLI answers
    ``--help`` and every package the library imports can be imported."""
    import subprocess
    import sys
    import venv

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    root = REQUIREMENTS.parent
    # --no-compile: byte-compiling every installed module (pyspark's, botocore's, ...) is most of an
    # install's time and checks nothing here; the imports below compile what they load
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                          "--constraint", str(REQUIREMENTS), str(root / "include")],
                         capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    help_ = subprocess.run([str(env_dir / "bin" / "tidemark"), "--help"], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=120)
    assert help_.returncode == 0 and "drain" in help_.stdout, help_.stderr[-3000:]
    code = ("import importlib, sys\n"
            f"for name in {sorted(_library_imports())!r}: importlib.import_module(name)\n"
            "import tidemark.capture.drain, tidemark.consolidate.job, tidemark.landing.store\n"
            "print(tidemark.capture.drain.__file__)")
    imp = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert imp.returncode == 0, imp.stderr[-3000:]
    assert str(env_dir) in imp.stdout          # the installed copy, not the checkout
    assert sys.prefix != str(env_dir)
