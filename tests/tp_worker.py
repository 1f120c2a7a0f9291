"""One rank of the tensor-parallel tests (tests/test_distributed.py starts two): gloo on
the CPU, graphify's simulation backend. Prints one `RESULT <json>` line."""

from __future__ import annotations

import json
import logging
import random
import sys
import time

import torch
import torch.distributed as dist

from graphify import Options, graphify, release_all, sglang_piecewise_sizes
from graphify.distributed.lockstep import DispatchMismatchError
from graphify.models import (
    BatchLayout,
    all_reduce_fn,
    DecoderConfig,
    init_params,
    model_support,
    new_paged_cache,
    shard_config,
    shard_paged_cache,
    split_ops,
    tp_varlen_step,
    varlen_axes,
    varlen_step,
)
from graphify.transforms import split

CFG = DecoderConfig.tiny(max_seq_len=128, heads=4, kv_heads=2, ffn=96)
EXAMPLE = BatchLayout((3, 1, 5), (4, 7, 0), 16, 8)


def layout(rnd: random.Random) -> BatchLayout:
    r = rnd.randint(1, 6)
    if rnd.random() < 0.4:
        return BatchLayout((1,) * r, tuple(rnd.randint(1, 60) for _ in range(r)), 16, 8)
    return BatchLayout(tuple(rnd.randint(1, 9) for _ in range(r)), tuple(rnd.choice((0, 5, 30)) for _ in range(r)), 16, 8)


def build(rank: int, world: int, mode: str, sizes=None, lockstep: str = "graph", all_reduce: str = "nccl"):
    full = init_params(CFG, seed=0)
    tcfg = shard_config(CFG, world)
    full_cache = new_paged_cache(CFG, 80, 16, seed=1)
    cache = shard_paged_cache(tcfg, full_cache, rank)
    step = tp_varlen_step(tcfg, full, rank, all_reduce=all_reduce)
    example = EXAMPLE.build(CFG)
    fn = split(step, split_ops("unified"), *example, cache, axes=varlen_axes())
    g = graphify(fn, mode=mode, sizes=sizes or sglang_piecewise_sizes(32), axes=varlen_axes(), support=model_support("unified"), options=Options(backend="sim", group=dist.group.WORLD, lockstep=lockstep))
    return g.capture(*example, cache), cache, varlen_step(CFG, full), full_cache


def equal(rank: int, world: int) -> dict:
    """TP graphs equal the single-process model on random batches."""
    out = {}
    for mode in ("FULL", "FULL_AND_PIECEWISE"):
        g, cache, reference, ref_cache = build(rank, world, mode)
        rnd = random.Random(mode)  # the same batches on every rank
        worst, seen = 0.0, []
        with torch.inference_mode():
            for i in range(12):
                lay = layout(rnd)
                seen.append((sum(lay.query_lens), all(q == 1 for q in lay.query_lens)))  # (tokens, uniform decode)
                batch = lay.build(CFG, seed=i)
                worst = max(worst, (g(*batch, cache) - reference(*batch, ref_cache)).abs().max().item())
        out[mode] = {"max_err": worst, "modes": {r.mode.value: r.calls for r in g.stats.by_mode()}, "seen": seen,
                     "resolved": g.resolution.mode.value, "largest": max(g.sizes)}
    return out


def symm_fallback(rank: int, world: int) -> dict:
    """kind="symm_mem" on gloo: the functional collective, a logged reason, the same numbers."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("graphify.models.tensor_parallel").addHandler(handler)
    reduce = all_reduce_fn(kind="symm_mem", dtype=torch.float32, device="cpu")
    nccl = all_reduce_fn(kind="nccl")
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(rank))
    out = {"kind": reduce.kind, "reason": reduce.fallback_reason, "logged": [r.getMessage() for r in records],
           "reduce_diff": (reduce(x) - nccl(x)).abs().max().item(),
           "reduce_vs_sum": (reduce(x) - sum(torch.randn(5, 128, generator=torch.Generator().manual_seed(r))
                                             for r in range(world))).abs().max().item()}
    for mode in ("FULL", "FULL_AND_PIECEWISE"):
        g, cache, reference, ref_cache = build(rank, world, mode, all_reduce="symm_mem")
        n, ncache, _, _ = build(rank, world, mode)
        rnd = random.Random(mode)
        worst = same = 0.0
        seen = []
        with torch.inference_mode():
            for i in range(8):
                lay = layout(rnd)
                seen.append((sum(lay.query_lens), all(q == 1 for q in lay.query_lens)))
                batch = lay.build(CFG, seed=i)
                got = g(*batch, cache)
                same = max(same, (got - n(*batch, ncache)).abs().max().item())
                worst = max(worst, (got - reference(*batch, ref_cache)).abs().max().item())
        out[mode] = {"max_err": worst, "vs_nccl": same, "modes": {r.mode.value: r.calls for r in g.stats.by_mode()},
                     "seen": seen, "resolved": g.resolution.mode.value, "largest": max(g.sizes)}
    return out


def plan_mismatch(rank: int, world: int) -> dict:
    try:
        build(rank, world, "FULL", sizes=(4, 8) if rank == 0 else (4, 16))
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def prepare_fails_on_one_rank(rank: int, world: int) -> dict:
    """Rank 1's capture is rejected before it plans: rank 0 must hear of it, not wait."""
    full = init_params(CFG, seed=0)
    tcfg = shard_config(CFG, world)
    cache = shard_paged_cache(tcfg, new_paged_cache(CFG, 80, 16, seed=1), rank)
    step = tp_varlen_step(tcfg, full, rank)
    axes = varlen_axes() if rank == 0 else varlen_axes()[:-1]  # rank 1: one axis short
    g = graphify(step, mode="FULL", sizes=(4, 8), axes=axes, options=Options(backend="sim", group=dist.group.WORLD))
    try:
        g.capture(*EXAMPLE.build(CFG), cache)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def call_mismatch(rank: int, world: int, lockstep: str = "graph") -> dict:
    """Rank 0 calls with 2 requests, rank 1 with 5: both must raise, then carry on."""
    g, cache, reference, ref_cache = build(rank, world, "FULL", lockstep=lockstep)
    result = {}
    same = EXAMPLE.build(CFG, seed=3)
    with torch.inference_mode():
        g(*same, cache)
        mine = BatchLayout((1,) * (2 if rank == 0 else 5), (9,) * (2 if rank == 0 else 5), 16, 8).build(CFG, seed=4)
        try:
            g(*mine, cache)
            result["mismatch"] = None
        except DispatchMismatchError as exc:
            result["mismatch"] = str(exc)
        after = BatchLayout((1, 1, 1), (5, 6, 7), 16, 8).build(CFG, seed=5)
        result["after_ok"] = tuple(g(*after, cache).shape) == (3, CFG.vocab_size)
    return result


def build_cuda(rank: int, world: int, mode: str, all_reduce: str = "nccl"):
    """`build` on GPU `rank` over NCCL (bf16, CUDA graphs): the captured TP callable, its
    cache, the single-GPU reference and the reference's cache; plus the config and device."""
    device = torch.device("cuda", rank)
    cfg = DecoderConfig.tiny(max_seq_len=128, heads=4, kv_heads=2, ffn=96, hidden=128, dtype=torch.bfloat16)
    full = init_params(cfg, seed=0, device=device)
    tcfg = shard_config(cfg, world)
    full_cache = new_paged_cache(cfg, 80, 16, seed=1, device=device)
    cache = shard_paged_cache(tcfg, full_cache, rank)
    step = tp_varlen_step(tcfg, full, rank, all_reduce=all_reduce)
    assert step.all_reduce.kind == all_reduce, step.all_reduce.fallback_reason
    example = EXAMPLE.build(cfg, device=device)
    fn = split(step, split_ops("unified"), *example, cache, axes=varlen_axes())
    g = graphify(fn, mode=mode, sizes=sglang_piecewise_sizes(32), axes=varlen_axes(), support=model_support("unified"), options=Options(backend="cuda", group=dist.group.WORLD)).capture(*example, cache)
    return g, cache, varlen_step(cfg, full), full_cache, cfg, device


def equal_cuda(rank: int, world: int, all_reduce: str = "nccl") -> dict:
    """On GPUs (NCCL, CUDA graphs, bf16): TP decode equals the single-GPU model."""
    out = {}
    for mode in ("FULL", "FULL_AND_PIECEWISE"):
        g, cache, reference, ref_cache, cfg, device = build_cuda(rank, world, mode, all_reduce)
        rnd = random.Random(mode)
        worst, seen = 0.0, []
        with torch.inference_mode():
            for i in range(12):
                lay = BatchLayout((1,) * 6, tuple(rnd.randint(1, 60) for _ in range(6)), 16, 8) if i % 2 else layout(rnd)
                seen.append((sum(lay.query_lens), all(q == 1 for q in lay.query_lens)))
                batch = lay.build(cfg, seed=i, device=device)
                got = g(*batch, cache).float()
                worst = max(worst, (got - reference(*batch, ref_cache).float()).abs().max().item())
        out[mode] = {"max_err": worst, "modes": {r.mode.value: r.calls for r in g.stats.by_mode()}, "seen": seen,
                     "resolved": g.resolution.mode.value, "largest": max(g.sizes)}
    return out


def symm_mem_cuda(rank: int, world: int) -> dict:
    """The symm_mem reduce on GPUs: TP graphs (FULL: its ops captured per size; F&P: split's
    registered op) equal the single-GPU model; the reduce alone, eager and replayed in a
    CUDA graph on fresh inputs, equals NCCL's sum, falling back where it must."""
    out = equal_cuda(rank, world, "symm_mem")
    device = torch.device("cuda", rank)
    reduce = all_reduce_fn(kind="symm_mem", dtype=torch.bfloat16, device=device, max_bytes=1 << 16)
    small = all_reduce_fn(kind="symm_mem", dtype=torch.float32, device=device, max_bytes=4096)
    gen = torch.Generator(device=device).manual_seed(100 + rank)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    def nccl_sum(x):
        y = x.clone()
        dist.all_reduce(y)
        return y

    cases = {  # name -> (reduce, input): within the buffer, above it, odd bytes, another dtype, strided, misaligned
        "decode": (reduce, rand(1, 4096)), "batch": (reduce, rand(8, 4096)), "above": (reduce, rand(16, 4096)),
        "odd": (reduce, rand(1, 3)), "fp16": (reduce, rand(4, 64, dtype=torch.float16)),
        "strided": (reduce, rand(8, 512)[:, ::2]), "offset": (reduce, rand(1001)[1:].view(10, 100)),
        "fp32": (small, rand(4, 256, dtype=torch.float32)), "fp32_above": (small, rand(5, 256, dtype=torch.float32)),
    }
    out["direct"] = {k: (r(x).float() - nccl_sum(x).float()).abs().max().item() for k, (r, x) in cases.items()}
    static = rand(4, 4096)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        reduce(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = reduce(static)
    worst = 0.0
    for _ in range(5):
        static.copy_(rand(4, 4096))
        graph.replay()
        worst = max(worst, (captured.float() - nccl_sum(static).float()).abs().max().item())
    out["graph_replay"] = worst
    out["kinds"] = [reduce.kind, small.kind]
    torch.cuda.synchronize()
    return out


def exits_cleanly(rank: int, world: int) -> dict:
    """A captured TP callable still alive at the end: teardown releases its graphs first."""
    g, cache, reference, ref_cache = build(rank, world, "FULL_AND_PIECEWISE")
    with torch.inference_mode():
        g(*EXAMPLE.build(CFG, seed=2), cache)
    KEPT.append(g)  # still alive when main() destroys the process group
    return {"graphs": len(g.table), "released_by_hand": release_all(dist.group.WORLD) if rank == 0 else None,
            "call_after_release": _error_of(lambda: g(*EXAMPLE.build(CFG, seed=2), cache)) if rank == 0 else None}


KEPT: list = []


def exits_cleanly_cuda(rank: int, world: int) -> dict:
    g, cache, _, _, cfg, device = build_cuda(rank, world, "FULL_AND_PIECEWISE")
    with torch.inference_mode():
        for seed in range(4):
            g(*BatchLayout((1,) * 4, (9, 3, 20, 7), 16, 8).build(cfg, seed=seed, device=device), cache)
            g(*EXAMPLE.build(cfg, seed=seed, device=device), cache)
    torch.cuda.synchronize()
    KEPT.append(g)
    return {"graphs": len(g.table)}


def call_mismatch_cuda(rank: int, world: int) -> dict:
    g, cache, _, _, cfg, device = build_cuda(rank, world, "FULL")
    with torch.inference_mode():
        mine = BatchLayout((1,) * (2 if rank == 0 else 5), (9,) * (2 if rank == 0 else 5), 16, 8)
        g(*mine.build(cfg, seed=4, device=device), cache)
        torch.cuda.synchronize()  # the device-side assert surfaces here
    return {"mismatch": None}


def _error_of(fn) -> str | None:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


SCENARIOS = {"equal": equal, "plan_mismatch": plan_mismatch, "call_mismatch": call_mismatch, "equal_cuda": equal_cuda,
             "symm_fallback": symm_fallback, "symm_mem_cuda": symm_mem_cuda,
             "call_mismatch_host": lambda rank, world: call_mismatch(rank, world, "host"),
             "prepare_fails_on_one_rank": prepare_fails_on_one_rank, "exits_cleanly": exits_cleanly,
             "exits_cleanly_cuda": exits_cleanly_cuda, "call_mismatch_cuda": call_mismatch_cuda}


def run_scenario(name: str, rank: int, world: int, between: bool = False) -> dict:
    """One scenario's result; `between`: one of several in this group (a barrier after it,
    so the next starts together: one group's start-up serves them all)."""
    try:
        result = SCENARIOS[name](rank, world)
    except Exception as exc:  # reported, so the test can show it
        result = {"crash": f"{type(exc).__name__}: {exc}"}
    if between:
        dist.barrier()
    return result


def main() -> None:
    scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    backend = "nccl" if scenario.endswith("_cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = run_scenario(scenario, rank, world) if "+" not in scenario else {
        name: run_scenario(name, rank, world, between=True) for name in scenario.split("+")}
    result["t_result"] = time.time()
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()  # graphify releases graphs holding the group's collectives first
    print("AFTER_DESTROY " + json.dumps({"graphs_left": [len(g.table) for g in KEPT]}), flush=True)


if __name__ == "__main__":
    main()
