"""Dynamo's traced graphs for tests of policies that read them (`graphify.compile.shape_policy`,
`graphify.compile.layout_policy`): a recording backend, and a fixture that resets dynamo."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo


class Recording:
    """A torch.compile backend that keeps each traced graph and runs it as is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def traced(model, x, dynamic=False, inputs: tuple = ()) -> torch.fx.GraphModule:
    """The last graph dynamo traced of `model(x)`, or of `model(*inputs)` (without grad, as
    inference runs)."""
    rec = Recording()
    with torch.no_grad():
        torch.compile(model, backend=rec, dynamic=dynamic)(*(inputs or (x,)))
    return rec.graphs[-1]
