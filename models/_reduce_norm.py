"""A row-parallel layer's all-reduce, the residual add and the next RMSNorm as one step.

At TP > 1 every decoder layer ends its attention and its MLP the same way: the ranks' partial
outputs summed (an all-reduce), added to the residual stream, and the sum normed for what
comes next. Unfused that is an all-reduce kernel, then inductor's add + RMSNorm kernel: two
launches and a round trip of the hidden state through memory, 64 times a step at the 8B
shape, where a decode step's time is mostly such fixed costs (notes: TP=2 runs at ~0.76 of
TP=1, not 0.5). Fused (`add_norm_fn(..., fused=True)`) it is one Triton launch over the
one-shot all-reduce's symmetric buffer (`models._triton_reduce_norm`), as TensorRT-LLM's
fused all-reduce and vLLM's all-reduce fusion pass do.

The fused launch serves what the one-shot all-reduce would: a symm_mem reduce (CUDA, NCCL
group, peers by P2P), a message within its one-shot range and its buffer, contiguous rows of
up to `MAX_HIDDEN`. Anything else (NCCL's reduce, the CPU, prefill's larger messages) runs the
three ops as written. The choice is made per call on the real size, inside one registered op
(`graphify_models::symm_mem_add_rms_norm`) so that `split`'s traces and inductor see one opaque
step, as `symm_mem_all_reduce` does for the reduce alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._symm_mem import _BUFFERS, _HANDLES, _WORLDS, _reduce, nccl_reduce

__all__ = ["add_norm_fn", "MAX_HIDDEN", "PROGRAMS"]

PROGRAMS = 16  # programs a launch at most: each holds `world` 32-bit slots of every signal pad (16 x 8 x 4 bytes)
MAX_HIDDEN = 16384  # a row is one program's registers


def add_norm_fn(reduce, eps: float, fused: bool = False):
    """`add_norm(partial, residual, weight) -> (x, y)`: `x = residual + reduce(partial)` and
    `y = rms_norm(x) * weight`. `fused`: one launch where it can run (see the module); the
    result's `.fused` says whether it may, `.reason` why not."""
    reason = _why_not(reduce) if fused else "not asked for"
    if reason is not None:
        def add_norm(partial, residual, weight):
            x = residual + reduce(partial)
            return x, F.rms_norm(x, (x.shape[-1],), weight, eps)
    else:
        name, max_bytes = reduce.group_name, reduce.max_bytes
        one, two = reduce.one_shot_max_bytes, reduce.two_shot_max_bytes

        def add_norm(partial, residual, weight):
            return torch.ops.graphify_models.symm_mem_add_rms_norm(
                partial, residual, weight, eps, name, max_bytes, one, two)
    add_norm.fused, add_norm.reason = reason is None, reason
    return add_norm


def _why_not(reduce) -> str | None:
    """Why `reduce` cannot take the fused step (None: it can, for messages that fit)."""
    if getattr(reduce, "kind", None) != "symm_mem":
        return f"the all-reduce is {getattr(reduce, 'kind', 'not symm_mem')}'s, not symmetric memory's"
    try:
        from . import _triton_reduce_norm  # noqa: F401
    except ImportError as exc:
        return f"no Triton here ({exc})"
    return None


def _fits(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, buf, one_shot_max: int) -> bool:
    """Whether the fused launch takes this call (else the three ops run as written)."""
    nbytes = partial.numel() * partial.element_size()
    return (buf is not None and partial.is_cuda and 0 < nbytes <= min(one_shot_max, buf.numel() * buf.element_size())
            and partial.dtype == buf.dtype == residual.dtype and partial.shape == residual.shape
            and partial.shape[-1] <= MAX_HIDDEN and weight.shape == partial.shape[-1:]
            and partial.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()
            and buf.data_ptr() in _HANDLES)


@torch.library.custom_op("graphify_models::symm_mem_add_rms_norm", mutates_args=())
def symm_mem_add_rms_norm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                          group_name: str, max_bytes: int, one_shot_max: int,
                          two_shot_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused step where it fits, else the all-reduce `choose` picks, the add and the norm."""
    buf = _BUFFERS.get((group_name, max_bytes, partial.dtype, partial.device))
    if _fits(partial, residual, weight, buf, one_shot_max):
        return _launch(partial, residual, weight, eps, buf, group_name)
    reduced = _reduce(partial, buf, group_name, one_shot_max, two_shot_max) if buf is not None \
        else nccl_reduce(group_name)(partial)
    x = residual + reduced
    return x, F.rms_norm(x, (x.shape[-1],), weight, eps)


@symm_mem_add_rms_norm.register_fake
def _(partial, residual, weight, eps, group_name, max_bytes, one_shot_max, two_shot_max):
    return torch.empty_like(residual), torch.empty_like(residual)


def _launch(partial, residual, weight, eps: float, buf: torch.Tensor, name: str):
    """One launch of the fused kernel over `buf`'s rendezvous (every rank of the group launches it)."""
    import triton

    from ._triton_reduce_norm import all_reduce_add_rms_norm_kernel

    handle = _HANDLES[buf.data_ptr()]
    hidden = partial.shape[-1]
    rows = partial.numel() // hidden
    x, y = torch.empty_like(residual), torch.empty_like(residual)
    block = triton.next_power_of_2(hidden)
    all_reduce_add_rms_norm_kernel[(min(rows, PROGRAMS),)](
        handle.buffer_ptrs_dev, handle.signal_pad_ptrs_dev, partial, residual, weight, x, y, rows, eps,
        H=hidden, BLOCK=block, rank=handle.rank, world=_WORLDS.get(name, handle.world_size),
        num_warps=max(4, min(16, block // 256)),
    )
    return x, y
