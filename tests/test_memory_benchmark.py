"""The memory benchmark runs end to end (CPU: the tiny decoder on the simulation backend;
GPU: its own model and the CuPy rows, at small sizes) and its capture orders all agree with
eager, every checked call a replay of the captured graphs."""

import torch

from benchmarks import memory
from conftest import calls_by_mode, replayed


def test_every_configuration_is_measured_and_matches_eager(monkeypatch):
    checked = {}
    measure = memory.measure

    def counting(name, build, check):  # each configuration's check, and what its calls ran as
        def counted_check(graphs):
            err = check(graphs)
            calls = sum(sum(calls_by_mode(g).values()) for g in graphs)
            checked[name] = (calls, sum(replayed(g) for g in graphs))
            return err
        return measure(name, build, counted_check)

    monkeypatch.setattr(memory, "measure", counting)
    result = memory.run(max_size=8)
    gpu = result["env"]["gpu"]
    assert gpu == torch.cuda.is_available()
    rows = {r["config"]: r for r in result["rows"]}
    assert {"decode: one pool, largest first", "decode: one pool, smallest first", "decode: a pool per size",
            "draft + target: one shared pool", "draft + target: a pool each"} <= set(rows)
    sizes = len(result["config"]["sizes"])
    assert rows["decode: a pool per size"]["pools"] == sizes and rows["decode: one pool, largest first"]["pools"] == 1
    assert rows["draft + target: one shared pool"]["graphs"] == 2 * sizes
    assert set(checked) == set(rows)
    for name, (calls, replays) in checked.items():
        assert calls > 0 and replays == calls, (name, calls, replays)  # every checked call replayed a graph
    for i, r in enumerate(rows.values()):
        assert r["max_err"] < 1e-4, r
        if r["left_after_drop_mib"] is None:  # the CuPy rows: their pools' own counts are the measure
            assert gpu and r["config"].startswith("CuPy"), r
        elif gpu and i == 0:  # a process's first capture makes its capture stream's cuBLAS workspace, once
            assert r["left_after_drop_mib"] <= 64, r
        else:
            assert r["left_after_drop_mib"] == 0, r
    assert ("CPU-only" in memory.render(result)) is not gpu
