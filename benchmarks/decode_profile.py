"""Profile of the batch-8 decode step: graphify (FULL graphs of plain pieces, of inductor
pieces, or of the whole step compiled by inductor, so fusions cross the attention op) vs
torch.compile reduce-overhead. Kernels per step and GPU time by kernel (torch.profiler,
which sees the kernels inside graph replays), and the host cost split into the graph
launch alone and graphify's own work.

    python -m benchmarks.decode_profile          # graphify: plain, inductor pieces, whole step compiled
    python -m benchmarks.decode_profile --peer   # torch.compile reduce-overhead (own process)
    python -m benchmarks.decode_profile --fresh-caches   # inductor and Triton compile cold, in this process
    python -m benchmarks.decode_profile --variants pieces,pieces-static,pieces-cdt   # inductor settings side by side
    python -m benchmarks.decode_profile --step 81 --variants pieces   # a step of the serving trace (81: mixed, 512 tokens)

A step's GPU idle time (between kernels) is its own column: it is what told the FULL graphs
of compiled pieces captured straight after their same-size schedule (1.25 ms) from those
warmed up first (1.14 ms), same kernels, in session 37 (see benchmarks.compile_state).
"""

from __future__ import annotations

import time

import attrs
import torch

from graphify import Mode, Options, graphify
from graphify.models import model_support, split_ops, varlen_axes
from graphify.transforms import split

from ._report import environment, fresh_compile_caches, host_pipelined_us, kernels, publish, table, time_per_call
from .peers import ReduceOverhead
from ._serving_trace import ATTENTION, Setup

B = 8


# name in the table, split(compile=...), graphify's Options
VARIANTS = {
    "plain": ("graphify FULL", False, Options()),
    "pieces": ("graphify FULL + inductor pieces", True, Options()),
    "whole": ("graphify FULL, whole step compiled (Options(compile=True))", True, Options(compile=True)),
    "pieces-static": ("graphify FULL + inductor pieces, compiled for batch 8", True, Options(compile_sizes=(B,))),
    "pieces-cdt": ("graphify FULL + inductor pieces, coordinate descent tuning",
                   {"coordinate_descent_tuning": True}, Options()),
    "pieces-static-autotune": ("graphify FULL + inductor pieces, compiled for batch 8, max-autotune",
                               {"max_autotune": True}, Options(compile_sizes=(B,))),
    "pieces-static-cdt": ("graphify FULL + inductor pieces, compiled for batch 8, coordinate descent tuning",
                          {"coordinate_descent_tuning": True}, Options(compile_sizes=(B,))),
}


DEFAULT_VARIANTS = ("plain", "pieces", "whole")


def run(peer: bool = False, fresh_caches: bool = False, variants: tuple[str, ...] = DEFAULT_VARIANTS,
        step: int | None = None) -> dict:
    """`step`: profile that step of the serving trace (a mixed prefill + decode batch runs
    PIECEWISE under FULL_AND_PIECEWISE) instead of the batch-8 decode step."""
    if fresh_caches:  # before anything compiles
        fresh_compile_caches()
    env = environment()
    env["compile_caches"] = "fresh" if fresh_caches else "as found"
    setup = Setup(True, 48, 0)
    if step is None:
        batch, size, what = setup.decode_batch(B), B, f"batch-{B} decode"
    else:
        s = setup.steps[step]
        batch, size = setup.batches[step], s.num_tokens
        what = f"trace step {step} ({s.kind}, {s.num_tokens} tokens, {len(s.request_ids)} requests)"
    cache = setup.cache
    out = {}
    with torch.inference_mode():
        graphs = {}
        capture_s = {}
        for key in () if peer else variants:
            name, pieces, options = VARIANTS[key]
            if step is not None and options.compile_sizes == (B,):  # "compiled for batch 8": for the profiled size
                options = attrs.evolve(options or Options(), compile_sizes=(size,))
                name = name.replace(f"batch {B}", "this size")
            t0 = time.perf_counter()  # timed once, by hand: a compile and capture is not repeated
            fn = split(setup.step, split_ops(ATTENTION), *setup.example, cache, axes=varlen_axes(), compile=pieces)
            g = graphify(fn, mode="FULL_AND_PIECEWISE", sizes=(size,), axes=varlen_axes(), support=model_support(ATTENTION), options=attrs.evolve(options or Options(), outputs="view")).capture(*setup.example, cache)
            capture_s[name] = time.perf_counter() - t0  # split, compiles and captures
            graphs[name] = g
        calls = {name: (lambda g=g: g(*batch, cache)) for name, g in graphs.items()}
        if peer:  # in its own process: see benchmarks/serving.in_own_process
            graphs.clear()
            compiled = ReduceOverhead(setup.step, [cache, *setup.params.values()])
            calls = {"torch.compile reduce-overhead": lambda: compiled(*batch, cache)}
        rows = []
        for name, call in calls.items():  # timings first: the profiler slows later launches
            row = {"config": name, "capture_s": capture_s.get(name), "step_ms": time_per_call(lambda i: call()),  # noqa: B023
                   "host_us": host_pipelined_us(lambda i: call())}  # noqa: B023
            if name in graphs and step is None:
                entry = next(e for e in graphs[name].table if e.mode is Mode.FULL)
                row["replay_alone_us"] = host_pipelined_us(lambda i: entry.replay())  # noqa: B023
            rows.append(row)
        for row in rows:
            row["kernels_per_step"], row["gpu_ms"], row["gpu_idle_us"], out[row["config"]] = kernels(calls[row["config"]])
            print(row, flush=True)
    return {"env": env, "what": what, "rows": rows, "top_kernels": out}


COLUMNS = [("config", "configuration", "s"), ("kernels_per_step", "kernels/step", ".0f"), ("gpu_ms", "GPU ms (sum)", ".3f"), ("gpu_idle_us", "GPU idle µs", ".0f"),
           ("step_ms", "step ms", ".3f"), ("capture_s", "capture s", ".1f"), ("host_us", "host µs/step", ".1f"), ("replay_alone_us", "graph launch alone µs", ".1f")]


def render(result: dict) -> str:
    lines = [f"{result.get('what', f'batch-{B} decode')}\n", table(result["rows"], COLUMNS)]
    for name, top in result["top_kernels"].items():
        lines.append(f"\nTop kernels, {name} (per step):\n")
        lines.append(table([{"kernel": k, "count": c, "us": t} for k, c, t in top],
                           [("kernel", "kernel", "s"), ("count", "count", ".0f"), ("us", "µs", ".1f")]))
    return "\n".join(lines)


def main(argv=None) -> dict:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", action="store_true", help="profile torch.compile reduce-overhead instead")
    parser.add_argument("--fresh-caches", action="store_true", help="compile with empty inductor and Triton caches")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated graphify variants, of: {', '.join(VARIANTS)}")
    parser.add_argument("--step", type=int, help="profile this step of the serving trace instead of batch-8 decode")
    args = parser.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    result = run(args.peer, args.fresh_caches, variants, args.step)
    name = ("decode-profile-peer" if args.peer else "decode-profile") + (f"-step{args.step}" if args.step is not None else "")
    publish(name + ("-fresh-caches" if args.fresh_caches else ""), result, render(result))
    return result


if __name__ == "__main__":
    main()
