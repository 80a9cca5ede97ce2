"""The README a newcomer reads and the docs site: short, built, and no link broken."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_docs_site_builds_with_no_broken_link_or_anchor(tmp_path):
    """mkdocs' strict mode fails on a link or anchor between pages that does not resolve."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "site" / "serving" / "index.html").exists()


def anchors(page: Path) -> set[str]:
    """The heading ids mkdocs gives `page` (Python-Markdown's toc slugs)."""
    from markdown.extensions.toc import slugify

    return {slugify(h, "-") for h in re.findall(r"^#+\s+(.*)$", page.read_text(), flags=re.M)}


def test_every_link_in_the_readme_resolves():
    broken = []
    for target in LINK.findall((ROOT / "README.md").read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / path) if path else ROOT / "README.md"
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(target)
    assert broken == []


def test_the_readme_is_short_enough_to_read_in_five_minutes():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_each_plot_the_docs_copy_from_a_benchmark_is_its_recorded_plot():
    """The site cannot reach benchmarks/results/, so docs/results/ holds copies of its plots: a
    re-run that records a new result must copy its plot too, or the docs show the old one."""
    stale = []
    for copy in sorted((ROOT / "docs/results").glob("*.png")):
        recorded = ROOT / "benchmarks/results" / copy.name
        if not recorded.exists():  # a run recorded in its own directory: the one plot at its top
            plots = sorted((ROOT / "benchmarks/results" / copy.stem).glob("*.png"))
            recorded = plots[0] if len(plots) == 1 else None
        if recorded is not None and recorded.read_bytes() != copy.read_bytes():
            stale.append(copy.name)
    assert stale == []
