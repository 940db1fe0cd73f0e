"""``agentspec fleet status``: what a tenant's fleet log on Redis holds, per shard.

For each tenant (``--tenant``, repeatable; default ``default``) it reads the
stream (length, last id, compaction marks) and the snapshot index, then
replays the log the way a subscriber does (a temporary, read-only
`FleetSubscriber` that never compacts) to count each shard's sequences and
tokens.  Per shard it shows:

- ``sequences``, ``tokens``: what every subscriber at the log's end holds;
- ``last id``: the shard's last stream entry (or its snapshot's covered id);
- ``covered``: the stream id its snapshot covers, and ``snapshot age``:
  now minus that id's time;
- ``snapshot lag``: the stream's last id minus the covered id, in
  milliseconds: how far a subscriber starting from the snapshots has to read.

Then each live subscriber (replicas and other followers write a heartbeat
about once a second; a gone one drops out within seconds): its name, host
and pid, position, ``lag ms`` (the stream's last id minus its position
when it wrote the heartbeat), ``behind ms`` (the stream's last id now minus
its position), when it was last heard from, and whether it compacts (a
read-only user does not).

The Redis password never appears in the output (``***``).  Give the URL in
a file (``--redis-file PATH``, mode 600) or in ``$AGENTSPEC_REDIS_URL`` /
``$AGENTSPEC_REDIS_URL_FILE`` to keep the password out of the process list;
``--redis URL`` with a password works but warns.  A tenant without
fleet data is reported as such; nothing is written to Redis.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agentspec._fleet.status import fleet_status
from agentspec._util import secrets_source
from agentspec._util.secrets_source import REDIS_URL_ENV, REDIS_URL_FILE_ENV, RedisUrlError
from agentspec.exceptions import AgentSpecError

__all__ = ["add_arguments", "run_status"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fleet`` subcommands to ``parser``."""
    sub = parser.add_subparsers(dest="fleet_command", metavar="COMMAND")
    st = sub.add_parser(
        "status",
        help="per shard: sequences, tokens, last id, snapshot age and lag",
        description=(__doc__ or "").split("\n\n", 1)[-1].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    secrets_source.add_arguments(
        st,
        f"Redis URL (default: ${REDIS_URL_ENV}); a password here is visible in the process "
        "list: prefer --redis-file or the environment",
    )
    st.add_argument(
        "--tenant",
        action="append",
        default=None,
        metavar="T",
        help="tenant to show (repeatable; default: default)",
    )
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="longest wait for replaying one tenant's log (default 30)",
    )
    st.set_defaults(func=run_status)
    parser.set_defaults(func=None, _help=parser.print_help)


def _aligned(rows: list[tuple[str, ...]], indent: str) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def _table(status: dict[str, Any]) -> str:
    lines = [f"redis {status['redis']}"]
    for tenant, t in status["tenants"].items():
        if not t["exists"]:
            lines.append(f"tenant {tenant}: no fleet data")
            continue
        st = t["stream"]
        marks = ", ".join(
            f"{k} {st[k]}" for k in ("depth", "budget", "round", "trimmed") if k in st
        )
        lines.append(
            f"tenant {tenant}: stream {st['length']} entries, last id {st['last_id']}; {marks}"
        )
        header = (
            "pipeline",
            "stage",
            "sequences",
            "tokens",
            "last id",
            "covered",
            "age s",
            "lag ms",
        )
        rows: list[tuple[str, ...]] = [header]
        for s in t["shards"]:
            _, pipeline, stage = s["key"]
            rows.append(
                (
                    pipeline or "-",
                    stage or "-",
                    str(s["sequences"]),
                    str(s["tokens"]),
                    s["last_id"],
                    s["covered"] or "-",
                    "-" if s["snapshot_age_s"] is None else f"{s['snapshot_age_s']:.1f}",
                    "-" if s["snapshot_lag_ms"] is None else str(s["snapshot_lag_ms"]),
                )
            )
        lines += _aligned(rows, "  ")
        if not t["shards"]:
            lines.append("  (no shards)")
        subs = t["subscribers"]
        lines.append(f"  subscribers: {len(subs)}")
        rows = [("name", "position", "lag ms", "behind ms", "seen s ago", "applied", "compacts")]
        for b in subs:
            rows.append(
                (
                    b["name"],
                    b["position"],
                    str(b["lag_ms"]),
                    str(b["behind_ms"]),
                    f"{b['seen_s_ago']:.1f}",
                    str(b["applied"]),
                    "yes" if b["compacts"] else "no",
                )
            )
        if subs:
            lines += _aligned(rows, "    ")
        if t["malformed_heartbeats"]:
            lines.append(f"  malformed heartbeats: {t['malformed_heartbeats']}")
    lines.append(f"note: {status['note']}")
    return "\n".join(lines)


#: Redis errors (as the status module names them) -> what to check.
_ACCESS_HINTS = (
    (
        ("AuthenticationError", "WRONGPASS", "invalid username-password"),
        "Redis refused the credentials: check the user and password of the URL; an ACL user "
        "needs both: redis://USER:PASSWORD@HOST",
    ),
    (
        ("NoPermissionError", "NOPERM"),
        "the Redis user's ACL does not allow that tenant's keys: a tenant's user gets the rules "
        "that agentspec.fleet.tenant_acl_rules(tenant) gives",
    ),
)


def _access_hint(message: str) -> str | None:
    """What to check for an authentication or permission error (None: another error)."""
    for marks, hint in _ACCESS_HINTS:
        if any(m in message for m in marks):
            return hint
    return None


def run_status(args: argparse.Namespace) -> int:
    """``agentspec fleet status``."""
    resolved = secrets_source.from_args(args)
    if resolved is None:
        raise RedisUrlError(
            f"give --redis-file PATH or --redis URL (or set ${REDIS_URL_ENV} or "
            f"${REDIS_URL_FILE_ENV})"
        )
    tenants = list(dict.fromkeys(args.tenant or ["default"]))
    try:
        status = fleet_status(resolved.url, tenants, args.timeout)
    except AgentSpecError as e:
        hint = _access_hint(str(e))
        if hint is None:
            raise
        raise AgentSpecError(f"{e}; hint: {hint}") from None
    if args.json:
        json.dump(status, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(_table(status))
    return 0
