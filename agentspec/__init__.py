"""agentspec: model-free speculative decoding (SuffixDecoding) on a C suffix-tree engine.

The engine indexes token sequences (earlier responses, agent traces) in a
suffix tree and drafts likely continuations of a request's context, to be
verified by the target model in one forward pass.

Main entry points:

- `SuffixTree`: a tree of sequences shared by requests (the "global" tree);
  snapshots and deltas serialise it.
- `Cursor`: one request's context and per-request tree; drafts incrementally.
- `BatchDrafter` / `draft_batch`: one native call per decode step for a batch.
- `DraftParams` / `Draft`: drafting parameters and results;
  `DraftParams.confident()` is the default policy, `confidence_table` its table.
- `Speculator`: stage shards (one tree per pipeline stage) plus per-request
  trees, learned online from finished responses.
- `GoodputController`: cuts each step's drafts to what pays, from calibrated
  acceptance probabilities and the measured step cost (in `Speculator` by
  default; usable with `BatchDrafter` drafts in another engine).
- `agentspec.fleet`: shards shared by every replica through Redis Streams.
- `agentspec.compat.SuffixDecodingCache`: drop-in for arctic-inference's API.
- `AgentSpecClient` / `AsyncAgentSpecClient`: drop-ins for ``openai.OpenAI`` /
  ``AsyncOpenAI`` that tag calls by session and stage (`stage`, `session`)
  and learn every output into a `ShardStore`.
- `ShardStore`: shards keyed by (tenant, pipeline, stage), persisted to a
  directory (journal + snapshots); `ShardPusher` sends them to serving
  workers, whose side of the protocol is `ShardIntake`.

Errors are in `agentspec.exceptions`.
"""

import typing as _typing
from importlib import metadata as _metadata

from agentspec import exceptions
from agentspec._client.tags import Tags, current_tags, session, stage
from agentspec._core.batch import BatchDrafter, draft_batch
from agentspec._core.cursor import Cursor
from agentspec._core.draft import Draft, DraftParams, confidence_table
from agentspec._core.goodput import GoodputController
from agentspec._core.speculator import Speculator
from agentspec._core.tree import SuffixTree, TreeStats
from agentspec._push.intake import ShardIntake, serve_intake
from agentspec._push.pusher import EndpointStatus, PushError, ShardPusher
from agentspec._store.store import ShardStats, ShardStore
from agentspec.protocol import ShardKey

if _typing.TYPE_CHECKING:
    from agentspec._client.client import AgentSpecClient, AsyncAgentSpecClient

_LAZY = {"AgentSpecClient", "AsyncAgentSpecClient"}  # import openai only when used


def __getattr__(name: str) -> _typing.Any:
    """Load the openai-backed clients on first use."""
    if name in _LAZY:
        from agentspec._client import client as _client

        value = getattr(_client, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'agentspec' has no attribute {name!r}")


try:
    __version__: str = _metadata.version("agentspec-suffix")
except _metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"

__all__ = [
    "AgentSpecClient",
    "AsyncAgentSpecClient",
    "BatchDrafter",
    "Cursor",
    "Draft",
    "DraftParams",
    "EndpointStatus",
    "GoodputController",
    "PushError",
    "ShardIntake",
    "ShardKey",
    "ShardPusher",
    "ShardStats",
    "ShardStore",
    "Speculator",
    "SuffixTree",
    "Tags",
    "TreeStats",
    "__version__",
    "confidence_table",
    "current_tags",
    "draft_batch",
    "exceptions",
    "serve_intake",
    "session",
    "stage",
]
