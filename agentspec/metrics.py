"""Prometheus metrics: the metric names, capped labels and scrape-time collectors.

Everything agentspec exports is named ``agentspec_*`` (the constants below) and
built with ``prometheus_client``.  Hot paths never call ``prometheus_client``
per token or per request: they add to plain Python tables (`CounterTable`,
`GaugeTable`, `HistogramTable`), which a `MetricsCollector` renders when the
registry is scraped.

- **Label cap.**  Every label value goes through a `LabelCap` (one per metric
  family and label name): past ``max_values`` distinct values (default 64,
  env ``AGENTSPEC_METRICS_MAX_LABEL_VALUES``) a value is reported as
  ``other``, so a free-form stage tag cannot blow up cardinality.
  ``agentspec_metrics_label_overflow_total{metric,label}`` counts the folds.
- **Off switch.**  ``AGENTSPEC_METRICS=0`` (or ``false``/``no``/``off``)
  turns metrics off in every component (`metrics_enabled`); components with
  options have their own switch too (``EngineOptions.metrics``).
- **Serving.**  ``agentspec.metrics.serve(9464)`` serves a registry (the
  default one unless given) on ``http://127.0.0.1:9464/metrics``; `render`
  returns its exposition text.

A component builds its metrics like this::

    collector = MetricsCollector()
    requests = collector.counter(REQUESTS_TOTAL, "requests finished", KEY_LABELS)
    collector.register(registry)              # or None: the default registry
    ...
    requests.add(key_labels(tenant, pipeline, stage))
"""

from __future__ import annotations

import bisect
import math
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from agentspec.exceptions import InvalidArgumentError
from agentspec.protocol import DEFAULT_TENANT

__all__ = [
    "ACCEPTED_TOKENS_PER_POSITION_TOTAL",
    "ACCEPTED_TOKENS_TOTAL",
    "CLIENT_CALLS_TOTAL",
    "CLIENT_LEARNED_SEQUENCES_TOTAL",
    "CLIENT_LEARN_QUEUE_DEPTH",
    "CLIENT_PUBLISH_BACKLOG",
    "CLIENT_PUBLISH_FAILURES_TOTAL",
    "CLIENT_PUSH_BACKLOG",
    "CLIENT_PUSH_FAILURES_TOTAL",
    "CONTENT_TYPE",
    "DEFAULT_MAX_LABEL_VALUES",
    "DRAFTS_TOTAL",
    "DRAFT_SOURCES",
    "DRAFT_TOKENS_TOTAL",
    "ENV_MAX_LABEL_VALUES",
    "ENV_METRICS",
    "FLEET_APPLIED_TOTAL",
    "FLEET_COMPACTIONS_TOTAL",
    "FLEET_LAG_SECONDS",
    "FLEET_LAG_SECONDS_BUCKETS",
    "FLEET_MALFORMED_TOTAL",
    "FLEET_PUBLISHED_TOTAL",
    "FLEET_RECONNECTS_TOTAL",
    "FLEET_SNAPSHOT_AGE_SECONDS",
    "GOODPUT_ACTIVE",
    "GOODPUT_CALIBRATION_ERROR",
    "GOODPUT_KEPT_TOKENS_TOTAL",
    "GOODPUT_OFFERED_TOKENS_TOTAL",
    "KEY_LABELS",
    "LABEL_OVERFLOW_TOTAL",
    "OTHER",
    "PUSHES_TOTAL",
    "REQUESTS_TOTAL",
    "SHARDS",
    "SHARD_BUDGET_BYTES",
    "SHARD_BYTES",
    "SHARD_EVICTIONS_TOTAL",
    "SHARD_KINDS",
    "SHARD_TOKENS",
    "STEP_COST_COEFFICIENT_SECONDS",
    "STEP_COST_RESIDUAL_SECONDS",
    "STEP_SECONDS",
    "STEP_SECONDS_BUCKETS",
    "TOKENS_PER_STEP",
    "TOKENS_PER_STEP_BUCKETS",
    "VERIFY_STEPS_TOTAL",
    "CounterTable",
    "GaugeTable",
    "HistogramTable",
    "LabelCap",
    "MetricsCollector",
    "key_labels",
    "metrics_enabled",
    "render",
    "serve",
]

# --- switches and limits ------------------------------------------------------

#: ``AGENTSPEC_METRICS=0`` turns every component's metrics off.
ENV_METRICS = "AGENTSPEC_METRICS"
#: The most distinct values one label of one metric family takes before ``other``.
ENV_MAX_LABEL_VALUES = "AGENTSPEC_METRICS_MAX_LABEL_VALUES"
DEFAULT_MAX_LABEL_VALUES = 64
#: What a label value past the cap is reported as.
OTHER = "other"
#: The content type of `render`'s text (Prometheus text format 0.0.4), for a server
#: answering ``GET /metrics``.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_OFF = frozenset({"0", "false", "no", "off"})


def metrics_enabled() -> bool:
    """False when ``AGENTSPEC_METRICS`` is ``0``/``false``/``no``/``off``; True otherwise."""
    return os.environ.get(ENV_METRICS, "1").strip().lower() not in _OFF


def _max_label_values() -> int:
    raw = os.environ.get(ENV_MAX_LABEL_VALUES, "").strip()
    if not raw:
        return DEFAULT_MAX_LABEL_VALUES
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgumentError(
            f"{ENV_MAX_LABEL_VALUES} must be an integer, got {raw!r}"
        ) from None
    if value < 1:
        raise InvalidArgumentError(f"{ENV_MAX_LABEL_VALUES} must be >= 1, got {value}")
    return value


# --- names --------------------------------------------------------------------

#: The labels of a shard key, in this order: ``(tenant, pipeline, stage)``.
KEY_LABELS = ("tenant", "pipeline", "stage")

# speculation (server side: the embedded engine, the vLLM proposer)
REQUESTS_TOTAL = "agentspec_requests_total"
VERIFY_STEPS_TOTAL = "agentspec_verify_steps_total"
DRAFT_TOKENS_TOTAL = "agentspec_draft_tokens_total"
ACCEPTED_TOKENS_TOTAL = "agentspec_accepted_tokens_total"
#: labels ``KEY_LABELS + ("position",)``; position ``"0"`` .. ``"k-1"``
ACCEPTED_TOKENS_PER_POSITION_TOTAL = "agentspec_accepted_tokens_per_position_total"
#: labels ``KEY_LABELS + ("source",)``; source one of `DRAFT_SOURCES`
DRAFTS_TOTAL = "agentspec_drafts_total"
DRAFT_SOURCES = ("request", "stage", "pipeline", "pushed", "fleet", "none")
#: histogram, no labels: one observation per batched verification step
STEP_SECONDS = "agentspec_step_seconds"
#: histogram, label ``stage``: tokens emitted per request per step
TOKENS_PER_STEP = "agentspec_tokens_per_step"

# goodput controller
GOODPUT_OFFERED_TOKENS_TOTAL = "agentspec_goodput_offered_tokens_total"
GOODPUT_KEPT_TOKENS_TOTAL = "agentspec_goodput_kept_tokens_total"
GOODPUT_ACTIVE = "agentspec_goodput_active"
#: gauge, label ``depth``: expected minus observed acceptance rate
GOODPUT_CALIBRATION_ERROR = "agentspec_goodput_calibration_error"
#: gauge, label ``term``: ``per_step``, ``per_request``, ``per_token``
STEP_COST_COEFFICIENT_SECONDS = "agentspec_step_cost_coefficient_seconds"
#: gauge, label ``tokens``: mean prediction residual per size class
STEP_COST_RESIDUAL_SECONDS = "agentspec_step_cost_residual_seconds"

# shards
#: the ``kind`` label's values
SHARD_KINDS = ("learned", "pushed", "fleet")
SHARDS = "agentspec_shards"
SHARD_TOKENS = "agentspec_shard_tokens"
SHARD_BYTES = "agentspec_shard_bytes"
SHARD_EVICTIONS_TOTAL = "agentspec_shard_evictions_total"
SHARD_BUDGET_BYTES = "agentspec_shard_budget_bytes"
#: labels ``result`` (accepted/refused), ``code`` (HTTP status or error type)
PUSHES_TOTAL = "agentspec_pushes_total"

# fleet
FLEET_PUBLISHED_TOTAL = "agentspec_fleet_published_total"
FLEET_APPLIED_TOTAL = "agentspec_fleet_applied_total"
FLEET_MALFORMED_TOTAL = "agentspec_fleet_malformed_total"
FLEET_RECONNECTS_TOTAL = "agentspec_fleet_reconnects_total"
FLEET_COMPACTIONS_TOTAL = "agentspec_fleet_compactions_total"
FLEET_LAG_SECONDS = "agentspec_fleet_lag_seconds"
FLEET_SNAPSHOT_AGE_SECONDS = "agentspec_fleet_snapshot_age_seconds"

# client side (AgentSpecClient, the LiteLLM hook)
CLIENT_CALLS_TOTAL = "agentspec_client_calls_total"
CLIENT_LEARNED_SEQUENCES_TOTAL = "agentspec_client_learned_sequences_total"
CLIENT_LEARN_QUEUE_DEPTH = "agentspec_client_learn_queue_depth"
CLIENT_PUSH_BACKLOG = "agentspec_client_push_backlog"
CLIENT_PUSH_FAILURES_TOTAL = "agentspec_client_push_failures_total"
CLIENT_PUBLISH_BACKLOG = "agentspec_client_publish_backlog"
CLIENT_PUBLISH_FAILURES_TOTAL = "agentspec_client_publish_failures_total"

#: labels ``metric``, ``label``: values folded into ``other`` by a `LabelCap`
LABEL_OVERFLOW_TOTAL = "agentspec_metrics_label_overflow_total"

# histogram buckets shared by every component that observes these
STEP_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
TOKENS_PER_STEP_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0)
FLEET_LAG_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0)


def key_labels(tenant: str | None, pipeline: str | None, stage: str | None) -> tuple[str, str, str]:
    """The `KEY_LABELS` values of a shard key: a missing tenant is `DEFAULT_TENANT`, a missing
    pipeline or stage ``""``."""
    return (tenant or DEFAULT_TENANT, pipeline or "", stage or "")


# --- label caps ---------------------------------------------------------------


class LabelCap:
    """At most ``max_values`` distinct values of one label of one metric family.

    `fold` returns a value unchanged while it is one of the first ``max_values``
    distinct values seen, and `OTHER` past that; `folds` counts the values
    folded.  ``max_values=None`` reads ``AGENTSPEC_METRICS_MAX_LABEL_VALUES``
    (default 64).  Thread-safe.
    """

    __slots__ = ("_folds", "_lock", "_seen", "label", "max_values", "metric")

    def __init__(self, metric: str, label: str, max_values: int | None = None) -> None:
        if max_values is None:
            max_values = _max_label_values()
        if max_values < 1:
            raise InvalidArgumentError(f"max_values must be >= 1, got {max_values}")
        self.metric = metric
        self.label = label
        self.max_values = max_values
        self._seen: set[str] = set()
        self._folds = 0
        self._lock = threading.Lock()

    def fold(self, value: str) -> str:
        """``value`` while it fits under the cap, `OTHER` once the cap is full."""
        if value in self._seen:
            return value
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) < self.max_values:
                self._seen.add(value)
                return value
            self._folds += 1
            return OTHER

    @property
    def folds(self) -> int:
        """How many values were reported as `OTHER`."""
        return self._folds


# --- tables -------------------------------------------------------------------


class _Table:
    """A metric family's values keyed by label tuples (values folded through a cap each)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        max_values: int | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.caps = tuple(LabelCap(name, label, max_values) for label in self.labelnames)
        self._lock = threading.Lock()

    def family(self) -> Metric:
        raise NotImplementedError

    def _empty(self) -> Metric:
        raise NotImplementedError

    def family_from(self, rows: Iterable[tuple[tuple[str, ...], float]]) -> Metric:
        """A family of ``rows`` (label values, value), read from a component's own
        stats at scrape time: the values go through this table's caps, and rows
        folded into one series are summed.  The table's own series are not included."""
        merged: dict[tuple[str, ...], float] = {}
        for labels, value in rows:
            key = self._fold(labels)
            merged[key] = merged.get(key, 0.0) + value
        family = self._empty()
        for key, value in merged.items():
            family.add_metric(key, value)  # type: ignore[attr-defined]
        return family

    def _fold(self, labels: tuple[str, ...]) -> tuple[str, ...]:
        if len(labels) != len(self.caps):
            raise InvalidArgumentError(
                f"{self.name} takes {len(self.caps)} label values {self.labelnames}, "
                f"got {len(labels)}"
            )
        return tuple(cap.fold(value) for cap, value in zip(self.caps, labels, strict=True))


class _ValueTable(_Table):
    """A family of one number per series (counters, gauges)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        max_values: int | None = None,
    ) -> None:
        super().__init__(name, documentation, labelnames, max_values)
        self._values: dict[tuple[str, ...], float] = {}

    def value(self, labels: tuple[str, ...] = ()) -> float:
        """The series' value (0 if never added to or set)."""
        with self._lock:
            return self._values.get(labels, 0.0)

    def items(self) -> list[tuple[tuple[str, ...], float]]:
        """A snapshot of every series."""
        with self._lock:
            return list(self._values.items())

    def family(self) -> Metric:
        """The family as ``prometheus_client`` renders it."""
        family = self._empty()
        for labels, value in self.items():
            family.add_metric(labels, value)  # type: ignore[attr-defined]
        return family


class CounterTable(_ValueTable):
    """A counter family held as plain numbers: `add` is one dict update under a lock."""

    def add(self, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0) to the series ``labels`` (one value per label name)."""
        values = self._values
        with self._lock:
            if labels in values:
                values[labels] += amount
                return
        key = self._fold(labels)
        with self._lock:
            values[key] = values.get(key, 0.0) + amount

    def _empty(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)


class GaugeTable(_ValueTable):
    """A gauge family held as plain numbers (`set` replaces a series' value)."""

    def set(self, labels: tuple[str, ...] = (), value: float = 0.0) -> None:
        """Set the series ``labels`` to ``value``.

        A value folded into `OTHER` replaces the ``other`` series' value: callers that
        need a sum over folded series add with `add` instead."""
        key = self._fold(labels)
        with self._lock:
            self._values[key] = value

    def add(self, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        """Add ``amount`` (may be negative) to the series ``labels``."""
        key = self._fold(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def clear(self) -> None:
        """Drop every series (for a gauge rebuilt from scratch at each scrape)."""
        with self._lock:
            self._values.clear()

    def _empty(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)


class HistogramTable(_Table):
    """A histogram family held as plain bucket counts: `observe` is a bisect and two adds."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = STEP_SECONDS_BUCKETS,
        max_values: int | None = None,
    ) -> None:
        super().__init__(name, documentation, labelnames, max_values)
        bounds = sorted(float(b) for b in buckets if not math.isinf(b))
        if not bounds:
            raise InvalidArgumentError(f"{name}: a histogram needs at least one finite bucket")
        self.buckets = tuple(bounds)
        # per series: [count per bucket..., count in +Inf only] and the sum
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        """Record one observation of ``value`` in the series ``labels``."""
        index = bisect.bisect_left(self.buckets, value)
        with self._lock:
            series = self._series.get(labels)
        if series is None:
            key = self._fold(labels)
            with self._lock:
                series = self._series.setdefault(key, ([0] * (len(self.buckets) + 1), [0.0]))
        with self._lock:
            series[0][index] += 1
            series[1][0] += value

    def count(self, labels: tuple[str, ...] = ()) -> int:
        """How many observations the series holds."""
        with self._lock:
            series = self._series.get(labels)
            return sum(series[0]) if series is not None else 0

    def family(self) -> HistogramMetricFamily:
        """The family as ``prometheus_client`` renders it (cumulative buckets)."""
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            snapshot = [(k, list(v[0]), v[1][0]) for k, v in self._series.items()]
        for labels, counts, total in snapshot:
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, n in zip(self.buckets, counts, strict=False):
                cumulative += n
                buckets.append((_bound_text(bound), float(cumulative)))
            cumulative += counts[-1]
            buckets.append(("+Inf", float(cumulative)))
            family.add_metric(labels, buckets, total)
        return family


def _bound_text(bound: float) -> str:
    return repr(float(bound))


# --- collectors ---------------------------------------------------------------


class MetricsCollector(Collector):
    """A ``prometheus_client`` collector rendering its tables when scraped.

    Make the tables with `counter`, `gauge` and `histogram`; add families computed
    at scrape time (from a component's own ``stats()``) with `on_collect`; then
    `register` it in a registry.  Registering through `register` (not
    ``registry.register``) also gives the registry one
    ``agentspec_metrics_label_overflow_total`` family counting the folds of
    every registered collector's caps.
    """

    def __init__(self) -> None:
        self._tables: list[_Table] = []
        self._scraped: list[_Table] = []  # rendered by callbacks (`family_from`)
        self._callbacks: list[Callable[[], Iterable[Metric]]] = []
        self._registries: list[CollectorRegistry] = []

    def counter(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        at_scrape: bool = False,
    ) -> CounterTable:
        """A counter table rendered at each scrape.  ``at_scrape=True``: a table whose
        series an `on_collect` callback renders with `CounterTable.family_from` (not
        rendered by itself; its caps still count in the overflow family)."""
        table = CounterTable(name, documentation, labelnames)
        (self._scraped if at_scrape else self._tables).append(table)
        return table

    def gauge(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        at_scrape: bool = False,
    ) -> GaugeTable:
        """A gauge table (``at_scrape`` as in `counter`)."""
        table = GaugeTable(name, documentation, labelnames)
        (self._scraped if at_scrape else self._tables).append(table)
        return table

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = STEP_SECONDS_BUCKETS,
    ) -> HistogramTable:
        table = HistogramTable(name, documentation, labelnames, buckets)
        self._tables.append(table)
        return table

    def on_collect(self, callback: Callable[[], Iterable[Metric]]) -> None:
        """Call ``callback`` at every scrape; it yields families (``GaugeMetricFamily`` ...)."""
        self._callbacks.append(callback)

    def caps(self) -> list[LabelCap]:
        """Every label cap of this collector's tables."""
        return [cap for table in (*self._tables, *self._scraped) for cap in table.caps]

    def collect(self) -> Iterator[Metric]:
        for table in self._tables:
            yield table.family()
        for callback in self._callbacks:
            yield from callback()

    def register(self, registry: CollectorRegistry | None = None) -> CollectorRegistry:
        """Register in ``registry`` (default: ``prometheus_client.REGISTRY``); returns it."""
        registry = REGISTRY if registry is None else registry
        registry.register(self)
        _overflow_for(registry).add(self)
        self._registries.append(registry)
        return registry

    def unregister(self) -> None:
        """Leave every registry `register` put this collector in."""
        for registry in self._registries:
            registry.unregister(self)
            _overflow_for(registry).discard(self)
        self._registries.clear()


class _OverflowCollector(Collector):
    """One per registry: `LABEL_OVERFLOW_TOTAL` over its registered collectors' caps."""

    def __init__(self) -> None:
        self._members: weakref.WeakSet[MetricsCollector] = weakref.WeakSet()

    def add(self, member: MetricsCollector) -> None:
        self._members.add(member)

    def discard(self, member: MetricsCollector) -> None:
        self._members.discard(member)

    def collect(self) -> Iterator[Metric]:
        folds: dict[tuple[str, str], float] = {}
        for member in list(self._members):
            for cap in member.caps():
                key = (cap.metric, cap.label)
                folds[key] = folds.get(key, 0.0) + cap.folds
        family = CounterMetricFamily(
            LABEL_OVERFLOW_TOTAL,
            "label values reported as 'other' because the label's cap was full",
            labels=("metric", "label"),
        )
        for key, value in sorted(folds.items()):
            if value:
                family.add_metric(key, value)
        yield family


_overflows: weakref.WeakKeyDictionary[CollectorRegistry, _OverflowCollector] = (
    weakref.WeakKeyDictionary()
)
_overflows_lock = threading.Lock()


def _overflow_for(registry: CollectorRegistry) -> _OverflowCollector:
    with _overflows_lock:
        overflow = _overflows.get(registry)
        if overflow is None:
            overflow = _OverflowCollector()
            registry.register(overflow)
            _overflows[registry] = overflow
        return overflow


# --- serving ------------------------------------------------------------------


def serve(port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None) -> Any:
    """Serve ``registry`` (default: the default registry) on ``http://addr:port/metrics``
    from a daemon thread; returns ``prometheus_client.start_http_server``'s result (the
    server and its thread: ``server.shutdown()`` stops it).  ``port=0`` picks a free port
    (``server.server_port``)."""
    return start_http_server(port, addr=addr, registry=REGISTRY if registry is None else registry)


def render(registry: CollectorRegistry | None = None) -> bytes:
    """The exposition text of ``registry`` (default: the default registry)."""
    return generate_latest(REGISTRY if registry is None else registry)
