"""The serving-trace benchmark runs end to end (a small trace; CPU: the tiny model on the
simulation backend; GPU: its own model, without the peer-compared configurations' own
processes, which compile for minutes)."""

import pytest
import torch

from benchmarks import serving


def test_every_mode_runs_the_trace_and_matches_eager(monkeypatch):
    monkeypatch.setattr(serving, "in_own_process", lambda *args, **kwargs: None)  # GPU only: a failed run's rows left out
    # on the GPU the batch-8 decode rows take 8 requests of 256 tokens of KV blocks, and the
    # cache is sized from the trace: a 6-request trace has too few blocks for them
    result = serving.run(num_requests=16 if torch.cuda.is_available() else 6, seed=3)
    gpu = result["env"]["gpu"]
    assert gpu == torch.cuda.is_available()
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {f"graphify {m}" for m in serving.MODES}
    tol = 0.25 if gpu else 1e-4  # bfloat16 on the GPU, and padded rows change the matrix products' sums
    for r in rows.values():
        assert r["max_err_vs_eager"] < tol and r["tokens_per_s"] > 0, r
        assert abs(r["steps_full_pct"] + r["steps_piecewise_pct"] + r["steps_none_pct"] - 100) < 1e-6
    # what the steps ran as, per mode: every step of the trace fits the captured sizes, and
    # only decode steps (one token per request) are uniform
    trace = result["trace"]
    decode = 100 * trace["step_kinds"]["decode"] / trace["steps"]
    assert 0 < decode < 100
    ran = {m: (rows[f"graphify {m}"]["steps_full_pct"], rows[f"graphify {m}"]["steps_piecewise_pct"],
               rows[f"graphify {m}"]["steps_none_pct"]) for m in serving.MODES}
    expected = {"NONE": (0, 0, 100), "PIECEWISE": (0, 100, 0), "FULL": (100, 0, 0),
                "FULL_DECODE_ONLY": (decode, 0, 100 - decode), "FULL_AND_PIECEWISE": (decode, 100 - decode, 0)}
    assert set(ran) == set(expected)
    for mode, shares in expected.items():  # pytest.approx compares flat containers only (pytest 9.2 refuses nested ones)
        assert ran[mode] == pytest.approx(shares), mode
    for r in rows.values():
        total_ms = trace["tokens"] / r["tokens_per_s"] * 1e3  # every timed step lands in its kind
        assert sum(r["ms_by_kind"].values()) == pytest.approx(total_ms)
        assert set(r["ms_by_kind"]) == {k for k, n in trace["step_kinds"].items() if n}
    if gpu:  # the batch-8 decode step, eager and graphify, profiled
        assert [d["config"] for d in result["decode"]] == ["eager", "graphify FULL_AND_PIECEWISE"]
    text = serving.render(result)
    assert ("CPU-only" in text) is not gpu
    assert "Milliseconds per step kind" in text


def test_own_process_runs_compare_with_the_peer_in_the_same_process_kind():
    import random

    rnd = random.Random(7)

    def result(config):
        row = {"config": config, "tokens_per_s": rnd.uniform(1e4, 6e4)}
        return {"row": row, "decode": [{"config": config, "step_ms": rnd.uniform(1, 2), "host_us": rnd.uniform(20, 500)}]}

    names = serving.OWN_PROCESS
    runs = [(w, p, result(names[w])) for w in names for p in ("1st", "2nd")]
    runs[1] = ("graphify", "2nd", None)  # a failed process leaves its rows out, nothing else
    rows = [{"config": "graphify FULL", "tokens_per_s": 1.0}]
    decode = [{"config": "graphify FULL_AND_PIECEWISE", "step_ms": 2.0, "host_us": 30.0},
              {"config": "eager", "step_ms": 9.0, "host_us": 9000.0}]
    serving.merge_own_processes(rows, decode, runs)
    peer = {p: r for w, p, r in runs if w == "ro"}
    assert len(rows) == 1 + 5 and "tokens_vs_reduce_overhead" not in rows[0]
    for r in rows[1:]:
        want = r["tokens_per_s"] / peer[r["process"]]["row"]["tokens_per_s"]
        assert abs(r["tokens_vs_reduce_overhead"] - want) < 1e-12
    assert [d["config"] for d in decode[:3]] == ["eager", names["ro"], names["ro"]]
    for d in decode:
        ro = peer[d.get("process", "1st")]["decode"][0]
        assert abs(d["step_vs_reduce_overhead"] - d["step_ms"] / ro["step_ms"]) < 1e-12
        assert abs(d["host_vs_reduce_overhead"] - d["host_us"] / ro["host_us"]) < 1e-12
    assert {d.get("process") for d in decode} == {None, "1st", "2nd"}
    text = serving.render({"env": {"gpu": True}, "rows": rows, "decode": decode,
                           "trace": {"requests": 6, "seed": 3, "steps": 9, "tokens": 99, "max_batch_tokens": 64,
                                     "step_kinds": {}},
                           "ratios": {"fp_vs_piecewise": 1.0, "fp_vs_none": 2.0}})
    assert text.count("| 2nd |") == 4 and text.count("| 1st |") == 6  # 2 + 3 rows, 2 + 3 decode rows


def test_the_sizes_that_get_their_own_compile_start_where_asked():
    from benchmarks._serving_trace import SPECIALISE_FROM, Setup

    sizes = (16, 32, 256, 288, 512)
    assert Setup(False, 4, 1).compile_sizes(sizes) == tuple(s for s in sizes if s >= SPECIALISE_FROM)
    assert Setup(False, 4, 1, specialise_from=288).compile_sizes(sizes) == (288, 512)
    assert Setup(False, 4, 1, specialise_from=1024).compile_sizes(sizes) == ()
