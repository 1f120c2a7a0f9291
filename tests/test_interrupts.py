"""Interrupted captures: Ctrl-C (KeyboardInterrupt) in the middle of a long capture, and a
CUDA error raised inside a capture, leave the process usable: the callable captured from
works, nothing stays pinned, and a new capture succeeds."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from conftest import calls_by_mode, counted, requires_cuda
from graphify import Options, CaptureError, graphify, persistent, tokens

SIZES = (2, 4, 8, 16)


def mlp(x, w):
    return torch.tanh(x @ w)


def allocated(device) -> int:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    # No allocator to ask on the CPU: the bytes of every storage a live tensor holds (the sim
    # backend's static buffers and outputs are ordinary tensors that gc can see).
    storages = {}
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type == "cpu" and o.layout is torch.strided:
            try:  # plain tensors only: fake and functional ones (tracing, compile) have no storage to count
                storage = o.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:
                continue
    return sum(storages.values())


def test_ctrl_c_in_the_middle_of_a_capture(backend):
    name, device = backend
    w = torch.randn(16, 16, device=device)
    state = torch.zeros(4, device=device)

    buffers = []  # weak references to the static input buffers the capture ran on

    def interrupted(x, w):
        buffers.append(weakref.ref(x if x._base is None else x._base))
        state.add_(1)  # outside state written by warm-ups: must be put back even when interrupted
        if x.shape[0] == 4:
            raise KeyboardInterrupt
        return mlp(x, w)

    g = graphify(interrupted, mode="FULL", sizes=SIZES, axes=(tokens(), persistent()),
                 options=Options(backend=name, side_effects="at_capture"))  # `buffers` logs the capture's runs
    before = allocated(device)
    with pytest.raises(KeyboardInterrupt):  # not swallowed, not wrapped
        g.capture(torch.randn(3, 16, device=device), w)
    assert allocated(device) - before <= (1 << 20 if device == "cuda" else 0)  # graphs of 16 and 8 and the static buffers: released
    assert len(buffers) >= 3 and not [b for b in buffers if b() is not None]  # sizes 16, 8 and 4 ran: none pinned
    assert state.tolist() == [0.0] * 4
    x = torch.randn(3, 16, device=device)
    again = graphify(mlp, mode="FULL", sizes=SIZES, axes=(tokens(), persistent()), options=Options(backend=name)).capture(x, w)
    torch.testing.assert_close(again(x, w), mlp(x, w))
    assert calls_by_mode(again) == counted(full=1)  # a new capture replays


@requires_cuda
@pytest.mark.cuda
def test_a_cuda_error_inside_a_capture_leaves_the_process_usable():
    w = torch.randn(16, 16, device="cuda")
    x = torch.randn(3, 16, device="cuda")

    def syncs_while_capturing(x, w):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not allowed while a stream is capturing: CUDA raises
        return mlp(x, w)

    good = graphify(mlp, mode="FULL", sizes=SIZES, axes=(tokens(), persistent())).capture(x, w)
    before = allocated("cuda")
    with pytest.raises(CaptureError, match="capture failed"):
        graphify(syncs_while_capturing, mode="FULL", sizes=SIZES, axes=(tokens(), persistent())).capture(x, w)
    assert allocated("cuda") - before <= 1 << 20
    torch.testing.assert_close(good(x, w), mlp(x, w))  # the earlier graphs still replay
    again = graphify(mlp, mode="FULL", sizes=SIZES, axes=(tokens(), persistent())).capture(x, w)
    torch.testing.assert_close(again(x, w), mlp(x, w))  # and torch can capture again
    assert calls_by_mode(good) == calls_by_mode(again) == counted(full=1)
    y = torch.randn(5, 16, device="cuda")
    torch.testing.assert_close(torch.tanh(y @ w), mlp(y, w))  # eager work goes on
