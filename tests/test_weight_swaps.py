"""Weights swapped under a graph are never replayed stale, on CUDA and in the simulation alike.

A graph reads the storage its modules' parameters and buffers had at capture. Every way a
user swaps that storage (`p.data = new`, `load_state_dict(..., assign=True)`, a replaced
Parameter, `.to()` / `.half()`, a new tensor passed as a persistent argument) is caught on
the next call: a captured callable raises `StateChangedError` (or `PersistentSwapError`),
a first-use callable drops the graphs over the old storage and captures again, its answer
eager's throughout. The simulation would read the new storage where a GPU reads the old,
so both must refuse the replay for the same reasons: the same tests run on both.
"""

from __future__ import annotations

import pytest
import torch

from conftest import calls_by_mode, counted, replayed
from graphify import Options, PersistentSwapError, StateChangedError, graphify, persistent, tokens


def model(device) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8),
    ).to(device)


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return torch.randn(t.shape, dtype=t.dtype, device=t.device)


SWAPS = {  # each changes what the middle layer's weight reads (not the first or the last tensor)
    ".data": lambda m: setattr(m[2].weight, "data", _fresh(m[2].weight)),
    "assign=True": lambda m: m.load_state_dict({k: _fresh(v) for k, v in m.state_dict().items()}, assign=True),
    "new Parameter": lambda m: setattr(m[2], "weight", torch.nn.Parameter(_fresh(m[2].weight))),
    ".to(float64)": lambda m: m.to(torch.float64),
}


def inputs(device, dtype=torch.float32, rows=4):
    return torch.randn(rows, 16, device=device, dtype=dtype)


@pytest.mark.parametrize("how", sorted(SWAPS))
def test_a_captured_callable_refuses_to_replay_swapped_weights(backend, how):
    name, device = backend
    m = model(device)
    with torch.no_grad():
        g = graphify(m, mode="FULL", sizes=(4,), options=Options(backend=name)).capture(inputs(device))
        x = inputs(device)
        torch.testing.assert_close(g(x), m(x))
        SWAPS[how](m)
        with pytest.raises(StateChangedError, match="since capture.*capture again"):
            g(inputs(device, next(m.parameters()).dtype))
    assert calls_by_mode(g) == counted(full=1)


@pytest.mark.parametrize("how", sorted(SWAPS))
def test_first_use_captures_again_over_swapped_weights_and_answers_as_eager(backend, how):
    name, device = backend
    m = model(device)
    g = graphify(m, options=Options(backend=name))
    with torch.no_grad():
        for _ in range(3):  # a warm-up, the capture, a replay
            x = inputs(device)
            torch.testing.assert_close(g(x), m(x))
        assert replayed(g) == 2
        SWAPS[how](m)
        dtype = next(m.parameters()).dtype
        for _ in range(3):  # the stale graphs dropped: a warm-up, a capture, a replay again
            x = inputs(device, dtype)
            torch.testing.assert_close(g(x), m(x))
    assert replayed(g) == 4


def test_a_buffer_whose_storage_is_swapped_is_caught(backend):
    name, device = backend

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)
            self.register_buffer("scale", torch.randn(16))
            self.register_buffer("shift", torch.randn(16))

        def forward(self, x):
            return self.lin(x) * self.scale + self.shift

    m = Scaled().to(device)
    g = graphify(m, options=Options(backend=name))
    with torch.no_grad():
        for _ in range(3):
            x = inputs(device)
            torch.testing.assert_close(g(x), m(x))
        m.scale.data = torch.randn(16, device=device)  # a buffer between others, its storage swapped
        for _ in range(3):
            x = inputs(device)
            torch.testing.assert_close(g(x), m(x))
    assert replayed(g) == 4


def test_a_new_persistent_argument_is_captured_again_under_first_use_and_refused_after_capture(backend):
    name, device = backend

    def mlp(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    w1, w2 = torch.randn(16, 32, device=device), torch.randn(32, 16, device=device)
    axes = (tokens(), persistent(), persistent())
    g = graphify(mlp, axes=axes, options=Options(backend=name))
    for weights in ((w1, w2), (torch.randn(16, 32, device=device), w2)):
        for _ in range(3):
            x = inputs(device)
            torch.testing.assert_close(g(x, *weights), mlp(x, *weights))
    assert replayed(g) == 4
    captured = graphify(mlp, mode="FULL", sizes=(4,), axes=axes, options=Options(backend=name)).capture(x, w1, w2)
    with pytest.raises(PersistentSwapError, match="different tensor"):
        captured(x, torch.randn(16, 32, device=device), w2)


def test_weights_swapped_back_and_forth_every_call_end_up_eager_with_one_warning(backend, caplog):
    """Two weight sets alternating call by call: each swap drops the graphs; after a few,
    the calls run eagerly for good rather than capturing on every call."""
    name, device = backend
    m = model(device)
    other = {k: _fresh(v) for k, v in m.state_dict().items()}
    mine = {k: v.clone() for k, v in m.state_dict().items()}
    g = graphify(m, options=Options(backend=name))
    with torch.no_grad():
        for i in range(20):
            m.load_state_dict(other if i % 4 < 2 else mine, assign=True)
            x = inputs(device)
            torch.testing.assert_close(g(x), m(x))
    assert "these calls run eagerly from now on" in caplog.text
    assert replayed(g) <= 5
