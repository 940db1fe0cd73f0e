"""The embedded engine's Prometheus metrics (`agentspec.metrics` names), one registry per engine.

The request loop adds to plain tables (`agentspec.metrics.CounterTable` ...)
once per finished request, plus one histogram observation per verification
step; everything else -- the goodput controller, the learned, pushed and
fleet shards, the pushes, the fleet's counters -- is read from the
components' own stats when the registry is scraped.  ``GET /metrics`` on the
engine's server serves `EngineMetrics.registry`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from agentspec._util.log import get_logger
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
    GOODPUT_CALIBRATION_ERROR,
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
    STEP_SECONDS_BUCKETS,
    TOKENS_PER_STEP,
    TOKENS_PER_STEP_BUCKETS,
    VERIFY_STEPS_TOTAL,
    MetricsCollector,
    key_labels,
    render,
)
from agentspec.protocol import ShardKey

if TYPE_CHECKING:
    from agentspec._core.goodput import GoodputController
    from agentspec._core.speculator import Speculator
    from agentspec._push.intake import ShardIntake
    from agentspec.engine._fleet import EngineFleet

__all__ = ["EngineMetrics", "draft_source_label"]

_log = get_logger()

#: `Speculator.draft_source` names -> the ``source`` label (`agentspec.metrics.DRAFT_SOURCES`).
_SOURCES = {
    "local": "request",
    "merged": "request",
    "stage": "stage",
    "pipeline": "pipeline",
    "pushed": "pushed",
    "fleet": "fleet",
    "none": "none",
}

#: Times a scrape re-reads stats that another thread changed while it read them.
_RETRIES = 3


def draft_source_label(name: str) -> str:
    """The ``source`` label of a `Speculator.draft_source` name."""
    return _SOURCES.get(name, "none")


def _stats(read: Callable[[], Any]) -> Any:
    """``read()``, again when a dict it iterates changed under it (another thread)."""
    for _ in range(_RETRIES - 1):
        try:
            return read()
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return read()


class EngineMetrics:
    """One engine's metrics and the registry they are served from.

    Args:
        registry: where to register (default: a new ``CollectorRegistry`` of
            its own, so several engines in one process never collide).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """Create the tables and register them."""
        self.registry = CollectorRegistry() if registry is None else registry
        c = self.collector = MetricsCollector()
        self.requests = c.counter(REQUESTS_TOTAL, "requests finished", KEY_LABELS)
        self.steps = c.counter(VERIFY_STEPS_TOTAL, "verification steps", KEY_LABELS)
        self.drafted = c.counter(DRAFT_TOKENS_TOTAL, "draft tokens verified", KEY_LABELS)
        self.accepted = c.counter(
            ACCEPTED_TOKENS_TOTAL, "draft tokens accepted and kept", KEY_LABELS
        )
        self.per_position = c.counter(
            ACCEPTED_TOKENS_PER_POSITION_TOTAL,
            "draft tokens accepted at each position of their draft (0: the first)",
            (*KEY_LABELS, "position"),
        )
        self.drafts = c.counter(
            DRAFTS_TOTAL, "drafts made, by the tree they came from", (*KEY_LABELS, "source")
        )
        self.step_seconds = c.histogram(
            STEP_SECONDS, "seconds per verification step", (), STEP_SECONDS_BUCKETS
        )
        self.tokens_per_step = c.histogram(
            TOKENS_PER_STEP,
            "tokens emitted per request per step",
            ("stage",),
            TOKENS_PER_STEP_BUCKETS,
        )
        # read from the components at scrape time
        self._calibration = c.gauge(
            GOODPUT_CALIBRATION_ERROR,
            "goodput controller: estimated minus observed acceptance, by draft depth",
            ("depth",),
            at_scrape=True,
        )
        self._residual = c.gauge(
            STEP_COST_RESIDUAL_SECONDS,
            "step-cost model: mean observed minus predicted step seconds, by verified tokens",
            ("tokens",),
            at_scrape=True,
        )
        self._shard_tokens = c.gauge(
            SHARD_TOKENS, "tokens held by the shards", ("kind", *KEY_LABELS), at_scrape=True
        )
        self._shard_bytes = c.gauge(
            SHARD_BYTES, "live bytes of the shards", ("kind", *KEY_LABELS), at_scrape=True
        )
        self._snapshot_age = c.gauge(
            FLEET_SNAPSHOT_AGE_SECONDS,
            "seconds since the stream time the newest known fleet snapshot round covers",
            ("tenant",),
            at_scrape=True,
        )
        self._pushes = c.counter(
            PUSHES_TOTAL, "shard pushes answered, by result and HTTP status", ("result", "code"),
            at_scrape=True,
        )  # fmt: skip
        self._goodput: GoodputController | None = None
        self._speculators: Callable[[], Mapping[str, Speculator]] | None = None
        self._learned_budget: Callable[[], int | None] | None = None
        self._intake: ShardIntake | None = None
        self._fleet: EngineFleet | None = None
        c.on_collect(self._collect)
        c.register(self.registry)

    # --- sources --------------------------------------------------------------

    def watch_engine(
        self,
        goodput: GoodputController,
        speculators: Callable[[], Mapping[str, Speculator]],
        learned_budget: Callable[[], int | None],
    ) -> None:
        """Read the goodput controller and the learned shards at each scrape."""
        self._goodput = goodput
        self._speculators = speculators
        self._learned_budget = learned_budget

    def watch_intake(self, intake: ShardIntake) -> None:
        """Read the pushed shards and the push counts of ``intake`` at each scrape."""
        self._intake = intake

    def watch_fleet(self, fleet: EngineFleet | None) -> None:
        """Read the fleet's shards and counters at each scrape (None: no fleet)."""
        self._fleet = fleet

    # --- recording (the request loop) -----------------------------------------

    def record_request(
        self,
        key: ShardKey,
        steps: int,
        drafted: int,
        accepted: int,
        accepted_runs: Mapping[int, int],
        sources: Mapping[str, int],
    ) -> None:
        """Count one finished request: its counters, and per accepted-run length the
        steps that accepted that many draft tokens, per draft source the drafts."""
        labels = key_labels(*key)
        self.requests.add(labels)
        self.steps.add(labels, steps)
        self.drafted.add(labels, drafted)
        self.accepted.add(labels, accepted)
        if accepted_runs:
            # a step that accepted n tokens accepted positions 0..n-1
            longest = max(accepted_runs)
            reaching = 0
            per_position = self.per_position
            for position in range(longest - 1, -1, -1):
                reaching += accepted_runs.get(position + 1, 0)
                per_position.add((*labels, str(position)), reaching)
        for name, count in sources.items():
            self.drafts.add((*labels, draft_source_label(name)), count)

    # --- scraping -------------------------------------------------------------

    def render(self) -> bytes:
        """The registry's exposition text."""
        return render(self.registry)

    def _collect(self) -> Iterator[Metric]:
        if self._goodput is not None:
            yield from self._goodput_families(_stats(self._goodput.stats))
        yield from self._shard_families()

    def _goodput_families(self, stats: Mapping[str, Any]) -> Iterator[Metric]:
        yield CounterMetricFamily(
            GOODPUT_OFFERED_TOKENS_TOTAL,
            "goodput controller: draft tokens offered to it",
            value=stats["offered"],
        )
        yield CounterMetricFamily(
            GOODPUT_KEPT_TOKENS_TOTAL,
            "goodput controller: draft tokens it kept",
            value=stats["kept"],
        )
        yield GaugeMetricFamily(
            GOODPUT_ACTIVE, "goodput controller cutting drafts now (1) or not (0)",
            value=1.0 if stats["active"] else 0.0,
        )  # fmt: skip
        errors = stats.get("calibration_error", {})
        yield self._calibration.family_from(((depth,), e) for depth, e in errors.items())
        cost = stats["step_cost"]
        coefficients = GaugeMetricFamily(
            STEP_COST_COEFFICIENT_SECONDS,
            "step-cost model: seconds = per_step + per_request * batch + per_token * tokens",
            labels=("term",),
        )
        for term, value in cost["seconds"].items():
            coefficients.add_metric((term,), value)
        yield coefficients
        yield self._residual.family_from(
            ((size,), row["seconds"] - row["predicted"]) for size, row in cost["by_tokens"].items()
        )

    def _shard_families(self) -> Iterator[Metric]:
        shards = GaugeMetricFamily(SHARDS, "shards held", labels=("kind",))
        evictions = CounterMetricFamily(
            SHARD_EVICTIONS_TOTAL, "sequences evicted from the shards", labels=("kind",)
        )
        budget = GaugeMetricFamily(
            SHARD_BUDGET_BYTES, "byte budget the shards are held under", labels=("kind",)
        )
        tokens: list[tuple[tuple[str, ...], float]] = []
        nbytes: list[tuple[tuple[str, ...], float]] = []
        if self._speculators is not None:
            specs = list(self._speculators().items())
            count = evicted = 0
            for tenant, spec in specs:
                sizes = _stats(spec.shard_sizes)
                count += sum(1 for _, stage in sizes if stage is not None)
                evicted += spec.evicted_sequences
                for (pipeline, stage), (t, b) in sizes.items():
                    labels = ("learned", *key_labels(tenant, pipeline, stage))
                    tokens.append((labels, t))
                    nbytes.append((labels, b))
            shards.add_metric(("learned",), count)
            evictions.add_metric(("learned",), evicted)
            limit = None if self._learned_budget is None else self._learned_budget()
            if limit is not None:
                budget.add_metric(("learned",), limit)
        intake = self._intake
        if intake is not None:
            held = intake.shards()
            shards.add_metric(("pushed",), len(held))
            for shard in held:
                labels = ("pushed", *key_labels(*shard.key))
                tokens.append((labels, shard.tokens))
                nbytes.append((labels, shard.bytes))
            if intake.max_bytes is not None:
                budget.add_metric(("pushed",), intake.max_bytes)
            yield self._pushes.family_from(
                ((result, code), n) for (result, code), n in intake.push_counts().items()
            )
        if self._fleet is not None:
            yield from self._fleet_families(self._fleet, shards, evictions, tokens)
        yield shards
        yield evictions
        yield budget
        yield self._shard_tokens.family_from(tokens)
        yield self._shard_bytes.family_from(nbytes)

    def _fleet_families(
        self,
        fleet: EngineFleet,
        shards: GaugeMetricFamily,
        evictions: CounterMetricFamily,
        tokens: list[tuple[tuple[str, ...], float]],
    ) -> Iterable[Metric]:
        count = evicted = applied = malformed = reconnects = compactions = 0
        lag = [0] * (len(FLEET_LAG_SECONDS_BUCKETS) + 1)
        lag_sum = 0.0
        ages: list[tuple[tuple[str, ...], float]] = []
        for sub in list(fleet.subscribers.values()):
            s = sub.stats()
            if len(s.lag_counts) == len(lag):
                lag = [a + b for a, b in zip(lag, s.lag_counts, strict=True)]
                lag_sum += s.lag_sum
            if s.snapshot_age_ms is not None:
                ages.append(((s.tenant,), s.snapshot_age_ms / 1000.0))
            applied += s.applied
            malformed += s.malformed
            reconnects += s.reconnects
            compactions += s.compactions
            count += len(s.shards)
            for key, shard in s.shards.items():
                tokens.append((("fleet", *key_labels(*key)), shard.tokens))
                evicted += shard.evicted
        shards.add_metric(("fleet",), count)
        evictions.add_metric(("fleet",), evicted)
        published = fleet.publisher.stats().published
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, n in zip((*FLEET_LAG_SECONDS_BUCKETS, "+Inf"), lag, strict=True):
            cumulative += n
            buckets.append((bound if isinstance(bound, str) else repr(bound), float(cumulative)))
        histogram = HistogramMetricFamily(
            FLEET_LAG_SECONDS,
            "seconds from a fleet entry's stream time to its apply here, per applied entry",
        )
        histogram.add_metric((), buckets, lag_sum)
        return [
            histogram,
            self._snapshot_age.family_from(ages),
            CounterMetricFamily(
                FLEET_PUBLISHED_TOTAL, "responses published to the fleet", value=published
            ),
            CounterMetricFamily(
                FLEET_APPLIED_TOTAL, "fleet entries applied to this engine's trees", value=applied
            ),
            CounterMetricFamily(
                FLEET_MALFORMED_TOTAL, "fleet entries skipped as malformed", value=malformed
            ),
            CounterMetricFamily(
                FLEET_RECONNECTS_TOTAL, "reconnects of the fleet subscribers", value=reconnects
            ),
            CounterMetricFamily(
                FLEET_COMPACTIONS_TOTAL, "compactions the fleet subscribers ran", value=compactions
            ),
        ]
