"""Tensor parallelism over the ranks of torchrun: decode steps of the 0.5B- and
Llama-3-8B-shaped varlen models (random bf16 weights) at TP=1 and TP=world, and the main
job's serving trace at TP=1 and TP=world.

Decode (`--what decode`, the default), B = 1, 8, 64 at KV length 256, per model:
- TP=1: the single-GPU model in graphify FULL graphs (every rank runs its own copy);
- TP=world, once per all-reduce kind (`--all-reduce nccl symm_mem`: NCCL's functional
  all-reduce, or the one-shot all-reduce through symmetric memory, NVLink P2P and no
  multicast; both by default where 2+ GPUs reach each other by P2P, else nccl): eager;
  graphify FULL with `group=` (the all-reduces inside the graphs, each graph checking that
  every rank replays the same one); and the floor, a hand-written loop of one
  `torch.cuda.CUDAGraph` per batch size of the same step (inputs copied into static
  buffers, no checks of any kind). Each row names its kind, and TP ÷ TP=1 is per kind.
Serving (`--what serving`): the trace of `benchmarks/serving.py` through graphify
FULL_AND_PIECEWISE at TP=1 and TP=world per all-reduce kind (collectives inside FULL graphs
and in PIECEWISE pieces): tokens/s and step latency p50/p99.

    torchrun --nproc-per-node 2 -m benchmarks.tensor_parallel [--model 0.5b 8b] [--what decode|serving|all] \
        [--all-reduce nccl symm_mem]
    torchrun --nproc-per-node 2 -m benchmarks.tensor_parallel --smoke --cpu --what all   # tiny, gloo, simulation

Every rank ends by itself (`ExitTogether`): a rank that fails prints its traceback, tells
the others through the process group's store and leaves at once; the others leave when
they hear of it, even while waiting on a collective inside a graph (which no NCCL timeout
sees). NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends), as the lent machines
require. Rank 0 prints the tables and writes benchmarks/results/<name>[-serving]-*.{json,md}.
"""

from __future__ import annotations

import argparse
import os

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _key, _value in NO_MULTICAST.items():
    os.environ.setdefault(_key, _value)
os.environ.setdefault("TORCH_SYMMMEM", "CUDA")  # symm_mem all-reduce: torch's own P2P backend, read at import
# `--cpu` (gloo and the simulation) hides the GPUs before torch is imported; `parse` reads it again
_early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
_early.add_argument("--cpu", action="store_true")
if _early.parse_known_args()[0].cpu:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from graphify import Mode, Options, graphify, sglang_piecewise_sizes
from graphify.capture import freeze_gc
from graphify.models import (  # noqa: E402
    ALL_REDUCE_KINDS,
    model_support,
    shard_config,
    shard_paged_cache,
    split_ops,
    tp_varlen_step,
    varlen_axes,
)
from graphify.transforms import split  # noqa: E402
from graphify.models._symm_mem import DEFAULT_MAX_BYTES, agree, thresholds  # noqa: E402

from ._ranks import ExitTogether, init, maybe_fail, rank_options  # noqa: E402
from ._report import environment, publish, sync  # noqa: E402
from ._tp_decode import BATCHES, LEVERS, MODELS, Groups, all_reduce_label, decode_model, max_err, model_setup  # noqa: E402
from ._tp_report import render_decode, render_serving, targets  # noqa: E402

# -- decode ---------------------------------------------------------------------------------

def run_decode(args, rank: int, world: int, device: torch.device) -> dict:
    rows, tp1_rows = [], []
    groups = Groups(world)
    for name in args.model:
        more, ones = decode_model(name, args, groups, device)
        rows += more
        tp1_rows += ones
        dist.barrier()
    cfg, _, kv_len = model_setup(args.model[0], device)
    return {"env": {**environment(), "world": world}, "world": world, "tp": list(args.tp), "kv_len": kv_len,
            "dtype": str(cfg.dtype), "batches": list(args.batches), "all_reduce": list(args.all_reduce),
            "levers": {lever: LEVERS[lever] for lever in args.lever}, "rows": rows, "tp1_rows": tp1_rows,
            "targets": targets([r for r in rows if r.get("batch") is not None], tp1_rows)}


# -- serving --------------------------------------------------------------------------------

def trace_row(setup, g, cache, initial: torch.Tensor, name: str, tp: int, startup: float, timed,
              group=None) -> dict:
    """Check `g` step by step against the single-GPU eager model (its own copy of the
    starting cache), then time every step of the trace (`group`: its ranks lined up first)."""
    from ._serving_trace import _percentile, ms_by_kind

    ref_cache = initial.clone()
    g.stats.reset()
    worst = 0.0
    with torch.inference_mode():
        for batch in setup.batches:
            worst = max(worst, max_err(g(*batch, cache), setup.step(*batch, ref_cache)))
        del ref_cache
        with freeze_gc():
            # every rank here first: work a rank did alone just before (the check pass's last
            # reference step, its GC pass) ends at other times on other ranks, and the first timed
            # step's all-reduces would wait out the difference (18-90 ms on the first step of TP=2
            # and TP=4 traces, 2026-11-28, against ~10 ms at TP=1)
            if group is not None:
                agree(True, group, cache.device)
            latencies = [timed(lambda: g(*batch, cache))[1] for batch in setup.batches]  # noqa: B023
    calls = len(setup.batches)
    by_mode = {r.mode: r.calls / 2 for r in g.stats.by_mode()}  # checked once, timed once
    return {"config": name, "tp": tp, "tokens_per_s": setup.tokens / (sum(latencies) / 1e3),
            # where a TP degree wins or loses against TP=1: ms per step kind, and every step's ms
            "ms_by_kind": ms_by_kind(setup, latencies), "step_ms": [round(x, 4) for x in latencies],
            "p50_ms": statistics.median(latencies), "p99_ms": _percentile(latencies, 0.99), "startup_s": startup,
            "steps_full_pct": 100 * by_mode.get(Mode.FULL, 0) / calls,
            "steps_piecewise_pct": 100 * by_mode.get(Mode.PIECEWISE, 0) / calls,
            "steps_none_pct": 100 * by_mode.get(Mode.NONE, 0) / calls, "max_err_vs_single_gpu": worst}


def serving_build(levers: list[str]) -> tuple[bool, bool]:
    """(inductor pieces, fused all-reduce + norm) of the serving trace's one build, from the levers
    asked for: pieces if any lever is of inductor's pieces ("pieces", "pieces+splitkv", ...), the
    fused norm if any lever has "+fused" (TP > 1 only). The trace's attention splits KV by itself,
    and its LM head stays replicated, so "+splitkv" and "+vocab" change nothing here."""
    fuse_norm = any("+fused" in lever for lever in levers)
    return any(lever.startswith("pieces") for lever in levers), fuse_norm


def run_serving(args, rank: int, world: int, device: torch.device) -> dict:
    """The main job's trace (benchmarks/serving.py) through graphify FULL_AND_PIECEWISE at
    TP=1 (each rank its own single-GPU model) and at each TP degree > 1 (`group=`) per
    all-reduce kind; with `--lever pieces`, every configuration's pieces inductor-compiled; with a
    `+fused` lever, also each TP step's all-reduces fused with the next norm where they can be."""
    from ._serving_trace import ATTENTION, SERVING_MODELS, Setup, step_kinds, step_timer

    gpu = device.type == "cuda"
    inductor, fuse_norm = serving_build(args.lever)
    setup = Setup(gpu, args.requests, args.seed, specialise_from=1 << 30, model=args.serving_model)
    timed = step_timer(gpu)
    initial = setup.cache.clone()
    how = "FULL_AND_PIECEWISE" + (" + inductor pieces" if inductor else "")
    g1, startup = setup.graphify("FULL_AND_PIECEWISE", inductor=inductor)
    one = trace_row(setup, g1, setup.cache, initial, f"TP=1 graphify {how}", 1, startup, timed)
    g1.release()
    del g1
    rows, ratios, groups, skipped = [one], {}, Groups(world), []
    sizes = sglang_piecewise_sizes(setup.max_tokens)
    for tp in (t for t in args.tp if t > 1):
        group = groups.of(tp)
        local = dist.get_rank(group)
        try:
            tcfg = shard_config(setup.cfg, tp)
        except ValueError as exc:  # the model's heads or MLP do not split over this many ranks
            skipped.append(f"TP={tp}: {exc}")
            continue
        for kind in args.all_reduce:
            cache = shard_paged_cache(tcfg, initial, local)
            step = tp_varlen_step(tcfg, setup.params, local, group=group, attention=ATTENTION, all_reduce=kind,
                                  crossover=args.crossover, fuse_norm=fuse_norm)
            used = step.all_reduce.kind
            label = f"TP={tp} " + all_reduce_label(kind, used, args.crossover) + (
                " + fused norms" if step.add_norm.fused else "")
            sync()
            t0 = time.perf_counter()  # start-up, timed once: split and capture are not repeated
            fn = split(step, split_ops(ATTENTION), *setup.example, cache, axes=varlen_axes(), compile=inductor)
            g = graphify(fn, mode="FULL_AND_PIECEWISE", sizes=sizes, axes=varlen_axes(),
                         support=model_support(ATTENTION),
                         options=Options(outputs="view", group=group)).capture(*setup.example, cache)
            sync()
            startup = time.perf_counter() - t0
            row = trace_row(setup, g, cache, initial, f"{label} graphify {how}", tp, startup, timed, group)
            g.release()
            del g, fn, step, cache
            ratios[label] = {"tokens_per_s": row["tokens_per_s"] / one["tokens_per_s"],
                             "p99": row["p99_ms"] / one["p99_ms"],
                             "ms_by_kind": {k: row["ms_by_kind"].get(k, 0.0) / ms
                                            for k, ms in one["ms_by_kind"].items() if ms}}
            rows.append({**row, "all_reduce": label})
        if gpu:
            torch.cuda.empty_cache()
    kinds = step_kinds(setup)
    return {"env": {**environment(), "world": world}, "world": world, "tp": list(args.tp), "rows": rows,
            "ratios": ratios, "inductor_pieces": inductor, "skipped": skipped,
            "trace": {"requests": args.requests, "seed": args.seed, "steps": len(setup.steps), "tokens": setup.tokens,
                      "step_kinds": kinds, "max_batch_tokens": setup.max_tokens},
            "config": {"model": SERVING_MODELS[setup.model][1], "dtype": str(setup.cfg.dtype),
                       "attention": ATTENTION}}


# -- main -------------------------------------------------------------------------------------

def crossover(one_shot_max_bytes: int | None, two_shot_max_bytes: int | None) -> dict[str, int | None] | None:
    """`tp_varlen_step`'s crossover for the symm_mem all-reduce, None where both are the defaults."""
    if one_shot_max_bytes is None and two_shot_max_bytes is None:
        return None
    thresholds(DEFAULT_MAX_BYTES, one_shot_max_bytes, two_shot_max_bytes)  # a bad one fails here, not on a rank
    return {"one_shot_max_bytes": one_shot_max_bytes, "two_shot_max_bytes": two_shot_max_bytes}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["0.5b", "8b"])
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--tp", type=int, nargs="+", default=None,
                        help="TP degrees beside TP=1 (default: the world size); each must divide the world, and "
                             "ranks run in groups of consecutive ranks, rank 0's group reported")
    parser.add_argument("--lever", nargs="+", choices=sorted(LEVERS), default=["plain"],
                        help="how the step is built: plain (as written) and/or pieces (inductor-compiled pieces)")
    parser.add_argument("--serving-model", choices=("0.5b", "8b"), default="0.5b", help="the serving trace's model")
    parser.add_argument("--what", choices=("decode", "serving", "all"), default="decode")
    parser.add_argument("--all-reduce", nargs="+", choices=ALL_REDUCE_KINDS, default=None,
                        help="TP all-reduce kinds to measure (default: both where 2+ GPUs reach each other by P2P, "
                             "else nccl)")
    parser.add_argument("--one-shot-max-bytes", type=int, default=None,
                        help="symm_mem: the one-shot all-reduce up to this many bytes (default: the library's, "
                             "1 MiB on two GPUs, 512 KiB on more)")
    parser.add_argument("--two-shot-max-bytes", type=int, default=None,
                        help="symm_mem: the two-shot all-reduce above the one-shot's range up to this many bytes, "
                             "NCCL above (default: the buffer; 0: none); the thresholds benchmarks.all_reduce_crossover "
                             "suggests")
    parser.add_argument("--requests", type=int, default=48, help="serving trace: requests")
    parser.add_argument("--seed", type=int, default=0, help="serving trace: seed")
    parser.add_argument("--name", default="tensor-parallel", help="result files' name (a second run: ...-again)")
    rank_options(parser, smoke="the tiny model, light timing, no result files", cpu="gloo and the simulation backend on the CPU", timeout=180)
    parser.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fail-at", choices=("start", "stuck", "capture", "timing"), default="timing",
                        help=argparse.SUPPRESS)
    parser.add_argument("--fail-how", choices=("raise", "kill"), default="raise", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.crossover = crossover(args.one_shot_max_bytes, args.two_shot_max_bytes)
    if args.smoke:
        args.model = ["tiny"]
    return args


def default_all_reduce(world: int, device: torch.device) -> list[str]:
    """Both kinds where every rank's GPU reaches the others' by P2P (agreed over the ranks,
    so all measure the same kinds), else nccl."""
    ok = device.type == "cuda" and world >= 2 and torch.cuda.device_count() >= world and all(
        torch.cuda.can_device_access_peer(device, peer) for peer in range(world) if peer != device.index)
    return list(ALL_REDUCE_KINDS) if agree(ok, None, device) else ["nccl"]


def serving_name(name: str) -> str:
    """The serving results' name beside decode results named `name`: tensor-parallel-serving[-tag]."""
    if name.startswith("tensor-parallel"):
        return "tensor-parallel-serving" + name.removeprefix("tensor-parallel")
    return f"{name}-serving"


def run(args, rank: int, world: int, device: torch.device) -> dict:
    """The parts asked for; rank 0 publishes each (or only prints it, in a smoke run)."""
    results = {}
    parts = (("decode", run_decode, render_decode, args.name),
             ("serving", run_serving, render_serving, serving_name(args.name)))
    for part, fn, render, name in parts:
        if args.what not in (part, "all"):
            continue
        result = fn(args, rank, world, device)
        if rank == 0:
            markdown = render(result)
            if args.smoke:
                print(markdown, flush=True)
            else:
                publish(name, dict(result), markdown)
        results[part] = result
        dist.barrier()
    return results


def main(argv=None) -> dict | None:
    args = parse(argv)
    rank, world, device = init(args.cpu, args.timeout)
    if rank != 0 or args.smoke:  # one progress bar: rank 0's
        os.environ["TQDM_DISABLE"] = "1"
    together = ExitTogether(rank)
    try:
        maybe_fail(args, rank, "start")
        maybe_fail(args, rank, "stuck")
        args.all_reduce = args.all_reduce or default_all_reduce(world, device)
        args.tp = sorted(set(args.tp or [world]))
        bad = [tp for tp in args.tp if tp < 1 or world % tp]
        if bad:
            raise ValueError(f"--tp {bad}: each TP degree must divide the world size {world}")
        results = run(args, rank, world, device)
        if rank == 0 and args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2, default=str)
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001 - any failure must end every rank
        together.fail(exc)
    together.stop()
    dist.destroy_process_group()  # graphify releases graphs holding the group's collectives first
    return results if rank == 0 else None


if __name__ == "__main__":
    main()
