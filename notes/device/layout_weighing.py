"""The layout policy's weighing of the zoo's CNNs on the device: for each model and batch, the
share of convolution flops in grouped convolutions (more than one channel a group), the weighing
with inductor's constant (1.358), with `GROUPED_CHANNELS_LAST`, and with each grouped
convolution timed (`graphify.compile.conv_timing`), and the decision. Then, to see whether timing
every convolution would decide RegNetY-016 right (its grouped ones time alike in both layouts, yet
the model is 1.25x slower channels-last): each distinct 2-D convolution timed channels-first, and
channels-last with the per-call copy of its weight to channels-last that inductor's lowering adds
(`kernel/conv.py`: "maybe we can convert weights to channels last just once"), summed over the
graph ("all_first_ms", "all_last_ms", "all_last_copy_ms"). Diagnostic (it explains `zoo-layout`'s
times), printed as JSON lines:
`PYTHONPATH=. python3 notes/device/layout_weighing.py timm/regnety_016 torchvision/regnet_y_800mf ... > weighing.jsonl`."""

import json
import sys
import time

import torch

from benchmarks._zoo_models import by_name
from graphify.compile import conv_timing, layout_policy
from graphify.compile.shape_policy import convolution_nodes

sys.path.insert(0, "tests")
from traced_graphs import Recording  # noqa: E402 (the tests' recording backend)


def weighed(convs, grouped) -> float:
    flops = [layout_policy._flops(c) for c in convs]
    return sum(f * layout_policy._weight(c, grouped) for f, c in zip(flops, convs)) / sum(flops)


def every_convolution(convs) -> dict:
    """Σ over the graph's 2-D convolutions of each one's median ms channels-first, channels-last,
    and channels-last after copying its (channels-first) weight, as inductor's graph runs it."""
    import statistics

    if not torch.cuda.is_available():
        return {}
    cache, totals = {}, {"all_first_ms": 0.0, "all_last_ms": 0.0, "all_last_copy_ms": 0.0}
    for c in convs:
        if c.transposed or c.w.dim() != 4:
            continue
        key = conv_timing._key(c)
        if key not in cache:
            stride, padding, dilation = c.geometry
            x = torch.randn(tuple(c.x.shape), dtype=c.x.dtype, device="cuda")
            w = torch.randn(tuple(c.w.shape), dtype=c.w.dtype, device="cuda")
            xl, wl = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
            conv = torch.nn.functional.conv2d
            arms = {"all_first_ms": lambda: conv(x, w, None, stride, padding, dilation, c.groups),
                    "all_last_ms": lambda: conv(xl, wl, None, stride, padding, dilation, c.groups),
                    "all_last_copy_ms": lambda: conv(xl, w.contiguous(memory_format=torch.channels_last), None,
                                                     stride, padding, dilation, c.groups)}
            times = {k: [] for k in arms}
            with torch.no_grad():
                for _ in range(3):
                    for f in arms.values():
                        f()
                for _ in range(9):  # on the GPU's clock, launches queued behind a spin (as the policy times)
                    for k, f in arms.items():
                        times[k].append(conv_timing._on_the_device(f))
            cache[key] = {k: statistics.median(v) for k, v in times.items()}
        for k, v in cache[key].items():
            totals[k] += v
    return {k: round(v, 4) for k, v in totals.items()} | {"distinct": len(cache)}


def main(names):
    gen = torch.Generator().manual_seed(0)
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)  # (a CPU run times nothing)
    for model in by_name(names):
        net = model.build().to(device, dtype)
        for batch in (1, 8):
            torch._dynamo.reset()
            rec = Recording()
            with torch.no_grad():
                torch.compile(net, backend=rec, dynamic=False)(**model.inputs(batch, None, device, dtype, gen))
            convs = [c for gm in rec.graphs for c in convolution_nodes(gm)]
            grouped = [c for c in convs if layout_policy._grouped(c)]
            flops = sum(layout_policy._flops(c) for c in convs) or 1
            start = time.perf_counter()
            ratios = {str(conv_timing._key(c)[2:6]): conv_timing.channels_last_ratio(c) for c in grouped}
            seconds = time.perf_counter() - start
            print(json.dumps({
                "model": model.name, "batch": batch, "convolutions": len(convs), "grouped": len(grouped),
                "grouped_share": sum(layout_policy._flops(c) for c in grouped) / flops,
                "inductor": weighed(convs, lambda c: 1.358) if convs else None,
                "constant": weighed(convs, lambda c: None) if convs else None,
                "timed": weighed(convs, conv_timing.channels_last_ratio) if convs else None,
                "channels_last_off": any(layout_policy.channels_last_slows(gm, conv_timing.channels_last_ratio)
                                         for gm in rec.graphs),
                "timing_s": round(seconds, 4), "ratios": ratios} | every_convolution(convs)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
