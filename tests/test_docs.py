"""The documentation a reader follows: every link resolves, and results pages cite only files that exist.

Results live in one page per subsystem, ``docs/benchmarks/<subsystem>.md``, with the raw files of the runs it
cites under ``docs/benchmarks/data/<subsystem>/``; a data file that no page cites is a superseded run and should
leave the tree (git keeps it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "benchmarks"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
DATA_REF = re.compile(r"(?<![\w/.-])((?:\.\./)*data/[\w./-]*[\w/])")  # a file or a folder of runs


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _targets(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold commands, not links
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    broken = []
    for target in _targets(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def _cited(page: Path) -> set[Path]:
    text = page.read_text()
    refs = {m.group(1) for m in DATA_REF.finditer(text)}
    refs |= {t.split("#", 1)[0] for t in _targets(page) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)}
    return {(page.parent / r).resolve() for r in refs if r}


@pytest.mark.parametrize("page", sorted(BENCH.glob("*.md")), ids=lambda p: p.name)
def test_results_pages_cite_files_that_exist(page):
    missing = sorted(str(p.relative_to(ROOT)) for p in _cited(page) if not p.exists())
    assert not missing, f"{page.name} cites files that do not exist: {missing}"


def test_every_data_file_is_cited_by_a_results_page():
    data = BENCH / "data"
    if not data.exists():
        pytest.skip("no docs/benchmarks/data yet")
    cited = set().union(*(_cited(p) for p in BENCH.glob("*.md")), *(_cited(p) for p in _pages()))
    files = [*data.rglob("*"), *BENCH.glob("*.png")]  # plots may sit next to their page

    def is_cited(f: Path) -> bool:  # the file itself, or a folder holding it, is cited
        f = f.resolve()
        return f in cited or any(parent in cited for parent in f.parents)

    orphans = sorted(str(f.relative_to(ROOT)) for f in files if f.is_file() and not is_cited(f))
    assert not orphans, ("data files no results page cites (superseded runs leave the tree; git keeps them): "
                         f"{orphans}")


def test_results_files_live_in_pages_or_data():
    """docs/benchmarks holds pages (one per subsystem) and data/<subsystem>/ folders, not loose run files."""
    loose = sorted(f.name for f in BENCH.iterdir() if f.is_file() and f.suffix not in (".md", ".png"))
    assert not loose, f"loose run files in docs/benchmarks (move them under data/<subsystem>/): {loose}"
