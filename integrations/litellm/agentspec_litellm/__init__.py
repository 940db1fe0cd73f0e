"""agentspec for LiteLLM: a proxy callback tagging agent calls and learning their outputs.

In the proxy's ``config.yaml``::

    litellm_settings:
      callbacks: agentspec_litellm.proxy_handler_instance

with ``AGENTSPEC_LITELLM_CONFIG=/path/agentspec.yaml`` in the proxy's
environment (see `agentspec_litellm.config` for the keys).  Code that wants
its own settings builds ``AgentSpecHook(HookConfig(...))`` in a module next
to the proxy config and names that instead.
"""

from agentspec_litellm.config import CONFIG_ENV, HookConfig, load_config
from agentspec_litellm.hook import AgentSpecHook

__all__ = ["CONFIG_ENV", "AgentSpecHook", "HookConfig", "load_config", "proxy_handler_instance"]

#: The instance the proxy config names; it reads ``$AGENTSPEC_LITELLM_CONFIG`` on first use.
proxy_handler_instance = AgentSpecHook()
