"""The models people bring (`benchmarks._zoo_models`: timm, torchvision, transformers), each
graphify line beside eager and torch.compile's reduce-overhead.

    eager            model(**inputs)
    reduce_overhead  torch.compile(model, mode="reduce-overhead"): the peer a user tries first
    graphify         graphify(model): plain graphs, captured on first use
    graphify_compile graphify(model, options=Options(compile=True)): inductor's kernels in the graphs
    graphify_background  graphify(model, options=Options(compile="background")): plain graphs at
                     once, compiled ones once a worker process made them

Per model, line, batch (1 and 8) and served length (encoders), in a process of its own with
inductor's and Triton's caches empty at its start (the same cold state for every line): the
first call's seconds, the seconds from the first call until the line runs as it will from then
on (reduce-overhead and graphify: the third call, after a warm-up and a capture; the background
line: once its compiled graphs replay), ms per call (CUDA events, warm-up, median), the largest
difference from eager's outputs over fresh inputs (eager in the same process, the same
weights) and from the fp32 model's (the same bf16 weights in fp32 arithmetic, TF32 off: which of
two lines that differ from eager by a rounding step is nearer the exact answer), the device
memory the line reserved beyond eager's, calls replayed, and the warnings it gave. Random
weights, eval, bf16 (fp32 on the CPU), `torch.inference_mode()`.

On a machine without a GPU: `--smoke` runs a tiny BERT on the simulation backend (not GPU timings).

    python -m benchmarks.zoo [--models timm torchvision transformers/bert-base] [--lines ...] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
from torch.utils import _pytree as pytree

from ._report import (cuda_spans, environment, fresh_compile_caches, publish, replay_us, run_process, summarise, sync,
                      table, worker_arguments)
from . import _gpu_share as gpu_share
from ._kernel_configs import chosen_configs, picks_kept, picks_unread
from ._zoo_merge import merge
from ._zoo_models import MODELS, TINY, available, by_name

LINES = ("eager", "reduce_overhead", "graphify", "graphify_compile", "graphify_background")
# The compile line under other `Options(compile={...})` settings, for profiling its choices
# beside the peer's (not run unless named in --lines), and the background line with what only a
# compile nobody waits for can afford (inductor's autotuning of GEMM and convolution templates,
# coordinate-descent tuning of its own kernels)
VARIANTS = {"graphify_compile_static": {"dynamic": False}, "graphify_compile_auto": {"dynamic": None},
            "graphify_compile_autotune": {"mode": "max-autotune-no-cudagraphs"},
            "graphify_background_autotune": {"background": True, "mode": "max-autotune-no-cudagraphs"},
            "graphify_background_coordinate": {"background": True, "options": {"coordinate_descent_tuning": True}},
            # a static compile per captured shape, made in the worker: the static kernels (the Llama-1B
            # shape's rotary kernel half the time of the symbolic length's) at no wait to the caller
            "graphify_background_static": {"background": True, "dynamic": False},
            # the background line as a service runs it: calls go on while the worker compiles (it times
            # kernel configs beside them), where the plain background line's caller waits idle
            "graphify_background_busy": {"background": True},
            # inductor's channels-last layout off: at fixed shapes its heuristic turns it on for grouped
            # convolutions (RegNetY), which the peer's dynamic graph after a second batch size never does
            "graphify_compile_channels_first": {"options": {"layout_optimization": False}}}
# A line run with cuDNN's benchmarking of convolution algorithms on (`torch.backends.cudnn.benchmark`,
# set after eager's reference outputs): whether a shape-fixed graph gains from cuDNN's own
# search where the defaults take its heuristics' first choice
CUDNN_FIND = "_cudnn_find"
FIND_LINES = tuple(f"{line}{CUDNN_FIND}" for line in ("reduce_overhead", "graphify", "graphify_compile"))
# A graphify line handing out its graphs' output buffers (`Options(outputs="view")`, valid until the
# next call, as reduce-overhead's are) instead of a copy of them (the default): what the copy costs
VIEW = "_view"
VIEW_LINES = tuple(f"{line}{VIEW}" for line in ("graphify", "graphify_compile", "graphify_background"))
BUSY = "_busy"
COMPILE_WAIT_S = 1200


def wait_for_compiles(fn, call=None, timeout: float = COMPILE_WAIT_S) -> None:
    """Wait for a background line's compiles (at most `timeout` s); with `call`, calling it all
    the while (a service's loop going on), synchronised every tenth call."""
    if call is None:
        fn.wait_compiles(timeout=timeout)
        return
    made, end = 0, time.perf_counter() + timeout
    while not fn.wait_compiles(timeout=0) and time.perf_counter() < end:
        call()
        made += 1
        if made % 10 == 0:
            sync()
    sync()


# warnings a line gives that are torch's or a library's notices of deprecation, not what a user
# of the line is told about their model (torch.compile's own `torch.jit.script_method` notice)
LIBRARY_NOTICES = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
STEADY_CALLS = 3  # warm-up, capture (or record), the first replay
ERROR_BATCHES = 3  # fresh inputs compared with eager's outputs
PROFILED_CALLS = 5  # --profile: back-to-back calls under torch.profiler
KNOWN_LINES = LINES + tuple(VARIANTS) + FIND_LINES + VIEW_LINES
GRAPHIFY_COMPILE = {"graphify": None, "graphify_compile": True, "graphify_background": "background", **VARIANTS}


def wrapped(model, line: str, device: str):
    """The callable a user of `line` calls."""
    from graphify import Options, graphify

    if line not in KNOWN_LINES:
        raise ValueError(f"unknown line {line!r}; the lines: {KNOWN_LINES}")
    options = {"backend": "cuda" if device == "cuda" else "sim"}
    if line.endswith(CUDNN_FIND):
        torch.backends.cudnn.benchmark = True  # from here on in this worker (one line a process)
        line = line[: -len(CUDNN_FIND)]
    if line.endswith(VIEW):
        options["outputs"] = "view"
        line = line[: -len(VIEW)]
    if line == "eager":
        return model
    if line == "reduce_overhead":
        return torch.compile(model, mode="reduce-overhead")
    compile = GRAPHIFY_COMPILE[line]
    if compile is not None:
        options["compile"] = dict(compile) if isinstance(compile, dict) else compile
    return graphify(model, options=Options(**options))


@contextlib.contextmanager
def cudnn_defaults():
    """cuDNN's benchmarking off for eager's reference outputs (a `_cudnn_find` line turns it on)."""
    was = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = was


def tensors(out) -> list[torch.Tensor]:
    """The floating tensors of an output (a tensor, a tuple, a transformers ModelOutput)."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def largest_difference(got, want) -> float:
    pairs = list(zip(tensors(got), tensors(want)))
    if not pairs or len(tensors(got)) != len(tensors(want)):
        return float("inf")
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)


def shape_inputs(spec, batch: int, length, device: str, dtype) -> tuple[dict, list[dict]]:
    """The timed call's inputs and the fresh ones outputs are compared on, seeded by the shape."""
    gen = torch.Generator().manual_seed(batch * 1000 + (length or 0))
    fixed = spec.inputs(batch, length, device, dtype, gen)
    return fixed, [spec.inputs(batch, length, device, dtype, gen) for _ in range(ERROR_BATCHES)]


def exact_outputs(model, inputs: list[dict]) -> list:
    """The outputs of an fp32 copy of `model` (its weights' values kept, so the exact answer for
    the same weights) on `inputs`, their floating tensors in fp32, with TF32 off for matmuls and
    convolutions. The copy lives only in this call; `model` is left as it was."""
    exact = copy.deepcopy(model).float()
    was = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with cudnn_defaults(), gpu_share.using():
            return [exact(**{k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                             for k, v in x.items()}) for x in inputs]
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was


def measure(model, spec, line: str, batch: int, length, device: str, inputs: tuple[dict, list[dict]],
            profile: bool = False, exact: "list | None" = None) -> dict:
    """One row: the line's first calls, steady time, error (against eager, and against `exact`,
    the fp32 model's outputs on the fresh inputs, where given) and memory for one input shape;
    `inputs`: the timed call's and the fresh ones (`shape_inputs`)."""
    fixed, fresh = inputs
    with cudnn_defaults(), gpu_share.using():
        want = [model(**x) for x in fresh]
        sync()
    base = torch.cuda.memory_reserved() if device == "cuda" else 0
    fn = wrapped(model, line, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        calls = []
        with gpu_share.using():
            for _ in range(STEADY_CALLS):
                t0 = time.perf_counter()
                fn(**fixed)
                sync()
                calls.append(time.perf_counter() - t0)
        if line.startswith("graphify_background"):
            # the worker process runs the compiled code on this GPU (inductor times kernel configs
            # there, and saves the call): held alone, as this process's own tuning is (`tune_alone`),
            # so its picks are not made beside another process's work
            with gpu_share.alone():
                wait_for_compiles(fn, (lambda: fn(**fixed)) if line.endswith(BUSY) else None)
                for _ in range(STEADY_CALLS):  # the swap: its kind captures again, with the compiled code
                    fn(**fixed)
                sync()
        ready = time.perf_counter() - start
        with gpu_share.using():
            error, error_exact = errors(fn, fresh, want, exact)
        seen = [str(w.message) for w in caught if not issubclass(w.category, LIBRARY_NOTICES)]
    with gpu_share.timing():
        ms = steady_ms(lambda: fn(**fixed), device)
    mib = ((torch.cuda.memory_reserved() - base) / 2**20) if device == "cuda" else None
    replayed = _replayed(fn)
    graphs_mib = pool_mib(fn)
    row = {"model": spec.name, "library": spec.library, "kind": spec.kind, "line": line, "batch": batch,
           "length": length, "first_s": calls[0], "ready_s": ready, "ms": ms, "max_err": error,
           "max_err_exact": error_exact, "mib": mib,
           "pool_mib": graphs_mib, "replayed": replayed, "warnings": sorted(set(w[:300] for w in seen)),
           "compile_phases": compile_phases()}
    if profile and device == "cuda":
        with gpu_share.timing():
            row.update(profiled(lambda: fn(**fixed)))
        try:
            row["configs"] = chosen_configs(seen=_SEEN_SOURCES)  # this worker's fresh cache
        except Exception as e:  # noqa: BLE001 - a diagnostic: the row keeps its timings and says why
            row["configs"], row["picks_error"] = {}, f"{type(e).__name__}: {e}"[:300]
        row["picks_kept"] = picks_kept()  # more than the picks found: a cache layout not read
        if row["picks_kept"] and not row["configs"] and "picks_error" not in row:
            row["picks_unread"] = picks_unread()
    return row


def errors(fn, fresh: list[dict], want: list, exact: "list | None") -> tuple[float, "float | None"]:
    """`fn`'s largest difference from eager's outputs `want`, and from `exact` (None without it),
    over the fresh inputs: each output compared before the next call (reduce-overhead's outputs
    are its graph's buffers, overwritten by the next replay)."""
    error, error_exact = 0.0, (0.0 if exact is not None else None)
    for i, x in enumerate(fresh):
        got = fn(**x)
        error = max(error, largest_difference(got, want[i]))
        if exact is not None:
            error_exact = max(error_exact, largest_difference(got, exact[i]))
    return error, error_exact


_SEEN_SOURCES: set = set()  # kernel sources an earlier row of this worker's line already reported


def profiled(call) -> dict:
    """`call`'s kernels a call, GPU ms and idle µs a call, its costliest kernels (`top`), and
    every kernel it runs (`every_kernel`, names whole, for `benchmarks.zoo_kernels`)."""
    spans = cuda_spans(call, PROFILED_CALLS)
    count, gpu_ms, idle_us, top = summarise(spans, PROFILED_CALLS)
    every = summarise(spans, PROFILED_CALLS, top=None, width=None)[3]
    return {"kernels": count, "gpu_ms": gpu_ms, "idle_us": idle_us, "top": top, "every_kernel": every}


def compile_phases() -> dict:
    """Seconds this process spent so far in each of torch.compile's timed phases (dynamo's
    trace, AOT, inductor's codegen and compiles, ...), and the graphs dynamo compiled: where a
    line's seconds to steady go."""
    from torch._dynamo import utils

    phases = {k: round(sum(v), 2) for k, v in utils.compilation_time_metrics.items() if sum(v) >= 0.05}
    phases["graphs"] = utils.counters["stats"].get("unique_graphs", 0)
    return phases


def steady_ms(call, device: str, reps: int = 30, warmup: int = 5) -> float:
    """Median ms a call: CUDA events between back-to-back calls (the host clock on the CPU)."""
    return statistics.median(replay_us(call, device == "cuda", reps, warmup)) / 1e3


def pool_mib(fn) -> float | None:
    """MiB graphify's graph pools reserve for a first-use callable (each pool once): what of
    the line's memory beyond eager its graphs hold, the rest being what its warm-ups and
    compiles left cached elsewhere. None for other lines."""
    first_use = getattr(fn, "_first_use", None)
    if first_use is None:
        return None
    pools = {id(b.capture.session.pool): b.capture.session.pool for s in tuple(first_use.structures)
             for b in tuple(s.branches.values())}
    return sum(p.report().reserved_bytes for p in pools.values()) / 2**20


def _replayed(fn) -> int | None:
    stats = getattr(fn, "stats", None)
    if stats is None:
        return None
    return sum(r.calls for r in stats.by_mode() if r.mode.value != "NONE")


def cold_model(name: str):
    """In a worker process: inductor's and Triton's caches empty, the zoo model `name` built
    (seeded) on the GPU in bf16, or on the CPU in fp32. Returns (spec, model, device, dtype)."""
    fresh_compile_caches()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    spec = by_name([name])[0]
    torch.manual_seed(0)
    return spec, spec.build().to(device, dtype), device, dtype


def emit(row: dict, out: str) -> None:
    """A worker's row, appended to its file as it comes (a cut run keeps what it measured)."""
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def worker(job: dict, out: str) -> None:
    """In a process of its own, cold caches: one model and line, every batch and length."""
    spec, model, device, dtype = cold_model(job["model"])
    # the autotuner's and graphify's layout timings: never beside another process
    gpu_share.tune_alone(graphify=job["line"].startswith("graphify"))
    with torch.inference_mode():
        shapes = [(batch, length) for batch in job["batches"] for length in spec.lengths]
        inputs = {s: shape_inputs(spec, *s, device, dtype) for s in shapes}
        exact = {s: exact_outputs(model, inputs[s][1]) for s in shapes}  # on the very inputs measure compares
        if device == "cuda":  # the fp32 copy's blocks given back: the line's memory is measured from here
            torch.cuda.empty_cache()
        for batch, length in shapes:
            emit(measure(model, spec, job["line"], batch, length, device, inputs[batch, length],
                         job.get("profile", False), exact[batch, length]), out)


def in_process(module: str, job: dict, what: str, timeout: int, failures: list) -> list[dict]:
    """`python -m <module> --worker <job>` in a process of its own: the rows it wrote (its
    failure, if any, added to `failures`)."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        out = f.name
    failed = run_process([sys.executable, "-m", module, "--worker", json.dumps(job), "--out", out], what, timeout,
                         dict(os.environ))
    if failed:
        failures.append(failed)
    with contextlib.suppress(FileNotFoundError):
        rows = [json.loads(x) for x in open(out) if x.strip()]
        os.unlink(out)
        return rows
    return []


def run(models, lines, batches, timeout: int, profile: bool = False, keep=None) -> dict:
    """Every model and line, each in a process of its own. `keep(result)`: called with what
    was measured so far after each line (a run cut short keeps its lines)."""
    env = environment()
    rows, failures = [], []
    for spec in models:
        for line in lines:
            job = {"model": spec.name, "line": line, "batches": list(batches), "profile": profile}
            rows += in_process("benchmarks.zoo", job, f"{line} on {spec.name}", timeout, failures)
            if keep is not None:
                keep({"env": env, "rows": ratios(list(rows)), "failures": list(failures), "partial": True})
    return {"env": env, "rows": ratios(rows), "failures": failures}


def ratios(rows: list[dict]) -> list[dict]:
    """Each row's ms over eager's and over reduce-overhead's for the same model and shape."""
    by = {(r["model"], r["batch"], r["length"], r["line"]): r for r in rows}
    for r in rows:
        shape = (r["model"], r["batch"], r["length"])
        for peer, key in (("eager", "vs_eager"), ("reduce_overhead", "vs_peer")):
            other = by.get((*shape, peer))
            r[key] = r["ms"] / other["ms"] if other and other["ms"] else None
    return rows


COLUMNS = [("model", "model", "s"), ("batch", "B", "d"), ("length", "length", "d"), ("line", "line", "s"),
           ("ms", "ms/call", ".3f"), ("vs_eager", "÷ eager", ".2f"), ("vs_peer", "÷ reduce-overhead", ".2f"),
           ("max_err", "max err vs eager", ".3g"),
           ("max_err_exact", "max err vs fp32", ".3g"), ("first_s", "first call s", ".2f"),
           ("ready_s", "s to steady", ".1f"), ("mib", "MiB beyond eager", ".0f"), ("pool_mib", "of it graph pools", ".0f"),
           ("replayed", "replayed", "d")]


PROFILE_COLUMNS = [("kernels", "kernels/call", ".0f"), ("gpu_ms", "GPU ms/call", ".3f"), ("idle_us", "GPU idle µs", ".0f")]


def costliest(rows: list[dict], top: int = 8) -> str:
    """Per profiled row, its costliest kernels (name, count a call, µs a call)."""
    out = ["Costliest kernels a call (count, µs):"]
    for r in rows:
        if r.get("top"):
            out.append(f"\n{r['model']} B={r['batch']} length={r['length']} {r['line']}:")
            out += [f"- {n} ×{c:.0f} {us:.1f}" for n, c, us in r["top"][:top]]
    return "\n".join(out)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None, help="names, libraries or kinds (default: all installed)")
    parser.add_argument("--lines", nargs="+", default=list(LINES), choices=KNOWN_LINES)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--smoke", action="store_true", help="a tiny BERT (on the CPU simulation where there is no GPU)")
    parser.add_argument("--profile", action="store_true",
                        help="also each line's kernels a call, GPU ms and idle µs, and its costliest kernels (GPU)")
    worker_arguments(parser, timeout=600)
    parser.add_argument("--merge", metavar="TAG",
                        help="join the results of runs tagged TAG-<model> (one model a run, several GPUs) into one")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge)
    if args.worker:
        worker(json.loads(args.worker), args.out)
        return None
    if args.smoke:
        models, lines = (TINY,), [line for line in args.lines if line in ("eager", "graphify")]
    else:
        models = available(by_name(args.models) if args.models else MODELS)
        lines = args.lines
    name = "zoo" + (f"-{args.tag}" if args.tag else "") + ("-smoke" if args.smoke else "")

    def keep(partial: dict) -> None:  # the lines so far, on disk (the full result replaces them)
        from ._report import write

        write(name, partial.pop("env"), partial, with_failures(table(partial["rows"], COLUMNS), partial["failures"]))

    result = run(models, lines, args.batches, args.timeout, args.profile, keep=keep)
    md = table(result["rows"], COLUMNS + (PROFILE_COLUMNS if args.profile else []))
    if args.profile:
        md += "\n\n" + costliest(result["rows"])
    return publish_result("zoo", result, md, args.tag, args.smoke)


def with_failures(md: str, failures: list) -> str:
    return md + ("\n\nFailures:\n" + "\n".join(f"- {f}" for f in failures) if failures else "")


def publish_result(kind: str, result: dict, md: str, tag: str = "", smoke: bool = False) -> dict:
    """Publish a zoo benchmark's result as `<kind>[-tag][-smoke]-<device>`, its failures listed."""
    publish(kind + (f"-{tag}" if tag else "") + ("-smoke" if smoke else ""), result, with_failures(md, result["failures"]))
    return result


if __name__ == "__main__":
    main()
