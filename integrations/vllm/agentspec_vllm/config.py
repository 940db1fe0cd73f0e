"""Configuration of the agentspec proposer and worker extension.

The ``agentspec`` section of vLLM's ``--additional-config`` and its environment
variables are defined by `agentspec.integration.vllm_config` (so that
``agentspec serve --engine vllm`` checks a section with the plugin's own
rules without importing the plugin); this module re-exports it.
"""

from __future__ import annotations

from agentspec.integration.vllm_config import (
    ENV_PREFIX,
    REDIS_URL_FILE_ENV,
    AgentSpecVllmConfig,
    load_config,
)

__all__ = ["ENV_PREFIX", "REDIS_URL_FILE_ENV", "AgentSpecVllmConfig", "load_config"]
