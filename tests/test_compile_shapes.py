"""The compile line's shapes (`graphify.compile.shape_policy`): dynamic by default, per captured
shape where the traced call holds 2-D or 3-D convolutions (inductor lays those out channels-last
only at static shapes), as asked where the compile dict names `dynamic`. Every path answers as
eager does on fresh inputs, in the foreground and in the background worker."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from traced_graphs import Recording, fresh_dynamo, traced  # noqa: F401 (the fixture)

from conftest import calls_by_mode, requires_cuda
from graphify import Mode, Options, graphify
from graphify.base.compile_options import CompileOptions
from graphify.compile.shape_policy import Specialise, asked_to_specialise, wants_static


class Convs(torch.nn.Module):
    """A small CNN: two 2-D convolutions, a batch norm, a pooled head (importable: the
    background worker rebuilds it from this module)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                        torch.nn.Conv2d(8, 8, 3, stride=2))
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


class Sequence(torch.nn.Module):
    """No 2-D convolution: a 1-D one (as state-space models hold) and a linear."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 4, 3, padding=1)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.conv(x).transpose(1, 2))


class Patches(torch.nn.Module):
    """A ViT's shape: one 2-D convolution (the patch embedding) before many other ops, where
    inductor lays nothing out channels-last at any shape ("only a few conv")."""

    def __init__(self, depth: int = 40):
        super().__init__()
        self.embed = torch.nn.Conv2d(3, 16, 4, stride=4)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32),
                                                              torch.nn.GELU(), torch.nn.Linear(32, 16))
                                          for _ in range(depth))

    def forward(self, x):
        h = self.embed(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            h = h + block(h)
        return h.mean(1)


class FunctionalConvs(torch.nn.Module):
    """`Convs`' convolutions written as `F.conv2d` over parameters: no convolution module for
    `per_shape_from_the_start` to count, so its traced graph decides."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(torch.randn(8, 3, 3, 3) * 0.2), torch.nn.Parameter(torch.randn(8, 8, 3, 3) * 0.1)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(torch.nn.functional.conv2d(x, self.w1, padding=1))
        return self.head(torch.nn.functional.conv2d(h, self.w2, stride=2).mean((2, 3)))


@pytest.fixture(autouse=True)
def _fresh(fresh_dynamo):
    yield


def test_a_2d_convolution_over_symbolic_shapes_wants_a_compile_per_shape():
    torch.manual_seed(0)
    convs, seq = Convs().eval(), Sequence().eval()
    assert wants_static(traced(convs, torch.randn(2, 3, 12, 12), dynamic=True))
    assert not wants_static(traced(convs, torch.randn(2, 3, 12, 12), dynamic=False))
    assert not wants_static(traced(seq, torch.randn(2, 4, 6), dynamic=True))  # 1-D: left dynamic
    assert not wants_static(traced(torch.nn.Linear(4, 4), torch.randn(3, 4), dynamic=True))


def test_one_convolution_among_many_nodes_stays_dynamic_as_inductor_would_not_lay_it_out():
    from graphify.compile.shape_policy import NODES_PER_CONVOLUTION

    torch.manual_seed(0)
    deep, shallow = Patches().eval(), Patches(depth=2).eval()
    big = traced(deep, torch.randn(2, 3, 16, 16), dynamic=True)
    assert len(big.graph.nodes) >= NODES_PER_CONVOLUTION  # the case: one convolution, 300 nodes or more
    assert not wants_static(big)
    assert wants_static(traced(shallow, torch.randn(2, 3, 16, 16), dynamic=True))  # few nodes: per shape


def test_a_module_of_convolutions_is_known_per_shape_before_any_trace():
    from graphify.compile.shape_policy import LEAVES_PER_CONVOLUTION, per_shape_from_the_start

    convs = Convs()
    assert per_shape_from_the_start(convs) and per_shape_from_the_start(convs.forward)
    assert not per_shape_from_the_start(Patches())  # one convolution among 161 leaves: its graph decides
    assert not per_shape_from_the_start(Sequence())  # a 1-D convolution only
    assert not per_shape_from_the_start(FunctionalConvs())  # no convolution module: its graph decides
    assert not per_shape_from_the_start(lambda x: torch.nn.functional.conv2d(x, x))
    assert not per_shape_from_the_start(torch.nn.Linear(4, 4))
    edge = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), *[torch.nn.Identity() for _ in range(LEAVES_PER_CONVOLUTION - 1)])
    assert per_shape_from_the_start(edge)
    assert not per_shape_from_the_start(torch.nn.Sequential(edge, torch.nn.Identity()))


def count_refusal_checks(monkeypatch) -> list:
    """Every traced graph the compile line's backend weighs for a per-shape refusal."""
    from graphify.compile import compiled

    checked = []

    def counted(gm):
        checked.append(gm)
        return wants_static(gm)

    monkeypatch.setattr(compiled, "wants_static", counted)
    return checked


def test_a_cnn_compiles_per_shape_without_a_dynamic_trace_first(backend, monkeypatch):
    checked, counting = count_refusal_checks(monkeypatch), Counting()
    model, eager = twins(Convs, backend[1])
    g = graphify(model, options=Options(backend=backend[0], compile={"backend": counting}))
    run_batches(g, eager, backend[1], (2, 5))
    assert checked == []  # no dynamic trace made to be refused
    assert counting.shapes() == [["2", "3", "12", "12"], ["5", "3", "12", "12"]]
    assert g._first_use.spec.compiled.per_shape and calls_by_mode(g)[Mode.FULL] >= 4


def test_convolutions_without_modules_are_refused_on_their_trace_and_compiled_per_shape(backend, monkeypatch):
    checked, counting = count_refusal_checks(monkeypatch), Counting()
    model, eager = twins(FunctionalConvs, backend[1])
    g = graphify(model, options=Options(backend=backend[0], compile={"backend": counting}))
    run_batches(g, eager, backend[1], (2, 5))
    assert len(checked) == 1  # the dynamic trace, refused
    assert counting.shapes() == [["2", "3", "12", "12"], ["5", "3", "12", "12"]]
    assert g._first_use.spec.compiled.per_shape and calls_by_mode(g)[Mode.FULL] >= 4


def test_a_wrapped_refusal_is_recognised_through_its_causes():
    try:
        try:
            raise Specialise("per shape")
        except Specialise as inner:
            raise RuntimeError("backend failed") from inner
    except RuntimeError as outer:
        assert asked_to_specialise(outer)
    assert not asked_to_specialise(RuntimeError("another failure"))


class Counting(Recording):
    def shapes(self) -> list:
        """Per compiled graph, the input's shape as traced (ints, or symbols where dynamic): its
        first argument of three or more dimensions (images, sequences), parameters aside."""
        def images(g):
            return next(n for n in g.graph.nodes if n.op == "placeholder" and "parameters" not in n.name
                        and isinstance(n.meta["example_value"], torch.Tensor) and n.meta["example_value"].dim() >= 3)

        return [[str(d) for d in images(g).meta["example_value"].shape] for g in self.graphs]


def run_batches(g, eager, device, batches, size=12):
    with torch.no_grad():
        for n in batches:
            for _ in range(3):  # the first call of a shape may run eagerly, the next capture, then replays
                x = torch.randn(n, 3, size, size, device=device)
                torch.testing.assert_close(g(x), eager(x), rtol=1e-3, atol=1e-4)  # cuDNN may pick other kernels


def twins(cls, device):
    torch.manual_seed(0)
    model, twin = cls().to(device).eval(), cls().to(device).eval()
    twin.load_state_dict(model.state_dict())
    return model, twin


def test_a_model_of_convolutions_is_compiled_per_captured_shape(backend):
    counting = Counting()
    model, eager = twins(Convs, backend[1])
    g = graphify(model, options=Options(backend=backend[0], compile={"backend": counting}))
    run_batches(g, eager, backend[1], (2, 5, 2))
    assert counting.shapes() == [["2", "3", "12", "12"], ["5", "3", "12", "12"]]  # static, once each
    assert g._first_use.spec.compiled.per_shape  # the static compile serves from the first capture on
    assert calls_by_mode(g)[Mode.FULL] >= 6


def test_asked_for_dynamic_shapes_a_model_of_convolutions_compiles_once(backend):
    counting = Counting()
    model, eager = twins(Convs, backend[1])
    g = graphify(model, options=Options(backend=backend[0], compile={"backend": counting, "dynamic": True}))
    run_batches(g, eager, backend[1], (2, 5, 2))
    assert len(counting.graphs) == 1 and not counting.shapes()[0][0].isdigit()
    assert not g._first_use.spec.compiled.per_shape


def test_a_model_without_2d_convolutions_compiles_its_first_shape_static_then_one_dynamic_compile(backend):
    counting = Counting()
    model, eager = twins(Sequence, backend[1])
    g = graphify(model, options=Options(backend=backend[0], compile={"backend": counting}))
    with torch.no_grad():
        for n in (2, 5, 3):
            for _ in range(3):
                x = torch.randn(n, 4, 6, device=backend[1])
                torch.testing.assert_close(g(x), eager(x), rtol=1e-4, atol=1e-5)
    first, dynamic = counting.shapes()  # batch 2 as traced, then a symbol that 5 and 3 share
    assert first[0] == "2" and not dynamic[0].isdigit()
    assert not g._first_use.spec.compiled.per_shape and g._first_use.spec.compiled.first_shape.dynamic


def test_a_model_graphified_again_at_another_shape_goes_dynamic_once_and_reuses_that_compile(backend):
    """The first shape is the code's, as dynamo's cache entries are: a model graphified anew for
    each shape (as the zoo does, a wrapper per shape) compiles static once, dynamic once at its
    second shape, and every later wrapper reuses the dynamic compile; a first shape kept per
    wrapper compiled each new wrapper's shape static again."""
    counting = Counting()
    model, eager = twins(Sequence, backend[1])
    with torch.no_grad():
        for n in (2, 5, 3, 7):
            g = graphify(model, options=Options(backend=backend[0], compile={"backend": counting}))
            for _ in range(3):
                x = torch.randn(n, 4, 6, device=backend[1])
                torch.testing.assert_close(g(x), eager(x), rtol=1e-4, atol=1e-5)
            assert g._first_use.spec.compiled.first_shape.dynamic == (n != 2)
    first, dynamic = counting.shapes()  # batch 2 as traced, then one symbol for 5, 3 and 7
    assert first[0] == "2" and not dynamic[0].isdigit()


def test_a_vit_shaped_model_keeps_one_dynamic_compile_after_its_first_shape_and_eagers_answer(backend):
    counting = Counting()
    model, eager = twins(Patches, backend[1])
    g = graphify(model, options=Options(backend=backend[0], compile={"backend": counting}))
    run_batches(g, eager, backend[1], (2, 5, 3), size=16)
    first, dynamic = counting.shapes()
    assert first[0] == "2" and not dynamic[0].isdigit()
    assert not g._first_use.spec.compiled.per_shape


@pytest.mark.parametrize("value", [True, False, None, "auto"])
def test_dynamic_takes_torchs_values_and_auto(value):
    assert CompileOptions.parse({"dynamic": value}).dynamic == value
    assert CompileOptions().dynamic == "auto"


def test_another_dynamic_value_is_refused_by_name():
    with pytest.raises(TypeError, match="'dynamic' must be True, False, None or 'auto'"):
        Options(compile={"dynamic": "sometimes"})


@pytest.mark.parametrize("line", [
    pytest.param(("sim", "cpu", "aot_eager"), id="sim-cpu"),
    pytest.param(("cuda", "cuda", "inductor"), id="cuda", marks=[pytest.mark.cuda, requires_cuda]),
])
def test_the_background_worker_compiles_a_model_of_convolutions_per_shape(line):
    """The worker's compile refuses the dynamic trace as the caller's does and saves a static
    one; the caller swaps to it and answers as eager does."""
    from graphify.compile import aot as _aot
    from graphify.compile.background import line as _background

    backend, device, compiler = line
    _background.reset()
    try:
        model, eager = twins(Convs, device)
        model.forward = graphify(model.forward, options=Options(
            backend=backend, compile={"background": True, "backend": compiler, "whole": _aot.saves(compiler)}))
        run_batches(model, eager, device, (4,))
        assert model.forward.wait_compiles(240)
        (ticket,) = model.forward._first_use.jobs.tickets.values()
        assert ticket.state == "ready", ticket.error
        assert (ticket.loaded is not None) == _aot.saves(compiler), ticket.load_error  # saved whole, static
        run_batches(model, eager, device, (4,))
        jobs = model.forward._first_use.jobs
        assert jobs.swaps == 1 and jobs.per_shape()  # the worker said so, or (not saved whole) this process's trace
        run_batches(model, eager, device, (4,), size=16)  # the same batch at another size: a job of its own
        assert model.forward.wait_compiles(240)
        tickets = {id(t): t for t in jobs.tickets.values()}.values()  # the first one's also under its exact kind
        assert len(tickets) == 2
        assert all(t.state == "ready" for t in tickets)
        run_batches(model, eager, device, (4,), size=16)
        assert calls_by_mode(model.forward)[Mode.FULL] >= 8
    finally:
        _background.reset()


@pytest.mark.parametrize("line", [
    pytest.param(("sim", "cpu", "aot_eager"), id="sim-cpu"),
    pytest.param(("cuda", "cuda", "inductor"), id="cuda", marks=[pytest.mark.cuda, requires_cuda]),
])
def test_a_background_compile_asked_to_be_static_sends_each_shape_a_job_of_its_own(line):
    """`{"background": True, "dynamic": False}` on a model without convolutions: the worker
    compiles the first shape static, and another shape gets its own static compile (not the
    first one's, whose guards it would fail); every call answers as eager does."""
    from graphify.compile import aot as _aot
    from graphify.compile.background import line as _background

    backend, device, compiler = line
    _background.reset()
    try:
        model, eager = twins(Sequence, device)
        model.forward = graphify(model.forward, options=Options(backend=backend, compile={
            "background": True, "dynamic": False, "backend": compiler, "whole": _aot.saves(compiler)}))
        jobs = model.forward._first_use.jobs
        assert jobs.per_shape()
        with torch.no_grad():
            for n in (2, 5, 2, 5):
                for _ in range(3):
                    x = torch.randn(n, 4, 6, device=device)
                    torch.testing.assert_close(model(x), eager(x), rtol=1e-4, atol=1e-5)
                assert model.forward.wait_compiles(240)
        tickets = {id(t): t for t in jobs.tickets.values()}.values()
        assert len(tickets) == 2 and all(t.state == "ready" for t in tickets), [t.error for t in tickets]
        assert calls_by_mode(model.forward)[Mode.FULL] >= 4
    finally:
        _background.reset()


def test_a_model_compiled_per_shape_follows_a_replaced_submodule(backend):
    """After a change the watch sees, the per-shape compile traces the model as it is now."""
    counting = Counting()
    model, eager = twins(Convs, backend[1])
    g = graphify(model, options=Options(backend=backend[0], compile={"backend": counting}))
    run_batches(g, eager, backend[1], (2,))
    model.body[2] = torch.nn.Tanh()
    eager.body[2] = torch.nn.Tanh()
    run_batches(g, eager, backend[1], (2, 3))
    assert g._first_use.spec.compiled.per_shape
    assert all(s[2:] == ["12", "12"] and s[0].isdigit() for s in counting.shapes())  # every compile static
    assert calls_by_mode(g)[Mode.FULL] >= 5
