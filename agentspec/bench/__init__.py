"""Offline benchmarks of drafting methods on recorded traces (``agentspec bench``).

- `agentspec.bench.replay`: replays traces through a simulated greedy verifier
  for several drafting methods side by side (stage shards, one tree, n-gram
  lookup, arctic-inference, and the copy-drafting oracle) and reports MAT,
  acceptance, timings and memory per file and per stage.
- `agentspec.bench.entropy`: the fast predictor: the count-weighted entropy of
  the next-token distributions of each stage's responses.
- `agentspec.bench.budget`: MAT against draft budget (a grid of alpha and min
  prob per method), methods compared at equal drafted tokens per step.
- `agentspec.bench.explain`: why the copy oracle accepts more than the default
  drafter, step by step, in classes (other branch, match length, stopped early,
  prompt only, unanchored, nowhere).
- `agentspec.bench.verifier`, `agentspec.bench.ngram`, `agentspec.bench.oracle`:
  the building blocks (greedy acceptance, vLLM's n-gram proposer, the ceiling).

These modules need the ``bench`` extra (``tokenizers``; ``matplotlib`` for
plots) and are not imported by ``import agentspec``.
"""

__all__: list[str] = []
