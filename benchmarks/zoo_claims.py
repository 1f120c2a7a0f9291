"""The zoo's targets checked run by run: a claim holds only where every run named meets it.

Per run (a merged `zoo-<tag>-<device>.json`), against torch.compile's reduce-overhead (RO):
- outputs: each graphify line's largest difference from eager within RO's own (x 1.05);
- outputs vs fp32: the same against the fp32 model's outputs (same weights, fp32 arithmetic):
  where a line and RO differ from eager by another rounding, which is nearer the exact answer
  (runs that predate the fp32 column measure none);
- best line: the fastest graphify line's ms ÷ RO's at most 1.0 on every shape, and their
  geometric mean at most 0.85;
- compile line: its ms ÷ RO's at most 1.0 on every shape;
- seconds to steady: the compile line's, summed over a model's shapes, at most RO's;
- first call: the background line's first call at most twice eager's, every shape.
Printed as a table (each target: how many of the shapes or models meet it in each run, and
whether all do in all runs), the misses with every run's figure, and how many shapes met the
bound where measured but are missing from a run (a run not yet complete):
`python3 -m benchmarks.zoo_claims run2 run3`."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict

from ._report import RESULTS

OURS = ("graphify", "graphify_compile", "graphify_background")
PEER = "reduce_overhead"
ERROR_SLACK = 1.05
TARGETS = {  # name: (what is checked, the bound)
    "outputs": ("each line's max error ÷ RO's", ERROR_SLACK),
    "outputs vs fp32": ("each line's max error from the fp32 model ÷ RO's", ERROR_SLACK),
    "best line": ("fastest graphify line ÷ RO", 1.0),
    "compile line": ("compile line ÷ RO", 1.0),
    "seconds to steady": ("compile line's s to steady ÷ RO's, a model's shapes summed", 1.0),
    "first call": ("background line's first call ÷ eager's", 2.0),
}
GEOMEAN_BOUND = 0.85


def _shapes(rows: list[dict]) -> dict:
    by: dict = defaultdict(dict)
    for r in rows:
        by[(r["model"], r["batch"], r.get("length"))][r["line"]] = r
    return by


def figures(rows: list[dict]) -> dict[str, dict]:
    """{target: {shape or model: the figure checked against its bound}} for one run's rows."""
    out: dict[str, dict] = {name: {} for name in TARGETS}
    steady: dict = defaultdict(lambda: [0.0, 0.0])
    for shape, lines in _shapes(rows).items():
        peer, eager = lines.get(PEER), lines.get("eager")
        if peer and peer.get("ms"):
            ours = [lines[o]["ms"] / peer["ms"] for o in OURS if o in lines and lines[o].get("ms")]
            if ours:
                out["best line"][shape] = min(ours)
            if "graphify_compile" in lines:
                out["compile line"][shape] = lines["graphify_compile"]["ms"] / peer["ms"]
                steady[shape[0]][0] += lines["graphify_compile"].get("ready_s") or 0.0
                steady[shape[0]][1] += peer.get("ready_s") or 0.0
            for name, key in (("outputs", "max_err"), ("outputs vs fp32", "max_err_exact")):
                ratio = _error_ratio(lines, peer, key)
                if ratio is not None:
                    out[name][shape] = ratio
        background = lines.get("graphify_background")
        if background and eager and eager.get("first_s"):
            out["first call"][shape] = background["first_s"] / eager["first_s"]
    out["seconds to steady"] = {m: ours / peer for m, (ours, peer) in steady.items() if peer > 0}
    return out


def _error_ratio(lines: dict, peer: dict, key: str) -> "float | None":
    """The largest of our lines' errors (`key`) over RO's; None where one of them lacks it."""
    errors = [lines[o].get(key) for o in OURS if o in lines]
    if not errors or any(e is None for e in errors) or peer.get(key) is None:
        return None
    return max(errors) / peer[key] if peer[key] else (1.0 if max(errors) == 0 else math.inf)


def geomean(values) -> float:
    values = list(values)
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else math.nan


def verdict(runs: dict[str, list[dict]]) -> str:
    """The table and the misses for runs {tag: rows}: a target holds where every run has the
    shape (or model) and meets the bound on it."""
    figs = {tag: figures(rows) for tag, rows in runs.items()}
    tags = list(runs)
    lines = ["| target | bound | " + " | ".join(f"{t}: met / measured" for t in tags) + " | holds in every run |",
             "|---|---|" + "---|" * len(tags) + "---|"]
    misses, unmeasured = [], defaultdict(int)
    for name, (what, bound) in TARGETS.items():
        cells, holds = [], True
        keys = set().union(*(figs[t][name] for t in tags))
        for t in tags:
            got = figs[t][name]
            met = sum(v <= bound for v in got.values())
            cells.append(f"{met} / {len(got)}")
            holds &= met == len(got) == len(keys) > 0  # nothing measured holds nothing
        lines.append(f"| {name} ({what}) | ≤ {bound:g} | " + " | ".join(cells) + f" | {'yes' if holds else 'no'} |")
        for k in sorted(keys, key=str):
            row = [figs[t][name].get(k) for t in tags]
            if not any(v is not None and v > bound for v in row):
                for t, v in zip(tags, row):
                    unmeasured[(name, t)] += v is None
                continue
            misses.append(f"- {name}: {k}: " + ", ".join(f"{t} {'-' if v is None else format(v, '.3f')}"
                                                          for t, v in zip(tags, row)))
    geo = [geomean(figs[t]["best line"].values()) for t in tags]
    lines.append(f"| best line, geometric mean | ≤ {GEOMEAN_BOUND} | " + " | ".join(f"{g:.3f}" for g in geo)
                 + f" | {'yes' if all(g <= GEOMEAN_BOUND for g in geo) else 'no'} |")
    gaps = [f"- {name}: {count} not in {t}" for (name, t), count in unmeasured.items() if count]
    return ("\n".join(lines) + "\n\nMisses (every run's figure; - where a run lacks it):\n\n" + "\n".join(misses or ["none"])
            + "\n\nMet where measured, not yet measured in every run:\n\n" + "\n".join(gaps or ["none"]) + "\n")


def load(tag: str) -> list[dict]:
    """The rows of the merged run `zoo-<tag>-<device>.json` (one device's)."""
    found = sorted(RESULTS.glob(f"zoo-{tag}-*.json"))
    if len(found) != 1:
        raise SystemExit(f"want one merged result zoo-{tag}-<device>.json under {RESULTS}, found {[p.name for p in found]}")
    return json.loads(found[0].read_text())["rows"]


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tags", nargs="+", help="merged runs' tags (run2 run3)")
    text = verdict({tag: load(tag) for tag in parser.parse_args(argv).tags})
    print(text)
    return text


if __name__ == "__main__":
    main()
