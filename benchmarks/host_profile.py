"""Host-time breakdown of one piecewise decode step (what the eager split ops cost).

    python -m benchmarks.host_profile
"""

from __future__ import annotations

import torch

from graphify import graphify, vllm_sizes
from graphify.models import BatchLayout, DecoderConfig, init_params, model_support, new_paged_cache, split_ops, varlen_axes, varlen_step
from graphify.models import attention as attn
from graphify.transforms import split

from ._report import host_costs_us


def main():
    cfg = DecoderConfig.qwen2_5_0_5b(max_seq_len=2048)
    step = varlen_step(cfg, init_params(cfg, device="cuda"), "unified")
    cache = new_paged_cache(cfg, 1100, 16, device="cuda")
    lay = BatchLayout((1,) * 8, (255,) * 8, 16, 16)
    batch = lay.build(cfg, device="cuda")
    example = BatchLayout((3, 1, 5), (4, 7, 0), 16, 16).build(cfg, device="cuda")
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes())
    g = graphify(pw, mode="PIECEWISE", sizes=vllm_sizes(64), support=model_support("unified"))
    g = g.capture(*example, cache)
    g(*batch, cache)
    entry = next(e for e in g.table if e.key.num_tokens == 8)
    sched = entry.graph
    t, h, d, kvh = 8, cfg.heads, cfg.head_dim, cfg.kv_heads
    q = torch.randn(t, h, d, device="cuda", dtype=cfg.dtype)
    k = torch.randn(t, kvh, d, device="cuda", dtype=cfg.dtype)
    out = torch.empty_like(q)
    ids, pos, slots, ql, sl, bt = batch
    from graphify.models import _triton_attention as tri
    calls = {
        "whole piecewise step (g(...))": lambda i: g(*batch, cache),
        "schedule.replay(8, 8)": lambda i: sched.replay(8, 8),
        "one graph piece replay": lambda i: sched.steps[2].replay(),
        "attention via torch.ops (dispatcher)": lambda i: torch.ops.graphify_models.unified_attention(q, k, k, cache, 0, slots, pos, ql, sl, bt, out),
        "attention impl called directly": lambda i: getattr(attn.unified_attention, "_init_fn")(q, k, k, cache, 0, slots, pos, ql, sl, bt, out),
        "triton paged_attention (fused write)": lambda i: tri.paged_attention(q, k, k, cache, 0, slots, pos, ql, bt, out),
        "torch.cumsum": lambda i: torch.cumsum(ql, 0, dtype=torch.int32),
        "split piece GraphModule call": lambda i: sched.steps[1].fn(*[a if a is not None else None for a in sched._trimmed[(8, 8)][1]]),
    }
    rows = host_costs_us(calls, reps=200)  # each call after a synchronize, the variants interleaved
    for name, us in rows.items():
        print(f"{name:<45} {us:8.1f} µs")


if __name__ == "__main__":
    main()
