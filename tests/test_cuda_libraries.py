"""Every CUDA library family a user may call inside a graphified function (cuFFT, cuBLAS /
cuSOLVER, cuRAND, cuSPARSE, CUB; CuPy and torch, and CuPy inside torch) is captured and
equal to eager, or rejected before CUDA sees it with an error that names the call, as
pinned per family in EXPECTED; never a crash, and the process stays usable. Each case runs
in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HAS_CUDA

CUPY = ["cupy-fft", "cupy-linalg-solve", "cupy-linalg-norm", "cupy-random", "cupy-sparse", "cupy-cub-cumsum",
        "cupy-cub-sort"]
TORCH = ["torch-fft", "torch-linalg-solve", "torch-linalg-norm", "torch-random", "torch-sparse", "torch-cub-cumsum",
         "torch-cub-sort", "torch+cupy-fft", "torch+cupy-random"]


# What each family gave on the H100 (benchmarks/results/gpu-tests-nvidia-h100-80gb-hbm3.txt, the library
# families record of commit 4f07c18; README "Library objects..."): CAPTURED, or REJECTED with the library or
# op the error must name. A family that changes outcome fails here: a capture lost (or one gained: update this
# table, the results file and the README together).
EXPECTED = {
    "cupy-fft": "CAPTURED",
    "cupy-linalg-solve": ("REJECTED", "calls cuSOLVER"),
    "cupy-linalg-norm": "CAPTURED",
    "cupy-random": ("REJECTED", "calls cuRAND"),
    "cupy-sparse": ("REJECTED", "calls cuSPARSE"),
    "cupy-cub-cumsum": "CAPTURED",
    "cupy-cub-sort": "CAPTURED",
    "torch-fft": "CAPTURED",
    "torch-linalg-solve": ("REJECTED", "aten::_linalg_check_errors"),  # use torch.linalg.solve_ex
    "torch-linalg-norm": "CAPTURED",
    "torch-random": "CAPTURED",
    "torch-sparse": "CAPTURED",
    "torch-cub-cumsum": "CAPTURED",
    "torch-cub-sort": "CAPTURED",
    "torch+cupy-fft": "CAPTURED",
    "torch+cupy-random": ("REJECTED", "calls cuRAND"),
}


def test_every_family_has_an_expected_outcome():
    assert set(EXPECTED) == set(CUPY + TORCH)


def has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("case", CUPY + TORCH)
def test_library_family_is_captured_or_rejected_never_a_crash(case):
    if "cupy" in case and not has_cupy():
        pytest.skip("needs CuPy")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, str(root / "tests" / "library_cases.py"), case], env=env,
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{case}: exit {done.returncode} (a negative code is a crash)\n{out[-3000:]}"
    assert "USABLE" in done.stdout, out[-3000:]
    outcomes = [ln for ln in done.stdout.splitlines() if ln.startswith(("CAPTURED", "REJECTED"))]
    assert len(outcomes) == 1, out[-3000:]
    line, want = outcomes[0], EXPECTED[case]
    if want == "CAPTURED":
        assert line == "CAPTURED", f"{case}: captured on the H100 before, now: {line[:1000]}"
    else:
        assert line.startswith("REJECTED"), f"{case}: rejected on the H100 before, now: {line[:1000]}"
        assert want[1] in line, f"{case}: the error should name {want[1]!r}: {line[:1000]}"
        assert "graphify(" in line and "out of the graphified function" in line, line
    print(case, [ln[:300] for ln in done.stdout.splitlines()])
