"""Decode's one-row matmuls through a Triton GEMV instead of cuBLAS, inside compiled code.

At a batch of one, every projection of a decode step is a [1, K] x [N, K].T product that reads
its weight once and computes little. On an H200, cuBLAS reads the Llama-3-8B shapes at 23-88%
of peak bandwidth (a token's matmuls 4.5 ms); the GEMV of `graphify.models._triton_gemv` reads
each of them nearer peak (3.8 ms with its one-row config; `benchmarks.one_row_gemm --sweep`).
At 8 rows the two are level, so only one row takes the GEMV.

`route_one_row_linears(gm)` rewrites dynamo's graph before inductor compiles it
(`Options(compile={"gemv": True, ...})`): every `linear` call becomes
`torch.ops.graphify.one_row_linear`, an opaque op that decides per call from its inputs
(`takes_gemv`, a pure function of the shapes, dtypes and device) whether the GEMV or
`F.linear` runs. Dynamic shapes keep the row count symbolic at compile time, so the choice
cannot be made there; under a captured graph the decision ran once, at capture. Anything the
GEMV does not take (the CPU, fp32, more rows, odd K, no Triton) runs `F.linear` as written.
"""

import functools
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from graphify.extend import GraphRewrite

__all__ = ["route_one_row_linears", "takes_gemv", "one_row_linear", "triton_ready", "GEMV_ROWS", "REWRITE"]

GEMV_ROWS = 1  # rows the GEMV takes: at 8 it is level with cuBLAS (0.97-0.98 a token, H200)
_DTYPES = (torch.bfloat16, torch.float16)
_LINEAR = {torch._C._nn.linear, F.linear}


def takes_gemv(device_type: str, x_dtype, w_dtype, rows: int, n: int, k: int, w_contiguous: bool,
               triton_ready: bool) -> bool:
    """Whether a linear of `rows` rows over an [n, k] weight runs the GEMV: CUDA, bf16 or fp16
    on both sides, at most `GEMV_ROWS` rows (and at least one), K a multiple of 8 (its 16-byte
    loads), a contiguous weight, Triton importable."""
    return (device_type == "cuda" and x_dtype in _DTYPES and w_dtype == x_dtype and 1 <= rows <= GEMV_ROWS
            and k % 8 == 0 and n >= 1 and w_contiguous and triton_ready)


@functools.lru_cache(maxsize=1)
def triton_ready() -> bool:
    """Whether the GEMV can run here (Triton importable, not its interpreter); imports both."""
    from graphify.models import _triton_gemv

    return _triton_gemv.available() and not _triton_gemv.interpreting()


@torch.library.custom_op("graphify::one_row_linear", mutates_args=())
def one_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the GEMV where `takes_gemv` says so."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if weight.dim() == 2 and x.is_cuda and takes_gemv(x.device.type, x.dtype, weight.dtype, rows, weight.shape[0], k,
                                                      weight.is_contiguous(), triton_ready()):
        from graphify.models._triton_gemv import gemv

        out = gemv(x.reshape(rows, k), weight).reshape(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


@one_row_linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _keep_for_backward(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    """`F.linear`'s gradients: a compile with grad on (training, or a user's call outside
    `no_grad`) traces through the op as through the linear it replaced."""
    x, weight = ctx.saved_tensors
    rows = grad.reshape(-1, grad.shape[-1])
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None
    grad_w = rows.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_b = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


one_row_linear.register_autograd(_backward, setup_context=_keep_for_backward)


def route_one_row_linears(gm: fx.GraphModule) -> int:
    """Rewrite every `linear` call of `gm` (dynamo's graph) to `one_row_linear` in place;
    returns how many."""
    routed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _LINEAR:
            continue
        args = node.args
        if len(args) < 2 or set(node.kwargs) - {"bias"} or (len(args) > 2 and node.kwargs):
            continue  # spelled with keywords other than bias: left as written
        x, weight = args[:2]
        bias = args[2] if len(args) > 2 else node.kwargs.get("bias")
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.graphify.one_row_linear.default, (x, weight, bias))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        routed += 1
    if routed:
        gm.graph.lint()
        gm.recompile()
    return routed


# off unless `Options(compile={"gemv": True})`; Triton imported before the compile that uses it
REWRITE = GraphRewrite("gemv", route_one_row_linears, default=False, ready=lambda: triton_ready())
