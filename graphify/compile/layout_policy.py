"""Where the compile line keeps inductor from laying convolutions out channels-last.

At static shapes inductor lays a graph's convolutions out channels-last where its weighing of
their flops says that pays (`GraphLowering.decide_layout_opt`, inference): each class of
convolution's flops times the time channels-last took for that class in torch's benchmark
samples (A100, training inputs), against the plain total. Grouped convolutions with more than one
input channel a group weigh 1.358 there. On the H200, in inference, they cost more:

- RegNetY-016 (24 channels a group; 28% of its convolution flops in such convolutions, weighed 0.970 of
  the total, so laid out channels-last) took 1.24x (B = 1) and 1.21x (B = 8) the time of the same
  compile with the layout off;
- ResNet-50 (no grouped convolution) took 0.72x and 0.70x with it on (`zoo-layout`, H200).

If the other convolutions took ResNet-50's 0.72, RegNetY's 1.23 puts grouped ones near 2.5. But
torchvision's RegNetY-800MF (16 channels a group, 20% of its flops), weighed with 2.5 (1.15, off),
then took 1.22x reduce-overhead's time at B = 1, which lays it out channels-last: the class's cost
differs by model. So for CUDA graphs the compile line weighs as inductor does, with each grouped
convolution's own ratio timed on the device (`graphify.compile.conv_timing`;
`GROUPED_CHANNELS_LAST` where it cannot be timed), and compiles with `layout_optimization=False`
where the weighted flops exceed the total. CNNs without grouped convolutions weigh 0.78-0.82
(kept) and time nothing. Not on the CPU, where inductor lays convolutions out channels-last
for oneDNN whatever their flops. A layout setting the user gives (`layout_optimization` or
`force_layout_optimization`, in `Options(compile={"options": ...})` or inductor's config) is left
as it is. The setting is inductor's process-wide config on torch 2.11 (per thread from 2.12):
graphify's compiles run under dynamo's compile lock, so only an inductor compile outside dynamo
on another thread could see it meanwhile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from graphify.compile.shape_policy import NODES_PER_CONVOLUTION, Convolution, convolution_nodes

__all__ = ["channels_last_slows", "inductor_layout", "GROUPED_CHANNELS_LAST"]

GROUPED_CHANNELS_LAST = 2.5  # time in channels-last ÷ channels-first, grouped convolutions not timed (H200, above); inductor: 1.358
_SMALL, _IN_OUT, _DEFAULT = 0.783, 0.725, 0.823  # inductor's own weights for the other classes
_LAYOUT_SETTINGS = ("layout_optimization", "force_layout_optimization")
_DEVICES = frozenset({"cuda"})  # where the H200's weighing holds (a CPU test adds "cpu")


def _grouped(c: Convolution) -> bool:
    """A grouped convolution of more than one input channel a group (its weight: out, in a
    group, kernel...; transposed: in, out a group, kernel...)."""
    return c.groups > 1 and c.w.size(1) > 1


def _weight(c: Convolution, grouped: "Callable[[Convolution], float | None]") -> float:
    """Channels-last time ÷ channels-first time for one convolution: `grouped(c)` for a
    grouped one (`GROUPED_CHANNELS_LAST` where that gives None), else its class's, in inductor's order."""
    w = c.w
    if _grouped(c):
        ratio = grouped(c)
        return GROUPED_CHANNELS_LAST if ratio is None else ratio
    if w.size(0) <= 64 and w.size(1) <= 64:
        return _SMALL
    if w.size(0) * 2 <= w.size(1) and w.size(2) > 1:
        return _IN_OUT
    return _DEFAULT


def _flops(c: Convolution) -> float:
    """torch's count (`conv_flop_count`): 2 · batch · the output's spatial size (the input's,
    transposed) · the weight's elements. An unbatched input is one."""
    dims = c.w.dim() - 2
    batch = c.x.size(0) if c.x.dim() == c.w.dim() else 1
    spatial = c.x if c.transposed or c.out is None else c.out
    return 2.0 * batch * spatial.shape[-dims:].numel() * c.w.numel()


def _untimed(c: Convolution) -> None:
    return None


def channels_last_slows(gm: torch.fx.GraphModule, grouped: "Callable[[Convolution], float | None]" = _untimed) -> bool:
    """Whether inductor would lay this traced graph's convolutions out channels-last on a
    CUDA device (static shapes, fewer than `NODES_PER_CONVOLUTION` nodes a convolution) and,
    weighed with `grouped(c)` for grouped convolutions (`GROUPED_CHANNELS_LAST` where None),
    that would cost time. Pure where `grouped` is."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    convolutions = convolution_nodes(gm)
    if not convolutions or len(gm.graph.nodes) >= NODES_PER_CONVOLUTION * len(convolutions):
        return False
    if any(c.x.device.type not in _DEVICES or free_symbols(c.x) or free_symbols(c.w) for c in convolutions):
        return False  # inductor's own choice: symbolic convolutions stay channels-first, the CPU's go channels-last
    flops = [_flops(c) for c in convolutions]
    return sum(f * _weight(c, grouped) for f, c in zip(flops, convolutions)) > sum(flops)


def inductor_layout(gm: torch.fx.GraphModule, compiler):
    """The inductor setting `compiler` (torch.compile's backend wrapper) compiles this graph
    under: channels-last off where it slows, unless the compile's own settings or inductor's
    config already decide the layout. Nothing for a backend other than inductor."""
    from torch._inductor import config

    from graphify.compile.conv_timing import channels_last_ratio

    if not isinstance(compiler, torch._TorchCompileInductorWrapper):
        return contextlib.nullcontext()
    decided = any(k in compiler.config for k in _LAYOUT_SETTINGS) or config.force_layout_optimization
    if not decided and channels_last_slows(gm, channels_last_ratio):
        return config.patch(layout_optimization=False)
    return contextlib.nullcontext()
