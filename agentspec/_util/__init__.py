"""Foundation: argument checks, logging, API key variables, server processes, CLI helpers."""
