"""agentspec-vllm: agentspec's SuffixDecoding drafts inside vLLM."""
