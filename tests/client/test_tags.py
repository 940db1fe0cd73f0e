"""Tests of agentspec._client.tags: tag scopes on contextvars, validation, header encoding."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentspec._client.tags import (
    MAX_TAG_LENGTH,
    Tags,
    TagScope,
    check_tag,
    current_tags,
    decode_header_value,
    encode_header_value,
    resolve,
    session,
    stage,
)
from agentspec.exceptions import InvalidArgumentError


def test_no_scope_means_no_tags():
    assert current_tags() == Tags(None, None, None)


def test_stage_scope_sets_and_restores():
    with stage("SQL") as tags:
        assert tags == Tags(stage="SQL")
        assert current_tags().stage == "SQL"
    assert current_tags() == Tags()


def test_nesting_overrides_only_named_tags_and_restores_each_level():
    with session("s1", pipeline="p1") as outer:
        assert outer == Tags("s1", None, "p1")
        with stage("plan"):
            assert current_tags() == Tags("s1", "plan", "p1")
            with stage("SQL"), session("s2"):
                assert current_tags() == Tags("s2", "SQL", "p1")
            assert current_tags() == Tags("s1", "plan", "p1")
        assert current_tags() == Tags("s1", None, "p1")
    assert current_tags() == Tags()


def test_scope_restores_on_exception():
    with pytest.raises(KeyError), stage("A"):
        raise KeyError("x")
    assert current_tags() == Tags()


def test_session_without_id_makes_a_random_one():
    with session() as a:
        pass
    with session() as b:
        pass
    assert a.session
    assert b.session
    assert a.session != b.session


def test_scope_cannot_be_entered_twice_at_once_but_can_be_reused():
    scope = stage("A")
    with scope:
        with pytest.raises(RuntimeError, match="already active"), scope:
            pass
        assert current_tags().stage == "A"
    with scope:
        assert current_tags().stage == "A"
    with pytest.raises(RuntimeError, match="not entered"):
        scope.__exit__(None, None, None)


def test_on_exit_gets_the_scope_tags():
    seen = []
    with stage("outer"), TagScope(session="s", on_exit=seen.append):
        pass
    assert seen == [Tags("s", "outer", None)]


def test_threads_do_not_see_each_others_tags():
    barrier = threading.Barrier(2, timeout=10)
    seen: dict[str, Tags] = {}

    def work(name: str) -> None:
        with stage(name):
            barrier.wait()
            seen[name] = current_tags()
            barrier.wait()

    threads = [threading.Thread(target=work, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"a": Tags(stage="a"), "b": Tags(stage="b")}


def test_async_tasks_keep_their_own_tags():
    async def task(name: str, delay: float) -> tuple[Tags, Tags]:
        async with stage(name):
            await asyncio.sleep(delay)
            inside = current_tags()
        return inside, current_tags()

    async def main():
        async with session("s"):
            return await asyncio.gather(task("a", 0.02), task("b", 0.0))

    (a_in, a_out), (b_in, b_out) = asyncio.run(main())
    assert a_in == Tags("s", "a", None)
    assert b_in == Tags("s", "b", None)
    assert a_out == b_out == Tags("s", None, None)


def test_resolve_per_call_values_over_context():
    with session("s", pipeline="p"), stage("A"):
        assert resolve(None, None, None) == Tags("s", "A", "p")
        assert resolve(None, "B", None) == Tags("s", "B", "p")
        assert resolve("t", None, "q") == Tags("t", "A", "q")
    with pytest.raises(InvalidArgumentError, match="stage"):
        resolve(None, "", None)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("", "1..128"),
        ("x" * (MAX_TAG_LENGTH + 1), "1..128"),
        ("a\x00b", "control"),
        ("a\nb", "control"),
        ("a\x85b", "control"),
        (5, "must be a str"),
        (None, "must be a str"),
        (b"SQL", "must be a str"),
    ],
)
def test_bad_tags_are_refused(value, match):
    with pytest.raises(InvalidArgumentError, match=match):
        check_tag(value, "stage")
    if value is not None:  # None means "inherit" in a scope
        with pytest.raises(InvalidArgumentError, match=match):
            TagScope(stage=value)


def test_bad_scope_arguments_fail_when_made_not_when_entered():
    with pytest.raises(InvalidArgumentError, match="session"):
        session("x\ty")
    with pytest.raises(InvalidArgumentError, match="pipeline"):
        session("ok", pipeline="")
    assert current_tags() == Tags()


def test_longest_tag_is_accepted():
    assert check_tag("x" * MAX_TAG_LENGTH, "stage") == "x" * MAX_TAG_LENGTH


@pytest.mark.parametrize(
    ("value", "sent"),
    [
        ("SQL", "SQL"),
        ("plan step", "plan step"),
        ("a/b:c=d", "a/b:c=d"),
        ("50%", "50%25"),
        (" lead", "%20lead"),
        ("trail ", "trail%20"),
        ("étape", "%C3%A9tape"),
    ],
)
def test_header_encoding(value, sent):
    assert encode_header_value(value) == sent
    assert decode_header_value(sent) == value


@given(st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=40))
def test_header_encoding_round_trips_and_is_plain_ascii(value):
    sent = encode_header_value(value)
    assert sent.isascii()
    assert sent == sent.strip()
    assert all(0x20 <= ord(c) < 0x7F for c in sent)
    assert decode_header_value(sent) == value
