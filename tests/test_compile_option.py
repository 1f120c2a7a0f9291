"""`Options(compile=...)`: graphs record the compiled function, calls without a graph run
the function as written (so they never compile); torch.compile'd functions are called by
captures exactly as the user called them (no recompile for a calling convention); a
transformers model's own compile of generate() is turned off by graphify(model.forward)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo

from conftest import calls_by_mode, counted
from graphify import CaptureError, Mode, Options, graphify, persistent, static, tokens
from graphify.base.call_layout import CallLayout


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch (dynamo caches compiled code per code object, across
    torch.compile wrappers)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Counting:
    """A torch.compile backend that counts compiles and runs the traced graph as is, so
    CPU tests pay no inductor compile; each compile is one entry."""

    def __init__(self):
        self.shapes = []
        self.symbolic = []  # per compile: whether the traced graph holds a symbolic size

    def __call__(self, gm, example_inputs):
        from torch.fx.experimental.symbolic_shapes import free_symbols

        self.shapes.append(tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)))
        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        self.symbolic.append(any(bool(free_symbols(v)) for v in values if isinstance(v, torch.Tensor)))
        return gm.forward


def mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


AXES = (tokens(), persistent(), persistent())


def replays(g) -> int:
    return calls_by_mode(g)[Mode.FULL]


def test_captures_record_the_compiled_function_and_eager_calls_never_compile(backend):
    counting = Counting()
    g = graphify(mlp, axes=AXES, options=Options(backend=backend[0], compile={"backend": counting, "dynamic": False}))
    w1, w2 = torch.randn(16, 32, device=backend[1]), torch.randn(32, 8, device=backend[1])
    x = torch.randn(3, 16, device=backend[1])  # a first call runs eagerly: the function as written
    assert torch.allclose(g(x, w1, w2), mlp(x, w1, w2), atol=1e-5)
    assert counting.shapes == [] and replays(g) == 0
    for _ in range(3):  # the structure repeats: captured, compiled for the captured shapes once
        x = torch.randn(4, 16, device=backend[1])
        assert torch.allclose(g(x, w1, w2), mlp(x, w1, w2), atol=1e-5)
    assert len(counting.shapes) == 1 and (4, 16) in counting.shapes[0]
    assert calls_by_mode(g) == counted(none=1, full=3)  # the first call eager, the next three replay


def test_bad_compile_options_are_named():
    with pytest.raises(TypeError, match="compile must be True, False, 'background' or a dict"):
        Options(compile="inductor")
    with pytest.raises(ValueError, match="torch.compile'd already"):
        graphify(torch.compile(mlp), options=Options(compile=True))


def test_captures_call_a_function_as_its_example_call_did():
    seen = []

    def f(x, w, scale=1.0, bias=None, *, shift=0.0):
        return x @ w * scale + shift

    def record(*args, **kwargs):
        seen.append((len(args), tuple(kwargs)))
        return f(*args, **kwargs)

    x, w = torch.randn(2, 3), torch.randn(3, 3)
    layout = CallLayout.build("f", f, (x,), {"shift": 1.0, "w": w})
    slots = layout.bind((x,), {"shift": 1.0, "w": w})
    out = layout.caller(record)(*slots)
    assert seen == [(1, ("shift", "w"))]  # not (x, w, 1.0, None) positionally
    assert torch.equal(out, f(x, w, shift=1.0))
    slots = layout.bind((x,), {"shift": 1.0, "w": w, "scale": 2.0})  # a slot the example left default
    layout.caller(record)(*slots)
    assert seen[-1] == (1, ("shift", "w", "scale"))
    def g(x, w, scale=1.0, /, *, shift=0.0):  # positional-only with a default the example left out
        return x @ w * scale + shift

    layout = CallLayout.build("g", g, (x, w), {"shift": 0.5})
    assert torch.equal(layout.caller(g)(*layout.bind((x, w, 3.0), {"shift": 0.5})), g(x, w, 3.0, shift=0.5))
    assert torch.equal(layout.caller(g)(*layout.bind((x, w), {"shift": 0.5})), g(x, w, shift=0.5))
    plain = CallLayout.build("f", mlp, (x, w, w), {})
    assert plain.caller(mlp) is mlp  # all positional: the function itself


def test_a_compiled_function_is_not_recompiled_by_the_way_captures_call_it(backend):
    counting = Counting()
    compiled = torch.compile(mlp, backend=counting, dynamic=False)
    g = graphify(compiled, axes={"x": tokens(), "w1": persistent(), "w2": persistent()}, options=Options(backend=backend[0]))
    w1, w2 = torch.randn(16, 32, device=backend[1]), torch.randn(32, 8, device=backend[1])
    with torch.no_grad():  # inference, as captures run (grad mode is part of a compile's guards)
        for _ in range(3):
            x = torch.randn(4, 16, device=backend[1])
            assert torch.allclose(g(x, w1=w1, w2=w2), mlp(x, w1, w2), atol=1e-5)
    assert len(counting.shapes) == 1  # the eager call and the captures share one compile
    assert calls_by_mode(g) == counted(none=1, full=2)


def test_graphify_turns_off_transformers_own_compile_of_generate():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    other = transformers.LlamaForCausalLM(cfg).eval()
    assert not model.generation_config.disable_compile
    model.forward = graphify(model.forward)
    graphify(other.get_input_embeddings())  # a module, not a model's forward: left alone
    assert model.generation_config.disable_compile and not other.generation_config.disable_compile


def test_a_compile_that_fails_runs_eagerly_with_a_warning_naming_it_or_raises_when_strict(backend):
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    w1, w2 = torch.randn(16, 32, device=backend[1]), torch.randn(32, 8, device=backend[1])
    for strict in (False, True):
        options = Options(backend=backend[0], compile={"backend": broken}, first_use="strict" if strict else True)
        g = graphify(mlp, axes=AXES, options=options)
        with torch.no_grad():
            x = torch.randn(4, 16, device=backend[1])
            assert torch.allclose(g(x, w1, w2), mlp(x, w1, w2), atol=1e-5)  # the first call: as written
            x = torch.randn(4, 16, device=backend[1])
            if strict:
                with pytest.raises(CaptureError, match="no compiler here"):
                    g(x, w1, w2)  # the capture compiles
            else:
                with pytest.warns(UserWarning, match="no compiler here"):
                    assert torch.allclose(g(x, w1, w2), mlp(x, w1, w2), atol=1e-5)
                assert replays(g) == 0


def test_the_compile_has_dynamic_shapes_so_new_batches_and_lengths_reuse_it(backend):
    """A generate()-like loop: new batch sizes and, per call, a new cache object of another
    length. A call carrying an object that holds tensors (the cache) compiles dynamically from
    the first call, batch 1 and larger batches apart (dynamo specialises sizes 0 and 1),
    nothing more."""
    counting = Counting()

    class Cache:  # what a transformers StaticCache is to graphify: a static object holding tensors
        def __init__(self, length):
            self.t = torch.randn(length, 16, 16, device=backend[1])

    def step(x, cache):
        return x @ cache.t.sum(0)

    g = graphify(step, axes=(tokens(), static()), options=Options(backend=backend[0], compile={"backend": counting}))
    with torch.no_grad():
        for length in (8, 12, 20):
            cache = Cache(length)
            for n in (1, 4, 6, 1):
                for _ in range(2):
                    x = torch.randn(n, 16, device=backend[1])
                    assert torch.allclose(g(x, cache), step(x, cache), atol=1e-4)
    assert counting.symbolic == [True, True]
    assert calls_by_mode(g) == counted(none=1, full=3 * 4 * 2 - 1)  # only the very first call eager


def test_a_function_called_at_one_shape_compiles_once_static(backend):
    """Under `dynamic="auto"` a function called at one shape gets one compile of that shape, as
    torch.compile's own default gives it (no symbolic sizes: static kernels, a faster trace)."""
    counting = Counting()
    w1, w2 = (torch.randn(16, 16, device=backend[1]) for _ in range(2))
    g = graphify(mlp, axes=AXES, options=Options(backend=backend[0], compile={"backend": counting}))
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, 16, device=backend[1])
            assert torch.allclose(g(x, w1, w2), mlp(x, w1, w2), atol=1e-4)
    assert counting.symbolic == [False] and counting.shapes[0][0] == (4, 16)
    assert calls_by_mode(g) == counted(none=1, full=5)


def test_the_first_shapes_compile_is_left_for_a_dynamic_one_only_by_another_shape():
    """`compile_for_captures` under `dynamic="auto"`: the first shape's static compile serves
    until a second shape (or any recompile of its frame); a compile for a worker
    (`"background"`) and a CNN's (per shape from the start) never take that path."""
    from graphify.compile.compiled import compile_for_captures

    counting = Counting()
    fn = compile_for_captures("mlp", lambda x: torch.relu(x) * 2, {"backend": counting})
    assert fn.first_shape.signature is None and not fn.first_shape.dynamic
    for n in (3, 3, 5, 7, 9):
        x = torch.randn(n, 4)
        assert torch.equal(fn(x), torch.relu(x) * 2)
        assert fn.first_shape.dynamic == (n != 3)
    assert counting.symbolic == [False, True]
    background = compile_for_captures("mlp", lambda x: x + 1, {"backend": counting, "background": True})
    cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    assert background.first_shape is None and compile_for_captures("cnn", cnn, {"backend": counting}).first_shape is None
    assert compile_for_captures("mlp", lambda x: x - 1, {"backend": counting, "dynamic": True}).first_shape is None


def test_a_split_function_is_compiled_whole_for_full_graphs_and_kept_in_pieces_for_piecewise(backend):
    """Options(compile=...) on a split function: FULL graphs record the function it was split
    from, compiled whole (inductor may then fuse across the split ops), PIECEWISE graphs run
    its pieces, eager calls run it as split; all equal the unsplit function on fresh batches."""
    from graphify.models import BlockTables, DecoderConfig, init_params, new_paged_cache, split_ops, varlen_axes, varlen_step
    from graphify.transforms import split

    device = backend[1]
    cfg = DecoderConfig.tiny(max_seq_len=256, layers=2)
    step = varlen_step(cfg, init_params(cfg, seed=0, device=device), "unified")
    cache = new_paged_cache(cfg, 64, 16, device=device, seed=1)
    tables = BlockTables(64, 16, 16)
    example = tables.batch(cfg, (0, 1, 2), (3, 1, 2), (3, 5, 6), device=device, seed=0)
    counting = Counting()
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes())
    g = graphify(pw, mode="FULL_AND_PIECEWISE", sizes=(2, 4), axes=varlen_axes(),
                 options=Options(backend=backend[0], compile={"backend": counting})).capture(*example, cache)
    compiles = len(counting.shapes)
    assert compiles >= 1  # the FULL keys' captures compiled the unsplit function
    calls = [((1, 1), (7, 30)), ((1, 1, 1), (4, 12, 40)), ((2, 1, 1), (0, 9, 20)), ((1, 1, 1, 1), (3, 8, 9, 50)),
             ((3, 1), (5, 17)), ((1, 1), (60, 2))]
    with torch.no_grad():
        for i, (q, ctx) in enumerate(calls):
            batch = tables.batch(cfg, tuple(range(10 + 4 * i, 10 + 4 * i + len(q))), q, ctx, device=device, seed=100 + i)
            ref = cache.clone()
            torch.testing.assert_close(g(*batch, cache), step(*batch, ref), rtol=1e-4, atol=1e-4)
            # every block the requests own (block 0 is the scratch block padded tokens write)
            torch.testing.assert_close(cache[:, :, 1:], ref[:, :, 1:], rtol=1e-4, atol=1e-4)
    assert calls_by_mode(g) == counted(full=4, piecewise=2)  # decode batches FULL, mixed ones in pieces
    assert len(counting.shapes) == compiles  # replays never compile


def test_compiled_code_lives_as_long_as_the_graphs_not_as_dynamos_caches(backend):
    """Graphs launch the code the compile made; `torch._dynamo.reset()` drops dynamo's
    caches, not that code, and the graphs replay right after it. Freed with the function."""
    import gc
    import weakref

    made = []

    def keeping_track(gm, example_inputs):
        made.append(weakref.ref(gm))
        return gm.forward

    g = graphify(mlp, axes=AXES, options=Options(backend=backend[0], compile={"backend": keeping_track}))
    w1, w2 = torch.randn(16, 32, device=backend[1]), torch.randn(32, 8, device=backend[1])
    for _ in range(2):  # first use: the second call captures, compiling
        x = torch.randn(4, 16, device=backend[1])
        g(x, w1, w2)
    assert len(made) == 1
    before = replays(g)
    torch._dynamo.reset()
    gc.collect()
    assert made[0]() is not None  # held by graphify, not only by dynamo
    for _ in range(3):
        x = torch.randn(4, 16, device=backend[1])
        assert torch.allclose(g(x, w1, w2), mlp(x, w1, w2), atol=1e-5)
    assert replays(g) == before + 3 and len(made) == 1
    del g
    gc.collect()
    assert made[0]() is None  # and let go with the function


@pytest.mark.cuda
def test_inductor_graphs_replay_after_dynamo_resets(backend):
    if backend[0] != "cuda":
        pytest.skip("the kernels that could be unloaded are inductor's CUDA kernels")
    import gc

    g = graphify(mlp, axes=AXES, options=Options(backend="cuda", compile=True))
    w1, w2 = torch.randn(64, 128, device="cuda"), torch.randn(128, 32, device="cuda")
    for _ in range(2):
        g(torch.randn(8, 64, device="cuda"), w1, w2)
    before = replays(g)
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.synchronize()
    for _ in range(3):
        x = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(g(x, w1, w2), mlp(x, w1, w2), rtol=2e-3, atol=2e-3)
    assert replays(g) == before + 3


class Scaled(torch.nn.Module):
    """Float attributes as transformers layers have them (`eps`, attention `scaling`)."""

    def __init__(self):
        super().__init__()
        self.lin, self.eps, self.scaling = torch.nn.Linear(16, 16), 1e-6, 0.25

    def forward(self, x):
        x = self.lin(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        q = x.view(x.shape[0], 1, 4, 4).transpose(1, 2)  # an op that takes the float as a number
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=self.scaling).reshape(x.shape)


@pytest.mark.parametrize("floats", ["specialised", "symbolic"])
def test_a_compile_with_dynamic_shapes_traces_the_function_once(backend, monkeypatch, floats):
    """With dynamic shapes dynamo made float attributes symbols, and AOTAutograd's pass that
    turns them into tensors restarted the whole trace: every compile traced the model twice.
    Floats are specialised while graphify's compile runs, so the backend is called once."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    import graphify.compile.compiled as compiled

    if floats == "symbolic":  # the old setting: shows what the test would catch
        monkeypatch.setattr(compiled, "DYNAMO_CONFIG", {})
    calls = []

    def counting(gm, example_inputs):
        calls.append(len(example_inputs))
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    model = Scaled().to(backend[1])  # dynamic from the first shape (under "auto" the first compiles static)
    g = graphify(model, options=Options(backend=backend[0], compile={"backend": counting, "dynamic": True}))
    for n in (4, 4, 4, 6):  # captured at 4 (one compile), then 6 reuses it (dynamic shapes)
        x = torch.randn(n, 16, device=backend[1])
        with torch.no_grad():
            assert torch.allclose(g(x), model(x), atol=1e-5)
    assert calls_by_mode(g) == counted(none=1, full=3)
    if floats == "symbolic" and len(calls) == 1:
        pytest.skip("this torch no longer restarts the trace for symbolic floats")
    assert len(calls) == (1 if floats == "specialised" else 2)


class TwoLayer(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(16, 32, generator=g))
        self.w2 = torch.nn.Parameter(torch.randn(32, 8, generator=g))

    def forward(self, x):
        return mlp(x, self.w1, self.w2)


def test_models_of_one_class_with_the_same_options_share_one_compile(backend):
    """Dynamo guards a compiled entry on its backend's identity: with a backend per
    graphified model, each model of a class compiled its forward again (and past dynamo's
    recompile limit of 8, ran eagerly). Ten models, one compile, every one replaying."""
    from torch._dynamo.utils import counters

    counters.clear()
    models = [TwoLayer(seed).to(backend[1]) for seed in range(10)]
    for model in models:
        model.forward = graphify(model.forward, options=Options(backend=backend[0], compile={"backend": "eager"}))
    with torch.no_grad():
        for model in models:
            for _ in range(3):  # first use: a warm-up, the capture (compiling), a replay
                x = torch.randn(4, 16, device=backend[1])
                torch.testing.assert_close(model.forward(x), mlp(x, model.w1, model.w2))
    assert counters["stats"]["unique_graphs"] == 1  # the first model's compile served all ten
    assert all(replays(model.forward) == 2 for model in models)
    assert models[0].forward.spec.compiled is not models[1].forward.spec.compiled


def test_the_simulation_compares_compiled_code_with_its_eager_original_when_asked():
    """The simulation replays a compiled function's eager original; `compiled_compared` notes
    where the compiled code a GPU would replay answers otherwise (here a backend that doubles
    every output: what a stale compiled entry looks like)."""
    from graphify.backends.sim import compiled_compared

    def doubling(gm, example_inputs):
        def run(*inputs):
            return [o * 2 if isinstance(o, torch.Tensor) else o for o in gm.forward(*inputs)]

        return run

    w1, w2 = torch.randn(8, 16), torch.randn(16, 8)

    def step(x):
        return mlp(x, w1, w2)

    for compared in (False, True):
        torch._dynamo.reset()
        g = graphify(step, sizes=(4,), options=Options(backend="sim", compile={"backend": doubling}))
        with compiled_compared() if compared else contextlib.nullcontext([]) as found:
            for _ in range(3):
                x = torch.randn(4, 8)
                torch.testing.assert_close(g(x), step(x))  # the simulation's answer: the eager original's
        assert calls_by_mode(g)[Mode.FULL] >= 1
        assert bool(found) is compared, found
        if compared:
            assert "step" in found[0]


def test_a_change_drops_the_entries_on_the_frame_torch_compile_puts_around_a_module(monkeypatch):
    """torch.compile of a module keeps its entries on a wrapper frame of its own (torch 2.11:
    `external_utils.wrap_inline`), where torch 2.11 served an entry traced over a submodule's
    old class after `m[1].__class__ = Tanh`: a change graphify sees drops those too."""
    from graphify.compile.compiled import _module_frame_codes, forget_compiled

    frames = _module_frame_codes()
    if not frames:
        pytest.skip("this torch puts no wrapper frame around a compiled module")
    dropped = []
    monkeypatch.setattr(torch._C._dynamo.eval_frame, "reset_code", lambda code: dropped.append(code))
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)).eval()
    g = graphify(m, sizes=(4,), options=Options(backend="sim", compile={"backend": Counting()}))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8)
            torch.testing.assert_close(g(x), m(x))
    forget_compiled(g._first_use.spec)
    assert all(any(code is d for d in dropped) for code in frames)


def test_a_compiled_module_whose_submodule_changes_class_answers_as_eager():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)).eval()
    g = graphify(m, sizes=(4,), options=Options(backend="sim", compile={"backend": "eager"}))
    from graphify.backends.sim import compiled_compared

    with torch.no_grad(), compiled_compared() as disagreements:
        for i in range(8):
            if i == 4:
                m[1].__class__ = torch.nn.Tanh
            x = torch.randn(4, 8)
            torch.testing.assert_close(g(x), m(x))
    assert not disagreements, disagreements[0]
    assert calls_by_mode(g)[Mode.FULL] >= 2


@pytest.mark.parametrize("how, error, words", [
    ({"whole": False}, ValueError, "'whole' says how a compile in the background comes back"),
    ({"background": True, "deadline_s": 0}, ValueError, "'deadline_s' must be a positive number"),
    ({"deadline_s": 60}, ValueError, "'deadline_s' bounds a compile in the background"),
    ({"background": "yes"}, TypeError, "'background' must be True or False"),
    ({"fold_gqa": "no"}, TypeError, "'fold_gqa' must be True or False"),
    ({"mode": 3}, TypeError, "mode"),
    ({1: True}, TypeError, "keys must be strings"),
])
def test_the_compile_dict_is_checked_key_by_key(how, error, words):
    with pytest.raises(error, match=words):
        Options(compile=how)


def test_a_rewrite_no_adapter_declares_is_named_when_the_compile_is_set_up():
    from graphify.compile.compiled import compile_settings

    assert compile_settings({"gemv": True, "mode": "max-autotune"})["rewrites"] == ("fold_gqa", "gemv")
    with pytest.raises(ValueError, match=r"\['gmv'\], which is neither a torch.compile keyword nor a graph rewrite"):
        compile_settings({"gmv": True})


def test_a_second_shape_goes_dynamic_before_anything_of_the_call_ran():
    """Which compile a call goes to is decided on its arguments before it runs, so no call is
    stopped part-way and started again: Python work before a graph break, a write in the
    graph before it, and a `torch._dynamo.reset()` between calls each happen once a call."""
    from graphify.compile.compiled import compile_for_captures

    counting, count, log = Counting(), torch.zeros(()), []

    @torch._dynamo.disable
    def note(n):  # Python only, before any graph of the call: the entry frame breaks here
        log.append(n)

    def step(x):
        note(x.shape[0])
        count.add_(1)
        torch._dynamo.graph_break()
        return x * 2 + count

    fn = compile_for_captures("step", step, {"backend": counting})
    sizes = (3, 3, 5, 5, 7, 3)
    for i, n in enumerate(sizes):
        if i == 4:
            torch._dynamo.reset()
        x = torch.randn(n)
        assert torch.equal(fn(x), x * 2 + (i + 1)) and count.item() == i + 1
    assert log == list(sizes) and fn.first_shape.dynamic
    # static at 3: the graph of the write, then the resumed frame's; from 5 the dynamic compile,
    # its resumed frame's size a symbol (again after the reset)
    assert counting.shapes[:2] == [((),), ((3,), ())] and counting.symbolic[:2] == [False, False]
    assert counting.symbolic.count(True) == 2 and len(counting.shapes) <= 8  # 3 graphs a compile at most


def test_python_work_before_a_functions_first_graph_runs_once_a_call():
    """A function whose first graph comes after a graph break: a new shape's compile is chosen
    before the call, so the Python work before the break is never done twice."""
    from graphify.compile.compiled import compile_for_captures

    appended = []

    def python_first(x):  # no graph before the break: the first graph dynamo builds is after it
        appended.append(1)
        torch._dynamo.graph_break()
        return x * 2

    fn = compile_for_captures("python_first", python_first, {"backend": Counting()})
    for n in (3, 5, 7):
        x = torch.randn(n)
        assert torch.equal(fn(x), x * 2)
    assert appended == [1, 1, 1]


def test_two_models_of_one_class_share_their_codes_first_shape_and_write_once_a_call():
    """Two graphified modules of one class share dynamo's code (and its cache entries), and so
    the first shape of that code: b's first call, at another shape than a's, goes to the dynamic
    compile; each call's writes are made once."""
    from graphify.compile.compiled import compile_for_captures

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.count.add_(1)
            torch._dynamo.graph_break()
            return x * 2 + self.count

    counting = Counting()
    a, b = Step(), Step()
    fa, fb = (compile_for_captures(name, m, {"backend": counting}) for name, m in (("a", a), ("b", b)))
    for i, (fn, m, n) in enumerate([(fa, a, 3), (fb, b, 3), (fb, b, 5), (fa, a, 3), (fb, b, 7), (fa, a, 5)]):
        before = m.count.item()
        x = torch.randn(n)
        assert torch.equal(fn(x), x * 2 + (before + 1)) and m.count.item() == before + 1
    assert a.count.item() == 3 and b.count.item() == 3 and fa.first_shape is fb.first_shape and fa.first_shape.dynamic


def test_a_transformers_model_graphified_anew_per_shape_compiles_static_once_then_one_dynamic():
    """transformers wraps every model's `forward` in one closure's code, so the first shape is
    kept per model class, not per code: a BERT graphified anew for each batch compiles its
    first batch static and one dynamic compile for every other (a record per wrapper compiled
    each batch static, an entry each on that one code, until dynamo's limit ran them eagerly)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    counting = Counting()
    with torch.no_grad():
        for n in range(2, 12):
            g = graphify(model, options=Options(backend="sim", compile={"backend": counting}))
            for _ in range(3):
                ids = torch.randint(0, 64, (n, 8))
                torch.testing.assert_close(g(input_ids=ids)[0], model(input_ids=ids)[0])
    assert counting.symbolic == [False, True]


def test_a_static_compile_made_again_for_the_same_arguments_leaves_the_rest_to_the_dynamic_one():
    """What the arguments' signature does not see can change the static compile's guards: a
    tensor the function reads changing size, another model of the class with other parameter
    shapes. The second compile of the static one sends every later call to the dynamic compile,
    not a static compile per change (one each, up to dynamo's recompile limit, then eagerly)."""
    from graphify.compile.compiled import compile_for_captures

    counting, table = Counting(), [torch.randn(2, 4)]
    fn = compile_for_captures("lookup", lambda x: x @ table[0].T, {"backend": counting})
    for k in range(2, 12):
        table[0] = torch.randn(k, 4)
        x = torch.randn(3, 4)
        assert torch.equal(fn(x), x @ table[0].T)
    assert len(counting.symbolic) <= 3 and fn.first_shape.dynamic

    class Head(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.proj = torch.nn.Linear(16, width)

        def forward(self, x):
            return self.proj(x).relu()

    counting = Counting()
    heads = [Head(width) for width in range(1, 9)]
    fns = [compile_for_captures(f"head{i}", h, {"backend": counting}) for i, h in enumerate(heads)]
    for batch in (4, 6):
        for f, h in zip(fns, heads):
            x = torch.randn(batch, 16)
            torch.testing.assert_close(f(x), h(x))
    # one compile a model, as a dynamic compile from the start made (parameters' shapes stay static),
    # and two static ones: not a static and a dynamic compile a model
    assert len(counting.symbolic) <= len(heads) + 2 and counting.symbolic[:2] == [False, False]


class _Holder:
    def __init__(self):
        self.t = torch.ones(2)


def test_the_first_shape_is_shared_by_one_classs_modules_under_one_backend_and_no_further():
    """`first_shape`: a class's modules and their bound `forward`s share one record under one
    backend, closures or not (transformers wraps every model's `forward` in one closure's code);
    another backend, another class, a closure or a partial each have their own."""
    import functools

    from graphify.compile.shape_policy import first_shape

    one, other = Counting(), Counting()  # backends: any object a weak key holds
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(3, 3)
    shared = first_shape(a, one)
    assert first_shape(b, one) is shared and first_shape(b.forward, one) is shared
    assert first_shape(a, other) is not shared and first_shape(torch.nn.ReLU(), one) is not shared
    scale = 2.0
    closure = lambda x: x * scale  # noqa: E731
    assert first_shape(closure, one) is not first_shape(closure, one)
    part = functools.partial(torch.add, other=1)
    assert first_shape(part, one) is not first_shape(part, one)
    assert shared.static("s") and shared.static("s") and not shared.static("t") and not shared.static("s")
    assert first_shape(b, one).dynamic and not first_shape(a, other).dynamic


def test_a_calls_signature_holds_its_tensors_shapes_and_plain_values_and_nothing_else():
    """`call_signature`: equal for calls a static compile serves alike, different for another
    shape, stride, dtype or plain value, None for a call carrying any other object (a cache)."""
    from graphify.compile.shape_policy import call_signature

    def sig(*args, **kwargs):
        return call_signature(args, kwargs)

    base = sig(torch.ones(2, 3), 3, None, mask=torch.ones(3), use_cache=True, dtype=torch.float16)
    assert base is not None
    assert base == sig(torch.zeros(2, 3), 3, None, mask=torch.randn(3), use_cache=True, dtype=torch.float16)
    for other in (sig(torch.ones(4, 3), 3, None, mask=torch.ones(3), use_cache=True, dtype=torch.float16),
                  sig(torch.ones(3, 2).t(), 3, None, mask=torch.ones(3), use_cache=True, dtype=torch.float16),
                  sig(torch.ones(2, 3, dtype=torch.float64), 3, None, mask=torch.ones(3), use_cache=True,
                      dtype=torch.float16),
                  sig(torch.ones(2, 3), 4, None, mask=torch.ones(3), use_cache=True, dtype=torch.float16),
                  sig(torch.ones(2, 3), 3, None, mask=torch.ones(3), use_cache=False, dtype=torch.float16)):
        assert other is not None and other != base
    assert sig((torch.ones(1), [torch.ones(1), {"a": 2.0}])) is not None
    assert sig(torch.ones(2), past_key_values=_Holder()) is None
    assert sig([_Holder()]) is None and sig(fn=len) is None


def test_a_static_compile_made_again_is_seen_with_options_that_cannot_be_shared():
    """Options holding an unhashable value give a function a backend of its own: the static
    compile's recompiles are still counted on the backend it compiles with."""
    from graphify.compile.compiled import compile_for_captures

    class TakingOptions(Counting):  # torch.compile hands a backend the options as keywords
        def __call__(self, gm, example_inputs, **options):
            return super().__call__(gm, example_inputs)

    counting, table = TakingOptions(), [torch.randn(2, 4)]
    fn = compile_for_captures("lookup", lambda x: x @ table[0].T,
                              {"backend": counting, "options": {"unhashable": [1]}})
    for k in range(2, 8):
        table[0] = torch.randn(k, 4)
        x = torch.randn(3, 4)
        assert torch.equal(fn(x), x @ table[0].T)
    assert fn.first_shape.dynamic and len(counting.symbolic) <= 3
