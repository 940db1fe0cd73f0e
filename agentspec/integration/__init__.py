"""The integration surface: what the vLLM plugin and the LiteLLM hook build on.

The integrations under ``integrations/`` import only public modules:
``agentspec`` (the facade), `agentspec.protocol` (tag, header and
``vllm_xargs`` names, shard keys, tenant rules, tenant key maps),
`agentspec.exceptions`, `agentspec.fleet`, this module and
`agentspec.integration.vllm_config` (the ``agentspec`` section of vLLM's
``--additional-config``).  This module gathers the rest they need, so that a
patch release cannot move it from under them:

- logging: `get_logger` (the ``agentspec`` structlog logger);
- secrets: `read_url_file`, `REDIS_URL_FILE_ENV` (a Redis URL from a file);
- model outputs: `join_texts`, `tool_calls_text`, `load_tokenizer`;
- byte budgets: `LearnedBudget`, `parse_byte_size` and the ``DEFAULT_MAX_*``
  budgets;
- the shard push wire (what `ShardPusher` and `ShardIntake` speak): its
  routes, content types, `INSTANCE_HEADER`, `DEFAULT_MAX_BODY_BYTES`, key
  query codec and answer builders.
"""

from __future__ import annotations

from agentspec._client.outputs import join_texts, load_tokenizer, tool_calls_text
from agentspec._core.budget import (
    DEFAULT_MAX_LEARNED_BYTES,
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_MAX_TENANT_LEARNED_BYTES,
    DEFAULT_MAX_TENANT_SHARD_BYTES,
    LearnedBudget,
    parse_byte_size,
)
from agentspec._push.wire import (
    API_PREFIX,
    DEFAULT_MAX_BODY_BYTES,
    DELTA_PATH,
    INSTANCE_HEADER,
    JSON_CONTENT_TYPE,
    SHARD_CONTENT_TYPE,
    SHARDS_PATH,
    SNAPSHOT_FILE_PATH,
    SNAPSHOT_PATH,
    ErrorType,
    WireResponse,
    decode_key_query,
    encode_key_query,
    error_response,
    json_response,
    parse_content_length,
    write_shm_file,
)
from agentspec._util.log import get_logger
from agentspec._util.secrets_source import REDIS_URL_FILE_ENV, read_url_file

__all__ = [
    "API_PREFIX",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_LEARNED_BYTES",
    "DEFAULT_MAX_SHARD_BYTES",
    "DEFAULT_MAX_TENANT_LEARNED_BYTES",
    "DEFAULT_MAX_TENANT_SHARD_BYTES",
    "DELTA_PATH",
    "INSTANCE_HEADER",
    "JSON_CONTENT_TYPE",
    "REDIS_URL_FILE_ENV",
    "SHARDS_PATH",
    "SHARD_CONTENT_TYPE",
    "SNAPSHOT_FILE_PATH",
    "SNAPSHOT_PATH",
    "ErrorType",
    "LearnedBudget",
    "WireResponse",
    "decode_key_query",
    "encode_key_query",
    "error_response",
    "get_logger",
    "join_texts",
    "json_response",
    "load_tokenizer",
    "parse_byte_size",
    "parse_content_length",
    "read_url_file",
    "tool_calls_text",
    "write_shm_file",
]
