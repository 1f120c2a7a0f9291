"""Does a cold compile in a process slow the CUDA graphs it replays?

On one H100 (session 36) the batch-8 FULL graph of inductor pieces stepped in 1.265 ms in
processes that compiled the pieces cold, 1.146-1.150 ms where they came from the on-disk
caches: same kernels, same kernel time, more idle time between kernels. Reduce-overhead's
step in a process that had compiled graphify's pieces cold was slow too (1.29-1.30 ms, 1.17-1.19
alone). This script tells a process-wide effect from one of the cold-compiled code:

1. graph A: the pieces compiled with the caches as found (run it once before: warm);
2. an unrelated small function compiled cold (fresh inductor and Triton cache folders);
3. graph B: the same pieces compiled cold (fresh folders again), captured beside A;
4. inductor's compile workers shut down.

After each stage both graphs' batch-8 step (CUDA events) and GPU idle time between kernels.

    python -m benchmarks.compile_state
"""

from __future__ import annotations

import os
import tempfile

import torch

from graphify import Mode, Options, graphify, sglang_piecewise_sizes
from models import model_support, split_ops, varlen_axes
from transforms import split

from ._report import environment, kernels, publish, table, time_per_call
from ._serving_trace import ATTENTION, Setup

B = 8


def fresh_caches() -> None:
    """Point inductor's and Triton's on-disk caches at new empty folders: what compiles
    next compiles cold."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-")
    from torch._inductor import utils

    if hasattr(utils, "clear_caches"):  # the in-memory ones too (what inductor's own fresh_cache() does)
        utils.clear_caches()


def run() -> dict:
    env = environment()
    setup = Setup(True, 48, 0)
    batch, cache = setup.decode_batch(B), setup.cache
    sizes = sglang_piecewise_sizes(setup.max_tokens)
    graphs: dict = {}
    rows = []

    def build(name: str) -> None:
        fn = split(setup.step, split_ops(ATTENTION), *setup.example, cache, axes=varlen_axes(), compile=True)
        g = graphify(fn, mode="FULL_AND_PIECEWISE", sizes=sizes, axes=varlen_axes(), outputs="view",
                     support=model_support(ATTENTION),
                     options=Options(compile_sizes=tuple(s for s in sizes if s >= 256)))
        graphs[name] = g.capture(*setup.example, cache)
        assert any(e.mode is Mode.FULL and e.key.num_tokens == B for e in graphs[name].table)

    def measure(stage: str) -> None:
        for name, g in graphs.items():
            call = lambda: g(*batch, cache)  # noqa: E731, B023
            n, gpu_ms, idle_us, _ = kernels(call)
            rows.append({"stage": stage, "graph": name, "step_ms": time_per_call(lambda i: call()),
                         "gpu_ms": gpu_ms, "gpu_idle_us": idle_us, "kernels": n})
            print(rows[-1], flush=True)

    with torch.inference_mode():
        build("A (caches as found)")
        measure("1. A built")
        fresh_caches()
        small = torch.compile(lambda x, w: torch.nn.functional.silu(x @ w) * x.sum(-1, keepdim=True))
        small(torch.randn(B, 256, device="cuda"), torch.randn(256, 256, device="cuda"))
        torch.cuda.synchronize()
        measure("2. after a small cold compile")
        fresh_caches()
        build("B (compiled cold)")
        measure("3. B built cold")
        from torch._inductor import async_compile

        async_compile.shutdown_compile_workers()
        measure("4. compile workers shut down")
    return {"env": env, "rows": rows}


COLUMNS = [("stage", "stage", "s"), ("graph", "graph", "s"), ("step_ms", "step ms", ".3f"),
           ("gpu_ms", "kernel ms", ".3f"), ("gpu_idle_us", "GPU idle µs", ".0f"), ("kernels", "kernels", ".0f")]


def main(argv=None) -> dict:
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.compile_state needs a CUDA GPU (inductor's CUDA kernels and graphs)")
    result = run()
    publish("compile-state", result, "Batch-8 decode step after each stage (CUDA events; idle: between kernels, "
            "torch.profiler).\n\n" + table(result["rows"], COLUMNS))
    return result


if __name__ == "__main__":
    main()
