"""Runnable examples of agentspec (not part of the installed package)."""
