"""A small tagged agent pipeline for the operations tests and the dashboard picture.

Three stages of one pipeline (``plan``, ``code``, ``review``) for the default
tenant and one stage for tenant ``acme``; each stage sends its own prompt a few
times, so the stage's learned shard drafts from the second call on.  `run`
sends the calls to an OpenAI-compatible server (the embedded engine, or vLLM
with the agentspec plugin) and returns what the responses themselves counted.

It also reads the Grafana dashboard: `dashboard_exprs` lists every PromQL
expression of ``docs/grafana/agentspec.json`` (panel targets and template
variables) and `concrete` turns one into a query Prometheus runs (template
variables as ``.*``, ``$__rate_interval`` as a fixed window, ``label_values``
as ``group by``).
"""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "agentspec.json"
ALERTS = ROOT / "docs" / "prometheus" / "agentspec-alerts.yml"

MODEL = "smollm2-135m"
PIPELINE = "triage"

#: (tenant, pipeline, stage) -> the stage's prompt.  A tenant of None sends no tenant
#: tag (the server's default tenant).
STAGES: dict[tuple[str | None, str, str], str] = {
    (None, PIPELINE, "plan"): "List three steps to make a cup of tea, one per line.",
    (None, PIPELINE, "code"): "Write a Python function that returns the sum of a list.",
    (None, PIPELINE, "review"): "Count from 1 to 10, separated by commas.",
    ("acme", PIPELINE, "plan"): "Give me a JSON object with keys name and age for Ann, 30.",
}


@dataclass
class Counts:
    """What the responses of one (tenant, pipeline, stage) counted, summed."""

    requests: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, usage: dict[str, Any]) -> None:
        """Add one response's ``agentspec`` counters."""
        self.requests += 1
        self.steps += int(usage.get("steps", 0))
        self.drafted += int(usage["drafted"])
        self.accepted += int(usage["accepted"])

    @property
    def rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.accepted / self.drafted


def chat(
    port: int,
    tenant: str | None,
    pipeline: str,
    stage: str,
    prompt: str,
    *,
    api_key: str | None = None,
    max_tokens: int = 16,
    chat_api: bool = True,
) -> dict[str, Any]:
    """One tagged, greedy call; the decoded response (asserts 200)."""
    xargs: dict[str, Any] = {"agentspec_pipeline": pipeline, "agentspec_stage": stage}
    if tenant is not None:
        xargs["agentspec_tenant"] = tenant
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "vllm_xargs": xargs,
    }
    if chat_api:
        body["messages"] = [{"role": "user", "content": prompt}]
        body["return_token_ids"] = True
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", path, json.dumps(body).encode(), headers)
        resp = conn.getresponse()
        raw = resp.read()
        assert resp.status == 200, raw[:2000]
        return json.loads(raw)  # type: ignore[no-any-return]
    finally:
        conn.close()


def run(
    port: int,
    *,
    api_key: str | None = None,
    rounds: int = 3,
    default_tenant: str = "default",
    max_tokens: int = 16,
    chat_api: bool = True,
) -> dict[tuple[str, str, str], Counts]:
    """Send every stage's prompt ``rounds`` times; the counts per (tenant, pipeline, stage).

    The counts come from each response's ``agentspec`` field; with
    ``chat_api=False`` (vLLM, whose responses carry no such field) only requests
    are counted.
    """
    out: dict[tuple[str, str, str], Counts] = {}
    for _ in range(rounds):
        for (tenant, pipeline, stage), prompt in STAGES.items():
            resp = chat(
                port,
                tenant,
                pipeline,
                stage,
                prompt,
                api_key=api_key,
                max_tokens=max_tokens,
                chat_api=chat_api,
            )
            counts = out.setdefault((tenant or default_tenant, pipeline, stage), Counts())
            if "agentspec" in resp:
                counts.add(resp["agentspec"])
            else:
                counts.requests += 1
    return out


# --- the dashboard's PromQL ----------------------------------------------------------------

_VAR = re.compile(r"\$\{?(tenant|pipeline|stage)\}?")
_LABEL_VALUES = re.compile(r"^label_values\((?:(.*),\s*)?(\w+)\)$", re.S)


def _panels(panels: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def dashboard_exprs(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """``(where, expr)`` for every PromQL expression of the dashboard.

    ``where`` names the panel (``panel <title> <refId>``) or the template
    variable (``variable <name>``).
    """
    dash = json.loads(path.read_text())
    out = []
    for p in _panels(dash["panels"]):
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out.append((f"variable {v['name']}", q["query"] if isinstance(q, dict) else q))
    return out


def concrete(expr: str, rate_interval: str = "1m") -> str:
    """The query Prometheus runs for a dashboard expression (see the module docstring)."""
    expr = _VAR.sub(".*", expr).replace("$__rate_interval", rate_interval)
    m = _LABEL_VALUES.match(expr.strip())
    if m:
        label = m.group(2)
        selector = m.group(1) or "{" + label + '!=""}'
        return f"group by ({label}) ({selector})"
    assert "$" not in expr, f"an unknown template variable in {expr!r}"
    return expr


#: Series only a vLLM server (with the plugin, on a fleet) exports: vLLM's own, and the
#: fleet lag, which the embedded engine does not measure.
VLLM_SERIES = ("vllm:",)


def is_vllm(expr: str) -> bool:
    """Whether the expression is checked against vLLM (it reads a `VLLM_SERIES` series)."""
    return any(name in expr for name in VLLM_SERIES)
