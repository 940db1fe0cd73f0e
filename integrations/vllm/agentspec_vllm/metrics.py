"""The plugin's Prometheus metrics: every worker's counters, merged, on vLLM's ``/metrics``.

The proposer keeps plain counters in its worker process (a few list and dict
adds per request and step, no ``prometheus_client`` call on the decode path).
The API server's endpoint plugin collects them from every worker with one
``collective_rpc("agentspec_metrics")`` every ``metrics_interval`` seconds
(an asyncio task), merges them (`merge_snapshots`) and a `WorkerMetrics`
collector, registered in ``prometheus_client``'s default registry, renders
the last merged snapshot when vLLM's ``/metrics`` is scraped: a scrape never
waits on the engine (the scrape handler runs on the event loop that the RPC
needs).  ``GET /v1/agentspec/metrics`` (vLLM's ``--api-key`` and the plugin's
``api_key`` apply) collects afresh and answers the same families.

vLLM serves the default registry on ``/metrics`` unless it runs several API
server processes (``--api-server-count`` > 1, which sets
``PROMETHEUS_MULTIPROC_DIR``): its ``/metrics`` then reads only the
multiprocess files of its own metrics, and ``/v1/agentspec/metrics`` is the
route to scrape for these.

Merging: workers of one engine (tensor / pipeline parallel ranks, same
``data_parallel_rank``) see the same batches, so one of them (the lowest
rank with a proposer) speaks for the engine; the engines' (data parallel
ranks') counters and histograms are summed, their memory gauges reported
as the largest (budgets are per worker), their backlogs summed, a tenant's
fleet snapshot age as the least (the newest snapshot round any engine knows).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from agentspec.integration import get_logger
from agentspec.metrics import (
    ACCEPTED_TOKENS_PER_POSITION_TOTAL,
    ACCEPTED_TOKENS_TOTAL,
    DRAFT_TOKENS_TOTAL,
    DRAFTS_TOTAL,
    FLEET_APPLIED_TOTAL,
    FLEET_COMPACTIONS_TOTAL,
    FLEET_LAG_SECONDS,
    FLEET_LAG_SECONDS_BUCKETS,
    FLEET_MALFORMED_TOTAL,
    FLEET_PUBLISHED_TOTAL,
    FLEET_RECONNECTS_TOTAL,
    FLEET_SNAPSHOT_AGE_SECONDS,
    GOODPUT_ACTIVE,
    GOODPUT_KEPT_TOKENS_TOTAL,
    GOODPUT_OFFERED_TOKENS_TOTAL,
    KEY_LABELS,
    PUSHES_TOTAL,
    REQUESTS_TOTAL,
    SHARD_BUDGET_BYTES,
    SHARD_BYTES,
    SHARD_EVICTIONS_TOTAL,
    SHARD_TOKENS,
    SHARDS,
    STEP_COST_COEFFICIENT_SECONDS,
    STEP_COST_RESIDUAL_SECONDS,
    STEP_SECONDS,
    VERIFY_STEPS_TOTAL,
    LabelCap,
    MetricsCollector,
    render,
)

__all__ = [
    "METRICS_PATH",
    "RPC_METRICS",
    "WORKERS",
    "Merged",
    "MetricsRefresher",
    "WorkerMetrics",
    "install_collector",
    "merge_snapshots",
]

#: ``GET``: the families of `WorkerMetrics`, collected afresh from every worker.
METRICS_PATH = "/v1/agentspec/metrics"
#: Worker-extension method returning the worker's metric counters.
RPC_METRICS = "agentspec_metrics"
#: Gauge: workers whose counters the last collection merged.
WORKERS = "agentspec_vllm_workers"
#: Counter: collections from the workers that failed (the last snapshot stays).
COLLECT_FAILURES_TOTAL = "agentspec_vllm_collect_failures_total"
#: Counter: requests whose agentspec tags were invalid (served as untagged).
BAD_TAGS_TOTAL = "agentspec_vllm_bad_tags_total"

#: The proposer's draft source names as the ``source`` label reports them.
_SOURCE_LABELS = {"local": "request"}

_log = get_logger()

Key = tuple[str, str, str]


@dataclass
class Merged:
    """Every worker's counters merged (see the module docstring for the rules)."""

    workers: int = 0
    #: per key: requests, steps, drafts, drafted, accepted, learned, published
    keys: dict[Key, list[int]] = field(default_factory=dict)
    sources: dict[tuple[str, str, str, str], int] = field(default_factory=dict)
    #: per key: verified drafts by accepted length (index n: n tokens accepted)
    accepted_len: dict[Key, list[int]] = field(default_factory=dict)
    step_counts: list[int] = field(default_factory=list)
    step_bounds: list[float] = field(default_factory=list)
    step_sum: float = 0.0
    goodput_offered: int = 0
    goodput_kept: int = 0
    goodput_active: bool | None = None
    coefficients: dict[str, float] = field(default_factory=dict)
    residuals: dict[str, float] = field(default_factory=dict)
    #: (kind, tenant, pipeline, stage) -> tokens / live bytes (largest over engines)
    shard_tokens: dict[tuple[str, str, str, str], int] = field(default_factory=dict)
    shard_bytes: dict[tuple[str, str, str, str], int] = field(default_factory=dict)
    shards: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    budgets: dict[str, int] = field(default_factory=dict)
    pushes_refused: dict[str, int] = field(default_factory=dict)
    #: (result, HTTP status) -> pushes the workers answered (`ShardIntake.push_counts`)
    #: plus those the API server refused before forwarding (`WorkerMetrics.count_local`)
    pushes: dict[tuple[str, str], int] = field(default_factory=dict)
    fleet: dict[str, int] = field(default_factory=dict)
    lag_counts: list[int] = field(default_factory=list)
    lag_sum: float = 0.0
    #: tenant -> seconds since the newest snapshot round a worker knows (the least)
    snapshot_age: dict[str, float] = field(default_factory=dict)
    bad_tags: int = 0


def _representatives(snapshots: Sequence[Any]) -> tuple[int, list[Mapping[str, Any]]]:
    """The number of valid snapshots and one snapshot per engine (data parallel rank)."""
    valid = [s for s in snapshots if isinstance(s, Mapping)]
    groups: dict[int, list[Mapping[str, Any]]] = {}
    for snap in valid:
        dp = snap.get("dp_rank")
        groups.setdefault(dp if isinstance(dp, int) else 0, []).append(snap)
    reps = []
    for dp in sorted(groups):
        members = sorted(groups[dp], key=lambda s: s.get("rank") or 0)
        with_proposer = [s for s in members if s.get("proposer")]
        reps.append((with_proposer or members)[0])
    return len(valid), reps


def _add_into(total: list[int], values: Sequence[int]) -> None:
    if len(total) < len(values):
        total.extend([0] * (len(values) - len(total)))
    for i, v in enumerate(values):
        total[i] += int(v)


def _max_into(table: dict[Any, int], key: Any, value: int) -> None:
    table[key] = max(table.get(key, 0), int(value))


def merge_snapshots(snapshots: Sequence[Any]) -> Merged:
    """Merge the workers' ``agentspec_metrics()`` answers (anything else is skipped)."""
    merged = Merged()
    merged.workers, reps = _representatives(snapshots)
    first_goodput = True
    for snap in reps:
        prop = snap.get("proposer")
        if isinstance(prop, Mapping):
            _merge_proposer(merged, prop, first_goodput)
            first_goodput = first_goodput and not isinstance(prop.get("goodput"), Mapping)
        pushed = snap.get("pushed")
        if isinstance(pushed, Mapping):
            _merge_pushed(merged, pushed)
        fleet = snap.get("fleet")
        if isinstance(fleet, Mapping):
            _merge_fleet(merged, fleet)
    return merged


def _merge_proposer(merged: Merged, prop: Mapping[str, Any], first_goodput: bool) -> None:
    for row in prop.get("keys") or ():
        key: Key = (str(row[0]), str(row[1]), str(row[2]))
        _add_into(merged.keys.setdefault(key, []), row[3:10])
        for source, n in (row[10] or {}).items():
            skey = (*key, _SOURCE_LABELS.get(source, str(source)))
            merged.sources[skey] = merged.sources.get(skey, 0) + int(n)
        _add_into(merged.accepted_len.setdefault(key, []), row[11])
        _max_into(merged.shard_tokens, ("learned", *key), row[12])
        _max_into(merged.shard_bytes, ("learned", *key), row[13])
    step = prop.get("step_seconds")
    if isinstance(step, Mapping):
        bounds = [float(b) for b in step.get("bounds") or ()]
        if not merged.step_bounds:
            merged.step_bounds = bounds
        if bounds == merged.step_bounds:
            _add_into(merged.step_counts, step.get("counts") or ())
            merged.step_sum += float(step.get("sum") or 0.0)
    goodput = prop.get("goodput")
    if isinstance(goodput, Mapping):
        merged.goodput_offered += int(goodput.get("offered") or 0)
        merged.goodput_kept += int(goodput.get("kept") or 0)
        merged.goodput_active = bool(merged.goodput_active) or bool(goodput.get("active"))
        cost = goodput.get("step_cost")
        if first_goodput and isinstance(cost, Mapping):
            merged.coefficients = {str(k): float(v) for k, v in (cost.get("seconds") or {}).items()}
            merged.residuals = {
                str(k): float(v["seconds"]) - float(v["predicted"])
                for k, v in (cost.get("by_tokens") or {}).items()
            }
    learned = prop.get("learned")
    if isinstance(learned, Mapping):
        _max_into(merged.shards, "learned", learned.get("shards") or 0)
        merged.evictions["learned"] = merged.evictions.get("learned", 0) + int(
            learned.get("evictions") or 0
        )
        if learned.get("max_bytes") is not None:
            _max_into(merged.budgets, "learned", learned["max_bytes"])
    merged.bad_tags += int(prop.get("bad_tags") or 0)


def _merge_pushed(merged: Merged, pushed: Mapping[str, Any]) -> None:
    shards = pushed.get("shards") or ()
    for row in shards:
        key = ("pushed", str(row[0]), str(row[1]), str(row[2]))
        _max_into(merged.shard_tokens, key, row[3])
        _max_into(merged.shard_bytes, key, row[4])
    _max_into(merged.shards, "pushed", len(shards))
    if pushed.get("max_bytes") is not None:
        _max_into(merged.budgets, "pushed", pushed["max_bytes"])
    for code, name in (("507", "refused"), ("413", "too_large")):
        merged.pushes_refused[code] = merged.pushes_refused.get(code, 0) + int(
            pushed.get(name) or 0
        )
    counts = pushed.get("counts")
    if isinstance(counts, list):
        for row in counts:
            if isinstance(row, list) and len(row) == 3:
                push_key = (str(row[0]), str(row[1]))
                merged.pushes[push_key] = merged.pushes.get(push_key, 0) + int(row[2])
    else:  # a worker without per-status counts: its refusals by budget and size
        for code in ("507", "413"):
            n = int(pushed.get("refused" if code == "507" else "too_large") or 0)
            if n:
                merged.pushes[("refused", code)] = merged.pushes.get(("refused", code), 0) + n


def _merge_fleet(merged: Merged, fleet: Mapping[str, Any]) -> None:
    for name in ("published", "applied", "malformed", "reconnects", "compactions", "evicted"):
        merged.fleet[name] = merged.fleet.get(name, 0) + int(fleet.get(name) or 0)
    shards = fleet.get("shards") or ()
    for row in shards:
        _max_into(merged.shard_tokens, ("fleet", str(row[0]), str(row[1]), str(row[2])), row[3])
    _max_into(merged.shards, "fleet", len(shards))
    lag = fleet.get("lag")
    if isinstance(lag, Mapping):
        _add_into(merged.lag_counts, lag.get("counts") or ())
        merged.lag_sum += float(lag.get("sum") or 0.0)
    ages = fleet.get("snapshot_age")
    if isinstance(ages, Mapping):
        for tenant, age in ages.items():
            seen = merged.snapshot_age.get(str(tenant))
            merged.snapshot_age[str(tenant)] = float(age) if seen is None else min(seen, float(age))


# --- rendering -----------------------------------------------------------------


class _Caps:
    """One `LabelCap` per (metric family, label), made on first use."""

    def __init__(self) -> None:
        self._caps: dict[tuple[str, str], LabelCap] = {}
        self._lock = threading.Lock()

    def fold(self, metric: str, names: Sequence[str], values: Sequence[str]) -> tuple[str, ...]:
        out = []
        for name, value in zip(names, values, strict=True):
            cap = self._caps.get((metric, name))
            if cap is None:
                with self._lock:
                    cap = self._caps.setdefault((metric, name), LabelCap(metric, name))
            out.append(cap.fold(value))
        return tuple(out)

    def all(self) -> list[LabelCap]:
        with self._lock:
            return list(self._caps.values())


def _counter(
    caps: _Caps,
    name: str,
    doc: str,
    labels: Sequence[str],
    series: Mapping[Any, float],
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for values, n in _folded(caps, name, labels, series).items():
        family.add_metric(values, n)
    return family


def _gauge(
    caps: _Caps,
    name: str,
    doc: str,
    labels: Sequence[str],
    series: Mapping[Any, float],
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for values, n in _folded(caps, name, labels, series).items():
        family.add_metric(values, n)
    return family


def _folded(
    caps: _Caps, name: str, labels: Sequence[str], series: Mapping[Any, float]
) -> dict[tuple[str, ...], float]:
    """``series`` with its label values capped (values folded into ``other`` add up)."""
    out: dict[tuple[str, ...], float] = {}
    for values in sorted(series):
        key = caps.fold(name, labels, values) if labels else ()
        out[key] = out.get(key, 0.0) + float(series[values])
    return out


def _histogram(
    name: str, doc: str, bounds: Sequence[float], counts: Sequence[int], total: float
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc)
    if counts:
        cumulative = 0
        buckets = []
        for bound, n in zip(bounds, counts, strict=False):
            cumulative += n
            buckets.append((repr(float(bound)), float(cumulative)))
        cumulative += sum(counts[len(bounds) :])
        buckets.append(("+Inf", float(cumulative)))
        family.add_metric([], buckets, total)
    return family


def families(
    merged: Merged,
    caps: _Caps,
    failures: int = 0,
    local_pushes: Mapping[tuple[str, str], int] | None = None,
) -> Iterator[Metric]:
    """The metric families of a merged snapshot (``local_pushes``: pushes the API
    server answered itself, by (result, HTTP status), added to the workers')."""
    local_pushes = local_pushes or {}
    t = KEY_LABELS
    keys = merged.keys

    def per_key(i: int) -> dict[tuple[str, ...], float]:
        return {k: v[i] for k, v in keys.items() if len(v) > i}

    yield _counter(caps, REQUESTS_TOTAL, "requests the proposer drafted for", t, per_key(0))
    yield _counter(
        caps, VERIFY_STEPS_TOTAL, "decode steps drafted for (per request)", t, per_key(1)
    )
    yield _counter(caps, DRAFT_TOKENS_TOTAL, "draft tokens sent to verification", t, per_key(3))
    yield _counter(caps, ACCEPTED_TOKENS_TOTAL, "draft tokens the model accepted", t, per_key(4))
    positions: dict[tuple[str, ...], float] = {}
    for key, lens in merged.accepted_len.items():
        # position j was accepted by every verified draft that accepted more than j tokens
        above = 0
        for j in range(len(lens) - 1, 0, -1):
            above += lens[j]
            positions[(key[0], key[1], key[2], str(j - 1))] = above
    yield _counter(
        caps,
        ACCEPTED_TOKENS_PER_POSITION_TOTAL,
        "accepted draft tokens by their position in the draft",
        (*t, "position"),
        positions,
    )
    yield _counter(
        caps,
        DRAFTS_TOTAL,
        "drafts by the tree they came from (none: no draft)",
        (*t, "source"),
        dict(merged.sources),
    )
    yield _histogram(
        STEP_SECONDS,
        "seconds between the proposer's calls (one batched decode step)",
        merged.step_bounds,
        merged.step_counts,
        merged.step_sum,
    )
    yield _counter(
        caps,
        GOODPUT_OFFERED_TOKENS_TOTAL,
        "draft tokens offered to the goodput controller",
        (),
        {(): merged.goodput_offered},
    )
    yield _counter(
        caps,
        GOODPUT_KEPT_TOKENS_TOTAL,
        "draft tokens the goodput controller kept",
        (),
        {(): merged.goodput_kept},
    )
    active: dict[Any, float] = {}
    if merged.goodput_active is not None:
        active[()] = float(merged.goodput_active)
    yield _gauge(caps, GOODPUT_ACTIVE, "1 while the goodput controller cuts drafts", (), active)
    yield _gauge(
        caps,
        STEP_COST_COEFFICIENT_SECONDS,
        "the step-cost model's fit: seconds per step, per request, per token",
        ("term",),
        {(k,): v for k, v in merged.coefficients.items()},
    )
    yield _gauge(
        caps,
        STEP_COST_RESIDUAL_SECONDS,
        "mean observed minus predicted step seconds, by verified-token size class",
        ("tokens",),
        {(k,): v for k, v in merged.residuals.items()},
    )
    shards = {(k,): v for k, v in merged.shards.items()}
    yield _gauge(caps, SHARDS, "shards held, by kind", ("kind",), shards)
    yield _gauge(
        caps,
        SHARD_TOKENS,
        "tokens held per shard",
        ("kind", *t),
        dict(merged.shard_tokens),
    )
    yield _gauge(
        caps,
        SHARD_BYTES,
        "live bytes held per shard (learned: its stage tree; pushed: the pushed tree)",
        ("kind", *t),
        dict(merged.shard_bytes),
    )
    evictions = dict(merged.evictions)
    if "evicted" in merged.fleet:
        evictions["fleet"] = merged.fleet["evicted"]
    yield _counter(
        caps,
        SHARD_EVICTIONS_TOTAL,
        "sequences (learned) or shards (fleet) evicted",
        ("kind",),
        {(k,): v for k, v in evictions.items()},
    )
    yield _gauge(
        caps,
        SHARD_BUDGET_BYTES,
        "the byte budget each worker holds shards of this kind under",
        ("kind",),
        {(k,): v for k, v in merged.budgets.items()},
    )
    pushes = dict(merged.pushes)
    for push_key, n in local_pushes.items():
        pushes[push_key] = pushes.get(push_key, 0) + n
    yield _counter(
        caps,
        PUSHES_TOTAL,
        "shard pushes answered, by result (accepted, refused) and HTTP status: the workers'"
        " answers and the API server's refusals before forwarding",
        ("result", "code"),
        pushes,
    )
    for name, field_name, doc in (
        (FLEET_PUBLISHED_TOTAL, "published", "responses Redis acknowledged"),
        (FLEET_APPLIED_TOTAL, "applied", "fleet entries learned"),
        (FLEET_MALFORMED_TOTAL, "malformed", "fleet entries refused by validation"),
        (FLEET_RECONNECTS_TOTAL, "reconnects", "fleet subscriber reconnections"),
        (FLEET_COMPACTIONS_TOTAL, "compactions", "fleet compaction rounds completed"),
    ):
        value = merged.fleet.get(field_name)
        yield _counter(caps, name, doc, (), {} if value is None else {(): value})
    yield _histogram(
        FLEET_LAG_SECONDS,
        "seconds from a fleet entry's stream time to its apply here, per applied entry",
        FLEET_LAG_SECONDS_BUCKETS,
        merged.lag_counts,
        merged.lag_sum,
    )
    yield _gauge(
        caps,
        FLEET_SNAPSHOT_AGE_SECONDS,
        "seconds since the stream time the newest known fleet snapshot round covers",
        ("tenant",),
        {(tenant,): age for tenant, age in merged.snapshot_age.items()},
    )
    yield _counter(
        caps, BAD_TAGS_TOTAL, "requests with invalid agentspec tags", (), {(): merged.bad_tags}
    )
    yield _gauge(caps, WORKERS, "workers merged by the last collection", (), {(): merged.workers})
    yield _counter(
        caps,
        COLLECT_FAILURES_TOTAL,
        "collections from the workers that failed",
        (),
        {(): failures},
    )


class WorkerMetrics(MetricsCollector):
    """A collector rendering the last merged snapshot of the workers' counters."""

    def __init__(self) -> None:
        """Nothing collected yet (the families are rendered empty)."""
        super().__init__()
        self._merged = Merged()
        self._label_caps = _Caps()
        self._lock = threading.Lock()
        self.failures = 0
        # push counts of the API server's own refusals: `ShardIntake.push_counts` of
        # each forwarder's checking intake (weakly held: a forwarder gone is not read)
        self._local_sources: list[weakref.WeakMethod[Callable[[], Mapping[Any, int]]]] = []
        self.registry = CollectorRegistry()  # this collector alone (`render_text`)
        self.on_collect(self._families)

    @property
    def merged(self) -> Merged:
        """The last merged snapshot."""
        with self._lock:
            return self._merged

    def update(self, snapshots: Sequence[Any]) -> Merged:
        """Merge the workers' answers and render them from now on."""
        merged = merge_snapshots(snapshots)
        with self._lock:
            self._merged = merged
        return merged

    def add_local_pushes(self, push_counts: Callable[[], Mapping[Any, int]]) -> None:
        """Also count the pushes ``push_counts`` (a bound method, such as
        `ShardIntake.push_counts` of the API server's checking intake) reports: the
        ones the API server answered without forwarding them."""
        with self._lock:
            self._local_sources.append(weakref.WeakMethod(push_counts))

    def _local_pushes(self) -> dict[tuple[str, str], int]:
        with self._lock:
            sources = [ref() for ref in self._local_sources]
            self._local_sources = [
                r for r, f in zip(self._local_sources, sources, strict=True) if f
            ]
        total: dict[tuple[str, str], int] = {}
        for source in sources:
            if source is not None:
                for key, n in source().items():
                    total[key] = total.get(key, 0) + n
        return total

    def caps(self) -> list[LabelCap]:
        """The label caps of every family (for the overflow counter)."""
        return [*super().caps(), *self._label_caps.all()]

    def _families(self) -> Iterator[Metric]:
        return families(self.merged, self._label_caps, self.failures, self._local_pushes())

    def render_text(self) -> bytes:
        """The exposition text of these families alone."""
        return render(self.registry)


Rpc = Callable[[str, tuple[Any, ...]], Awaitable[Sequence[Any]]]


class MetricsRefresher:
    """Collects the workers' counters into a `WorkerMetrics` every ``interval`` seconds."""

    def __init__(
        self, rpc: Rpc, metrics: WorkerMetrics, interval: float, timeout: float = 60.0
    ) -> None:
        """Use ``rpc`` (``engine_client.collective_rpc``); see `run`."""
        self._rpc = rpc
        self.metrics = metrics
        self.interval = interval
        self.timeout = timeout

    async def refresh(self) -> Merged:
        """One collection (raises what the RPC raises)."""
        results = await asyncio.wait_for(self._rpc(RPC_METRICS, ()), self.timeout)
        return self.metrics.update(list(results))

    async def run(self) -> None:
        """Collect now and then every ``interval`` seconds until cancelled."""
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.metrics.failures += 1
                n = self.metrics.failures
                if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ... failure
                    _log.warning(
                        "agentspec.vllm.metrics_collect_failed", failures=n, error=repr(e)[:300]
                    )
            await asyncio.sleep(self.interval)


_installed: WorkerMetrics | None = None
_install_lock = threading.Lock()


def install_collector(registry: CollectorRegistry | None = None) -> WorkerMetrics:
    """This process's `WorkerMetrics`, registered in ``registry`` (default: the default
    registry, which vLLM's ``/metrics`` serves) on the first call."""
    global _installed
    with _install_lock:
        if _installed is None:
            metrics = WorkerMetrics()
            metrics.register(metrics.registry)
            metrics.register(REGISTRY if registry is None else registry)
            _installed = metrics
        return _installed
