"""Library metrics in the default registry: families summed over the live objects reporting them.

`AgentSpecClient` (its shared core), `ShardStore` and `FleetSubscriber` call
`track(obj, samples)` when made: ``samples(obj)`` reads the object's own
``stats()`` and yields ``(family, label values, value)`` -- or ``(family, label
values, value, token)``, where samples with the same token count once (two
clients sharing one store report its backlog once).  A histogram family's value
is ``(counts per bucket, +Inf last, not cumulative; sum)``.  Nothing runs per call:
the one process-wide collector (`LIVE`, registered in
``prometheus_client.REGISTRY`` on the first `track`) asks every live object
when the registry is scraped and sums what they say, so several clients in one
process add up.  An object's counters stay counted after it is closed
(`retire`); one dropped without being closed takes its counts with it (a
counter reset, which ``rate()`` absorbs).  Label values go through one
`agentspec.metrics.LabelCap` per family and label.  A family is yielded only
when some live object reports it, and the collector claims no names when
registered (``describe()`` is empty), so a process whose integration reports
the same family for its own objects through another collector never fails to
register it.  ``AGENTSPEC_METRICS=0`` turns it off (`track` does nothing).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from agentspec import metrics as m
from agentspec._util.log import get_logger

__all__ = ["FAMILIES", "LIVE", "Family", "LiveMetrics", "Sample", "retire", "track"]

#: ``(family, label values, value)`` or ``(family, label values, value, dedupe token)``.
Sample = tuple[Any, ...]
Samples = Callable[[Any], Iterable[Sample]]

_log = get_logger()


@dataclass(frozen=True)
class Family:
    """A family this collector renders: its name, type, help text and label names
    (``buckets``: a histogram with these bucket bounds; ``counter`` is then True)."""

    name: str
    counter: bool
    documentation: str
    labelnames: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


_T = m.KEY_LABELS
_K = ("kind",)
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(m.CLIENT_CALLS_TOTAL, True, "model calls made by AgentSpecClient", _T),
        Family(m.CLIENT_LEARNED_SEQUENCES_TOTAL, True, "sequences learned into the store", _T),
        Family(m.CLIENT_LEARN_QUEUE_DEPTH, False, "finished calls waiting to be learned"),
        Family(m.CLIENT_PUSH_BACKLOG, False, "shard keys a worker has not acknowledged, summed"),
        Family(m.CLIENT_PUSH_FAILURES_TOTAL, True, "shard pushes that failed after retries"),
        Family(m.CLIENT_PUBLISH_BACKLOG, False, "learned sequences not yet durable in the fleet"),
        Family(
            m.CLIENT_PUBLISH_FAILURES_TOTAL,
            True,
            "fleet publish attempts that failed, and entries Redis refused for good",
        ),
        Family(m.SHARDS, False, "shards held", _K),
        Family(m.SHARD_TOKENS, False, "tokens in live sequences", _K + _T),
        Family(m.SHARD_BYTES, False, "bytes the shard trees hold", _K + _T),
        Family(m.SHARD_EVICTIONS_TOTAL, True, "sequences evicted by a memory budget", _K),
        Family(m.SHARD_BUDGET_BYTES, False, "the memory budget shards are held under"),
        Family(m.FLEET_PUBLISHED_TOTAL, True, "fleet entries Redis acknowledged"),
        Family(m.FLEET_APPLIED_TOTAL, True, "fleet entries applied to shards"),
        Family(m.FLEET_MALFORMED_TOTAL, True, "fleet entries refused by validation"),
        Family(m.FLEET_RECONNECTS_TOTAL, True, "fleet connections made after the first"),
        Family(m.FLEET_COMPACTIONS_TOTAL, True, "fleet compaction rounds completed"),
        Family(
            m.FLEET_LAG_SECONDS,
            True,
            "seconds from a fleet entry's stream time to its apply here, per applied entry",
            buckets=m.FLEET_LAG_SECONDS_BUCKETS,
        ),
        Family(
            m.FLEET_SNAPSHOT_AGE_SECONDS,
            False,
            "seconds since the stream time the newest known fleet snapshot round covers",
            ("tenant",),
        ),
    )
}


class LiveMetrics(m.MetricsCollector):
    """The process-wide collector of the library's objects (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._sources: dict[int, tuple[weakref.ref[Any], Samples]] = {}
        self._retired: dict[tuple[str, tuple[str, ...]], _Value] = {}
        self._caps: dict[tuple[str, str], m.LabelCap] = {}
        self._folded: dict[tuple[str, str, str], str] = {}
        self._registered = False

    def track(self, obj: object, samples: Samples) -> None:
        """Report ``samples(obj)`` at each scrape while ``obj`` lives (until `retire`)."""
        if not m.metrics_enabled():
            return
        key = id(obj)

        def gone(_ref: weakref.ref[Any], key: int = key) -> None:
            with self._lock:
                entry = self._sources.get(key)
                if entry is not None and entry[0] is _ref:
                    del self._sources[key]

        ref = weakref.ref(obj, gone)
        with self._lock:
            self._sources[key] = (ref, samples)
            first, self._registered = not self._registered, True
        if first:
            self.register(REGISTRY)

    def retire(self, obj: object) -> None:
        """Stop asking ``obj``; keep its counters' last values counted (call it at close).

        Samples with a dedupe token are not kept: they belong to a shared object
        (a store) that other live objects may go on reporting.
        """
        with self._lock:
            entry = self._sources.get(id(obj))
            if entry is None or entry[0]() is not obj:
                return
            del self._sources[id(obj)]
        totals = self._sum([(obj, entry[1])], shared=False)
        with self._lock:
            for (name, labels), value in totals.items():
                if FAMILIES[name].counter:
                    self._retired[(name, labels)] = _plus(self._retired.get((name, labels)), value)

    def describe(self) -> list[Metric]:
        """No names claimed at registration (see the module doc)."""
        return []

    def caps(self) -> list[m.LabelCap]:
        """The label caps used so far (for ``agentspec_metrics_label_overflow_total``)."""
        with self._lock:
            return list(self._caps.values())

    def _sum(
        self, sources: list[tuple[Any, Samples]], *, shared: bool = True
    ) -> dict[tuple[str, tuple[str, ...]], _Value]:
        """Sum the sources' samples; ``shared=False`` leaves out the ones with a token."""
        totals: dict[tuple[str, tuple[str, ...]], _Value] = {}
        seen: set[tuple[str, tuple[str, ...], object]] = set()
        for obj, samples in sources:
            rows: list[Sample] = []
            try:
                rows.extend(samples(obj))
            except Exception as exc:  # one broken object must not fail the scrape
                _log.debug("agentspec_metrics_source_failed", error=repr(exc))
            for sample in rows:
                name, labels, value = sample[0], sample[1], sample[2]
                if len(sample) > 3:
                    if not shared:  # another live object may report the same thing
                        continue
                    token = (name, labels, sample[3])
                    if token in seen:
                        continue
                    seen.add(token)
                totals[(name, labels)] = _plus(totals.get((name, labels)), value)
        return totals

    def _fold(self, family: Family, labels: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for label, value in zip(family.labelnames, labels, strict=True):
            done = self._folded.get((family.name, label, value))
            if done is None:
                cap = self._caps.get((family.name, label))
                if cap is None:
                    cap = self._caps[(family.name, label)] = m.LabelCap(family.name, label)
                done = self._folded[(family.name, label, value)] = cap.fold(value)
            out.append(done)
        return tuple(out)

    def collect(self) -> Iterator[Metric]:
        """Sum every live object's samples with the retired counters; yield non-empty families."""
        with self._lock:
            live = [(obj, fn) for ref, fn in self._sources.values() if (obj := ref()) is not None]
            retired = dict(self._retired)
        totals = self._sum(live)
        for key, value in retired.items():
            totals[key] = _plus(totals.get(key), value)
        by_family: dict[str, dict[tuple[str, ...], _Value]] = {}
        with self._lock:
            for (name, labels), value in totals.items():
                series = by_family.setdefault(name, {})
                folded = self._fold(FAMILIES[name], labels)
                series[folded] = _plus(series.get(folded), value)
        for name in sorted(by_family):
            family = FAMILIES[name]
            if family.buckets:
                yield _histogram(family, by_family[name])
                continue
            metric: CounterMetricFamily | GaugeMetricFamily
            if family.counter:
                metric = CounterMetricFamily(name, family.documentation, labels=family.labelnames)
            else:
                metric = GaugeMetricFamily(name, family.documentation, labels=family.labelnames)
            for labels, value in sorted(by_family[name].items()):
                metric.add_metric(labels, value)  # type: ignore[arg-type]
            yield metric


#: A summed value: a number, or a histogram's counts per bucket followed by its sum.
_Value = float | list[float]


def _plus(total: _Value | None, value: Any) -> _Value:
    """``total + value``; a histogram sample ``(counts, sum)`` adds bucket by bucket."""
    if isinstance(value, tuple):
        counts, observed = value
        add = [float(c) for c in counts] + [float(observed)]
    elif isinstance(value, list):
        add = value
    else:
        return (total if isinstance(total, float) else 0.0) + float(value)
    if not isinstance(total, list):
        return list(add)
    if len(total) != len(add):  # other buckets (never with one library): keep the first
        return total
    return [a + b for a, b in zip(total, add, strict=True)]


def _histogram(family: Family, series: dict[tuple[str, ...], _Value]) -> HistogramMetricFamily:
    metric = HistogramMetricFamily(family.name, family.documentation, labels=family.labelnames)
    bounds = [repr(float(b)) for b in family.buckets] + ["+Inf"]
    for labels, value in sorted(series.items()):
        if not isinstance(value, list) or len(value) != len(bounds) + 1:
            continue
        cumulative = 0.0
        buckets = []
        for bound, n in zip(bounds, value[:-1], strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        metric.add_metric(labels, buckets, value[-1])
    return metric


#: The process-wide collector.
LIVE = LiveMetrics()


def track(obj: object, samples: Samples) -> None:
    """`LiveMetrics.track` on `LIVE`."""
    LIVE.track(obj, samples)


def retire(obj: object) -> None:
    """`LiveMetrics.retire` on `LIVE`."""
    LIVE.retire(obj)
