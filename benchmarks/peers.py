"""The peer we measure against: torch.compile(mode="reduce-overhead") (inductor + CUDA
graph trees), set up the way it has to be for a serving step to really use graphs.

Two things make it graph: the KV cache (mutated in place by attention) and the weights
must be marked static (`torch._dynamo.mark_static_address`), or inductor skips graphs for
"mutated inputs" (and copies unmarked weights into graph memory). Each step begins with
`torch.compiler.cudagraph_mark_step_begin()`, as an inference loop must. Whether graphs
were used is read from inductor's own counter of skipped graphs, not assumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

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
        return int(sum(self._counters["inductor"].get(k, 0) for k in ("cudagraph_skips",)))

    @property
    def recompiles(self) -> int:
        return int(self._counters["stats"].get("unique_graphs", 0))
