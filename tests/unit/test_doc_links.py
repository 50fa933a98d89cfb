"""Every relative link in the user docs resolves: README.md, BENCHMARKS.md,
docs/*.md and examples/**/README.md. A link's file must exist (relative to
the linking page); a ``#anchor`` into a Markdown page must name one of its
headings, slugged as GitHub does. Links inside code blocks and code spans
are text, not links; http(s) and mailto links are not fetched.

BENCHMARKS.md keeps an index: every ``## `` entry is linked from it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: ``[text](target)`` and ``![alt](target)``; the target ends at whitespace or ``)``.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def doc_pages() -> list[Path]:
    pages = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
    pages += sorted((REPO / "examples").glob("**/README.md"))
    return [p for p in pages if p.is_file()]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks, code spans removed."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, re.sub(r"(`+)(?:(?!\1).)+\1", "", line)))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (before de-duplication)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def headings(page: Path, level: str = "#{1,6}") -> list[str]:
    """The anchors of ``page``'s headings (of ``level``), de-duplicated as GitHub does."""
    seen: dict[str, int] = {}
    out = []
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(rf"^({level})\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        slug = github_slug(m.group(2))
        out.append(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def anchors(page: Path) -> set[str]:
    return set(headings(page))


def broken_links(page: Path) -> list[str]:
    problems = []
    for n, line in prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)}:{n}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where} (no heading with anchor #{anchor} in {dest.relative_to(REPO)})")
    return problems


def test_every_relative_link_resolves():
    pages = doc_pages()
    assert REPO / "README.md" in pages and len(pages) > 5
    problems = [p for page in pages for p in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_benchmarks_index_links_every_entry():
    page = REPO / "BENCHMARKS.md"
    text = page.read_text()
    entries = [e for e in headings(page, level="##") if e != "index"]
    linked = {t.partition("#")[2] for _, line in prose_lines(text) for t in LINK.findall(line) if t.startswith("#")}
    missing = [e for e in entries if e not in linked]
    assert not missing, f"BENCHMARKS.md: add these entries to its index: {missing}"


def test_testing_page_lists_every_test_file():
    """docs/testing.md's inventory has a row for every test file."""
    text = (REPO / "docs" / "testing.md").read_text()
    missing = [f"{p.parent.name}/{p.name}" for p in sorted((REPO / "tests").glob("*/test_*.py"))
               if f"| `{p.name}` |" not in text.split(f"### tests/{p.parent.name}\n", 1)[-1].split("\n### ", 1)[0]]
    assert not missing, f"docs/testing.md: add an inventory row (what it proves, its tolerance) for {missing}"


def test_the_checker_catches_what_it_should(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A page\n## Loading: `data.num_workers`\n## Same\n## Same\n"
        "[ok](b.md) [ok](#a-page) [ok](#loading-datanum_workers) [ok](#same-1) [web](https://x.org/y)\n"
        "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
        "[gone](c.md) [bad anchor](b.md#nope) [dir](../docs)\n"
    )
    (tmp_path / "docs" / "b.md").write_text("# B\n")
    problems = broken_links(tmp_path / "docs" / "a.md")
    assert [p.split(": ", 1)[1] for p in problems] == [
        "c.md (no such file)", "b.md#nope (no heading with anchor #nope in docs/b.md)"]
