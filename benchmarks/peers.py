"""The peer we measure against: torch.compile(mode="reduce-overhead") (inductor + CUDA
graph trees), set up the way it has to be for a serving step to really use graphs.

Two things make it graph: the KV cache (mutated in place by attention) and the weights
must be marked static (`torch._dynamo.mark_static_address`), or inductor skips graphs for
"mutated inputs" (and copies unmarked weights into graph memory). Each step begins with
`torch.compiler.cudagraph_mark_step_begin()`, as an inference loop must. Whether graphs
were used is read from inductor's own counter of skipped graphs, not assumed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import torch

from ._report import sync

__all__ = ["ReduceOverhead"]


class ReduceOverhead:
    """`step` compiled with mode="reduce-overhead"; call like `step`."""

    def __init__(self, step: Callable, static: Iterable[torch.Tensor]):
        from torch._dynamo.utils import counters

        # No torch._dynamo.reset() here: it frees compiled code that live CUDA graphs of
        # inductor pieces still launch (their replay then reads freed kernels).
        counters.clear()
        for t in static:
            torch._dynamo.mark_static_address(t)
        self.compiled = torch.compile(step, mode="reduce-overhead")
        self._counters = counters

    def __call__(self, *args):
        torch.compiler.cudagraph_mark_step_begin()
        return self.compiled(*args)

    @property
    def graph_skips(self) -> int:
        """How many times inductor fell back to running without CUDA graphs."""
        return int(self._counters["inductor"].get("cudagraph_skips", 0))

    @property
    def recompiles(self) -> int:
        return int(self._counters["stats"].get("unique_graphs", 0))


def reduce_overhead_row(setup, timed) -> tuple[dict, ReduceOverhead]:
    """torch.compile reduce-overhead over the same trace. Its start-up is the first pass
    (compiles, recompiles for new shapes, graph recordings) less a steady pass."""
    sync()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    from ._serving_trace import _percentile, ms_by_kind, run_trace, slowest_steps

    compiled = ReduceOverhead(setup.step, [setup.cache, *setup.params.values()])
    t0 = time.perf_counter()  # whole passes over the trace, each once: start-up, not a repeated call
    worst, _ = run_trace(setup, compiled, "torch.compile", timed)
    first_pass = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, latencies = run_trace(setup, compiled, "torch.compile", timed)
    steady = time.perf_counter() - t0
    skips = compiled.graph_skips
    return {
        "config": "torch.compile reduce-overhead",
        "tokens_per_s": setup.tokens / (sum(latencies) / 1e3),
        "p50_ms": statistics.median(latencies),
        "p99_ms": _percentile(latencies, 0.99),
        "startup_s": max(first_pass - steady, 0.0),
        "graph_mib": (torch.cuda.memory_reserved() - base) / 2**20,
        "padding_waste_pct": 0.0,
        "uses_graphs": "yes" if skips == 0 else f"no ({skips} skips)",
        "max_err_vs_eager": worst,
        "slowest": slowest_steps(setup, latencies),
        "ms_by_kind": ms_by_kind(setup, latencies),
    }, compiled
