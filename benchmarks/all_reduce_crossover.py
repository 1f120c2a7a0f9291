"""Where the one-shot symmetric-memory all-reduce stops paying: one-shot, two-shot (through the
same symmetric buffer) and NCCL's functional all-reduce timed per message size, to pick the
thresholds of `models._symm_mem.choose` (`all_reduce_fn(one_shot_max_bytes=...,
two_shot_max_bytes=...)`).

Messages of [tokens, hidden] bf16, tokens 1, 2, 4, ..., 1024, hidden 4096 (`--hidden 4096
8192` adds the 70B shape). Each kind of each size is timed inside one captured CUDA graph of
`--reduces` back-to-back reduces (warm-up replays, then CUDA events around each of `--reps`
replays; the time is the slowest rank's median ÷ reduces), and checked first: the graph
replayed on fresh random inputs (never zeros), each output against NCCL's eager sum of the
same inputs. Rank 0 prints the table (per size the fastest kind and every kind's ratio to it,
and today's choice) and the suggested thresholds, and writes
benchmarks/results/all-reduce-crossover-tp<N>-<device>.{json,md}.

    torchrun --nproc-per-node 2 -m benchmarks.all_reduce_crossover [--hidden 4096 8192]
    torchrun --nproc-per-node 2 -m benchmarks.all_reduce_crossover --cpu --smoke   # gloo: the checks, host times

NVLink multicast stays off, as the lent machines require: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set where unset (before
torch loads NCCL), and no multimem op is called. Without a CUDA GPU (or with `--cpu`) the
ranks join a gloo group and run the correctness pass of NCCL's kind alone (symmetric memory
needs GPUs), timed on the host; no result files unless asked (`--out`).
"""

from __future__ import annotations

import argparse
import os

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _key, _value in NO_MULTICAST.items():
    os.environ.setdefault(_key, _value)
os.environ.setdefault("TORCH_SYMMMEM", "CUDA")  # symmetric memory's own P2P backend, read at import

import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ._crossover import TOKENS, messages, render, suggest, summarise  # noqa: E402
from ._crossover_run import measure  # noqa: E402
from ._ranks import ExitTogether, init, rank_options  # noqa: E402
from ._report import environment, publish  # noqa: E402


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096], help="4096: 8B; 8192: the 70B shape")
    parser.add_argument("--reduces", type=int, default=20, help="back-to-back reduces in each captured graph")
    parser.add_argument("--reps", type=int, default=50, help="timed replays per graph (the median is kept)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed replays first")
    parser.add_argument("--checks", type=int, default=2, help="fresh random inputs checked per message and kind")
    parser.add_argument("--name", default="all-reduce-crossover", help="result files' name, -tp<N> added")
    rank_options(parser, smoke="few sizes and replays, no result files", cpu="gloo on the CPU: the correctness pass, host timing", timeout=120)
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens = sorted({args.tokens[0], args.tokens[len(args.tokens) // 2], args.tokens[-1]})
        args.reduces, args.reps, args.warmup, args.checks = 4, 5, 1, 1
    return args


def run(args, rank: int, world: int, device: torch.device) -> dict:
    """Every message measured by every kind, summarised; the same on every rank."""
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32  # gloo's CPU sums: float32, as the TP smoke runs
    sizes = messages(args.tokens, args.hidden, dtype)
    cells, unavailable = measure(sizes, args, dtype, device)
    rows = summarise(cells, dtype, world)
    how = (f"each kind inside one captured CUDA graph of {args.reduces} back-to-back reduces" if gpu else
           f"{args.reduces} back-to-back eager reduces on the host (no graphs on the CPU)")
    return {"env": {**environment(), "world": world}, "world": world, "gpu": gpu, "dtype": str(dtype),
            "tokens": list(args.tokens), "hidden": list(args.hidden), "reduces": args.reduces, "reps": args.reps,
            "warmup": args.warmup, "checks": args.checks, "how": how,
            "multicast_env": {k: os.environ.get(k) for k in NO_MULTICAST}, "unavailable": unavailable,
            "cells": cells, "rows": rows, "suggestion": suggest(rows, dtype, world)}


def report(args, result: dict, world: int) -> None:
    """Rank 0: the table and the suggestion printed; the result files written (not in a smoke run)."""
    markdown = render(result)
    if args.smoke or not result["gpu"]:
        print(markdown, flush=True)
    else:
        publish(f"{args.name}-tp{world}", dict(result), markdown)
    s = result["suggestion"]
    print(f"suggested crossover (tp{world}): one_shot_max_bytes={s['one_shot_max_bytes']} "
          f"two_shot_max_bytes={s['two_shot_max_bytes']} max_bytes={s['max_bytes']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2, default=str)


def main(argv=None) -> dict | None:
    args = parse(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("all_reduce_crossover: no CUDA GPU here; running the gloo correctness pass only (as --cpu)",
              file=sys.stderr, flush=True)
        args.cpu = True
    rank, world, device = init(args.cpu, args.timeout)
    together = ExitTogether(rank)
    result = None
    try:
        result = run(args, rank, world, device)
        if rank == 0:
            report(args, result, world)
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001 - any failure must end every rank
        together.fail(exc)
    together.stop()
    dist.destroy_process_group()
    return result if rank == 0 else None


if __name__ == "__main__":
    main()
