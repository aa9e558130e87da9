"""The documentation: the site builds with warnings as errors, its internal links resolve, the
generated reference pages match the code, and the README's links and feature table hold."""

from __future__ import annotations

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from server_utils import REPO_ROOT, cli_env

pytest.importorskip("mkdocs")


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"])
        for name in ("href", "src"):
            if values.get(name):
                self.links.append(values[name])


def _parse(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text())
    return parser


def test_reference_pages_match_the_code() -> None:
    result = subprocess.run([sys.executable, "scripts/docs_reference.py", "--check"],
                            cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_site_builds_strict_and_internal_links_resolve(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                             str(site)], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 12
    anchors = {page: _parse(page).ids for page in pages}
    broken = []
    for page in pages:
        for link in _parse(page).links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "data:")):
                continue
            base = site if parts.path.startswith("/") else page.parent  # 404.html is absolute
            target = (base / parts.path.lstrip("/")).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {link}")
            elif parts.fragment and target.suffix == ".html" and parts.fragment not in anchors.get(
                    target, _parse(target).ids):
                broken.append(f"{page.relative_to(site)}: {link} (no such anchor)")
    assert not broken, broken


def test_readme_links_resolve_and_every_check_links_to_its_page() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if not re.match(r"[a-z]+://", target):
            assert (REPO_ROOT / target.split("#")[0]).exists(), target
    rows = [line for line in readme.splitlines() if line.startswith("| ") and "✔" in line]
    assert len(rows) >= 8
    for row in rows:
        pagellm_cell = row.split("|")[2]
        if "✔" in pagellm_cell:
            assert re.fullmatch(r"\s*\[✔[^\]]*\]\(docs/[^)]+\.md(#[\w-]+)?\)\s*", pagellm_cell), row
