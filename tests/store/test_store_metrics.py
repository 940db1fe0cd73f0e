"""ShardStore's shard rows in the default registry, summed over the live stores of the process.

Real stores (in memory and on disk) learn real sequences; the default
registry is scraped with ``prometheus_client.generate_latest`` and parsed
back.  Each test uses its own tenant, so other tests' stores do not interfere
with the per-key rows.
"""

from __future__ import annotations

import gc
import uuid

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agentspec._store.store import ShardStore


@pytest.fixture
def tenant():
    return f"t-{uuid.uuid4().hex[:12]}"


def scrape() -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def labels(tenant, pipeline="", stage="", kind="learned"):
    return frozenset({"kind": kind, "tenant": tenant, "pipeline": pipeline, "stage": stage}.items())


LEARNED = frozenset({("kind", "learned")})


def test_stores_add_up_per_key_and_closed_stores_leave(tenant, tmp_path):
    before = scrape()
    a = ShardStore()
    b = ShardStore(tmp_path / "b")
    try:
        a.learn((tenant, "P", "S"), list(range(1, 40)))
        b.learn((tenant, "P", "S"), list(range(100, 150)))
        b.learn((tenant, None, "T"), [7, 8, 9])
        got = scrape()
        sa, sb = a.stats((tenant, "P", "S")), b.stats((tenant, "P", "S"))
        assert got[("agentspec_shard_tokens", labels(tenant, "P", "S"))] == sa.tokens + sb.tokens
        live = a._shards[(tenant, "P", "S")].live_bytes + b._shards[(tenant, "P", "S")].live_bytes
        assert 0 < live <= sa.bytes + sb.bytes
        assert got[("agentspec_shard_bytes", labels(tenant, "P", "S"))] == live
        st = b.stats((tenant, None, "T"))
        assert got[("agentspec_shard_tokens", labels(tenant, "", "T"))] == st.tokens == 3
        assert (
            got[("agentspec_shards", LEARNED)] == before.get(("agentspec_shards", LEARNED), 0) + 3
        )
    finally:
        a.close()
    got = scrape()
    assert got[("agentspec_shard_tokens", labels(tenant, "P", "S"))] == sb.tokens
    b.close()
    got = scrape()
    assert ("agentspec_shard_tokens", labels(tenant, "P", "S")) not in got


def test_budget_and_evictions_stay_counted_after_close(tenant):
    before = scrape()
    evictions = ("agentspec_shard_evictions_total", LEARNED)
    budget = ("agentspec_shard_budget_bytes", frozenset())
    store = ShardStore(max_bytes=20_000)
    n = 0
    while store._evicted_total < 3:
        store.learn((tenant, None, "E"), [n * 1000 + i for i in range(200)])
        n += 1
    evicted = store._evicted_total
    got = scrape()
    assert got[evictions] == before.get(evictions, 0) + evicted
    assert got[budget] == before.get(budget, 0) + 20_000
    assert 0 < got[("agentspec_shard_bytes", labels(tenant, "", "E"))] <= 20_000  # live bytes
    store.close()
    got = scrape()
    assert got[evictions] == before.get(evictions, 0) + evicted  # a counter never goes back
    assert got.get(budget, 0) == before.get(budget, 0)  # a gauge of a closed store is gone


def test_a_store_dropped_without_close_leaves_the_gauges(tenant):
    store = ShardStore()
    store.learn((tenant, None, "G"), [1, 2, 3, 4])
    assert scrape()[("agentspec_shard_tokens", labels(tenant, "", "G"))] == 4
    del store
    gc.collect()
    assert ("agentspec_shard_tokens", labels(tenant, "", "G")) not in scrape()
