"""``agentspec shards``: inspect and maintain a client shard store directory.

Every subcommand takes ``--store DIR`` (the directory of a `ShardStore`).
``list``, ``stats``, ``export``, ``push`` and ``status`` only read it, so they
work while another process (a proxy, a client) writes it: they see the store
as of their start.  ``import`` and ``compact`` change it, so they wait for or
refuse a store another process holds open (``--lock-timeout``):

- ``list``: the shard keys (``--tenant`` filters);
- ``stats``: per shard sequences, tokens, bytes, version and evictions;
- ``export OUTPUT``: one shard's native snapshot (``.ashd``; ``-`` for stdout);
- ``import INPUT``: native shard bytes (snapshot or delta; ``-`` for stdin)
  merged into a shard, or replacing it with ``--replace``;
- ``compact``: write every shard's snapshot and empty the journals;
- ``push --endpoint URL``: send every shard to serving workers once;
- ``status --endpoint URL``: compare each shard with the workers' copies.

The shard of ``export`` / ``import`` is given by ``--tenant`` (default
"default"), ``--pipeline`` and ``--stage`` (absent: untagged).  ``--json``
prints machine-readable output; in text output an untagged component
shows as ``-``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentspec._core.shardkey import DEFAULT_TENANT, ShardKey, make_key

if TYPE_CHECKING:
    from agentspec._store.store import ShardStore

__all__ = ["add_arguments", "run_cli"]

_COLUMNS = ("sequences", "tokens", "bytes", "version", "evicted")


def _common(p: argparse.ArgumentParser, *, writes: bool = False) -> None:
    """Options every subcommand takes (``--lock-timeout`` only matters to one that ``writes``)."""
    p.add_argument("--store", type=Path, required=True, metavar="DIR", help="store directory")
    p.add_argument(
        "--lock-timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for another process holding the store (default 0: fail)"
        if writes
        else argparse.SUPPRESS,  # accepted as before; reading takes no lock
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _key_options(p: argparse.ArgumentParser) -> None:
    """``--tenant/--pipeline/--stage`` naming one shard."""
    p.add_argument("--tenant", default=DEFAULT_TENANT, help="tenant (default: %(default)s)")
    p.add_argument("--pipeline", default=None, help="pipeline (default: untagged)")
    p.add_argument("--stage", default=None, help="stage (default: untagged)")


def add_arguments(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[Any]:
    """Add the ``shards`` subcommands to ``parser``; return their subparsers action."""
    sub = parser.add_subparsers(dest="shards_command", metavar="SUBCOMMAND")
    lp = sub.add_parser("list", help="list the shard keys", description="List the shard keys.")
    _common(lp)
    lp.add_argument("--tenant", default=None, help="only this tenant's shards")
    sp = sub.add_parser(
        "stats",
        help="per-shard sequences, tokens, bytes, version",
        description="Per-shard sequences, tokens, bytes, version and evictions.",
    )
    _common(sp)
    sp.add_argument("--tenant", default=None, help="only this tenant's shards")
    ep = sub.add_parser(
        "export",
        help="write one shard as a native .ashd snapshot",
        description="Write one shard's native snapshot to OUTPUT (- for stdout).",
    )
    _common(ep)
    _key_options(ep)
    ep.add_argument("output", help="output file (.ashd), or - for stdout")
    ip = sub.add_parser(
        "import",
        help="import native .ashd bytes into a shard",
        description="Merge native shard bytes (snapshot or delta) from INPUT (- for stdin) "
        "into a shard, or replace it with --replace.",
    )
    _common(ip, writes=True)
    _key_options(ip)
    ip.add_argument("input", help="input file (.ashd), or - for stdin")
    ip.add_argument("--replace", action="store_true", help="replace the shard's content")
    cp = sub.add_parser(
        "compact",
        help="snapshot every shard and empty the journals",
        description="Write every shard's snapshot (atomically) and empty the journals.",
    )
    _common(cp, writes=True)
    for p in (lp, sp, ep, ip, cp):
        p.set_defaults(func=run_cli)
    return sub


def _open(args: argparse.Namespace, *, create: bool = False, readonly: bool = False) -> ShardStore:
    """Open the store named by ``--store`` (it must exist unless ``create``).

    ``readonly``: without the writer's lock (see `ShardStore`), so another
    process may hold the store.
    """
    from agentspec._store.store import ShardStore

    if not create and not (args.store / "shards").is_dir():
        raise FileNotFoundError(f"no shard store at {args.store}")
    if readonly:
        return ShardStore(args.store, readonly=True)
    return ShardStore(args.store, lock_timeout=args.lock_timeout)


def _key_fields(key: ShardKey) -> dict[str, str | None]:
    """A key as JSON fields."""
    return {"tenant": key[0], "pipeline": key[1], "stage": key[2]}


def _table(header: Iterable[str], rows: list[list[str]]) -> str:
    """Left-aligned text columns."""
    head = list(header)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    ]
    return "\n".join(lines) + "\n"


def _text_key(key: ShardKey) -> list[str]:
    """A key as text cells (``-`` for untagged)."""
    return [key[0], key[1] or "-", key[2] or "-"]


def _emit(args: argparse.Namespace, doc: Any, text: str) -> None:
    """Print ``doc`` as JSON with ``--json``, else ``text``."""
    sys.stdout.write(json.dumps(doc, indent=1) + "\n" if args.json else text)


def run_cli(args: argparse.Namespace) -> int:
    """Run an ``agentspec shards`` subcommand from parsed arguments; return the exit status."""
    command = getattr(args, "shards_command", None)
    if command is None:
        raise ValueError("a subcommand is needed: list, stats, export, import or compact")
    if command == "import":
        return _import(args)
    with _open(args, readonly=command != "compact") as store:
        if command == "list":
            keys = store.keys(tenant=args.tenant)
            text = _table(("TENANT", "PIPELINE", "STAGE"), [_text_key(k) for k in keys])
            _emit(args, [_key_fields(k) for k in keys], text)
        elif command == "stats":
            stats = [store.stats(k) for k in store.keys(tenant=args.tenant)]
            docs = [
                {
                    **_key_fields(s.key),
                    **{c: getattr(s, c) for c in _COLUMNS},
                    "first_seq": s.first_seq,
                    "last_seq": s.last_seq,
                }
                for s in stats
            ]
            rows = [[*_text_key(s.key), *(str(getattr(s, c)) for c in _COLUMNS)] for s in stats]
            header = ("TENANT", "PIPELINE", "STAGE", *(c.upper() for c in _COLUMNS))
            _emit(args, docs, _table(header, rows))
        elif command == "export":
            key = make_key(args.tenant, args.pipeline, args.stage)
            data, version = store.snapshot(key)
            _write_output(args.output, data)
            doc = {**_key_fields(key), "version": version, "bytes": len(data)}
            if args.output != "-":
                _emit(args, doc, f"wrote {len(data)} bytes (version {version}) to {args.output}\n")
        elif command == "compact":
            store.compact()
            n = len(store.keys())
            _emit(args, {"shards": n}, f"compacted {n} shard(s) in {args.store}\n")
        else:  # pragma: no cover - argparse allows only the commands above
            raise ValueError(f"unknown subcommand {command!r}")
    return 0


def _import(args: argparse.Namespace) -> int:
    """``shards import``."""
    key = make_key(args.tenant, args.pipeline, args.stage)
    data = sys.stdin.buffer.read() if args.input == "-" else Path(args.input).read_bytes()
    with _open(args, create=True) as store:
        version = store.import_shard(key, data, replace=args.replace)
        s = store.stats(key)
    doc = {**_key_fields(key), "version": version, "sequences": s.sequences, "tokens": s.tokens}
    _emit(args, doc, f"imported into {key!r}: {s.sequences} sequences, version {version}\n")
    return 0


def _write_output(output: str, data: bytes) -> None:
    """Write export bytes to a file (mode 0600) or to stdout for ``-``."""
    if output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
