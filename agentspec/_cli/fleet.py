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
from typing import Any, cast

from agentspec._fleet.status import fleet_status
from agentspec._util import secrets_source
from agentspec._util.secrets_source import REDIS_URL_ENV, REDIS_URL_FILE_ENV, RedisUrlError
from agentspec.exceptions import AgentSpecError, InvalidArgumentError

__all__ = ["add_arguments", "run_setup", "run_status"]


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
    su = sub.add_parser(
        "setup",
        help="load the fleet's Redis function library and print (or create) tenant ACL users",
        description=_SETUP_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    secrets_source.add_arguments(
        su,
        f"admin Redis URL (default: ${REDIS_URL_ENV}); a password here is visible in the "
        "process list: prefer --redis-file or the environment",
    )
    su.add_argument(
        "--tenant",
        action="append",
        default=None,
        metavar="T",
        help="tenant to print ACL users for (repeatable)",
    )
    su.add_argument("--apply", action="store_true", help="create the users (ACL SETUSER)")
    su.add_argument(
        "--password-file",
        default=None,
        metavar="F",
        help="with --apply: lines 'USER PASSWORD' for every user printed",
    )
    su.set_defaults(func=run_setup)
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
        rows = [
            (
                "name",
                "position",
                "lag ms",
                "behind ms",
                "seen s ago",
                "applied",
                "compacts",
                "config",
            )
        ]
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
                    "differs" if b.get("config_mismatch") else "ok",
                )
            )
        if subs:
            lines += _aligned(rows, "    ")
        if t["malformed_heartbeats"]:
            lines.append(f"  malformed heartbeats: {t['malformed_heartbeats']}")
            for r in t.get("malformed_heartbeat_records", []):
                lines.append(f"    {r['id'][:64]}: {r['reason']} ({r['bytes']} bytes)")
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


def _redis_url(args: argparse.Namespace) -> str:
    """The Redis URL from ``--redis``, ``--redis-file`` or the environment.

    Raises:
        RedisUrlError: none given, or one that cannot be used.
    """
    resolved = secrets_source.from_args(args)
    if resolved is None:
        raise RedisUrlError(
            f"give --redis-file PATH or --redis URL (or set ${REDIS_URL_ENV} or "
            f"${REDIS_URL_FILE_ENV})"
        )
    return resolved.url


def run_status(args: argparse.Namespace) -> int:
    """``agentspec fleet status``."""
    url = _redis_url(args)
    tenants = list(dict.fromkeys(args.tenant or ["default"]))
    try:
        status = fleet_status(url, tenants, args.timeout)
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


_SETUP_DOC = """\
Loads (FUNCTION LOAD REPLACE) the fleet's Redis function library, which
tenant users may only call, and prints, per --tenant, the ACL users of
the tenant: a writer (publishes, subscribes, compacts) named
agentspec.<T> and a read-only replica named agentspec-ro.<T>, as
ACL SETUSER lines with the password as PASSWORD.  With --apply and
--password-file F (lines "USER PASSWORD"), it creates those users.
Run it with an admin URL; again after a Redis restart that lost the
library (no persistence).  With a redis+cluster:// URL it loads the
library on every primary, and --apply creates the users on every node
(primaries and replicas; their rules add CLUSTER SLOTS and ASKING).
The password never appears in the output."""


def _users(tenants: list[str], cluster: bool) -> list[tuple[str, list[str]]]:
    from agentspec._fleet.names import encode_tenant, tenant_acl_rules

    out = []
    for t in tenants:
        out.append((f"agentspec.{encode_tenant(t)}", tenant_acl_rules(t, cluster=cluster)))
        out.append(
            (
                f"agentspec-ro.{encode_tenant(t)}",
                tenant_acl_rules(t, read_only=True, cluster=cluster),
            )
        )
    return out


def _passwords(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise InvalidArgumentError(f"cannot read --password-file {path}: {e.strerror}") from None
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, _, pw = line.partition(" ")
        if not pw.strip() or any(c.isspace() for c in pw.strip()):
            raise InvalidArgumentError(f"{path}:{n}: expected 'USER PASSWORD'")
        out[user] = pw.strip()
    return out


def run_setup(args: argparse.Namespace) -> int:
    """``agentspec fleet setup``."""
    import redis

    from agentspec._fleet.connection import CLUSTER_SCHEME, Redactor, open_client
    from agentspec._fleet.functions import load_library
    from agentspec._fleet.scripts import LIBRARY_NAME
    from agentspec.exceptions import AgentSpecError

    url = _redis_url(args)
    cluster = url.lower().startswith(CLUSTER_SCHEME + ":")
    users = _users(list(dict.fromkeys(args.tenant or [])), cluster)
    passwords: dict[str, str] = {}
    if args.apply:
        if not args.password_file:
            raise InvalidArgumentError("--apply needs --password-file F")
        passwords = _passwords(args.password_file)
        missing = [u for u, _ in users if u not in passwords]
        if missing:
            raise InvalidArgumentError(f"--password-file has no password for {', '.join(missing)}")
    elif args.password_file:
        raise InvalidArgumentError("--password-file is for --apply")
    redactor = Redactor(url)
    try:
        client = open_client(url)
        try:
            load_library(client)
            # In a cluster, ACLs are per node: every primary and replica (a replica
            # may be promoted); redis-py would send ACL SETUSER to one node only.
            nodes = {"target_nodes": redis.RedisCluster.ALL_NODES} if cluster else {}
            for user, rules in users if args.apply else []:
                cast("Any", client).execute_command(
                    "ACL", "SETUSER", user, "reset", "on", f">{passwords[user]}", *rules, **nodes
                )
        finally:
            client.close()
    except (redis.RedisError, redis.exceptions.RedisClusterException, ValueError) as exc:
        raise AgentSpecError(f"setup on {redactor.url} failed: {redactor.error(exc)}") from None
    print(f"loaded function library {LIBRARY_NAME} on {redactor.url}")
    for user, rules in users:
        print(f"ACL SETUSER {user} reset on >PASSWORD {' '.join(rules)}")
    if args.apply:
        print(f"created {len(users)} users")
    return 0
