"""The Triton kernel behind `models._reduce_norm`: a one-shot all-reduce through symmetric
memory, the residual add and RMSNorm in one launch (CUDA only; imported lazily, as Triton
is not a dependency on the CPU).

Each program takes rows `pid, pid + P, ...` of a [T, H] message. It copies its rows of this
rank's partial sum into this rank's symmetric buffer, meets the programs of the same id on
every peer at a barrier, sums the peers' rows in fp32, adds the residual, writes the new
residual and its RMSNorm, and meets them again, so that no rank writes its buffer for the
next reduce while a peer still reads it. The buffer and the pads serve one stream at a time
(torch's one- and two-shot kernels use them too, in stream order).

The barrier is the signal-pad handshake torch's own one-shot kernels use: each program owns
one 32-bit slot per peer in every rank's signal pad. To signal, a program compare-and-swaps
its slot on the peer from 0 to 1 (system scope, release: its block's writes before it are
visible to whoever acquires); to wait, it swaps each slot on its own pad from 1 back to 0
(acquire). Every slot is 0 again after a barrier, so a captured graph replays it with no host
step. A CTA barrier (`tl.debug_barrier`) before the signal orders the other threads' stores
before it, and one after the wait keeps them from reading early.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["all_reduce_add_rms_norm_kernel"]  # (named so: profiles count it among the all-reduces)


@triton.jit
def _meet(pads, program, rank: tl.constexpr, world: tl.constexpr):
    """Every rank's program `program` here: signal each peer, then wait for each peer's signal."""
    tl.debug_barrier()
    for peer in tl.static_range(world):
        theirs = tl.load(pads + peer).to(tl.pointer_type(tl.int32))
        slot = theirs + program * world + rank
        seen = tl.atomic_cas(slot, 0, 1, sem="release", scope="sys")
        while seen != 0:
            seen = tl.atomic_cas(slot, 0, 1, sem="release", scope="sys")
    mine = tl.load(pads + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(world):
        slot = mine + program * world + peer
        seen = tl.atomic_cas(slot, 1, 0, sem="acquire", scope="sys")
        while seen != 1:
            seen = tl.atomic_cas(slot, 1, 0, sem="acquire", scope="sys")
    tl.debug_barrier()


# Not specialised on `rows`: Triton would compile a kernel of its own for one row and for row
# counts divisible by 16, on first sight, and a first sight inside a graph's capture cannot load
# a new module. `_reduce_norm` compiles this one ahead (`warmup`) before any capture.
@triton.jit(do_not_specialize=["rows"])
def all_reduce_add_rms_norm_kernel(
    peers, pads, partial, residual, weight, residual_out, normed, rows, eps,
    H: tl.constexpr, BLOCK: tl.constexpr, rank: tl.constexpr, world: tl.constexpr,
):
    """`residual_out = residual + sum over ranks of partial`, `normed = rms_norm(residual_out) * weight`.
    `peers`: every rank's buffer as a tensor, in rank order (tensor arguments, so Triton sees
    their alignment and reads 16 bytes at a time); `pads`: a device array of every rank's
    signal-pad address (uint64)."""
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    pads = pads.to(tl.pointer_type(tl.uint64))
    own = peers[rank]
    for row in range(program, rows, programs):
        at = row.to(tl.int64) * H + cols
        tl.store(own + at, tl.load(partial + at, mask=inside), mask=inside)
    _meet(pads, program, rank, world)
    w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)  # lanes past H: 0, out of the sums
    for row in range(program, rows, programs):
        at = row.to(tl.int64) * H + cols
        total = tl.load(residual + at, mask=inside, other=0.0).to(tl.float32)
        # the peers in rank order, in fp32, rounded once: every rank the same rows; at two ranks
        # bit-equal to the one-shot reduce, at more within a rounding of it (it adds in bf16)
        reduced = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(world):
            reduced += tl.load(peers[peer] + at, mask=inside, other=0.0).to(tl.float32)
        total += reduced.to(partial.dtype.element_ty).to(tl.float32)
        total = total.to(residual_out.dtype.element_ty)
        tl.store(residual_out + at, total, mask=inside)
        x = total.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)  # as inductor's RMSNorm: within a bf16 rounding of eager's
        tl.store(normed + at, (x * rstd * w).to(normed.dtype.element_ty), mask=inside)
    _meet(pads, program, rank, world)
