"""`Options(compile="background")`: plain graphs at once, compiled ones once a worker process
has compiled the same calls (`graphify.compile.background.line`). The worker is a real process here;
on the CPU it compiles with AOTAutograd's "aot_eager" backend (exact, quick), on a GPU with
inductor."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

from conftest import calls_by_mode, requires_cuda
from graphify import Mode, Options, graphify
from graphify.compile import aot as _aot
from graphify.compile.background import line as _background
from graphify.compile.background.jobs import OOM_TRIES, CompileJobs, Job, capture_with
from graphify.compile.compiled import shared_backend
from graphify.base.errors import CaptureError, StateReplacedError

WAIT_S = 240  # the worker imports torch (and transformers) before its first job


class Block(torch.nn.Module):
    """Importable (the worker rebuilds it from its module), with weights and a buffer."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.register_buffer("shift", torch.randn(width))

    def forward(self, x):
        return torch.relu(self.lin(x) + self.shift) * 2


class CacheProbe(torch.nn.Module):
    """A forward of its own: in a process where another test compiled `Block` with inductor
    (the CUDA tests), dynamo would reuse that compile and never look at the caches."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.sigmoid(self.lin(x)) - 0.5


# (backend, device, the worker's compile backend): AOTAutograd's on the CPU, inductor on a GPU
LINES = pytest.mark.parametrize("backend", [
    pytest.param(("sim", "cpu", "aot_eager"), id="sim-cpu"),
    pytest.param(("cuda", "cuda", "inductor"), id="cuda", marks=[pytest.mark.cuda, requires_cuda]),
])


def twins(cls, device: str) -> tuple:
    """Two modules of `cls` with the same weights: one to graphify, one to run eagerly."""
    torch.manual_seed(0)
    model, twin = cls().to(device).eval(), cls().to(device).eval()
    twin.load_state_dict(model.state_dict())
    return model, twin


def on_the_line(cls, device: str, compiler: str) -> tuple:
    """`twins(cls, device)`, the first's forward on the background line (dynamo's cache emptied
    first: a trace an earlier test left for this code would serve it)."""
    torch._dynamo.reset()
    model, eager = twins(cls, device)
    model.forward = graphify(model.forward, options=background(compiler))
    return model, eager


def calls_of(monkeypatch, owner, name: str) -> list:
    """The first argument of every call of the method `owner.name` while the test runs."""
    seen, through = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda self, first, *rest, **kw: seen.append(first) or through(
        self, first, *rest, **kw))
    return seen


def background(backend: str, whole: bool = True) -> Options:
    return Options(compile={"background": True, "backend": backend, "whole": whole})


def compiles_here(backend: str) -> int:
    """How many graphs this process compiled through graphify's shared backend."""
    return len(shared_backend(backend, None, None, True, ("fold_gqa",), specialise=True).outputs)  # the defaults


@pytest.fixture
def fresh_worker():
    """A test that ends the worker starts with a new one and leaves none behind (the other
    tests share this process's worker, as a process's graphified functions do)."""
    _background.reset()
    yield
    _background.reset()


@LINES
@pytest.mark.parametrize("whole", [True, False], ids=["loaded-whole", "traced-here"])
def test_plain_graphs_serve_at_once_and_compiled_graphs_after_the_worker(backend, whole):
    """Whole: the worker saves the compiled function and this process loads it, compiling
    nothing. Not whole (or a backend this torch cannot save whole, `_aot.saves`: torch 2.11 and
    the simulation's aot_eager): this process traces the function and loads the backend's output."""
    _, device, compiler = backend
    whole = whole and _aot.saves(compiler)
    torch._dynamo.reset()  # a trace an earlier test left in dynamo's cache for this code would serve it here
    block, eager = twins(Block, device)
    block.forward = graphify(block.forward, options=background(compiler, whole))
    before = compiles_here(compiler)
    with torch.no_grad():
        for _ in range(4):  # a warm-up, then plain graphs: nothing compiles in this process
            x = torch.randn(3, 16, device=device)
            torch.testing.assert_close(block(x), eager(x))
        assert calls_by_mode(block.forward)[Mode.FULL] == 3
        assert compiles_here(compiler) == before
        assert block.forward.wait_compiles(WAIT_S)
        (ticket,) = block.forward._first_use.jobs.tickets.values()
        assert ticket.state == "ready", ticket.error
        assert (ticket.loaded is not None) == whole, ticket.load_error  # saved whole, loaded before ready
        jobs = block.forward._first_use.jobs
        assert jobs.swaps == 0
        for i in range(5):  # the plain graphs give way at the first call; it captures again, compiled
            x = torch.randn(3, 16, device=device)
            torch.testing.assert_close(block(x), eager(x))
            assert jobs.swaps == 1, i  # counted once: what a benchmark reads to find the call
    loads = block.forward._first_use.spec.compiled.aot_loads
    assert (ticket.loaded is not None) == whole, ticket.load_error
    assert compiles_here(compiler) == before + (0 if whole else 1)
    assert (loads.calls > 0) == whole  # the capture's calls went through the loaded function
    assert calls_by_mode(block.forward)[Mode.FULL] >= 3 + 3


@LINES
def test_the_call_that_takes_compiled_graphs_in_replays_at_once_without_the_op_guard(backend, monkeypatch):
    """The structure compiled graphs replace is the new one's kin: the call that takes them in
    captures at once (no eager warm-up call), and its capture's first warm-up runs the eager
    original outside the op guard and the code recording, which the plain capture ran over
    the same code (they were most of that call's cost: 8B, H100)."""
    from graphify.backends.op_guard import CaptureGuard

    _, device, compiler = backend
    block, eager = on_the_line(Block, device, compiler)
    guarded = calls_of(monkeypatch, CaptureGuard, "__torch_dispatch__")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 16, device=device)
            torch.testing.assert_close(block(x), eager(x))
        assert guarded  # the plain capture ran the op guard
        assert block.forward.wait_compiles(WAIT_S)
        before, compiled_before = calls_by_mode(block.forward), compiles_here(compiler)
        guarded.clear()
        for _ in range(3):
            x = torch.randn(3, 16, device=device)
            torch.testing.assert_close(block(x), eager(x))
    after = calls_by_mode(block.forward)
    assert after[Mode.NONE] == before[Mode.NONE] and after[Mode.FULL] == before[Mode.FULL] + 3
    assert not guarded
    loads = block.forward._first_use.spec.compiled.aot_loads
    assert loads.calls > 0 or compiles_here(compiler) > compiled_before  # the graphs are the compiled function's


class Totals:
    """A static object whose tensor every call adds to in place: a warm-up left undone shows."""

    def __init__(self, device: str):
        self.total = torch.randn(16, device=device)


class Accumulates(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x, totals):
        totals.total.add_(self.lin(x).sum(0))
        return x * totals.total


@LINES
def test_the_swap_undoes_its_compiled_warm_up_by_the_writes_the_replaced_structure_recorded(backend, monkeypatch):
    """The call that takes compiled graphs in warms the compiled function up without a recorded
    eager run: the structure it replaces recorded that the call writes `totals.total`, whose
    storage is copied whole before and put back after (`graphify.capture.kin_writes`); so is a
    later kin's (a new object). The in-place sum matches eager's at every call only if each
    warm-up was undone."""
    from graphify.backends.tensor_writes import StateKeeper

    _, device, compiler = backend
    model, eager = on_the_line(Accumulates, device, compiler)
    wholes = calls_of(monkeypatch, StateKeeper, "take_whole")
    mine, theirs = Totals(device), Totals(device)
    theirs.total.copy_(mine.total)

    def agree(calls: int) -> None:
        for _ in range(calls):
            x = torch.randn(3, 16, device=device)
            torch.testing.assert_close(model(x, mine), eager(x, theirs))
            torch.testing.assert_close(mine.total, theirs.total)

    with torch.no_grad():
        agree(3)
        assert model.forward.wait_compiles(WAIT_S)
        before = calls_by_mode(model.forward)
        agree(4)
        assert list(map(len, wholes)) == [1]  # the swap's capture: one storage, copied whole
        after = calls_by_mode(model.forward)
        assert after[Mode.NONE] == before[Mode.NONE] and after[Mode.FULL] == before[Mode.FULL] + 4
        mine, theirs = Totals(device), Totals(device)  # a new object: a kin of the compiled structure
        theirs.total.copy_(mine.total)
        agree(3)
    assert list(map(len, wholes)) == [1, 1]


class Probed(torch.nn.Module):
    """Code of its own: whether dynamo still compiles it after a swap is this test's alone."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + 0.125


@pytest.mark.parametrize("whole", [True, False], ids=["loaded-whole", "traced-here"])
def test_the_simulated_swap_leaves_the_functions_code_compilable(whole):
    """The simulation records the eager original where a capture's function is compiled:
    compiled code run under its recording dispatch mode made dynamo run that code eagerly in
    every later compile of the process (a GPU test then saw no compile at all)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, eager = twins(Probed, "cpu")
    model.forward = graphify(model.forward, options=background("aot_eager", whole and _aot.saves("aot_eager")))
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(3, 16))
        assert model.forward.wait_compiles(WAIT_S)
        for _ in range(3):
            x = torch.randn(3, 16)
            torch.testing.assert_close(model(x), eager(x))
        frames = counters["frames"]["ok"]
        again = torch.compile(Probed().double().forward, backend="aot_eager", dynamic=True)
        again(torch.randn(5, 16, dtype=torch.float64))
    assert counters["frames"]["ok"] == frames + 1


@LINES
def test_the_callers_compile_loads_what_the_worker_compiled(backend, fresh_worker, monkeypatch, tmp_path):
    """The point of the line: the compile in this process is a cache hit (a miss is a whole
    compile inside a call). The worker runs under this process's settings, precision
    included: `set_float32_matmul_precision("highest")` there keyed inductor's cache apart."""
    from torch._dynamo.utils import counters

    _, device, _ = backend
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # empty: the worker (started now) fills it
    block, eager = twins(CacheProbe, device)  # code no other test compiles: dynamo compiles it here
    block.forward = graphify(block.forward, options=background("inductor", whole=False))
    with torch.no_grad():
        for _ in range(3):
            block(torch.randn(3, 16, device=device))
        assert block.forward.wait_compiles(WAIT_S)
        (ticket,) = block.forward._first_use.jobs.tickets.values()
        assert ticket.state == "ready", ticket.error
        misses, hits = counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]
        for _ in range(4):
            x = torch.randn(3, 16, device=device)
            torch.testing.assert_close(block(x), eager(x))
    assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1
    assert counters["inductor"]["fxgraph_cache_miss"] == misses


def test_the_worker_runs_under_the_callers_precision_settings_and_changes_no_other():
    from graphify.compile.background.job_pickle import _apply_precision, applied, precision_settings, torch_state

    default = precision_settings()
    with applied(torch_state()):  # the same settings: nothing set (a set switch moves others: another cache key)
        assert precision_settings() == default
    try:
        torch.set_float32_matmul_precision("high")
        high = torch_state()
        _apply_precision(default)
        assert precision_settings() == default
        with applied(high):
            assert precision_settings() == high["precision"] != default
            assert torch.get_float32_matmul_precision() == "high"
    finally:
        _apply_precision(default)
    assert precision_settings() == default


def test_the_worker_sets_no_setting_torch_marks_deprecated(monkeypatch):
    """Carrying the caller's dynamo settings sets none that torch deprecated: each would warn
    (a FutureWarning on every background compile) and change nothing."""
    import warnings

    import torch._dynamo.config as dynamo_config

    from graphify.compile.background.job_pickle import applied, torch_state

    deprecated = [e for e in getattr(dynamo_config, "_config", {}).values() if getattr(e, "deprecated", False)]
    if not deprecated:
        pytest.skip("this torch marks no dynamo setting deprecated")
    for entry in deprecated:  # torch warns once a process: as if never warned
        monkeypatch.setattr(entry, "_deprecation_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with applied(torch_state()):
            pass
    assert not [w for w in caught if "is deprecated" in str(w.message)], [str(w.message) for w in caught]


def test_a_function_the_worker_cannot_rebuild_keeps_plain_graphs_with_one_warning():
    weight = torch.randn(16, 16)

    def local(x):  # a closure: no process but this one can import it
        return torch.tanh(x @ weight)

    g = graphify(local, options=background("aot_eager"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(5, 16)
            torch.testing.assert_close(g(x), local(x))
        assert g.wait_compiles(WAIT_S)
        for _ in range(4):
            x = torch.randn(5, 16)
            torch.testing.assert_close(g(x), local(x))
    failed = [w for w in seen if "compile in the background failed" in str(w.message)]
    assert len(failed) == 1, [str(w.message) for w in seen]
    assert calls_by_mode(g)[Mode.FULL] == 6  # plain graphs all along, none dropped


def test_a_worker_that_dies_leaves_plain_graphs_serving(fresh_worker):
    torch.manual_seed(0)
    block = Block().eval()
    g = graphify(block.forward, options=background("aot_eager"))
    with torch.no_grad():
        g(torch.randn(2, 16))
        g(torch.randn(2, 16))  # captures plain and sends the job
        _background.compiler().proc.kill()
        assert g.wait_compiles(WAIT_S)
        (ticket,) = g._first_use.jobs.tickets.values()
        assert ticket.state == "failed" and "worker ended" in ticket.error
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(3):
                x = torch.randn(2, 16)
                torch.testing.assert_close(g(x), Block.forward(block, x))
    assert any("compile in the background failed" in str(w.message) for w in seen)
    assert calls_by_mode(g)[Mode.FULL] == 4


def fails_in_the_parent(gm, example_inputs):
    """A dynamo backend that compiles (as the graph itself) in the worker and fails in the
    process that started it."""
    if str(os.getpid()) == os.environ.get("GRAPHIFY_TEST_PARENT"):
        raise RuntimeError("made to fail in the parent")
    return gm.forward


def test_a_compiled_capture_that_fails_here_keeps_plain_graphs_with_one_warning(fresh_worker, monkeypatch):
    monkeypatch.setenv("GRAPHIFY_TEST_PARENT", str(os.getpid()))  # the worker starts after this
    torch.manual_seed(0)
    block = Block().eval()
    g = graphify(block.forward, options=Options(compile={"background": True, "backend": fails_in_the_parent}))
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(4, 16)
            torch.testing.assert_close(g(x), Block.forward(block, x))
        assert g.wait_compiles(WAIT_S)
        (ticket,) = g._first_use.jobs.tickets.values()
        assert ticket.state == "ready", ticket.error  # the worker compiled it
        for _ in range(4):  # the compiled capture fails here: plain graphs again, not eager calls
            x = torch.randn(4, 16)
            torch.testing.assert_close(g(x), Block.forward(block, x))
    assert ticket.state == "failed" and "could not be captured here" in ticket.error
    assert len([w for w in seen if "compile in the background failed" in str(w.message)]) == 1
    # plain graphs before, and at once again: the call that fell back captured plain as the replaced
    # structure's kin, with no eager warm-up call
    assert calls_by_mode(g)[Mode.FULL] == 2 + 4


@LINES
def test_a_function_that_cannot_be_captured_as_written_replays_its_compile_once_made(backend, monkeypatch):
    """A model whose plain capture fails (EdgeNeXt copies a host tensor to the device inside its
    forward; inductor folds the copy into a constant) runs eagerly with one warning until its
    compile is made, then replays the compiled graphs. The failure is made here: every plain
    capture raises as such a copy does."""
    from graphify.capture import CallCapture

    through = CallCapture.capture_first_use

    def as_written_fails(self, pair, args, loaded, *, kin, collect, plain):
        if plain:
            raise CaptureError("Cannot copy between CPU and CUDA tensors during CUDA graph capture (made to)")
        return through(self, pair, args, loaded, kin=kin, collect=collect, plain=plain)

    monkeypatch.setattr(CallCapture, "capture_first_use", as_written_fails)
    _, device, compiler = backend
    torch._dynamo.reset()
    block, eager = twins(Block, device)
    g = graphify(block.forward, options=background(compiler))
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(4):  # eager: the graph cannot be captured as written
            x = torch.randn(3, 16, device=device)
            torch.testing.assert_close(g(x), eager(x))
        assert calls_by_mode(g)[Mode.FULL] == 0
        assert g.wait_compiles(WAIT_S)
        (ticket,) = g._first_use.jobs.tickets.values()
        assert ticket.state == "ready", ticket.error
        for _ in range(4):  # the compiled function captures: graphs from the first call after
            x = torch.randn(3, 16, device=device)
            torch.testing.assert_close(g(x), eager(x))
    assert calls_by_mode(g)[Mode.FULL] >= 3
    told = [str(w.message) for w in seen if "Cannot copy" in str(w.message)]
    assert len(told) == 1 and "until the compile in the background is made" in told[0]


def test_without_a_compile_on_its_way_a_failed_capture_runs_eagerly_for_good(monkeypatch):
    from graphify.capture import CallCapture

    monkeypatch.setattr(CallCapture, "capture_first_use", lambda *a, **k: (_ for _ in ()).throw(
        CaptureError("Cannot copy between CPU and CUDA tensors during CUDA graph capture (made to)")))
    block, eager = twins(Block, "cpu")
    g = graphify(block.forward, options=Options(backend="sim"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad():
            for _ in range(5):
                x = torch.randn(3, 16)
                torch.testing.assert_close(g(x), eager(x))
    assert calls_by_mode(g)[Mode.FULL] == 0
    told = [str(w.message) for w in seen if "Cannot copy" in str(w.message)]
    assert len(told) == 1 and "until the compile" not in told[0]


def sleeps_in_the_worker(gm, example_inputs):
    """A dynamo backend whose compile never ends in the worker (a stuck compile)."""
    if str(os.getpid()) != os.environ.get("GRAPHIFY_TEST_PARENT"):
        time.sleep(600)
    return gm.forward


def test_a_compile_past_its_deadline_stops_the_worker_and_plain_graphs_serve(fresh_worker, monkeypatch):
    monkeypatch.setenv("GRAPHIFY_TEST_PARENT", str(os.getpid()))
    torch.manual_seed(0)
    block = Block().eval()
    how = {"background": True, "backend": sleeps_in_the_worker, "deadline_s": 2}
    g = graphify(block.forward, options=Options(compile=how))
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            g(torch.randn(4, 16))
        start = time.monotonic()
        assert g.wait_compiles(WAIT_S)  # settles: the deadline, not the compile, ends the wait
        assert time.monotonic() - start < WAIT_S / 2
        (ticket,) = g._first_use.jobs.tickets.values()
        assert ticket.state == "failed" and "past its deadline of 2 s" in ticket.error, ticket.error
        assert _background.compiler().proc.wait(timeout=10) is not None  # the worker was stopped
        for _ in range(3):
            x = torch.randn(4, 16)
            torch.testing.assert_close(g(x), Block.forward(block, x))
    assert len([w for w in seen if "past its deadline" in str(w.message)]) == 1
    assert calls_by_mode(g)[Mode.FULL] == 4  # plain graphs all along


def test_batches_of_one_compile_apart_from_larger_ones():
    family = ("f",)
    kind = lambda *shapes: _background.job_kind(family, None, tuple(torch.empty(s) for s in shapes))  # noqa: E731
    assert kind((1, 4)) != kind((2, 4))  # dynamo specialises size 1
    assert kind((2, 4)) == kind((7, 4))  # and not other sizes: one compile serves both
    assert kind((2, 4), (1,)) != kind((2, 4), (3,))


@pytest.mark.parametrize("bad", ["backgrund", {"background": 1}, {"deadline_s": 5}, {"background": True, "deadline_s": 0},
                                 {"background": True, "deadline_s": "5"}])
def test_options_refuse_a_misspelled_background(bad):
    with pytest.raises((TypeError, ValueError), match="compile"):
        Options(compile=bad)


@pytest.mark.parametrize("family", ["Gemma3", "T5"])  # a sliding window's branches; an encoder-decoder
@LINES
def test_other_families_take_their_compiled_graphs_in_with_eager_tokens(backend, family):
    pytest.importorskip("transformers")
    from test_hf_zoo import fresh, generate

    _, device, compiler = backend
    if device == "cpu":  # the CPU suite's time (15-50 s each); `capture_with`'s cases below run on the CPU
        pytest.skip("transformers families under the background line run on CUDA (by hand on the CPU: "
                    "notes/issue41.md)")
    want = generate(fresh(family, device), "static", device, disable_compile=True)
    model = fresh(family, device)
    model.forward = graphify(model.forward, options=background(compiler))
    before = compiles_here(compiler)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.testing.assert_close(generate(model, "static", device), want, rtol=0, atol=0)
        assert model.forward.wait_compiles(WAIT_S)
        for _ in range(2):  # the first takes the compiled graphs in, the second replays them
            torch.testing.assert_close(generate(model, "static", device), want, rtol=0, atol=0)
    tickets = model.forward._first_use.jobs.tickets.values()
    assert tickets and all(t.state == "ready" for t in tickets), [t.error for t in tickets]
    assert compiles_here(compiler) > before or model.forward._first_use.spec.compiled.aot_loads.calls > 0
    assert not [w for w in seen if "eager" in str(w.message) or "background" in str(w.message)], \
        [str(w.message) for w in seen]
    assert calls_by_mode(model.forward)[Mode.FULL] >= 3 * (8 - 3)


class Counting(torch.nn.Module):
    """Keeps a count of its calls in a buffer it writes in place (as models keep a cache or a
    position in one): the worker's run must not write the caller's."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x) * self.calls


@LINES
def test_the_worker_never_writes_the_callers_buffers(backend):
    _, device, compiler = backend
    model, twin = twins(Counting, device)
    model.forward = graphify(model.forward, options=background(compiler))
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 16, device=device)
            torch.testing.assert_close(model(x), twin(x))
        assert model.forward.wait_compiles(WAIT_S)
        for i in range(4):
            x = torch.randn(2, 16, device=device)
            torch.testing.assert_close(model(x), twin(x))
    assert model.calls.item() == twin.calls.item() == 7  # the worker's runs counted in its own copy
    assert calls_by_mode(model.forward)[Mode.FULL] >= 2 + 2


def test_a_function_of_the_script_run_as_main_is_refused_by_name():
    class Script(torch.nn.Module):
        def forward(self, x):
            return x * 2

    Script.__module__ = "__main__"
    with pytest.raises(ValueError, match="defined in the script run as __main__"):
        _background._importable(Script().forward)
    _background._importable(Block().forward)  # an importable one passes


def test_a_call_crosses_as_a_compact_copy_of_the_same_view(monkeypatch):
    """Only a view's rows cross, rebuilt there as the same view of a base of the same
    geometry: dynamo gives a base's sizes symbols too, and a compacted copy named a 24-layer
    model's symbols differently in the worker (another cache key: a cold compile in the call)."""
    import pickle

    from graphify.compile.background import job_pickle as _job_pickle
    from graphify.compile.background.job_pickle import dumps, view_geometry

    big = torch.randn(200_000, 2)
    view, mask = big[:2], torch.randn(8, 1, 1, 300)[..., :192]
    payload = dumps({"args": (view, 3, mask)})
    assert len(payload) < 60_000  # the rows, not the buffers behind them
    back, _, back_mask = pickle.loads(payload)["args"]
    assert torch.equal(back, view) and back.data_ptr() != view.data_ptr() and torch.equal(back_mask, mask)
    assert view_geometry(back) == view_geometry(view) == ((200_000, 2), (2, 1), (2, 2), (2, 1), 0)
    assert view_geometry(back_mask) == view_geometry(mask) is not None
    view.add_(1)  # the caller goes on writing: the copy does not change
    assert not torch.equal(back, view)
    assert pickle.loads(dumps(torch.randn(3)))._base is None  # a tensor of its own stays one
    monkeypatch.setattr(_job_pickle, "VIEW_BASE_BYTES", 1 << 10)  # a base above it, and 4x its view, is not
    large = torch.randn(1 << 10)  # 4 KiB: made again there for a two-element slice, it would cost 512x the slice
    assert view_geometry(large[:2]) is None and pickle.loads(dumps(large[:2]))._base is None
    assert view_geometry(large[:512]) is not None  # a view of half its base crosses as a view
    complex_ = torch.randn(4, 3, dtype=torch.complex64)
    odd = (torch.randn(6)[None].expand(3, 6), torch.arange(8)[None].expand(1, -1), complex_.real, complex_.conj(),
           torch.randn(5, 5).t(), torch.randn(4, 4)[::2, 1:])  # expanded, another dtype, conjugate, strided
    back = pickle.loads(dumps(odd))
    for sent, got in zip(odd, back):  # each arrives with its values, those not made again as views compacted
        assert torch.equal(got.resolve_conj(), sent.resolve_conj()) and got.is_conj() == sent.is_conj()
    assert view_geometry(odd[0]) is None and view_geometry(odd[2]) is None and view_geometry(odd[3]) is None
    assert view_geometry(back[4]) == view_geometry(odd[4]) is not None  # a transpose: the same view there


def test_a_copy_keeps_what_dynamo_keys_its_compile_on():
    """transformers' StaticCache marks its keys and values static (`mark_static_address`):
    a copy without the mark compiled another graph (other static inputs), a cache miss here."""
    import pickle

    from graphify.compile.background.job_pickle import dumps

    cache, plain = torch.randn(4, 8), torch.randn(4, 8)
    torch._dynamo.mark_static_address(cache)
    back_cache, back_plain = pickle.loads(dumps((cache, plain)))
    assert torch.equal(back_cache, cache) and torch.equal(back_plain, plain)
    assert getattr(back_cache, "_dynamo_static_input_type", None) == cache._dynamo_static_input_type
    assert not hasattr(back_plain, "_dynamo_static_input_type")


@pytest.mark.parametrize("whole", [True, False], ids=["kept-whole", "traced-here"])
def test_weights_swapped_after_the_worker_has_the_function_are_compiled_again(whole):
    """Saved whole or not, after what the calls read changed only a job sent since serves (a
    function kept from before is not looked for again in this process)."""
    torch.manual_seed(0)
    block = Block().eval()
    g = graphify(block.forward, options=background("aot_eager", whole))
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(3, 16))
        assert g.wait_compiles(WAIT_S)
        for _ in range(3):  # the compiled graphs come in
            g(torch.randn(3, 16))
        first = tuple(g._first_use.jobs.tickets.values())
        block.lin.weight.data = torch.randn(16, 16)  # the worker's copy now holds the old weights
        for _ in range(3):
            x = torch.randn(3, 16)
            torch.testing.assert_close(g(x), Block.forward(block, x))
        assert g.wait_compiles(WAIT_S)
        again = tuple(g._first_use.jobs.tickets.values())
        assert again and not set(map(id, again)) & set(map(id, first))  # sent again, with the new weights
        assert all(t.state == "ready" for t in again), [t.error for t in again]
        for _ in range(3):
            x = torch.randn(3, 16)
            torch.testing.assert_close(g(x), Block.forward(block, x))


class _Job:
    """A stand-in for `graphify.compile.background.jobs.Job`: ready, and what it was given up for."""

    ready = True
    why = None
    tries = 0

    def give_up(self, why):
        self.why = why

    def take_loaded(self):
        pass

    def try_again_later(self):
        self.tries += 1
        return self.tries < OOM_TRIES


def out_of_memory_capture_error() -> CaptureError:
    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except torch.OutOfMemoryError as exc:
        try:
            raise CaptureError("f: capture failed: out of device memory") from exc
        except CaptureError as wrapped:
            return wrapped


def test_a_compiled_capture_out_of_memory_tries_again_before_it_gives_up():
    job = _Job()

    def capture(plain):
        if not plain:
            raise out_of_memory_capture_error()
        return "plain table"

    for _ in range(OOM_TRIES - 1):  # plain this time; the kind is not given up
        assert capture_with(job, capture, strict=False) == ("plain table", True)
        assert job.why is None
    assert capture_with(job, capture, strict=False) == ("plain table", True)
    assert "could not be captured here" in job.why and job.tries == OOM_TRIES  # the last try gives the kind up


def test_a_kind_out_of_memory_is_looked_at_again_on_the_next_call():
    jobs = CompileJobs(spec=None)
    jobs.tickets[("kind",)] = _background.Ticket(1, state="ready")
    job = Job(jobs, ("kind",), None, ())
    for _ in range(OOM_TRIES - 1):
        jobs.seen = _background.settled()
        assert not jobs.settled()
        assert job.try_again_later()
        assert jobs.settled()  # the next call drops the plain structure and tries compiled again
    assert not job.try_again_later()  # the last try: give up


@pytest.mark.parametrize("error, outcome", [
    (CaptureError("a compile failed"), "plain"),  # the kind keeps plain graphs
    (StateReplacedError("Python state changed (a cache layer made on first use)"), "raised"),  # first use retries
    (StateReplacedError("a tensor replaced", replaced=True), "raised"),  # first use runs such calls eagerly
])
def test_a_compiled_capture_that_fails_falls_back_only_where_the_compile_is_to_blame(error, outcome):
    job, tried = _Job(), []

    def capture(plain):
        tried.append(plain)
        if not plain:
            raise error
        return "plain table"

    if outcome == "raised":
        with pytest.raises(type(error)):
            capture_with(job, capture, strict=False)
        assert tried == [False] and job.why is None
    else:
        assert capture_with(job, capture, strict=False) == ("plain table", True)
        assert tried == [False, True] and "could not be captured here" in job.why
    with pytest.raises(type(error)):  # strict: whatever failed is raised
        capture_with(_Job(), capture, strict=True)


IMPORTS_ON_THE_CALLERS_THREAD = """
import importlib.abc, sys, threading
sys.path[:0] = {paths!r}
import torch
from graphify import Options, graphify
from test_background_compile import Block

torch.manual_seed(0)
model, eager = Block().to({device!r}).eval(), Block().to({device!r}).eval()
eager.load_state_dict(model.state_dict())
model.forward = graphify(model.forward, options=Options(compile={{"background": True, "backend": {compiler!r}}}))
elsewhere = []  # modules imported on a thread other than the caller's

class Recorder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if threading.current_thread() is not threading.main_thread():
            elsewhere.append(name)

sys.meta_path.insert(0, Recorder())
with torch.no_grad():
    for _ in range(4):
        x = torch.randn(3, 16, device={device!r})
        torch.testing.assert_close(model(x), eager(x))
    assert model.forward.wait_compiles(240)
    for _ in range(3):
        x = torch.randn(3, 16, device={device!r})
        torch.testing.assert_close(model(x), eager(x))
(ticket,) = model.forward._first_use.jobs.tickets.values()
assert ticket.loaded is not None, (ticket.state, ticket.error, ticket.load_error)
print("RESULT", model.forward._first_use.jobs.swaps, sorted({{n for n in elsewhere if n in sys.modules}}))
"""


@LINES
def test_the_load_of_a_compiled_function_imports_nothing_off_the_callers_thread(backend, tmp_path):
    """Imports register operators and lowerings with torch's dispatcher, which the caller's
    thread reads without its lock while an operator runs: imports on another thread beside it
    corrupted it (std::bad_alloc, basic_string::_M_create inside custom operators, GPU suite).
    `graphify(...)` makes them for a background line, so the thread that loads the worker's
    compiled function (inductor's output code, its Triton kernels) imports nothing. A fresh
    process, with caches of its own: a kept function would load with no job sent."""
    import subprocess
    import sys

    _, device, compiler = backend
    if not _aot.saves(compiler):
        pytest.skip(f"this torch does not save {compiler}'s compiled functions whole (graphify.compile.aot.saves)")
    tests = os.path.dirname(os.path.abspath(__file__))
    code = IMPORTS_ON_THE_CALLERS_THREAD.format(paths=[tests] + [p for p in sys.path if p], device=device,
                                                compiler=compiler)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("TRITON_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S, env=env)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-3000:]
    swaps, imported = line.split(" ", 2)[1:]
    assert int(swaps) == 1
    assert imported == "[]", f"imported off the caller's thread: {imported}"
