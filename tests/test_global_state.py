"""torch's process-wide settings (autocast, default dtype, deterministic algorithms, TF32,
attention backends) at capture, compared before every replay: graphs never answer a call
that eager would run with other kernels. `torch.compile` guards the same settings (dynamo's
global-state guard); these tests fail where graphify replays across a change."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from conftest import calls_by_mode
from graphify import Mode, Options, StateChangedError, graphify
from graphify.reads.torch_settings import GlobalState
from graphify.compile.background.job_pickle import _apply_precision, precision_settings


@contextlib.contextmanager
def setting(read, write, value):
    """A process-wide torch setting at `value` for the block, put back after."""
    before = read()
    write(value)
    try:
        yield
    finally:
        write(before)


def default_dtype(dtype):
    return setting(torch.get_default_dtype, torch.set_default_dtype, dtype)


def deterministic():
    return setting(torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms, True)


def autocast(device):
    return torch.autocast(device, dtype=torch.bfloat16)


def math_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


SETTINGS = {  # name -> (a context that changes a setting, whether the output's dtype moves with it)
    "autocast": (autocast, True),
    "default dtype": (lambda device: default_dtype(torch.float64), True),
    "deterministic algorithms": (lambda device: deterministic(), False),
    "attention backends (sdpa_kernel)": (lambda device: math_attention(), False),
}


def stepper(device):
    """A step over a weight it holds: a matmul (autocast moves it), a factory without a dtype
    (the default dtype moves it), and attention (the enabled backends pick its kernel)."""
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(99)).to(device)

    def step(x):
        h = x @ w.to(x.dtype) + torch.ones(x.shape[-1], device=x.device)
        q = h.view(x.shape[0], 2, -1, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(x.shape)

    return step


def inputs(device, seed=0):
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_call_under_another_setting_is_not_answered_by_graphs_captured_before(backend, setting):
    name, device = backend
    change, moves_dtype = SETTINGS[setting]
    step = stepper(device)
    g = graphify(step, options=Options(backend=name))
    with torch.no_grad():
        for seed in range(3):  # captured on the second call, replayed on the third
            x = inputs(device, seed)
            torch.testing.assert_close(g(x), step(x), rtol=0, atol=0)
        replays = calls_by_mode(g)[Mode.FULL]
        assert replays >= 1
        with change(device):
            for seed in range(4, 7):  # never the old graphs; a graph of its own once captured under it
                x = inputs(device, seed)  # the same arguments: only the setting moved
                want, got = step(x), g(x)
                assert got.dtype == want.dtype
                torch.testing.assert_close(got, want, rtol=0, atol=0)
                if seed == 4:
                    assert calls_by_mode(g)[Mode.FULL] == replays  # the first call under it replayed nothing
        if moves_dtype:
            assert want.dtype != torch.float32
        x = inputs(device, 8)  # back under the first settings: eager's answer again
        torch.testing.assert_close(g(x), step(x), rtol=0, atol=0)


def test_an_explicit_capture_refuses_a_call_under_another_setting_and_names_it(backend):
    name, device = backend
    x, step = inputs(device), stepper(device)
    g = graphify(step, mode="FULL", sizes=[4], options=Options(backend=name)).capture(x)
    with torch.no_grad():
        torch.testing.assert_close(g(x), step(x), rtol=0, atol=0)
        with default_dtype(torch.float64), pytest.raises(StateChangedError, match="default_dtype"):
            g(x)
        with math_attention(), pytest.raises(StateChangedError, match=r"attention backends enabled: .*flash"):
            g(x)
        torch.testing.assert_close(g(x), step(x), rtol=0, atol=0)  # the settings back: it replays


def test_grad_mode_alone_does_not_refuse_a_replay(backend):
    """Graphs replay without autograd in either grad mode (a call in grad mode with tensors
    that require grad is warned about, `graphify.reads.table_reads`): grad mode is not a setting here."""
    name, device = backend
    x, step = inputs(device), stepper(device)
    with torch.no_grad():
        g = graphify(step, mode="FULL", sizes=[4], options=Options(backend=name)).capture(x)
    before = calls_by_mode(g)[Mode.FULL]
    torch.testing.assert_close(g(x), step(x), rtol=0, atol=0)  # grad mode on, nothing requires grad
    with torch.inference_mode():
        torch.testing.assert_close(g(x), step(x), rtol=0, atol=0)
    assert calls_by_mode(g)[Mode.FULL] == before + 2


def test_the_record_compares_the_settings_it_was_taken_under():
    state = GlobalState.take("f")
    assert state.same()
    with torch.no_grad():
        assert state.same()
    with default_dtype(torch.float64):
        assert not state.same() and "default_dtype" in state.describe()
    with autocast("cpu"):
        assert not state.same() and "autocast" in state.describe()
    with math_attention():
        assert not state.same() and "flash (True -> False)" in state.error_text()
    precision = precision_settings()  # flipping the legacy switch back leaves "ieee" where it was "none"
    torch.backends.cuda.matmul.allow_tf32 = not torch.backends.cuda.matmul.allow_tf32
    try:
        # (torch 2.15's global-state record names the setting `cuda_matmul_precision`; earlier ones `allow_tf32`)
        assert not state.same() and ("allow_tf32" in state.describe() or "cuda_matmul_precision" in state.describe())
    finally:
        _apply_precision(precision)
    assert state.same() and precision_settings() == precision
    with setting(torch._C._get_cudnn_deterministic, torch._C._set_cudnn_deterministic, True):
        assert not state.same() and "cuDNN's switches: deterministic (False -> True)" in state.error_text()
    assert state.same()


def test_a_compile_job_carries_the_callers_attention_backends_to_its_worker():
    """The worker's trace bakes in the attention kernel the enabled backends give: it traces
    under the caller's choice, read when the job is sent and set in the worker."""
    from graphify.reads.torch_settings import sdp_flags, set_sdp_flags
    from graphify.compile.background.job_pickle import applied, torch_state

    before = sdp_flags()
    with math_attention():
        state = torch_state()
    assert state["attention_backends"] == (False, False, True, False) != before
    try:
        with applied(state):
            assert sdp_flags() == (False, False, True, False)
    finally:
        set_sdp_flags(before)
    assert sdp_flags() == before


def test_the_cpu_thread_count_alone_does_not_refuse_a_replay():
    """dynamo's guard holds the thread count, which no graph's kernel reads: where it alone
    moved the record is taken again; moved with a setting that counts, it still refuses."""
    state = GlobalState.take("f")
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert state.same() and state.same()
        with default_dtype(torch.float64):
            assert not state.same() and "default_dtype" in state.describe()
    finally:
        torch.set_num_threads(threads)
    assert state.same()
