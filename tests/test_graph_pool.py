"""A pool's graph pool id: kept while graphs of it live, renewed when they are all gone, and
renewed after a capture into it raised (torch 2.11 then leaves the id routed: a later capture
into it fails "already recording to mempool_id"). The simulation refuses what torch refuses."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

from conftest import requires_cuda
from graphify.backends import sim, torch_cuda
from graphify.backends.graph_pool import GraphPool


class Graph:
    """Something a pool counts while it lives."""


def pool() -> GraphPool:
    ids = itertools.count(1)
    return GraphPool(lambda: next(ids))


def test_the_id_is_kept_while_a_graph_of_it_lives_and_renewed_when_none_does():
    p = pool()
    assert p.for_capture() == 1
    first = Graph()
    p.holds(first, 1)
    assert p.for_capture() == 1 and p.live == 1
    del first
    gc.collect()
    assert p.live == 0 and p.for_capture() == 2  # torch would refuse the released id 1


def test_after_a_capture_raised_inside_it_the_next_capture_takes_a_fresh_id():
    p = pool()
    p.for_capture()
    kept = Graph()
    p.holds(kept, 1)
    assert p.for_capture() == 1  # a second capture, into the live id
    p.unended()  # ... raised after it began
    assert p.for_capture() == 2 and p.live == 0
    later = Graph()
    p.holds(later, 2)
    assert p.for_capture() == 2
    del kept  # a graph of the old id goes: the new id's count is its own
    gc.collect()
    assert p.live == 1 and p.for_capture() == 2
    del later
    gc.collect()
    assert p.for_capture() == 3


def widened(x):
    return torch.relu(x.repeat(1, 2) - 0.5).sum(-1)


def three_captures_into_one_pool(backend, device, fn, spoil: list) -> None:
    """The backend's capture step thrice into one pool: a capture, one `fn` spoils while
    `spoil[0]` is set, and one more, which must capture and replay (torch 2.11 left the
    spoilt capture's id routed: "already recording to mempool_id")."""
    p = backend.new_pool_handle(device)
    gen = torch.Generator(device=device).manual_seed(3)
    a, b, c = (torch.rand(64, w, generator=gen, device=device) for w in (256, 512, 1024))
    first = backend.capture(fn, (a,), pool=p, warmups=1, weak_outputs=False)
    spoil[0] = True
    with pytest.raises(Exception):
        backend.capture(fn, (b,), pool=p, warmups=1, weak_outputs=False)
    spoil[0] = False
    third = backend.capture(fn, (c,), pool=p, warmups=1, weak_outputs=False)
    for captured, x in ((first, a), (third, c)):
        x.copy_(torch.rand(x.shape, generator=gen, device=device))  # fresh values in the captured input
        captured.replay()
        torch.testing.assert_close(captured.outputs, widened(x))


@pytest.mark.parametrize("kind", ["sim", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])])
def test_a_capture_after_one_invalidated_in_the_same_pool_captures_and_replays(kind):
    """Invalidated inside the run: a host sync on CUDA, an error the simulation raises there."""
    spoil = [False]

    def fn(x):
        if spoil[0] and (sim.taping() or torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            if kind == "sim":
                raise RuntimeError("invalidated inside the capture (sim)")
            x.sum().item()  # a host sync: CUDA invalidates the capture
        return widened(x)

    backend = sim.SimBackend() if kind == "sim" else torch_cuda.TorchCudaBackend()
    three_captures_into_one_pool(backend, torch.device(kind if kind == "cuda" else "cpu"), fn, spoil)


def test_the_simulation_refuses_a_capture_into_an_id_a_raised_capture_left_routed(monkeypatch):
    """As torch 2.11 does, where the pool would not take a fresh id after such a capture."""
    backend, p = sim.SimBackend(), sim.SimBackend().new_pool_handle(torch.device("cpu"))
    raising = [False]

    def fn(x):
        if raising[0] and sim.taping():
            raise RuntimeError("invalidated inside the capture (sim)")
        return widened(x)

    def capture(x):
        return backend.capture(fn, (x,), pool=p, warmups=1, weak_outputs=False)

    a, b, c = (torch.rand(4, w) for w in (8, 16, 32))
    first = capture(a)
    monkeypatch.setattr(GraphPool, "unended", lambda self: None)  # as if the pool kept the routed id
    raising[0] = True
    with pytest.raises(RuntimeError, match="invalidated"):
        capture(b)
    raising[0] = False
    with pytest.raises(RuntimeError, match="already recording"):
        capture(c)
    assert first.graph.pool_id == p.id


@pytest.mark.cuda
@requires_cuda
def test_a_capture_after_one_cuda_refused_to_end_captures_and_replays():
    """A side stream forked inside the capture and never joined: the run returns, and CUDA
    refuses to end the capture."""
    spoil = [False]

    def fn(x):
        if spoil[0] and torch.cuda.is_current_stream_capturing():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                x.mul(2)  # left on the side stream: the capture is never joined
        return widened(x)

    three_captures_into_one_pool(torch_cuda.TorchCudaBackend(), torch.device("cuda"), fn, spoil)
