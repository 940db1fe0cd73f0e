"""agentspec for LiteLLM: a proxy callback tagging agent calls and learning their outputs.

In the proxy's ``config.yaml``::

    litellm_settings:
      callbacks: agentspec_litellm.proxy_handler_instance

with ``AGENTSPEC_LITELLM_CONFIG=/path/agentspec.yaml`` in the proxy's
environment (see `agentspec_litellm.config` for the keys).  The file is read
and checked when the proxy loads ``proxy_handler_instance``: a bad one (an
unknown key, a wrong type) stops the proxy's start with an error naming the
key.  Code that wants its own settings builds ``AgentSpecHook(HookConfig(...))``
in a module next to the proxy config and names that instead.
"""

from __future__ import annotations

from agentspec_litellm.config import CONFIG_ENV, HookConfig, load_config
from agentspec_litellm.hook import AgentSpecHook

__all__ = ["CONFIG_ENV", "AgentSpecHook", "HookConfig", "load_config", "proxy_handler_instance"]

#: The instance the proxy config names, built (and ``$AGENTSPEC_LITELLM_CONFIG`` read and
#: checked) on first access; see `__getattr__`.
proxy_handler_instance: AgentSpecHook


def __getattr__(name: str) -> AgentSpecHook:
    """``proxy_handler_instance``: the hook with ``$AGENTSPEC_LITELLM_CONFIG``'s settings.

    Raises:
        InvalidArgumentError: the settings file is missing, unreadable or
            holds a bad value (the message names the key), so a proxy naming
            the hook does not start with settings it would ignore.
    """
    if name != "proxy_handler_instance":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    hook = AgentSpecHook(load_config())
    globals()[name] = hook
    return hook
