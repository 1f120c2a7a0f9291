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

from ._symm_mem import _BUFFERS, _HANDLES, _reduce, agree, nccl_reduce

__all__ = ["add_norm_fn", "MAX_HIDDEN", "PROGRAMS"]

PROGRAMS = 16  # programs a launch at most: each holds `world` 32-bit slots of every signal pad (16 x 8 x 4 bytes)
MAX_HIDDEN = 16384  # a row is one program's registers
_PEERS: dict[int, tuple] = {}  # a buffer's address -> every rank's buffer, as tensors on this GPU


def add_norm_fn(reduce, eps: float, fused: bool = False, *, hidden: int | None = None, group=None):
    """`add_norm(partial, residual, weight) -> (x, y)`: `x = residual + reduce(partial)` and
    `y = rms_norm(x) * weight`. `fused`: one launch where it can run (see the module); the
    result's `.fused` says whether it may, `.reason` why not. With `group` (collective: every
    rank calls it, outside any capture) the kernel for rows of `hidden` is compiled here, and
    every rank must have it, or none fuses: a rank that launched it alone would wait for its
    peers forever."""
    reason = _why_not(reduce) if fused else "not asked for"
    if fused and group is not None and getattr(reduce, "kind", None) == "symm_mem":  # (else the same on every rank)
        if reason is None and hidden is not None:
            reason = _compile(reduce, hidden)
        if not agree(reason is None, group, reduce.buffer.device):
            reason = reason or "the fused all-reduce + norm cannot run on another rank"
    if reason is not None:
        def add_norm(partial, residual, weight):
            return _three_ops(reduce, partial, residual, weight, eps)
    else:
        name, max_bytes = reduce.group_name, reduce.max_bytes
        one, two = reduce.one_shot_max_bytes, reduce.two_shot_max_bytes

        def add_norm(partial, residual, weight):
            n = partial.numel()
            if not isinstance(n, torch.SymInt) and n * partial.element_size() > one:  # known now: not fused
                return _three_ops(reduce, partial, residual, weight, eps)  # (inductor fuses around the reduce)
            return torch.ops.graphify_models.symm_mem_add_rms_norm(
                partial, residual, weight, eps, name, max_bytes, one, two)
    add_norm.fused, add_norm.reason = reason is None, reason
    return add_norm


def _three_ops(reduce, partial, residual, weight, eps: float):
    """The step unfused: `residual + reduce(partial)` and its RMSNorm."""
    x = residual + reduce(partial)
    return x, F.rms_norm(x, (x.shape[-1],), weight, eps)


def _why_not(reduce) -> str | None:
    """Why `reduce` cannot take the fused step (None: it can, for messages that fit)."""
    if getattr(reduce, "kind", None) != "symm_mem":
        return f"the all-reduce is {getattr(reduce, 'kind', 'not symm_mem')}'s, not symmetric memory's"
    try:
        from . import _triton_reduce_norm  # noqa: F401
    except ImportError as exc:
        return f"no Triton here ({exc})"
    return None


def _aligned(*tensors: torch.Tensor) -> bool:
    """Every tensor starts on a 16-byte boundary: the one specialisation compiled ahead."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _fits(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, buf, one_shot_max: int) -> bool:
    """Whether the fused launch takes this call (else the three ops run as written). Every rank
    must answer alike, or one would wait in the kernel for peers running other kernels: these are
    facts of the call's shapes and dtypes, and of alignment, which fresh tensors from the caching
    allocator share (512-byte blocks) and views share by their shapes."""
    nbytes = partial.numel() * partial.element_size()
    return (buf is not None and partial.is_cuda and 0 < nbytes <= min(one_shot_max, buf.numel() * buf.element_size())
            and partial.dtype == buf.dtype == residual.dtype == weight.dtype
            and partial.device == residual.device == weight.device and partial.shape == residual.shape
            and partial.shape[-1] <= MAX_HIDDEN and weight.shape == partial.shape[-1:]
            and partial.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()
            and _aligned(partial, residual, weight) and buf.data_ptr() in _HANDLES)


@torch.library.custom_op("graphify_models::symm_mem_add_rms_norm", mutates_args=())
def symm_mem_add_rms_norm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                          group_name: str, max_bytes: int, one_shot_max: int,
                          two_shot_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused step where it fits, else the all-reduce `choose` picks, the add and the norm."""
    buf = _BUFFERS.get((group_name, max_bytes, partial.dtype, partial.device))
    if _fits(partial, residual, weight, buf, one_shot_max):
        return _launch(partial, residual, weight, eps, buf)
    reduce = (lambda p: _reduce(p, buf, group_name, one_shot_max, two_shot_max)) if buf is not None \
        else nccl_reduce(group_name)
    return _three_ops(reduce, partial, residual, weight, eps)


@symm_mem_add_rms_norm.register_fake
def _(partial, residual, weight, eps, group_name, max_bytes, one_shot_max, two_shot_max):
    return torch.empty_like(residual), torch.empty_like(residual)


def _peers(buf: torch.Tensor) -> tuple:
    """Every rank's buffer as a tensor on this GPU (its own is `buf`), in rank order, made once."""
    if buf.data_ptr() not in _PEERS:
        handle = _HANDLES[buf.data_ptr()]
        _PEERS[buf.data_ptr()] = tuple(buf if r == handle.rank else handle.get_buffer(r, (buf.numel(),), buf.dtype)
                                       for r in range(handle.world_size))
    return _PEERS[buf.data_ptr()]


def _grid_args(partial, residual, weight, eps: float, buf: torch.Tensor):
    """(grid, arguments, options) of one launch over `buf`'s rendezvous."""
    import triton

    handle = _HANDLES[buf.data_ptr()]
    hidden = partial.shape[-1]
    rows = partial.numel() // hidden
    x, y = torch.empty_like(residual), torch.empty_like(residual)
    block = triton.next_power_of_2(hidden)
    options = {"H": hidden, "BLOCK": block, "rank": handle.rank, "world": handle.world_size,
               "num_warps": max(4, min(16, block // 256))}
    return (min(rows, PROGRAMS),), (_peers(buf), handle.signal_pad_ptrs_dev, partial, residual, weight, x, y, rows,
                                     eps), options


def _launch(partial, residual, weight, eps: float, buf: torch.Tensor):
    """One launch of the fused kernel (every rank of the group launches it)."""
    from ._triton_reduce_norm import all_reduce_add_rms_norm_kernel

    grid, args, options = _grid_args(partial, residual, weight, eps, buf)
    all_reduce_add_rms_norm_kernel[grid](*args, **options)
    return args[5], args[6]


def _compile(reduce, hidden: int) -> str | None:
    """Compile the kernel for rows of `hidden` and load it (no launch), so that no capture is the
    first to see it; why it failed (None: it did not)."""
    try:
        from ._triton_reduce_norm import all_reduce_add_rms_norm_kernel

        buf = reduce.buffer
        row = torch.zeros(1, hidden, dtype=buf.dtype, device=buf.device)
        grid, args, options = _grid_args(row, row.clone(), torch.ones(hidden, dtype=buf.dtype, device=buf.device),
                                         1e-6, buf)
        compiled = all_reduce_add_rms_norm_kernel.warmup(*args, grid=grid, **options)
        getattr(compiled, "_init_handles", lambda: None)()  # its module loaded now: a capture may not load one
    except Exception as exc:  # noqa: BLE001 - any failure is a reason to run the three ops, on every rank
        return f"the fused all-reduce + norm kernel did not compile: {type(exc).__name__}: {exc}"
    return None
