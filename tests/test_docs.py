"""User-facing docs: links resolve, tables are whole, no words about how the project is made.

Checked files: README.md, docs/*.md, the integrations' READMEs, benchmarks/README.md,
examples' READMEs and CHANGELOG.md.  A relative link must name an existing file
(``#anchor`` included: a heading of that file must produce it, GitHub-style);
a markdown table must not be split by a blank line (GitHub renders the rest as
text); and phrases that describe the project's own making (who worked on it,
in what session) must not reach users.
"""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _doc_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "benchmarks" / "README.md"]
    files += sorted((REPO / "docs").glob("*.md"))
    files += sorted((REPO / "integrations").glob("*/README.md"))
    files += sorted((REPO / "examples").glob("*/README.md"))
    return [f for f in files if f.is_file()]


DOCS = _doc_files()
IDS = [str(f.relative_to(REPO)) for f in DOCS]

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out = []
    fenced = False
    for no, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((no, line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def broken_links(path: Path) -> list[str]:
    """Relative links of ``path`` whose file (or heading anchor) does not exist."""
    bad = []
    for no, line in _prose_lines(path.read_text(encoding="utf-8")):
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        for m in _LINK.finditer(line):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = path if not file_part else (path.parent / file_part).resolve()
            if not dest.exists():
                bad.append(f"{path.relative_to(REPO)}:{no}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{path.relative_to(REPO)}:{no}: {target} (no such heading)")
    return bad


def split_tables(path: Path) -> list[str]:
    """Tables with a blank line between two of their rows (the rest renders as text)."""
    bad = []
    lines = _prose_lines(path.read_text(encoding="utf-8"))
    for i in range(len(lines) - 2):
        (no, a), (_, b), (_, c) = lines[i], lines[i + 1], lines[i + 2]
        if a.startswith("|") and not b.strip() and c.startswith("|"):
            # a new table starts with a header and its |---| separator: that is fine
            nxt = lines[i + 3][1] if i + 3 < len(lines) else ""
            if not re.match(r"^\|[\s:|-]+\|\s*$", nxt):
                bad.append(f"{path.relative_to(REPO)}:{no + 1}: blank line inside a table")
    return bad


#: Phrases about how the project is made; case-insensitive, whole phrases.
INTERNAL = (
    r"the issue'?s targets?",
    r"\bissue \d+\b",
    r"when issue",
    r"the review'?s",
    r"review'?s scenario",
    r"\breviewer",
    r"this session",
    r"other sessions",
    r"same session",
    r"\bhelpers? (?:build|session|branch|worktree)",
    r"\bthe helper\b",
    r"\bworktree",
    r"this machine",
    r"this box",
    r"\bthe brief\b",
)
_INTERNAL = re.compile("|".join(INTERNAL), re.IGNORECASE)


def internal_phrases(text: str, name: str) -> list[str]:
    return [
        f"{name}:{no}: {m.group(0)!r}"
        for no, line in enumerate(text.splitlines(), 1)
        for m in _INTERNAL.finditer(line)
    ]


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_tables_are_not_split(path: Path) -> None:
    assert split_tables(path) == []


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_no_words_about_how_the_project_is_made(path: Path) -> None:
    assert internal_phrases(path.read_text(encoding="utf-8"), IDS[DOCS.index(path)]) == []


def test_help_texts_have_no_words_about_how_the_project_is_made() -> None:
    commands = [
        [],
        ["serve"],
        ["vllm-args"],
        ["demo"],
        ["shards"],
        ["fleet"],
        ["bench"],
        *([["bench", c] for c in ("replay", "entropy", "budget", "explain", "evidence", "fleet")]),
    ]
    found = []
    for args in commands:
        proc = subprocess.run(
            [sys.executable, "-m", "agentspec", *args, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=REPO,
        )
        assert proc.returncode == 0, (args, proc.stderr)
        found += internal_phrases(proc.stdout, "agentspec " + " ".join(args))
    assert found == []


def test_the_readme_opens_with_what_it_is_and_the_two_commands() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    head = text[: text.index("\n## ")]
    assert "speculative decoding" in head
    blocks = re.findall(r"```bash\n(.*?)```", head, re.DOTALL)
    assert [b.strip().splitlines()[-1] for b in blocks] == [
        'python -m pip install torch==2.13.0 && python -m pip install -e ".[local,bench]" '
        "&& python -m agentspec demo",
        "bash .ci/run",
    ]
    first = text.index("\n## ")
    assert text[first:].startswith("\n## What it adds to vLLM's built-in `suffix` method")


# --- the checks themselves -----------------------------------------------------------


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Title\n\n## A `code` heading, here\n\n"
        "[ok](doc.md) [ok](#title) [ok](#a-code-heading-here) [web](https://x.invalid/y)\n"
        "[gone](missing.md) [bad anchor](doc.md#nope)\n\n"
        "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n\n"
        "| c | d |\n|---|---|\n| 5 | 6 |\n\n"
        "```\n[in code](missing-too.md)\n```\n",
        encoding="utf-8",
    )
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        links = broken_links(doc)
        tables = split_tables(doc)
    finally:
        REPO = saved
    assert links == [
        "doc.md:6: missing.md (no such file)",
        "doc.md:6: doc.md#nope (no such heading)",
    ]
    assert tables == ["doc.md:11: blank line inside a table"]
    assert internal_phrases("Against the issue's targets: as this session found", "x") == [
        'x:1: "the issue\'s targets"',
        "x:1: 'this session'",
    ]
    assert internal_phrases("a session of the agent; the helper thread", "y") == [
        "y:1: 'the helper'"
    ]
