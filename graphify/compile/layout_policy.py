"""Where the compile line keeps inductor from laying convolutions out channels-last.

At static shapes inductor lays a graph's convolutions out channels-last where its weighing of
their flops says that pays (`GraphLowering.decide_layout_opt`, inference): each class of
convolution's flops times the time channels-last took for that class in torch's benchmark
samples (A100, training inputs), against the plain total. Grouped convolutions with more than one
input channel a group weigh 1.358 there. On the H200, in inference, they cost more:

- RegNetY-016 (group width 8; 28% of its convolution flops in such convolutions, weighed 0.970 of
  the total, so laid out channels-last) took 1.24x (B = 1) and 1.21x (B = 8) the time of the same
  compile with the layout off;
- ResNet-50 (no grouped convolution) took 0.72x and 0.70x with it on (`zoo-layout`, H200).

If the other convolutions took ResNet-50's 0.72, RegNetY's 1.23 puts grouped ones near 2.5. So
the compile line weighs as inductor does, with `GROUPED_CHANNELS_LAST` for those, and compiles with
`layout_optimization=False` where the weighted flops exceed the total: RegNetY-016 weighs 1.29
(off), ResNeXt-50 (5% grouped) 0.91 (kept), CNNs without grouped convolutions 0.78-0.82 (kept).
A setting the user gives (`Options(compile={"options": {"layout_optimization": ...}})`) wins: torch
applies it inside this one.
"""

from __future__ import annotations

import contextlib

import torch

from graphify.compile.shape_policy import NODES_PER_CONVOLUTION, convolution_nodes

__all__ = ["channels_last_slows", "layout_for", "GROUPED_CHANNELS_LAST"]

GROUPED_CHANNELS_LAST = 2.5  # time in channels-last ÷ channels-first, grouped convolutions (H200, above); inductor: 1.358
_SMALL, _IN_OUT, _DEFAULT = 0.783, 0.725, 0.823  # inductor's own weights for the other classes


def _weight(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, transposed: bool) -> float:
    """Channels-last time ÷ channels-first time for one convolution's class, as inductor classes them."""
    groups = (out.size(1) if transposed else x.size(1)) // max(w.size(1), 1)
    if groups > 1 and w.size(1) > 1:
        return GROUPED_CHANNELS_LAST
    if w.size(0) <= 64 and w.size(1) <= 64:
        return _SMALL
    if w.size(0) * 2 <= w.size(1) and w.size(2) > 1:
        return _IN_OUT
    return _DEFAULT


def channels_last_slows(gm: torch.fx.GraphModule) -> bool:
    """Whether inductor would lay this traced graph's convolutions out channels-last (static
    shapes, fewer than `NODES_PER_CONVOLUTION` nodes a convolution) and, weighed with
    `GROUPED_CHANNELS_LAST`, that would cost time. Pure."""
    convolutions = convolution_nodes(gm)
    if not convolutions or len(gm.graph.nodes) >= NODES_PER_CONVOLUTION * len(convolutions):
        return False
    total = weighted = 0.0
    for x, w, out, transposed in convolutions:
        if any(isinstance(s, torch.SymInt) for t in (x, w, out) for s in t.shape):
            return False  # inductor keeps symbolic convolutions channels-first anyway
        flops = 2.0 * out.numel() * w[0].numel()
        total += flops
        weighted += flops * _weight(x, w, out, transposed)
    return weighted > total


def layout_for(gm: torch.fx.GraphModule):
    """The inductor setting this graph compiles under: channels-last off where it slows."""
    if channels_last_slows(gm):
        from torch._inductor import config

        return config.patch(layout_optimization=False)
    return contextlib.nullcontext()
