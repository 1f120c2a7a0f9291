"""CUDA-only faults: a real out-of-memory while capturing (device squeezed by a large
allocation) gives a clear error, leaks nothing, and leaves torch able to capture again."""

import gc

import pytest
import torch

from conftest import requires_cuda
from graphify import CaptureError, Pool, graphify, persistent, tokens

pytestmark = [pytest.mark.cuda, requires_cuda]
MiB = 1 << 20


def wide(x, w):
    return torch.relu(x @ w).sum(dim=1, keepdim=True) * x


def test_real_out_of_memory_during_capture():
    w = torch.randn(256, 65536, device="cuda")  # at 4096 tokens x @ w is 1 GiB
    x = torch.randn(8, 256, device="cuda")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - 700 * MiB, dtype=torch.uint8, device="cuda")  # leave ~700 MiB
    try:
        allocated = torch.cuda.memory_allocated()
        g = graphify(wide, mode="FULL", sizes=(64, 4096), axes=(tokens(), persistent()), pool=Pool("squeezed"))
        with pytest.raises(CaptureError) as info:
            g.capture(x, w)
        msg = str(info.value)
        assert "graphify(wide" in msg and "OutOfMemoryError" in msg
        assert "fewer sizes or a smaller maximum" in msg and "still works" in msg
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - allocated <= MiB  # no graph or buffer memory kept
        torch.testing.assert_close(g(x, w), wide(x, w))  # the callable captured from still works
        smaller = graphify(wide, mode="FULL", sizes=(8, 64), axes=(tokens(), persistent()))
        smaller = smaller.capture(x, w)
        torch.testing.assert_close(smaller(x, w), wide(x, w))  # torch can still capture: nothing poisoned
    finally:  # give the squeezed memory back to the device, not just to torch's cache
        del hog
        gc.collect()
        torch.cuda.empty_cache()
