"""Two benchmark processes on one GPU without timing each other's work.

A zoo line spends most of its time compiling on the host. Two such processes on one GPU
(each pinned to half its cores) keep it busy, provided neither times its calls while the
other uses the device: a reader-writer lock on a file named by `BENCH_GPU_LOCK`.
- Device work that is not timed (eager references, first calls with their compiles and captures,
  error checks) holds it shared (`using()`); two processes may do that at once.
- Timed work (`timing()`) holds it alone, so no other process's kernels run beside the timed ones.
Without `BENCH_GPU_LOCK` (one process a GPU, the default) both are no-ops.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

__all__ = ["using", "timing"]

ENV = "BENCH_GPU_LOCK"


@contextlib.contextmanager
def _held(kind: int):
    path = os.environ.get(ENV)
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, kind)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def using():
    """Held shared while this process uses the GPU untimed."""
    return _held(fcntl.LOCK_SH)


def timing():
    """Held alone while this process times calls on the GPU."""
    return _held(fcntl.LOCK_EX)
