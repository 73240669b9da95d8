"""The documents stay readable: a short README, no run history, no broken links.

README.md is for the people who use the server; docs/ holds the design and operations;
benchmarks/README.md every measured figure. None of them tells the story of how a figure was
found (sessions, leases, commit hashes): that is what the git log is for.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 250


def documents() -> list[Path]:
    """README.md, everything under docs/, benchmarks/README.md."""
    return [README, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md"]


# Run history: which session or lease measured what, and commit hashes. A hash is 7-40 lowercase
# hex digits as a whole word with at least one digit and one letter a-f, so that ordinary words
# ("deadbeef" has no digit) and plain numbers ("8684892160" has no letter) pass; a `#` before it
# is a colour, not a hash. A session or lease that something owns ("their last lease": a seat's)
# is the software's own, not a run's.
_NOT_OWNED = r"(?<!\btheir )(?<!\bits )(?<!'s )"
HISTORY = [
    re.compile(r"\bsessions? \d+\b", re.IGNORECASE),
    re.compile(_NOT_OWNED + r"\b(?:this|last|next|later|earlier|previous|same|that) session\b", re.IGNORECASE),
    re.compile(_NOT_OWNED + r"\b(?:this|last|next|later|earlier|previous|same|that) lease\b", re.IGNORECASE),
    re.compile(r"(?<![#\w])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?!\w)"),
]


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move detail to docs/"


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_run_history(path: Path):
    found = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for pattern in HISTORY
        for match in pattern.finditer(line)
    ]
    assert not found, "run history in a document (it belongs in the git log):\n" + "\n".join(found)


CODE_DIRS = ("streamserver", "engines", "benchmarks", "tests")


def code_files() -> list[Path]:
    """The .py files of the package, the engines, the benchmarks and the tests."""
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py") if "results" not in p.relative_to(ROOT).parts)


def commentary(source: str) -> list[tuple[int, str]]:
    """(line number, line) of every comment and docstring in Python source; code and other strings left out."""
    lines = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                lines += [(first.lineno + n, line) for n, line in enumerate(first.value.value.splitlines())]
    return sorted(lines)


def test_no_run_history_in_code_comments():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}"
        for path in code_files()
        for number, line in commentary(path.read_text(encoding="utf-8"))
        for pattern in HISTORY
        for match in pattern.finditer(line)
    ]
    assert not found, "run history in a comment or docstring (it belongs in the git log):\n" + "\n".join(found)


def test_commentary_reads_comments_and_docstrings_only():
    source = '''"""Module: in session 25."""
x = "the code at ba90aaf"  # measured at 8477762a
def f():
    """On the next lease."""
    return "a later session"
'''
    found = [line for _, line in commentary(source) if any(p.search(line) for p in HISTORY)]
    assert found == ["Module: in session 25.", "# measured at 8477762a", "On the next lease."], found
    assert len(code_files()) > 100 and ROOT / "tests" / "test_docs.py" in code_files()


def test_history_patterns_catch_what_they_should():
    for text in ("in session 25 this ran", "sessions 25 and 26", "on the next lease", "a later session",
                 "this session's runs", "the code at ba90aaf", "run `kill-final-5dc37e5`", "(8477762a)"):
        assert any(p.search(text) for p in HISTORY), text
    for text in ("a decoder session", "seat leases of 30 s", "deadbeef", "8684892160 bytes", "colour #1a2b3c4d",
                 "2026-12-03", "sessionStorage", "--max-batch 64", "1e-6", "cafe au lait",
                 "both seat keys expire with their last lease", "the peer's last session"):
        assert not any(p.search(text) for p in HISTORY), text


FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code removed."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, re.sub(r"`[^`]*`", "", line)))
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced or not (match := HEADING.match(line)):
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def relative_links(path: Path) -> list[tuple[int, str]]:
    return [
        (number, target)
        for number, line in _prose(path.read_text(encoding="utf-8"))
        for target in LINK.findall(line)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)  # http:, https:, mailto:
    ]


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    broken = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not linked.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{where} (no heading #{anchor} in {linked.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_link_check_sees_links():
    assert relative_links(README), "README.md links to docs/: the link pattern finds none"
    assert _slug("Uplink outage: the on-prem gateway (2 cores)") == "uplink-outage-the-on-prem-gateway-2-cores"
    assert _slug("A live class with captions (`serve`, 2 cores)") == "a-live-class-with-captions-serve-2-cores"
