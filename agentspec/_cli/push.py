"""``agentspec shards push`` and ``agentspec shards status``: a store against its workers.

- ``agentspec shards push --store DIR --endpoint URL [--endpoint URL ...]``
  sends every shard of the store to every worker once (snapshots) and
  prints the result per endpoint; exit status 1 when a worker did not
  acknowledge everything within ``--timeout``.
- ``agentspec shards status --store DIR --endpoint URL ...`` compares each
  local shard (sequences, largest sequence id) with each worker's
  ``GET /v1/agentspec/shards`` and prints ``in-sync``, ``behind``,
  ``missing`` (the worker lacks the shard), ``differs`` or ``worker-only``;
  exit status 1 unless everything is in sync.

Both only read the store directory (`ShardStore` with ``readonly=True``),
so they work while another process writes it.  The API key defaults to ``$AGENTSPEC_API_KEY``
(the variable ``agentspec serve`` reads too), else ``$OPENAI_API_KEY``.
"""

from __future__ import annotations

import argparse
import http.client
import json
from pathlib import Path
from typing import TYPE_CHECKING

from agentspec._push.pusher import ShardPusher
from agentspec._push.wire import (
    SHARDS_PATH,
    ShardKey,
    WorkerShard,
    bearer_headers,
    parse_shard_list,
)
from agentspec._util.keys import client_api_key

if TYPE_CHECKING:
    from agentspec._store.store import ShardStore

__all__ = [
    "add_push_arguments",
    "add_status_arguments",
    "fetch_worker_shards",
    "run_push",
    "run_status",
]


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments shared by push and status."""
    parser.add_argument("--store", required=True, metavar="DIR", help="shard store directory")
    parser.add_argument(
        "--endpoint",
        action="append",
        required=True,
        metavar="URL",
        help="worker base URL, e.g. http://host:8000 (repeatable)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="bearer token of the workers (default: $AGENTSPEC_API_KEY, the key agentspec "
        "serve reads too; else $OPENAI_API_KEY)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds to wait for the workers (default 60)",
    )
    parser.add_argument(
        "--max-depth", type=int, default=64, help="tree depth of the store (default 64)"
    )
    parser.add_argument(  # accepted as before; reading the store takes no lock
        "--lock-timeout", type=float, default=0.0, metavar="S", help=argparse.SUPPRESS
    )


def add_push_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``agentspec shards push`` to ``parser``."""
    _common_arguments(parser)
    parser.add_argument(
        "--shm-dir",
        default=None,
        metavar="DIR",
        help="hand large snapshots over as files in this directory shared with the "
        "workers (e.g. /dev/shm) instead of uploading them",
    )


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``agentspec shards status`` to ``parser``."""
    _common_arguments(parser)


def _api_key(args: argparse.Namespace) -> str | None:
    """The API key of the arguments or the environment."""
    return client_api_key(args.api_key)


def _open_store(args: argparse.Namespace) -> ShardStore:
    """Open the existing store directory of the arguments, read-only."""
    from agentspec._store.store import ShardStore

    path = Path(args.store)
    if not path.is_dir():
        raise FileNotFoundError(f"no shard store directory at {path}")
    return ShardStore(path, max_depth=args.max_depth, readonly=True)


def _key_text(key: ShardKey) -> str:
    """A shard key as compact JSON."""
    return json.dumps(list(key), ensure_ascii=False)


def run_push(args: argparse.Namespace) -> int:
    """Push every shard once; print one line per endpoint; 0 when all acknowledged."""
    with _open_store(args) as store:
        nkeys = len(store.keys())
        pusher = ShardPusher(
            store,
            args.endpoint,
            api_key=_api_key(args),
            shm_dir=getattr(args, "shm_dir", None),
            timeout=max(args.timeout, 1.0),
        )
        try:
            ok = pusher.flush(args.timeout)
            status = pusher.status()
        finally:
            pusher.close()
    for url, st in status.items():
        if not st.pending:
            print(
                f"{url}: ok, {nkeys} shard(s), {st.bytes_sent} bytes, worker instance {st.instance}"
            )
        else:
            print(
                f"{url}: FAILED, {len(st.pending)} of {nkeys} shard(s) not acknowledged; "
                f"last error: {st.last_error}"
            )
    return 0 if ok else 1


def fetch_worker_shards(
    url: str, api_key: str | None = None, timeout: float = 30.0
) -> tuple[str, list[WorkerShard]]:
    """``(instance, shards)`` of a worker (``GET /v1/agentspec/shards``).

    Raises:
        OSError: the worker is unreachable.
        RuntimeError: it answered with an error.
        InvalidArgumentError: the URL or the answer is malformed.
    """
    from agentspec._push.pusher import _parse_endpoint

    ep = _parse_endpoint(url)
    cls = http.client.HTTPSConnection if ep.scheme == "https" else http.client.HTTPConnection
    conn = cls(ep.host, ep.port, timeout=timeout)
    try:
        conn.request("GET", ep.prefix + SHARDS_PATH, headers=bearer_headers(api_key))
        resp = conn.getresponse()
        body = resp.read()
    except http.client.HTTPException as e:
        raise OSError(f"{url}: {type(e).__name__}: {e}") from e
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {body[:200].decode('utf-8', 'replace')}")
    return parse_shard_list(body)


def _state(local_sequences: int, local_max: int, worker: WorkerShard | None) -> str:
    """in-sync / behind / missing / differs for one shard on one worker."""
    if worker is None:
        return "missing"
    if worker.sequences == local_sequences and worker.max_seq == local_max:
        return "in-sync"
    if worker.max_seq < local_max or (
        worker.max_seq == local_max and worker.sequences < local_sequences
    ):
        return "behind"
    return "differs"


def run_status(args: argparse.Namespace) -> int:
    """Compare the store with each worker; print one line per shard; 0 when all in sync."""
    with _open_store(args) as store:
        local: dict[ShardKey, tuple[int, int]] = {}
        keys = store.keys()
        for key in keys:
            st = store.stats(key)
            local[key] = (st.sequences, int(st.last_seq or 0) if st.sequences else 0)
    all_ok = True
    for url in args.endpoint:
        try:
            instance, shards = fetch_worker_shards(url, _api_key(args), args.timeout)
        except (OSError, RuntimeError, ValueError) as e:
            print(f"{url}: failed: {e}")
            all_ok = False
            continue
        remote = {s.key: s for s in shards}
        print(f"{url}: worker instance {instance}, {len(shards)} shard(s)")
        for key in sorted(local, key=_key_text):
            seqs, max_seq = local[key]
            w = remote.get(key)
            state = _state(seqs, max_seq, w)
            all_ok = all_ok and state == "in-sync"
            theirs = "-" if w is None else f"{w.sequences} seqs, max seq {w.max_seq}"
            print(
                f"  {_key_text(key)}: {state} "
                f"(local {seqs} seqs, max seq {max_seq}; worker {theirs})"
            )
        for key in sorted(set(remote) - set(local), key=_key_text):
            w = remote[key]
            all_ok = False
            print(
                f"  {_key_text(key)}: worker-only (worker {w.sequences} seqs, max seq {w.max_seq})"
            )
    return 0 if all_ok else 1
