"""agentspec.metrics: label caps, scrape-time tables, the off switch, serving."""

from __future__ import annotations

import threading
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from agentspec import metrics
from agentspec.exceptions import InvalidArgumentError
from agentspec.metrics import (
    KEY_LABELS,
    LABEL_OVERFLOW_TOTAL,
    OTHER,
    REQUESTS_TOTAL,
    STEP_SECONDS,
    LabelCap,
    MetricsCollector,
)


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_cap_folds_values_past_the_cap_into_other() -> None:
    cap = LabelCap("m", "stage", max_values=3)
    assert [cap.fold(v) for v in ("a", "b", "c")] == ["a", "b", "c"]
    assert cap.fold("d") == OTHER
    assert cap.fold("e") == OTHER
    assert cap.fold("a") == "a"  # a value seen before the cap filled stays itself
    assert cap.folds == 2


def test_cap_reads_its_size_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(metrics.ENV_MAX_LABEL_VALUES, "2")
    cap = LabelCap("m", "stage")
    assert (cap.max_values, cap.fold("x"), cap.fold("y"), cap.fold("z")) == (2, "x", "y", OTHER)
    monkeypatch.delenv(metrics.ENV_MAX_LABEL_VALUES)
    assert LabelCap("m", "stage").max_values == metrics.DEFAULT_MAX_LABEL_VALUES
    monkeypatch.setenv(metrics.ENV_MAX_LABEL_VALUES, "many")
    with pytest.raises(InvalidArgumentError):
        LabelCap("m", "stage")
    with pytest.raises(InvalidArgumentError):
        LabelCap("m", "stage", max_values=0)


@pytest.mark.parametrize(
    ("value", "enabled"),
    [(None, True), ("1", True), ("yes", True), ("0", False), ("false", False), (" OFF ", False)],
)
def test_off_switch(monkeypatch: pytest.MonkeyPatch, value: str | None, enabled: bool) -> None:
    if value is None:
        monkeypatch.delenv(metrics.ENV_METRICS, raising=False)
    else:
        monkeypatch.setenv(metrics.ENV_METRICS, value)
    assert metrics.metrics_enabled() is enabled


def test_key_labels_fill_missing_parts() -> None:
    assert metrics.key_labels(None, None, "SQL") == (metrics.DEFAULT_TENANT, "", "SQL")
    assert metrics.key_labels("t", "p", "s") == ("t", "p", "s")


def test_collector_output_parses_back_with_the_overflow_counter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(metrics.ENV_MAX_LABEL_VALUES, "2")
    registry = CollectorRegistry()
    collector = MetricsCollector()
    requests = collector.counter(REQUESTS_TOTAL, "requests finished", KEY_LABELS)
    steps = collector.histogram(STEP_SECONDS, "step time", buckets=(0.01, 0.1))
    gauge = collector.gauge("agentspec_test_gauge", "a gauge", ("kind",))
    collector.on_collect(lambda: [GaugeMetricFamily("agentspec_test_live", "live", value=7)])
    collector.register(registry)

    for stage in ("a", "b", "c", "d", "a"):
        requests.add(("t", "p", stage))
    requests.add(("t", "p", "a"), 2.5)
    for seconds in (0.005, 0.05, 0.05, 3.0):
        steps.observe((), seconds)
    gauge.set(("learned",), 4)
    gauge.add(("learned",), -1)

    got = _samples(metrics.render(registry))
    key = (("pipeline", "p"), ("tenant", "t"))
    assert got[REQUESTS_TOTAL, (*key[:1], ("stage", "a"), *key[1:])] == 4.5
    assert got[REQUESTS_TOTAL, (*key[:1], ("stage", "b"), *key[1:])] == 1
    assert got[REQUESTS_TOTAL, (*key[:1], ("stage", OTHER), *key[1:])] == 2  # c and d
    assert got[LABEL_OVERFLOW_TOTAL, (("label", "stage"), ("metric", REQUESTS_TOTAL))] == 2
    assert got[STEP_SECONDS + "_bucket", (("le", "0.01"),)] == 1
    assert got[STEP_SECONDS + "_bucket", (("le", "0.1"),)] == 3
    assert got[STEP_SECONDS + "_bucket", (("le", "+Inf"),)] == 4
    assert got[STEP_SECONDS + "_count", ()] == 4
    assert got[STEP_SECONDS + "_sum", ()] == pytest.approx(3.105)
    assert got["agentspec_test_gauge", (("kind", "learned"),)] == 3
    assert got["agentspec_test_live", ()] == 7

    collector.unregister()
    assert REQUESTS_TOTAL not in metrics.render(registry).decode()


def test_two_collectors_share_one_overflow_family_per_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(metrics.ENV_MAX_LABEL_VALUES, "1")
    registry = CollectorRegistry(auto_describe=True)
    first, second = MetricsCollector(), MetricsCollector()
    a = first.counter("agentspec_test_a_total", "a", ("stage",))
    b = second.counter("agentspec_test_b_total", "b", ("stage",))
    first.register(registry)
    second.register(registry)
    for table in (a, b):
        table.add(("x",))
        table.add(("y",))
    text = metrics.render(registry).decode()
    assert text.count(f"# TYPE {LABEL_OVERFLOW_TOTAL} counter") == 1
    got = _samples(text.encode())
    assert got[LABEL_OVERFLOW_TOTAL, (("label", "stage"), ("metric", "agentspec_test_a_total"))]
    assert got[LABEL_OVERFLOW_TOTAL, (("label", "stage"), ("metric", "agentspec_test_b_total"))]


def test_tables_check_their_label_count() -> None:
    table = MetricsCollector().counter("agentspec_test_total", "t", ("a", "b"))
    with pytest.raises(InvalidArgumentError):
        table.add(("only-one",))


def test_counter_adds_from_many_threads_are_not_lost() -> None:
    table = MetricsCollector().counter("agentspec_test_total", "t", ("stage",))
    per_thread, threads = 20_000, 4

    def work() -> None:
        for _ in range(per_thread):
            table.add(("s",))

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert table.value(("s",)) == per_thread * threads


def test_serve_answers_get_metrics() -> None:
    registry = CollectorRegistry()
    collector = MetricsCollector()
    collector.counter(REQUESTS_TOTAL, "requests", KEY_LABELS).add(("t", "", ""), 3)
    collector.register(registry)
    server, thread = metrics.serve(0, registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = answer.read()
            assert answer.headers["Content-Type"] == metrics.CONTENT_TYPE
        key = (("pipeline", ""), ("stage", ""), ("tenant", "t"))
        assert _samples(body)[REQUESTS_TOTAL, key] == 3
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
