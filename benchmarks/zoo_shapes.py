"""Shapes as users send them: a stream of calls of changing shapes through each line, with what
the stream costs around the graphs (captures, compiles, eager calls) counted.

    vision models  images at two resolutions (224 and 288) and batches of 1 and 8, in a seeded order
    encoders       batches of 1 to 8 rows at lengths drawn from 8 to 512 tokens (what a service is sent)

Per model and line (eager, reduce-overhead, graphify's plain and compile lines), in a process of
its own from cold compile caches: the first pass's seconds (every compile and capture inside),
a second pass's seconds over the same calls (what the steady service costs), how many of the
second pass's calls replayed a graph, the graphs graphify holds, memory reserved beyond eager,
and the largest difference from eager's outputs over the stream.

    python -m benchmarks.zoo_shapes [--models timm/resnet50 transformers/bert-base] [--calls 40]
"""

from __future__ import annotations

import argparse
import json
import random
import time
import warnings

import torch

from ._report import environment, sync, table, worker_arguments
from ._zoo_models import TINY, available, by_name
from .zoo import LIBRARY_NOTICES, _replayed, cold_model, emit, in_process, largest_difference, publish_result, wrapped

LINES = ("eager", "reduce_overhead", "graphify", "graphify_compile")
RESOLUTIONS = (224, 288)
BATCHES = (1, 8)
LENGTHS = (8, 512)  # an encoder's requests: the shortest and longest lengths drawn


def stream(spec, calls: int, seed: int = 0, lengths: tuple = LENGTHS) -> list[tuple[int, int | None]]:
    """(batch, resolution or length) per call, seeded: the same stream for every line. Pure."""
    rng = random.Random(seed)
    if spec.kind in ("encoder",):
        return [(rng.randint(1, max(BATCHES)), rng.randint(*lengths)) for _ in range(calls)]
    return [(rng.choice(BATCHES), rng.choice(RESOLUTIONS)) for _ in range(calls)]


def inputs(spec, batch: int, size: int | None, device: str, dtype, gen) -> dict:
    """One call's arguments: an encoder's at `size` tokens, a vision model's at `size` pixels."""
    if spec.kind == "encoder":
        return spec.inputs(batch, size, device, dtype, gen)
    first = spec.inputs(batch, None, device, dtype, gen)
    (name, x), = first.items()
    return {name: torch.randn(batch, x.shape[1], size, size, generator=gen).to(device, dtype)}


def graphs_held(fn) -> int | None:
    first_use = getattr(fn, "_first_use", None)
    if first_use is None:
        return None
    return sum(s.graphs for s in tuple(first_use.structures))


def timed_pass(fn, batches) -> tuple[float, float]:
    """(seconds, of them the host's own) for one pass over `batches`: the host's time is
    summed over the calls without a sync inside, the rest is the GPU's."""
    t0, host = time.perf_counter(), 0.0
    for x in batches:
        h0 = time.perf_counter()
        fn(**x)
        host += time.perf_counter() - h0
    sync()
    return time.perf_counter() - t0, host


def measure(model, spec, line: str, calls: list, device: str, dtype) -> dict:
    """Three passes over the stream: the first (every compile and capture it needs), the
    second (which may still capture a shape the first met only once and ran eagerly), the
    third (steady). Graphs held after each, calls replayed in the last."""
    gen = torch.Generator().manual_seed(1)
    batches = [inputs(spec, b, n, device, dtype, gen) for b, n in calls]
    with torch.inference_mode():
        want = [model(**x) for x in batches]
        sync()
        base = torch.cuda.memory_reserved() if device == "cuda" else 0
        fn = wrapped(model, line, device)
        passes, graphs = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                stats = getattr(fn, "stats", None)
                if stats is not None:
                    stats.reset()
                passes.append(timed_pass(fn, batches))
                graphs.append(graphs_held(fn))
            replayed = _replayed(fn)
        # each output compared as it comes: reduce-overhead's outputs are overwritten by its next call
        error = max(largest_difference(fn(**x), w) for x, w in zip(batches, want))
    (first, _), (second, _), (steady, host) = passes
    return {"model": spec.name, "kind": spec.kind, "line": line, "calls": len(calls),
            "shapes": len(set(calls)), "first_pass_s": first, "second_pass_s": second, "steady_pass_s": steady,
            "steady_host_s": host, "replayed": replayed, "graphs": graphs[-1],
            "graphs_by_pass": graphs, "max_err": error,
            "mib": ((torch.cuda.memory_reserved() - base) / 2**20) if device == "cuda" else None,
            "warnings": sorted({str(w.message)[:300] for w in caught if not issubclass(w.category, LIBRARY_NOTICES)})}


def worker(job: dict, out: str) -> None:
    spec, model, device, dtype = cold_model(job["model"])
    emit(measure(model, spec, job["line"], [tuple(c) for c in job["calls"]], device, dtype), out)


def run(models, lines, calls: int, timeout: int, lengths: tuple = LENGTHS) -> dict:
    env, rows, failures = environment(), [], []
    for spec in models:
        plan = stream(spec, calls, lengths=lengths)
        for line in lines:
            job = {"model": spec.name, "line": line, "calls": plan}
            rows += in_process("benchmarks.zoo_shapes", job, f"{line} on {spec.name}", timeout, failures)
    eager = {r["model"]: r for r in rows if r["line"] == "eager"}
    for r in rows:
        e = eager.get(r["model"])
        r["steady_vs_eager"] = r["steady_pass_s"] / e["steady_pass_s"] if e else None
    return {"env": env, "rows": rows, "failures": failures}


COLUMNS = [("model", "model", "s"), ("line", "line", "s"), ("calls", "calls", "d"), ("shapes", "shapes", "d"),
           ("first_pass_s", "first pass s", ".2f"), ("second_pass_s", "second pass s", ".3f"),
           ("steady_pass_s", "third pass s", ".3f"), ("steady_host_s", "of it host s", ".3f"),
           ("steady_vs_eager", "third ÷ eager", ".2f"), ("replayed", "replayed (3rd pass)", "d"),
           ("graphs", "graphs held", "d"), ("mib", "MiB beyond eager", ".0f"), ("max_err", "max err vs eager", ".3g")]


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["timm/resnet50", "transformers/bert-base"])
    parser.add_argument("--lines", nargs="+", default=list(LINES), choices=LINES)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--smoke", action="store_true", help="a tiny BERT on the CPU simulation, short lengths")
    worker_arguments(parser, timeout=900)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker), args.out)
        return None
    if args.smoke:
        result = run((TINY,), [line for line in args.lines if line in ("eager", "graphify")], args.calls, args.timeout,
                     lengths=(4, 24))
    else:
        result = run(available(by_name(args.models)), args.lines, args.calls, args.timeout)
    return publish_result("zoo-shapes", result, table(result["rows"], COLUMNS), args.tag, args.smoke)


if __name__ == "__main__":
    main()
