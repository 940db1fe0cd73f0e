"""Fleet building blocks without Redis: ids, key names, redaction, entries, shard state."""

from __future__ import annotations

import array

import pytest
from prereq import require_module

require_module("redis", reason="the redis client is not installed")

from agentspec import SuffixTree  # noqa: E402
from agentspec._fleet.config import FleetConfig  # noqa: E402
from agentspec._fleet.connection import Redactor, redact_url  # noqa: E402
from agentspec._fleet.entry import BadEntryError, FleetEntry, decode_entry  # noqa: E402
from agentspec._fleet.ids import ZERO, check_identity, fleet_seq_id, format_id, parse_id  # noqa: E402
from agentspec._fleet.names import FleetKeys, encode_tenant, shard_name, tenant_acl_pattern  # noqa: E402
from agentspec._fleet.shard import GONE_RING, FleetShard  # noqa: E402
from agentspec.exceptions import InvalidArgumentError  # noqa: E402

KEY = ("acme", "sql", "gen")


def ints(tokens):
    return memoryview(array.array("i", tokens))


def entry(tokens, identity="r1", key=KEY):
    return FleetEntry.make(key, identity, array.array("i", tokens))


# --- ids ---------------------------------------------------------------------


def test_fleet_id_is_63_bits_and_depends_on_every_input():
    base = fleet_seq_id(KEY, "r1", ints([1, 2, 3]))
    assert 0 <= base < 2**63
    assert base == fleet_seq_id(KEY, "r1", ints([1, 2, 3]))
    others = {
        fleet_seq_id(("acme", "sql", "other"), "r1", ints([1, 2, 3])),
        fleet_seq_id(("acme", None, "gen"), "r1", ints([1, 2, 3])),
        fleet_seq_id(KEY, "r2", ints([1, 2, 3])),
        fleet_seq_id(KEY, "r1", ints([1, 2, 4])),
        fleet_seq_id(KEY, "r1", ints([1, 2])),
    }
    assert base not in others
    assert len(others) == 5


def test_fleet_id_fields_are_length_prefixed():
    # Moving bytes between identity and key must not give the same id.
    a = fleet_seq_id(("acme", "a", "b"), "xy", ints([1]))
    b = fleet_seq_id(("acme", "a", "bx"), "y", ints([1]))
    assert a != b


def test_identity_checks():
    assert check_identity("req-1") == "req-1"
    for bad in ("", "x" * 257, 5, None, "\udc80"):
        with pytest.raises(InvalidArgumentError):
            check_identity(bad)


def test_stream_ids_parse_and_compare():
    assert parse_id(b"1700000000000-3") == (1700000000000, 3)
    assert parse_id("5-0") > parse_id("4-99") > ZERO
    assert format_id((5, 1)) == "5-1"
    for bad in (b"5", "a-1", "5-", "-5"):
        with pytest.raises(ValueError, match="not a stream id"):
            parse_id(bad)


# --- names -------------------------------------------------------------------


def test_keys_share_the_tenant_prefix_and_hash_tag():
    keys = FleetKeys.of("acme")
    assert keys.log == "agentspec:{acme}:log"
    names = [keys.log, keys.meta, keys.index, keys.lock, keys.snap(shard_name(KEY))]
    assert all(n.startswith("agentspec:{acme}:") for n in names)
    assert tenant_acl_pattern("acme") == "~agentspec:{acme}:*"


def test_odd_tenant_names_are_hex_encoded_without_glob_characters():
    assert encode_tenant("team-a.b_c") == "team-a.b_c"
    for odd in ("a*b", "a?b", "[x]", "a}b{", "ü", "a b", "%41"):
        enc = encode_tenant(odd)
        assert enc.startswith("%")
        assert bytes.fromhex(enc[1:]).decode() == odd
        assert not set(enc) & set("*?[]\\{}")
    with pytest.raises(InvalidArgumentError):
        encode_tenant("")


def test_shard_names_differ_per_key():
    assert shard_name(KEY) != shard_name(("acme", "sql", None))
    assert len(shard_name(KEY)) == 32


# --- redaction ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://alice:s3cret@host:6379/0", "redis://alice:***@host:6379/0"),
        ("redis://:s3cret@host:6379", "redis://:***@host:6379"),
        ("unix://alice:s3cret@/tmp/r.sock", "unix://alice:***@/tmp/r.sock"),
        ("unix:///tmp/r.sock?db=0&password=s3cret", "unix:///tmp/r.sock?db=0&password=***"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("rediss://u@host", "rediss://u@host"),
    ],
)
def test_redact_url(url, shown):
    assert redact_url(url) == shown
    if "s3cret" in url:
        assert "s3cret" not in Redactor(url).scrub(f"failed {url} with s3cret")


def test_redactor_scrubs_percent_encoded_passwords():
    r = Redactor("redis://alice:p%40ss%3Aword@host")
    assert "p@ss:word" not in r.scrub("auth p@ss:word failed")
    assert "p%40ss%3Aword" not in r.scrub("url p%40ss%3Aword")
    assert "p%40ss" not in r.url


# --- config ------------------------------------------------------------------


def test_config_round_trip_and_checks():
    for cfg in (FleetConfig(), FleetConfig(8, None), FleetConfig(1024, 5)):
        f = {k: v.encode() for k, v in cfg.encode().items()}
        assert FleetConfig.decode(f["depth"], f["budget"]) == cfg
    for bad in (lambda: FleetConfig(1), lambda: FleetConfig(8, 0)):
        with pytest.raises(InvalidArgumentError):
            bad()
    with pytest.raises(InvalidArgumentError):
        FleetConfig.decode(b"x", b"none")


# --- entries -----------------------------------------------------------------


def test_entry_round_trip():
    e = entry([5, 6, 7])
    got = decode_entry(e.fields(16), "acme", 16)
    assert got == e


def _delta(ids_tokens, depth=16):
    with SuffixTree(depth) as t:
        for sid, toks in ids_tokens:
            t.add(sid, toks)
        return t.delta_bytes([sid for sid, _ in ids_tokens])


def bad_entries():
    e = entry([5, 6, 7])
    good = e.fields(16)
    flipped = bytearray(good[b"d"])
    flipped[-5] ^= 0xFF
    yield "missing field", {b"v": b"1", b"k": good[b"k"]}
    yield "unknown format", {**good, b"v": b"2"}
    yield "bad key or identity", {**good, b"k": b"{not json"}
    yield "bad key or identity", {**good, b"k": b'["acme", 5, null]'}
    yield "bad key or identity", {**good, b"i": b""}
    yield "key of another tenant", {**good, b"k": b'["other","sql","gen"]'}
    yield "shard bytes refused", {**good, b"d": bytes(flipped)}
    yield "shard bytes refused", {**good, b"d": b"garbage"}
    yield "shard bytes refused", {**good, b"d": e.fields(32)[b"d"]}
    yield "2 sequences", {**good, b"d": _delta([(e.seq_id, [5, 6, 7]), (1, [1])])}
    yield "not the fleet id", {**good, b"d": _delta([(12345, [5, 6, 7])])}
    yield "empty sequence", _empty_entry()
    yield "oversized", {**good, b"d": good[b"d"] + b"x" * 5000}


def _empty_entry():
    e = FleetEntry.make(KEY, "r", array.array("i"))
    return {b"v": b"1", b"k": b'["acme","sql","gen"]', b"i": b"r", b"d": _delta([(e.seq_id, [])])}


@pytest.mark.parametrize(("reason", "fields"), list(bad_entries()))
def test_bad_entries_are_refused_with_a_reason(reason, fields):
    with pytest.raises(BadEntryError) as info:
        decode_entry(fields, "acme", 16, max_bytes=4096)
    assert reason in info.value.reason


# --- shard state -------------------------------------------------------------


def test_shard_evicts_oldest_first_and_skips_duplicates():
    shard = FleetShard.empty(KEY, 16)
    es = [entry([i, i + 1, i + 2], f"r{i}") for i in range(6)]
    for n, e in enumerate(es):
        assert shard.apply(e, (n + 1, 0), budget=10)
    assert shard.tree.sequence_ids() == []  # readers see the batch only at sync
    shard.sync()
    # 3 tokens each, budget 10: the last three stay.
    assert shard.tree.sequence_ids() == [e.seq_id for e in es[3:]]
    assert shard.tokens == 9
    assert shard.evicted == 3
    assert not shard.apply(es[5], (7, 0), budget=10)  # live duplicate
    assert not shard.apply(es[0], (8, 0), budget=10)  # evicted duplicate (gone ring)
    assert shard.duplicates == 2
    assert shard.last_id == (8, 0)


def test_shard_keeps_the_newest_sequence_even_over_budget():
    shard = FleetShard.empty(KEY, 16)
    shard.apply(entry([1, 2], "a"), (1, 0), budget=3)
    shard.apply(entry(list(range(10)), "b"), (2, 0), budget=3)
    shard.sync()
    assert len(shard.order) == 1
    assert shard.tokens == 10
    assert len(shard.tree.sequence_ids()) == 1


def test_snapshot_round_trip_keeps_order_and_gone_ring():
    shard = FleetShard.empty(KEY, 16)
    es = [entry([i, 7, i], f"r{i}") for i in range(GONE_RING + 10)]
    for n, e in enumerate(es):
        shard.apply(e, (n + 1, 0), budget=30)
        if n % 100 == 0:
            shard.sync()
    shard.sync()
    data, gone = shard.snapshot()
    again = FleetShard.from_snapshot(KEY, data, gone, (99, 0), 16)
    assert again.tree.sequence_ids() == shard.tree.sequence_ids()
    assert list(again.order) == list(shard.order)
    assert again.tokens == shard.tokens
    assert again.gone_set == shard.gone_set
    assert len(again.gone) == GONE_RING
    assert again.through == again.last_id == (99, 0)
    # The same next entry does the same thing on both.
    nxt = entry([1, 2, 3], "next")
    shard.apply(nxt, (100, 0), 30)
    again.apply(nxt, (100, 0), 30)
    shard.sync()
    again.sync()
    assert again.tree.sequence_ids() == shard.tree.sequence_ids()
    assert again.snapshot() == shard.snapshot()
    with pytest.raises(InvalidArgumentError):
        FleetShard.from_snapshot(KEY, data, gone, (99, 0), 32)
    with pytest.raises(InvalidArgumentError):
        FleetShard.from_snapshot(KEY, data, b"123", (99, 0), 16)
