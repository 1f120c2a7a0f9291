"""Tensor-parallel decode: the 0.5B-shaped varlen model split over the ranks of torchrun,
eager vs graphify FULL (NCCL all-reduces inside the graphs), plus the outputs' largest
difference to the single-GPU model.

    torchrun --nproc-per-node 2 -m benchmarks.tensor_parallel

NVLink multicast (NVLS) stays off (NCCL_NVLS_ENABLE=0) as the lent machines require.
Rank 0 prints the table and writes benchmarks/results/tensor-parallel-*.{json,md}.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from graphify import Options, graphify, vllm_sizes  # noqa: E402
from models import (  # noqa: E402
    BlockTables,
    DecoderConfig,
    init_params,
    new_paged_cache,
    shard_config,
    shard_paged_cache,
    tp_varlen_step,
    varlen_axes,
    varlen_step,
)

from ._report import environment, host_pipelined_us, publish, table, time_per_call  # noqa: E402

BATCHES = (1, 8, 64)


def main() -> dict | None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    cfg = DecoderConfig.qwen2_5_0_5b(max_seq_len=1024)
    tcfg = shard_config(cfg, world)
    full = init_params(cfg, seed=0, device=device)
    full_cache = new_paged_cache(cfg, 1 + 64 * 17, 16, device=device, seed=1)
    cache = shard_paged_cache(tcfg, full_cache, rank)
    step = tp_varlen_step(tcfg, full, rank)
    single = varlen_step(cfg, full)
    tables = BlockTables(1 + 64 * 17, 16, 64)
    batches = {b: tables.batch(cfg, tuple(range(b)), (1,) * b, (256,) * b, device=device, seed=b) for b in BATCHES}
    g = graphify(step, mode="FULL", sizes=vllm_sizes(max(BATCHES)), axes=varlen_axes(), outputs="view",
                 options=Options(progress=rank == 0), group=dist.group.WORLD).capture(*batches[8], cache)
    rows = []
    with torch.inference_mode():
        for b, batch in batches.items():
            ref = single(*batch, full_cache.clone()).float()
            err = (g(*batch, cache).float() - ref).abs().max().item()
            eager_ms = time_per_call(lambda i: step(*batch, cache))  # noqa: B023
            graph_ms = time_per_call(lambda i: g(*batch, cache))  # noqa: B023
            rows.append({"batch": b, "eager_ms": eager_ms, "graphify_ms": graph_ms, "speedup": eager_ms / graph_ms,
                         "graphify_host_us": host_pipelined_us(lambda i: g(*batch, cache)),  # noqa: B023
                         "max_err_vs_single_gpu": err})
    dist.barrier()
    result = None
    if rank == 0:
        result = {"env": {**environment(), "world": world}, "rows": rows,
                  "config": {"model": "qwen2.5-0.5b-shape", "tp": world, "kv_len": 256, "dtype": str(cfg.dtype)}}
        md = (f"TP={world} decode, 0.5B shape (bf16), KV length 256; graphify FULL with NCCL all-reduces in the "
              "graphs, checked on every call for the same graph on every rank.\n\n")
        md += table(rows, [("batch", "B", "d"), ("eager_ms", "eager ms", ".3f"), ("graphify_ms", "graphify ms", ".3f"),
                           ("speedup", "speedup", ".2f"), ("graphify_host_us", "host µs/step", ".1f"),
                           ("max_err_vs_single_gpu", "max err vs 1 GPU", ".3g")])
        publish("tensor-parallel", result, md)
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
