"""AgentSpecClient with ``redis=``: learned outputs reach the fleet under the call's identity.

Against the local OpenAI-compatible server and a real redis-server: each
call carries a fresh ``agentspec_request_id`` in ``vllm_xargs`` (a caller's
own value wins), every choice is published under that id with the same
tokens the store learns (the prompt's lead, then the output), so a worker
publishing the same choice under that identity -- as the vLLM integration
does -- adds nothing; without a fleet nothing changes in the body.
"""

from __future__ import annotations

import array

import pytest
from openai_server import OpenAIServer, reply_text, token_ids
from redis_server import RedisServer, requires_redis_server

from agentspec._client.client import AgentSpecClient
from agentspec._fleet.config import FleetConfig
from agentspec._fleet.ids import fleet_seq_id
from agentspec._fleet.pub import FleetPublisher
from agentspec._fleet.sub import FleetSubscriber
from agentspec._store.fleet_outbox import FleetOptions
from agentspec._store.store import ShardStore
from agentspec.exceptions import InvalidArgumentError

pytestmark = requires_redis_server

CFG = FleetConfig(max_depth=16, max_shard_tokens=None)
KEY = ("default", "P", "S")
LEAD = 8
WAIT = 60.0


@pytest.fixture(scope="module")
def server():
    with OpenAIServer() as srv:
        yield srv


@pytest.fixture
def redis_server():
    with RedisServer() as s:
        yield s


def client_for(server, redis_url: str) -> AgentSpecClient:
    return AgentSpecClient(
        base_url=server.base_url,
        api_key="test",
        max_retries=0,
        timeout=10,
        return_token_ids=True,
        lead_tokens=LEAD,
        redis=FleetOptions(redis_url, config=CFG, durable_after=0, close_timeout=5),
    )


def worker_tokens(prompt: str, choice: int) -> list[int]:
    """What a worker publishes: the prompt's last LEAD ids, then the output's."""
    return token_ids(prompt)[-LEAD:] + token_ids(reply_text(prompt, choice))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_worker_copy_under_the_request_id_is_learned_once(server, redis_server, stream):
    url = redis_server.url
    with FleetSubscriber(url, "default", config=CFG, block_ms=100, compact_every=0) as sub:
        with client_for(server, url) as client, FleetPublisher(url, config=CFG) as worker:
            result = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "question"}],
                n=2,
                stream=stream,
                stage="S",
                pipeline="P",
            )
            if stream:
                list(result)
            rid = server.requests[-1].body["vllm_xargs"]["agentspec_request_id"]
            assert len(rid) == 32
            for i in range(2):  # the worker's side of the same two choices
                worker.publish(KEY, worker_tokens("question", i), rid)
            assert client.flush(WAIT)
            assert client.store.fleet is not None
            assert client.store.fleet.flush(WAIT)
            assert worker.flush(WAIT)
        assert sub.wait_until(lambda: sub.stats().applied + sub.stats().duplicates >= 4, WAIT)
        tree = sub.tree(KEY)
        assert tree is not None
        want = {
            fleet_seq_id(KEY, rid, array.array("i", worker_tokens("question", i))): i
            for i in range(2)
        }
        assert sorted(tree.sequence_ids()) == sorted(want)
        assert sub.stats().shards[KEY].duplicates == 2


def test_the_callers_request_id_wins_and_plain_clients_send_none(server, redis_server):
    url = redis_server.url
    key = ("default", None, None)
    with FleetSubscriber(url, "default", config=CFG, block_ms=100, compact_every=0) as sub:
        with client_for(server, url) as client:
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "q"}],
                extra_body={"vllm_xargs": {"agentspec_request_id": "mine-1"}},
            )
            assert server.requests[-1].body["vllm_xargs"]["agentspec_request_id"] == "mine-1"
            assert client.flush(WAIT)
        assert sub.wait_until(lambda: sub.stats().applied >= 1, WAIT)
        tree = sub.tree(key)
        assert tree is not None
        tokens = array.array("i", worker_tokens("q", 0))
        assert tree.sequence_ids() == [fleet_seq_id(key, "mine-1", tokens)]
    with AgentSpecClient(
        base_url=server.base_url, api_key="t", max_retries=0, redis=False
    ) as plain:
        plain.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
        assert "agentspec_request_id" not in server.requests[-1].body["vllm_xargs"]
    with pytest.raises(InvalidArgumentError, match="redis="), ShardStore() as store:
        AgentSpecClient(base_url=server.base_url, api_key="t", store=store, redis=redis_server.url)
