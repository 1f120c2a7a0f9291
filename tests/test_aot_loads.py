"""Compiled functions the worker saves whole and this process loads (`graphify.compile.aot`): the
guards torch cannot save (the identity of functions, classes, modules, builtins and closure
cells) are stood for by identities checked here at each capture, and by graphify's watch at
each call. A change to any of them, made before the job was sent (the worker imports the
module as written) or after the loaded graphs replay, must give eager's answer."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch

from conftest import calls_by_mode, requires_cuda, saves_aot_eager
from graphify import Mode, Options, graphify
from graphify.compile import aot as _aot
from graphify.compile.background import line as _background
from test_background_compile import compiles_here

WAIT_S = 240

pytestmark = [pytest.mark.skipif(not _aot.available(), reason="this torch cannot save compiled functions whole"),
              pytest.mark.usefixtures("one_compile_worker")]


def helper(x):
    return torch.tanh(x)


def other_helper(x):
    return torch.sigmoid(x) - 0.5


def make_act(f):
    def act(x):
        return f(x) * 2

    return act


ACT = make_act(torch.tanh)


class Helped(torch.nn.Module):
    """Reads a module global (a function), a closure cell (through another global) and a
    method of its class."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.post(ACT(helper(self.lin(x))))

    def post(self, y):
        return y + 0.25


class ShiftedLinear(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) + 1.0


# (graphify backend, device, the worker's compile backend)
LINES = pytest.mark.parametrize("backend", [
    pytest.param(("sim", "cpu", "aot_eager"), id="sim-cpu", marks=saves_aot_eager),
    pytest.param(("cuda", "cuda", "inductor"), id="cuda", marks=[pytest.mark.cuda, requires_cuda]),
])


@pytest.fixture(autouse=True)
def loaded_outputs_checked(monkeypatch):
    """On the CPU the simulation records the eager function for its replays, so a wrong loaded
    function would pass unseen there: each call through one is compared with the eager
    function on the same arguments here (before the test's own checks)."""
    real = _aot.AotLoads.call

    def on_cpu(tree) -> bool:  # CUDA calls are compared by their tests (inductor's kernels round otherwise)
        return not any(isinstance(x, torch.Tensor) and x.is_cuda for x in torch.utils._pytree.tree_leaves(tree))

    def tensors(tree) -> list:  # the tensors in `tree`, a cache object's keys and values included
        out = []
        for leaf in torch.utils._pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                out.append(leaf)
            for layer in getattr(leaf, "layers", ()):  # transformers' caches
                out += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                        if isinstance(t, torch.Tensor)]
        return out

    wrong = []  # raised inside a capture, a mismatch would only turn into graphify's fallback warning

    def checked(self, args, kwargs):
        twin = copy.deepcopy((args, kwargs)) if on_cpu((args, kwargs)) else None  # eager runs on its own state
        hit, out = real(self, args, kwargs)
        if hit and twin is not None:
            with torch.no_grad():
                want = self.fn(*twin[0], **twin[1])
            try:
                torch.testing.assert_close(tensors(out), tensors(want))  # the outputs
                torch.testing.assert_close(tensors((args, kwargs)), tensors(twin))  # and what each wrote in its state
            except AssertionError as exc:
                wrong.append(str(exc))
        return hit, out

    monkeypatch.setattr(_aot.AotLoads, "call", checked)
    yield
    assert not wrong, wrong[0]


@pytest.fixture
def this_module():
    return sys.modules[__name__]


def twins(device: str):
    torch.manual_seed(0)
    model, twin = Helped().to(device).eval(), Helped().to(device).eval()
    twin.load_state_dict(model.state_dict())
    return model, twin


def swapped_in(model, eager, device: str):
    """Calls until the worker's compile is in: plain graphs, the wait, then the compiled capture."""
    model.forward = graphify(model.forward, options=Options(compile={"background": True, "backend": device[2]}))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 16, device=device[1])
            torch.testing.assert_close(model(x), eager(x))
        assert model.forward.wait_compiles(WAIT_S)
        (ticket,) = model.forward._first_use.jobs.tickets.values()
        assert ticket.state == "ready", ticket.error
        for _ in range(3):
            x = torch.randn(3, 16, device=device[1])
            torch.testing.assert_close(model(x), eager(x))
    return ticket, model.forward._first_use.spec.compiled.aot_loads


def agree(model, eager, device: str, calls: int = 4) -> None:
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(3, 16, device=device)
            torch.testing.assert_close(model(x), eager(x))


@LINES
def test_the_loaded_function_serves_and_its_dropped_guards_are_named(backend):
    model, eager = twins(backend[1])
    ticket, loads = swapped_in(model, eager, backend)
    assert ticket.loaded is not None, ticket.load_error
    assert loads.calls > 0
    names = [name for name, _ in ticket.guards["identities"]]
    assert any("helper" in n for n in names)  # the global function: dropped, stood for here
    assert any("__closure__" in n for n in names)  # the closure cell's function
    assert ticket.guards["dropped"] and ticket.guards["kept"]


@LINES
def test_a_global_replaced_before_the_job_is_sent_is_not_taken_from_the_worker(backend, monkeypatch, this_module):
    """The worker imports this module as written: its trace met `helper`, this process holds
    `other_helper` there. The loaded function is passed over; the capture compiles here."""
    monkeypatch.setattr(this_module, "helper", other_helper)
    model, eager = twins(backend[1])
    ticket, loads = swapped_in(model, eager, backend)
    assert ticket.loaded is not None, ticket.load_error
    assert loads.calls == 0 and any("helper" in n for n in loads.refused)


@LINES
def test_a_closure_cell_changed_before_the_job_is_sent_is_not_taken_from_the_worker(backend, monkeypatch):
    cell = ACT.__closure__[0]
    monkeypatch.setattr(cell, "cell_contents", torch.sigmoid)
    model, eager = twins(backend[1])
    ticket, loads = swapped_in(model, eager, backend)
    assert loads.calls == 0 and any("__closure__" in n for n in loads.refused)


@LINES
def test_a_method_patched_on_its_class_before_the_job_is_sent_is_not_taken_from_the_worker(backend, monkeypatch):
    """As a library that rewrites a model class's methods in the caller's process does."""
    monkeypatch.setattr(Helped, "post", lambda self, y: y * 3)
    model, eager = twins(backend[1])
    _, loads = swapped_in(model, eager, backend)
    assert loads.calls == 0 and loads.refused


@LINES
@pytest.mark.parametrize("change", ["global", "closure", "class"])
def test_a_change_after_the_loaded_graphs_replay_gives_eagers_answer(backend, change, monkeypatch, this_module):
    model, eager = twins(backend[1])
    _, loads = swapped_in(model, eager, backend)
    assert loads.calls > 0
    if change == "global":
        monkeypatch.setattr(this_module, "helper", other_helper)
    elif change == "closure":
        monkeypatch.setattr(ACT.__closure__[0], "cell_contents", torch.sigmoid)
    else:
        model.lin.__class__ = eager.lin.__class__ = ShiftedLinear
    agree(model, eager, backend[1])
    assert loads.served  # what graphs captured before the change launch stays alive


def test_identities_tell_objects_apart_across_processes_by_name_and_code():
    def f(x):
        return x + 1

    def g(x):
        return x + 1

    def h(x):
        return x - 1

    two = [eval("lambda x: torch.tanh(x) * 2", {"torch": torch}), eval("lambda x: torch.sigmoid(x) * 3", {"torch": torch})]
    same = _aot.identity
    assert same(helper) == same(sys.modules[__name__].helper)
    assert same(helper) != same(other_helper)
    assert same(f) != same(h)  # another body
    assert same(f)[2] != same(g)[2]  # another name
    assert same(two[0]) != same(two[1])  # one line, one bytecode shape: other constants and callees
    assert same(torch) == ("module", "torch")
    assert same(len) == ("builtin", "builtins", "len")
    assert same(torch.nn.Linear) == ("class", "torch.nn.modules.linear", "Linear")
    assert same(3) == ("value", "int", "3") and same(None) != same(0)
    assert same(vars(Helped)) != same(vars(ShiftedLinear))  # a class's namespace, entry by entry
    assert same(types.SimpleNamespace())[:1] == _aot.UNVERIFIABLE  # no identity across processes


@LINES
@pytest.mark.parametrize("others", [False, True], ids=["one-family", "another-family-made-first"])
def test_a_transformers_decode_step_is_taken_in_as_the_worker_saved_it(backend, others):
    """generate() over a static cache: the swap loads the worker's compiled decode step (the
    model's output-capturing registry is recorded again in the worker, `transforms.hf`), and
    the tokens are eager's. Where this process made models of other families first, the
    registry holds their classes before this one's; the worker's trace sees them in the same
    order, or the loaded function's guard on the registry's keys refuses every call here."""
    transformers = pytest.importorskip("transformers")
    _, device, compiler = backend
    if others:
        for name in ("Qwen2", "Gemma"):
            kind = getattr(transformers, f"{name}Config")(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                          num_hidden_layers=1, num_attention_heads=2,
                                                          num_key_value_heads=1, head_dim=8)
            getattr(transformers, f"{name}ForCausalLM")(kind)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

    def model():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).to(device).eval()

    def generate(m, ids):
        return m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                          do_sample=False, cache_implementation="static", pad_token_id=0, disable_compile=True)

    ids = torch.randint(1, 96, (2, 3), generator=torch.Generator().manual_seed(7)).to(device)
    want = generate(model(), ids)
    m = model()
    m.forward = graphify(m.forward, options=Options(compile={"background": True, "backend": compiler}))
    before = compiles_here(compiler)
    torch.testing.assert_close(generate(m, ids), want, rtol=0, atol=0)
    first = calls_by_mode(m.forward)[Mode.FULL]
    assert first > 0  # plain graphs meanwhile
    assert m.forward.wait_compiles(WAIT_S)
    torch.testing.assert_close(generate(m, ids), want, rtol=0, atol=0)
    loads = m.forward._first_use.spec.compiled.aot_loads
    tickets = list(m.forward._first_use.jobs.tickets.values())
    assert loads.calls > 0, (loads.refused, [(t.state, t.error, t.aot_path, t.guards is None, t.load_error)
                                             for t in tickets])
    assert compiles_here(compiler) == before  # nothing compiled, nor traced, in this process
    torch.testing.assert_close(generate(m, ids), want, rtol=0, atol=0)
    assert calls_by_mode(m.forward)[Mode.FULL] > first
    assert all(t.state == "ready" for t in tickets), [(t.state, t.error) for t in tickets]  # no capture gave up


@LINES
@pytest.mark.parametrize("moved", [False, True], ids=["same-objects", "global-replaced"])
def test_a_later_graphified_model_captures_compiled_graphs_from_its_first_capture(backend, moved, monkeypatch,
                                                                                  this_module):
    """What a restarted process does: the compiled function an earlier worker kept
    (`graphify.compile.aot_store`) is loaded at the first capture and captured at once, no job sent,
    unless an object its dropped guards stood for is another here (then plain graphs and a job)."""
    model, eager = twins(backend[1])
    swapped_in(model, eager, backend)
    _background.reset()  # as if in a new process: no worker, nothing loaded
    if moved:
        monkeypatch.setattr(this_module, "helper", other_helper)
    later, twin = twins(backend[1])
    later.forward = graphify(later.forward, options=Options(compile={"background": True, "backend": backend[2]}))
    agree(later, twin, backend[1], calls=3)
    first_use = later.forward._first_use
    loads = first_use.spec.compiled.aot_loads
    if moved:
        assert loads.calls == 0 and any("helper" in n for n in loads.refused)
        assert first_use.jobs.tickets  # plain graphs, and the job sent
    else:
        assert loads.calls > 0 and not first_use.jobs.tickets
    agree(later, twin, backend[1])


@LINES
def test_a_later_graphified_models_new_sizes_capture_compiled_from_the_kept_function(backend):
    """A restarted process meets sizes after its first capture (a new batch, a cache of another
    length): the kept function that served the first capture serves their captures too, where its
    guards pass, with no job sent. (It once served the first capture alone: every later capture of
    the kind recorded plain graphs and sent a job, and a restarted service ran its plain graphs
    while a worker started.)"""
    model, eager = twins(backend[1])
    swapped_in(model, eager, backend)
    _background.reset()
    later, twin = twins(backend[1])
    later.forward = graphify(later.forward, options=Options(compile={"background": True, "backend": backend[2]}))
    agree(later, twin, backend[1], calls=3)
    loads = later.forward._first_use.spec.compiled.aot_loads
    first = loads.calls
    assert first > 0
    with torch.no_grad():
        for rows in (5, 5, 5, 7, 7, 7):
            x = torch.randn(rows, 16, device=backend[1])
            torch.testing.assert_close(later(x), twin(x))
    assert loads.calls > first and not later.forward._first_use.jobs.tickets, loads.refused


@LINES
def test_a_loaded_function_skips_the_first_call_aliasing_check_the_worker_made(backend, monkeypatch):
    """AOTAutograd's first-call check of custom ops' aliasing runs every op through a dispatch
    mode; the worker's save made that call on the same code, so none of the caller's calls
    through the loaded function runs it (in-process compiles keep it)."""
    from torch._functorch._aot_autograd import runtime_wrappers

    analyzer = getattr(runtime_wrappers, "_AnalyzeCustomOpInputOutputMode", None)
    if analyzer is None:
        pytest.skip("this torch has no first-call aliasing check")
    seen = []
    through = analyzer.__torch_dispatch__
    monkeypatch.setattr(analyzer, "__torch_dispatch__", lambda self, func, types, args=(), kwargs=None: seen.append(
        func) or through(self, func, types, args, kwargs))
    model, eager = twins(backend[1])
    _, loads = swapped_in(model, eager, backend)
    assert loads.calls > 0 and not seen


def test_kept_functions_are_named_by_function_kind_settings_and_sizes():
    from graphify.compile import aot_store as _aot_store

    small, large = Helped(16), Helped(32)
    kind, settings, state = ("family", 1), {"backend": "inductor"}, {"default_dtype": torch.float32}
    name = _aot_store.path_for
    assert name(small.forward, kind, settings, state) == name(Helped(16).forward, kind, settings, state)
    assert name(small.forward, kind, settings, state) != name(large.forward, kind, settings, state)
    assert name(small.forward, kind, settings, state) != name(small.forward, ("family", 2), settings, state)
    assert name(small.forward, kind, settings, state) != name(small.forward, kind, {"backend": "aot_eager"}, state)
    assert name(small.forward, kind, settings, state) != name(small.forward, kind, settings,
                                                              {"default_dtype": torch.float64})
    assert name(small.forward, kind, settings, state) != name(ShiftedLinear(16, 16).forward, kind, settings, state)
    # what libraries' state this process carries to its worker (transformers' registry of the model
    # classes made so far) is not part of the name: a restarted process that has not made them yet,
    # or not imported that library, finds the file, and the kept function's guards judge the rest
    carried = {**state, "carried": {"transformers output-capturing registry": ["<class 'LlamaModel'>"]}}
    assert name(small.forward, kind, settings, state) == name(small.forward, kind, settings, carried)


RESTARTED = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
logging.getLogger("torch").setLevel(logging.ERROR)
sys.path[:0] = {paths!r}
from graphify import Options, graphify
from test_aot_loads import twins
model, eager = twins("cpu")
model.forward = graphify(model.forward, options=Options(compile={{"background": True, "backend": "aot_eager"}}))
with torch.no_grad():
    for _ in range(4):
        x = torch.randn(3, 16)
        torch.testing.assert_close(model(x), eager(x))
fu = model.forward._first_use
loads = fu.spec.compiled.aot_loads
print("RESULT", loads.calls, len(fu.jobs.tickets))
print("refused", loads.refused, "tried", len(fu.jobs.store_tried))
"""


@saves_aot_eager
def test_a_restarted_process_captures_compiled_graphs_from_its_first_capture(monkeypatch, tmp_path):
    """A real second process (the simulation, AOTAutograd's backend): the kept function loads
    there, with its modules and builtins found by name, and serves from the first capture."""
    import subprocess

    from graphify.compile import aot_store as _aot_store

    monkeypatch.setattr(_aot_store, "DIRECTORY", None)  # inductor's cache directory, shared with the child
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model, eager = twins("cpu")
    swapped_in(model, eager, ("sim", "cpu", "aot_eager"))
    assert list((tmp_path / "inductor" / "graphify-whole").glob("*.aot"))
    code = RESTARTED.format(paths=[p for p in sys.path if p])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, done.stderr[-3000:]
    calls, tickets = map(int, line.split()[1:])
    assert calls > 0 and tickets == 0, done.stdout[-2000:] + done.stderr[-3000:]  # compiled at once, no job sent


def test_names_do_not_follow_set_or_dict_order():
    """Set order follows string hashes, which differ between processes (a restarted process
    named its kept functions apart before `canonical`)."""
    from graphify.compile.aot_store import canonical

    words = [f"w{i}" for i in range(40)]
    assert canonical({"s": set(words), "d": dict.fromkeys(words, 1)}) == \
        canonical({"d": dict.fromkeys(reversed(words), 1), "s": set(reversed(words))})
    assert canonical([1, (2, 3)]) != canonical((1, [2, 3]))


@saves_aot_eager
def test_a_kept_function_that_cannot_be_read_is_passed_over_without_raising(tmp_path):
    """A truncated or foreign file where a kept function should be: plain graphs and a job."""
    from graphify.compile import aot_store as _aot_store

    model, eager = twins("cpu")
    swapped_in(model, eager, ("sim", "cpu", "aot_eager"))
    (kept,) = (tmp_path / "graphify-whole").glob("*.aot")
    (tmp_path / "graphify-whole" / (kept.name + ".guards")).write_bytes(b"\x80\x09junk")
    assert _aot_store.read(str(kept)) is None
    _background.reset()
    later, twin = twins("cpu")
    later.forward = graphify(later.forward, options=Options(compile={"background": True, "backend": "aot_eager"}))
    agree(later, twin, "cpu")
    assert later.forward._first_use.jobs.tickets  # plain graphs, and the job sent
    kept.write_bytes(kept.read_bytes()[:-7])  # a function that is not the one its guards were written for
    assert _aot_store.read(str(kept)) is None


@pytest.mark.parametrize("how", [{"background": True}, {"background": True, "options": {"freezing": True}},
                                 {"background": True, "whole": False}])
def test_a_function_is_saved_whole_unless_asked_not_to_or_its_weights_would_be_folded_in(how):
    from graphify.compile.background.jobs import Job

    jobs = types.SimpleNamespace(spec=types.SimpleNamespace(options=Options(compile=how)))
    assert Job(jobs, (), None, ()).whole == (how.get("options") is None and how.get("whole", True))
    with torch._inductor.config.patch(freezing=True):
        assert not Job(jobs, (), None, ()).whole


def test_a_loaded_function_that_fails_here_is_dropped_and_the_call_compiles_here(caplog):
    class Failing:
        def guard_check(self, *args):
            return True

        def prepare_f_locals(self, *args):
            return {}

        def fn(self, *args):
            raise RuntimeError("kernels for another device")

    loads = _aot.AotLoads(helper)
    loads.add(Failing(), {"identities": (), "values": (), "classes": ()})
    with caplog.at_level("WARNING", logger="graphify"):
        assert loads.call((torch.randn(2),), {}) == (False, None)
    assert not loads.loaded and loads.calls == 0
    assert "kernels for another device" in caplog.text  # its own failure, logged, not a check's


def test_a_saved_function_whose_guards_are_not_its_pair_is_not_loaded(tmp_path):
    from graphify.compile import aot_store as _aot_store

    path = str(tmp_path / "f.aot")
    (tmp_path / "f.aot").write_bytes(b"compiled")
    _aot_store.write_guards(path, {"identities": []})
    assert _aot_store.read(path) == (b"compiled", {"identities": [], "sha256": _aot_store.read(path)[1]["sha256"]})
    (tmp_path / "f.aot").write_bytes(b"another compile")
    ticket = _background.Ticket(1, aot_path=path, guards={"identities": []})
    assert _background.load_saved(ticket) is None and "not a pair" in ticket.load_error


def test_a_backend_this_torch_cannot_save_is_not_saved_whole(monkeypatch):
    """Where `_aot.saves` says no (torch 2.11 and AOTAutograd's aot_eager), the job is sent
    without a path to save to: the caller traces it from the caches, as before saving whole."""
    from graphify.compile.background.jobs import Job

    jobs = types.SimpleNamespace(spec=types.SimpleNamespace(options=Options(compile={"background": True,
                                                                                     "backend": "aot_eager"})))
    assert Job(jobs, (), None, ()).whole == _aot.saves("aot_eager")
    monkeypatch.setattr(_aot, "saves", lambda backend: backend == "inductor")
    assert not Job(jobs, (), None, ()).whole
    assert Job(jobs, (), None, ()).store_path() is None
    model, eager = twins("cpu")
    ticket, loads = swapped_in(model, eager, ("sim", "cpu", "aot_eager"))
    assert ticket.aot_path is None and ticket.guards is None and loads.calls == 0
    agree(model, eager, "cpu")


@pytest.mark.parametrize("registry", ["this transformers'", "a plain dict (transformers 5.17)"])
def test_a_rebuilt_transformers_model_is_recorded_as_its_transformers_records_it(registry, monkeypatch):
    """The worker records a rebuilt model's class in the output-capturing registry the way the
    installed transformers' own `__init__` does: by the model (newer) or by its class's name in
    a plain dict (5.17, the GPU machines'). Keyed the other way the forward finds nothing, its
    saved function guards on the entry's absence, and no call here is served by it."""
    transformers = pytest.importorskip("transformers")
    capturing = pytest.importorskip("transformers.utils.output_capturing")
    from graphify.transforms.hf import _recorded_again

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config).eval()
    if registry.startswith("a plain"):
        monkeypatch.setattr(capturing, "_CAN_RECORD_REGISTRY", {})
    else:
        monkeypatch.setattr(capturing, "_CAN_RECORD_REGISTRY", type(capturing._CAN_RECORD_REGISTRY)())
    table = capturing._CAN_RECORD_REGISTRY
    for m in model.modules():
        _recorded_again(m)
    assert model.model._can_record_outputs  # LlamaModel records its layers' outputs
    assert dict.get(table, str(type(model.model))) == model.model._can_record_outputs  # what the forward reads
    assert dict.get(table, str(type(model))) == model._can_record_outputs


@pytest.mark.parametrize("registry", ["this transformers'", "a plain dict (transformers 5.17)"])
def test_the_workers_registry_takes_the_callers_key_order(registry, monkeypatch):
    """What the job carries of the output-capturing registry (its keys in order) and what the
    worker makes of it: the caller's keys in the caller's order, its own entries' values kept,
    the empty entry for classes it never recorded, its extra keys last."""
    capturing = pytest.importorskip("transformers.utils.output_capturing")
    from graphify.transforms.hf import _registry_in_order, _registry_keys

    fresh = {} if registry.startswith("a plain") else type(capturing._CAN_RECORD_REGISTRY)()
    monkeypatch.setattr(capturing, "_CAN_RECORD_REGISTRY", fresh)
    for key, value in (("<class 'Qwen2Model'>", {"a": 1}), ("<class 'LlamaModel'>", {"b": 2})):
        dict.__setitem__(fresh, key, value)
    caller = _registry_keys()
    assert caller == ["<class 'Qwen2Model'>", "<class 'LlamaModel'>"]
    worker = {} if registry.startswith("a plain") else type(capturing._CAN_RECORD_REGISTRY)()
    dict.__setitem__(worker, "<class 'Extra'>", {"x": 0})
    dict.__setitem__(worker, "<class 'LlamaModel'>", {"b": 2})  # the rebuilt model, recorded again
    monkeypatch.setattr(capturing, "_CAN_RECORD_REGISTRY", worker)
    _registry_in_order(caller)
    assert list(dict.items(worker)) == [("<class 'Qwen2Model'>", {}), ("<class 'LlamaModel'>", {"b": 2}),
                                        ("<class 'Extra'>", {"x": 0})]
    assert capturing._CAN_RECORD_REGISTRY is worker  # set in place: the forward reads this very object
    _registry_in_order(None)  # a caller without the registry: the worker's left as it is
    assert len(worker) == 3


class _AlwaysPasses:
    """A stand-in loaded function: its kept guards pass; it returns its input doubled."""

    def __init__(self):
        self.guard_checks = 0

    def guard_check(self, fn, args, kwargs):
        self.guard_checks += 1
        return True

    def fn(self, f, args, kwargs):
        return f(*args, **kwargs)


def test_within_one_capture_the_dropped_guards_checks_run_once_for_the_same_objects(monkeypatch):
    """`checks_held`: the identity, value and class checks of a loaded function pass once a
    capture for the same objects (the kept guards run on every call); outside it, and for
    other objects, every call checks."""
    checked = []
    monkeypatch.setattr(_aot, "identity_changes", lambda compiled, names, call, env: checked.append(call[1]) or [])
    monkeypatch.setattr(_aot, "value_changes", lambda *a: [])
    monkeypatch.setattr(_aot, "class_changes", lambda *a: [])
    loads = _aot.AotLoads(lambda x: x * 2)
    compiled = _AlwaysPasses()
    loads.add(compiled, {"identities": (), "values": (), "classes": ()})
    x, y = torch.randn(3), torch.randn(3)
    for _ in range(2):
        assert loads.call((x,), {})[0]
    assert len(checked) == 2  # no scope: each call
    with _aot.checks_held():
        for _ in range(3):
            assert loads.call((x,), {})[0]
        assert loads.call((y,), {})[0]  # other objects: checked again
        with _aot.checks_held():  # a nested scope keeps the outer one's verdicts
            assert loads.call((x,), {})[0]
    assert len(checked) == 4
    assert loads.call((x,), {})[0]
    assert len(checked) == 5  # the scope's verdicts went with it
    assert compiled.guard_checks == 8  # the kept guards ran every call


def test_a_refused_loaded_function_is_not_held(monkeypatch):
    """A check that finds a change drops the function, inside a scope as out of it."""
    monkeypatch.setattr(_aot, "identity_changes", lambda *a: ["G['helper']"])
    monkeypatch.setattr(_aot, "value_changes", lambda *a: [])
    monkeypatch.setattr(_aot, "class_changes", lambda *a: [])
    loads = _aot.AotLoads(lambda x: x * 2)
    loads.add(_AlwaysPasses(), {"identities": (), "values": (), "classes": ()})
    with _aot.checks_held():
        assert loads.call((torch.randn(3),), {}) == (False, None)
    assert not loads.loaded and loads.refused == ["G['helper']"]


@LINES
def test_the_swap_checks_what_the_dropped_guards_stood_for_once_a_capture(backend, monkeypatch):
    """A capture calls the loaded function for its warm-up and again for the capture (on a
    GPU; the simulation records the eager original instead): the identity checks run once."""
    checks = []
    real = _aot.identity_changes
    monkeypatch.setattr(_aot, "identity_changes", lambda *a: checks.append(1) or real(*a))
    model, eager = twins(backend[1])
    _, loads = swapped_in(model, eager, backend)
    agree(model, eager, backend[1])
    assert 0 < len(checks) <= loads.calls
    if backend[0] == "cuda":
        assert len(checks) < loads.calls, (len(checks), loads.calls)

