#!/usr/bin/env python3
"""Draw the panels of docs/grafana/agentspec.json with matplotlib from real Prometheus data.

Two ways to get the data:

    # query a Prometheus that already scrapes agentspec (the last 15 minutes)
    python scripts/render_dashboard_png.py --prometheus http://127.0.0.1:9090 --minutes 15

    # or run it all here: two embedded engines on SmolLM2-135M (A serves a tagged
    # pipeline and publishes to a fleet on a local redis-server, B follows the fleet)
    # and Debian's prometheus scraping them every second, for --seconds of traffic
    python scripts/render_dashboard_png.py --seconds 90

Each panel's queries run as range queries (template variables as ``.*``,
``$__rate_interval`` as ``--rate-interval``); a panel with no data says so.
Needs the ``bench`` extra (matplotlib); the run mode also needs the ``local``
extra, the ``prometheus`` binary and, for the fleet panels, ``redis-server``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the Prometheus harness and the pipeline
if str(ROOT) not in sys.path:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import ops_pipeline  # noqa: E402

_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    """``/api/v1/query_range`` of the Prometheus at ``url`` (raises on an error answer)."""
    params = urllib.parse.urlencode(
        {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    )
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{params}", timeout=60) as resp:
        obj = json.loads(resp.read())
    if obj.get("status") != "success":
        raise RuntimeError(f"{expr}: {obj.get('error')}")
    return list(obj["data"]["result"])


def panels() -> list[dict[str, Any]]:
    """The dashboard's graph panels (rows left out), in layout order."""
    dash = json.loads(ops_pipeline.DASHBOARD.read_text())
    return [p for p in dash["panels"] if p.get("type") != "row"]


def render(url: str, start: float, end: float, out: Path, rate_interval: str) -> int:
    """Draw every panel over [start, end]; returns how many panels had data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = panels()
    cols = 3
    rows = (len(ps) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    step = max(1.0, (end - start) / 300)
    with_data = 0
    for ax, panel in zip(axes.flat, ps, strict=False):
        unit = panel["fieldConfig"]["defaults"].get("unit", "short")
        drawn = 0
        for target in panel["targets"]:
            expr = ops_pipeline.concrete(target["expr"], rate_interval)
            for series in query_range(url, expr, start, end, step):
                pts = [(float(t) - start, float(v)) for t, v in series["values"]]
                pts = [(t, v) for t, v in pts if v == v and abs(v) != float("inf")]  # NaN, Inf
                if not pts:
                    continue
                labels = series["metric"]
                legend = _LEGEND.sub(
                    lambda m, lb=labels: lb.get(m.group(1), ""), target.get("legendFormat", "")
                )
                if unit == "percentunit":
                    pts = [(t, 100 * v) for t, v in pts]
                ax.plot([t for t, _ in pts], [v for _, v in pts], label=legend or expr[:40], lw=1.2)
                drawn += 1
        ax.set_title(panel["title"], fontsize=10)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("seconds", fontsize=7)
        ax.set_ylabel({"percentunit": "%"}.get(unit, unit), fontsize=7)
        ax.grid(alpha=0.3)
        if drawn:
            with_data += 1
            if unit == "bytes":  # shards are small next to their budget
                ax.set_yscale("symlog")
            handles, names = ax.get_legend_handles_labels()
            ax.legend(handles[:12], names[:12], fontsize=6, loc="best", ncol=2 if drawn > 4 else 1)
        else:
            ax.text(
                0.5,
                0.5,
                "no data in this run",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="grey",
            )
    for ax in list(axes.flat)[len(ps) :]:
        ax.axis("off")
    fig.suptitle(
        f"agentspec (docs/grafana/agentspec.json): {end - start:.0f} s of Prometheus data",
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    return with_data


def run_stack(seconds: float) -> tuple[Any, float, float, list[Any]]:
    """Start the engines, the fleet and Prometheus; send the pipeline for ``seconds``."""
    import torch
    from prometheus_server import PrometheusServer, Target

    from agentspec.engine import EngineOptions, EngineServer
    from agentspec.models import ensure_default_model, load_model

    torch.set_num_threads(1)  # one thread per engine step: no OpenMP oversubscription
    model, tok = load_model(ensure_default_model())
    opts = EngineOptions(default_max_tokens=24)
    closers: list[Any] = []
    fleet_a = fleet_b = None
    if shutil.which("redis-server"):
        from redis_server import RedisServer

        from agentspec._fleet.config import FleetConfig
        from agentspec._fleet.functions import load_library
        from agentspec.engine._fleet import EngineFleet

        redis = RedisServer(tcp=True).__enter__()
        closers.append(lambda: redis.__exit__(None, None, None))
        admin = redis.client()
        load_library(admin)
        admin.close()
        cfg = FleetConfig(max_depth=64, max_shard_tokens=100_000)
        fleet_a = EngineFleet(redis.tcp_url, config=cfg, block_ms=200)
        fleet_b = EngineFleet(redis.tcp_url, config=cfg, block_ms=200)
        closers += [lambda: fleet_a.close(0), lambda: fleet_b.close(0)]
    a = EngineServer.create(model, tok, opts, fleet=fleet_a).start()
    b = EngineServer.create(model, tok, opts, fleet=fleet_b).start()
    closers += [a.stop, b.stop]
    prom = PrometheusServer(
        {"engine-a": [Target(f"127.0.0.1:{a.port}")], "engine-b": [Target(f"127.0.0.1:{b.port}")]},
        rule_files=[ops_pipeline.ALERTS],
    ).start()
    closers.append(prom.close)
    prom.wait_scraped()
    start = time.time()
    i = 0
    while time.time() - start < seconds:
        for (tenant, pipeline, stage), prompt in ops_pipeline.STAGES.items():
            # a few variants per stage: the shards learn, and some drafts miss
            variant = prompt if i % 4 else f"{prompt} Answer briefly, case {i}."
            ops_pipeline.chat(a.port, tenant, pipeline, stage, variant, max_tokens=24)
        i += 1
    prom.wait_scraped(time.time())
    return prom, start - 5, time.time(), closers


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prometheus", help="query this Prometheus (URL) instead of running the stack")
    ap.add_argument("--minutes", type=float, default=15.0, help="time range with --prometheus")
    ap.add_argument("--seconds", type=float, default=90.0, help="traffic to send in run mode")
    ap.add_argument("--rate-interval", default="15s", help="what $__rate_interval becomes")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    args = ap.parse_args()
    if args.prometheus:
        end = time.time()
        n = render(
            args.prometheus.rstrip("/"), end - 60 * args.minutes, end, args.out, args.rate_interval
        )
    else:
        prom, start, end, closers = run_stack(args.seconds)
        try:
            n = render(prom.url, start, end, args.out, args.rate_interval)
        finally:
            for close in reversed(closers):
                close()
    print(f"wrote {args.out} ({n} of {len(panels())} panels with data)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
