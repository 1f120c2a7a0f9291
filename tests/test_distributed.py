"""Tensor parallelism on torch.distributed (gloo, two CPU processes, simulation backend):
TP graphs equal the single-process model, capture plans and per-call graphs are agreed
across ranks, and a disagreement is an error on every rank instead of a hang."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
ROOT = Path(__file__).resolve().parent.parent
WORLD = 2


def run_ranks(scenario: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(ROOT / "tests" / "tp_worker.py"), scenario, str(r), str(WORLD), str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for r in range(WORLD)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        assert line is not None, f"rank exited {p.returncode} without a result:\n{err[-3000:]}"
        results.append(json.loads(line[len("RESULT "):]))
    for r in results:
        assert "crash" not in r, r["crash"]
    return results


def test_tensor_parallel_graphs_equal_the_single_process_model():
    for rank in run_ranks("equal"):
        for mode in ("FULL", "FULL_AND_PIECEWISE"):
            assert rank[mode]["max_err"] < 1e-4, (mode, rank[mode])
        assert rank["FULL_AND_PIECEWISE"]["modes"].get("PIECEWISE", 0) > 0  # collectives inside pieces too
        assert rank["FULL_AND_PIECEWISE"]["modes"].get("FULL", 0) > 0


def test_ranks_planning_different_graphs_fail_together():
    for rank in run_ranks("plan_mismatch"):
        assert rank["error"] == "CaptureError"
        assert "ranks disagree on what to capture" in rank["message"] and "same mode, sizes" in rank["message"]


def test_a_rank_whose_capture_is_rejected_early_does_not_leave_the_others_waiting():
    rank0, rank1 = run_ranks("prepare_fails_on_one_rank")
    assert rank1["error"] == "ValueError" and "axes has 6 entries" in rank1["message"]
    assert rank0["error"] == "CaptureError" and "rank 1 could not prepare its capture" in rank0["message"]


def test_ranks_choosing_different_graphs_for_a_call_fail_together_and_recover():
    for rank in run_ranks("call_mismatch"):
        assert rank["mismatch"] is not None
        assert "rank 0: FULL graph for 4 tokens" in rank["mismatch"]  # 2 requests padded to 4
        assert "rank 1: FULL graph for 8 tokens" in rank["mismatch"]  # 5 requests padded to 8
        assert rank["after_ok"]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device kind nvidia-h200-x2)")
def test_tensor_parallel_cuda_graphs_with_nccl_equal_the_single_gpu_model():
    for rank in run_ranks("equal_cuda"):
        for mode in ("FULL", "FULL_AND_PIECEWISE"):
            assert rank[mode]["max_err"] < 0.1, (mode, rank[mode])  # bf16 rounding, two partial sums
        assert rank["FULL_AND_PIECEWISE"]["modes"].get("PIECEWISE", 0) > 0
