"""How much longer a grouped convolution takes channels-last than channels-first, timed on its device.

Inductor weighs a graph's convolutions by class, with times torch took on an A100 in training
(`decide_layout_opt`); grouped convolutions of more than one input channel a group weigh 1.358.
On the H200, in inference, that class is faster channels-last in one model and far slower in
another: channels-last made RegNetY-016 (24 channels a group) 1.24x slower at B = 1, and
torchvision's RegNetY-800MF (16 a group) 1.22x faster (`zoo-layout`, `zoo-run2`). No constant
serves both, so the layout policy times each such convolution of a graph it weighs: cuDNN, the
graph's shapes, dtype and geometry, both memory formats, once per process (a tenth of a second
or so a graph). Where it cannot be timed (another device, a transposed or non-2-D convolution, inside a
stream capture, which timing would break) the caller's constant stands.

Timed as the compiled graph runs it. Channels-last, the weight arrives channels-first (a
parameter, a graph input) and inductor's lowering copies it to channels-last before each call's
convolution, so that arm times the copy too. And the GPU's time, not the host's: a small grouped
convolution takes microseconds on the GPU and longer to launch from the host, so timed one
launch at a time both layouts measure the host and tie (RegNetY-016's did, 0.94-1.07, while its
graph ran 1.25x slower channels-last). Each sample queues its launches behind a spin of the GPU
(`torch.cuda._sleep`) long enough that they run back to back, as in a replayed graph; a sample
whose spin ended before the host had queued them is taken again behind a longer one.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from graphify.compile.shape_policy import Convolution

__all__ = ["channels_last_ratio"]

log = logging.getLogger("graphify")

WARM_UPS, REPEATS = 3, 9
LAUNCHES = 8  # a device sample: this many launches back to back, behind a spin of the GPU
_spin = {"cycles": 1_000_000}  # about 0.5 ms at an H200's clock; doubled where the host was slower
_SPIN_MOST = 64_000_000
_measured: dict = {}  # key (device, dtype, shapes, groups, geometry, cuDNN's search) -> ratio


def _key(c: Convolution):
    geometry = tuple(tuple(g) if isinstance(g, (list, tuple)) else g for g in c.geometry)
    return (c.x.device.index or 0, c.x.dtype, tuple(c.x.shape), tuple(c.w.shape), c.groups, geometry,
            torch.backends.cudnn.benchmark)


def channels_last_ratio(c: Convolution) -> "float | None":
    """`c`'s time channels-last ÷ its time channels-first on its CUDA device (measured once a
    process), or None where it cannot be timed here."""
    x, w = c.x, c.w
    if x.device.type != "cuda" or c.transposed or w.dim() != 4 or x.dim() != 4 or not torch.cuda.is_available():
        return None
    if not all(isinstance(s, int) for s in (*x.shape, *w.shape)):
        return None
    with torch.cuda.device(x.device):
        if torch.cuda.is_current_stream_capturing():
            return None
        key = _key(c)
        if key not in _measured:
            try:
                _measured[key] = _timed(c)
            except Exception as exc:  # noqa: BLE001 - a saving only (out of memory, say): the constant stands
                log.info("graphify: timing a grouped convolution %s failed (%s); weighed with the constant", key, exc)
                return None
            log.debug("graphify: grouped convolution %s: channels-last %.2fx channels-first", key, _measured[key])
        return _measured[key]


def _timed(c: Convolution) -> float:
    """Median channels-last time ÷ median channels-first time, interleaved (the host's drift
    spread over both), from real tensors made outside any fake, dispatch or torch-function mode
    the compile runs under (a warm-up's op guard, its write recorder); their values come from a
    generator of their own (the user's stays where it was).
    On `c`'s device: CUDA events there, the host's clock on the CPU (where tests run it)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    stride, padding, dilation = c.geometry
    cuda = c.x.device.type == "cuda"
    with unset_fake_temporarily(), _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
        device = torch.device("cuda", c.x.device.index or 0) if cuda else torch.device("cpu")
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tuple(c.x.shape), dtype=c.x.dtype, device=device, generator=gen)
        w = torch.randn(tuple(c.w.shape), dtype=c.w.dtype, device=device, generator=gen)
        inputs = {f: x.contiguous(memory_format=f) for f in (torch.contiguous_format, torch.channels_last)}

        def run(f):  # channels-last: the weight copied first, as inductor's graph does each call
            weight = w if f is torch.contiguous_format else w.contiguous(memory_format=f)
            return torch.nn.functional.conv2d(inputs[f], weight, None, stride, padding, dilation, c.groups)

        for _ in range(WARM_UPS):  # cuDNN's search, where on, and its handle's workspace
            for f in inputs:
                run(f)
        clock = _on_the_device if cuda else _on_the_host
        times: dict = {f: [] for f in inputs}
        for _ in range(REPEATS):
            for f in inputs:
                times[f].append(clock(lambda: run(f)))
    first = statistics.median(times[torch.contiguous_format])
    return statistics.median(times[torch.channels_last]) / first if first > 0 else 1.0


def _on_the_device(fn, launches: int = LAUNCHES) -> float:
    """GPU ms of one `fn()`: `launches` of them queued behind a spin of the GPU, so they run back
    to back whatever the host's launch cost; where the spin ran out before the host had queued
    them (the start event already passed), again behind one twice as long."""
    while True:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_spin["cycles"])
        start.record()
        for _ in range(launches):
            fn()
        end.record()
        starved = start.query()
        end.synchronize()
        if not starved or _spin["cycles"] >= _SPIN_MOST:
            return start.elapsed_time(end) / launches
        _spin["cycles"] *= 2


def _on_the_host(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
