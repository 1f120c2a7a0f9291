"""What a graph launches that a library caches and may free, kept alive as long as the graph.

A CUDA graph records kernel launches with their arguments by value: device pointers into
objects a library owns (a cuFFT plan and its work area, a cuBLAS workspace). If the library
frees such an object while the graph lives, the next replay reads freed memory or crashes
the process. The libraries a graphified function may call, and what graphify does:

| library object | how it can be freed under a live graph | what graphify does |
|---|---|---|
| torch cuFFT plans | LRU eviction (`cufft_plan_cache.max_size`, 4096 by default), `.clear()` | pins the device's cache while graphs that ran cuFFT live: no eviction; a new `max_size` or a `clear()` waits (with a warning) until they are released |
| CuPy cuFFT plans (and their work areas) | LRU eviction (16 plans per thread and device), `set_size`, `clear` | the table holds a reference to every plan its captures used |
| torch cuBLAS / cuBLASLt workspaces | `torch._C._cuda_clearCublasWorkspaces()`, which torch.compile's CUDA graph trees call around every recording | each capture allocates its workspace inside the graph's own pool (cleared before it, as graph trees do), so a later clear returns it to that pool, never to eager code |
| torch work areas of cuFFT, cuSOLVER, CUB; CuPy CUB temporaries | allocated per call from the caching allocator | allocated inside the capture, from the graph's pool, which lives as long as its graphs |
| cuBLAS / cuSOLVER / cuSPARSE handles (torch) | pooled per device and thread, never destroyed before exit | nothing to do |
| CuPy cuBLAS, cuSOLVER, cuRAND, cuSPARSE | CuPy refuses to call them during a capture | the capture is rejected with advice (`graphify.capture.failed`) |

`LibraryHold` is what one table keeps; `holding(...)` is the context a table's captures
run in. Nothing here runs per call.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from typing import Any

import torch

__all__ = ["LibraryHold", "holding", "torch_fft_seen", "pinned_cufft_devices"]

log = logging.getLogger("graphify")

_FFT_PREFIX = "aten::_fft_"
_PIN_SIZE = 2**31 - 1  # torch accepts up to int64 max; this is "never evict" in practice
_lock = threading.RLock()
_pins: dict[int, list] = {}  # device -> [live holds, the max_size the user asked for]
_seen = threading.local()  # torch cuFFT calls the op guard saw inside the current window
_watch_installed = False


def torch_fft_seen(name: str, args) -> None:
    """Called by the op guard for every op: notes a torch cuFFT call on a CUDA tensor."""
    if name.startswith(_FFT_PREFIX) and args and getattr(args[0], "is_cuda", False):
        _seen.fft = True


def pinned_cufft_devices() -> dict[int, int]:
    """{device: live holds} of torch cuFFT plan caches graphify keeps from evicting."""
    with _lock:
        return {d: entry[0] for d, entry in _pins.items()}


class LibraryHold:
    """What one table keeps alive for its graphs: a pin on torch's cuFFT plan cache of its
    device, and references to CuPy cuFFT plans. `release()` lets go (idempotent); a hold
    that is garbage collected lets go by itself."""

    def __init__(self):
        self.cufft_device: int | None = None
        self.cupy_plans: list = []
        self._finalizer = weakref.finalize(self, _release, self.__dict__)

    @property
    def held(self) -> bool:
        return self.cufft_device is not None or bool(self.cupy_plans)

    def release(self) -> None:
        self._finalizer()

    def __repr__(self) -> str:
        return f"LibraryHold(cufft_device={self.cufft_device}, cupy_plans={len(self.cupy_plans)})"


def _release(state: dict) -> None:
    device, state["cufft_device"] = state.get("cufft_device"), None
    state["cupy_plans"] = []
    if device is not None:
        _unpin(device)


@contextlib.contextmanager
def holding(hold: LibraryHold, device: torch.device | None, *, uses_fft: bool = False):
    """Run a table's captures so that what they launch stays alive with `hold`.

    On CUDA, torch's cuFFT cache of `device` is pinned for the window (nothing is evicted
    between a warm-up and its capture) and stays pinned by `hold` if the captures ran
    cuFFT: `uses_fft` (a split function whose trace holds an FFT op), an FFT the op guard
    saw, or a plan cache that grew. CuPy cuFFT plans used in the window are recorded into
    `hold`. cuBLAS workspaces are cleared on the way out, so none made inside the window
    outlives it in torch's per-stream table (see the module table)."""
    cuda = device is not None and device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    pinned_here = False
    size_before = 0
    if cuda and hold.cufft_device is None:
        _pin(index)
        pinned_here = True
        size_before = torch._cufft_get_plan_cache_size(index)
    previous_seen = getattr(_seen, "fft", False)
    _seen.fft = False
    try:
        with _recording_cupy_plans(hold.cupy_plans):
            yield hold
    finally:
        used = uses_fft or _seen.fft
        _seen.fft = previous_seen
        if pinned_here:
            used = used or torch._cufft_get_plan_cache_size(index) > size_before
            if used:
                hold.cufft_device = index
            else:
                _unpin(index)
        if cuda:
            clear_cublas_workspaces()


def clear_cublas_workspaces() -> None:
    """Drop torch's per-(handle, stream) cuBLAS and cuBLASLt workspaces. Called before each
    capture (the capture then allocates its own inside the graph's pool) and after a
    table's captures (so that one is not kept in torch's table, where any later clear
    would free it)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


# -- torch cuFFT: pin the plan cache ------------------------------------------------------
def _pin(device: int) -> None:
    with _lock:
        entry = _pins.get(device)
        if entry is None:
            _install_watch()
            entry = _pins[device] = [0, torch._cufft_get_plan_cache_max_size(device)]
            if entry[1] < _PIN_SIZE:
                torch._cufft_set_plan_cache_max_size(device, _PIN_SIZE)
        entry[0] += 1


def _unpin(device: int) -> None:
    with _lock:
        entry = _pins.get(device)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] <= 0:
            del _pins[device]
            torch._cufft_set_plan_cache_max_size(device, entry[1])  # evicts down to what the user asked


def _install_watch() -> None:
    """Route `cufft_plan_cache[i].max_size = n` and `.clear()` through the pins: while a
    device is pinned, a new max_size is remembered (applied when the last graph using the
    cache is released) and clear() is skipped, each with a warning; otherwise they do what
    torch does."""
    global _watch_installed
    if _watch_installed:
        return
    cls = getattr(torch.backends.cuda, "cuFFTPlanCache", None)
    prop = cls.__dict__.get("max_size") if cls is not None else None
    if prop is None or not callable(getattr(prop, "setter", None)):
        _watch_installed = True
        return
    real_set, real_clear = prop.setter, cls.clear

    def set_max_size(device: int, value: int) -> None:
        with _lock:
            entry = _pins.get(device)
            if entry is None:
                return real_set(device, value)
            if not isinstance(value, int) or value < 0:
                raise RuntimeError(f"cuFFT plan cache max_size must be a non-negative int, got {value!r}")
            entry[1] = value
        log.warning(
            "graphify: torch's cuFFT plan cache on device %d holds plans that live CUDA graphs replay; "
            "max_size=%d takes effect when they are released (g.release())", device, value,
        )

    def clear(self) -> None:
        with _lock:
            pinned = self.device_index in _pins
        if not pinned:
            return real_clear(self)
        log.warning(
            "graphify: cufft_plan_cache[%d].clear() skipped: live CUDA graphs replay plans in it; release "
            "them first (g.release())", self.device_index,
        )

    prop.setter = set_max_size
    cls.clear = clear
    _watch_installed = True


# -- CuPy cuFFT: hold the plans ------------------------------------------------------------
class _RecordingPlanCache:
    """CuPy's plan cache as `cupy.fft` sees it inside a window: every plan it hands out or
    is given is appended to `kept` before CuPy's LRU can drop it."""

    def __init__(self, real, kept: list):
        self._real, self._kept = real, kept

    def _keep(self, plan) -> None:
        if plan is not None and all(p is not plan for p in self._kept):
            self._kept.append(plan)

    def get(self, key, default=None):
        plan = self._real.get(key, default)
        self._keep(plan)
        return plan

    def __getitem__(self, key):
        plan = self._real[key]
        self._keep(plan)
        return plan

    def __setitem__(self, key, plan) -> None:
        self._keep(plan)  # first: a disabled or full cache may drop it at once
        self._real[key] = plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def _recording_cupy_plans(kept: list):
    """Within the window, `cupy.fft` reaches its plan cache through a recorder (only if
    CuPy's FFT module is already imported: graphify never imports CuPy itself)."""
    fft = sys.modules.get("cupy.fft._fft")
    real = getattr(fft, "get_plan_cache", None)
    if real is None:
        yield
        return
    fft.get_plan_cache = lambda: _RecordingPlanCache(real(), kept)
    try:
        yield
    finally:
        fft.get_plan_cache = real
