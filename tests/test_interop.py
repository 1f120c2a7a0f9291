"""Functions of foreign arrays (the CuPy path's logic, run with NumPy on the sim backend),
explicit release, and pool reports."""

import attrs
import numpy as np
import pytest
import torch

from conftest import calls_by_mode, counted
from graphify import Options, GraphifyError, Pool, graphify, persistent, tokens
from graphify.base.interop import array_library, foreign_library

SIZES = (1, 2, 4, 8, 16)


def np_mlp(x, w):
    """Elementwise, matmul and a row reduction, all NumPy."""
    h = np.tanh(x @ w)
    return h - h.mean(axis=1, keepdims=True), (h * h).sum(axis=1)


def captured(pool=None):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    g = graphify(np_mlp, mode="FULL", sizes=SIZES, axes=(tokens(), persistent()), pool=pool, options=Options(backend="sim"))
    return g.capture(rng.standard_normal((3, 6)).astype(np.float32), w), w


def test_array_library_names_foreign_arrays_only():
    assert array_library(np.zeros(2)) == "numpy"
    assert array_library(torch.zeros(2)) is None
    assert array_library(3) is None
    with pytest.raises(TypeError, match="one library"):
        foreign_library("call", [np.zeros(1), FakeCupy()])


class FakeCupy:
    """Stands in for a CuPy array in the mixing check (only its module name matters)."""

    __module__ = "cupy._core.core"

    def __dlpack__(self):  # pragma: no cover - never called
        raise AssertionError


def test_numpy_function_equals_eager_at_every_size_and_above():
    g, w = captured()
    assert g.table.library == "numpy" and g.table.backend.name == "sim"
    rng = np.random.default_rng(1)
    for n in (*range(1, 17), 23):
        x = rng.standard_normal((n, 6)).astype(np.float32)
        got, want = g(x, w), np_mlp(x, w)
        assert all(isinstance(a, np.ndarray) for a in got)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
            assert a.shape == b.shape
    assert calls_by_mode(g) == counted(full=16, none=1)  # 1 to 16 rows replayed, 23 eagerly


def test_numpy_outputs_are_copies_by_default_and_views_on_request():
    g, w = captured()
    x = np.random.default_rng(2).standard_normal((4, 6)).astype(np.float32)
    first, _ = g(x, w)
    g(x * 2, w)
    np.testing.assert_allclose(first, np_mlp(x, w)[0], rtol=1e-5, atol=1e-6)  # kept: its own memory
    assert calls_by_mode(g) == counted(full=2)
    view = attrs.evolve(g, options=attrs.evolve(g.options, outputs="view"))
    first, _ = view(x, w)
    kept = first.copy()
    view(x * 2, w)
    assert not np.allclose(first, kept)  # a view of the static output, overwritten by the next replay
    np.testing.assert_allclose(kept, np_mlp(x, w)[0], rtol=1e-5, atol=1e-6)
    assert calls_by_mode(view) == counted(full=2)


def test_numpy_persistent_swap_and_wrong_dtype_are_rejected():
    g, w = captured()
    x = np.ones((2, 6), dtype=np.float32)
    with pytest.raises(GraphifyError, match="persistent argument 'w'"):
        g(x, w.copy())
    with pytest.raises(TypeError, match="argument 'x'"):
        g(x.astype(np.float64), w)


def test_release_frees_graphs_and_the_report_shows_it():
    pool = Pool("released")
    g, w = captured(pool)
    assert len(pool.report().per_graph) == len(SIZES)
    report = pool.report()
    assert report.reserved_bytes == report.total_bytes > 0
    fresh = g.release()
    assert not fresh.captured and pool.report().per_graph == ()
    x = np.random.default_rng(3).standard_normal((5, 6)).astype(np.float32)
    with pytest.raises(GraphifyError, match="released"):
        g(x, w)
    np.testing.assert_allclose(fresh(x, w)[1], np_mlp(x, w)[1], rtol=1e-6)  # uncaptured: eager
    assert calls_by_mode(fresh) == counted(none=1)
    again = fresh.capture(x, w)
    np.testing.assert_allclose(again(x, w)[1], np_mlp(x, w)[1], rtol=1e-5)
    assert calls_by_mode(again) == counted(full=1)


def test_two_functions_share_one_pool_report():
    import gc

    pool = Pool("draft+target")
    g1, _ = captured(pool)
    g2, _ = captured(pool)
    assert len(pool.report().per_graph) == 2 * len(SIZES)
    del g1
    gc.collect()
    assert len(pool.report().per_graph) == len(SIZES)  # only live graphs count
    del g2
    gc.collect()
    assert pool.report().per_graph == ()


def test_cupy_backend_rejects_torch_functions():
    g = graphify(lambda x: x + 1, mode="FULL", sizes=(2,), options=Options(backend="cupy"))
    with pytest.raises(ValueError, match="backend='cupy' captures functions of CuPy arrays"):
        g.capture(torch.randn(2, 3))
