"""CUDA-only replay details: the direct cudaGraphLaunch path, and streams."""

import importlib.util

import pytest
import torch

from conftest import requires_cuda
from graphify import graphify, persistent, tokens

pytestmark = [pytest.mark.cuda, requires_cuda]
HAS_CUDA_PYTHON = importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None


def linear(x, w):
    return torch.tanh(x @ w)


@pytest.mark.skipif(not HAS_CUDA_PYTHON, reason="needs cuda-python (cuda.bindings) for the direct launch path")
def test_graphs_without_random_ops_launch_directly_and_random_ones_through_torch():
    w = torch.randn(16, 16, device="cuda")
    plain = graphify(linear, sizes=(4,), axes=(tokens(), persistent()), progress=False).capture(
        torch.randn(4, 16, device="cuda"), w
    )
    noisy = graphify(lambda x: x + torch.randn_like(x), sizes=(4,), progress=False).capture(torch.randn(4, 16, device="cuda"))
    (p_entry,), (n_entry,) = list(plain.table), list(noisy.table)
    assert p_entry.replay != p_entry.graph.replay
    assert n_entry.replay == n_entry.graph.replay


def test_replay_runs_on_the_callers_current_stream():
    w = torch.randn(256, 256, device="cuda")
    g = graphify(linear, sizes=(64,), axes=(tokens(), persistent()), progress=False).capture(
        torch.randn(64, 256, device="cuda"), w
    )
    side = torch.cuda.Stream()
    x = torch.randn(64, 256, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(20):
            out = g(x, w)
        kept = out.clone()
    side.synchronize()
    assert torch.equal(kept, linear(x, w))
