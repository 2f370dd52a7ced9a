"""The documentation holds together: the README stays short (at most 300 lines) and leads to the
books; every link between the README, the books and ARCHITECTURE.md leads to a file that exists
and, with an anchor, to a heading it has; the books link only to what the package ships beside
them; the packages ship the books where they ship the README; and ARCHITECTURE.md has a row for
every role of the import-graph test. What each book says is checked against the code elsewhere
(tests/test_reference.py for the reference)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_architecture import ROLES

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BOOKS = tuple(
    ROOT / "docs" / f"{name}.md" for name in ("owner-manual", "job-author-guide", "reference")
)
DOCUMENTS = (README, ROOT / "ARCHITECTURE.md", *BOOKS)
MAX_README_LINES = 300
BUILD = ROOT / "packaging" / "build"


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a ``# comment`` in a shell block is no heading)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return "\n".join(kept)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces as
    hyphens; a heading met again gets -1, -2, ..."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+?)\s*#*$", _prose(path.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(text: str) -> list[str]:
    """Every link target of a Markdown text that is not a web address."""
    targets = re.findall(r"\]\(([^()\s]+)\)", _prose(text))
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def destination(path: Path, target: str) -> Path:
    """The file a link of ``path`` leads to (``path`` itself for a bare ``#anchor``)."""
    file = target.partition("#")[0]
    return (path.parent / file).resolve() if file else path


def broken(path: Path, text: str | None = None) -> list[str]:
    """The links of ``path`` (or of ``text`` read as if it were ``path``) that lead nowhere."""
    found = []
    for target in links(path.read_text() if text is None else text):
        anchor = target.partition("#")[2]
        dest = destination(path, target)
        if not dest.exists():
            found.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            found.append(f"{target}: {dest.name} has no heading with that anchor")
    return found


def test_the_readme_stays_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move some into a book"


def test_the_readme_keeps_the_two_commands_and_leads_to_every_book() -> None:
    text = README.read_text()
    assert "./scripts/demo" in text and "./scripts/test" in text
    targets = {destination(README, t) for t in links(text)}
    assert set(BOOKS) <= targets, sorted(str(b) for b in set(BOOKS) - targets)


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_to_a_file_and_a_heading_it_has(path: Path) -> None:
    assert not broken(path)


@pytest.mark.parametrize("book", BOOKS, ids=lambda p: p.name)
def test_a_book_links_only_to_what_is_shipped_beside_it(book: Path) -> None:
    """The package installs the README and the books (nfpm.yaml), nothing else of the tree: a
    book's links must not lead out of that set, or they break on an installed node."""
    shipped = {README, *BOOKS}
    assert not [t for t in links(book.read_text()) if destination(book, t) not in shipped]


def test_the_packages_ship_the_books_beside_the_readme() -> None:
    nfpm = (ROOT / "packaging" / "nfpm.yaml").read_text()
    assert "dst: /usr/share/doc/flashnode/README.md" in nfpm
    for book in BOOKS:
        rel = book.relative_to(ROOT)
        assert f"src: {rel}\n    dst: /usr/share/doc/flashnode/{rel}\n" in nfpm, rel


def test_the_installed_readmes_first_line_links_to_what_is_installed() -> None:
    """packaging/build puts a first line above the README it installs: its links lead where they
    do in the repository (the books lie beside it, under docs/), and it names the owner's Log in."""
    [line] = [x for x in BUILD.read_text().splitlines() if "Installed with the flashnode" in x]
    line = line.strip().removeprefix('echo "').removesuffix('"').replace("\\`", "`")
    assert "docs/owner-manual.md#log-in" in line and "./scripts/demo" not in line
    assert not broken(README, line + "\n\n" + README.read_text())


def test_the_architecture_has_a_row_for_every_role() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    named = [m for row in rows for m in re.findall(r"`([a-z_]+)/`", row)]
    roles = [r for r in ROLES if r and r != "__main__"]
    assert named == roles, "ARCHITECTURE.md's rows, in the import-graph test's order"
