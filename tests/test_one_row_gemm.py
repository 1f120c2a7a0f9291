"""The one-row GEMM benchmark (`benchmarks.one_row_gemm`): its shapes, its layer weighting, its
table and its CPU smoke run; and the Triton GEMV (`models._triton_gemv`) against torch: under
Triton's interpreter on the CPU (where Triton is installed), at the 8B shapes on a GPU.

Triton reads TRITON_INTERPRET when it is imported, and this process has imported it (graphify
does): the interpreted runs (the kernel's cases, the smoke run) are processes of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks import one_row_gemm as bench
from conftest import requires_cuda
from graphify.models import _triton_gemv as tg

needs_triton = pytest.mark.skipif(not tg.available(), reason="Triton is not installed (the GPU machines have it)")
ROOT = Path(__file__).resolve().parent.parent
LAYER_PARAMS = 4096 * 4096 * 2 + 1024 * 4096 * 2 + 14336 * 4096 * 3  # q, o; k, v; gate, up, down


def test_shapes_are_the_8b_weights_and_the_layer_counts_every_gemm_once():
    dims = {s.name: (s.n, s.k) for s in bench.SHAPES}
    assert dims == {"q/o": (4096, 4096), "k/v": (1024, 4096), "qkv": (6144, 4096), "gate/up": (14336, 4096),
                    "gate+up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
    for layer in (bench.LAYER, bench.FUSED_LAYER):
        assert sum(count * dims[name][0] * dims[name][1] for name, count in layer.items()) == LAYER_PARAMS
    assert sum(bench.LAYER.values()) == 7  # q, k, v, o, gate, up, down: the launches of one layer
    assert {s.name for s in bench.SMOKE_SHAPES} == set(bench.LAYER)


def rows_for(times: dict, m: int = 1) -> list[dict]:
    dims = {s.name: s for s in bench.SHAPES}
    return [{"shape": name, "n": dims[name].n, "k": dims[name].k, "m": m, "variant": variant, "us": us,
             "max_err": 1e-3, "ok": True, "error": None}
            for variant, per in times.items() for name, us in per.items()]


def test_a_layers_time_is_each_shapes_time_times_its_count_against_cublas():
    cublas = {"q/o": 10.0, "k/v": 3.0, "gate/up": 30.0, "down": 31.0, "lm_head": 250.0}
    rows = rows_for({"linear": cublas, "triton": {k: v / 2 for k, v in cublas.items()},
                     "inductor": {"q/o": 9.0}})  # a variant missing shapes has no layer time
    summary = bench.summarise(rows, bench.SHAPES, [1], ["linear", "triton", "inductor"], peak=4.8e12)
    by = {(s["group"], s["variant"]): s for s in summary}
    layer = by["layer", "linear"]
    assert layer["us"] == 2 * 10 + 2 * 3 + 2 * 30 + 31 and layer["vs_a"] == 1.0
    moved = sum(c * bench.moved_bytes(1, n, k) for c, (n, k) in
                ((2, (4096, 4096)), (2, (1024, 4096)), (2, (14336, 4096)), (1, (4096, 14336))))
    xs, ys = 6 * 4096 + 14336, 2 * 4096 + 2 * 1024 + 2 * 14336 + 4096  # x and y of the 7 calls
    assert moved == 2 * (LAYER_PARAMS + xs + ys)
    assert layer["gb_s"] == pytest.approx(moved / layer["us"] / 1e3)
    assert layer["peak_pct"] == pytest.approx(100 * layer["gb_s"] * 1e9 / 4.8e12)
    assert by["layer", "triton"]["vs_a"] == pytest.approx(0.5)
    assert by["layer", "inductor"]["us"] is None and by["layer", "inductor"]["vs_a"] is None
    assert by["token", "linear"]["us"] == pytest.approx(32 * layer["us"] + 250.0)
    assert by["layer, fused", "linear"]["us"] is None  # no qkv, gate+up times


def test_the_table_shows_every_row_its_ratio_and_why_a_variant_did_not_run():
    rows = rows_for({"linear": {"q/o": 10.0, "k/v": 3.0}, "triton": {"q/o": 8.0, "k/v": 2.5}})
    rows[-1]["ok"] = False
    rows.append({"shape": "q/o", "n": 4096, "k": 4096, "m": 1, "variant": "inductor", "us": None, "ok": None,
                 "error": "BackendCompilerFailed: no compiler"})
    for r in rows:
        r["vs_a"] = None if r["us"] is None else r["us"] / {"q/o": 10.0, "k/v": 3.0}[r["shape"]]
        r["gb_s"] = None if r["us"] is None else bench.moved_bytes(1, r["n"], r["k"]) / r["us"] / 1e3
    summary = bench.summarise(rows, bench.SHAPES, [1], ["linear", "triton", "inductor"], None)
    md = bench.render({"how": "how it was timed", "rows": rows, "summary": summary})
    lines = md.splitlines()
    assert lines[0] == "how it was timed"
    assert sum(line.startswith("| q/o |") or line.startswith("| k/v |") for line in lines) == 5
    assert any("(d) Triton GEMV" in line and "| 0.800 |" in line for line in lines)
    assert "WRONG" in md and "(c) torch.compile max-autotune at q/o M=1: BackendCompilerFailed: no compiler" in md


def test_choose_is_a_pure_function_of_the_shape_and_fills_the_gpu():
    for m in (1, 2, 4, 8, 16):
        for s in bench.SHAPES:
            config = tg.choose(m, s.n, s.k, 132)
            assert config == tg.choose(m, s.n, s.k, 132)  # a graph replays what eager chose
            assert tg.candidates(m, s.n, s.k, 132)[0] == config
            programs = -(-s.n // config.block_n) * config.split_k
            assert programs >= 264 or config.split_k == 8 or s.k // (2 * config.split_k) < 2 * config.block_k
    assert tg.choose(1, 1024, 4096, 132).split_k == 1  # k/v at one row: 512 blocks of 2 rows fill the SMs
    assert tg.choose(8, 1024, 4096, 132).split_k > 1  # at 8 rows: 32 blocks of 32 rows, split to fill them
    with pytest.raises(ValueError, match="m must be 1 to 16"):
        tg.choose(17, 4096, 4096)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        tg.GemvConfig(block_n=12, block_k=64)


def test_gemv_without_triton_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert not tg.available()
    with pytest.raises(RuntimeError, match="Triton is not installed"):
        tg.gemv(torch.randn(1, 64).bfloat16(), torch.randn(32, 64).bfloat16())


def interpreted(args: list, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python3 args` from the repository, with Triton's interpreter on from the start (Triton
    reads TRITON_INTERPRET at its import, and this process imported it: graphify does)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_smoke_run_on_the_cpu_checks_each_variant_and_writes_nothing(tmp_path):
    out = tmp_path / "smoke.json"
    interpreted(["-m", "benchmarks.one_row_gemm", "--smoke", "--cpu", "--name", "test-smoke", "--out", str(out)])
    assert not list(bench_results().glob("test-smoke*"))
    result = json.loads(out.read_text())
    assert not result["gpu"] and result["variants"] == ["linear", "triton"]
    rows = {(r["shape"], r["m"], r["variant"]): r for r in result["rows"]}
    assert len(rows) == len(bench.SMOKE_SHAPES) * 2 * 2
    for (shape, m, variant), r in rows.items():
        if variant == "triton" and not tg.available():
            assert r["error"] == "RuntimeError: Triton is not installed" and r["us"] is None, r
            continue
        assert r["error"] is None and r["ok"] and r["us"] > 0 and 0 < r["max_err"] < 0.05, r
    layer = [s for s in result["summary"] if s["group"] == "layer" and s["variant"] == "linear"]
    assert [s["m"] for s in layer] == [1, 8] and all(s["us"] > 0 and s["vs_a"] == 1.0 for s in layer)


def bench_results():
    from benchmarks import _report

    return _report.RESULTS


CASES = {  # (m, n, k, config or None for choose's): ragged N and K, splits, both paths, fp16 (m = 5)
    "choose-ragged": (1, 40, 200, None),
    "split-rows3": (3, 64, 256, dict(block_n=8, block_k=64, split_k=2, num_stages=1)),
    "split-fp16": (5, 24, 96, dict(block_n=4, block_k=32, split_k=2)),
    "dot-split4": (8, 48, 512, dict(block_n=16, block_k=64, split_k=4, num_stages=3, dot=True)),
    "dot-rows16": (16, 32, 128, dict(block_n=32, block_k=64, dot=True)),
    "dot-ragged-split": (8, 72, 160, dict(block_n=32, block_k=32, split_k=2, dot=True)),
}

# Run in a process of its own under the interpreter: each case against the fp32 product, once
# more into `out` (the same bits: the split's partials summed in a fixed order), the counters.
CASE_RUNNER = """
import json, sys, torch
from graphify.models import _triton_gemv as tg
assert tg.interpreting()
found = {}
for name, (m, n, k, config) in json.loads(sys.argv[1]).items():
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    dtype = torch.float16 if m == 5 else torch.bfloat16
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    config = config and tg.GemvConfig(**config)
    y = tg.gemv(x, w, config=config)
    ref = x.float() @ w.float().T
    out = torch.full((m, n), float("nan"), dtype=dtype)
    again = tg.gemv(x, w, out=out, config=config)
    found[name] = {"shape": list(y.shape), "dtype": str(y.dtype), "err": (y.float() - ref).abs().max().item(),
                   "top": ref.abs().max().item(), "eps": torch.finfo(dtype).eps, "into_out": again is out,
                   "same": torch.equal(out, y), "counters": sum(int(c.abs().sum()) for _, c in tg._WORKSPACES.values())}
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def interpreted_cases():
    return json.loads(interpreted(["-c", CASE_RUNNER, json.dumps(CASES)]).stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_gemv_equals_torch_under_the_interpreter(interpreted_cases, name):
    m, n, k, _ = CASES[name]
    r = interpreted_cases[name]
    assert r["shape"] == [m, n] and r["dtype"] == ("torch.float16" if m == 5 else "torch.bfloat16")
    assert r["err"] <= 2 * r["eps"] * r["top"], r  # the interpreter rounds toward zero: a whole ulp
    assert r["into_out"] and r["same"], r
    assert r["counters"] == 0, r  # every split's counter back to 0 for the next launch


@needs_triton
def test_gemv_refuses_what_it_does_not_compute():
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    with pytest.raises(ValueError, match="1 to 16 rows"):
        tg.gemv(torch.randn(17, 64).bfloat16(), w)
    with pytest.raises(ValueError, match="w must be contiguous"):
        tg.gemv(x, torch.randn(64, 32).bfloat16().T)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        tg.gemv(x.float(), w.float())
    if not tg.interpreting():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            tg.gemv(x, w)


def expect_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within a rounding of y's dtype of the fp32 product."""
    ref = x.float() @ w.float().T
    assert (y.float() - ref).abs().max().item() <= torch.finfo(y.dtype).eps * ref.abs().max().item()


@pytest.mark.cuda
@requires_cuda
@needs_triton
@pytest.mark.parametrize("m", [1, 8])
def test_gemv_equals_torch_at_the_8b_shapes(m):
    gen = torch.Generator(device="cuda").manual_seed(m)
    for s in bench.SHAPES:
        x = torch.randn(m, s.k, generator=gen, device="cuda").bfloat16()
        w = (torch.randn(s.n, s.k, generator=gen, device="cuda") / s.k ** 0.5).bfloat16()
        y = tg.gemv(x, w)
        expect_close(y, x, w)
        torch.testing.assert_close(y, F.linear(x, w), atol=0.03, rtol=0.02)
        del x, w, y
    torch.cuda.empty_cache()


@pytest.mark.cuda
@requires_cuda
@needs_triton
def test_gemv_split_over_k_replays_in_a_graph_on_fresh_inputs():
    """K split over 2 programs a block (k/v's shape): the per-block counters must be back at 0
    after every launch."""
    m, n, k = 1, 1024, 4096
    config = tg.GemvConfig(4, 1024, split_k=2)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
    x = torch.randn(m, k, device="cuda").bfloat16()
    tg.gemv(x, w, config=config)  # compiles, makes the workspace: before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [tg.gemv(x, w, config=config) for _ in range(3)]
    for _ in range(3):
        x.copy_(torch.randn(m, k, device="cuda"))
        graph.replay()
        for y in ys:
            expect_close(y, x, w)


def test_a_split_k_workspace_is_never_first_made_inside_a_capture(monkeypatch):
    """Made inside a capture, its counters would be zeroed only when that graph replays."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(tg, "_WORKSPACES", {})
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        tg._workspace(torch.device("cuda"), 8, 2)
    assert tg._WORKSPACES == {}
    cpu = torch.device("cpu")  # the interpreter's tensors: never captured
    part, counters = tg._workspace(cpu, 8, 2)
    assert part.numel() == 8 and counters.tolist() == [0, 0]
