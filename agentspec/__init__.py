"""agentspec: model-free speculative decoding (SuffixDecoding) on a C suffix-tree engine.

The engine indexes token sequences (earlier responses, agent traces) in a
suffix tree and drafts likely continuations of a request's context, to be
verified by the target model in one forward pass.

Main entry points:

- `SuffixTree`: a tree of sequences shared by requests (the "global" tree);
  snapshots and deltas serialise it.
- `Cursor`: one request's context and per-request tree; drafts incrementally.
- `BatchDrafter` / `draft_batch`: one native call per decode step for a batch.
- `DraftParams` / `Draft`: drafting parameters and results.
- `Speculator`: stage shards (one tree per pipeline stage) plus per-request
  trees, learned online from finished responses.
- `agentspec.compat.SuffixDecodingCache`: drop-in for arctic-inference's API.

Errors are in `agentspec.exceptions`.
"""

from importlib import metadata as _metadata

from agentspec import exceptions
from agentspec._batch import BatchDrafter, draft_batch
from agentspec._draft import Cursor, Draft, DraftParams
from agentspec._speculator import Speculator
from agentspec._tree import SuffixTree, TreeStats

try:
    __version__: str = _metadata.version("agentspec")
except _metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"

__all__ = [
    "BatchDrafter",
    "Cursor",
    "Draft",
    "DraftParams",
    "Speculator",
    "SuffixTree",
    "TreeStats",
    "__version__",
    "draft_batch",
    "exceptions",
]
