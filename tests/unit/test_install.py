"""The install: pinned versions, and pyspark's files are its own (pyspark-client writes into pyspark/)."""

import base64
import hashlib
import importlib.metadata as md
import re
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements.txt"


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
