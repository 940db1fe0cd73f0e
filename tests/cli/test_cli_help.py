"""Every ``--help`` of the command line speaks to users: no module paths, no code names."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

from agentspec.__main__ import build_parser

#: A default shown as a code identifier (``default: default_out_dir``) instead of its value.
_IDENT_DEFAULT = re.compile(r"default:?\s+`?([A-Za-z]+_[A-Za-z0-9_]*)`?(?![\w./-])")


def helps(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, str]]:
    """``(command, help text)`` of ``parser`` and of every subcommand below it."""
    yield name, parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in {id(p): (n, p) for n, p in action.choices.items()}.values():
                yield from helps(p, f"{name} {sub}")


def test_no_help_shows_internal_names() -> None:
    seen = dict(helps(build_parser(), "agentspec"))
    assert {"agentspec demo", "agentspec fleet status", "agentspec shards status"} <= set(seen)
    for name, text in seen.items():
        flat = " ".join(text.split())
        for bad in ("agentspec._", "<function", "<bound method", "%(default)"):
            assert bad not in flat, (name, bad)
        assert not _IDENT_DEFAULT.search(flat), (name, _IDENT_DEFAULT.search(flat))


def test_shards_help_describes_every_subcommand() -> None:
    text = dict(helps(build_parser(), "agentspec"))["agentspec shards"]
    description = text.split("positional arguments:")[0]
    for sub in ("list", "stats", "export", "import", "compact", "push", "status"):
        assert f"- {sub}" in description, sub
        assert re.search(rf"^\s+{sub}\s+\S", text, re.M), sub  # and a help line


def test_demo_help_shows_the_real_default_path() -> None:
    from agentspec._cli.demo import default_out_dir

    text = " ".join(dict(helps(build_parser(), "agentspec"))["agentspec demo"].split())
    assert f"(default: {default_out_dir()})" in text
