"""The zoo's targets checked run by run (`benchmarks.zoo_claims`): a claim holds only where
every run meets it on every shape; misses name every run's figure."""

from __future__ import annotations

import math
import random

from benchmarks import zoo_claims


def row(model, batch, line, ms, *, first=0.01, ready=1.0, err=0.0, length=None):
    return {"model": model, "batch": batch, "length": length, "line": line, "ms": ms, "first_s": first,
            "ready_s": ready, "max_err": err}


def run(rng: random.Random, compile_ratio: float, background_first: float = 0.015, model="m/cnn"):
    """One run of one model at B = 1 and 8: RO and eager at random speeds, the compile line at
    `compile_ratio` of RO, the background line at a random ratio under 1."""
    rows = []
    for batch in (1, 8):
        ro = rng.uniform(0.3, 2.0)
        rows += [row(model, batch, "eager", ro * rng.uniform(4, 10), first=0.01),
                 row(model, batch, "reduce_overhead", ro, ready=10.0, err=0.01),
                 row(model, batch, "graphify_compile", ro * compile_ratio, ready=8.0, err=0.01),
                 row(model, batch, "graphify_background", ro * rng.uniform(0.8, 0.99), first=background_first,
                     err=0.005)]
    return rows


def test_a_target_holds_only_where_every_run_meets_it():
    rng = random.Random(3)
    text = zoo_claims.verdict({"a": run(rng, 0.9), "b": run(rng, 1.1)})
    table = {line.split(" (")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert table["compile line"].endswith("| 2 / 2 | 0 / 2 | no |")
    assert table["best line"].endswith("| 2 / 2 | 2 / 2 | yes |")  # the background line is the faster in b
    assert table["seconds to steady"].endswith("| 1 / 1 | 1 / 1 | yes |")  # 16 s against 20 s
    assert table["first call"].endswith("| 2 / 2 | 2 / 2 | yes |")  # 15 ms against 10 ms
    assert "- compile line: ('m/cnn', 1, None): a 0.900, b 1.100" in text


def test_a_shape_one_run_lacks_fails_the_claim_apart_from_the_misses_and_bounds_are_inclusive():
    rng = random.Random(4)
    a = run(rng, 1.0) + run(rng, 0.95, model="m/vit")
    b = run(rng, 1.0, background_first=0.021)
    figs = zoo_claims.figures(b)
    assert all(math.isclose(v, 1.0) for v in figs["compile line"].values())
    assert all(math.isclose(v, 2.1) for v in figs["first call"].values())
    text = zoo_claims.verdict({"a": a, "b": b})
    table = {line.split(" (")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert table["compile line"].endswith("| 4 / 4 | 2 / 2 | no |")  # b lacks m/vit: no claim yet
    misses, gaps = text.split("Met where measured")
    assert "m/vit" not in misses  # 0.95 met where measured
    assert "- compile line: 2 not in b" in gaps and "not in a" not in gaps
    assert "- first call: ('m/cnn', 1, None): a 1.500, b 2.100" in text
    assert "- compile line: ('m/cnn', 1, None)" not in text  # 1.0 meets ≤ 1.0


def test_the_geometric_mean_and_errors_against_the_peers_own():
    rows = [row("m/x", 1, "eager", 5.0), row("m/x", 1, "reduce_overhead", 1.0, err=0.02),
            row("m/x", 1, "graphify_compile", 0.64, err=0.03), row("m/x", 8, "eager", 5.0),
            row("m/x", 8, "reduce_overhead", 2.0, err=0.0), row("m/x", 8, "graphify_compile", 2.0, err=0.0)]
    figs = zoo_claims.figures(rows)
    assert math.isclose(zoo_claims.geomean(figs["best line"].values()), 0.8)
    assert figs["outputs"] == {("m/x", 1, None): 1.5, ("m/x", 8, None): 1.0}
    assert "| best line, geometric mean | ≤ 0.85 | 0.800 | yes |" in zoo_claims.verdict({"r": rows})


def test_errors_from_the_fp32_model_are_checked_where_every_line_has_them():
    """The outputs target against the fp32 model's outputs: our worst line's error over RO's,
    where our lines and RO carry it; a run from before the column measures none and claims nothing."""
    def with_exact(r, exact):
        return {**r, "max_err_exact": exact}

    rows = [with_exact(row("m/x", 1, "reduce_overhead", 1.0, err=0.02), 0.04),
            with_exact(row("m/x", 1, "graphify_compile", 1.0, err=0.03), 0.03),
            with_exact(row("m/x", 1, "graphify_background", 1.0, err=0.02), 0.05),
            with_exact(row("m/x", 8, "reduce_overhead", 1.0, err=0.02), 0.04),
            with_exact(row("m/x", 8, "graphify_compile", 1.0, err=0.03), 0.04),
            row("m/x", 8, "graphify_background", 1.0, err=0.02)]  # one line without it: not measured
    figs = zoo_claims.figures(rows)
    assert figs["outputs vs fp32"] == {("m/x", 1, None): 1.25}
    assert figs["outputs"] == {("m/x", 1, None): 1.5, ("m/x", 8, None): 1.5}
    old = [row("m/x", 1, "reduce_overhead", 1.0, err=0.02), row("m/x", 1, "graphify_compile", 1.0, err=0.02)]
    text = zoo_claims.verdict({"old": old, "new": rows})
    table = {line.split(" (")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert table["outputs vs fp32"].endswith("| 0 / 0 | 0 / 1 | no |")
    assert "- outputs vs fp32: ('m/x', 1, None): old -, new 1.250" in text
    assert zoo_claims.verdict({"old": old}).splitlines()[3].endswith("| 0 / 0 | no |")  # nothing measured holds nothing
