"""Triton kernels for the reference paged attention on CUDA: one launch per layer writes
the new keys and values into the cache and computes attention for every token (any mix
of prefill and decode) with an online softmax over its request's blocks. Few launches
matter here: split ops run eagerly between piecewise graphs, so their launch count is
host time per layer; so is each launch's cost, and after the first launch of a
specialisation the op launches Triton's compiled kernel directly (`launch_key` says when
two calls may share one), at a fraction of the host time of Triton's own launch path.

The torch implementation in `attention.py` is the reference (and the CPU path); the CUDA
tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import driver

try:
    from triton import knobs
except ImportError:  # Triton < 3.4: Triton's own launch path only
    knobs = None

__all__ = ["paged_attention", "launch_key"]

# Triton's launch path spends tens of microseconds binding and specialising 21 arguments, and
# a PIECEWISE step runs this op eagerly once per layer (more host time a step than the step's
# GPU time at small batches). So the first launch of each specialisation goes through
# Triton, which compiles or finds the kernel, and later ones with the same `launch_key`
# launch that compiled kernel directly, with raw pointers (no per-call binding).
# `CompiledKernel.run`'s arguments are Triton's private launcher API and change between
# releases, so the direct path is on only for the release it was written and tested on.
# Split-KV (flash-decoding): with few programs (decode at B=1 runs one per kv head) each walks
# every position alone; splitting the positions over more programs, then joining their partial
# softmaxes in a second kernel, shortens the longest walk. On two H200s at the 8B shape, B=1,
# 257 keys: 32 layers' attention took 480 µs in one step, 199 + 81 (the joins) split in five.
SPLIT_KV = True
SPLIT_BELOW_PROGRAMS = 64  # one-step grids of fewer programs split (64 at B=8 gained nothing)
MAX_SPLITS = 16
_FAST = knobs is not None and triton.__version__.startswith("3.6.") and torch.version.hip is None  # CUDA's launcher
_COMPILED: dict = {}


# Not specialised on num_reqs: Triton would compile a kernel of its own for a batch of one
# request (value 1) and for request counts divisible by 16, on first sight; a captured graph
# never saw a single-request prefill, so its first one compiled in the middle of serving
# (a Triton compile, with the launcher's C stub built by gcc).
@triton.jit(do_not_specialize=["num_reqs"])
def _attention_kernel(
    Q, K, V, KC, VC, Out, block_tables, query_lens, positions, slots, Part,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt,
    num_reqs, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, KVH: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SPLITS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)  # kv head
    split = tl.program_id(2)  # which share of the token's keys (SPLITS > 1: split-KV)
    offs_d = tl.arange(0, D)
    # This token's new key and value go to its slot. Nobody reads them from the cache in
    # this launch: tokens of the same request take this step's keys from K and V below.
    if split == 0:
        slot = tl.load(slots + t).to(tl.int64)
        tl.store(KC + slot * (KVH * D) + h * D + offs_d, tl.load(K + t * stride_kt + h * stride_kh + offs_d))
        tl.store(VC + slot * (KVH * D) + h * D + offs_d, tl.load(V + t * stride_vt + h * stride_vh + offs_d))

    # The token's request: how many requests end at or before it (ends = running sum of
    # the query lengths), and where that request's new tokens end.
    req = 0
    carry = 0
    end = 2147483647
    for i in range(0, num_reqs, 128):
        offs_r = i + tl.arange(0, 128)
        lens = tl.load(query_lens + offs_r, mask=offs_r < num_reqs, other=0).to(tl.int32)
        ends = carry + tl.cumsum(lens, axis=0)
        inside = offs_r < num_reqs
        req += tl.sum(((ends <= t) & inside).to(tl.int32), axis=0)
        end = tl.minimum(end, tl.min(tl.where((ends > t) & inside, ends, 2147483647), axis=0))
        carry += tl.sum(lens, axis=0)
    req = tl.minimum(req, num_reqs - 1)
    pos = tl.load(positions + t)
    if t < carry:  # keys before the request's first new token come from the cache
        first = end - tl.load(query_lens + req).to(tl.int32)
        ctx = tl.load(positions + first)
    else:  # a padding token: everything from the cache (its request is padding too)
        first = 0
        ctx = pos + 1

    offs_g = tl.arange(0, G_PAD)
    q = tl.load(Q + t * stride_qt + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=offs_g[:, None] < G, other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    # This program's share of the token's pos + 1 keys: whole BLOCK_Ns, split by the token's own
    # length (read here, so a replayed graph splits each step's lengths evenly).
    span = tl.cdiv(tl.cdiv(pos + 1, BLOCK_N), SPLITS) * BLOCK_N
    for start in range(split * span, tl.minimum((split + 1) * span, pos + 1), BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        visible = offs_n <= pos
        cached = visible & (offs_n < ctx)
        fresh = visible & (offs_n >= ctx)
        blk = tl.load(block_tables + req * stride_bt + offs_n // BS, mask=cached, other=0).to(tl.int64)
        row = (blk * BS + offs_n % BS) * (KVH * D) + h * D
        new = first + offs_n - ctx
        k = tl.load(KC + row[:, None] + offs_d[None, :], mask=cached[:, None], other=0.0)
        k += tl.load(K + new[:, None] * stride_kt + h * stride_kh + offs_d[None, :], mask=fresh[:, None], other=0.0)
        v = tl.load(VC + row[:, None] + offs_d[None, :], mask=cached[:, None], other=0.0)
        v += tl.load(V + new[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=fresh[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(visible[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(Out + t * stride_ot + (h * G + offs_g)[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=offs_g[:, None] < G)
    else:  # this split's running max, sum and unnormalised output: `_combine_kernel` joins them
        row = ((t * KVH + h) * SPLITS + split) * G_PAD + offs_g
        tl.store(Part + row * (D + 2) + D, m_i)
        tl.store(Part + row * (D + 2) + D + 1, l_i)
        tl.store(Part + row[:, None] * (D + 2) + offs_d[None, :], acc)


@triton.jit
def _combine_kernel(Part, Out, stride_ot, stride_oh, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                    KVH: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr):
    """One token's kv head: the splits' partial softmaxes joined (split-KV attention's second step)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    row = ((t * KVH + h) * SPLITS + offs_s[:, None]) * G_PAD + offs_g[None, :]  # [S_PAD, G_PAD]
    inside = offs_s[:, None] < SPLITS
    m = tl.load(Part + row * (D + 2) + D, mask=inside, other=float("-inf"))
    l = tl.load(Part + row * (D + 2) + D + 1, mask=inside, other=0.0)
    top = tl.max(m, axis=0)  # split 0 always holds a key (position 0), so it is finite
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top[None, :]))  # a split past the token's keys: none
    total = tl.sum(l * w, axis=0)
    acc = tl.load(Part + row[:, :, None] * (D + 2) + offs_d[None, None, :], mask=inside[:, :, None], other=0.0)
    out = tl.sum(acc * w[:, :, None], axis=0) / total[:, None]
    tl.store(Out + t * stride_ot + (h * G + offs_g)[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=offs_g[:, None] < G)


def splits_for(tokens: int, kv_heads: int, max_positions: int, block_n: int) -> int:
    """How many ranges of positions a token's keys are split into (1: the one-step kernel).
    Split-KV only where the one-step grid leaves most of the GPU idle (decode at small
    batch: one program per token and kv head); a choice from shapes alone, so a captured
    graph always makes it alike."""
    if not SPLIT_KV or tokens * kv_heads >= SPLIT_BELOW_PROGRAMS:
        return 1
    return max(1, min(MAX_SPLITS, -(-max_positions // block_n), SPLIT_BELOW_PROGRAMS // (tokens * kv_heads)))


def paged_attention(q, k, v, kv_cache, layer: int, slot_mapping, positions, query_lens, block_tables, out) -> None:
    """Write k, v at `slot_mapping`, then out[t] = attention of q[t] over its request's
    positions <= positions[t]: one launch."""
    t, heads, d = q.shape
    if t == 0:
        return
    kvh, bs = kv_cache.shape[-2], kv_cache.shape[-3]
    g = heads // kvh
    (sqt, sqh, _), (skt, skh, _), (svt, svh, _), (sot, soh, _) = q.stride(), k.stride(), v.stride(), out.stride()
    ints = (sqt, sqh, skt, skh, svt, svh, sot, soh, block_tables.stride(0), block_tables.shape[0])
    g_pad, block_n = max(16, triton.next_power_of_2(g)), max(64, bs)
    max_positions = block_tables.shape[1] * bs
    splits = splits_for(t, kvh, max_positions, block_n)
    consts = (g, g_pad, d, bs, kvh, block_n, q.dtype == torch.float32, splits)
    scale = 1.0 / d**0.5
    part = (torch.empty((t, kvh, splits, g_pad, d + 2), dtype=torch.float32, device=q.device) if splits > 1
            else out)  # unused with one split
    tensors = (q, k, v, out, block_tables, query_lens, positions, slot_mapping, part)
    fast = _FAST and _no_launch_hooks()  # launch hooks (profilers) go through Triton
    if fast:
        if not -kv_cache.shape[0] <= layer < kv_cache.shape[0]:  # what kv_cache[layer] would raise below
            raise IndexError(f"layer {layer} is out of range for a KV cache of {kv_cache.shape[0]} layers")
        layer %= kv_cache.shape[0]
        es = kv_cache.element_size()
        kc = kv_cache.data_ptr() + layer * kv_cache.stride(0) * es  # kv_cache[layer][0], no view made
        ptrs = (tensors[0].data_ptr(), tensors[1].data_ptr(), tensors[2].data_ptr(), kc, kc + kv_cache.stride(1) * es,
                *(x.data_ptr() for x in tensors[3:]))
        device = driver.active.get_current_device()
        key = launch_key(device, (q.dtype, k.dtype, v.dtype, kv_cache.dtype, kv_cache.dtype,
                                  *(x.dtype for x in tensors[3:])), ptrs, ints, consts)
        kernel = _COMPILED.get(key)
        if kernel is not None:
            kernel.run(t, kvh, splits, driver.active.get_current_stream(device), kernel.function,
                       kernel.packed_metadata, None, None, None, *ptrs, *ints, scale, *consts)
            _combine(part, out, t, kvh, consts)
            return
    cache = kv_cache[layer]
    kernel = _attention_kernel[(t, kvh, splits)](
        q, k, v, cache[0], cache[1], out, block_tables, query_lens, positions, slot_mapping, part, *ints, scale,
        G=g, G_PAD=g_pad, D=d, BS=bs, KVH=kvh, BLOCK_N=block_n, IEEE=consts[6], SPLITS=splits,
    )
    _combine(part, out, t, kvh, consts)
    if fast:
        _COMPILED[key] = kernel


def _combine(part, out, t: int, kvh: int, consts: tuple) -> None:
    """Split-KV's second step (nothing with one split)."""
    g, g_pad, d, splits = consts[0], consts[1], consts[2], consts[7]
    if splits > 1:
        _combine_kernel[(t, kvh)](part, out, out.stride(0), out.stride(1), G=g, G_PAD=g_pad, D=d, KVH=kvh,
                                  SPLITS=splits, S_PAD=triton.next_power_of_2(splits))


def _no_launch_hooks() -> bool:
    """No launch hook is set (Triton >= 3.4 holds them in chains, empty unless a profiler adds one)."""
    rt = knobs.runtime
    return all(h is None or not getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


def launch_key(device: int, dtypes: tuple, ptrs: tuple, ints: tuple, consts: tuple) -> tuple:
    """What Triton specialises a compiled kernel on, or finer: the device, each pointer's
    dtype and 16-byte alignment, each int's class (1, a multiple of 16, 32-bit or not) and
    the constexprs. Two calls with one key may share a compiled kernel."""
    return (device, dtypes, tuple(p % 16 == 0 for p in ptrs),
            tuple((i == 1, i % 16 == 0, -(2**31) <= i < 2**31) for i in ints), consts)
