"""The worker's registry of pushed shards: one `agentspec.ShardIntake` per worker process.

The worker extension feeds it (HTTP requests forwarded by the API server's
endpoint plugin through ``collective_rpc``) and the proposer drafts from its
trees.  Both live in the same worker process but are created independently
by vLLM (the extension is mixed into the worker class, the proposer is built
by the model runner), so they meet here: `worker_intake` makes the intake on
first use and returns the same one afterwards.

vLLM runs ``collective_rpc`` calls between engine steps in the worker's
main thread, the same thread that calls the proposer, so a push never
modifies a tree while a draft reads it.
"""

from __future__ import annotations

import threading

from agentspec import ShardIntake, ShardKey, SuffixTree
from agentspec_vllm.config import AgentSpecVllmConfig

__all__ = ["pushed_tree", "reset_worker_intake", "worker_intake"]

_lock = threading.Lock()
_intake: ShardIntake | None = None


def worker_intake(config: AgentSpecVllmConfig, vocab_size: int | None = None) -> ShardIntake:
    """This process's intake, made from ``config`` on the first call.

    ``vocab_size`` (the model's, when the caller knows it) is set on an
    intake that has none yet: shards holding other ids then get 422.
    """
    global _intake
    with _lock:
        if _intake is None:
            _intake = ShardIntake(
                api_key=config.api_key,
                max_depth=config.max_depth,
                max_body_bytes=config.max_body_bytes,
                shm_dir=config.shm_dir,
                max_bytes=config.max_shard_bytes,
                max_tenant_bytes=config.max_tenant_shard_bytes,
            )
        if vocab_size is not None and _intake.vocab_size is None:
            _intake.vocab_size = vocab_size
        return _intake


def pushed_tree(key: ShardKey) -> SuffixTree | None:
    """The pushed tree of ``key``, or None (also before any intake exists)."""
    intake = _intake
    return None if intake is None else intake.tree(key)


def reset_worker_intake() -> None:
    """Forget this process's intake (its trees go with it); the next call makes a new one."""
    global _intake
    with _lock:
        _intake = None
