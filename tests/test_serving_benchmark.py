"""The serving-trace benchmark runs end to end on the simulation backend (small trace)."""

import pytest
import torch

from benchmarks import serving


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="on a GPU this is the benchmark itself (python -m benchmarks.serving), not a test; it checks the CPU run",
)
def test_every_mode_runs_the_trace_and_matches_eager():
    result = serving.run(num_requests=6, seed=3)
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {f"graphify {m}" for m in serving.MODES}
    for r in rows.values():
        assert r["max_err_vs_eager"] < 1e-4 and r["tokens_per_s"] > 0
        assert abs(r["steps_full_pct"] + r["steps_piecewise_pct"] + r["steps_none_pct"] - 100) < 1e-6
    assert rows["graphify NONE"]["steps_none_pct"] == 100
    assert rows["graphify FULL_AND_PIECEWISE"]["steps_full_pct"] > 0 and rows["graphify FULL_AND_PIECEWISE"]["steps_piecewise_pct"] > 0
    assert "CPU-only" in serving.render(result)
