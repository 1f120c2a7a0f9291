"""The serving benchmark's plot: throughput and p99 step latency per configuration."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_serving(rows: Sequence[dict], path: Path, title: str) -> Path | None:
    """Two horizontal bar panels (tokens/s, p99 ms); None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [r["config"] + (f" ({r['process']} process)" if r.get("process") else "") for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 1.8), sharey=True)
    colors = ["#4c72b0" if n.startswith("graphify") else "#dd8452" for n in names]
    for ax, key, label in ((left, "tokens_per_s", "tokens / s (higher is better)"),
                           (right, "p99_ms", "p99 step latency, ms (lower is better)")):
        values = [r[key] for r in rows]
        ax.barh(names, values, color=colors)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:,.0f}" if key == "tokens_per_s" else f" {v:.2f}", va="center", fontsize=8)
        ax.set_xlabel(label)
        ax.margins(x=0.18)
    left.invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
