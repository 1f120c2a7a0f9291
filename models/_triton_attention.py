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
_FAST = knobs is not None and triton.__version__.startswith("3.6.") and torch.version.hip is None  # CUDA's launcher
_COMPILED: dict = {}


# Not specialised on num_reqs: Triton would compile a kernel of its own for a batch of one
# request (value 1) and for request counts divisible by 16, on first sight; a captured graph
# never saw a single-request prefill, so its first one compiled in the middle of serving
# (a Triton compile, with the launcher's C stub built by gcc).
@triton.jit(do_not_specialize=["num_reqs"])
def _attention_kernel(
    Q, K, V, KC, VC, Out, block_tables, query_lens, positions, slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt,
    num_reqs, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, KVH: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)  # kv head
    offs_d = tl.arange(0, D)
    # This token's new key and value go to its slot. Nobody reads them from the cache in
    # this launch: tokens of the same request take this step's keys from K and V below.
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
    for start in range(0, pos + 1, BLOCK_N):
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
    out = acc / l_i[:, None]
    tl.store(Out + t * stride_ot + (h * G + offs_g)[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=offs_g[:, None] < G)


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
    consts = (g, max(16, triton.next_power_of_2(g)), d, bs, kvh, max(64, bs), q.dtype == torch.float32)
    scale = 1.0 / d**0.5
    tensors = (q, k, v, out, block_tables, query_lens, positions, slot_mapping)
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
            kernel.run(t, kvh, 1, driver.active.get_current_stream(device), kernel.function, kernel.packed_metadata,
                       None, None, None, *ptrs, *ints, scale, *consts)
            return
    cache = kv_cache[layer]
    kernel = _attention_kernel[(t, kvh)](
        q, k, v, cache[0], cache[1], out, block_tables, query_lens, positions, slot_mapping, *ints, scale,
        G=consts[0], G_PAD=consts[1], D=d, BS=bs, KVH=kvh, BLOCK_N=consts[5], IEEE=consts[6],
    )
    if fast:
        _COMPILED[key] = kernel


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
