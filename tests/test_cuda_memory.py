"""CUDA-only memory behaviour: weak outputs let all sizes share the largest one's memory;
pool reports against torch's allocator (no CuPy needed)."""

import gc

import pytest
import torch

from conftest import calls_by_mode, counted, requires_cuda
from graphify import Options, Pool, graphify, persistent, tokens

pytestmark = [pytest.mark.cuda, requires_cuda]

MiB = 1 << 20


def wide(x, w):
    """Its output is all the memory it needs (no intermediates): kept outputs of every size
    pile up in the pool, while weak ones let smaller sizes reuse the largest one's block.
    (With intermediates as large as the output, freed intermediates of a larger size hold
    a smaller size's output and the two settings reserve the same.)"""
    return x @ w


def capture(weak: bool, w):
    g = graphify(wide, mode="FULL", sizes=(64, 128, 256, 512), axes=(tokens(), persistent()),
                 options=Options(weak_outputs=weak), pool=Pool(f"weak={weak}"))
    return g.capture(torch.randn(4, 256, device="cuda"), w)


def test_weak_outputs_use_less_pool_memory_and_stay_correct():
    w = torch.randn(256, 16384, device="cuda")  # the output at 512 tokens: 32 MiB
    strong = capture(False, w)
    weak = capture(True, w)
    kept, shared = strong.pool.report(), weak.pool.report()
    out = 512 * 16384 * 4
    workspace = 32 << 20  # cuBLAS's, allocated inside each pool (graphify.backends.keepalive): at most 32 MiB on Hopper
    assert kept.reserved_bytes >= out * 1.8  # 512 + 256 + 128 + 64 rows of output kept
    assert shared.reserved_bytes <= out * 1.2 + workspace  # one block, reused by every size
    print(f"weak outputs: pool {shared.reserved_bytes / 2**20:.0f} MiB vs {kept.reserved_bytes / 2**20:.0f} MiB")
    for n in (64, 128, 256, 512):  # replays of every size still see their own outputs
        x = torch.randn(n, 256, device="cuda")
        assert torch.equal(weak(x, w), wide(x, w))
    for n in (3, 100):  # padded: another matmul shape, so equal up to rounding
        x = torch.randn(n, 256, device="cuda")
        torch.testing.assert_close(weak(x, w), wide(x, w), rtol=1e-3, atol=1e-3)
    assert calls_by_mode(weak) == counted(full=6)  # every call replayed a graph


def test_memory_returns_after_the_callable_is_dropped():
    w = torch.randn(256, 4096, device="cuda")
    capture(True, w)  # first capture on this device: CUDA and cuBLAS set themselves up
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    g = capture(True, w)
    g(torch.randn(5, 256, device="cuda"), w)
    assert g.pool.report().reserved_bytes >= 512 * 4096 * 4  # the graphs hold pool memory
    del g
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() - base <= 1 << 20


def relu_matmul(x, w):
    return torch.relu(x @ w) * 2


def test_torch_pool_report_matches_torch_allocator_and_memory_returns():
    w = torch.randn(256, 4096, device="cuda")
    graphify(relu_matmul, mode="FULL", sizes=(8,), axes=(tokens(), persistent())).capture(
        torch.randn(4, 256, device="cuda"), w
    )  # the capture stream's cuBLAS workspace is made once per process: not part of what is measured
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    pool = Pool("torch")
    g = graphify(relu_matmul, mode="FULL", sizes=(64, 128, 256), axes=(tokens(), persistent()),
                 pool=pool).capture(torch.randn(4, 256, device="cuda"), w)
    report = pool.report()
    assert report.backend == "cuda" and report.reserved_bytes > 0
    assert abs(report.total_bytes - report.reserved_bytes) <= MiB  # per-graph deltas vs allocator segments
    released = g.release()
    gc.collect()
    pool.trim()
    assert pool.report().reserved_bytes == 0
    assert torch.cuda.memory_reserved() - base <= 2 * MiB  # static buffers of `released` may stay until dropped
    del released
