"""Paged attention as registered ops, with two backends of different CUDA-graph support.

Both ops write the new keys and values into a paged KV cache, `[layers, 2, blocks,
block_size, kv_heads, head_dim]`, at `slot_mapping` (block * block_size + offset; block 0
is scratch, so padding writes there), then attend each token to its request's cached
positions up to its own, writing into `out` in place (nothing is returned, so a split
program needs no copy between the op and the next piece).

- `unified_attention` (Support.ALWAYS): one routine for any mix of prefill, decode and
  spec-decode tokens, from lengths in tensors only: capturable for every batch.
- `split_attention` (Support.UNIFORM_SINGLE_TOKEN_DECODE): a decode routine when every
  request has one token (capturable), and a prefill routine that reads the query lengths
  on the host and loops over requests (not capturable), like backends whose mixed-batch
  path needs host metadata.
"""

from __future__ import annotations

import functools
import math

import attrs
import torch
import torch.nn.functional as F

from graphify import Support

__all__ = ["AttentionBackend", "BACKENDS", "unified_attention", "split_attention", "triton_kernels"]

USE_TRITON = True  # on CUDA, when Triton is installed; tests switch it off to compare


def triton_kernels(q: torch.Tensor):
    """The Triton kernels module for CUDA tensors, or None (CPU, no Triton, switched off)."""
    if not (USE_TRITON and q.is_cuda):
        return None
    return _load_triton()


@functools.cache
def _load_triton():
    try:
        from . import _triton_attention
    except ImportError:
        return None
    return _triton_attention


def _write_kv(kv_cache, layer: int, slot_mapping, k, v) -> None:
    cache = kv_cache[layer]
    kvh, d = cache.shape[-2], cache.shape[-1]
    cache[0].view(-1, kvh, d)[slot_mapping] = k
    cache[1].view(-1, kvh, d)[slot_mapping] = v


def _request_kv(kv_cache, layer: int, block_tables):
    """Keys and values of each request: [R, S, kv_heads, d] with S = blocks * block_size."""
    cache = kv_cache[layer]
    r, kvh, d = block_tables.shape[0], cache.shape[-2], cache.shape[-1]
    return cache[0][block_tables].reshape(r, -1, kvh, d), cache[1][block_tables].reshape(r, -1, kvh, d)


def _grouped(q, keys, values, visible):
    """q [B, h, d] against keys/values [B, S, kvh, d]; visible [B, S] -> [B, h, d]."""
    b, h, d = q.shape
    kvh = keys.shape[2]
    scores = torch.matmul(q.view(b, kvh, h // kvh, d), keys.permute(0, 2, 3, 1)).float() * (1.0 / math.sqrt(d))
    scores = scores.masked_fill(~visible[:, None, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values.permute(0, 2, 1, 3)).reshape(b, h, d)


@torch.library.custom_op("graphify_models::unified_attention", mutates_args=("kv_cache", "out"))
def unified_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
    slot_mapping: torch.Tensor, positions: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, out: torch.Tensor,
) -> None:
    kernels = triton_kernels(q)
    if kernels is not None:
        kernels.paged_attention(q, k, v, kv_cache, layer, slot_mapping, positions, query_lens, block_tables, out)
        return
    _write_kv(kv_cache, layer, slot_mapping, k, v)
    keys, values = _request_kv(kv_cache, layer, block_tables)
    t, r = q.shape[0], block_tables.shape[0]
    ends = torch.cumsum(query_lens, 0)
    req = torch.searchsorted(ends, torch.arange(t, device=q.device), right=True).clamp_(max=r - 1)
    visible = torch.arange(keys.shape[1], device=q.device)[None, :] <= positions[:, None]
    out.copy_(_grouped(q, keys[req], values[req], visible))


@torch.library.custom_op("graphify_models::split_attention", mutates_args=("kv_cache", "out"))
def split_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
    slot_mapping: torch.Tensor, positions: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, out: torch.Tensor,
) -> None:
    t, r = q.shape[0], block_tables.shape[0]
    kernels = triton_kernels(q)
    if t == r and kernels is not None:  # the decode routine, as one kernel on CUDA
        kernels.paged_attention(q, k, v, kv_cache, layer, slot_mapping, positions, query_lens, block_tables, out)
        return
    _write_kv(kv_cache, layer, slot_mapping, k, v)
    keys, values = _request_kv(kv_cache, layer, block_tables)
    if t == r:  # every request has one token: the decode routine
        visible = torch.arange(keys.shape[1], device=q.device)[None, :] <= positions[:, None]
        out.copy_(_grouped(q, keys, values, visible))
        return
    start = 0  # the prefill routine: host lengths, one request at a time
    for b, (ql, sl) in enumerate(zip(query_lens.tolist(), seq_lens.tolist())):
        if ql == 0:
            continue
        qpos = torch.arange(sl - ql, sl, device=q.device)
        mask = torch.arange(sl, device=q.device)[None, :] <= qpos[:, None]
        qb = q[start : start + ql].transpose(0, 1)[None]
        kb, vb = keys[b, :sl].transpose(0, 1)[None], values[b, :sl].transpose(0, 1)[None]
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True)
        out[start : start + ql] = ob[0].transpose(0, 1)
        start += ql


@unified_attention.register_fake
def _(q, k, v, kv_cache, layer, slot_mapping, positions, query_lens, seq_lens, block_tables, out):
    return None


@split_attention.register_fake
def _(q, k, v, kv_cache, layer, slot_mapping, positions, query_lens, seq_lens, block_tables, out):
    return None


@attrs.frozen
class AttentionBackend:
    """An attention op and how much CUDA-graph support it declares."""

    name: str
    op: object = attrs.field(eq=False, repr=False)
    support: Support


BACKENDS = {
    "unified": AttentionBackend("unified", torch.ops.graphify_models.unified_attention, Support.ALWAYS),
    "split": AttentionBackend("split", torch.ops.graphify_models.split_attention, Support.UNIFORM_SINGLE_TOKEN_DECODE),
}
