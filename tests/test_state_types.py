"""Python state of registered types (`graphify.reads.stateful_types`): graphs per branch, the state
advanced after each replay, and `per_call` computed once a call for all objects of a type."""

from __future__ import annotations

import pytest
import torch

from graphify import Mode, Options, graphify
from graphify.reads.stateful_types import _REGISTRY
from graphify.extend import StateType, register_state_type


class Window:
    """A Python counter that picks what a call does (as a sliding-window cache layer's)."""

    def __init__(self):
        self.seen = 0


def shifted(x, windows):
    out = x * 2 + sum(float(w.seen >= 4) for w in windows)  # a constant of the graph, per branch
    for w in windows:
        w.seen += x.shape[0]
    return out


@pytest.fixture
def registered():
    reads = []

    def per_call(call):
        reads.append(call["x"].shape[0])
        return call["x"].shape[0]

    register_state_type(Window, StateType(("seen",), lambda w, q: w.seen >= 4, lambda w, q: (w.seen + q,), per_call))
    try:
        yield reads
    finally:
        _REGISTRY.pop(Window, None)


def test_graphs_follow_a_registered_counter_reading_the_call_once(backend, registered):
    name, device = backend
    g = graphify(shifted, options=Options(backend=name))
    windows, twins = [Window(), Window()], [Window(), Window()]
    for _ in range(3):  # warm-up, capture and replay of the first branch
        x = torch.randn(2, 3, device=device)
        torch.testing.assert_close(g(x, windows), shifted(x, twins))
    registered.clear()
    for _ in range(5):  # the second branch, then its replays: the counter advanced by each
        x = torch.randn(2, 3, device=device)
        torch.testing.assert_close(g(x, windows), shifted(x, twins))
        assert [w.seen for w in windows] == [w.seen for w in twins]
    assert registered == [2] * 5  # once a call, not once an object
    stats = {r.mode: r.calls for r in g.stats.by_mode()}
    assert stats[Mode.FULL] >= 5, stats
