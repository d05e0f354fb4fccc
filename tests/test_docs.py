"""README.md stays a five-minute read, and no link or image in it or in docs/ points at nothing.

README.md is at most 200 lines; every relative link and image in README.md and docs/*.md names a
file or folder that exists, and a link to a heading (`page.md#anchor`, `#anchor`) names a heading
that page has, spelled as GitHub spells its anchors.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans (whose brackets and hashes are not markdown)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(page: Path) -> list[str]:
    """Every link and image target in a page, in order."""
    return LINK.findall(prose(page.read_text()))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated heading numbered (`-1`, `-2`, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_readme_is_a_five_minute_read() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the reference into docs/")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_image_exists(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        if SCHEME.match(target) or not path:
            continue
        where = (page.parent / path).resolve()
        if not where.exists():
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_within_a_page_names_one_of_its_headings(page: Path) -> None:
    missing = [t for t in links(page) if t.startswith("#") and t[1:] not in anchors(page)]
    assert not missing, f"{page.relative_to(ROOT)}: {missing}"


def test_the_readme_links_the_reference_and_shows_its_picture() -> None:
    targets = links(README)
    assert "docs/figures/e3_timeline.png" in targets
    for page in ("architecture", "operations", "cli", "experiments", "benchmarks", "teaching", "development"):
        assert f"docs/{page}.md" in targets, page


def test_the_anchor_rules_match_github() -> None:
    page = ROOT / "docs" / "operations.md"
    assert {"kubernetes--kubeflow-tf_config", "the-run-directory", "beyond-one-machine"} <= anchors(page)
    assert "5-why-synchronous-training-waits-for-the-slowest-worker-e3" in anchors(ROOT / "docs" / "teaching.md")
    assert "copy-the-run-directory-out" not in anchors(page)  # a comment in a bash block is no heading


def test_teachings_reproduce_table_lists_every_spec_with_its_point_counts() -> None:
    """docs/teaching.md's "Reproduce everything" table: one row per spec in experiments/, and its
    "points: full / reduced" are the numbers of points the spec makes (a changed grid changes them)."""
    from asyncps.tools.experiment.spec import load_spec

    text = (ROOT / "docs" / "teaching.md").read_text()
    rows = dict(re.findall(r"^\| \[(e\d+_\w+)\]\([^)]*\) \|.*\| (\d+ / \d+) \|$", text, re.MULTILINE))
    specs = sorted((ROOT / "experiments").glob("e*.yaml"))
    assert sorted(rows) == [p.stem for p in specs]
    for path in specs:
        counts = f"{len(load_spec(path).points())} / {len(load_spec(path, reduced=True).points())}"
        assert rows[path.stem] == counts, (path.stem, rows[path.stem], counts)
