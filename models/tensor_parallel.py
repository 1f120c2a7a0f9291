"""Tensor parallelism for the varlen reference model, on torch.distributed.

Megatron-style: the fused QKV and gate/up projections are column-parallel (each rank keeps
its heads, its KV heads and its slice of the MLP), the attention output and down
projections are row-parallel, and their partial outputs are summed over the ranks by one
all-reduce each, of one of two kinds (`all_reduce_fn`):
- "nccl": torch's functional collective (`_c10d_functional.all_reduce` + `wait_tensor`), so
  `split` traces it, inductor compiles it, and CUDA graphs capture it (NCCL on GPUs; gloo
  runs the same program on CPUs);
- "symm_mem": a one-shot all-reduce through symmetric memory (`models._symm_mem`: one
  kernel reading the peers' buffers over NVLink P2P, no multicast), for the small messages
  of decode, where NCCL's per-call latency dominates; NCCL where it cannot run. Thresholds
  (`one_shot_max_bytes`, `two_shot_max_bytes`) may hand larger messages to a two-shot
  reduce through the same buffer, or to NCCL; by default the measured crossover: one-shot up
  to 1 MiB on two GPUs (512 KiB on more), two-shot above it up to the 8 MiB buffer, NCCL above.
Embedding and norms are replicated; so is the LM head (tied to the embedding), or, with
`lm_head="vocab"`, split by vocabulary rows, the logits joined by one all-gather.

    torchrun --nproc-per-node 2 -m benchmarks.tensor_parallel
"""

from __future__ import annotations

from collections.abc import Sequence

import logging

import attrs
import torch

from ._reduce_norm import add_norm_fn
from ._symm_mem import DEFAULT_MAX_BYTES, nccl_gather_last, nccl_reduce, symm_mem_reduce, thresholds
from .decoder import Decoder, DecoderConfig, draw_weight, rope_tables
from .varlen import varlen_step

__all__ = ["shard_config", "shard_params", "init_shard_params", "shard_paged_cache", "all_reduce_fn", "tp_varlen_step", "ALL_REDUCE_KINDS"]

log = logging.getLogger(__name__)
ALL_REDUCE_KINDS = ("nccl", "symm_mem")
LM_HEADS = ("replicated", "vocab")


def shard_config(cfg: DecoderConfig, world: int) -> DecoderConfig:
    """The per-rank config of `cfg` split over `world` ranks."""
    return attrs.evolve(cfg, tp=world)


def _rows(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return t[start : start + size]


def shard_params(cfg: DecoderConfig, params: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slices of the full model's `params` (from `init_params` with tp=1)."""
    if not 0 <= rank < cfg.tp:
        raise ValueError(f"shard_params: rank {rank} is outside 0..{cfg.tp - 1}")
    d, h, kv, ffn = cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn
    hl, kvl, fl = cfg.local_heads, cfg.local_kv_heads, cfg.local_ffn
    out = {}
    for name, t in params.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("qkv_weight", "qkv_bias"):  # [q heads | k heads | v heads] rows: keep ours of each
            q = _rows(t, rank * hl * d, hl * d)
            k = _rows(t, h * d + rank * kvl * d, kvl * d)
            v = _rows(t, (h + kv) * d + rank * kvl * d, kvl * d)
            out[name] = torch.cat([q, k, v]).contiguous()
        elif leaf == "o_weight":  # row-parallel: our heads' input columns
            out[name] = t[:, rank * hl * d : (rank + 1) * hl * d].contiguous()
        elif leaf == "gate_up_weight":  # [gate | up] rows: our slice of each
            out[name] = torch.cat([_rows(t, rank * fl, fl), _rows(t, ffn + rank * fl, fl)]).contiguous()
        elif leaf == "down_weight":  # row-parallel: our MLP slice's input columns
            out[name] = t[:, rank * fl : (rank + 1) * fl].contiguous()
        else:
            out[name] = t
    return out


_SHARDED = ("qkv_weight", "qkv_bias", "o_weight", "gate_up_weight", "down_weight")


def init_shard_params(cfg: DecoderConfig, rank: int, *, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights of a model too large to build whole on one device (a 70B shape
    at TP=4): drawn sharded (`cfg.tp` > 1) straight on `device`, with the scale of the whole
    model's (`init_params`). Weights every rank holds (embedding, norms) are equal on all
    ranks; the shards are not the slices of any one whole model, so compare them with this
    TP model run eagerly, not with a single-GPU one."""
    if not 0 <= rank < cfg.tp:
        raise ValueError(f"init_shard_params: rank {rank} is outside 0..{cfg.tp - 1}")
    device = torch.device(device)
    fan_in = {"o_weight": cfg.heads * cfg.head_dim, "down_weight": cfg.ffn}  # the whole layer's inputs
    params = {}
    for i, (name, p) in enumerate(Decoder(cfg).to("meta").named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        own = rank + 1 if leaf in _SHARDED else 0  # replicated weights draw alike on every rank
        gen = torch.Generator(device=device).manual_seed((seed * 100_003 + i) * 1_009 + own)
        params[name] = draw_weight(name, p.shape, fan_in.get(leaf, p.shape[-1]), gen, cfg.dtype)
    return {**params, **rope_tables(cfg, device)}


def shard_paged_cache(cfg: DecoderConfig, cache: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s KV heads of a full paged cache `[layers, 2, blocks, block, kv_heads, d]`."""
    kvl = cfg.local_kv_heads
    return cache[..., rank * kvl : (rank + 1) * kvl, :].contiguous()


def all_reduce_fn(group=None, kind: str = "nccl", *, dtype: torch.dtype = torch.bfloat16, device=None,
                  max_bytes: int = DEFAULT_MAX_BYTES, one_shot_max_bytes: int | None = None,
                  two_shot_max_bytes: int | None = None):
    """`x -> sum of x over the group`, traceable by `split` and capturable in CUDA graphs.

    `kind="nccl"`: the functional collective. `kind="symm_mem"`: the one-shot all-reduce
    through a symmetric-memory buffer of `max_bytes` for tensors of `dtype` on `device` (the
    current CUDA device by default), NCCL for larger messages; it is collective (every rank
    calls it, outside any capture) and, where symmetric memory cannot run (CPU or gloo, one
    rank, no P2P, another dtype), logs why and returns the NCCL reduce. The result says what
    it is: `.kind` ("nccl" or "symm_mem") and `.fallback_reason` (None unless it fell back).

    The crossover (`models._symm_mem.choose`, measured by `benchmarks.all_reduce_crossover`):
    one-shot up to `one_shot_max_bytes`, the two-shot all-reduce through the same buffer up to
    `two_shot_max_bytes`, NCCL above. The defaults are the crossover measured on two and four
    H200s: one-shot up to 1 MiB on two GPUs (512 KiB on more), two-shot above it up to the
    buffer, NCCL above (where two-shot cannot run: one-shot up to the buffer)."""
    import torch.distributed as dist

    if kind not in ALL_REDUCE_KINDS:
        raise ValueError(f"all_reduce_fn: kind {kind!r} is not one of {ALL_REDUCE_KINDS}")
    thresholds(max_bytes, one_shot_max_bytes, two_shot_max_bytes)  # a bad threshold is an error for any kind
    group = group or dist.group.WORLD
    reduce, reason = (None, None) if kind == "nccl" else symm_mem_reduce(
        group, dtype, device, max_bytes, one_shot_max_bytes, two_shot_max_bytes)
    if reduce is not None:
        return reduce
    if reason is not None:
        log.warning("all_reduce_fn(kind='symm_mem'): %s; using NCCL's functional all-reduce instead", reason)
    reduce = nccl_reduce(group.group_name)
    reduce.kind, reduce.fallback_reason = "nccl", reason
    return reduce


def tp_varlen_step(cfg: DecoderConfig, params: dict[str, torch.Tensor], rank: int, group=None,
                   attention: "str | Sequence[str]" = "unified", all_reduce: str = "nccl", *, sharded: bool = False,
                   lm_head: str = "replicated", crossover: "dict[str, int] | None" = None, fuse_norm: bool = False):
    """This rank's step of the model whose full (tp=1) weights are `params` (or, `sharded`,
    whose rank-`rank` shards they are: `init_shard_params`); `all_reduce` is the kind of
    `all_reduce_fn` (collective for "symm_mem": every rank of `group` builds its step). The
    step's `.all_reduce` is the reduce it got (its `.kind` says whether it fell back).
    `lm_head="vocab"`: each rank computes its slice of the vocabulary's logits (its rows of
    the tied embedding) and one all-gather joins them, instead of every rank reading the
    whole LM head. `crossover`: `all_reduce_fn`'s `one_shot_max_bytes` / `two_shot_max_bytes` for
    the symm_mem kind (measured by `benchmarks.all_reduce_crossover`); None keeps its defaults.
    `fuse_norm`: each layer's all-reduces, residual adds and next norms as one launch where the
    symm_mem reduce can serve the message (`models._reduce_norm`; the step's `.add_norm.fused`
    says whether it may, `.reason` why not)."""
    import torch.distributed as dist

    if lm_head not in LM_HEADS:
        raise ValueError(f"tp_varlen_step: lm_head {lm_head!r} is not one of {LM_HEADS}")
    device = next(iter(params.values())).device
    reduce = all_reduce_fn(group, all_reduce, dtype=cfg.dtype, device=device, **(crossover or {}))
    mine = params if sharded else shard_params(cfg, params, rank)
    gather = None
    if lm_head == "vocab":
        rows = cfg.vocab_size // cfg.tp
        mine = {**mine, "lm_head": params["embed"][rank * rows : (rank + 1) * rows].contiguous()}
        gather = nccl_gather_last((group or dist.group.WORLD).group_name, cfg.tp)
    add_norm = add_norm_fn(reduce, cfg.eps, fused=fuse_norm, hidden=cfg.hidden, group=group or dist.group.WORLD)
    step = varlen_step(cfg, mine, attention, reduce=reduce, gather=gather, add_norm=add_norm)
    step.all_reduce, step.add_norm = reduce, add_norm
    return step
