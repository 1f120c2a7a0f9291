"""Inductor's tuning and compiling kept out of a graph's pool.

A capture's warm-ups allocate from the graph's own pool (`graphify.backends.pool_routing`), and
the compile line's first warm-up is the compiled code's first run. That run tunes Triton
kernels with several configs: inductor's benchmarker allocates an L2-sized buffer it clears
between timings (60 MiB on an H200) and clones of the kernel's arguments. Freed after, their
segments stayed in the pool for the graph's whole life: the compile line's pool was 118 MiB
at B = 1 on ResNet-50 against the plain line's 56 (`benchmarks.pool_origins`, H200).
What a compile itself allocates (max-autotune's example inputs, frozen constants) is no
warm-up's either. Both run outside the routing: their memory goes to the default pool, where
the caching allocator reuses it, and gives it back when an allocation would otherwise fail or
on `torch.cuda.empty_cache()`; a live graph's pool keeps its segments whatever happens.
"""

from __future__ import annotations

import functools

from graphify.backends.pool_routing import outside

__all__ = ["tune_outside_pools"]

# The benchmarker's entry points: `benchmark` (what Triton's autotuner and max-autotune call)
# and `benchmark_gpu` (where the buffers are made; `benchmark` ends there on torch 2.11 and 2.13).
_ENTRY_POINTS = ("benchmark", "benchmark_gpu")


def _outside_routing(method):
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with outside():
            return method(*args, **kwargs)

    wrapped.graphify_outside = True
    return wrapped


def tune_outside_pools(benchmarker=None) -> None:
    """Make inductor's benchmarker (`torch._inductor.runtime.benchmarking.benchmarker`, or the
    one given) time kernels outside any warm-up's routing on its thread. Idempotent; a no-op
    for a benchmarker without these methods."""
    if benchmarker is None:
        from torch._inductor.runtime import benchmarking

        benchmarker = benchmarking.benchmarker
    for name in _ENTRY_POINTS:
        method = getattr(benchmarker, name, None)
        if method is not None and not getattr(method, "graphify_outside", False):
            setattr(benchmarker, name, _outside_routing(method))
