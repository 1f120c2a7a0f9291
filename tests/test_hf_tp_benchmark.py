"""benchmarks/hf_tensor_parallel.py end to end on the tiny shape: two ranks (gloo and the
simulation backend on the CPU; NCCL and CUDA graphs on two GPUs) load a random checkpoint
with `tp_plan="auto"`, run eager TP, transformers' compile and graphify's one line, and
exit 0; graphify's tokens equal eager TP's on every rank and its decode steps replayed graphs."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads tp_plan models through accelerate")

from test_distributed import WORLD, free_port, launch, rank_env  # noqa: E402

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device kind nvidia-h200-x2)")


def run_benchmark(tmp_path, cpu: bool, timeout: float) -> dict:
    """The benchmark's ranks as plain processes in torchrun's environment (each must end by
    itself); rank 0's result as it wrote it with `--out`."""
    out, port = tmp_path / "hf-tp.json", free_port()
    cmd = [sys.executable, "-m", "benchmarks.hf_tensor_parallel", "--smoke", "--shape", "tiny", "--batches", "1",
           "--new-tokens", "4", "--model-dir", str(tmp_path / "checkpoint"), "--out", str(out),
           "--step-timeout", str(timeout - 10), *(("--cpu",) if cpu else ())]
    done = launch([cmd] * WORLD, [rank_env(r, port, cpu=cpu) for r in range(WORLD)], timeout=timeout)
    for rank, d in enumerate(done):
        assert d["returncode"] == 0, f"rank {rank} exited {d['returncode']}:\n{d['stderr'][-3000:]}"
    assert "graphify one line" in done[0]["stdout"]  # rank 0 printed the table
    return json.loads(out.read_text())


def check(result: dict) -> None:
    """Every line ran at B=1; graphify's tokens equal eager TP's on every rank, its decode
    steps replayed FULL graphs on every rank, and its target says so."""
    rows = {r["line"]: r for r in result["rows"]}
    assert set(rows) == {"eager", "hf_compile", "graphify"} and result["world"] == WORLD, result["rows"]
    assert result["checkpoint"]["weight_type"] == "DTensor", result["checkpoint"]  # transformers sharded it
    for row in rows.values():  # transformers' compile may fail under TP: its row then says why
        assert row["batch"] == 1 and (row["line"] == "hf_compile" and row["error"] or row["ms_per_token"] > 0), row
        assert row["error"] or row["first_generate_s"] > 0, row
    ours = rows["graphify"]
    assert ours["error"] is None, ours["error"]
    assert ours["tokens_equal"] and ours["tokens_equal_by_rank"] == [True] * WORLD, ours
    for modes in ours["modes_by_rank"]:
        assert modes["FULL"] > 0, ours["modes_by_rank"]
    assert ours["vs_eager"] > 0, ours
    assert result["targets"]["tokens_equal"]["met"] is True, result["targets"]
    assert rows["eager"]["error"] is None and rows["eager"]["tokens_equal"], rows["eager"]


def test_the_hf_tensor_parallel_benchmark_runs_on_two_gloo_ranks(tmp_path):
    result = run_benchmark(tmp_path, cpu=True, timeout=120)
    check(result)
    compiled = {r["line"]: r for r in result["rows"]}["hf_compile"]
    # on the CPU transformers does not compile generate() (its criteria: a cuda/xpu/... device)
    assert compiled["error"] is None and compiled["compiled"] is False, compiled
    assert "only on cuda" in compiled["compile_note"], compiled
    assert not result["env"]["gpu"]


@pytest.mark.cuda
@two_gpus
def test_the_hf_tensor_parallel_benchmark_runs_on_two_nccl_gpus(tmp_path):
    result = run_benchmark(tmp_path, cpu=False, timeout=300)
    check(result)
    compiled = {r["line"]: r for r in result["rows"]}["hf_compile"]
    # transformers' compile under TP on GPUs: it compiled, or the row says why it could not
    assert compiled["compiled"] or compiled["error"], compiled
