"""A real Prometheus scrapes what a library user serves with ``agentspec.metrics.serve``.

A registry of the user's own, one `MetricsCollector` in it with a per-key
counter whose labels are capped at two values, served by the documented
one-liner; Prometheus (Debian's binary) scrapes it and its HTTP API sees the
counts, the third stage folded into ``other`` and the fold counted by
``agentspec_metrics_label_overflow_total``.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry
from prometheus_server import PrometheusError, Target, requires_prometheus

from agentspec.metrics import (
    ENV_MAX_LABEL_VALUES,
    KEY_LABELS,
    LABEL_OVERFLOW_TOTAL,
    REQUESTS_TOTAL,
    MetricsCollector,
    key_labels,
    serve,
)

pytestmark = requires_prometheus


def test_prometheus_scrapes_the_served_registry(start_prometheus, monkeypatch) -> None:
    monkeypatch.setenv(ENV_MAX_LABEL_VALUES, "2")
    registry = CollectorRegistry()
    collector = MetricsCollector()
    requests = collector.counter(REQUESTS_TOTAL, "requests finished", KEY_LABELS)
    collector.register(registry)
    server, thread = serve(0, registry=registry)
    try:
        prom = start_prometheus({"lib": [Target(f"127.0.0.1:{server.server_port}")]})
        for stage, n in (("plan", 3), ("code", 2), ("review", 1)):
            requests.add(key_labels("acme", "triage", stage), n)
        prom.wait_scraped(time.time())
        got = prom.values(f"sum by (stage) ({REQUESTS_TOTAL})", "stage")
        assert got == {"plan": 3.0, "code": 2.0, "other": 1.0}
        folds = prom.query(f'{LABEL_OVERFLOW_TOTAL}{{label="stage"}}')
        assert [float(r["value"][1]) for r in folds] == [1.0]
        assert folds[0]["metric"]["metric"] == REQUESTS_TOTAL
        with pytest.raises(PrometheusError, match="parse error"):
            prom.query("sum(")  # the harness reports Prometheus's own errors
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        collector.unregister()
