"""A graphified closure's compile uses no dynamo entry another graphified closure of the same
code made, where this torch does not guard inlined functions' defaults (`graphify.compile.code_claims`)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from graphify import Options, graphify
from graphify.compile import code_claims as _code_claims

D = 8


def make_step(model, scale: float):
    """A factory's closure: every step shares one code object, each its own helper."""

    def helper(y, s=scale):
        return y * s

    def step(x):
        return helper(model(x))

    return step, helper


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def resets(monkeypatch):
    """The codes whose entries were dropped, with this torch taken to miss the guard."""
    dropped = []
    real = torch._C._dynamo.eval_frame.reset_code
    monkeypatch.setattr(torch._C._dynamo.eval_frame, "reset_code", lambda code: dropped.append(code) or real(code))
    monkeypatch.setattr(_code_claims, "dynamo_guards_defaults", lambda: False)
    monkeypatch.setattr(_code_claims, "_CLAIMS", type(_code_claims._CLAIMS)())
    return dropped


def graphified(step):
    return graphify(step, sizes=(4,), options=Options(backend="sim", compile={"backend": "eager"}))


def test_the_probe_tells_which_torch_guards_defaults():
    """torch 2.11's dynamo keeps no guard on an inlined function's defaults; 2.13's does."""
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version == (2, 12):
        pytest.skip("not known for torch 2.12")
    assert _code_claims.dynamo_guards_defaults() is (version >= (2, 13))


def test_a_closures_compile_drops_the_entries_another_graphified_closure_made(resets):
    torch.manual_seed(0)
    model = torch.nn.Linear(D, D).eval()
    step_a, _ = make_step(model, 3.0)
    step_b, _ = make_step(model, 2.0)
    a, b = graphified(step_a), graphified(step_b)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, D)
            torch.testing.assert_close(a(x), step_a(x))
        claimed_by_a = len(resets)
        for _ in range(3):
            x = torch.randn(4, D)
            torch.testing.assert_close(b(x), step_b(x))
    assert claimed_by_a >= 1 and resets[0] is step_a.__code__
    assert len(resets) == claimed_by_a + 1 and resets[-1] is step_b.__code__  # b's first compile only


def test_calls_of_one_graphified_closure_keep_its_entries(resets):
    torch.manual_seed(0)
    step, _ = make_step(torch.nn.Linear(D, D).eval(), 2.0)
    g = graphify(step, options=Options(backend="sim", compile={"backend": "eager"}))
    with torch.no_grad():
        for rows in (2, 3, 5, 2, 3, 5):  # captures of new sizes compile again through the same claim
            x = torch.randn(rows, D)
            torch.testing.assert_close(g(x), step(x))
    assert resets == [step.__code__]


def test_modules_and_bound_methods_share_their_entries(resets):
    """Instances of one class share compiled entries on purpose: no claim."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(D, D).eval(), torch.nn.Linear(D, D).eval()
    with torch.no_grad():
        for m in (first, second, first):
            g = graphify(m.forward, sizes=(4,), options=Options(backend="sim", compile={"backend": "eager"}))
            for _ in range(3):
                x = torch.randn(4, D)
                torch.testing.assert_close(g(x), m(x))
    assert resets == []


def test_where_the_guard_exists_nothing_is_dropped(monkeypatch):
    dropped = []
    monkeypatch.setattr(torch._C._dynamo.eval_frame, "reset_code", lambda code: dropped.append(code))
    monkeypatch.setattr(_code_claims, "dynamo_guards_defaults", lambda: True)
    step_a, _ = make_step(torch.nn.Identity(), 3.0)
    step_b, _ = make_step(torch.nn.Identity(), 2.0)
    _code_claims.claim(step_a, object.__new__(type("A", (), {})))
    owner = object.__new__(type("B", (), {}))
    _code_claims.claim(step_b, owner)
    assert dropped == []
