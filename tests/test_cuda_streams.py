"""CUDA-only: a call copies and replays on the caller's current stream."""

import pytest
import torch

from conftest import requires_cuda
from graphify import graphify, persistent, tokens

pytestmark = [pytest.mark.cuda, requires_cuda]


def linear(x, w):
    return torch.tanh(x @ w)


def test_replay_runs_on_the_callers_current_stream():
    w = torch.randn(256, 256, device="cuda")
    g = graphify(linear, sizes=(64,), axes=(tokens(), persistent())).capture(
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
