"""Where a line's graph memory comes from: the allocations inside graph pools, largest first,
with the Python frames that made them (torch's allocator history), and the memory the line
reserved beyond eager's.

For one zoo model (`benchmarks._zoo_models`) and line (graphify, graphify_compile or
reduce_overhead) at one batch, in this process: eager's calls first (their memory is the
baseline), then the line's first calls under `torch.cuda.memory._record_memory_history`. Each
segment of a private pool is listed with its size and the largest allocations made in it.
Set `CUDNN_CONV_WSCAP_DBG` (MiB) to cap cuDNN's convolution workspaces and see what moves.

    python -m benchmarks.pool_origins --model timm/resnet50 --line graphify --batch 1
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from ._zoo_models import by_name
from .zoo import wrapped

MiB = 1 << 20


def origins(snapshot: dict, before: frozenset = frozenset(), top: int = 6) -> list[dict]:
    """Per segment made since `before` (the addresses of the segments that existed then), in any
    pool: its pool, stream, size, and its largest allocations (size, Python frames). Pure over a
    `torch.cuda.memory._snapshot()`."""
    allocs = [e for trace in snapshot.get("device_traces", []) for e in trace if e.get("action") == "alloc"]
    out = []
    for seg in snapshot.get("segments", []):
        if seg["address"] in before:
            continue
        lo, hi = seg["address"], seg["address"] + seg["total_size"]
        inside = sorted((e for e in allocs if lo <= e["addr"] < hi), key=lambda e: -e["size"])[:top]
        out.append({"pool": tuple(seg.get("segment_pool_id", (0, 0))), "stream": seg.get("stream"),
                    "mib": seg["total_size"] / MiB,
                    "largest": [{"mib": e["size"] / MiB,
                                 "frames": [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}"
                                            for f in e.get("frames", []) if f["filename"].endswith(".py")][:6]}
                                for e in inside]})
    return sorted(out, key=lambda s: -s["mib"])


def _warm_up_on_callers_stream() -> None:
    """An experiment: graphify's warm-ups on the default stream instead of its capture stream."""
    from graphify.backends import torch_cuda

    runs = torch_cuda.eager_runs

    def on_default(*a, **k):
        with torch.cuda.stream(torch.cuda.default_stream()):
            return runs(*a, **k)

    torch_cuda.eager_runs = on_default


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="timm/resnet50")
    parser.add_argument("--line", default="graphify")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=None)
    parser.add_argument("--warm-up-on-default-stream", action="store_true")
    args = parser.parse_args(argv)
    if args.warm_up_on_default_stream:
        _warm_up_on_callers_stream()
    spec = by_name([args.model])[0]
    torch.manual_seed(0)
    model = spec.build().to("cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    length = args.length or spec.lengths[0]
    x = spec.inputs(args.batch, length, "cuda", torch.bfloat16, gen)
    with torch.inference_mode():
        for _ in range(3):
            model(**x)
        torch.cuda.synchronize()
        base = torch.cuda.memory_reserved()
        before = frozenset(seg["address"] for seg in torch.cuda.memory._snapshot()["segments"])
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
        fn = wrapped(model, args.line, "cuda")
        for _ in range(4):
            fn(**x)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    result = {"model": args.model, "line": args.line, "batch": args.batch,
              "cap_mib": os.environ.get("CUDNN_CONV_WSCAP_DBG"),
              "beyond_eager_mib": (torch.cuda.memory_reserved() - base) / MiB,
              "segments": origins(snap, before), "experiment": args.warm_up_on_default_stream}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
