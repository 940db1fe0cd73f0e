"""The hook's Prometheus metrics, in the proxy process's default registry.

With LiteLLM's ``prometheus`` callback on (``litellm_settings: callbacks:
[..., prometheus]``) the proxy serves ``prometheus_client``'s default
registry on ``/metrics``; the hook registers one collector there when it is
created, so these families appear beside LiteLLM's ``litellm_*`` ones.
Without that callback, serve the registry yourself
(``agentspec.metrics.serve(9464)`` in a module the proxy imports).

The hook only adds to plain tables on the request path (a dict update per
call); queue depths and backlogs are read when the registry is scraped.
Every live hook of the process adds up into one set of families.  The names
are ``agentspec_litellm_*``: they count what the proxy's hook did, beside
the ``agentspec_client_*`` families of `agentspec.AgentSpecClient`, and a
store the hook opens is a `agentspec.ShardStore` like any other.
``AGENTSPEC_METRICS=0`` registers nothing.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from agentspec.metrics import KEY_LABELS, CounterTable, LabelCap, MetricsCollector, key_labels

if TYPE_CHECKING:
    from agentspec_litellm.hook import AgentSpecHook

__all__ = [
    "CALLS_TOTAL",
    "ERRORS_TOTAL",
    "LEARNED_SEQUENCES_TOTAL",
    "LEARN_DROPPED_TOTAL",
    "LEARN_QUEUE_DEPTH",
    "PUBLISH_BACKLOG",
    "PUBLISH_FAILURES_TOTAL",
    "PUSH_BACKLOG",
    "PUSH_FAILURES_TOTAL",
    "HookMetrics",
    "install",
]

#: calls the hook tagged, by shard key
CALLS_TOTAL = "agentspec_litellm_calls_total"
#: sequences learned into the store (one per choice), by shard key
LEARNED_SEQUENCES_TOTAL = "agentspec_litellm_learned_sequences_total"
#: finished answers waiting for the learner thread
LEARN_QUEUE_DEPTH = "agentspec_litellm_learn_queue_depth"
#: answers dropped because the learner's queue was full
LEARN_DROPPED_TOTAL = "agentspec_litellm_learn_dropped_total"
#: (endpoint, shard) pairs the pushers have not delivered at the store's version
PUSH_BACKLOG = "agentspec_litellm_push_backlog"
#: pushes that failed after their retries
PUSH_FAILURES_TOTAL = "agentspec_litellm_push_failures_total"
#: learned answers the fleet outbox has not settled in Redis yet
PUBLISH_BACKLOG = "agentspec_litellm_publish_backlog"
#: failed attempts to reach Redis plus entries Redis refused
PUBLISH_FAILURES_TOTAL = "agentspec_litellm_publish_failures_total"
#: failures of agentspec inside the hook (never of a request), by where
ERRORS_TOTAL = "agentspec_litellm_errors_total"


class HookMetrics:
    """One hook's per-key tables (`agentspec.metrics.CounterTable`: a dict add per event)."""

    def __init__(self) -> None:
        """Empty tables."""
        self.calls = CounterTable(CALLS_TOTAL, "calls the agentspec hook tagged", KEY_LABELS)
        self.learned = CounterTable(
            LEARNED_SEQUENCES_TOTAL, "sequences the agentspec hook learned", KEY_LABELS
        )

    def call(self, key: tuple[str, str | None, str | None]) -> None:
        """Count one tagged call."""
        self.calls.add(key_labels(*key))

    def learned_sequence(self, key: tuple[str, str | None, str | None]) -> None:
        """Count one learned sequence."""
        self.learned.add(key_labels(*key))


class _HookCollector(MetricsCollector):
    """Every live hook of the process, summed."""

    def __init__(self) -> None:
        super().__init__()
        self.hooks: weakref.WeakSet[AgentSpecHook] = weakref.WeakSet()
        self._where = LabelCap(ERRORS_TOTAL, "where")
        self.on_collect(self._families)

    def caps(self) -> list[LabelCap]:
        return [
            self._where,
            *(cap for hook in list(self.hooks) for cap in _tables_caps(hook.metrics)),
        ]

    def _families(self) -> Iterator[Metric]:
        hooks = list(self.hooks)
        for name, doc, attr in (
            (CALLS_TOTAL, "calls the agentspec hook tagged", "calls"),
            (LEARNED_SEQUENCES_TOTAL, "sequences the agentspec hook learned", "learned"),
        ):
            family = CounterMetricFamily(name, doc, labels=KEY_LABELS)
            sums: dict[tuple[str, ...], float] = {}
            for hook in hooks:
                for labels, n in getattr(hook.metrics, attr).items():
                    sums[labels] = sums.get(labels, 0.0) + n
            for labels, n in sorted(sums.items()):
                family.add_metric(labels, n)
            yield family
        totals = {"queue": 0, "dropped": 0, "push_backlog": 0, "push_failures": 0}
        totals.update(publish_backlog=0, publish_failures=0)
        errors: dict[str, float] = {}
        for hook in hooks:
            _add_hook(hook, totals, errors, self._where)
        gauges = (
            (LEARN_QUEUE_DEPTH, "finished answers waiting to be learned", "queue"),
            (
                PUSH_BACKLOG,
                "(endpoint, shard) pairs not pushed at the store's version",
                "push_backlog",
            ),
            (
                PUBLISH_BACKLOG,
                "learned answers not settled in the fleet's Redis",
                "publish_backlog",
            ),
        )
        counters = (
            (LEARN_DROPPED_TOTAL, "answers dropped: the learn queue was full", "dropped"),
            (PUSH_FAILURES_TOTAL, "pushes that failed after their retries", "push_failures"),
            (PUBLISH_FAILURES_TOTAL, "failed Redis attempts, refused entries", "publish_failures"),
        )
        for name, doc, field in gauges:
            yield GaugeMetricFamily(name, doc, value=totals[field])
        for name, doc, field in counters:
            yield CounterMetricFamily(name, doc, value=totals[field])
        family = CounterMetricFamily(
            ERRORS_TOTAL, "failures inside the agentspec hook (requests go on)", labels=("where",)
        )
        for where, n in sorted(errors.items()):
            family.add_metric((where,), n)
        yield family


def _tables_caps(metrics: HookMetrics) -> list[LabelCap]:
    return [*metrics.calls.caps, *metrics.learned.caps]


def _add_hook(
    hook: AgentSpecHook, totals: dict[str, int], errors: dict[str, float], where: LabelCap
) -> None:
    """Add one hook's queue, backlogs and failures (read now) to the totals."""
    counts = hook.counters.snapshot()
    totals["dropped"] += counts.get("dropped", 0)
    for name, n in counts.items():
        if name.startswith("errors."):
            key = where.fold(name.removeprefix("errors."))
            errors[key] = errors.get(key, 0.0) + n
    state: Any = hook._state
    if state is None:
        return
    totals["queue"] += state.learner.depth()
    for pusher in state.pushers:
        for status in pusher.status().values():
            totals["push_backlog"] += len(status.pending)
            totals["push_failures"] += status.errors
    store = state.learner.store
    outbox = store.fleet if store is not None else None
    if outbox is not None:
        st = outbox.stats()
        totals["publish_backlog"] += st.pending
        totals["publish_failures"] += st.publisher.failures + st.rejected


_collector: _HookCollector | None = None
_lock = threading.Lock()


def install(hook: AgentSpecHook, registry: CollectorRegistry | None = None) -> None:
    """Count ``hook`` in the process's collector, registered in ``registry`` (default:
    the default registry) on the first call."""
    global _collector
    with _lock:
        if _collector is None:
            _collector = _HookCollector()
            _collector.register(REGISTRY if registry is None else registry)
        _collector.hooks.add(hook)
