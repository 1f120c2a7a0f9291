"""The layout policy's timing of a grouped convolution in both memory formats
(`graphify.compile.conv_timing`): made from the traced graph's fake values, outside the
compile's modes, as inductor's graph runs it (the weight copied channels-last each call), and
on the GPU's clock, not the host's."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import requires_cuda
from traced_graphs import fresh_dynamo, traced  # noqa: F401 (the fixture)


@pytest.fixture(autouse=True)
def _fresh(fresh_dynamo):
    yield


def test_timing_a_convolution_from_the_traced_graphs_values_runs_it_in_both_layouts(monkeypatch):
    """The traced graph's values are fake: the timing makes real tensors outside fake mode, runs
    the convolution with its geometry in both memory formats, and leaves the global generator
    where it was. On the CPU the policy itself asks for no timing (None)."""
    from graphify.compile import conv_timing
    from graphify.compile.shape_policy import convolution_nodes

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(32, 32, 3, stride=2, padding=1, groups=4)
    (c,) = convolution_nodes(traced(conv, torch.randn(2, 32, 12, 12)))
    assert isinstance(c.x, torch._subclasses.FakeTensor) and conv_timing.channels_last_ratio(c) is None
    ran, real = [], torch.nn.functional.conv2d

    def spy(x, w, *args):
        out = real(x, w, *args)
        assert not isinstance(out, torch._subclasses.FakeTensor)
        ran.append((x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous(), tuple(out.shape), args))
        return out

    monkeypatch.setattr(torch.nn.functional, "conv2d", spy)
    class Seen(torch.overrides.TorchFunctionMode):  # a warm-up's op guard, say
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    state, seen = torch.get_rng_state(), []
    with Seen(), c.x.fake_mode:  # as inside a compile under a warm-up
        ratio = conv_timing._timed(c)
    assert seen == []
    assert torch.equal(torch.get_rng_state(), state)
    assert ratio > 0 and len(ran) == 2 * (conv_timing.WARM_UPS + conv_timing.REPEATS)
    assert {r[0] for r in ran} == {True, False} and {r[1] for r in ran} == {(2, 32, 6, 6)}
    as_given = {tuple(tuple(a) if isinstance(a, (list, tuple)) else a for a in r[2]) for r in ran}
    assert as_given == {(None, (2, 2), (1, 1), (1, 1), 4)}


def test_the_channels_last_arm_copies_a_channels_first_weight_each_run(monkeypatch):
    """A parameter reaches the compiled graph channels-first and inductor copies it to
    channels-last before each convolution: the timing's channels-last arm pays that copy every
    run, not once."""
    from graphify.compile import conv_timing
    from graphify.compile.shape_policy import convolution_nodes

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(32, 32, 3, padding=1, groups=4)
    (c,) = convolution_nodes(traced(conv, torch.randn(2, 32, 12, 12)))
    copies, real = [], torch.Tensor.contiguous

    def counted(self, *args, **kwargs):
        if kwargs.get("memory_format", args[0] if args else None) is torch.channels_last and self.dim() == 4 \
                and tuple(self.shape) == tuple(c.w.shape) and not self.is_contiguous(memory_format=torch.channels_last):
            copies.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", counted)
    with c.x.fake_mode:
        conv_timing._timed(c)
    assert len(copies) == conv_timing.WARM_UPS + conv_timing.REPEATS


@requires_cuda
def test_on_cuda_a_grouped_convolution_is_timed_once_not_inside_a_capture_and_a_failure_weighs_nothing():
    from graphify.compile import conv_timing
    from graphify.compile.shape_policy import convolution_nodes

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(96, 96, 3, padding=1, groups=4).cuda().to(torch.bfloat16)
    grouped = convolution_nodes(traced(conv, torch.randn(2, 96, 14, 14, device="cuda", dtype=torch.bfloat16)))
    state = torch.cuda.get_rng_state()
    first = conv_timing.channels_last_ratio(grouped[0])
    assert first is not None and 0 < first < 100 and torch.equal(torch.cuda.get_rng_state(), state)
    assert conv_timing.channels_last_ratio(grouped[0]) == first  # kept for the process
    conv_timing._measured.clear()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    x = torch.randn(8, device="cuda")
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            y = x * 2
            inside = conv_timing.channels_last_ratio(grouped[0])
        finally:
            graph.capture_end()
    graph.replay()
    torch.testing.assert_close(y, x * 2)
    assert inside is None and conv_timing._measured == {}

    def out_of_memory(c):
        raise torch.OutOfMemoryError("CUDA out of memory (a timing's tensors)")

    with pytest.MonkeyPatch.context() as mp:  # a saving only: where timing fails, the constant weighs
        mp.setattr(conv_timing, "_timed", out_of_memory)
        assert conv_timing.channels_last_ratio(grouped[0]) is None and conv_timing._measured == {}


@requires_cuda
def test_on_cuda_the_gpus_time_is_taken_not_the_hosts_launch():
    """Launches that cost the host a millisecond each, of a kernel of microseconds: queued
    behind a spin of the GPU that grows until the host keeps ahead, their time is the kernel's.
    Timed one launch at a time, it would be the host's (over a millisecond)."""
    from graphify.compile import conv_timing

    a = torch.randn(1024, device="cuda")
    slow_host = lambda: (time.sleep(1e-3), a.add_(1.0))  # noqa: E731
    was = dict(conv_timing._spin)
    conv_timing._spin["cycles"] = 1_000
    try:
        ms = conv_timing._on_the_device(slow_host)
        grown = conv_timing._spin["cycles"]
    finally:
        conv_timing._spin.update(was)
    assert grown > 1_000 and 0 < ms < 0.3, (grown, ms)
