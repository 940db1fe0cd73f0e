"""`AgentSpecWorkerExtension`: agentspec's RPC methods on every vLLM worker.

Load it with ``--worker-extension-cls agentspec_vllm.worker_ext.AgentSpecWorkerExtension``.
vLLM mixes the class into its worker class, so its methods can be called on
every worker through ``collective_rpc`` (``EngineClient.collective_rpc`` in
the API server, ``LLM.collective_rpc`` in-process):

* ``agentspec_handle(method, path, query, headers, body) -> (status, headers, body)``
  answers one request of the shard push protocol (``/v1/agentspec/...``,
  see docs/design-client.md) with the worker's `agentspec.ShardIntake`; the
  API server's endpoint plugin forwards HTTP requests to it unchanged.
* ``agentspec_stats() -> dict`` reports the proposer's counters per shard key
  and the pushed shards.
* ``agentspec_metrics() -> dict`` returns the counters behind the plugin's
  Prometheus metrics (`agentspec_vllm.metrics`), a compact snapshot the
  API server collects every ``metrics_interval`` seconds.
* ``init_worker_extension()`` is called by vLLM >= 0.33 once the model runner
  exists; it binds the runner to the proposer (older versions bind it on the
  first ``propose``).

Every attribute is prefixed ``agentspec_`` (vLLM refuses an extension whose
names collide with the worker's).  RPCs run between engine steps in the
worker's main thread: generation pauses while a large push loads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from agentspec import ShardIntake
from agentspec.integration import get_logger
from agentspec.metrics import FLEET_LAG_SECONDS_BUCKETS
from agentspec_vllm.config import load_config
from agentspec_vllm.proposer import AgentSpecProposer
from agentspec_vllm.shards import worker_intake

__all__ = ["AgentSpecWorkerExtension"]

_log = get_logger()


class AgentSpecWorkerExtension:
    """Mixin for vLLM's worker class (vLLM supplies ``model_runner`` and ``vllm_config``)."""

    model_runner: Any
    vllm_config: Any

    def init_worker_extension(self) -> None:
        """vLLM >= 0.33: bind the model runner to the agentspec proposer, if one is used."""
        proposer = self.agentspec_proposer()
        if proposer is not None:
            proposer.bind_runner(self.model_runner)
            _log.info("agentspec.vllm.runner_bound", how="init_worker_extension")

    def agentspec_proposer(self) -> AgentSpecProposer | None:
        """The worker's `AgentSpecProposer`, or None when speculation uses another method."""
        drafter = getattr(getattr(self, "model_runner", None), "drafter", None)
        return drafter if isinstance(drafter, AgentSpecProposer) else None

    def agentspec_intake(self) -> ShardIntake:
        """The worker's shard intake (made from the worker's settings on first use)."""
        proposer = self.agentspec_proposer()
        if proposer is not None:
            return proposer.intake
        config = load_config(getattr(self.vllm_config, "additional_config", None))
        return worker_intake(config, _vocab_size(self.vllm_config))

    def agentspec_handle(
        self,
        method: str,
        path: str,
        query: str,
        headers: Mapping[str, str],
        body: bytes,
    ) -> tuple[int, dict[str, str], bytes]:
        """Answer one push-protocol request: ``(status, headers, body)``.

        Bad input never raises: it becomes a 4xx answer (the shard is unchanged).
        """
        answer = self.agentspec_intake().handle(method, path, query, dict(headers), bytes(body))
        return answer.status, dict(answer.headers), bytes(answer.body)

    def agentspec_stats(self) -> dict[str, Any]:
        """This worker's proposer counters and pushed shards (JSON-ready).

        Finished requests are swept first, so their responses count as learned.
        """
        proposer = self.agentspec_proposer()
        intake = self.agentspec_intake()
        if proposer is not None:
            proposer.sweep()
        return {
            "pid": os.getpid(),
            "rank": getattr(self, "rank", None),
            "instance": intake.instance,
            "proposer": None if proposer is None else proposer.stats(),
            "pushed": [shard.to_json() for shard in intake.shards()],
            "pushed_budget": intake.budget(),
        }

    def agentspec_metrics(self) -> dict[str, Any]:
        """This worker's metric counters (see `agentspec_vllm.metrics.merge_snapshots`)."""
        proposer = self.agentspec_proposer()
        intake = self.agentspec_intake()
        if proposer is not None:
            proposer.sweep()
        budget = intake.budget()
        parallel = getattr(self.vllm_config, "parallel_config", None)
        fleet = None
        if proposer is not None and proposer.fleet is not None:
            fleet = proposer.fleet.metrics(FLEET_LAG_SECONDS_BUCKETS)
        return {
            "pid": os.getpid(),
            "rank": getattr(self, "rank", None),
            "dp_rank": getattr(parallel, "data_parallel_rank", 0) or 0,
            "proposer": None if proposer is None else proposer.metrics_snapshot(),
            "pushed": {
                "shards": [
                    [s.key[0], s.key[1] or "", s.key[2] or "", s.tokens, s.bytes]
                    for s in intake.shards()
                ],
                "bytes": budget["bytes"],
                "max_bytes": budget["max_bytes"],
                "refused": budget["refused"],
                "too_large": budget["too_large"],
                "counts": [[r, c, n] for (r, c), n in sorted(intake.push_counts().items())],
            },
            "fleet": fleet,
        }


def _vocab_size(vllm_config: Any) -> int | None:
    """The model's vocabulary size from vLLM's config (None when unknown)."""
    model = getattr(vllm_config, "model_config", None)
    try:
        return int(model.get_vocab_size()) if model is not None else None
    except Exception:  # a config without a model (tests) or an unloadable one
        return None
