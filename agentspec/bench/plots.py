"""PNG plots of `agentspec bench replay` results (matplotlib, Agg backend, optional).

Per trace file:

- ``<name>-mat-per-stage.png``: MAT per stage (and overall) per method;
- ``<name>-vs-shard-size.png``: MAT and acceptance rate against the number of
  responses already in the request's stage shard (log-2 buckets), as in the
  SuffixDecoding paper's corpus-size figure;
- ``<name>-budget.png`` (``agentspec bench budget``): MAT against drafted
  tokens per step, one line per method.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_budget", "plot_replay", "pyplot"]


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib)"


def _prepare(out_dir: Path | str) -> tuple[Any, Path]:
    """pyplot (None without matplotlib) and the output directory, created when plotting."""
    plt = pyplot()
    out = Path(out_dir)
    if plt is not None:
        out.mkdir(parents=True, exist_ok=True)
    return plt, out


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out, write and close ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_replay(results: dict[str, Any], out_dir: Path | str) -> tuple[list[Path], str | None]:
    """Write the plots of every file in ``results`` into ``out_dir``.

    Returns the paths written and None, or ``([], reason)`` when matplotlib is
    not installed.
    """
    plt, out = _prepare(out_dir)
    if plt is None:
        return [], _NO_MATPLOTLIB
    written: list[Path] = []
    for f in results["files"]:
        written.append(_per_stage(plt, f, out / f"{f['name']}-mat-per-stage.png"))
        written.append(_vs_shard(plt, f, out / f"{f['name']}-vs-shard-size.png"))
    return written, None


def _per_stage(plt: Any, f: dict[str, Any], path: Path) -> Path:
    methods: dict[str, Any] = f["methods"]
    groups = [*f["stages"], "all"]
    n = max(len(methods), 1)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + 0.35 * n * len(groups)), 4.0))
    for j, (name, m) in enumerate(methods.items()):
        vals = []
        for g in groups:
            src = m if g == "all" else m["per_stage"].get(g)
            v = src.get("mat") if src else None
            vals.append(v if v is not None else 0.0)
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(groups))]
        ax.bar(xs, vals, width, label=name, hatch="//" if name == "oracle" else None)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel("MAT (accepted + bonus per step)")
    ax.set_title(f"{f['name']}: MAT per stage")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.legend(fontsize=7, ncol=2)
    return _save(plt, fig, path)


def _vs_shard(plt: Any, f: dict[str, Any], path: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11.0, 4.0))
    for name, m in f["methods"].items():
        bins = m["by_shard_size"]
        xs = [b["shard_responses_lo"] for b in bins]
        style = "--" if name == "oracle" else "-"
        ax1.plot(xs, [b["mat"] for b in bins], style, marker="o", markersize=3, label=name)
        acc = [b["acceptance_rate"] for b in bins]
        ax2.plot(
            [x for x, a in zip(xs, acc, strict=True) if a is not None],
            [a for a in acc if a is not None],
            style,
            marker="o",
            markersize=3,
            label=name,
        )
    for ax, label in ((ax1, "MAT"), (ax2, "acceptance rate (accepted / drafted)")):
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlabel("responses already in the request's stage shard (log2 buckets)")
        ax.set_ylabel(label)
        ax.grid(True, linewidth=0.3)
    ax1.set_title(f"{f['name']}: MAT vs shard size")
    ax2.set_title("acceptance vs shard size")
    ax1.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_budget(results: dict[str, Any], out_dir: Path | str) -> tuple[list[Path], str | None]:
    """Write ``<name>-budget.png`` per file of an ``agentspec bench budget`` run:
    MAT against drafted tokens per step, one line per method (its budget points).

    Returns the paths written and None, or ``([], reason)`` without matplotlib.
    """
    plt, out = _prepare(out_dir)
    if plt is None:
        return [], _NO_MATPLOTLIB
    written: list[Path] = []
    for f in results["files"]:
        fig, ax = plt.subplots(figsize=(6.5, 4.0))
        by_method: dict[str, list[dict[str, Any]]] = {}
        for p in f["points"]:
            by_method.setdefault(p["method"], []).append(p)
        for name, pts in by_method.items():
            pts.sort(key=lambda p: p["drafted_per_step"])
            style = "--" if name == results["baseline"] else "-"
            ax.plot(
                [p["drafted_per_step"] for p in pts],
                [p["mat"] for p in pts],
                style,
                marker="o",
                markersize=3,
                label=name,
            )
        ax.set_xlabel("drafted tokens per step")
        ax.set_ylabel("MAT (accepted + bonus per step)")
        ax.set_title(f"{f['name']}: MAT against draft budget")
        ax.grid(True, linewidth=0.3)
        ax.legend(fontsize=7)
        written.append(_save(plt, fig, out / f"{f['name']}-budget.png"))
    return written, None
