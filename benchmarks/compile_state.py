"""Does how the pieces were compiled (cold, or loaded from the caches) change the CUDA graphs
that replay them?

A batch-8 FULL graph of inductor pieces may step at different speeds in processes that
compiled its pieces cold and in processes that loaded them from the on-disk caches. This
script builds both kinds in one process, FULL_AND_PIECEWISE at the main job's sizes:

1. graph B: the pieces compiled cold (fresh inductor and Triton cache folders);
2. graph A: the same pieces loaded from the caches B filled (inductor's in-memory caches
   cleared first), captured beside B;
3. an unrelated small function compiled cold (fresh folders again);
4. inductor's compile workers shut down.

After each stage every graph's batch-8 step (`torch.utils.benchmark.Timer`) and GPU idle
time between kernels; at the end, per kernel name, the idle time before it in each graph,
the kernels' launch set-up as the driver holds it (a verbose DOT dump of each batch-8
graph, under --dump), and how many kernels of each inductor launcher class the process
holds. A difference between A and B would come from the compile; the same step in both,
from the capture (why FULL keys of compiled pieces warm up twice:
graphify/capture/capturers.py). Results: benchmarks/results/compile-state-*.md.

    python -m benchmarks.compile_state [--dump DIR]
"""

from __future__ import annotations

import collections
import os

import torch

from graphify import Mode, Options, graphify, sglang_piecewise_sizes
from graphify.models import model_support, split_ops, varlen_axes
from graphify.transforms import split

from ._report import cuda_spans, environment, fresh_compile_caches, kernels, publish, table, time_per_call
from ._serving_trace import ATTENTION, Setup

B = 8


def run(dump: str | None = None) -> dict:
    env = environment()
    setup = Setup(True, 48, 0)
    batch, cache = setup.decode_batch(B), setup.cache
    sizes = sglang_piecewise_sizes(setup.max_tokens)
    graphs: dict = {}
    rows, launchers = [], {}

    def build(name: str) -> None:
        fn = split(setup.step, split_ops(ATTENTION), *setup.example, cache, axes=varlen_axes(), compile=True)
        g = graphify(fn, mode="FULL_AND_PIECEWISE", sizes=sizes, axes=varlen_axes(), support=model_support(ATTENTION),
                     options=Options(outputs="view", compile_sizes=tuple(s for s in sizes if s >= 256)))
        graphs[name] = g.capture(*setup.example, cache)
        assert any(e.mode is Mode.FULL and e.key.num_tokens == B for e in graphs[name].table)
        launchers[name] = launcher_counts()

    def measure(stage: str) -> None:
        calls = {name: (lambda g=g: g(*batch, cache)) for name, g in graphs.items()}
        timed = [{"stage": stage, "graph": name, "step_ms": time_per_call(lambda i, c=call: c())}
                 for name, call in calls.items()]  # every graph timed before any is profiled:
        for row in timed:  # the profiler slows the launches after it
            row["kernels"], row["gpu_ms"], row["gpu_idle_us"], _ = kernels(calls[row["graph"]])
            rows.append(row)
            print(row, flush=True)

    original_graph = torch.cuda.CUDAGraph
    torch.cuda.CUDAGraph = _keeping_graphs(original_graph)
    try:
        with torch.inference_mode():
            fresh_compile_caches()
            build("B (compiled cold)")
            measure("1. B built cold")
            from torch._inductor import utils

            utils.clear_caches()  # in memory only: A loads what B's compile left on disk
            build("A (from the disk caches)")
            measure("2. A built from B's caches")
            fresh_compile_caches()
            small = torch.compile(lambda x, w: torch.nn.functional.silu(x @ w) * x.sum(-1, keepdim=True))
            small(torch.randn(B, 256, device="cuda"), torch.randn(256, 256, device="cuda"))
            torch.cuda.synchronize()
            measure("3. after a small cold compile")
            from torch._inductor import async_compile

            async_compile.shutdown_compile_workers()
            measure("4. compile workers shut down")
            gaps = {name: gaps_by_kernel(lambda g=g: g(*batch, cache)) for name, g in graphs.items()}
            dumps = _dump(graphs, dump) if dump else {}
    finally:
        torch.cuda.CUDAGraph = original_graph
    return {"env": env, "rows": rows, "gaps": gaps, "launchers": launchers, "dumps": dumps,
            "static_launcher": bool(getattr(torch._inductor.config, "use_static_cuda_launcher", False))}


def _keeping_graphs(original_graph):
    """A `torch.cuda.CUDAGraph` that keeps its graph after instantiating it, so `debug_dump`
    has something to print (torch drops it otherwise, debug mode or not)."""

    class DebugGraph(original_graph):
        def __new__(cls, keep_graph=False):
            return super().__new__(cls, True)

        def __init__(self, keep_graph=False):
            super().__init__(True)

        def capture_end(self):
            super().capture_end()
            self.instantiate()  # kept graphs are not instantiated by capture_end

    return DebugGraph


def _dump(graphs: dict, folder: str) -> dict[str, str]:
    """A verbose DOT dump of each graph's batch-B FULL graph under `folder`: {name: path}."""
    os.makedirs(folder, exist_ok=True)
    dumps = {}
    for name, g in graphs.items():
        entry = next(e for e in g.table if e.mode is Mode.FULL and e.key.num_tokens == B)
        path = os.path.join(folder, f"graph-{name.split()[0]}.dot")  # graph-A.dot, graph-B.dot
        entry.graph.debug_dump(path)
        dumps[name] = path
    return dumps


def launcher_counts() -> dict[str, int]:
    """How many objects of each inductor/Triton launcher class the process holds."""
    import gc

    wanted = {"StaticallyLaunchedCudaKernel", "CompiledKernel", "StaticTritonCompileResult", "TritonCompileResult",
              "CachingAutotuner"}
    counts = collections.Counter(type(o).__name__ for o in gc.get_objects() if type(o).__name__ in wanted)
    return dict(counts)


def gaps_by_kernel(call, steps: int = 5) -> dict[str, list[float]]:
    """Per kernel name (first 60 characters): [launches per step, µs of idle GPU before
    those launches per step, µs of their own time per step], over back-to-back steps."""
    spans = sorted((start, end, name[:60]) for start, end, name in cuda_spans(call, steps))
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for previous, (start, end, name) in zip([None, *spans], spans):
        row = out[name]
        row[0] += 1 / steps
        row[1] += (max(start - previous[1], 0.0) if previous else 0.0) / steps
        row[2] += (end - start) / steps
    return dict(out)


COLUMNS = [("stage", "stage", "s"), ("graph", "graph", "s"), ("step_ms", "step ms", ".3f"),
           ("gpu_ms", "kernel ms", ".3f"), ("gpu_idle_us", "GPU idle µs", ".0f"), ("kernels", "kernels", ".0f")]


def main(argv=None) -> dict:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", help="folder for verbose DOT dumps of the batch-8 graphs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.compile_state needs a CUDA GPU (inductor's CUDA kernels and graphs)")
    result = run(args.dump)
    names = list(result["gaps"])
    gap_rows = []
    for kernel in sorted({k for g in result["gaps"].values() for k in g},
                         key=lambda k: -max(abs(result["gaps"][n].get(k, [0, 0, 0])[1]) for n in names)):
        row = {"kernel": kernel, "per_step": result["gaps"][names[0]].get(kernel, [0, 0, 0])[0]}
        for i, n in enumerate(names):
            row[f"idle{i}"], row[f"time{i}"] = result["gaps"][n].get(kernel, [0, 0, 0])[1:]
        gap_rows.append(row)
    gap_cols = [("kernel", "kernel", "s"), ("per_step", "per step", ".0f")]
    for i, n in enumerate(names):
        gap_cols += [(f"idle{i}", f"idle µs before, {n}", ".1f"), (f"time{i}", f"µs, {n}", ".1f")]
    markdown = ("Batch-8 decode step after each stage (torch.utils.benchmark.Timer; idle: between kernels, "
                "torch.profiler).\n\n"
                + table(result["rows"], COLUMNS)
                + "\n\nIdle GPU time before each kernel, per step, by kernel (largest first):\n\n"
                + table(gap_rows[:25], gap_cols)
                + f"\n\nLauncher objects after each build: {result['launchers']}; "
                  f"use_static_cuda_launcher={result['static_launcher']}")
    publish("compile-state", result, markdown)
    return result


if __name__ == "__main__":
    main()
