"""The ``agentspec`` command line (``python -m agentspec`` or the ``agentspec`` script).

Subcommands:

- ``agentspec demo``: the text-to-SQL agent pipeline on the embedded engine
  (or ``--base-url``), speculation off then on, identical outputs checked,
  per-stage speedups (`agentspec._cli.demo`);
- ``agentspec bench replay TRACES...``: replay traces through a simulated
  greedy verifier for several drafting methods (`agentspec.bench.replay`);
- ``agentspec bench entropy TRACES...``: the per-stage entropy predictor
  (`agentspec.bench.entropy`);
- ``agentspec bench budget TRACES...``: MAT against draft budget, methods
  compared at equal drafted tokens per step (`agentspec.bench.budget`);
- ``agentspec bench fleet TRACES...``: MAT of a simulated fleet of replicas,
  isolated per-replica trees against fleet-synced shards (`agentspec.bench.fleet`);
- ``agentspec bench calibration TRACES...``: predicted vs observed acceptance
  of draft tokens per probability bucket, raw and corrected online
  (`agentspec.bench.calibration`);
- ``agentspec bench explain TRACES...``: every step where the copy oracle
  accepts more than the default drafter, classified by why
  (`agentspec.bench.explain`);
- ``agentspec bench evidence TRACES...``: acceptance of draft tokens by
  matched length and continuation count, and the confidence table's model
  fitted to it (`agentspec.bench.evidence`);
- ``agentspec shards list|stats|export|import|compact --store DIR``: inspect
  and maintain a client shard store (`agentspec._cli.shards`);
- ``agentspec shards push|status --store DIR --endpoint URL``: push shards to
  serving workers, compare them with the workers' copies (`agentspec._cli.push`);
- ``agentspec fleet status --redis URL``: a tenant's fleet log on Redis, per
  shard (`agentspec._cli.fleet`); every command taking ``--redis`` also takes
  ``--redis-file PATH``, ``$AGENTSPEC_REDIS_URL`` and ``$AGENTSPEC_REDIS_URL_FILE``
  (`agentspec._util.secrets_source`), which keep the password out of argv;
- ``agentspec vllm-args`` / ``agentspec serve MODEL``: the vLLM flags that
  enable agentspec, and a server started with them (`agentspec._cli.vllm`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from agentspec._util.cli import doc_description, plain_text
from agentspec._util.secrets_source import RedisUrlError
from agentspec.exceptions import AgentSpecError

__all__ = ["build_parser", "main"]


def _version() -> str:
    """The installed package's version."""
    from agentspec import __version__

    return __version__


def package_problem() -> str | None:
    """Why ``agentspec`` is not the real package (None: it is).

    A folder named ``agentspec`` in the current directory (a source checkout
    cloned under that name, run from its parent) or on ``PYTHONPATH``, with no
    ``__init__.py`` of its own, is imported as a namespace package in place of
    the installed one; every command would then fail with an obscure
    ImportError.
    """
    import agentspec

    if getattr(agentspec, "__file__", None) is not None:
        return None
    folders = [str(p) for p in getattr(agentspec, "__path__", [])]
    where = folders[0] if folders else "a folder named agentspec"
    return (
        f"'agentspec' resolved to the folder {where}, not to the installed package: Python "
        "imports a folder named agentspec in the current directory (or on PYTHONPATH) as a "
        f"namespace package. Run agentspec from another directory (for instance cd {where}), "
        "or rename that folder."
    )


_SERVE_EPILOG = (
    "Tenants: without --tenant-keys there is NO ISOLATION between tenants. The "
    "tenant is whatever a request's body says (vllm_xargs.agentspec_tenant), so "
    "any client drafts from any tenant's shards (the embedded engine's "
    "per-response agentspec counters show what they hold), and the one API "
    "key also pushes, lists "
    "and deletes every tenant's shards. With --tenant-keys the tenant comes "
    "from the bearer key; add --admin-key (embedded engine) for the shard "
    "routes. See docs/engine.md."
)


def _add_demo(sub: Any) -> None:
    from agentspec._cli import demo as cli_demo

    dp = sub.add_parser(
        "demo",
        help="the text-to-SQL agent on a real model, speculation off then on",
        description=doc_description(cli_demo.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli_demo.add_arguments(dp)
    dp.set_defaults(func=cli_demo.run_cli)


def _add_bench(sub: Any) -> None:
    from agentspec.bench import budget, calibration, entropy, evidence, explain, replay
    from agentspec.bench import fleet as bench_fleet

    bench = sub.add_parser(
        "bench",
        help="offline benchmarks on recorded traces",
        description="Offline benchmarks of drafting methods on recorded traces.",
    )
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    # Each module has add_arguments(parser) and run_cli(args); its docstring
    # is the subcommand's description.
    benchmarks = (
        ("replay", replay, "replay traces through a simulated greedy verifier"),
        (
            "entropy",
            entropy,
            "count-weighted next-token entropy per stage (is the workload predictable?)",
        ),
        (
            "budget",
            budget,
            "MAT against draft budget; methods compared at equal drafted tokens per step",
        ),
        (
            "fleet",
            bench_fleet,
            "MAT at 1..N replicas: isolated per-replica trees vs fleet-synced shards",
        ),
        (
            "calibration",
            calibration,
            "predicted vs observed acceptance of draft tokens, raw and corrected online",
        ),
        (
            "explain",
            explain,
            "why the copy oracle accepts more than the default drafter, per class",
        ),
        (
            "evidence",
            evidence,
            "acceptance by matched length and count; the confidence table's model fitted",
        ),
    )
    for name, module, help_text in benchmarks:
        bp = bsub.add_parser(
            name,
            help=help_text,
            description=doc_description(module.__doc__),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(bp)
        bp.set_defaults(func=module.run_cli)
    bench.set_defaults(func=None, _help=bench.print_help)


def _add_shards(sub: Any) -> None:
    from agentspec._cli import push as cli_push
    from agentspec._cli import shards as cli_shards

    shards = sub.add_parser(
        "shards",
        help="inspect and maintain a client shard store directory",
        description=doc_description(cli_shards.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ssub = cli_shards.add_arguments(shards)
    pp = ssub.add_parser(
        "push",
        help="push every shard to serving workers once",
        description="Push every shard of the store to each worker endpoint and wait for them.",
    )
    cli_push.add_push_arguments(pp)
    pp.set_defaults(func=cli_push.run_push)
    st = ssub.add_parser(
        "status",
        help="compare the store's shards with the workers' copies",
        description="Compare each local shard with each worker's copy (in sync / behind).",
    )
    cli_push.add_status_arguments(st)
    st.set_defaults(func=cli_push.run_status)
    shards.set_defaults(func=None, _help=shards.print_help)


def _add_fleet(sub: Any) -> None:
    from agentspec._cli import fleet as cli_fleet

    fl = sub.add_parser(
        "fleet",
        help="inspect the fleet's shard log on Redis",
        description="Inspect a tenant's fleet log on Redis, and set the fleet up.",
    )
    cli_fleet.add_arguments(fl)


def _add_vllm_args(sub: Any) -> None:
    from agentspec._cli import vllm as cli_vllm

    va = sub.add_parser(
        "vllm-args",
        help="print the vLLM flags that enable agentspec",
        description=(
            "Print the vLLM flags and environment that enable agentspec: the custom_class "
            "proposer, the worker extension, the endpoint plugin and the header middleware."
        ),
    )
    cli_vllm.add_vllm_args_arguments(va)
    va.set_defaults(func=cli_vllm.run_vllm_args)


def _add_serve(sub: Any) -> None:
    from agentspec._cli import vllm as cli_vllm

    sv = sub.add_parser(
        "serve",
        help="serve MODEL with agentspec speculation (vLLM with the agentspec plugin)",
        description="Start an OpenAI-compatible server for MODEL with agentspec speculation.",
        epilog=_SERVE_EPILOG,
    )
    cli_vllm.add_serve_arguments(sv)
    sv.set_defaults(func=cli_vllm.run_serve)


#: The top-level subcommands, in help order: each entry adds its parser (and
#: its own subcommands) to the ``add_subparsers`` action it is given.
_COMMANDS: tuple[Callable[[Any], None], ...] = (
    _add_demo,
    _add_bench,
    _add_shards,
    _add_fleet,
    _add_vllm_args,
    _add_serve,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``agentspec`` command."""
    parser = argparse.ArgumentParser(
        prog="agentspec",
        description="agentspec: model-free speculative decoding with suffix trees.",
    )
    parser.add_argument(
        "--version", action="version", version=f"agentspec {_version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    parser.set_defaults(func=None, _help=parser.print_help)
    _plain_help(parser)
    return parser


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """Strip reST markup from every description, epilog and help (docstrings feed them)."""
    parser.description = plain_text(parser.description) if parser.description else None
    parser.epilog = plain_text(parser.epilog) if parser.epilog else None
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = plain_text(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if isinstance(choice.help, str):
                    choice.help = plain_text(choice.help)
            for sub in {id(p): p for p in action.choices.values()}.values():
                _plain_help(sub)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 1 failed, 2 usage error)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    problem = package_problem()
    if problem is not None:
        print(f"agentspec: error: {problem}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.func is None:
        args._help(sys.stderr)
        return 2
    args.argv = ["agentspec", *args_list]
    try:
        return int(args.func(args))
    except RedisUrlError as e:  # where the URL should come from: a usage error
        print(f"agentspec: error: {e}", file=sys.stderr)
        return 2
    except (AgentSpecError, OSError, ValueError, RuntimeError) as e:
        print(f"agentspec: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nagentspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
