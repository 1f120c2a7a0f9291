"""README's plots, rendered from the result files as its tables are (`benchmarks.render_results`).

- the main job: tokens/s and p99 step latency per configuration, torch.compile reduce-overhead
  (the peer) beside graphify's;
- transformers `generate()`: ms/token and the first `generate()`'s seconds per line, model and
  batch size, transformers' own compile (the peer) beside graphify's line;
- the model zoo: each model's compile line over reduce-overhead at B = 1 and 8 (`_render_zoo`).

Each plot takes the newest code era's rows (as the tables' ranges do) on one kind of card, the
one with the most of them, and shows the median over the runs of each configuration. Picking
the rows (`series`) is plain data; drawing needs matplotlib (`.[bench]`), and without it the
images already in the tree are left as they are.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Series", "series", "draw", "PLOTS", "readme_block"]

PLOTS = Path(__file__).resolve().parent / "results" / "plots"
SERVING_PEER = "torch.compile reduce-overhead"
HF_PEER = "transformers' own compile (no line)"


@dataclass
class Series:
    """One plot's bars: label -> {measure: median}, which labels are the peer's, and where
    the numbers come from (card, dates, runs)."""

    name: str
    title: str
    measures: tuple[tuple[str, str], ...]  # (field, axis label)
    bars: dict = field(default_factory=dict)
    peers: set = field(default_factory=set)
    device: str = ""
    dates: str = ""
    runs: int = 0


def _newest_on_one_card(runs, kind: str, table: str, where: dict, per: str | None = None) -> list[tuple]:
    """(run, row) of the newest era on the card with the most such rows; with `per` (a
    field), the newest era of each of its values (a configuration's newest runs, the peer's
    beside, as the claims take them)."""
    from .render_results import picked

    rows = picked(runs, kind, table, where)
    if per is not None:
        values = dict.fromkeys(row.get(per) for run in runs for row in _rows(run, kind, table)
                               if all(row.get(k) == v for k, v in where.items()))
        rows = [pair for v in values for pair in picked(runs, kind, table, {**where, per: v})]
    cards: dict = {}
    for run, row in rows:
        cards.setdefault(run.env["device"], []).append((run, row))
    return max(cards.values(), key=len, default=[])


def _rows(run, kind: str, table: str) -> list[dict]:
    """The rows of `table` in `run`, where it is a run of benchmark `kind`."""
    if run.bench.kind != kind:
        return []
    return next(t for t in run.bench.tables if t.name == table).rows(run.data)


def _fill(s: Series, chosen: list[tuple], label, is_peer) -> Series:
    """Medians per label over `chosen`; the card, dates and runs they came from."""
    values: dict = {}
    for run, row in chosen:
        for key, _ in s.measures:
            if row.get(key) is not None:
                values.setdefault(label(row), {}).setdefault(key, []).append(row[key])
    s.bars = {lab: {k: statistics.median(v) for k, v in m.items()} for lab, m in values.items()}
    s.peers = {label(row) for _, row in chosen if is_peer(row)}
    used = {run.file: run for run, _ in chosen}.values()
    s.device = next(iter(used)).env["device"] if used else ""
    days = sorted(run.env["date"][:10] for run in used)
    s.dates = "" if not days else days[0] if days[0] == days[-1] else f"{days[0]} to {days[-1]}"
    s.runs = len(used)
    return s


def series(runs) -> list[Series]:
    """The README's plots as data, from the loaded runs (`render_results.load_runs`)."""
    main = Series("main-job", "Main job: the serving trace", (("tokens_per_s", "tokens / s (higher is better)"),
                                                             ("p99_ms", "p99 step ms (lower is better)")))
    _fill(main, _newest_on_one_card(runs, "serving", "trace", {}),
          lambda r: r["config"] + (f" ({r['process']} process)" if r.get("process") else ""),
          lambda r: r["config"] == SERVING_PEER)
    hf = Series("hf-generate", "transformers generate()", (("ms_per_token", "ms / token (lower is better)"),
                                                            ("first_generate_s", "first generate() s (log)")))
    _fill(hf, _newest_on_one_card(runs, "hf-generate", "per-token", {}, per="config"),
          lambda r: f"{r['model']} B={r['batch']}: {_short(r['config'])}", lambda r: r["config"] == HF_PEER)
    from ._render_zoo import zoo_series

    return [s for s in (main, hf, zoo_series(runs)) if s.bars]


def _short(config: str) -> str:
    """A line's name short enough for an axis label."""
    return (config.replace("graphify(model.forward, options=Options(", "graphify, ").replace("))", ")")
            .replace(" (transformers' compile off)", "").replace(" (no line)", ""))


def path_of(s: Series) -> Path:
    return PLOTS / f"{s.name}.png"


def readme_block(plots: Sequence[Series]) -> str:
    """The README's plots block: one image a plot, its caption naming the card and runs."""
    lines = []
    for s in plots:
        where = f"{s.device.removeprefix('NVIDIA ')}, {s.dates}, {s.runs} run{'s' if s.runs != 1 else ''}"
        lines.append(f"![{s.title}: {', '.join(label.split(' (')[0] for _, label in s.measures)} per "
                     f"configuration, the peer beside ({where})](benchmarks/results/plots/{s.name}.png)\n")
    return "\n".join(lines)


def draw(s: Series, path: Path) -> Path | None:
    """Two horizontal bar panels (the series' two measures); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = sorted(s.bars, key=lambda lab: (lab.split(":")[0], lab in s.peers, lab))
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.32 * len(labels) + 1.6), sharey=True)
    colors = ["#dd8452" if lab in s.peers else "#4c72b0" for lab in labels]
    for ax, (key, axis) in zip(axes, s.measures):
        values = [s.bars[lab].get(key, 0.0) for lab in labels]
        ax.barh(labels, values, color=colors)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:,.0f}" if v >= 100 else f" {v:.2f}", va="center", fontsize=7)
        if key == "first_generate_s":
            ax.set_xscale("log")
        ax.set_xlabel(axis)
        ax.margins(x=0.2)
        ax.tick_params(axis="y", labelsize=7)
    axes[0].invert_yaxis()
    fig.suptitle(f"{s.title}: {s.device}, {s.dates}, median of {s.runs} runs (orange: the peer)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path
