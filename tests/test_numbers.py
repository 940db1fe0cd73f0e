"""One source for each number: the documents' headline figures against the benchmark JSON.

The figures are in benchmarks/results/headline.json.

A document marks a quoted figure with ``<!-- num:KEY -->`` right after it
(``<!-- num:K1 K2 ... -->`` after a list such as ``1.11 / 1.05 / 0.99``, keys in
order); the number(s) just before the marker must equal the JSON's values
rounded to the decimals the document shows.  Every figure must be quoted
somewhere, every marker must name a figure, and a range figure must span the
figures it summarises.
"""

from __future__ import annotations

import json
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEADLINE = REPO / "benchmarks" / "results" / "headline.json"
DOCS = sorted(
    {
        REPO / "README.md",
        REPO / "CHANGELOG.md",
        REPO / "benchmarks" / "README.md",
        *(REPO / "docs").glob("*.md"),
        *(REPO / "integrations").glob("*/README.md"),
    }
)

MARKER = re.compile(r"<!--\s*num:([^>]*?)\s*-->")
NUM = r"[-+]?\d[\d,]*(?:\.\d+)?"
SEP = "/\u2013"  # a list ("1.1 / 1.05") or a range with an en dash ("0.22-0.33")
# the numbers right before a marker, then at most a unit sign (%, the times sign, x) and bold
QUOTED = re.compile(rf"({NUM}(?:\s*[{SEP}]\s*{NUM})*)[\s*%\u00d7x]*$")


def figures() -> dict[str, dict[str, object]]:
    data = json.loads(HEADLINE.read_text())
    return dict(data["figures"])


def values(figure: dict[str, object]) -> list[float]:
    v = figure["value"]
    return [float(x) for x in v] if isinstance(v, list) else [float(v)]  # type: ignore[arg-type]


def shown(text: str) -> list[str]:
    return [t.strip().replace(",", "") for t in re.split(f"[{SEP}]", text)]


def agrees(doc: str, value: float) -> bool:
    """``doc`` (as written) equals ``value`` rounded half up to ``doc``'s decimals."""
    quoted = Decimal(doc)
    exponent = quoted.as_tuple().exponent
    assert isinstance(exponent, int)
    return Decimal(repr(value)).quantize(Decimal(1).scaleb(exponent), ROUND_HALF_UP) == quoted


def quotes() -> list[tuple[str, int, list[str], str]]:
    """(document, line number, keys, text before the marker) for every marker."""
    found = []
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in MARKER.finditer(line):
                before = MARKER.sub("", line[: m.start()])
                found.append((str(path.relative_to(REPO)), n, m.group(1).split(), before))
    return found


def test_every_figure_has_its_command_date_and_source() -> None:
    for key, figure in figures().items():
        assert {"value", "what", "command", "date", "source"} <= figure.keys(), key
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", str(figure["date"])), key
        assert values(figure), key


def test_a_range_spans_the_figures_it_summarises() -> None:
    figs = figures()
    for key, figure in figs.items():
        parts = figure.get("range_of")
        if parts is None:
            continue
        assert isinstance(parts, list)
        inner = [x for part in parts for x in values(figs[part])]
        assert values(figure) == [min(inner), max(inner)], key


def test_every_marked_number_equals_the_benchmark_json() -> None:
    figs = figures()
    wrong = []
    for doc, line, keys, before in quotes():
        unknown = [k for k in keys if k not in figs]
        assert not unknown, f"{doc}:{line}: no figure {unknown} in {HEADLINE.name}"
        m = QUOTED.search(before)
        assert m, f"{doc}:{line}: no number right before the marker {keys}"
        expected = [v for k in keys for v in values(figs[k])]
        quoted = shown(m.group(1))[-len(expected) :]
        if len(quoted) != len(expected) or not all(map(agrees, quoted, expected)):
            wrong.append(f"{doc}:{line}: {' / '.join(quoted)} quoted, {keys} = {expected}")
    assert not wrong, "documents disagree with benchmarks/results/headline.json:\n" + "\n".join(
        wrong
    )


def test_every_figure_is_quoted_somewhere() -> None:
    marked = {k for _, _, keys, _ in quotes() for k in keys}
    figs = figures()
    # a per-trace figure may be quoted only through the range that summarises it
    summarised = {p for f in figs.values() for p in f.get("range_of", [])}  # type: ignore[attr-defined]
    assert set(figs) - marked - summarised == set()


@pytest.mark.parametrize(
    ("doc", "value", "ok"),
    [
        ("1.11", 1.108, True),
        ("1.11", 1.13, False),
        ("6.0", 6.0, True),
        ("16", 15.5, True),
        ("0.99", 0.9866, True),
        ("27.4", 27.43, True),
        ("27.5", 27.43, False),
        ("1000", 1000.0, True),
    ],
)
def test_rounding_to_the_shown_decimals(doc: str, value: float, ok: bool) -> None:
    assert agrees(doc, value) is ok


def parsed(text: str) -> list[str]:
    m = QUOTED.search(text)
    assert m, text
    return shown(m.group(1))


def test_a_changed_number_is_caught() -> None:
    """The check reads what is right before the marker, lists and ranges included."""
    assert parsed("tok/s 1.13 / 1.06 / 0.98 / 0.99") == ["1.13", "1.06", "0.98", "0.99"]
    assert parsed("(draft p50 0.22\u20130.33") == ["0.22", "0.33"]
    assert parsed("| **1.05**") == ["1.05"]
    assert parsed("gains 6.0%") == ["6.0"]
    assert parsed("| 1.60\u00d7") == ["1.60"]
    assert not all(map(agrees, ["1.13", "1.06"], [1.108, 1.052]))
