"""The documentation: the manual in docs/ builds with `mkdocs build --strict` (no broken link or anchor,
no page left out of the nav), and the README stays a front door (short, every relative link resolves)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 150

# mkdocs is pinned in requirements.txt, so it is installed in the same virtualenv as the tests' Python
MKDOCS = Path(sys.executable).parent / "mkdocs"


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    assert MKDOCS.exists(), f"{MKDOCS} is missing: mkdocs is pinned in requirements.txt (run make setup)"
    # NO_MKDOCS_2_WARNING: material prints a banner about its end of life; not a problem of these pages
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, env=env, capture_output=True, text=True, timeout=300)


def _warnings(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if re.match(r"^\s*(WARNING|ERROR)\b", ln)]


def test_the_manual_builds_strict_without_warnings(tmp_path):
    r = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and not _warnings(out), f"mkdocs build --strict failed:\n{out}"
    assert (tmp_path / "site" / "operations" / "runbook" / "index.html").exists()


def test_a_broken_link_fails_the_build(tmp_path):
    """The check above would pass vacuously if strict mode let links through: a copy of the manual
    with one link to a missing anchor and one to a missing page must fail, naming both."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + "\n[gone](concepts.md#no-such-section) [missing](no-such-page.md)\n")
    r = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "no-such-section" in out and "no-such-page.md" in out, out


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the manual belongs in docs/"


def _relative_links(markdown: str) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)  # links are not read inside code blocks
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, flags=re.M)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_every_relative_link_of_the_readme_resolves():
    links = _relative_links(README.read_text())
    assert links, "the README links to the manual"
    missing = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert missing == [], f"README.md links to files that do not exist: {missing}"


def test_the_readme_points_at_every_page_of_the_manual():
    linked = {(ROOT / t.split("#")[0]).resolve() for t in _relative_links(README.read_text())}
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md")}
    assert pages - linked == set(), f"pages the README does not link: {sorted(map(str, pages - linked))}"


def test_the_readme_stream_file_is_valid():
    """The README's stream file is the first one a user copies: it must parse as a stream."""
    import yaml
    from tidemark.config import parse_config

    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1
    cfg = parse_config(yaml.safe_load(blocks[0]), "README.md")
    assert cfg.stream == "orders"


def test_the_lease_table_of_the_concepts_page_is_the_code_s():
    """docs/concepts.md prints which jobs run side by side; it must say what `lock_compatible` does."""
    from tidemark.control.db import LOCK_PURPOSES, lock_compatible

    text = (ROOT / "docs" / "concepts.md").read_text()
    section = text.split("## Which jobs run side by side", 1)[1].split("\n## ", 1)[0]
    printed = {}
    for row in re.findall(r"^\| (`.*?) \| (.*?) \|$", section, flags=re.M):
        beside = set(re.findall(r"`([a-z-]+)`", row[1]))
        for purpose in re.findall(r"`([a-z-]+)`", row[0]):
            printed[purpose] = beside
    assert printed == {a: {b for b in LOCK_PURPOSES if lock_compatible(a, b)} for a in LOCK_PURPOSES}
