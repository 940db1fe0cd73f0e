"""agentspec.protocol: the one home of the tag, header and vllm_xargs names and codecs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prereq import require_module

import agentspec
from agentspec import protocol
from agentspec._client import tags as client_tags
from agentspec._core import shardkey
from agentspec._push import wire
from agentspec.exceptions import InvalidArgumentError


def test_imports_without_the_client_the_engine_or_openai() -> None:
    code = (
        "import sys, agentspec.protocol\n"
        "bad = [m for m in ('openai', 'agentspec._client.client', 'agentspec.engine',"
        " 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_one_shard_key() -> None:
    assert agentspec.ShardKey is protocol.ShardKey
    assert shardkey.ShardKey is protocol.ShardKey
    assert wire.ShardKey is protocol.ShardKey
    assert protocol.ShardKey == tuple[str, str | None, str | None]
    assert protocol.StageKey == tuple[str | None, str | None]
    assert shardkey.check_key is protocol.check_key
    assert shardkey.DEFAULT_TENANT == wire.DEFAULT_TENANT == protocol.DEFAULT_TENANT


def test_the_engine_default_key_is_the_default_tenant() -> None:
    require_module("torch")
    from agentspec.engine._engine import GenerationRequest

    field = GenerationRequest.__dataclass_fields__["key"]
    assert field.default == (protocol.DEFAULT_TENANT, None, None)


def test_names_are_defined_once() -> None:
    assert client_tags.HEADER_SESSION is protocol.HEADER_SESSION
    assert client_tags.encode_header_value is protocol.encode_header_value
    assert wire.INSTANCE_HEADER == protocol.HEADER_INSTANCE == "X-AgentSpec-Instance"
    assert protocol.TAG_XARGS == {
        "session": "agentspec_session",
        "stage": "agentspec_stage",
        "pipeline": "agentspec_pipeline",
    }
    assert protocol.XARG_TENANT == "agentspec_tenant"
    assert protocol.XARG_SPECULATE == "agentspec_speculate"
    assert protocol.XARG_REQUEST_ID == "agentspec_request_id"
    assert set(protocol.TAG_HEADERS) == set(protocol.TAG_NAMES) == set(protocol.TAG_XARGS)


def test_tag_xargs_leaves_out_untagged_values_in_wire_order() -> None:
    assert protocol.tag_xargs("t") == {"agentspec_tenant": "t"}
    got = protocol.tag_xargs("t", pipeline="p", session="s", request_id="r")
    assert list(got) == [
        "agentspec_tenant",
        "agentspec_request_id",
        "agentspec_session",
        "agentspec_pipeline",
    ]
    assert got["agentspec_pipeline"] == "p"


@pytest.mark.parametrize("value", ["plain", "é tag", "50%", " padded ", "line\tab"])
def test_header_values_round_trip(value: str) -> None:
    encoded = protocol.encode_header_value(value)
    assert encoded.isascii()
    assert protocol.decode_header_value(encoded) == value


def test_names_are_checked() -> None:
    assert protocol.check_tenant("team-a") == "team-a"
    assert protocol.make_key(None, "p", None) == ("default", "p", None)
    assert protocol.check_identity("x" * protocol.MAX_IDENTITY)
    for bad in ("", "x" * (protocol.MAX_TAG_LENGTH + 1), "a\x00b", "zero\u200bwidth"):
        with pytest.raises(InvalidArgumentError):
            protocol.check_tag(bad, "stage")
    with pytest.raises(InvalidArgumentError):
        protocol.check_tenant("e\u0301")  # not NFC
    with pytest.raises(InvalidArgumentError):
        protocol.check_identity("x" * (protocol.MAX_IDENTITY + 1))
