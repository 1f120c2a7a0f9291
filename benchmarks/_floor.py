"""The floor every graph benchmark compares with: one step captured by hand."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._report import replay_us


class HandWrittenGraph:
    """What a careful engineer writes by hand for one batch size: static inputs (each new
    batch copied in), two warm-ups on a side stream (every rank runs them, so collectives
    inside pair up), one `torch.cuda.CUDAGraph`, one replay per call, no checks of any kind."""

    def __init__(self, step, example: tuple, cache: torch.Tensor):
        self.static = [t.clone() for t in example]
        self.cache = cache
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad():
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step(*self.static, cache)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=stream):
                self.out = step(*self.static, cache)

    def __call__(self, *batch):
        for dst, src in zip(self.static, batch):
            dst.copy_(src)
        self.graph.replay()
        return self.out


class BackToBack:
    """`body(x)`: `count` back-to-back calls over the static input `x` (a list of their
    outputs), as one `HandWrittenGraph` on CUDA, as eager calls on the CPU. `replay()` runs
    them into `outs`; write new inputs into `x`. What the micro-benchmarks time (one kernel
    or collective alone): many calls a replay, so a replay's own launch cost is spread."""

    def __init__(self, body: Callable[[torch.Tensor], list], x: torch.Tensor, count: int):
        self.body, self.count, self.graph = body, count, None
        if x.device.type != "cuda":
            self.x = x
            self.replay()
            return
        self.graph = HandWrittenGraph(lambda x, _: body(x), (x,), None)
        self.x, self.outs = self.graph.static[0], self.graph.out

    def replay(self) -> None:
        if self.graph is None:
            self.outs = self.body(self.x)
        else:
            self.graph.graph.replay()

    def per_call_us(self, reps: int, warmup: int) -> list[float]:
        """µs a call of each of `reps` replays after `warmup` (`replay_us`)."""
        return [us / self.count for us in replay_us(self.replay, self.graph is not None, reps, warmup)]
