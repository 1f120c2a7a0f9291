"""The memory benchmark runs end to end on the simulation backend (small sizes) and its
capture orders all agree with eager."""

import pytest
import torch

from benchmarks import memory


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="on a GPU this is the benchmark itself (python -m benchmarks.memory), not a test; it checks the CPU run",
)
def test_every_configuration_is_measured_and_matches_eager():
    result = memory.run(max_size=8)
    rows = {r["config"]: r for r in result["rows"]}
    assert {"decode: one pool, largest first", "decode: one pool, smallest first", "decode: a pool per size",
            "draft + target: one shared pool", "draft + target: a pool each"} <= set(rows)
    sizes = len(result["config"]["sizes"])
    assert rows["decode: a pool per size"]["pools"] == sizes and rows["decode: one pool, largest first"]["pools"] == 1
    assert rows["draft + target: one shared pool"]["graphs"] == 2 * sizes
    for r in rows.values():
        assert r["max_err"] < 1e-4 and r["left_after_drop_mib"] == 0
    assert "CPU-only" in memory.render(result)
