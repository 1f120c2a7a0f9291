"""Compiled functions loaded from the worker (`graphify.compile.aot`) against state the caller
changed before the job was sent (module constants, global containers, partials, callable
objects, class attributes, torch's own classes): never served by the worker's trace of the
modules as written. Each loaded call is compared with eager (mismatches recorded, asserted
after)."""

from __future__ import annotations

import contextlib
import functools
import sys

import pytest
import torch

from conftest import saves_aot_eager
from graphify import Options, graphify
from graphify.compile import aot as _aot
from graphify.compile.background import line as _background

WAIT_S = 240
pytestmark = [saves_aot_eager, pytest.mark.usefixtures("one_compile_worker")]  # aot_eager: the simulation's compiles

SCALE = 2.0
COUNT = 2
BIAS = torch.zeros(16)
TABLE = {"scale": 2.0}
SEQ = [2.0]
CLAMP = functools.partial(torch.clamp, min=-0.5)


class Scaler:
    def __init__(self, s):
        self.s = s

    def __call__(self, x):
        return x * self.s


SCALER = Scaler(2.0)


class Ops:
    @staticmethod
    def act(x):
        return torch.tanh(x)


class Net(torch.nn.Module):
    factor = 2.0

    def __init__(self, what: str, width: int = 16):
        super().__init__()
        self.what = what
        self.lin = torch.nn.Linear(width, width)
        self.flag = False

    def forward(self, x):
        y = self.lin(x)
        w = self.what
        if w == "float":
            return y * SCALE
        if w == "int":
            return y * COUNT
        if w == "tensor":
            return y + BIAS
        if w == "dict":
            return y * TABLE["scale"]
        if w == "list":
            return y * SEQ[0]
        if w == "partial":
            return CLAMP(y)
        if w == "callable":
            return SCALER(y)
        if w == "static":
            return Ops.act(y)
        if w == "classattr":
            return y * self.factor
        if w == "flag":
            return y * 3 if self.flag else y
        return y


@pytest.fixture
def wrong(monkeypatch):
    """Loaded calls whose output is not eager's, recorded (an assertion raised inside a
    capture could be turned into a fallback)."""
    seen = []
    real = _aot.AotLoads.call

    def checked(self, args, kwargs):
        hit, out = real(self, args, kwargs)
        if hit:
            with torch.no_grad():
                want = self.fn(*args, **kwargs)
            if out.dtype != want.dtype or not torch.allclose(out, want):
                seen.append((out, want))
        return hit, out

    monkeypatch.setattr(_aot.AotLoads, "call", checked)
    return seen


def run(what, setup=None, context=None):
    torch.manual_seed(0)
    model, eager = Net(what).eval(), Net(what).eval()
    eager.load_state_dict(model.state_dict())
    if setup:
        setup(model, eager)
    model.forward = graphify(model.forward, options=Options(compile={"background": True, "backend": "aot_eager"}))
    outs = []
    with torch.no_grad(), (context() if context else contextlib.nullcontext()):
        for _ in range(3):
            x = torch.randn(3, 16)
            outs.append((model(x), eager(x)))
        assert model.forward.wait_compiles(WAIT_S)
        (ticket,) = model.forward._first_use.jobs.tickets.values()
        assert ticket.state == "ready", ticket.error
        for _ in range(3):
            x = torch.randn(3, 16)
            outs.append((model(x), eager(x)))
    loads = model.forward._first_use.spec.compiled.aot_loads
    return loads, ticket, outs


this = sys.modules[__name__]


def patch_linear(monkeypatch):
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: torch.nn.functional.linear(x, self.weight, self.bias) * 5)


def _mutate_list(mp):
    SEQ[0] = 3.0  # in place (restored by `restore_seq`)


@pytest.fixture(autouse=True)
def restore_seq():
    yield
    SEQ[0] = 2.0


SCENARIOS = {
    "float": lambda mp: mp.setattr(this, "SCALE", 3.0),
    "int": lambda mp: mp.setattr(this, "COUNT", 5),
    "tensor": lambda mp: mp.setattr(this, "BIAS", torch.ones(16)),
    "dict": lambda mp: mp.setitem(TABLE, "scale", 3.0),
    "list": _mutate_list,
    "partial": lambda mp: mp.setattr(this, "CLAMP", functools.partial(torch.clamp, min=0.0)),
    "callable": lambda mp: mp.setattr(SCALER, "s", 3.0),
    "callable-class": lambda mp: mp.setattr(Scaler, "__call__", lambda self, x: x * self.s * 7),
    "static": lambda mp: mp.setattr(Ops, "act", staticmethod(torch.sigmoid)),
    "torch-class": patch_linear,
    "flag": lambda mp: None,
    "autocast": lambda mp: None,
    "classattr": lambda mp: mp.setattr(Net, "factor", 3.0),
    "torch-classattr": lambda mp: mp.setattr(torch.nn.Linear, "__call__", lambda self, x: torch.nn.Module.__call__(self, x) * 5),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_state_changed_before_the_job_is_sent_is_never_served_from_the_worker(scenario, monkeypatch, wrong):
    """The caller's state differs from the module as the worker imports it, changed before
    the job is sent. A global's plain values and a class attribute: torch rebuilds those kept
    guards from this process's values when it loads, so graphify records and compares them
    (`graphify.compile.aot.value_changes`); torch's classes: their namespaces are compared too."""
    SCENARIOS[scenario](monkeypatch)
    what = scenario.split("-")[0]
    if what == "torch":
        what = "plain"
    setup = None
    if what == "flag":
        def setup(model, eager):
            model.flag = eager.flag = True
    context = None
    if scenario == "autocast":
        what = "plain"
        context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    loads, ticket, outs = run(what, setup, context)
    bad_final = [i for i, (a, b) in enumerate(outs) if not torch.allclose(a, b)]
    assert not wrong and not bad_final, (scenario, loads.calls, loads.refused[:3])


def test_a_kept_function_is_not_served_after_a_module_constant_changed(monkeypatch, wrong):
    """A restarted process whose module constant differs (the user edited `SCALE = 2.0` in
    their source): the value its kept guard was traced with is compared, and the kept
    function traced with the old value does not serve."""
    run("float")
    _background.reset()  # as if in a new process
    monkeypatch.setattr(this, "SCALE", 3.0)
    torch.manual_seed(0)
    later, twin = Net("float").eval(), Net("float").eval()
    twin.load_state_dict(later.state_dict())
    later.forward = graphify(later.forward, options=Options(compile={"background": True, "backend": "aot_eager"}))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 16)
            torch.testing.assert_close(later(x), twin(x))
    loads = later.forward._first_use.spec.compiled.aot_loads
    assert not wrong
    assert loads.calls == 0 and later.forward._first_use.jobs.tickets  # plain graphs, and the job sent


def test_a_caller_with_its_own_thread_count_takes_the_workers_function_in(monkeypatch, wrong):
    """dynamo's global-state guard holds torch's thread count: the worker compiles under the
    caller's, or a caller that called `torch.set_num_threads` would refuse every loaded
    function and trace the whole forward again at the swap."""
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before != 1 else 2)
    try:
        loads, ticket, outs = run("plain")
    finally:
        torch.set_num_threads(before)
    assert not wrong and all(torch.allclose(a, b) for a, b in outs)
    assert loads.calls > 0 and not loads.refused, loads.refused[:3]


def test_a_librarys_process_state_goes_with_the_job_and_is_set_in_the_worker(monkeypatch):
    """`register_carried`: read in the caller when the job's state is taken, put in the worker
    under `applied`; a read that fails leaves that state out rather than the job."""
    from graphify.compile.background import job_pickle as _job_pickle
    from graphify.extend import register_carried

    monkeypatch.setattr(_job_pickle, "CARRIED", {})
    put = []
    register_carried("a registry", lambda: ["b", "a"], put.append)
    register_carried("a broken one", lambda: 1 / 0, put.append)
    state = _job_pickle.torch_state()
    assert state["carried"] == {"a registry": ["b", "a"]}
    with _job_pickle.applied(state):
        assert put == [["b", "a"]]
    state["carried"]["not registered here"] = 3  # a library the worker has not imported: skipped
    with _job_pickle.applied(state):
        assert put == [["b", "a"], ["b", "a"]]
