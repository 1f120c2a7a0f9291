"""graphify composed with torch.func, as research code does, and outputs whose size follows
the batch in ways graphify cannot cut: right answers or errors, never padded rows."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, vmap

from conftest import calls_by_mode, counted
from graphify import Options, CaptureError, GraphifyError, graphify

SIZES = (2, 4, 8)


def batches(device, widths=(3, 8, 5, 1)):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(n, 4, generator=gen).to(device) for n in widths]


def weights(device, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(device)


def check(g, f, device):
    for x in batches(device):
        got, want = g(x), f(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls_by_mode(g) == counted(full=len(batches(device)))  # every batch (1 to 8 rows) replayed


def test_per_example_gradients_inside(backend):
    name, device = backend
    w = weights(device, 4)

    def loss(w, x):
        return torch.tanh(x @ w) ** 2

    f = lambda x: vmap(grad(loss), in_dims=(None, 0))(w, x)  # noqa: E731
    check(graphify(f, mode="FULL", sizes=SIZES, options=Options(backend=name)).capture(batches(device)[0]), f, device)


def test_vmapped_ensemble_reduced_over_members(backend):
    name, device = backend
    W = weights(device, 5, 4, 3)
    f = lambda x: vmap(lambda w, x: x @ w, in_dims=(0, None))(W, x).sum(0)  # noqa: E731
    check(graphify(f, mode="FULL", sizes=SIZES, options=Options(backend=name)).capture(batches(device)[0]), f, device)


def test_functional_call_of_a_module(backend):
    name, device = backend
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)).to(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    f = lambda x: functional_call(model, params, (x,))  # noqa: E731
    check(graphify(f, mode="FULL", sizes=SIZES, options=Options(backend=name)).capture(batches(device)[0]), f, device)


def test_an_ensemble_with_the_batch_on_dim_1_is_an_error(backend):
    name, device = backend
    W = weights(device, 5, 4, 3)
    f = lambda x: vmap(lambda w, x: x @ w, in_dims=(0, None))(W, x)  # noqa: E731
    with pytest.raises(CaptureError, match=r"output 0 has shape \(5, 8, 3\).*movedim\(1, 0\)"):
        graphify(f, mode="FULL", sizes=SIZES, options=Options(backend=name)).capture(batches(device)[0])
    moved = lambda x: f(x).movedim(1, 0)  # noqa: E731
    check(graphify(moved, mode="FULL", sizes=SIZES, options=Options(backend=name)).capture(batches(device)[0]), moved, device)


def test_an_output_twice_the_batch_is_an_error_not_padded_rows(backend):
    name, device = backend
    with pytest.raises(CaptureError, match=r"shape \(16, 3\) at \(tokens=8\).*cannot cut the padded rows"):
        graphify(lambda x: x.new_zeros(x.shape[0] * 2, 3), mode="FULL", sizes=SIZES, options=Options(backend=name)).capture(
            batches(device)[0]
        )


def test_a_fixed_output_as_long_as_one_size_is_not_cut(backend):
    name, device = backend
    c = weights(device, 8, 4)
    f = lambda x: (x * 2, c + 1)  # noqa: E731
    g = graphify(f, mode="FULL", sizes=SIZES, options=Options(backend=name)).capture(batches(device)[0])
    for x in batches(device):
        scaled, const = g(x)
        assert scaled.shape == x.shape and const.shape == (8, 4)  # padded to 8: the constant stays whole
        torch.testing.assert_close(const, c + 1)
        torch.testing.assert_close(scaled, x * 2)
    assert calls_by_mode(g) == counted(full=len(batches(device)))


@pytest.mark.parametrize("outside", ["vmap", "grad"])
def test_transforms_around_a_graphified_call_are_an_error_that_says_what_composes(backend, outside):
    name, device = backend
    g = graphify(lambda x: torch.sin(x) * 2, mode="FULL", sizes=SIZES, options=Options(backend=name)).capture(batches(device)[0])
    x = batches(device)[0]
    with pytest.raises(GraphifyError, match=r"inside a torch.func transform.*graphify\(vmap\(f\)\)"):
        if outside == "vmap":
            vmap(g)(x.unsqueeze(0).expand(3, -1, -1))
        else:
            grad(lambda x: g(x).sum())(x)
    torch.testing.assert_close(g(x), torch.sin(x) * 2)  # and the callable still works
    assert calls_by_mode(g) == counted(full=1)  # the refused calls ran as nothing


def test_linalg_results_checked_on_the_host_are_rejected_and_ex_variants_capture(backend):
    from graphify import UnsupportedOpError

    name, device = backend
    A = weights(device, 4, 4).double() + 4 * torch.eye(4, dtype=torch.float64, device=device)
    x = batches(device)[0].double()
    with pytest.raises(UnsupportedOpError, match=r"_linalg_check_errors.*torch.linalg.solve_ex"):
        graphify(lambda x: torch.linalg.solve(A, x.T).T, mode="FULL", sizes=SIZES, options=Options(backend=name)).capture(x)
    f = lambda x: torch.linalg.solve_ex(A, x.T)[0].T  # noqa: E731
    g = graphify(f, mode="FULL", sizes=SIZES, options=Options(backend=name)).capture(x)
    for x in batches(device):
        torch.testing.assert_close(g(x.double()), torch.linalg.solve(A, x.double().T).T)
    assert calls_by_mode(g) == counted(full=len(batches(device)))


def test_a_library_cupy_refuses_during_capture_is_named_with_what_to_do():
    from graphify import UnsupportedOpError

    def uses_cusolver(x):  # what CuPy raises for cuSOLVER, cuRAND and cuSPARSE calls while capturing
        raise NotImplementedError("calling cuSOLVER API during stream capture is currently unsupported")

    with pytest.raises(UnsupportedOpError, match=r"test_compose.py:\d+ in uses_cusolver calls cuSOLVER.*out of the graphified"):
        graphify(uses_cusolver, mode="FULL", sizes=SIZES, options=Options(backend="sim")).capture(torch.randn(3, 4))


def test_a_user_file_under_a_folder_named_graphify_is_still_named(tmp_path):
    # a checkout cloned into a folder named graphify: the user's own frames are not the library's
    import importlib.util

    from graphify import UnsupportedOpError
    from graphify.capture.failed import _user_frame

    src = tmp_path / "graphify" / "user_code.py"
    src.parent.mkdir()
    src.write_text(
        "def uses_cusolver(x):\n"
        "    raise NotImplementedError('calling cuSOLVER API during stream capture is currently unsupported')\n"
    )
    spec = importlib.util.spec_from_file_location("user_code", src)
    user_code = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user_code)

    with pytest.raises(NotImplementedError) as info:
        user_code.uses_cusolver(None)
    assert _user_frame(info.value) == "user_code.py:2 in uses_cusolver"
    with pytest.raises(UnsupportedOpError, match=r"user_code.py:2 in uses_cusolver calls cuSOLVER"):
        graphify(user_code.uses_cusolver, mode="FULL", sizes=SIZES, options=Options(backend="sim")).capture(torch.randn(3, 4))
