"""The hook in the fleet: ``redis`` / ``$AGENTSPEC_REDIS_URL``, against a real redis-server.

In-process, with LiteLLM's own response types (as tests/test_hook.py): a
call through the hook carries ``vllm_xargs.agentspec_request_id`` and its
answer reaches the fleet's stream under that identity, with the tokens a
vLLM worker publishes (the prompt's last 8 ids, then the output's), so the
worker's copy -- a second `FleetPublisher` here, as in the main suite's
tests/test_client_fleet.py -- is learned once; a client's own request id
wins; Redis down: the hook serves and learns, and publishes the backlog
once Redis is up; the Redis password shows in no log line, error, repr or
stats file.  A `FleetSubscriber` reads what the fleet holds.  Waits are
events with generous timeouts, never sleeps.
"""

from __future__ import annotations

import array
import asyncio
import json
import logging
import shutil
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from litellm.types.utils import ModelResponse, ModelResponseStream
from redis_server import RedisServer, requires_redis_server

from agentspec._fleet.ids import fleet_seq_id
from agentspec._fleet.names import tenant_acl_rules
from agentspec._fleet.pub import FleetPublisher
from agentspec._fleet.sub import FleetSubscriber
from agentspec_litellm import AgentSpecHook
from agentspec_litellm.config import REDIS_URL_ENV
from agentspec_litellm.hook import REQUEST_ID_XARG

pytestmark = requires_redis_server

USER = SimpleNamespace(token=None, api_key=None, team_id=None, key_alias=None, user_id=None)
KEY = ("default", None, "S")
PROMPT_IDS = list(range(100, 120))
LEAD = PROMPT_IDS[-8:]  # the default lead_tokens, as the vLLM worker's
WAIT = 60.0


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


@pytest.fixture(autouse=True)
def _no_fleet_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)


def subscriber(url: str) -> FleetSubscriber:
    return FleetSubscriber(url, "default", block_ms=100, compact_every=0, max_backoff=0.05)


def request(**extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "proxy_server_request": {"headers": {"x-agentspec-stage": "S"}},
        **extra,
    }


def answer(ids: list[int]) -> ModelResponse:
    return ModelResponse(
        choices=[
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "x"},
                "provider_specific_fields": {"token_ids": ids},
            }
        ],
        prompt_token_ids=PROMPT_IDS,
    )


def chunks(ids: list[int]) -> list[ModelResponseStream]:
    first: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""}}
    out = [ModelResponseStream(id="s", model="m", choices=[first], prompt_token_ids=PROMPT_IDS)]
    for t in ids:
        choice = {"index": 0, "delta": {"content": "x"}, "token_ids": [t]}
        out.append(ModelResponseStream(id="s", model="m", choices=[choice]))
    done = {"index": 0, "delta": {}, "finish_reason": "stop"}
    out.append(ModelResponseStream(id="s", model="m", choices=[done]))
    return out


def call(hook: AgentSpecHook, ids: list[int], *, stream: bool = False, **extra: Any) -> str | None:
    """One call through the hook's four points; the request id the upstream got."""
    data = asyncio.run(hook.async_pre_call_hook(USER, None, request(**extra), "acompletion"))
    deployment = asyncio.run(hook.async_pre_call_deployment_hook(dict(data), "acompletion"))
    assert deployment is not None
    rid = deployment["vllm_xargs"].get(REQUEST_ID_XARG)
    assert deployment["extra_body"]["vllm_xargs"].get(REQUEST_ID_XARG) == rid
    if not stream:
        resp = answer(ids)
        asyncio.run(hook.async_post_call_success_hook(data, USER, resp))
        assert resp.choices[0].message.content == "x"  # the answer goes on
        return rid

    async def upstream() -> AsyncIterator[ModelResponseStream]:
        for c in chunks(ids):
            yield c

    async def drain() -> list[Any]:
        gen = hook.async_post_call_streaming_iterator_hook(USER, upstream(), data)
        return [c async for c in gen]

    assert len(asyncio.run(drain())) == len(ids) + 2
    return rid


def fid(rid: str, tokens: list[int]) -> int:
    return fleet_seq_id(KEY, rid, memoryview(array.array("i", tokens)))


def held(sub: FleetSubscriber) -> dict[int, list[int]]:
    tree = sub.tree(KEY)
    if tree is None:
        return {}
    ids = tree.sequence_ids()
    assert len(ids) == len(set(ids))
    return {i: list(tree.sequence(i)) for i in ids}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("source", ["config", "env"])
def test_an_answer_reaches_the_fleet_once_with_the_workers_copy(
    tmp_path: Path,
    server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    source: str,
    stream: bool,
) -> None:
    config: dict[str, Any] = {"store": str(tmp_path / "s"), "push": []}
    if source == "config":
        config["redis"] = server.url
    else:
        monkeypatch.setenv(REDIS_URL_ENV, server.url)
    with subscriber(server.url) as sub:
        hook = AgentSpecHook(config)
        try:
            with FleetPublisher(server.url) as worker:
                rid = call(hook, [7, 8, 9], stream=stream)
                assert isinstance(rid, str)
                assert len(rid) == 32
                int(rid, 16)
                # the worker's side: the same answer under the request id it was sent
                worker.publish(KEY, [*LEAD, 7, 8, 9], rid)
                assert worker.flush(WAIT)
            assert hook.flush(WAIT)
            assert hook.counters.snapshot()["learned"] == 1
        finally:
            hook.close()
        assert sub.wait_until(lambda: sub.stats().applied + sub.stats().duplicates >= 2, WAIT)
        assert held(sub) == {fid(rid, [*LEAD, 7, 8, 9]): [*LEAD, 7, 8, 9]}
        assert sub.stats().shards[KEY].duplicates == 1
    with server.client() as admin:
        entries = admin.xrange("agentspec:{default}:log")
    assert [e[b"i"].decode() for _, e in entries] == [rid, rid]  # two copies, one learned


def test_the_clients_request_id_wins_and_a_bad_one_is_replaced(
    tmp_path: Path, server: RedisServer
) -> None:
    hook = AgentSpecHook({"store": str(tmp_path / "s"), "push": [], "redis": server.url})
    with subscriber(server.url) as sub:
        try:
            own = call(hook, [1, 2], vllm_xargs={REQUEST_ID_XARG: "mine-1", "other": 5})
            assert own == "mine-1"
            nested = call(hook, [3, 4], extra_body={"vllm_xargs": {REQUEST_ID_XARG: "mine-2"}})
            assert nested == "mine-2"
            fresh = call(hook, [5, 6], vllm_xargs={REQUEST_ID_XARG: "x" * 300})
            assert fresh is not None
            assert len(fresh) == 32
            assert hook.counters.snapshot()["tag_problems"] == 1
            assert hook.flush(WAIT)
        finally:
            hook.close()
        want = {
            fid("mine-1", [*LEAD, 1, 2]): [*LEAD, 1, 2],
            fid("mine-2", [*LEAD, 3, 4]): [*LEAD, 3, 4],
            fid(fresh, [*LEAD, 5, 6]): [*LEAD, 5, 6],
        }
        assert sub.wait_until(lambda: sub.stats().applied >= 3, WAIT)
        assert held(sub) == want


def test_without_a_fleet_no_request_id_is_added(
    tmp_path: Path, server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(REDIS_URL_ENV, server.url)
    hook = AgentSpecHook({"store": str(tmp_path / "s"), "push": [], "redis": False})
    try:
        assert call(hook, [1, 2]) is None
        assert call(hook, [1, 2], vllm_xargs={REQUEST_ID_XARG: "kept"}) == "kept"  # passed on
        assert hook.flush(WAIT)
        assert hook.store is not None
        assert hook.store.fleet is None
        assert hook.counters.snapshot()["learned"] == 2
    finally:
        hook.close()
    with server.client() as admin:
        assert admin.exists("agentspec:{default}:log") == 0


def test_redis_down_the_hook_serves_and_learns_then_publishes_the_backlog(
    tmp_path: Path,
) -> None:
    srv = RedisServer()  # not started: its socket does not exist yet
    n = 5
    stats = tmp_path / "stats.json"
    config = {"store": str(tmp_path / "s"), "push": [], "redis": srv.url, "stats_file": str(stats)}
    hook = AgentSpecHook(config)
    try:
        rids = [call(hook, [50 + i, 60 + i]) for i in range(n)]
        assert hook.flush(WAIT, fleet=False)  # learned, not published
        assert hook.counters.snapshot()["learned"] == n
        store = hook.store
        assert store is not None
        assert store.fleet is not None
        assert store.fleet.stats().pending == n
        tree = store.tree(KEY)
        assert tree is not None
        assert len(tree.sequence_ids()) == n  # the local store has them all
        written = json.loads(stats.read_text())
        assert written["fleet"]["pending"] == n
        assert written["fleet"]["connected"] is False
        srv.start()
        with subscriber(srv.url) as sub:
            assert hook.flush(WAIT), store.fleet.stats()
            want = {
                fid(rid, [*LEAD, 50 + i, 60 + i]): [*LEAD, 50 + i, 60 + i]
                for i, rid in enumerate(rids)
                if rid is not None
            }
            assert len(want) == n
            assert sub.wait_until(lambda: sub.stats().applied >= n, WAIT)
            assert held(sub) == want
            assert store.fleet.stats().pending == 0
    finally:
        hook.close()
        srv.stop()
        shutil.rmtree(srv.dir, ignore_errors=True)


PASSWORD = "pw-Wh1sper-7f3a"


class LogEvent(logging.Handler):
    """Set once a log record whose message holds ``text`` arrives."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text = text
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()

    def wait(self, timeout: float) -> bool:
        return self.event.wait(timeout)


def test_the_password_is_never_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="agentspec")
    with RedisServer(tcp=True) as srv:
        with srv.client() as admin:
            admin.execute_command(
                "ACL", "SETUSER", "proxy", "on", f">{PASSWORD}", *tenant_acl_rules("default")
            )
        url = srv.url_for("proxy", PASSWORD, tcp=True)
        stats = tmp_path / "stats.json"
        monkeypatch.setenv(REDIS_URL_ENV, url)
        hook = AgentSpecHook({"store": str(tmp_path / "s"), "push": [], "stats_file": str(stats)})
        shown = []
        with subscriber(srv.url) as sub:
            try:
                rid = call(hook, [9, 9, 9])
                assert rid is not None
                assert hook.flush(WAIT)
                assert hook.store is not None
                shown += [repr(hook), repr(hook.store), repr(hook.store.fleet)]
                shown += [repr(hook.store.fleet.stats()), stats.read_text()]
            finally:
                hook.close()
            assert sub.wait_until(lambda: sub.stats().applied >= 1, WAIT)
            assert held(sub) == {fid(rid, [*LEAD, 9, 9, 9]): [*LEAD, 9, 9, 9]}
        assert json.loads(shown[-1])["fleet"]["redis"] == (
            f"redis://proxy:***@127.0.0.1:{srv.port}/0"
        )
        # refused URLs: a config error, counted and logged, the hook only tags
        for bad in (f"http://proxy:{PASSWORD}@h:1", f"redis://proxy:{PASSWORD}@h:port"):
            monkeypatch.setenv(REDIS_URL_ENV, bad)
            refused = AgentSpecHook({"store": str(tmp_path / "t"), "push": []})
            try:
                assert call(refused, [1]) is None
                assert refused.counters.snapshot()["errors.config"] == 1
                assert refused.store is None
            finally:
                refused.close()
        # a password Redis refuses: the publisher's error, kept and logged, is scrubbed
        wrong = srv.url_for("proxy", PASSWORD + "-wrong", tcp=True)
        monkeypatch.setenv(REDIS_URL_ENV, wrong)
        refusal = LogEvent("publisher cannot write to redis now")
        logging.getLogger("agentspec").addHandler(refusal)
        denied = AgentSpecHook({"store": str(tmp_path / "u"), "push": []})
        try:
            call(denied, [2])
            assert refusal.wait(WAIT)
            assert denied.store is not None
            assert denied.store.fleet is not None
            last = denied.store.fleet.stats().publisher.last_error
            assert last is not None
            assert "invalid username-password pair" in last
            shown.append(repr(denied.store.fleet.stats()))
        finally:
            logging.getLogger("agentspec").removeHandler(refusal)
            denied.close()
    assert "ready" in " ".join(r.getMessage() for r in caplog.records)
    logged = [f"{r.getMessage()} {vars(r)}" for r in caplog.records]
    assert any(f"redis://proxy:***@127.0.0.1:{srv.port}/0" in line for line in logged)
    for text in shown + logged + [str(last)]:
        assert PASSWORD not in text
