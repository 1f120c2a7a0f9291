"""Where a line's graph-pool segments come from (H200 diagnostic). The compile line's pool holds
116-120 MiB at B = 1 on nearly every zoo model (ResNet-18 to DenseNet), the background line's
54-56 (zoo run 3), about 60 MiB more whatever the model. Suspects: the first capture's warm-ups,
routed to the graph's pool (`graphify.backends.pool_routing`), run the eager original (the guard
run) and then the compiled code, whose first call compiles and may tune kernels, so blocks of two
different allocation patterns (and whatever the first compiled run makes: cuDNN workspaces,
tuning buffers, though Triton's `do_bench` flushes with 256 MB, which would show as more) end up
in one pool. With torch's allocator history on, each new segment is listed with its pool, size and the
frames of the allocation that made it, as JSON lines:
`PYTHONPATH=. timeout 150 python3 notes/device/pool_segments.py timm/resnet50 timm/efficientnet_b3 > segments.jsonl`."""

import json
import sys

import torch

from benchmarks._zoo_models import by_name
from graphify import Options, graphify

SKIP = ("torch/cuda/memory", "torch/utils/_python_dispatch", "contextlib.py", "<frozen")


def frames(entry) -> list[str]:
    out = []
    for f in entry.get("frames", []):
        where = f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}"
        if f.get("filename", "").endswith((".py",)) and not any(s in where for s in SKIP):
            out.append(where.split("site-packages/")[-1].split("/work/")[-1])
    return out[:10]


def run(name: str, line: str) -> None:
    spec = by_name([name])[0]
    model = spec.build().to("cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    x = spec.inputs(1, None, "cuda", torch.bfloat16, gen)
    with torch.inference_mode():
        model(**x)  # eager first, as the zoo does
        torch.cuda.synchronize()
        before = {s["address"] for s in torch.cuda.memory._snapshot()["segments"]}
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
        fn = graphify(model, options=Options(compile=True) if line == "compile" else Options())
        for _ in range(3):
            fn(**x)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    made = {}
    for entry in snap["device_traces"][torch.cuda.current_device()]:
        if entry["action"] == "segment_alloc":
            made[entry["addr"]] = entry
    for seg in snap["segments"]:
        if seg["address"] in before:
            continue
        entry = made.get(seg["address"], {})
        print(json.dumps({"model": name, "line": line, "pool": str(seg.get("segment_pool_id")),
                          "mib": seg["total_size"] / 2**20, "allocated_mib": seg["allocated_size"] / 2**20,
                          "frames": frames(entry)}), flush=True)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        for line in ("compile", "plain"):
            try:
                run(name, line)
            except Exception as exc:  # noqa: BLE001 - a diagnostic: the next model goes on
                print(json.dumps({"model": name, "line": line, "error": repr(exc)[:400]}), flush=True)
