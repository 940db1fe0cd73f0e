"""docs/grafana/agentspec.json is a dashboard Grafana imports as is.

Its shape (no Grafana here; the queries run against a real Prometheus in
test_prometheus_engine.py and the vLLM tests): schema version 39, a
Prometheus data-source variable every panel and query uses, the
tenant/pipeline/stage variables from ``label_values``, unique panel ids, a
grid layout without overlaps, and the panels the operations guide names.
"""

from __future__ import annotations

import json
from typing import Any

import ops_pipeline

DS = {"type": "prometheus", "uid": "${datasource}"}


def _dash() -> dict[str, Any]:
    return json.loads(ops_pipeline.DASHBOARD.read_text())  # type: ignore[no-any-return]


def test_dashboard_header_and_variables() -> None:
    dash = _dash()
    assert dash["schemaVersion"] == 39
    assert dash["uid"] == "agentspec"
    assert dash["id"] is None  # an import gets a fresh id
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("tenant", "pipeline", "stage"):
        v = variables[name]
        assert v["type"] == "query"
        assert v["datasource"] == DS
        assert v["query"]["query"].startswith("label_values(")
        assert v["query"]["query"].endswith(f", {name})")
        assert (v["includeAll"], v["multi"], v["allValue"]) == (True, True, ".*")


def test_panels_use_the_variable_and_do_not_overlap() -> None:
    panels = _dash()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0
        assert g["x"] + g["w"] <= 24
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, p["title"]
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["type"] == "timeseries"
        assert p["datasource"] == DS
        assert p["targets"]
        for t in p["targets"]:
            assert t["datasource"] == DS
            assert t["expr"].strip()
    titles = {p["title"] for p in panels}
    for wanted in (
        "Acceptance rate by stage",
        "Tokens per verification step",
        "Drafted vs accepted tokens",
        "Controller keep-rate",
        "Verification step time",
        "Shard bytes vs budget",
        "Fleet lag",
        "Fleet entries",
        "vLLM acceptance rate",
    ):
        assert wanted in titles


def test_agentspec_queries_filter_by_the_variables() -> None:
    for where, expr in ops_pipeline.dashboard_exprs():
        if where.startswith("panel") and "agentspec_accepted_tokens_total" in expr:
            assert 'stage=~"$stage"' in expr, where
            assert 'tenant=~"$tenant"' in expr, where
    assert ops_pipeline.concrete('rate(x{stage=~"$stage"}[$__rate_interval])') == (
        'rate(x{stage=~".*"}[1m])'
    )
    assert ops_pipeline.concrete('label_values(m{a="1"}, stage)') == 'group by (stage) (m{a="1"})'
