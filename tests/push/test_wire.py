"""The push protocol helpers: key encoding, JSON bodies, auth, Retry-After."""

from __future__ import annotations

import email.utils
import json

import pytest

from agentspec._push.wire import (
    DEFAULT_TENANT,
    MAX_RETRY_AFTER,
    WorkerShard,
    bearer_headers,
    check_bearer,
    check_shard_key,
    decode_key_query,
    encode_key_query,
    error_response,
    json_response,
    parse_error,
    parse_retry_after,
    parse_shard_list,
)
from agentspec.exceptions import InvalidArgumentError

KEYS = [
    ("default", None, None),
    ("acme", "etl", "Extract"),
    ("t", None, "SQL"),
    ("t", "p", None),
    ("ü & = ? / #", "a+b c", "%20%"),
    ("x" * 128, "y" * 128, "z" * 128),
]


@pytest.mark.parametrize("key", KEYS)
def test_key_query_round_trip(key):
    q = encode_key_query(key)
    assert decode_key_query(q) == key
    assert "\n" not in q
    assert "#" not in q


def test_absent_parameters():
    assert decode_key_query("") == (DEFAULT_TENANT, None, None)
    assert decode_key_query("stage=S") == (DEFAULT_TENANT, None, "S")
    assert encode_key_query(("t", None, None)) == "tenant=t"


@pytest.mark.parametrize(
    "query",
    [
        "tenant=a&tenant=b",  # repeated
        "stag=x",  # unknown parameter
        "pipeline=",  # empty component
        "stage=" + "x" * 129,  # too long
        "stage=a%00b",  # NUL
        "stage=a%0Ab",  # control character
        "stage=%C2%85",  # C1 control character
        "stage=a%E2%80%8Bb",  # zero-width space (a format character)
        "stage=a%E2%80%AEb",  # right-to-left override
        "stage=a%E2%80%A8b",  # line separator
        "tenant=e%CC%81",  # a decomposed (not NFC) tenant name
        "tenant",  # no '='
        "a=1&&b",  # malformed
    ],
)
def test_bad_queries(query):
    with pytest.raises(InvalidArgumentError):
        decode_key_query(query)


@pytest.mark.parametrize(
    "key",
    [
        None,
        ("a", None),
        ("a", None, None, None),
        (None, None, None),
        ("", None, None),
        ("a", "", None),
        ("a", None, 3),
        ("a\x00", None, None),
        ("a", "b\x7f", None),
    ],
)
def test_bad_keys(key):
    with pytest.raises(InvalidArgumentError):
        check_shard_key(key)
    if isinstance(key, tuple) and len(key) == 3:
        with pytest.raises(InvalidArgumentError):
            encode_key_query(key)


def test_check_shard_key_returns_tuple():
    assert check_shard_key(["a", None, "s"]) == ("a", None, "s")


def test_bearer():
    assert bearer_headers(None) == {}
    assert bearer_headers("k") == {"Authorization": "Bearer k"}
    assert check_bearer(None, None)
    assert check_bearer("anything", None)
    assert check_bearer("Bearer sekrit", "sekrit")
    assert check_bearer("bearer  sekrit ", "sekrit")
    assert not check_bearer(None, "sekrit")
    assert not check_bearer("Bearer sekri", "sekrit")
    assert not check_bearer("Bearer sekrit2", "sekrit")
    assert not check_bearer("Basic sekrit", "sekrit")
    assert not check_bearer("sekrit", "sekrit")
    assert not check_bearer("Bearer ünïcode", "sekrit")


def test_json_and_error_bodies():
    r = json_response(200, {"a": 1}, {"X-Y": "z"})
    assert r.status == 200
    assert r.headers["Content-Type"] == "application/json"
    assert r.headers["X-Y"] == "z"
    assert r.json() == {"a": 1}
    e = error_response(400, "bad bytes", "shard_format_error")
    assert e.json() == {
        "error": {"message": "bad bytes", "type": "shard_format_error", "code": 400}
    }
    assert parse_error(e.body) == ("shard_format_error", "bad bytes")
    assert parse_error(b"<html>oops</html>") == (None, "<html>oops</html>")
    assert parse_error(b'{"error": "plain"}')[0] is None


def test_shard_list():
    entry = WorkerShard(("t", None, "s"), 3, 30, 4096, 7)
    body = json.dumps({"instance": "abc", "shards": [entry.to_json()]}).encode()
    assert parse_shard_list(body) == ("abc", [entry])
    for bad in [
        b"nope",
        b"[]",
        b'{"shards": []}',
        b'{"instance": "a"}',
        b'{"instance": "a", "shards": [1]}',
        b'{"instance": "a", "shards": [{"tenant": "t", "sequences": -1}]}',
        b'{"instance": "a", "shards": [{"tenant": "", "sequences": 1, "tokens": 1,'
        b' "bytes": 1, "max_seq": 1}]}',
    ]:
        with pytest.raises(InvalidArgumentError):
            parse_shard_list(bad)


def test_retry_after():
    assert parse_retry_after({}) is None
    assert parse_retry_after({"Retry-After": "0.1"}) == pytest.approx(0.1)
    assert parse_retry_after({"retry-after": "2"}) == 2.0
    assert parse_retry_after({"Retry-After-Ms": "150"}) == pytest.approx(0.15)
    # retry-after-ms wins over Retry-After
    assert parse_retry_after({"retry-after-ms": "20", "Retry-After": "5"}) == pytest.approx(0.02)
    # capped
    assert parse_retry_after({"Retry-After": "3600"}) == MAX_RETRY_AFTER
    assert parse_retry_after({"retry-after-ms": "1e9"}) == MAX_RETRY_AFTER
    # ignored garbage
    assert parse_retry_after({"Retry-After": "soon"}) is None
    assert parse_retry_after({"Retry-After": "-1"}) is None
    assert parse_retry_after({"retry-after-ms": "nan", "Retry-After": "1"}) == 1.0
    # HTTP date
    now = 1_700_000_000.0
    date = email.utils.formatdate(now + 5, usegmt=True)
    assert parse_retry_after({"Retry-After": date}, now=now) == pytest.approx(5.0)
    past = email.utils.formatdate(now - 5, usegmt=True)
    assert parse_retry_after({"Retry-After": past}, now=now) == 0.0
