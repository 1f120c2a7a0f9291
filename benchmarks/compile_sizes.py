"""Which capture sizes pay for a shape-specialised compile (`Options(compile_sizes=...)`).

The 0.5B varlen model split at attention, its pieces compiled by inductor. Per size n: a
FULL graph of a decode batch of n requests (KV length 256) whose pieces are the dynamic
compile, and one whose pieces are compiled for n exactly; the step time of each (CUDA
events over replays, median) and the seconds the specialised compile added to capture,
in a fresh inductor cache (cold) and again (warm, from the cache on disk).

    python -m benchmarks.compile_sizes [--sizes 1 8 32 128 512]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="graphify-inductor-"))  # cold, before torch

import torch  # noqa: E402

from graphify import Options, graphify  # noqa: E402
from graphify.models import BatchLayout, DecoderConfig, init_params, model_support, new_paged_cache, split_ops, varlen_axes, varlen_step  # noqa: E402,E501
from graphify.transforms import split  # noqa: E402

from ._report import environment, publish, sync, table, time_per_call  # noqa: E402


def run(sizes=(1, 8, 32, 128, 512)) -> dict:
    env = environment()
    cfg = DecoderConfig.qwen2_5_0_5b(max_seq_len=1024)
    step = varlen_step(cfg, init_params(cfg, seed=0, device="cuda"), "unified")
    cache = new_paged_cache(cfg, 1 + max(sizes) * 17, 16, device="cuda", seed=1)
    example = BatchLayout((3, 1, 5), (4, 7, 0), 16, 16).build(cfg, device="cuda")
    t0 = time.perf_counter()  # split, compile and capture seconds, each timed once: none is repeated
    pw = split(step, split_ops("unified"), *example, cache, axes=varlen_axes(), compile=True)
    rows = [{"what": "split", "seconds": time.perf_counter() - t0}]
    t0 = time.perf_counter()  # the dynamic compile, once, so no size's row carries it
    warm = BatchLayout((1, 1), (256, 256), 16, 17).build(cfg, device="cuda", seed=2)
    graphify(pw, mode="FULL", sizes=[2], axes=varlen_axes(), support=model_support("unified"),
             options=Options(compile_sizes="none")).capture(*warm, cache).release()
    rows.append({"what": "dynamic compile + capture of size 2", "seconds": time.perf_counter() - t0})
    out = []
    for n in sizes:
        batch = BatchLayout((1,) * n, (256,) * n, 16, 17).build(cfg, device="cuda", seed=n)
        ref = step(*batch, cache.clone()).float()
        row = {"tokens": n}
        for name, rule in (("dynamic", "none"), ("specialised", (n,)), ("specialised, warm", (n,))):
            sync()
            t0 = time.perf_counter()
            g = graphify(pw, mode="FULL", sizes=[n], axes=varlen_axes(), support=model_support("unified"),
                         options=Options(outputs="view", compile_sizes=rule)).capture(*batch, cache)
            sync()
            row[f"{name}_capture_s"] = time.perf_counter() - t0
            with torch.inference_mode():
                row[f"{name}_err"] = (g(*batch, cache).float() - ref).abs().max().item()
                row[f"{name}_ms"] = time_per_call(lambda i: g(*batch, cache))  # noqa: B023
            g.release()
            if name == "specialised":  # the next pass finds every compile on disk: a second process's view
                for piece in pw.pieces:
                    if piece.kind == "graph":
                        piece.module.shared.static.clear()
        row["compile_s_cold"] = row["specialised_capture_s"] - row["dynamic_capture_s"]
        row["compile_s_warm"] = row["specialised, warm_capture_s"] - row["dynamic_capture_s"]
        row["step_gain"] = 1 - row["specialised_ms"] / row["dynamic_ms"]
        out.append(row)
        print(row, flush=True)
    return {"env": env, "rows": out, "setup": rows}


COLUMNS = [("tokens", "tokens", "d"), ("dynamic_ms", "dynamic pieces ms", ".3f"), ("specialised_ms", "specialised ms", ".3f"),
           ("step_gain", "step time saved", ".1%"), ("compile_s_cold", "compile s, cold", ".1f"),
           ("compile_s_warm", "compile s, warm", ".2f"), ("dynamic_err", "dynamic max err", ".3g"),
           ("specialised_err", "specialised max err", ".3g")]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    args = parser.parse_args(argv)
    result = run(tuple(args.sizes))
    md = table(result["rows"], COLUMNS)
    print(md)
    publish("compile-sizes", result, md)
    return result


if __name__ == "__main__":
    main()
