"""Profile of the batch-8 decode step: graphify (FULL graphs of plain pieces, of inductor
pieces, or of the whole step compiled by inductor, so fusions cross the attention op) vs
torch.compile reduce-overhead. Kernels per step and GPU time by kernel (torch.profiler,
which sees the kernels inside graph replays), and the host cost split into the graph
launch alone and graphify's own work.

    python -m benchmarks.decode_profile          # graphify: plain, inductor pieces, whole step compiled
    python -m benchmarks.decode_profile --peer   # torch.compile reduce-overhead (own process)
"""

from __future__ import annotations

import time

import torch

from graphify import Mode, Options, graphify
from models import model_support, split_ops, varlen_axes
from transforms import split

from ._report import environment, host_pipelined_us, kernels, publish, table, time_per_call
from .peers import ReduceOverhead
from ._serving_trace import ATTENTION, Setup

B = 8


def run(peer: bool = False) -> dict:
    env = environment()
    setup = Setup(True, 48, 0)
    batch = setup.decode_batch(B)
    cache = setup.cache
    out = {}
    with torch.inference_mode():
        graphs = {}
        variants = (("graphify FULL", False, False), ("graphify FULL + inductor pieces", True, False),
                    ("graphify FULL, whole step compiled (Options(compile=True))", True, True))
        capture_s = {}
        for name, pieces, whole in () if peer else variants:
            t0 = time.perf_counter()
            fn = split(setup.step, split_ops(ATTENTION), *setup.example, cache, axes=varlen_axes(), compile=pieces)
            g = graphify(fn, mode="FULL_AND_PIECEWISE", sizes=(B,), axes=varlen_axes(), outputs="view",
                         support=model_support(ATTENTION), options=Options(compile=whole)).capture(*setup.example, cache)
            capture_s[name] = time.perf_counter() - t0  # split, compiles and captures
            graphs[name] = g
        calls = {name: (lambda g=g: g(*batch, cache)) for name, g in graphs.items()}
        if peer:  # in its own process: see benchmarks/serving.run_peer
            graphs.clear()
            compiled = ReduceOverhead(setup.step, [cache, *setup.params.values()])
            calls = {"torch.compile reduce-overhead": lambda: compiled(*batch, cache)}
        rows = []
        for name, call in calls.items():  # timings first: the profiler slows later launches
            row = {"config": name, "capture_s": capture_s.get(name), "step_ms": time_per_call(lambda i: call()),  # noqa: B023
                   "host_us": host_pipelined_us(lambda i: call())}  # noqa: B023
            if name in graphs:
                entry = next(e for e in graphs[name].table if e.mode is Mode.FULL)
                row["replay_alone_us"] = host_pipelined_us(lambda i: entry.replay())  # noqa: B023
            rows.append(row)
        for row in rows:
            row["kernels_per_step"], row["gpu_ms"], out[row["config"]] = kernels(calls[row["config"]])
            print(row, flush=True)
    return {"env": env, "rows": rows, "top_kernels": out}


COLUMNS = [("config", "batch-8 decode", "s"), ("kernels_per_step", "kernels/step", ".0f"), ("gpu_ms", "GPU ms (sum)", ".3f"),
           ("step_ms", "step ms", ".3f"), ("capture_s", "capture s", ".1f"), ("host_us", "host µs/step", ".1f"), ("replay_alone_us", "graph launch alone µs", ".1f")]


def render(result: dict) -> str:
    lines = [table(result["rows"], COLUMNS)]
    for name, top in result["top_kernels"].items():
        lines.append(f"\nTop kernels, {name} (per step):\n")
        lines.append(table([{"kernel": k, "count": c, "us": t} for k, c, t in top],
                           [("kernel", "kernel", "s"), ("count", "count", ".0f"), ("us", "µs", ".1f")]))
    return "\n".join(lines)


def main(argv=None) -> dict:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", action="store_true", help="profile torch.compile reduce-overhead instead")
    args = parser.parse_args(argv)
    result = run(args.peer)
    publish("decode-profile-peer" if args.peer else "decode-profile", result, render(result))
    return result


if __name__ == "__main__":
    main()
