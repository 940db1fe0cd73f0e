"""The process-wide library collector: sums over live objects, dedupe tokens, retiring, failures."""

from __future__ import annotations

import gc

import pytest

from agentspec._util.live_metrics import LiveMetrics
from agentspec.metrics import CLIENT_CALLS_TOTAL, CLIENT_LEARN_QUEUE_DEPTH, CLIENT_PUBLISH_BACKLOG

KEY = ("t-live", "P", "S")


class Source:
    """An object reporting what it is told to (the collector reads it at each collect)."""

    def __init__(self, calls, depth, shared=None, fail_after=None):
        self.calls, self.depth, self.shared, self.fail_after = calls, depth, shared, fail_after

    @staticmethod
    def samples(obj):
        yield (CLIENT_CALLS_TOTAL, KEY, obj.calls)
        if obj.fail_after == "calls":
            raise RuntimeError("closed under us")
        yield (CLIENT_LEARN_QUEUE_DEPTH, (), obj.depth)
        if obj.shared is not None:
            yield (CLIENT_PUBLISH_BACKLOG, (), obj.shared[1], obj.shared[0])


@pytest.fixture
def live():
    lm = LiveMetrics()
    yield lm
    lm.unregister()


def values(lm):
    return {
        (s.name, tuple(s.labels.values())): s.value
        for family in lm.collect()
        for s in family.samples
    }


def test_sums_dedupes_retires_and_survives_a_failing_source(live):
    shared = ("store-1", 5)
    a = Source(3, 1, shared)
    b = Source(4, 2, shared)
    live.track(a, Source.samples)
    live.track(b, Source.samples)
    got = values(live)
    assert got[("agentspec_client_calls_total", KEY)] == 7
    assert got[("agentspec_client_learn_queue_depth", ())] == 3
    assert got[("agentspec_client_publish_backlog", ())] == 5  # one store, reported twice
    live.retire(a)
    a.calls = 100  # no longer read
    got = values(live)
    assert got[("agentspec_client_calls_total", KEY)] == 7  # a's 3 kept
    assert got[("agentspec_client_learn_queue_depth", ())] == 2  # a's gauge gone
    b.fail_after = "calls"
    got = values(live)
    assert got[("agentspec_client_calls_total", KEY)] == 7  # b's rows before the failure
    assert ("agentspec_client_learn_queue_depth", ()) not in got  # no source: no family
    del b
    gc.collect()
    assert values(live) == {("agentspec_client_calls_total", KEY): 3}  # dropped unclosed
