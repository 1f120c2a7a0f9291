"""graphify.backends.keepalive on the CPU, with stand-ins for what only CUDA has: CuPy's plan cache
(a fake `cupy.fft._fft` module whose LRU holds two plans) and torch's cuFFT plan cache
(its four functions replaced by a dict). The GPU cases are tests/test_cuda_eviction.py."""

from __future__ import annotations

import gc
import sys
import types
import weakref

import pytest
import torch

import graphify.backends.keepalive as keepalive
from graphify.backends.keepalive import LibraryHold, holding, pinned_cufft_devices, torch_fft_seen


class Plan:
    pass


class LRU:
    """CuPy's PlanCache as far as cupy.fft uses it: get, [key] = plan, and eviction."""

    def __init__(self, size: int):
        self.size, self.plans = size, {}

    def get(self, key, default=None):
        return self.plans.get(key, default)

    def __setitem__(self, key, plan):
        self.plans[key] = plan
        while len(self.plans) > self.size:
            self.plans.pop(next(iter(self.plans)))


@pytest.fixture
def fake_cupy(monkeypatch):
    cache = LRU(2)
    fft = types.ModuleType("cupy.fft._fft")
    fft.get_plan_cache = lambda: cache

    def rfft(n):  # what cupy.fft does: look the plan up, make and cache it on a miss
        c = fft.get_plan_cache()
        plan = c.get(n)
        if plan is None:
            plan = Plan()
            c[n] = plan
        return plan

    monkeypatch.setitem(sys.modules, "cupy.fft._fft", fft)
    return fft, cache, rfft


def test_cupy_plans_used_in_a_window_outlive_their_eviction(fake_cupy):
    fft, cache, rfft = fake_cupy
    hold = LibraryHold()
    outside = weakref.ref(rfft(100))  # made before the window: not the graph's
    with holding(hold, None):
        used = [weakref.ref(rfft(n)) for n in (1, 2, 4)]  # the third evicts the first from the 2-plan cache
        again = rfft(4)  # a hit is recorded once
    assert fft.get_plan_cache() is cache  # the recorder is gone after the window
    assert len(hold.cupy_plans) == 3 and again in hold.cupy_plans
    del again
    for n in range(10, 20):
        rfft(n)  # eager calls evict everything
    gc.collect()
    assert all(r() is not None for r in used) and outside() is None
    hold.release()
    gc.collect()
    assert all(r() is None for r in used)


def test_a_plan_given_to_a_disabled_cache_is_kept(fake_cupy):
    fft, cache, rfft = fake_cupy
    cache.size = 0  # CuPy drops it at once
    hold = LibraryHold()
    with holding(hold, None):
        plan = weakref.ref(rfft(8))
    gc.collect()
    assert plan() is not None


@pytest.fixture
def fake_torch_cufft(monkeypatch):
    state = {"max": 2, "size": 0, "clears": 0}
    monkeypatch.setattr(torch, "_cufft_get_plan_cache_max_size", lambda d: state["max"], raising=False)
    monkeypatch.setattr(torch, "_cufft_set_plan_cache_max_size", lambda d, v: state.update(max=v), raising=False)
    monkeypatch.setattr(torch, "_cufft_get_plan_cache_size", lambda d: state["size"], raising=False)
    monkeypatch.setattr(torch, "_cufft_clear_plan_cache", lambda d: state.update(clears=state["clears"] + 1), raising=False)
    monkeypatch.setattr(keepalive, "clear_cublas_workspaces", lambda: None)
    cls = torch.backends.cuda.cuFFTPlanCache
    prop = cls.__dict__["max_size"]
    monkeypatch.setattr(prop, "getter", torch._cufft_get_plan_cache_max_size)
    monkeypatch.setattr(prop, "setter", torch._cufft_set_plan_cache_max_size)
    monkeypatch.setattr(cls, "clear", lambda self: torch._cufft_clear_plan_cache(self.device_index))
    monkeypatch.setattr(keepalive, "_watch_installed", False)
    return state, cls(0)


CUDA0 = torch.device("cuda", 0)


def test_a_window_that_ran_cufft_keeps_torchs_cache_pinned(fake_torch_cufft, caplog):
    state, cache = fake_torch_cufft
    hold = LibraryHold()
    with holding(hold, CUDA0):
        assert state["max"] == keepalive._PIN_SIZE  # nothing is evicted between a warm-up and its capture
        state["size"] += 3  # the captures made plans
    assert hold.cufft_device == 0 and pinned_cufft_devices() == {0: 1}
    with pytest.raises(RuntimeError, match="non-negative int"):
        cache.max_size = -1  # still validated while pinned
    cache.max_size = 1  # the user's word is kept for later
    cache.clear()  # skipped: the graphs' plans are in it
    assert state["max"] == keepalive._PIN_SIZE and state["clears"] == 0
    assert "takes effect when they are released" in caplog.text and "clear() skipped" in caplog.text
    hold.release()
    assert state["max"] == 1 and pinned_cufft_devices() == {}
    cache.clear()
    assert state["clears"] == 1  # unpinned: torch's own behaviour again


def test_a_window_without_cufft_unpins_and_pins_are_counted(fake_torch_cufft):
    state, _ = fake_torch_cufft
    quiet = LibraryHold()
    with holding(quiet, CUDA0):
        pass
    assert quiet.cufft_device is None and state["max"] == 2 and pinned_cufft_devices() == {}
    holds = [LibraryHold(), LibraryHold()]
    with holding(holds[0], CUDA0, uses_fft=True):  # a split function whose trace holds an FFT op
        pass
    with holding(holds[1], CUDA0):
        torch_fft_seen("aten::_fft_r2c", (types.SimpleNamespace(is_cuda=True),))  # what the op guard reports
    assert pinned_cufft_devices() == {0: 2}
    holds[0].release()
    holds[0].release()  # idempotent
    assert state["max"] == keepalive._PIN_SIZE
    del holds[1]
    gc.collect()  # a dropped hold lets go by itself
    assert state["max"] == 2 and pinned_cufft_devices() == {}


def test_the_guard_reports_only_cuda_ffts():
    keepalive._seen.fft = False
    torch_fft_seen("aten::_fft_r2c", (torch.randn(4),))  # a CPU tensor: not cuFFT
    torch_fft_seen("aten::mm", (types.SimpleNamespace(is_cuda=True),))
    assert keepalive._seen.fft is False
