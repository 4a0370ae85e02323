"""The README's table of contents points at its headings, and its examples use defined names."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(text: str) -> list[tuple[int, str]]:
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^(#{2,3}) (.+)$", line)):
            out.append((len(m.group(1)), m.group(2)))
    return out


def test_every_contents_link_names_a_heading_and_every_section_is_listed() -> None:
    text = README.read_text()
    anchors = {github_anchor(h) for _, h in headings(text)}
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    assert links, "the README has no table of contents"
    assert set(links) <= anchors, sorted(set(links) - anchors)
    sections = {github_anchor(h) for level, h in headings(text) if level == 2} - {"contents"}
    assert sections <= set(links), sorted(sections - set(links))
