"""The compile line keeps convolutions channels-first where channels-last would slow them:
grouped convolutions with more than one input channel a group carrying a real share of the
flops (RegNet's), as measured on the H200 (`graphify.compile.layout_policy`)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from traced_graphs import fresh_dynamo, traced  # noqa: F401 (the fixture)

from graphify.compile.layout_policy import GROUPED_CHANNELS_LAST, channels_last_slows


class Block(torch.nn.Module):
    """A bottleneck: 1x1 in, a 3x3 with `groups` groups, 1x1 out (RegNet's with group width 8,
    ResNeXt's with 32 groups, MobileNet's depthwise with one channel a group)."""

    def __init__(self, outer: int, inner: int, groups: int):
        super().__init__()
        self.a = torch.nn.Conv2d(outer, inner, 1)
        self.b = torch.nn.Conv2d(inner, inner, 3, padding=1, groups=groups)
        self.c = torch.nn.Conv2d(inner, outer, 1)

    def forward(self, x):
        return x + self.c(torch.relu(self.b(torch.relu(self.a(x)))))


@pytest.fixture(autouse=True)
def _fresh(fresh_dynamo):
    yield


@pytest.fixture
def on_the_cpu_as_on_cuda(monkeypatch):
    """The policy weighs CUDA graphs only; these tests trace on the CPU."""
    from graphify.compile import layout_policy

    monkeypatch.setattr(layout_policy, "_DEVICES", frozenset({"cuda", "cpu"}))


def grouped_share(outer, inner, groups) -> float:
    """The share of a block's flops in its 3x3 convolution (every convolution keeps 16x16)."""
    grouped = inner * inner // groups * 9
    return grouped / (grouped + 2 * outer * inner)


def test_grouped_convolutions_carrying_the_flops_keep_channels_first(on_the_cpu_as_on_cuda):
    """RegNet's block: 8 channels a group, 22% of the flops (RegNetY-016: 28%). Inductor's own
    weight for grouped convolutions (1.358) keeps such a graph channels-last."""
    torch.manual_seed(0)
    x = torch.randn(2, 128, 16, 16)
    share = grouped_share(128, 128, 16)
    assert 0.2 < share < 0.25 and share * 1.358 + (1 - share) * 0.823 < 1
    assert channels_last_slows(traced(Block(128, 128, groups=16), x))


def test_grouped_convolutions_with_a_small_share_or_one_channel_a_group_keep_channels_last(on_the_cpu_as_on_cuda):
    torch.manual_seed(0)
    x = torch.randn(2, 256, 16, 16)
    resnext = Block(256, 128, groups=32)  # 4 channels a group, 6% of the flops
    depthwise = Block(256, 128, groups=128)  # one channel a group: channels-last helps those
    plain = Block(256, 128, groups=1)
    assert grouped_share(256, 128, 32) < 0.1
    assert not channels_last_slows(traced(resnext, x))
    assert not channels_last_slows(traced(depthwise, x))
    assert not channels_last_slows(traced(plain, x))


def test_the_weighing_turns_where_grouped_flops_times_their_weight_pass_the_total(on_the_cpu_as_on_cuda):
    """Blocks whose grouped share runs from 3% to 53%: channels-first exactly past the share where
    grouped flops at `GROUPED_CHANNELS_LAST` and the 1x1s at inductor's 0.823 outweigh the total."""
    torch.manual_seed(0)
    x = torch.randn(1, 256, 8, 8)
    turn = (1 - 0.823) / (GROUPED_CHANNELS_LAST - 0.823)
    shares = {g: grouped_share(256, 128, g) for g in (2, 8, 16, 32, 64)}
    assert min(shares.values()) < turn < max(shares.values())
    for groups, share in shares.items():
        assert channels_last_slows(traced(Block(256, 128, groups), x)) == (share > turn), (groups, share, turn)


def test_symbolic_shapes_are_left_to_inductor(on_the_cpu_as_on_cuda):
    torch.manual_seed(0)
    assert not channels_last_slows(traced(Block(64, 128, groups=16), torch.randn(2, 64, 16, 16), dynamic=True))
    assert not channels_last_slows(traced(torch.nn.Linear(8, 8), torch.randn(2, 8)))


def test_on_the_cpu_inductors_own_layout_stands():
    """Inductor lays a CPU graph's convolutions out channels-last for oneDNN whatever their flops."""
    torch.manual_seed(0)
    assert not channels_last_slows(traced(Block(128, 128, groups=16), torch.randn(2, 128, 16, 16)))


def test_the_flops_weighed_are_torchs_count_over_every_convolution(on_the_cpu_as_on_cuda):
    """A 1-D convolution counts, as in inductor's weighing; an unbatched input's channels are
    its first dimension; a transposed convolution counts its input's spatial size."""
    from graphify.compile.layout_policy import _flops
    from graphify.compile.shape_policy import convolution_nodes

    torch.manual_seed(0)

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = torch.nn.Conv1d(256, 256, 9, padding=4)  # most of the flops
            self.grouped = torch.nn.Conv2d(16, 16, 3, padding=1, groups=2)

        def forward(self, x, y):
            return self.seq(x).sum() + self.grouped(y).sum()

    mixed = traced(lambda x, y: Mixed()(x, y), None, inputs=(torch.randn(1, 256, 512), torch.randn(1, 16, 8, 8)))
    assert not channels_last_slows(mixed)  # the grouped 2-D convolution alone would turn it off
    unbatched = traced(torch.nn.Conv2d(16, 128, 3), torch.randn(16, 48, 48))
    (c,) = convolution_nodes(unbatched)
    assert c.groups == 1 and not channels_last_slows(unbatched)
    up = torch.nn.ConvTranspose2d(64, 32, 2, stride=2)
    (t,) = convolution_nodes(traced(up, torch.randn(2, 64, 8, 8)))
    assert t.transposed and _flops(t) == 2 * 2 * 8 * 8 * up.weight.numel()


def test_inductor_compiles_the_compile_lines_graphs_with_the_layout_the_policy_gives(on_the_cpu_as_on_cuda):
    """A real inductor compile (CPU): its own layout decision sees the setting, and a layout
    setting the user gives (`layout_optimization`, `force_layout_optimization`) stands."""
    from torch._inductor.graph import GraphLowering

    from graphify.compile.compiled import KeptCompiles

    decided, original = [], GraphLowering.decide_layout_opt

    def spy(gm, *, is_inference):
        decided.append(original(gm, is_inference=is_inference))
        return decided[-1]

    torch.manual_seed(0)
    model, x = Block(64, 128, groups=16).eval(), torch.randn(2, 64, 16, 16)
    before = (torch._inductor.config.fx_graph_cache, torch._functorch.config.enable_autograd_cache)
    # A cached graph decides nothing again. torch's config modules are patched through their own
    # `patch`: pytest's monkeypatch would delete the entry on undo, hiding it from later tests.
    no_caches = (torch._inductor.config.patch(fx_graph_cache=False),
                 torch._functorch.config.patch(enable_autograd_cache=False))
    with pytest.MonkeyPatch.context() as mp, no_caches[0], no_caches[1], torch.no_grad():
        mp.setattr(GraphLowering, "decide_layout_opt", staticmethod(spy))
        for options in (None, {"layout_optimization": True}, {"force_layout_optimization": True}):
            torch._dynamo.reset()
            out = torch.compile(model, backend=KeptCompiles(options=options), dynamic=False)(x)
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    # On a CPU inductor lays every convolution out channels-last (oneDNN) unless told not to.
    assert decided == [False, True, True]
    # every setting patched reads as before (a deleted config entry would raise here, and in later tests)
    assert (torch._inductor.config.fx_graph_cache, torch._functorch.config.enable_autograd_cache) == before


def test_the_background_workers_compile_takes_the_same_layout(on_the_cpu_as_on_cuda, monkeypatch):
    """The AOT backend the background worker compiles through (`graphify.compile.aot._backend`)
    applies the policy as the in-process one does (inductor itself stood in for)."""
    from torch._inductor import config

    from graphify.compile import aot

    seen = []
    monkeypatch.setattr(torch._TorchCompileInductorWrapper, "__call__",
                        lambda self, gm, example_inputs: seen.append(config.layout_optimization) or gm.forward)
    torch.manual_seed(0)
    regnet, plain = Block(128, 128, groups=16), Block(128, 128, groups=1)
    x = torch.randn(2, 128, 16, 16)
    for model in (regnet, plain):
        aot._backend("inductor", None, None, False, ())(traced(model, x), [x])
    assert seen == [False, True]



# -- grouped convolutions timed on the device (`graphify.compile.conv_timing`) -------------------


def test_a_grouped_convolutions_timed_ratio_decides_in_place_of_the_constant(on_the_cpu_as_on_cuda):
    """RegNet's block (22% grouped flops): channels-first with the constant, channels-last where
    its grouped convolution times faster or a little slower channels-last, channels-first where
    far slower. Only grouped convolutions of more than one channel a group are asked."""
    torch.manual_seed(0)
    gm = traced(Block(128, 128, groups=16), torch.randn(2, 128, 16, 16))
    asked = []

    def timed(ratio):
        return lambda c: asked.append((c.groups, c.w.size(1))) or ratio

    assert channels_last_slows(gm)
    assert not channels_last_slows(gm, timed(0.8))
    assert not channels_last_slows(gm, timed(1.5))  # 0.22 * 1.5 + 0.78 * 0.823 < 1
    assert channels_last_slows(gm, timed(2.0))
    assert channels_last_slows(gm, lambda c: None)  # not timed: the constant
    assert set(asked) == {(16, 8)}
    depthwise = traced(Block(128, 128, groups=128), torch.randn(2, 128, 16, 16))
    assert not channels_last_slows(depthwise, timed(9.0)) and set(asked) == {(16, 8)}


def test_convolutions_keep_their_stride_padding_and_dilation():
    from graphify.compile.shape_policy import convolution_nodes

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 32, 3, stride=2, padding=2, dilation=2, groups=4)
    (c,) = convolution_nodes(traced(conv, torch.randn(1, 16, 20, 20)))
    assert tuple(map(tuple, c.geometry)) == ((2, 2), (2, 2), (2, 2)) and c.groups == 4
    same = traced(lambda x: torch.nn.functional.conv2d(x, conv.weight, padding="same", groups=4), torch.randn(1, 16, 9, 9))
    (s,) = convolution_nodes(same)
    assert s.geometry[1] == "same" and s.geometry[0] in (1, (1, 1))


def test_the_timed_ratio_reaches_the_compile_lines_layout(on_the_cpu_as_on_cuda, monkeypatch):
    """`inductor_layout` weighs with the timing's answer (stood in for: the CPU times nothing)."""
    from torch._inductor import config

    from graphify.compile import conv_timing
    from graphify.compile.layout_policy import inductor_layout

    torch.manual_seed(0)
    gm = traced(Block(128, 128, groups=16), torch.randn(2, 128, 16, 16))
    inductor = torch._TorchCompileInductorWrapper("default", None, False)
    for ratio, layout in ((0.9, True), (3.0, False), (None, False)):
        monkeypatch.setattr(conv_timing, "channels_last_ratio", lambda c, r=ratio: r)
        with inductor_layout(gm, inductor):
            assert config.layout_optimization is layout, ratio
    assert config.layout_optimization is True
