"""Triton's compiles keyed alike in this process and in graphify's compile worker.

Triton looks a kernel up on disk by a key that includes the ptxas it compiles with (its
version) and finds it in `TRITON_CACHE_DIR`. Inductor sets both variables, where unset, in
whichever process compiles: its folder for Triton's cache, and the ptxas torch's wheel ships.
When the worker compiles in parallel, its own process never sets them, so a Triton kernel it
runs there (the GEMV of `Options(compile={"gemv": True})`) is keyed with Triton's bundled
ptxas, in Triton's default folder; the process that takes the compiled graphs in has set them
by then, misses the worker's binaries and compiles the kernel again inside the swap (on an
H200, swaps of 0.65-0.97 s at two layers of the 8B shapes, where one without the GEMV took 0.17 s).

`as_inductor_compiles()` sets both as inductor would, before the worker starts (which then
inherits them) and before the GEMV's first compile. A value the user set is kept.
"""

from __future__ import annotations

import os

__all__ = ["as_inductor_compiles"]


def as_inductor_compiles(device_index: int = 0) -> None:
    """Set `TRITON_CACHE_DIR` and `TRITON_PTXAS_PATH`, where unset, to what inductor sets
    them to on its first compile in a process (its own rules, called here)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:  # a torch without them: Triton's defaults in both processes
        return
    if "TRITON_CACHE_DIR" not in os.environ:
        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(device_index)
    if "TRITON_PTXAS_PATH" not in os.environ:
        getattr(_set_triton_ptxas_path, "__wrapped__", _set_triton_ptxas_path)()  # its once-a-process cache aside
