"""CUDA + CuPy: CuPy functions captured by the cupy backend, torch+CuPy functions captured
by the cuda backend, CuPy pool reports against CuPy's own counters, memory returned. (The
torch-only pool report test is in test_cuda_memory.py: it runs without CuPy.)"""

import gc
import time

import pytest
import torch

from conftest import calls_by_mode, counted, requires_cuda
from graphify import Pool, UnsupportedOpError, graphify, persistent, tokens

cp = pytest.importorskip("cupy", reason="needs CuPy (pip install 'graphify[cuda12]' or '[cuda13]')")
pytestmark = [pytest.mark.cuda, requires_cuda]

MiB = 1 << 20
SIZES = (1, 2, 4, 8, 16, 32)

_scale_rows = None
_spin = None
SPIN_CYCLES = 2_000_000_000  # some 1 s at an H100's clocks, far longer than 20 warm calls take to issue


def spin_kernel():
    """A RawKernel that holds its stream for `cycles` clock cycles (CuPy's torch.cuda._sleep)."""
    global _spin
    if _spin is None:
        _spin = cp.RawKernel(
            r'''
            extern "C" __global__ void spin(long long cycles) {
                long long start = clock64();
                while (clock64() - start < cycles) {}
            }''',
            "spin",
        )
    return _spin


def scale_rows_kernel():
    """A RawKernel: out[i, j] = x[i, j] * s[i] (so the reduction feeds custom code)."""
    global _scale_rows
    if _scale_rows is None:
        _scale_rows = cp.RawKernel(
            r'''
            extern "C" __global__ void scale_rows(const float* x, const float* s, float* out, int rows, int cols) {
                int i = blockIdx.x * blockDim.x + threadIdx.x;
                if (i < rows * cols) out[i] = x[i] * s[i / cols];
            }''',
            "scale_rows",
        )
    return _scale_rows


def cupy_fn(x, w):
    """Elementwise + reduction + a RawKernel, all CuPy (no cuBLAS: CuPy won't capture it)."""
    h = cp.tanh(x[:, :, None] * w[None]).sum(axis=1)
    norm = cp.sqrt((h * h).sum(axis=1) + 1e-6)
    out = cp.empty_like(h)
    rows, cols = h.shape
    scale_rows_kernel()(((rows * cols + 127) // 128,), (128,), (h, 1.0 / norm, out, cp.int32(rows), cp.int32(cols)))
    return out


def mixed_fn(x, w):
    """torch matmul, a CuPy elementwise step and a RawKernel, and torch again."""
    h = torch.relu(x @ w)
    hc = cp.from_dlpack(h)
    norm = cp.sqrt((hc * hc).sum(axis=1) + 1e-6)
    out = cp.empty_like(hc)
    rows, cols = hc.shape
    scale_rows_kernel()(((rows * cols + 127) // 128,), (128,), (hc, 1.0 / norm, out, cp.int32(rows), cp.int32(cols)))
    return torch.from_dlpack(out) + 1


def cupy_matmul(x, w):
    return x @ w


def test_cupy_matmul_is_rejected_with_advice_and_the_callable_still_works():
    rs = cp.random.RandomState(4)
    w = rs.standard_normal((8, 8), dtype=cp.float32)
    g = graphify(cupy_matmul, mode="FULL", sizes=(2, 4), axes=(tokens(), persistent()))
    with pytest.raises(UnsupportedOpError, match="backend='cuda'"):
        g.capture(rs.standard_normal((2, 8), dtype=cp.float32), w)
    x = rs.standard_normal((3, 8), dtype=cp.float32)
    cp.testing.assert_allclose(g(x, w), x @ w)  # uncaptured: eager, unchanged
    assert calls_by_mode(g) == counted(none=1)


def capture_cupy(pool=None):
    rs = cp.random.RandomState(0)
    w = rs.standard_normal((64, 128), dtype=cp.float32)
    g = graphify(cupy_fn, mode="FULL", sizes=SIZES, axes=(tokens(), persistent()), pool=pool)
    return g.capture(rs.standard_normal((3, 64), dtype=cp.float32), w), w


def test_cupy_function_equals_eager_at_every_size():
    g, w = capture_cupy()
    assert g.table.backend.name == "cupy" and g.table.library == "cupy"
    rs = cp.random.RandomState(1)
    for n in (*range(1, 33), 40):
        x = rs.standard_normal((n, 64), dtype=cp.float32)
        got = g(x, w)
        assert isinstance(got, cp.ndarray) and got.shape == (n, 128)
        cp.testing.assert_allclose(got, cupy_fn(x, w), rtol=1e-5, atol=1e-5)
    assert calls_by_mode(g) == counted(full=32, none=1)  # 1 to 32 rows replayed, 40 eagerly


def test_cupy_replay_runs_on_the_callers_cupy_stream():
    """The caller's CuPy stream (not blocking with the default one) spins, then writes the
    input: a call whose copies or replay ran on another stream reads the input before that
    write (or hands back an output the caller's stream copies before it is made), and a call
    that waited on the host would return only after the spin."""
    g, w = capture_cupy()
    new = cp.random.RandomState(2).standard_normal((16, 64), dtype=cp.float32)
    want = cupy_fn(new, w)
    x = cp.zeros((16, 64), dtype=cp.float32)
    side = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with side:  # every kernel of the timed part once (CuPy compiles a kernel on its first launch)
        spin_kernel()((1,), (1,), (cp.int64(1),))
        x[...] = new
        g(x, w).copy()
        x[...] = 0
    cp.cuda.Device().synchronize()
    with side:
        spin_kernel()((1,), (1,), (cp.int64(SPIN_CYCLES),))
        x[...] = new  # the input, written on the caller's stream once the spin is over
        t0 = time.perf_counter()
        for _ in range(20):
            out = g(x, w)
        kept = out.copy()
        issued = time.perf_counter() - t0
        assert not side.done, f"{issued:.3f} s to issue"  # still spinning: the calls returned without waiting for it
    assert cp.cuda.Stream.null.done  # nothing was queued behind the spin on the default stream
    side.synchronize()
    cp.testing.assert_allclose(kept, want, rtol=1e-5, atol=1e-5)  # copies and replays in order on the stream
    assert calls_by_mode(g) == counted(full=1 + 20)


def test_mixed_torch_and_cupy_function_is_captured_by_the_cuda_backend():
    w = torch.randn(64, 128, device="cuda")
    g = graphify(mixed_fn, mode="FULL", sizes=SIZES, axes=(tokens(), persistent()))
    g = g.capture(torch.randn(3, 64, device="cuda"), w)
    assert g.table.backend.name == "cuda"
    for n in (1, 5, 16, 32, 33):
        x = torch.randn(n, 64, device="cuda")
        torch.testing.assert_close(g(x, w), mixed_fn(x, w), rtol=1e-5, atol=1e-5)
    assert calls_by_mode(g) == counted(full=4, none=1)  # 33 rows: above the largest size, eager


def test_cupy_pool_report_matches_cupy_counters_and_memory_returns():
    default = cp.get_default_memory_pool()
    base_used = default.used_bytes()
    pool = Pool("cupy")
    g1, w = capture_cupy(pool)
    g2, _ = capture_cupy(pool)  # a second function in the same pool (draft + target)
    report = pool.report()
    handle = pool._handle
    assert report.backend == "cupy" and len(report.per_graph) == 2 * len(SIZES)
    assert report.reserved_bytes == handle.total_bytes() and report.used_bytes == handle.used_bytes()
    assert abs(report.total_bytes - handle.total_bytes()) <= MiB
    del g1, g2
    gc.collect()
    pool.trim()
    after = pool.report()
    assert after.per_graph == () and after.reserved_bytes == 0 and handle.total_bytes() == 0
    del w
    gc.collect()
    assert default.used_bytes() - base_used <= MiB  # static buffers returned too


def test_a_failed_capture_into_a_pool_leaves_its_live_graphs_memory_alone():
    """A capture that fails trims its pool; CuPy's trim frees every free block, and a live
    graph's working memory is such blocks: fresh arrays made after it would be overwritten by
    the next replay. Filled before and checked after replays, and the replays equal eager."""
    pool = Pool("shared")
    g, w = capture_cupy(pool)
    reserved = pool.report().reserved_bytes
    rs = cp.random.RandomState(5)
    failing = graphify(cupy_matmul, mode="FULL", sizes=(2, 4), axes=(tokens(), persistent()), pool=pool)
    with pytest.raises(UnsupportedOpError):
        failing.capture(rs.standard_normal((2, 64), dtype=cp.float32), w[:, :64].copy())
    assert pool.report().reserved_bytes >= reserved  # nothing of the live graphs' given back
    fresh = [cp.full((1 << 20,), 7.0, dtype=cp.float32) for _ in range(8)]
    for n in (3, 16, 32, 1):
        x = rs.standard_normal((n, 64), dtype=cp.float32)
        cp.testing.assert_allclose(g(x, w), cupy_fn(x, w), rtol=1e-5, atol=1e-5)
    cp.cuda.Device().synchronize()
    assert all(bool((a == 7.0).all()) for a in fresh)
