"""Shared fixtures: the backend matrix (sim on CPU everywhere, cuda where a GPU exists)."""

from __future__ import annotations

import os

# Several test processes (pytest-xdist) share the cores: one intra-op thread each, and for the
# processes tests start (benchmarks, ranks, compile workers). With torch's default of a thread
# a core, their OpenMP threads spin on cores the other processes hold: a tiny model's
# 256-token generation took 40 s beside two busy processes instead of 14 (2-core machine).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings

from graphify.compile import aot as _aot  # noqa: E402

settings.register_profile("ci", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=600)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

if os.environ.get("OMP_NUM_THREADS") == "1":
    torch.set_num_threads(1)  # torch may have been imported before this file (a plugin)
HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
# The simulation's compiled functions (AOTAutograd's aot_eager) are saved whole from torch 2.13;
# torch 2.11 (the GPU machines') saves only inductor's, so there only the CUDA tests load them.
saves_aot_eager = pytest.mark.skipif(not _aot.saves("aot_eager"),
                                     reason="this torch saves only inductor's compiled functions whole (graphify.compile.aot.saves)")

BACKENDS = [
    pytest.param(("sim", "cpu"), id="sim-cpu"),
    pytest.param(("cuda", "cuda"), id="cuda", marks=[pytest.mark.cuda, requires_cuda]),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """(backend name, device) for behavioural tests that must hold on every backend."""
    return request.param


@pytest.fixture(autouse=True)
def _compiled_functions_kept_per_test(tmp_path, monkeypatch):
    """Compiled functions kept for later processes (`graphify.compile.aot_store`) go to a folder of the
    test's own: a test never starts from what another test, or an earlier run, compiled."""
    from graphify.compile import aot_store as _aot_store

    monkeypatch.setattr(_aot_store, "DIRECTORY", str(tmp_path / "graphify-whole"))


@pytest.fixture(scope="module")
def one_compile_worker():
    """One compile worker for a module's tests (`usefixtures`): a worker's start costs
    seconds, and it imports the test module as written, whatever a test changed here."""
    from graphify.compile.background import line as _background

    _background.reset()
    yield
    _background.reset()


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


# -- counting what calls ran as ------------------------------------------------------------
# A graphified call that equals eager proves nothing by itself: an always-eager graphify
# equals eager too. Tests that compare with eager therefore also count, from `g.stats`,
# what the calls ran as.


def calls_by_mode(g) -> dict:
    """{Mode.NONE: n, Mode.PIECEWISE: n, Mode.FULL: n}: how many of `g`'s calls ran in each
    runtime mode (zeros included)."""
    return {r.mode: r.calls for r in g.stats.by_mode()}


def counted(*, full: int = 0, piecewise: int = 0, none: int = 0) -> dict:
    """The `calls_by_mode` a test expects: `counted(full=3, none=1)`."""
    from graphify import Mode

    return {Mode.NONE: none, Mode.PIECEWISE: piecewise, Mode.FULL: full}


def replayed(g) -> int:
    """Calls of `g` that replayed a graph (FULL or PIECEWISE); always 0 for eager calls."""
    from graphify import Mode

    by_mode = calls_by_mode(g)
    return by_mode[Mode.FULL] + by_mode[Mode.PIECEWISE]


def expected_calls(mode, batches, largest: int) -> dict:
    """`counted(...)` for calls of a callable captured in (resolved) `mode` with sizes up to
    `largest`, one call per `(num_tokens, uniform)` in `batches`: vLLM's dispatch stated
    apart from graphify's. Above the largest size: eager. Otherwise FULL graphs take every
    batch in FULL, uniform decode batches only in the dual modes (the rest: eagerly in
    FULL_DECODE_ONLY, in pieces in FULL_AND_PIECEWISE); PIECEWISE takes every batch."""
    from graphify import Mode

    mode = Mode.parse(mode) if isinstance(mode, str) else mode
    out = counted()
    for tokens, uniform in batches:
        if tokens > largest or mode is Mode.NONE:
            ran = Mode.NONE
        elif mode is Mode.FULL or (mode.is_dual and uniform):
            ran = Mode.FULL
        else:
            ran = mode.mixed_mode()
        out[ran] += 1
    return out


def pytest_collection_finish(session):
    """Freeze what collection made (torch, transformers and every test module, once
    collected), as a server freezes its start-up objects: the suite's full collections
    (graphify's before a process's first capture, the benchmarks' between configurations)
    then walk only what tests make. graphify's captures keep a process's freeze."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_runtest_logreport(report):
    """With GRAPHIFY_FAILURES_LOG set (.ci/gpu sets it), each failure is appended to that
    file as it happens: a run cut by its time limit still says what failed and why."""
    path = os.environ.get("GRAPHIFY_FAILURES_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):  # once: xdist's controller reports too
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
