"""Where start-up and per-call host time go, on a GPU.

The profile behind the README's start-up and host-cost notes.

    python -m benchmarks.profile_startup_host startup 51   # 8B F&P: split, cold/warm capture, phase timers
    python -m benchmarks.profile_startup_host host         # 0.5B FULL decode: the call's parts, interleaved

Writes `startup-prof.txt` / `host.txt` under $OUT (default /tmp).
"""

import argparse
import os
import time

import torch

OUT = os.environ.get("OUT", "/tmp")


def log(name, text):
    with open(f"{OUT}/{name}", "a") as f:
        f.write(text + "\n")
    print(text, flush=True)


def startup(count):
    import gc
    from graphify import graphify, vllm_sizes
    from graphify.models import model_support, split_ops, varlen_axes
    from graphify.transforms import split
    from benchmarks.startup import ATTENTION, MAX_SIZE, Model, tracing_setup
    log("startup-prof.txt", f"tracing set-up s {tracing_setup():.3f}")
    f = "startup-prof.txt"
    model = Model("8b", True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()  # split and captures, each timed once: start-up is not repeated
    pw = split(model.step, split_ops(ATTENTION), *model.example, axes=varlen_axes())
    log(f, f"split s {time.perf_counter() - t0:.3f}")
    t0 = time.perf_counter()
    split(model.step, split_ops(ATTENTION), *model.example, axes=varlen_axes())
    log(f, f"second split s {time.perf_counter() - t0:.3f}")
    sizes = vllm_sizes(MAX_SIZE[count])
    def cap():
        g = graphify(pw, mode="FULL_AND_PIECEWISE", sizes=sizes, axes=varlen_axes(), support=model_support(ATTENTION))
        torch.cuda.synchronize(); t0 = time.perf_counter()
        g = g.capture(*model.example)
        torch.cuda.synchronize()
        return g, time.perf_counter() - t0
    g, s = cap(); log(f, f"cold capture s {s:.3f}"); g.release(); del g; gc.collect(); torch.cuda.empty_cache()
    g, s = cap(); log(f, f"warm capture s {s:.3f}")
    with torch.inference_mode():
        for q, ctx in (((1,) * 8, (30,) * 8), ((6, 1, 1, 2), (0, 9, 20, 3))):
            batch = model.batch(q, ctx, seed=len(q))
            ref = model.step(*batch).float()
            log(f, f"max err {q}: {(g(*batch).float() - ref).abs().max().item()}")
    g.release(); del g; gc.collect(); torch.cuda.empty_cache()
    import graphify.transforms._schedule as sch
    from graphify.backends.torch_cuda import TorchCudaBackend
    spent = {"sched.replay": 0.0, "capture_pieces": 0.0, "backend.capture": 0.0, "capture_end": 0.0}
    def timer(obj, name, key):  # host seconds summed over every call inside one capture: no Timer measures that
        orig = getattr(obj, name)
        def w(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
        setattr(obj, name, w)
        return orig
    o1 = timer(sch.Schedule, "replay", "sched.replay")
    o2 = timer(sch, "capture_pieces", "capture_pieces")
    o3 = timer(TorchCudaBackend, "capture", "backend.capture")
    o4 = timer(torch.cuda.CUDAGraph, "capture_end", "capture_end")
    g, s = cap()
    by = {}
    for e in g.table:
        by[e.mode.value] = by.get(e.mode.value, 0) + e.seconds
    log(f, f"timed capture s {s:.3f}; {spent}; per mode {by}")
    g.release(); del g; gc.collect(); torch.cuda.empty_cache()
    sch.Schedule.replay, sch.capture_pieces, TorchCudaBackend.capture, torch.cuda.CUDAGraph.capture_end = o1, o2, o3, o4
    for key in list(spent): spent[key] = 0.0


def host():
    from graphify import Options, graphify, persistent, tokens, vllm_sizes
    from graphify.models import decode_step, init_params, new_kv_cache
    from benchmarks.decode import MODELS, make_inputs, own_cost_us
    from benchmarks._report import host_costs_us
    from graphify.call.hand_out import hand_out_for
    from graphify.call.runtime import STATIC_PLAN
    cfg = MODELS["0.5b"][0]()
    params = init_params(cfg, seed=0, device="cuda")
    cache = new_kv_cache(cfg, 64, device="cuda", seed=1)
    step = decode_step(cfg, params)
    axes = (tokens(), tokens(), tokens(), persistent())
    g = graphify(step, mode="FULL", sizes=vllm_sizes(64), axes=axes, options=Options(outputs="view")).capture(*make_inputs(cfg, 1, "cuda", 0)[0], cache)
    rt = g._runtime
    f = "host.txt"
    for mode in ("inference", "no_grad"):
        ctx = torch.inference_mode() if mode == "inference" else torch.no_grad()
        with ctx:
            for b in (1, 8):
                static = g.static_inputs(b)
                g(*static)
                plan = rt.plans[STATIC_PLAN][0]
                entry = next(e for e in g.table if e.key.num_tokens == b)
                checked = rt.hand_out
                def unchecked():
                    rt.hand_out = hand_out_for("", "view", None)
                    try:
                        g(*static)
                    finally:
                        rt.hand_out = checked
                res = host_costs_us({
                    "bare replay": lambda i: entry.replay(),
                    "g(*static) checked": lambda i: g(*static),
                    "g(*static) unchecked": lambda i: unchecked(),
                    "replay then checked_view": lambda i: (entry.replay(), checked(plan)),
                    "checked_view then replay": lambda i: (checked(plan), entry.replay()),
                    "checked_view only": lambda i: checked(plan),
                    "rt.run direct": lambda i: rt.run(static, g.stats),
                }, reps=600)
                res["graphify's own (launch stubbed)"] = own_cost_us(g, static)
                log(f, f"\n== {mode} B={b}")
                for k, v in res.items():
                    log(f, f"{k:<28} {v:8.1f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = parser.add_subparsers(dest="what", required=True)
    part = parts.add_parser("startup", help="8B FULL_AND_PIECEWISE: split, cold and warm capture, phase timers")
    part.add_argument("count", type=int, help="how many capture sizes (benchmarks.startup.MAX_SIZE's keys)")
    parts.add_parser("host", help="0.5B FULL decode: the call's parts, interleaved")
    args = parser.parse_args(argv)
    if args.what == "host":
        host()
    else:
        startup(args.count)


if __name__ == "__main__":
    main()

