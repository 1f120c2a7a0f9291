"""CUDA-only memory behaviour: weak outputs let all sizes share the largest one's memory."""

import pytest
import torch

from conftest import requires_cuda
from graphify import Options, Pool, graphify, persistent, tokens

pytestmark = [pytest.mark.cuda, requires_cuda]


def wide(x, w):
    """An output three times the size of each intermediate: kept outputs outgrow the
    memory the intermediates free, so only weak outputs let sizes share."""
    h = torch.relu(x @ w)
    return torch.cat([h, h * 2, h * 3], dim=1)


def capture(weak: bool, w):
    g = graphify(wide, mode="FULL", sizes=(64, 128, 256, 512), axes=(tokens(), persistent()),
                 options=Options(weak_outputs=weak), pool=Pool(f"weak={weak}"))
    return g.capture(torch.randn(4, 256, device="cuda"), w)


def test_weak_outputs_use_less_pool_memory_and_stay_correct():
    w = torch.randn(256, 4096, device="cuda")
    strong = capture(False, w)
    weak = capture(True, w)
    assert weak.pool.report().reserved_bytes < strong.pool.report().reserved_bytes
    for n in (64, 128, 256, 512):  # replays of every size still see their own outputs
        x = torch.randn(n, 256, device="cuda")
        assert torch.equal(weak(x, w), wide(x, w))
    for n in (3, 100):  # padded: another matmul shape, so equal up to rounding
        x = torch.randn(n, 256, device="cuda")
        torch.testing.assert_close(weak(x, w), wide(x, w), rtol=1e-3, atol=1e-3)


def test_memory_returns_after_the_callable_is_dropped():
    w = torch.randn(256, 4096, device="cuda")
    capture(True, w)  # first capture on this device: cuBLAS's workspace for the capture stream stays
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    g = capture(True, w)
    g(torch.randn(5, 256, device="cuda"), w)
    assert torch.cuda.memory_reserved() > base
    del g
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() - base <= 1 << 20
