"""Shard keys: validation (lone surrogates included) wherever keys enter."""

from __future__ import annotations

import json

import pytest

from agentspec import ShardStore
from agentspec._client.tags import stage
from agentspec._core.shardkey import check_key, key_dir_name, make_key
from agentspec._core.tree import SuffixTree
from agentspec._push.intake import ShardIntake
from agentspec._push.wire import (
    SHARD_CONTENT_TYPE,
    SNAPSHOT_PATH,
    WorkerShard,
    decode_key_query,
    encode_key_query,
    parse_error,
)
from agentspec.exceptions import InvalidArgumentError

SURROGATES = ["\ud800", "a\udfff", "\udc80b", "ok\ud83d"]  # lone halves, surrogateescape's range


@pytest.mark.parametrize("bad", SURROGATES, ids=ascii)
@pytest.mark.parametrize("where", [0, 1, 2])
def test_check_key_refuses_lone_surrogates(bad: str, where: int) -> None:
    key = ["t", "p", "s"]
    key[where] = bad
    with pytest.raises(InvalidArgumentError, match="not encodable as UTF-8"):
        check_key(tuple(key))


def test_non_ascii_keys_stay_valid() -> None:
    key = ("tenänt", "パイプライン", "stage \U0001f600")  # a real pair: the emoji encodes
    assert check_key(key) == key
    assert make_key("tenänt") == ("tenänt", None, None)
    assert key_dir_name(key)  # UTF-8 based names work
    assert decode_key_query(encode_key_query(key)) == key


@pytest.mark.parametrize("path", [None, "disk"])
def test_store_learn_refuses_a_surrogate_key_with_invalid_argument(tmp_path, path) -> None:
    """The review's reproducer: a disk-backed learn raised UnicodeEncodeError."""
    store = ShardStore(tmp_path / "s" if path else None, max_depth=8)
    try:
        with pytest.raises(InvalidArgumentError):
            store.learn(("\ud800", None, None), [1, 2, 3])
        with pytest.raises(InvalidArgumentError):
            store.learn(("t", None, "x\udc80"), [1, 2, 3])
        assert store.keys() == []
        store.learn(("t", None, "é"), [1, 2, 3])
        assert store.keys() == [("t", None, "é")]
    finally:
        store.close()


def test_tags_refuse_lone_surrogates() -> None:
    with pytest.raises(InvalidArgumentError, match="UTF-8"), stage("x\ud800"):
        pass


def test_wire_encoding_refuses_surrogates_and_bad_escapes() -> None:
    with pytest.raises(InvalidArgumentError):
        encode_key_query(("\ud800", None, None))
    for query in (
        "tenant=%ED%A0%80",  # UTF-8 encoding of U+D800: not valid UTF-8
        "tenant=%FF",
        "stage=a%C3",  # a truncated sequence
        "tenant=\u00e9",  # raw non-ASCII (a client sending bytes unescaped)
        "tenant=\udc80",
    ):
        with pytest.raises(InvalidArgumentError, match="malformed query string"):
            decode_key_query(query)
    assert decode_key_query("tenant=%C3%A9") == ("é", None, None)


def test_worker_shard_entries_refuse_surrogates() -> None:
    entry = json.loads(
        '{"tenant": "\\ud800", "pipeline": null, "stage": null, '
        '"sequences": 0, "tokens": 0, "bytes": 0, "max_seq": 0}'
    )
    with pytest.raises(InvalidArgumentError):
        WorkerShard.from_json(entry)


def test_intake_answers_400_for_surrogate_keys() -> None:
    intake = ShardIntake(max_depth=8)
    tree = SuffixTree(8)
    tree.add(1, [1, 2, 3])
    data = tree.to_bytes()
    for query in ("tenant=%ED%A0%80", "stage=%ED%B2%80", "tenant=\u00e9"):
        r = intake.handle("PUT", SNAPSHOT_PATH, query, {"Content-Type": SHARD_CONTENT_TYPE}, data)
        assert r.status == 400, query
        kind, message = parse_error(r.body)
        assert kind == "invalid_request_error"
        assert "Traceback" not in message
    assert intake.keys() == []
    ok = encode_key_query(("é", None, "\U0001f600"))
    r = intake.handle("PUT", SNAPSHOT_PATH, ok, {"Content-Type": SHARD_CONTENT_TYPE}, data)
    assert r.status == 200
    assert intake.keys() == [("é", None, "\U0001f600")]
