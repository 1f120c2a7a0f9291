"""What a capture CUDA refuses to end leaves behind (`graphify.backends.capture_run`), with
the CUDA calls stood in for: the pool takes a fresh id whatever fails after `capture_begin`;
on torch 2.11 the device allocator's routing torch left is ended and the graph kept."""

from __future__ import annotations

import pytest
import torch

from graphify.backends import capture_run


class Graph:
    """`torch.cuda.CUDAGraph`'s begin and end; `refuse`: CUDA refuses to end the capture."""

    def __init__(self, refuse: bool):
        self.refuse, self.calls = refuse, []

    def capture_begin(self, pool, capture_error_mode):
        self.calls.append(("begin", pool))

    def capture_end(self):
        self.calls.append(("end",))
        if self.refuse:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


class Pool:
    """A `GraphPool`'s `unended`, counted."""

    def __init__(self):
        self.count = 0

    def unended(self):
        self.count += 1


@pytest.fixture
def cuda(monkeypatch):
    ended = []
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda d, p: ended.append((d, p)), raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(capture_run, "_UNENDED", [])
    return ended


@pytest.mark.parametrize("where", ["inside the run", "at the end"])
@pytest.mark.parametrize("ends_first", [False, True], ids=["torch 2.11", "torch 2.12+"])
def test_a_capture_cuda_refuses_to_end_leaves_a_fresh_id_and_no_routing(cuda, monkeypatch, where, ends_first):
    monkeypatch.setattr(capture_run, "_ENDS_ROUTING_FIRST", ends_first)
    graph, p = Graph(refuse=True), Pool()

    def run():
        if where == "inside the run":
            raise RuntimeError("host sync inside the capture")
        return "out"

    with pytest.raises(RuntimeError, match="host sync" if where == "inside the run" else "previous error"):
        capture_run.record(graph, p, (7, 0), run)
    assert graph.calls == [("begin", (7, 0)), ("end",)] and p.count == 1
    assert cuda == ([] if ends_first else [(0, (7, 0))])
    assert capture_run._UNENDED == ([] if ends_first else [graph])  # the host routing's filter reads it


def test_a_run_that_raises_in_a_capture_that_ends_leaves_the_routing_to_torch(cuda):
    graph, p = Graph(refuse=False), Pool()
    with pytest.raises(ValueError):
        capture_run.record(graph, p, (8, 0), lambda: (_ for _ in ()).throw(ValueError("a Python error")))
    assert p.count == 1 and cuda == [] and capture_run._UNENDED == []


def test_a_capture_still_under_way_is_left_to_its_own_error(cuda, monkeypatch):
    monkeypatch.setattr(capture_run, "_ENDS_ROUTING_FIRST", False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # ended on another stream
    graph, p = Graph(refuse=True), Pool()
    with pytest.raises(RuntimeError):
        capture_run.record(graph, p, (9, 0), lambda: "out")
    assert p.count == 1 and cuda == []


def test_a_capture_that_ends_returns_the_run_and_touches_nothing(cuda):
    graph, p = Graph(refuse=False), Pool()
    assert capture_run.record(graph, p, (10, 0), lambda: "out") == "out"
    assert p.count == 0 and cuda == [] and graph.calls == [("begin", (10, 0)), ("end",)]
