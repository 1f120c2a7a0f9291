"""README's model-zoo block and plot, from the zoo's result files (`benchmarks.zoo`).

One row per model (and served length): eager's and reduce-overhead's ms per call at B = 1 / 8,
each graphify line's ms over reduce-overhead's, and how long the compile line took to reach its
steady state over the peer's, summed over the model's shapes. Medians over the runs on the card with the most zoo rows, newest
code era; plain data, drawn by `benchmarks._render_plots.draw`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["zoo_medians", "render_zoo", "zoo_series"]

PEER = "reduce_overhead"
OURS = ("graphify", "graphify_compile", "graphify_background")
BATCHES = (1, 8)


def zoo_medians(runs) -> tuple[dict, list]:
    """({(model, length, batch, line): {field: median}}, the runs used)."""
    from ._render_plots import _newest_on_one_card

    chosen = _newest_on_one_card(runs, "zoo", "models", {})
    values: dict = {}
    for _, row in chosen:
        key = (row["model"], row.get("length"), row["batch"], row["line"])
        for field in ("ms", "vs_peer", "ready_s", "max_err", "mib", "replayed"):
            if row.get(field) is not None:
                values.setdefault(key, {}).setdefault(field, []).append(row[field])
    medians = {k: {f: statistics.median(v) for f, v in fields.items()} for k, fields in values.items()}
    return medians, list({run.file: run for run, _ in chosen}.values())


def _per_batch(med: dict, model, length, line: str, field: str, fmt: str) -> str:
    cells = [med.get((model, length, b, line), {}).get(field) for b in BATCHES]
    return " / ".join("-" if v is None else format(v, fmt) for v in cells)


def _ready_ratio(med: dict, model) -> str:
    """The compile line's seconds to steady over the peer's, summed over every shape of the
    model in the order the benchmark met them (a later shape may reuse an earlier compile)."""
    ours, peer = (sum(v.get("ready_s", 0.0) for (m, _, _, line), v in med.items() if m == model and line == which)
                  for which in ("graphify_compile", PEER))
    return "-" if not ours or not peer else f"{ours / peer:.2f}"


def render_zoo(runs) -> str:
    """The README's zoo table and its summary line."""
    from .render_results import dates, device, markdown

    med, used = zoo_medians(runs)
    if not med:
        return "No zoo runs yet.\n"
    shapes = sorted({(m, n) for m, n, _, _ in med}, key=lambda s: (s[0].split("/")[0] != "timm", s[0], s[1] or 0))
    header = ["model", "length", "eager ms", "reduce-overhead ms", "graphify ÷ RO", "compile ÷ RO", "background ÷ RO",
              "compile's s to steady ÷ RO's (all shapes)"]
    rows = [[m, "-" if n is None else str(n), _per_batch(med, m, n, "eager", "ms", ".2f"),
             _per_batch(med, m, n, PEER, "ms", ".3f"), *(_per_batch(med, m, n, line, "vs_peer", ".2f") for line in OURS),
             _ready_ratio(med, m)] for m, n in shapes]
    best = [min(v for v in (med.get((m, n, b, line), {}).get("vs_peer") for line in OURS) if v is not None)
            for m, n, b, line in med if line == PEER
            if any(med.get((m, n, b, o), {}).get("vs_peer") is not None for o in OURS)]
    compiled = [v["vs_peer"] for (m, n, b, line), v in med.items() if line == "graphify_compile" and "vs_peer" in v]
    eager_only = sorted({m for (m, n, b, line), v in med.items() if line in OURS and v.get("replayed") == 0})
    errors = [(v.get("max_err"), med.get((m, n, b, PEER), {}).get("max_err")) for (m, n, b, line), v in med.items()
              if line in OURS]
    within = sum(ours is not None and peer is not None and ours <= peer * 1.05 + 1e-6 for ours, peer in errors)
    geo = math.exp(statistics.fmean(math.log(v) for v in best)) if best else float("nan")
    summary = (f"\n\n{len(shapes)} models and lengths, {len(best)} shapes; every cell B = 1 / B = 8. Best graphify "
               f"line ÷ reduce-overhead: geometric mean {geo:.2f}, at most 1.00 on {sum(v <= 1.0 for v in best)} of "
               f"{len(best)} shapes (worst {max(best):.2f}); the compile line alone at most 1.00 on "
               f"{sum(v <= 1.0 for v in compiled)} of {len(compiled)} (worst {max(compiled, default=float('nan')):.2f}). "
               f"Largest difference from eager within reduce-overhead's own on {within} of {len(errors)} line "
               f"shapes. Lines that replayed no graph (ran eagerly, with a warning): {', '.join(eager_only) or 'none'}. "
               f"{device(used[0].env['device'])}, {dates(used)}, {len(used)} result file{'s' if len(used) != 1 else ''}.\n")
    return markdown(header, rows) + summary


def zoo_series(runs):
    """The zoo plot: each model's compile line ÷ reduce-overhead at B = 1 and B = 8."""
    from ._render_plots import Series

    med, used = zoo_medians(runs)
    s = Series("zoo", "Model zoo: graphify's compile line ÷ torch.compile reduce-overhead (lower is better)",
               (("b1", "ms ÷ reduce-overhead's, B = 1"), ("b8", "ms ÷ reduce-overhead's, B = 8")))
    for (m, n, b, line), v in med.items():
        if line == "graphify_compile" and "vs_peer" in v:
            s.bars.setdefault(m + ("" if n is None else f" L={n}"), {})[f"b{b}"] = v["vs_peer"]
    if used:
        days = sorted(run.env["date"][:10] for run in used)
        s.device, s.runs = used[0].env["device"], len(used)
        s.dates = days[0] if days[0] == days[-1] else f"{days[0]} to {days[-1]}"
    return s
