"""`graphify.transforms.one_row_linear`: with `Options(compile={"gemv": True})` every linear of dynamo's
graph becomes `graphify::one_row_linear`, which runs the Triton GEMV for one row of bf16/fp16
on CUDA and `F.linear` for everything else; the compiled line gives eager's answers."""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from conftest import requires_cuda, saves_aot_eager
from graphify import Options, graphify
from graphify.compile import aot as _aot
from graphify.compile.compiled import KeptCompiles
from graphify.transforms.one_row_linear import GEMV_ROWS, route_one_row_linears, takes_gemv


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


ONE_ROW = dict(device_type="cuda", x_dtype=torch.bfloat16, w_dtype=torch.bfloat16, rows=1, n=4096, k=4096,
               w_contiguous=True, triton_ready=True)


def test_the_gemv_takes_one_row_of_bf16_or_fp16_on_cuda_and_nothing_else():
    assert takes_gemv(**ONE_ROW)
    assert takes_gemv(**{**ONE_ROW, "x_dtype": torch.float16, "w_dtype": torch.float16})
    for change in ({"device_type": "cpu"}, {"x_dtype": torch.float32, "w_dtype": torch.float32},
                   {"w_dtype": torch.float16}, {"rows": GEMV_ROWS + 1}, {"rows": 0}, {"k": 4100},
                   {"w_contiguous": False}, {"triton_ready": False}):
        assert not takes_gemv(**{**ONE_ROW, **change}), change


@given(rows=st.integers(0, 64), n=st.integers(1, 200_000), k=st.integers(1, 20_000))
def test_the_choice_depends_on_rows_and_k_alone_for_a_cuda_bf16_weight(rows, n, k):
    got = takes_gemv(**{**ONE_ROW, "rows": rows, "n": n, "k": k})
    assert got == (1 <= rows <= GEMV_ROWS and k % 8 == 0)


class Block(torch.nn.Module):
    """Linears with and without bias, one called with bias as a keyword, one spelled with a
    weight keyword (left as written)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 16, bias=False)
        self.c = torch.nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        z = F.linear(y, self.c, bias=None)
        return y, z, F.linear(y, weight=self.c)


def compiled(fn, gemv=True):
    kept = KeptCompiles("aot_eager", rewrites=("gemv",) if gemv else ())
    return torch.compile(fn, backend=kept, dynamic=True), kept


@pytest.mark.parametrize("rows", [1, 5])
def test_routed_linears_give_f_linear_bit_for_bit_off_cuda(rows):
    torch.manual_seed(0)
    block = Block().eval()
    fn, kept = compiled(block)
    with torch.no_grad():
        x = torch.randn(rows, 16)
        for got, want in zip(fn(x), block(x)):
            assert torch.equal(got, want)
    assert kept.counts.get("gemv", 0) == 3  # a, b, and the bias keyword; the weight keyword stays as written


def test_without_the_option_nothing_is_routed():
    fn, kept = compiled(Block().eval(), gemv=False)
    with torch.no_grad():
        fn(torch.randn(2, 16))
    assert kept.counts.get("gemv", 0) == 0


def test_a_graph_without_linears_is_left_untouched():
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    code = gm.code
    assert route_one_row_linears(gm) == 0 and gm.code == code


def test_options_name_a_gemv_that_is_not_a_bool():
    with pytest.raises(TypeError, match="'gemv' must be True or False"):
        Options(compile={"gemv": "yes"})


def tiny_llama(device="cpu", dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(5)).to(device)
    return model, dict(input_ids=ids, max_new_tokens=10, do_sample=False, cache_implementation="static",
                       output_logits=True, return_dict_in_generate=True)


def test_the_one_line_with_the_gemv_equals_eager_generate_and_routes_every_projection():
    from graphify.compile.compiled import _BACKENDS

    model, call = tiny_llama()
    want = model.generate(**call, disable_compile=True)
    model.forward = graphify(model.forward, options=Options(compile={"backend": "aot_eager", "gemv": True}))
    got = model.generate(**call)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-5, rtol=1e-5)
    assert max(b.counts["gemv"] for b in _BACKENDS.values() if "gemv" in b.rewrites) >= 2 * 7 + 1  # 7 a layer and the head


@pytest.mark.usefixtures("one_compile_worker")
@pytest.mark.skipif(not _aot.available(), reason="this torch cannot save compiled functions whole")
@pytest.mark.parametrize("backend", [
    pytest.param(("cpu", "aot_eager"), id="sim-cpu", marks=saves_aot_eager),
    pytest.param(("cuda", "inductor"), id="cuda", marks=[pytest.mark.cuda, requires_cuda]),
])
def test_the_background_line_saves_the_routed_linears_and_loads_them_here(backend):
    device, compiler = backend
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(device, dtype)
    eager = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(device, dtype)
    eager.load_state_dict(model.state_dict())
    model.forward = graphify(model.forward, options=Options(compile={"background": True, "backend": compiler,
                                                                      "gemv": True}))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 64, device=device, dtype=dtype)
            torch.testing.assert_close(model(x), eager(x), **tol)
        assert model.forward.wait_compiles(240)
        (ticket,) = model.forward._first_use.jobs.tickets.values()
        assert ticket.state == "ready", ticket.error
        assert ticket.loaded is not None, ticket.load_error
        with open(ticket.aot_path, "rb") as f:
            assert b"one_row_linear" in f.read()  # the worker's compile routed them
        for _ in range(4):
            x = torch.randn(1, 64, device=device, dtype=dtype)
            torch.testing.assert_close(model(x), eager(x), **tol)
    assert model.forward._first_use.spec.compiled.aot_loads.calls > 0


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_op_on_cuda_runs_the_gemv_at_one_row_and_f_linear_above(dtype):
    from graphify.models import _triton_gemv

    if not _triton_gemv.available():
        pytest.skip("no Triton")
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(1024, 4096, device="cuda", dtype=dtype, generator=g) / 64
    bias = torch.randn(1024, device="cuda", dtype=dtype, generator=g)
    for rows in (1, 3):
        x = torch.randn(1, rows, 4096, device="cuda", dtype=dtype, generator=g)
        got = torch.ops.graphify.one_row_linear(x, w, bias)
        exact = F.linear(x.float(), w.float(), bias.float())
        want = F.linear(x, w, bias)
        if rows > GEMV_ROWS:
            assert torch.equal(got, want)
        else:
            gemv = _triton_gemv.gemv(x.reshape(1, 4096), w).reshape(1, 1, 1024) + bias
            assert torch.equal(got, gemv)  # the GEMV ran
            assert (got.float() - exact).abs().max() <= (want.float() - exact).abs().max() * 2 + 1e-2


@requires_cuda
@pytest.mark.cuda
def test_inductor_with_the_gemv_gives_eagers_tokens_in_a_bf16_generate():
    from graphify.models import _triton_gemv

    if not _triton_gemv.available():
        pytest.skip("no Triton")
    from graphify.compile.compiled import _BACKENDS

    model, call = tiny_llama("cuda", torch.bfloat16)
    want = model.generate(**call, disable_compile=True)
    model.forward = graphify(model.forward, options=Options(compile={"gemv": True}))
    for _ in range(2):  # the first captures; the second replays
        got = model.generate(**call)
        assert torch.equal(got.sequences, want.sequences)
    assert max(b.counts["gemv"] for b in _BACKENDS.values() if "gemv" in b.rewrites) >= 2 * 7 + 1


@pytest.mark.parametrize("bias", [True, False])
def test_the_op_has_f_linears_gradients(bias):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    torch.autograd.gradcheck(lambda *a: torch.ops.graphify.one_row_linear(*a), (x, w, b))
    up = torch.randn(2, 3, 5, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(torch.ops.graphify.one_row_linear(x, w, b), (x, w, *([b] if bias else [])), up)
    want = torch.autograd.grad(F.linear(x, w, b), (x, w, *([b] if bias else [])), up)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def test_a_compile_with_grad_on_routes_and_trains_as_written():
    torch.manual_seed(0)
    block, twin = Block(), Block()
    twin.load_state_dict(block.state_dict())
    fn, kept = compiled(block)
    x = torch.randn(4, 16)
    sum(o.sum() for o in fn(x)).backward()
    sum(o.sum() for o in twin(x)).backward()
    assert kept.counts.get("gemv", 0) == 3
    for p, q in zip(block.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)



def test_triton_compiles_here_as_inductor_does_unless_the_user_chose(monkeypatch, tmp_path):
    import os

    from torch._inductor.runtime import compile_tasks
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    from graphify.compile.background.triton_env import as_inductor_compiles

    def inductors_rule():  # what torch's does where its wheel ships a ptxas (the CUDA wheels)
        os.environ["TRITON_PTXAS_PATH"] = "/torch/bin/ptxas"

    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", inductors_rule)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    as_inductor_compiles(0)
    assert (os.environ["TRITON_CACHE_DIR"], os.environ["TRITON_PTXAS_PATH"]) == (triton_cache_dir(0), "/torch/bin/ptxas")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/mine/ptxas")
    as_inductor_compiles(0)
    assert (os.environ["TRITON_CACHE_DIR"], os.environ["TRITON_PTXAS_PATH"]) == (str(tmp_path), "/mine/ptxas")


def test_the_compile_worker_starts_with_tritons_settings_as_inductors(monkeypatch):
    """The worker inherits them: its GEMV binaries are keyed and placed as this process looks."""
    import subprocess

    from graphify.compile.background import line as _background

    started = {}

    class Refused(Exception):
        pass

    def popen(*args, env, **kwargs):
        started.update(env)
        raise Refused

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(_background, "as_inductor_compiles", lambda: __import__("os").environ.update(
        TRITON_CACHE_DIR="/inductors/triton/0"))
    monkeypatch.setattr(subprocess, "Popen", popen)
    compiler = _background._Compiler()
    with pytest.raises(Refused):
        compiler._start()
    assert started["TRITON_CACHE_DIR"] == "/inductors/triton/0"
    assert compiler.files and not os.path.exists(compiler.files)  # a worker that never started leaves no folder


def test_a_gemv_compile_line_imports_triton_and_the_gemv_when_made(monkeypatch):
    """Not inside the call that later takes the compiled graphs in."""
    from graphify.transforms import one_row_linear as _one_row_linear

    seen = []
    monkeypatch.setattr(_one_row_linear, "triton_ready", lambda: seen.append(True) or False)
    graphify(lambda x: x * 2, options=Options(compile={"background": True}))
    assert seen == []
    graphify(lambda x: x * 2, options=Options(compile={"background": True, "gemv": True}))
    assert seen == [True]
