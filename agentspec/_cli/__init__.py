"""The ``agentspec`` command line: one module per command group."""
