"""CUDA-only: a call copies and replays on the caller's current stream."""

import pytest
import torch

from conftest import calls_by_mode, counted, requires_cuda
from graphify import graphify, persistent, tokens

pytestmark = [pytest.mark.cuda, requires_cuda]

SLEEP_CYCLES = 1_000_000_000  # torch.cuda._sleep: some 0.5 s at an H100's clocks, far longer than 20 warm calls take


def linear(x, w):
    return torch.tanh(x @ w)


def test_replay_runs_on_the_callers_current_stream():
    """The caller's stream sleeps, then writes the input: a call whose copies or replay ran
    on another stream (without waiting for the caller's) reads the input before that write,
    and a call that waited on the host would return only after the sleep."""
    w = torch.randn(256, 256, device="cuda")
    g = graphify(linear, sizes=(64,), axes=(tokens(), persistent())).capture(
        torch.randn(64, 256, device="cuda"), w
    )
    x = torch.zeros(64, 256, device="cuda")
    new = torch.randn(64, 256, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):  # every kernel of the timed part once
        torch.cuda._sleep(1)
        g(x, w).clone()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.copy_(new)  # the input, written on the caller's stream once the sleep is over
        for _ in range(20):
            out = g(x, w)
        kept = out.clone()
        assert not side.query()  # still asleep: every call returned without waiting for the device
    assert torch.cuda.default_stream().query()  # nothing was queued behind the sleep on the default stream
    side.synchronize()
    assert torch.equal(kept, linear(new, w))  # the copies and replays ran after the caller's write, in order
    assert calls_by_mode(g) == counted(full=1 + 20)
