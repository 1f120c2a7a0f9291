"""graphify(fn, mode=FULL ...) given bad input, on every backend: every mistake is an error
that names the argument (or the op, or the size) and says what to do, and the process stays
usable after it."""

from __future__ import annotations

import gc

import re

import pytest
import torch

from graphify import (
    Options,
    CaptureError,
    InputMismatchError,
    PersistentSwapError,
    Pool,
    UnsupportedOpError,
    graphify,
    persistent,
    static,
    tokens,
)
from conftest import calls_by_mode, counted
from test_graphify import SIZES, captured_mlp, mlp, weights

@pytest.mark.parametrize(
    "make_bad, match",
    [
        (lambda x: x.double(), "dtype torch.float64"),
        (lambda x: x[:, :16], r"shape \(3, 16\)"),
        (lambda x: x.unsqueeze(-1), r"shape \(3, 32, 1\)"),
    ],
)
def test_wrong_dtype_or_trailing_shape_names_argument_and_captured_spec(backend, make_bad, match):
    g, w1, w2 = captured_mlp(backend)
    with pytest.raises(InputMismatchError, match=match) as info:
        g(make_bad(torch.randn(3, 32, device=backend[1])), w1, w2)
    msg = str(info.value)
    assert "'x'" in msg and "captured tokens tensor of shape (num_tokens, 32)" in msg and "graphify(mlp" in msg


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to put an argument on the wrong device")
def test_wrong_device_names_argument():
    g, w1, w2 = captured_mlp(("cuda", "cuda"))
    with pytest.raises(InputMismatchError, match="device cpu"):
        g(torch.randn(3, 32), w1, w2)


def test_persistent_tensor_swapped_for_another_is_an_error(backend):
    g, w1, w2 = captured_mlp(backend)
    x = torch.randn(3, 32, device=backend[1])
    with pytest.raises(PersistentSwapError, match="'w1' is a different tensor"):
        g(x, w1.clone(), w2)
    with pytest.raises(PersistentSwapError, match="'w2' changed"):
        g(x, w1, w2.half())
    w1.mul_(2)  # in-place updates are what persistent means: the graph sees them
    assert torch.equal(g(torch.ones(2, 32, device=backend[1]), w1, w2), mlp(torch.ones(2, 32, device=backend[1]), w1, w2))
    assert calls_by_mode(g) == counted(full=1)  # a replay saw them; the refused calls ran as nothing


def test_static_argument_must_not_change(backend):
    name, device = backend
    g = graphify(lambda x, scale: x * scale, mode="FULL", sizes=(4,), axes=(tokens(), static()), options=Options(backend=name))
    g = g.capture(torch.randn(2, 3, device=device), 2.0)
    assert torch.equal(g(torch.ones(2, 3, device=device), 2.0), torch.full((2, 3), 2.0, device=device))
    with pytest.raises(InputMismatchError, match="'scale' is 3.0 but was captured as 2.0"):
        g(torch.ones(2, 3, device=device), 3.0)
    assert calls_by_mode(g) == counted(full=1)


def test_argument_count_and_disagreeing_token_rows(backend):
    name, device = backend
    g = graphify(torch.add, mode="FULL", sizes=(4,), options=Options(backend=name)).capture(
        torch.randn(2, 3, device=device), torch.randn(2, 3, device=device)
    )
    with pytest.raises(InputMismatchError, match="missing argument 'arg1'"):
        g(torch.randn(2, 3, device=device))
    with pytest.raises(InputMismatchError, match="disagree on dim 0"):
        g(torch.randn(2, 3, device=device), torch.randn(3, 3, device=device))


def test_cuda_backend_on_a_machine_without_gpu_suggests_sim(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    g = graphify(mlp, mode="FULL", sizes=SIZES, axes=(tokens(), persistent(), persistent()), options=Options(backend="cuda"))
    with pytest.raises(CaptureError, match=re.escape("Options(backend='sim')")):
        g.capture(torch.randn(3, 32), *weights("cpu"))


def test_exception_during_capture_names_the_size_and_releases_graphs(backend):
    name, device = backend

    def fragile(x):
        if x.shape[0] == 4:
            raise RuntimeError("boom at four")
        return x * 2

    pool = Pool("fragile")
    g0 = graphify(fragile, mode="FULL", sizes=SIZES, pool=pool, options=Options(backend=name))
    with pytest.raises(CaptureError, match=r"tokens=4\) \(3 of 5\).*boom at four.*2 graph\(s\) captured before it were released"):
        g0.capture(torch.randn(2, 3, device=device))
    gc.collect()
    assert pool.report().per_graph == ()
    x = torch.randn(3, 3, device=device)
    assert torch.equal(g0(x), x * 2)
    assert calls_by_mode(g0) == counted(none=1)  # uncaptured: its first call of a structure runs eagerly


@pytest.mark.parametrize(
    "body, op",
    [
        (lambda x: x * x.sum().item(), "aten::_local_scalar_dense"),
        (lambda x: x[torch.nonzero(x > 0)[:, 0]], "aten::nonzero"),
        (lambda x: x if bool((x > 0).any()) else -x, "aten::(is_nonzero|_local_scalar_dense)"),
    ],
)
def test_op_that_cannot_be_captured_is_named_and_the_process_stays_usable(backend, body, op):
    name, device = backend
    g = graphify(body, mode="FULL", sizes=(2, 4), options=Options(backend=name))
    with pytest.raises(UnsupportedOpError, match=op) as info:
        g.capture(torch.randn(2, 3, device=device))
    assert "split" in str(info.value)
    ok, w1, w2 = captured_mlp(backend)  # capture still works afterwards (no leaked capture state)
    x = torch.randn(4, 32, device=device)
    assert torch.equal(ok(x, w1, w2), mlp(x, w1, w2))
    assert calls_by_mode(ok) == counted(full=1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for a device-to-host copy")
def test_device_to_host_copy_is_rejected_before_capture():
    g = graphify(lambda x: x + x.cpu().sum().to(x.device), mode="FULL", sizes=(2,))
    with pytest.raises(UnsupportedOpError, match="copies a CUDA tensor to the host"):
        g.capture(torch.randn(2, 3, device="cuda"))


def test_function_writing_a_padded_argument_in_place_is_rejected(backend):
    name, device = backend

    def writes(x):
        x.add_(1)
        return x * 2

    with pytest.raises(CaptureError, match=r"writes to argument\(s\) \['x'\] in place"):
        graphify(writes, mode="FULL", sizes=(2,), options=Options(backend=name)).capture(torch.randn(2, 3, device=device))


def test_unknown_mode_and_backend_strings():
    with pytest.raises(ValueError, match="'FULL_AND_PIECEWISE'"):
        graphify(mlp, mode="fully")
    with pytest.raises(ValueError, match="'sim'"):
        graphify(mlp, options=Options(backend="tpu"))


