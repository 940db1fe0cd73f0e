"""Latency agentspec's client adds to a call: AgentSpecClient vs plain openai.OpenAI.

Both clients call the same local OpenAI-compatible server
(tests/openai_server.py) in one run, alternating call by call so that drift
of the machine or the server affects both alike.  Reported per mode
(non-streaming chat, streaming chat read to the end): p50 / p99 of the
call's wall time for each client and the difference (agentspec - plain).
The agentspec client tags every call (session + stage scopes) and learns every
response (server token ids) on its worker thread; the plain client sends the
same ``return_token_ids`` body field, so both get the same bytes back.

Target: agentspec's added p50 < 0.2 ms.  Nothing is asserted; numbers are
printed (``--json`` for a machine-readable line).

    python benchmarks/bench_client.py [--calls 2000] [--stream-calls 500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import openai

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT / "tests"))  # the test server
if str(_ROOT) not in sys.path:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(_ROOT))

from openai_server import OpenAIServer  # noqa: E402

import agentspec._client.tags as tags  # noqa: E402
from agentspec._client.client import AgentSpecClient  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` (nearest rank)."""
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def one_call(client, stream: bool, i: int, extra_body) -> float:
    """Wall time of one chat call (a stream read to its end), in ms."""
    messages = [{"role": "user", "content": f"question {i % 50}"}]
    t0 = time.perf_counter()
    if stream:
        for _ in client.chat.completions.create(
            model="m", messages=messages, stream=True, extra_body=extra_body
        ):
            pass
    else:
        client.chat.completions.create(model="m", messages=messages, extra_body=extra_body)
    return (time.perf_counter() - t0) * 1e3


def run_mode(plain, wrapped, stream: bool, calls: int, warmup: int) -> dict[str, float]:
    """Alternate plain / agentspec calls; return the p50/p99 of both and the differences."""
    times: dict[str, list[float]] = {"plain": [], "agentspec": []}
    body = {"return_token_ids": True}
    with wrapped.session("bench-session", pipeline="bench"), tags.stage("SQL"):
        for i in range(warmup + calls):
            order = ((plain, "plain", body), (wrapped, "agentspec", None))
            if i % 2:
                order = order[::-1]
            for client, name, extra in order:
                ms = one_call(client, stream, i, extra)
                if i >= warmup:
                    times[name].append(ms)
    out: dict[str, float] = {}
    for name, values in times.items():
        out[f"{name}_p50_ms"] = percentile(values, 0.5)
        out[f"{name}_p99_ms"] = percentile(values, 0.99)
        out[f"{name}_mean_ms"] = statistics.fmean(values)
    out["added_p50_ms"] = out["agentspec_p50_ms"] - out["plain_p50_ms"]
    out["added_p99_ms"] = out["agentspec_p99_ms"] - out["plain_p99_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="non-streaming calls per client")
    ap.add_argument("--stream-calls", type=int, default=500, help="streaming calls per client")
    ap.add_argument("--warmup", type=int, default=50, help="untimed calls first, per client")
    ap.add_argument("--json", action="store_true", help="also print one JSON line")
    args = ap.parse_args(argv)

    results: dict[str, dict[str, float]] = {}
    with OpenAIServer() as server:
        common = {"base_url": server.base_url, "api_key": "bench", "max_retries": 0}
        plain = openai.OpenAI(**common)
        wrapped = AgentSpecClient(**common, return_token_ids=True, queue_size=1 << 16)
        try:
            results["chat"] = run_mode(plain, wrapped, False, args.calls, args.warmup)
            results["chat-stream"] = run_mode(plain, wrapped, True, args.stream_calls, args.warmup)
            wrapped.flush(60)
            stats = wrapped.stats()
        finally:
            wrapped.close()
            plain.close()

    print(f"openai {openai.__version__}; calls alternate plain / agentspec on one local server")
    head = f"{'mode':<12} {'client':<10} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}"
    print(head)
    print("-" * len(head))
    for mode, r in results.items():
        for name in ("plain", "agentspec"):
            print(
                f"{mode:<12} {name:<10} {r[f'{name}_p50_ms']:8.3f} {r[f'{name}_p99_ms']:8.3f} "
                f"{r[f'{name}_mean_ms']:8.3f}"
            )
        print(
            f"{mode:<12} {'added':<10} {r['added_p50_ms']:8.3f} {r['added_p99_ms']:8.3f}"
            f"   (target: added p50 < 0.200 ms)"
        )
    print(
        f"recorder: submitted={stats.submitted} learned={stats.learned} "
        f"dropped={stats.dropped} failed={stats.failed}"
    )
    if args.json:
        print(json.dumps({"openai": openai.__version__, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
