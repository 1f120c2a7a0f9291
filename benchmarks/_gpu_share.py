"""Two benchmark processes on one GPU without timing each other's work.

A zoo line spends most of its time compiling on the host. Two such processes on one GPU
(each pinned to half its cores) keep it busy, provided neither times its calls while the
other uses the device: a reader-writer lock on a file named by `BENCH_GPU_LOCK`.
- Device work that is not timed (eager references, first calls with their compiles and captures,
  error checks) holds it shared (`using()`); two processes may do that at once.
- Timed work (`timing()`) holds it alone, so no other process's kernels run beside the timed ones.
- Choices made by timing inside untimed work hold it alone for their timings (`alone()`,
  installed by `tune_alone()`): inductor's autotuner picks each Triton kernel's launch config
  by timing its candidates at the kernel's first run, and graphify's layout policy times
  grouped convolutions both ways. Timed beside the other process's work, a pick was chance:
  the same kernel of Llama-1B's shape at B = 8 took 267 us in one process and 182 in another
  (the SiLU-mul kernel), and the rotary kernel 78 against 198 the other way round (H200,
  `zoo-bgstatic`), and the pick stays for every timed call after.
Without `BENCH_GPU_LOCK` (one process a GPU, the default) all of these are no-ops.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import threading

__all__ = ["using", "timing", "alone", "tune_alone"]

ENV = "BENCH_GPU_LOCK"
_held = threading.local()  # .files: [(open file, lock kind)] this thread holds, innermost last


def _files() -> list:
    if not hasattr(_held, "files"):
        _held.files = []
    return _held.files


@contextlib.contextmanager
def _holding(kind: int):
    path = os.environ.get(ENV)
    if not path or _alone_now():  # held alone already: nothing more to take (taking it would wait on itself)
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, kind)
        _files().append((f, kind))
        try:
            yield
        finally:
            _files().remove((f, kind))
            fcntl.flock(f, fcntl.LOCK_UN)


def _alone_now() -> bool:
    return any(kind == fcntl.LOCK_EX for _, kind in _files())


def using():
    """Held shared while this process uses the GPU untimed."""
    return _holding(fcntl.LOCK_SH)


@contextlib.contextmanager
def alone():
    """The GPU alone, from inside untimed use or outside it: this thread's shared holds are
    let go (a lock cannot be taken alone while its own process shares it), the lock taken
    alone, and the shared holds taken again after. Inside another `alone()`: nothing more to
    take."""
    files = _files()
    if not os.environ.get(ENV) or _alone_now():
        yield
        return
    shared = [f for f, _ in files]
    for f in shared:
        fcntl.flock(f, fcntl.LOCK_UN)
    try:
        with _holding(fcntl.LOCK_EX):
            yield
    finally:
        for f in shared:
            fcntl.flock(f, fcntl.LOCK_SH)


def timing():
    """Held alone while this process times calls on the GPU."""
    return alone()


def _alone_while(method):
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with alone():
            return method(*args, **kwargs)

    wrapped.bench_alone = True
    return wrapped


def tune_alone(benchmarker=None, conv_timing=None, graphify: bool = True) -> None:
    """Make the timings that choose kernels hold the GPU alone (`alone()`): inductor's
    benchmarker (`torch._inductor.runtime.benchmarking.benchmarker`, or the one given), which
    Triton's autotuner and max-autotune time candidates with, and, for a graphify line,
    graphify's timing of a grouped convolution in both layouts (`graphify.compile.conv_timing`,
    or the module given; another line's process does not import graphify for it).
    Idempotent; a no-op without `BENCH_GPU_LOCK`."""
    if not os.environ.get(ENV):
        return
    if benchmarker is None:
        from torch._inductor.runtime import benchmarking

        benchmarker = benchmarking.benchmarker
    if conv_timing is None and graphify:
        from graphify.compile import conv_timing
    timed = [(benchmarker, "benchmark"), (benchmarker, "benchmark_gpu")] + ([(conv_timing, "_timed")] if conv_timing else [])
    for owner, name in timed:
        method = getattr(owner, name)  # missing: this torch or graphify moved it; say so, not time by chance
        if not getattr(method, "bench_alone", False):
            setattr(owner, name, _alone_while(method))
