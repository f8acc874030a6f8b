"""The README and docs/ point only at what exists: every relative link resolves to a file (and its
`#anchor` to a heading of that file), and every benchmark or script they name is in the tree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[str]:
    return [target for target in LINK.findall(FENCE.sub("", path.read_text()))
            if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_relative_link_in_the_docs_resolves(doc):
    broken = []
    for target in _links(doc):
        name, _, anchor = target.partition("#")
        file = (doc.parent / name).resolve() if name else doc
        if not file.exists() or (
            anchor and file.suffix == ".md" and anchor not in _anchors(file)
        ):
            broken.append(target)
    assert broken == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_benchmark_and_script_the_docs_name_exists(doc):
    named = set(re.findall(r"\b((?:benchmarks|scripts)/[\w.-]+\.(?:py|sh))\b", doc.read_text()))
    assert sorted(name for name in named if not (ROOT / name).exists()) == []


def test_the_readme_stays_short_and_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 300
    linked = {Path(target.partition("#")[0]).name for target in _links(ROOT / "README.md")}
    assert sorted(path.name for path in DOCS[1:] if path.name not in linked) == []
