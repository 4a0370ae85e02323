"""Every relative link in README.md, CHANGELOG.md and docs/*.md points at a file or folder of the
repository, and a link with a `#fragment` into a Markdown page names one of its headings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (where brackets are not links)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def anchors(page: Path) -> set[str]:
    """The anchors of the page's headings (outside fenced code, where `#` is a comment)."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.+)$", line)):
            found.add(github_anchor(m.group(1)))
    return found


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def test_the_pages_exist_and_link_somewhere() -> None:
    assert all(page.is_file() for page in PAGES)
    assert links(ROOT / "README.md"), "the README links no docs page"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        path_part, _, fragment = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            broken.append(
                f"{target}: no {path.relative_to(ROOT) if ROOT in path.parents else path}"
            )
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{target}: {path.name} has no heading with anchor #{fragment}")
    assert not broken, broken
