"""Every bad input named in the design and the issues, in one table: each error names the
call and the argument (or op) and says what to do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import calls_by_mode, counted
from graphify import Batching, GraphifyError, Limits, Options, Pool, fixed, graphify, persistent, reqs, static, tokens
from graphify.base.errors import InputMismatchError

CALL = "graphify(mlp, mode='FULL')"


def mlp(x, w, scale):
    return torch.tanh(x @ w) * scale


def captured(**kw):
    w = torch.randn(8, 8)
    g = graphify(mlp, mode="FULL", sizes=(2, 4), axes=(tokens(), persistent(), static()), **kw)
    return g.capture(torch.randn(2, 8), w, 2.0), w


def bad_call(g, w):
    x = torch.randn(3, 8)
    return {
        "dtype": lambda: g(x.double(), w, 2.0),
        "trailing shape": lambda: g(torch.randn(3, 5), w, 2.0),
        "not a tensor": lambda: g([1.0] * 8, w, 2.0),
        "argument count": lambda: g(x, w),
        "persistent swapped": lambda: g(x, w.clone(), 2.0),
        "persistent reshaped": lambda: g(x, w.view(4, 16), 2.0),
        "static changed": lambda: g(x, w, 3.0),
        "unknown keyword": lambda: g(x, w, 2.0, bogus=1),
    }


# case -> (error type, the argument it must name, words of advice it must give)
CALL_CASES = {
    "dtype": (InputMismatchError, "'x'", "captured tokens tensor of shape (num_tokens, 8), dtype torch.float32, "
              "device cpu; cast it to the captured dtype (x.to(torch.float32)) or capture again with torch.float64"),
    "trailing shape": (InputMismatchError, "'x'", "captured tokens tensor"),
    "not a tensor": (InputMismatchError, "'x'", "must be a tensor"),
    "argument count": (InputMismatchError, "missing argument 'scale'", "pass it"),
    "persistent swapped": (GraphifyError, "'w'", "update that tensor in place (copy_) or capture again"),
    "persistent reshaped": (GraphifyError, "'w'", "pass the same tensor that was captured"),
    "static changed": (InputMismatchError, "'scale'", "capture again with the new value"),
    "unknown keyword": (InputMismatchError, "bogus", "unexpected keyword"),
}


@pytest.mark.parametrize("axis", [tokens(), reqs(), fixed()])
def test_a_dtype_mismatch_says_what_to_do(axis):
    rows = lambda n: 3 if axis.kind == "fixed" else n  # noqa: E731
    g = graphify(lambda x, y: x * 2 + y.sum(), mode="FULL", sizes=(2, 4), axes=(tokens(), axis), options=Options(backend="sim"))
    g = g.capture(torch.randn(2, 8), torch.randn(rows(2), 8))
    with pytest.raises(InputMismatchError) as info:
        g(torch.randn(4, 8), torch.randn(rows(4), 8, dtype=torch.float16))
    msg = str(info.value)
    assert msg.startswith("graphify(<lambda>, mode='FULL'): argument 'y' got dtype torch.float16"), msg
    assert "cast it to the captured dtype (y.to(torch.float32)) or capture again with torch.float16" in msg, msg
    assert "captures a new structure by itself" in msg, msg
    with pytest.raises(InputMismatchError) as info:  # a shape mismatch has no dtype to cast to
        g(torch.randn(4, 8), torch.randn(rows(4), 5))
    assert "cast it" not in str(info.value)


@pytest.mark.parametrize("case", sorted(CALL_CASES))
def test_bad_calls(case):
    g, w = captured()
    kind, names, advice = CALL_CASES[case]
    with pytest.raises(kind) as info:
        bad_call(g, w)[case]()
    msg = str(info.value)
    assert CALL in msg and names in msg and advice in msg, msg


def capture_cases():
    w = torch.randn(8, 8)
    x = torch.randn(2, 8)

    def item_fn(x, w, scale):
        return x * (x.sum().item() + scale)

    def inplace(x, w, scale):
        x.add_(scale)
        return x @ w

    def g_of(fn, **kw):
        backend = kw.pop("backend", "sim")
        settings = {"mode": "FULL", "sizes": (2, 4), "axes": (tokens(), persistent(), static()), **kw}
        return graphify(fn, **settings, options=Options(backend=backend))

    other = Pool("elsewhere")
    other.handle_for(type("B", (), {"name": "cuda", "new_pool_handle": lambda self, d: 1})(), torch.device("cuda", 0), "x")
    return {
        "no gpu for cuda": (lambda: g_of(mlp, backend="cuda").capture(x, w, 2.0), "graphify(mlp", "Options(backend='sim')"),
        "uncapturable op": (lambda: g_of(item_fn).capture(x, w, 2.0), "aten::_local_scalar_dense", "split op"),
        "in-place on padded": (lambda: g_of(inplace).capture(x, w, 2.0), "'x'", "mark them persistent()"),
        "axes length": (lambda: g_of(mlp, axes=(tokens(),)).capture(x, w, 2.0), "axes has 1 entries", "3 arguments"),
        "no batch axis": (lambda: g_of(mlp, axes=(persistent(), persistent(), static())).capture(x, w, 2.0),
                          "graphify(mlp", "mark at least one tokens() or reqs()"),
        "tensor marked static": (lambda: g_of(mlp, axes=(tokens(), static(), static())).capture(x, w, 2.0), "'w'",
                                 "mark it tokens(), reqs(), fixed() or persistent()"),
        "non-tensor marked tokens": (lambda: g_of(mlp, axes=(tokens(), persistent(), tokens())).capture(x, w, 2.0),
                                     "'scale'", "mark non-tensor arguments static()"),
        "pool of another device": (lambda: g_of(mlp, pool=other).capture(x, w, 2.0), "pool 'elsewhere'",
                                   "use one Pool per device and backend"),
        "cupy backend on torch": (lambda: g_of(mlp, backend="cupy").capture(x, w, 2.0), "graphify(mlp",
                                  "use Options(backend='cuda')"),
        "static_inputs before capture": (lambda: g_of(mlp).static_inputs(2), "graphify(mlp", "capture first"),
        "mixed array libraries": (lambda: g_of(mlp).capture(np.ones((2, 8), np.float32), FakeCupy(), 2.0),
                                  "graphify(mlp", "pass arrays of one library"),
    }


class FakeCupy:
    __module__ = "cupy._core.core"

    def __dlpack__(self):  # pragma: no cover - never called
        raise AssertionError


@pytest.mark.parametrize("case", sorted(capture_cases()))
def test_bad_captures(case):
    if case == "no gpu for cuda" and torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    run, names, advice = capture_cases()[case]
    with pytest.raises((GraphifyError, TypeError, ValueError)) as info:
        run()
    msg = str(info.value)
    assert names in msg and advice in msg, msg


def test_bad_construction():
    for kwargs, advice in (
        ({"mode": "FAST"}, "valid modes"),
        ({"options": lambda: Options(backend="tpu")}, "valid backends"),
        ({"options": lambda: Options(outputs="share")}, "'copy', 'view'"),
        ({"batching": lambda: Batching(max_num_reqs=0)}, "max_num_reqs must be >= 1"),
        ({"batching": lambda: Batching(uniform_query_len=0)}, "uniform_query_len must be >= 1"),
        ({"batching": lambda: {"max_num_reqs": 4}}, "batching must be a graphify.Batching"),
    ):
        with pytest.raises((ValueError, TypeError)) as info:
            made = {k: v() if callable(v) else v for k, v in kwargs.items()}
            graphify(mlp, **{"mode": "FULL", **made})
        assert advice in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="warmups must be >= 0"):
        Options(warmups=-1)
    with pytest.raises(TypeError, match="options must be a graphify.Options"):
        graphify(mlp, mode="FULL", options={"warmups": 2})


def test_call_after_release_says_capture_again():
    g, w = captured()
    g.release()
    with pytest.raises(GraphifyError) as info:
        g(torch.randn(2, 8), w, 2.0)
    assert CALL in str(info.value) and "capture it again" in str(info.value)


def test_empty_batches_copies_and_pickles_do_what_users_expect(backend):
    import copy
    import pickle

    name, device = backend
    w = torch.randn(8, 8, device=device)
    g = graphify(mlp, mode="FULL", sizes=(2, 4), axes=(tokens(), persistent(), static()), options=Options(backend=name))
    assert copy.deepcopy(g) is g and copy.copy(g) is g  # immutable
    assert pickle.loads(pickle.dumps(g)).mode is g.mode  # uncaptured: a plain value
    g = g.capture(torch.randn(2, 8, device=device), w, 2.0)
    empty = torch.randn(0, 8, device=device)
    torch.testing.assert_close(g(empty, w, 2.0), mlp(empty, w, 2.0))  # eager's empty result
    assert calls_by_mode(g) == counted(none=1)  # no graph has 0 rows: eagerly
    assert copy.deepcopy(g) is g
    with pytest.raises(TypeError, match="cannot be pickled; pickle the function"):
        pickle.dumps(g)
    with pytest.raises(ValueError, match="padding_ratio must be >= 1"):
        graphify(mlp, mode="FULL", options=Options(limits=Limits(padding_ratio=0.5)))
