"""The all-reduce crossover benchmark's measuring (`benchmarks.all_reduce_crossover`): each
kind's reduce, a graph of back-to-back reduces per message, its check against NCCL's sum on
fresh inputs, and its time. Collective: every rank runs the same messages in the same order."""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from graphify.models import all_reduce_fn
from graphify.models._symm_mem import DEFAULT_MAX_BYTES

from ._floor import BackToBack

__all__ = ["reducers", "back_to_back", "check", "time_us", "measure"]


def reducers(dtype: torch.dtype, device: torch.device, max_bytes: int) -> tuple[dict, dict]:
    """({kind: reduce} for the kinds that run here, {kind: why not} for the others). Each
    symm_mem reduce is forced to one kind over the whole buffer; both share one buffer.
    Collective."""
    group = dist.group.WORLD
    nccl = all_reduce_fn(group, "nccl")
    one = all_reduce_fn(group, "symm_mem", dtype=dtype, device=device, max_bytes=max_bytes,
                        one_shot_max_bytes=max_bytes, two_shot_max_bytes=0)
    two = all_reduce_fn(group, "symm_mem", dtype=dtype, device=device, max_bytes=max_bytes,
                        one_shot_max_bytes=0, two_shot_max_bytes=max_bytes)
    kinds, unavailable = {"nccl": nccl}, {}
    if one.kind == "symm_mem":
        kinds["one_shot"] = one
    else:
        unavailable["one_shot"] = one.fallback_reason
    if two.kind == "symm_mem" and two.two_shot_reason is None:
        kinds["two_shot"] = two
    else:
        unavailable["two_shot"] = two.fallback_reason or two.two_shot_reason
    return kinds, unavailable


def back_to_back(reduce, x: torch.Tensor, reduces: int) -> BackToBack:
    """`reduces` back-to-back reduces of the static input `x`, captured by hand (warmed up on a
    side stream first, so every rank's collectives pair up), or eager on the CPU."""
    return BackToBack(lambda x: [reduce(x) for _ in range(reduces)], x, reduces)


def fresh(shape: tuple, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Random values of magnitude 0.5 to 1.5 and random sign: never zero, so a reduce that
    wrote nothing, or summed too few ranks, shows."""
    gen = torch.Generator(device=device).manual_seed(seed)
    magnitude = torch.rand(shape, generator=gen, device=device) + 0.5
    sign = torch.randint(0, 2, shape, generator=gen, device=device) * 2 - 1
    return (magnitude * sign).to(dtype)


def tolerance(dtype: torch.dtype, world: int) -> float:
    """How far a sum of `world` values below 1.5 may lie from NCCL's, summed in another order
    with a rounding after each add: two units in the last place of the largest sum per add."""
    ulp = torch.finfo(dtype).eps * 2 ** math.floor(math.log2(1.5 * world))
    return 2 * max(world - 1, 1) * ulp


def check(run: BackToBack, seeds: list[int]) -> float:
    """The largest difference of any output from NCCL's eager sum, over fresh inputs per seed
    and over the ranks (so every rank reports the same)."""
    worst = torch.zeros((), dtype=torch.float64, device=run.x.device)
    for seed in seeds:
        run.x.copy_(fresh(tuple(run.x.shape), run.x.dtype, run.x.device, seed))
        want = run.x.clone()
        dist.all_reduce(want)
        run.replay()
        for out in run.outs:
            worst = torch.maximum(worst, (out.double() - want.double()).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def time_us(run: BackToBack, reps: int, warmup: int) -> float:
    """The slowest rank's median µs per reduce over `reps` replays: CUDA events between
    replays queued back to back (one sync at the end), or the host clock on the CPU."""
    slowest = torch.tensor([statistics.median(run.per_call_us(reps, warmup))], dtype=torch.float64, device=run.x.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def measure(sizes: list[dict], args, dtype: torch.dtype, device: torch.device) -> tuple[list[dict], dict]:
    """(one cell per message and kind, {kind: why it did not run}). A kind whose sum is wrong
    is still timed (its row says so); one that the reduce would not take for a size (an odd
    size: NCCL's instead) is not."""
    world, rank = dist.get_world_size(), dist.get_rank()
    size = torch.empty((), dtype=dtype).element_size()
    max_bytes = max(DEFAULT_MAX_BYTES, *(s["bytes"] for s in sizes))
    max_bytes += -max_bytes % size
    kinds, unavailable = reducers(dtype, device, max_bytes)
    cells = []
    for m, msg in enumerate(sizes):
        for k, (kind, reduce) in enumerate(sorted(kinds.items())):
            cell = {**msg, "kind": kind, "us": None, "max_err": None, "ok": None, "note": None}
            cells.append(cell)
            taken = getattr(reduce, "kind_for", lambda n, d: "nccl")(msg["bytes"], dtype)
            if taken != kind and kind != "nccl":
                cell["note"] = f"the reduce takes {taken} at {msg['bytes']} bytes"
                continue
            x = fresh((msg["tokens"], msg["hidden"]), dtype, device, seed=rank)
            run = back_to_back(reduce, x, args.reduces)
            seeds = [((m * 8 + k) * 100 + c) * 64 + rank for c in range(args.checks)]
            cell["max_err"] = check(run, seeds)
            cell["ok"] = cell["max_err"] <= tolerance(dtype, world)
            cell["us"] = time_us(run, args.reps, args.warmup)
            del run, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return cells, unavailable
