"""Library objects a graph launches outlive every cache that could free them: cuFFT plans
evicted from CuPy's or torch's plan cache, torch's cuBLAS workspaces cleared (as
torch.compile's graph trees do) while graphs that use them live. Each case runs in a
process of its own (before graphify kept these alive they were segfaults) and must print
SURVIVED, with every replay equal to eager. CPU: the pin and the plan recorder are tested
with fakes in tests/test_keepalive.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HAS_CUDA

CASES = ["cupy-fft-evicted", "torch-fft-evicted", "torch-fft-evicted-first-use", "cublas-workspace-cleared"]


def run_case(case: str, **env_extra) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env_extra}
    return subprocess.run([sys.executable, str(root / "tests" / "eviction_cases.py"), case], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("case", CASES)
def test_evicted_library_objects_stay_alive_for_their_graphs(case):
    if case.startswith("cupy"):
        pytest.importorskip("cupy")
    done = run_case(case)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{case}: exit {done.returncode} (a negative code is a crash)\n{out[-3000:]}"
    assert "SURVIVED" in done.stdout, out[-3000:]
    if case.startswith("torch-fft"):
        assert "PINNED-THEN-RESTORED" in done.stdout and "clear() skipped" in done.stderr, out[-3000:]
