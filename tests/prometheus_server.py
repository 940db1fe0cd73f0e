"""A real Prometheus server for tests: Debian's ``prometheus`` binary on loopback.

`PrometheusServer` writes a ``prometheus.yml`` scraping the given targets
every second (scrape_configs in JSON, which is YAML too), starts
``/usr/bin/prometheus`` on 127.0.0.1 with a port the OS picked and a
temporary ``--storage.tsdb.path``, waits for its own "Server is ready to
receive web requests." log line (read from its output by a thread: an event,
not a sleep) and for ``/-/ready``, then answers PromQL through
``/api/v1/query``.  `wait_scraped` waits until every target of a job was
scraped successfully after a given moment (``lastScrape`` in
``/api/v1/targets``), so a query sees what the targets counted before it.
``rule_files`` are loaded as the server's rule files (``/api/v1/rules``).

Outside CI, tests skip (with the reason) where the binary is missing; under
CI (``CI`` set, as `.ci/run` runs) nothing skips: `.ci/run` installs the
``prometheus`` package, and a missing binary fails the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from agentspec._util.procs import free_port, stop_group

_IN_CI = bool(os.environ.get("CI"))

PROMETHEUS = shutil.which("prometheus") or (
    "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None
)

PROMTOOL = shutil.which("promtool") or (
    "/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) else None
)

requires_prometheus = pytest.mark.skipif(
    PROMETHEUS is None and not _IN_CI,
    reason="the prometheus server is not installed (apt-get install prometheus)",
)

_READY = "Server is ready to receive web requests."


@dataclass(frozen=True)
class Target:
    """One scrape target: ``host:port``, the path, and a bearer token if it needs one."""

    address: str
    metrics_path: str = "/metrics"
    bearer: str | None = None


def eventually(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes (HTTP state, no event to wait on)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class PrometheusError(AssertionError):
    """Prometheus answered an API call with an error (the message has its ``error``)."""


class PrometheusServer:
    """One prometheus process (see the module docstring)."""

    def __init__(
        self,
        jobs: Mapping[str, Iterable[Target]],
        *,
        rule_files: Iterable[Path] = (),
        scrape_interval: str = "1s",
        evaluation_interval: str = "1s",
    ) -> None:
        """Write the configuration (the server starts with `start`)."""
        assert PROMETHEUS is not None, "the prometheus binary is not installed"
        self.dir = Path(tempfile.mkdtemp(prefix="as-prom-", dir="/tmp"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.jobs = {job: list(targets) for job, targets in jobs.items()}
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.proc: subprocess.Popen[str] | None = None
        self.log: deque[str] = deque(maxlen=400)
        self._ready = threading.Event()
        self.config_path = self.dir / "prometheus.yml"
        self.config_path.write_text(
            json.dumps(self.config(scrape_interval, evaluation_interval), indent=2)
        )

    def config(self, scrape_interval: str, evaluation_interval: str) -> dict[str, Any]:
        """The prometheus.yml contents: one scrape job per entry of ``jobs``."""
        scrape: list[dict[str, Any]] = []
        for job, targets in self.jobs.items():
            for i, t in enumerate(targets):
                cfg: dict[str, Any] = {
                    "job_name": job if len(targets) == 1 else f"{job}-{i}",
                    "metrics_path": t.metrics_path,
                    "static_configs": [{"targets": [t.address], "labels": {"service": job}}],
                    "scrape_timeout": scrape_interval,
                }
                if t.bearer is not None:
                    cfg["authorization"] = {"type": "Bearer", "credentials": t.bearer}
                scrape.append(cfg)
        return {
            "global": {
                "scrape_interval": scrape_interval,
                "evaluation_interval": evaluation_interval,
            },
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": scrape,
        }

    def args(self) -> list[str]:
        """The prometheus command line."""
        assert PROMETHEUS is not None
        return [
            PROMETHEUS,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",
            "--log.level=info",
        ]

    def start(self, timeout: float = 60.0) -> PrometheusServer:
        """Start the server; wait for its ready log line, then for ``/-/ready``."""
        self._ready.clear()
        self.proc = subprocess.Popen(
            self.args(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"prometheus did not become ready:\n{self.log_tail()}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited:\n{self.log_tail()}")
        if not eventually(lambda: self._get_status("/-/ready") == 200, timeout):
            raise RuntimeError(f"/-/ready did not answer 200:\n{self.log_tail()}")
        return self

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.log.append(line.rstrip("\n"))
            if _READY in line:
                self._ready.set()
        self._ready.set()  # exited: wake the waiter, which checks poll()

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the server's log."""
        return "\n".join(list(self.log)[-n:])

    def stop(self) -> None:
        """Stop the process group (SIGTERM, then SIGKILL)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc)  # type: ignore[arg-type]
            if proc.stdout is not None:
                proc.stdout.close()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self.start() if self.proc is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- the HTTP API ----------------------------------------------------------------

    def _get_status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return 0

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>``; returns its ``data`` (raises `PrometheusError` on an error)."""
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                obj = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            obj = json.loads(e.read() or b"{}")
        if obj.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {obj.get('errorType')}: {obj.get('error')}")
        return obj["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query at now: its vector (a scalar comes back as one unlabelled sample)."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(
        self, expr: str, start: float, end: float, step: float = 1.0
    ) -> list[dict[str, Any]]:
        """A range query: ``[{"metric": labels, "values": [[t, "v"], ...]}, ...]``."""
        data = self.api(
            "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}"
        )
        return list(data["result"])

    def values(self, expr: str, by: str) -> dict[str, float]:
        """``{series[by]: value}`` of an instant query (label ``by`` picks the key)."""
        return {r["metric"].get(by, ""): float(r["value"][1]) for r in self.query(expr)}

    def targets(self) -> list[dict[str, Any]]:
        """The active targets of ``/api/v1/targets``."""
        return list(self.api("targets", state="active")["activeTargets"])

    def wait_scraped(self, after: float | None = None, timeout: float = 60.0) -> None:
        """Wait until every target is up and was scraped after the moment ``after``.

        ``after`` is a ``time.time()`` value (default: now), so the next query
        sees every sample the targets held at that moment.
        """
        since = time.time() if after is None else after
        want = sum(len(t) for t in self.jobs.values())

        def done() -> bool:
            ts = self.targets()
            return len(ts) == want and all(
                t["health"] == "up" and _rfc3339(t["lastScrape"]) > since for t in ts
            )

        if not eventually(done, timeout):
            raise AssertionError(
                f"targets not scraped after {since}: {json.dumps(self.targets(), indent=1)}\n"
                f"{self.log_tail()}"
            )

    def rules(self) -> list[dict[str, Any]]:
        """Every rule of every group in ``/api/v1/rules``."""
        return [r for g in self.api("rules")["groups"] for r in g["rules"]]


def _rfc3339(stamp: str) -> float:
    """Seconds since the epoch of Prometheus's RFC 3339 timestamps (nanosecond fractions)."""
    head, _, rest = stamp.partition(".")
    if not rest:  # no fraction: "2026-01-01T00:00:00Z"
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    frac = ""
    i = 0
    while i < len(rest) and rest[i].isdigit():
        frac += rest[i]
        i += 1
    tz = rest[i:].replace("Z", "+00:00")
    base = datetime.fromisoformat(head + tz).timestamp()
    return base + float("0." + frac) if frac else base
