"""The drop-in openai client: learning finished calls, tags, streams, traces."""
