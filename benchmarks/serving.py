"""Serving-trace benchmark (work in progress for the main job): the varlen reference model
through one seeded synthetic trace (`benchmarks/trace.py`) under every graphify mode.

Per configuration: tokens per second, step latency p50/p99, start-up seconds (split +
capture), graph pool MiB, padding waste, share of steps per runtime mode, and the largest
difference to eager over the trace (checked step by step against an eager copy of the
cache). On a GPU: the Qwen2.5-0.5B-shaped model; on a CPU-only machine the tiny one through
the simulation backend, and the timings say so.

Not yet here (next): torch.compile(mode="reduce-overhead") beside these, graphify over
inductor pieces, and a plot.

    python -m benchmarks.serving [--requests 48] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from graphify import Mode, graphify, sglang_piecewise_sizes
from models import BlockTables, DecoderConfig, init_params, model_support, new_paged_cache, split_ops, varlen_axes, varlen_step
from transforms import split

from ._report import environment, publish, sync, table
from .trace import schedule, synthetic_requests

ATTENTION = "unified"
MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def build_batches(cfg, steps, requests, *, block, max_blocks, num_blocks, device):
    """The trace's steps as model batches, KV blocks kept per request across steps."""
    tables = BlockTables(num_blocks, block, max_blocks)
    total = {r.id: r.prompt_len + r.output_len for r in requests}
    done = {r.id: 0 for r in requests}
    batches = []
    for i, s in enumerate(steps):
        batches.append(tables.batch(cfg, s.request_ids, s.query_lens, s.context_lens, device=device, seed=i))
        for rid, q in zip(s.request_ids, s.query_lens):
            done[rid] += q
            if done[rid] == total[rid]:
                tables.release(rid)
    return batches


def step_timer(gpu: bool):
    """Per-step latency (ms): CUDA events on a GPU, a host clock otherwise."""
    if gpu:
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end)
    else:
        def timed(fn):
            t0 = time.perf_counter()
            out = fn()
            return out, (time.perf_counter() - t0) * 1e3
    return timed


def run(num_requests: int = 48, seed: int = 0) -> dict:
    env = environment()
    gpu = env["gpu"]
    device = "cuda" if gpu else "cpu"
    cfg = DecoderConfig.qwen2_5_0_5b(max_seq_len=1024) if gpu else DecoderConfig.tiny(max_seq_len=256)
    block, max_blocks = 16, 64
    max_tokens = 512 if gpu else 64
    requests = synthetic_requests(seed, num_requests, prompt_range=(16, 400) if gpu else (4, 60),
                                  output_range=(8, 64) if gpu else (2, 12))
    steps = schedule(requests, max_tokens=max_tokens, chunk=max_tokens // 2, spec_tokens=2, spec_every=4)
    params = init_params(cfg, seed=0, device=device)
    step = varlen_step(cfg, params, ATTENTION)
    num_blocks = 1 + sum(-(-(r.prompt_len + r.output_len) // block) for r in requests)
    cache = new_paged_cache(cfg, num_blocks, block, device=device, seed=1)
    batches = build_batches(cfg, steps, requests, block=block, max_blocks=max_blocks, num_blocks=num_blocks, device=device)
    example = next(b for b in batches if b[3].shape[0] >= 2)  # split traces with >= 2 tokens and requests
    timed = step_timer(gpu)
    tokens_total = sum(s.num_tokens for s in steps)
    rows = []
    from tqdm.auto import tqdm

    for mode in MODES:
        sync()
        t0 = time.perf_counter()
        fn = step if mode == "NONE" else split(step, split_ops(ATTENTION), *example, cache, axes=varlen_axes())
        g = graphify(fn, mode=mode, sizes=sglang_piecewise_sizes(max_tokens), axes=varlen_axes(),
                     support=model_support(ATTENTION), uniform_query_len=1, progress=True)
        if mode != "NONE":
            g = g.capture(*example, cache)
        sync()
        startup = time.perf_counter() - t0
        ref_cache = cache.clone()
        worst = 0.0
        with torch.inference_mode():
            for batch in tqdm(batches, desc=f"{mode}: check", leave=False, disable=None):
                out = g(*batch, cache)
                worst = max(worst, (out.float() - step(*batch, ref_cache).float()).abs().max().item())
            g.stats.reset()
            latencies = []
            for batch in tqdm(batches, desc=f"{mode}: run", leave=False, disable=None):
                latencies.append(timed(lambda: g(*batch, cache))[1])  # noqa: B023 - called at once
        by_mode = {r.mode: r.calls for r in g.stats.by_mode()}
        rows.append({
            "config": f"graphify {mode}",
            "tokens_per_s": tokens_total / (sum(latencies) / 1e3),
            "p50_ms": statistics.median(latencies),
            "p99_ms": sorted(latencies)[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "startup_s": startup,
            "graph_mib": 0.0 if g.table is None else g.table.nbytes / 2**20,
            "padding_waste_pct": 100 * g.stats.padding_waste(),
            "steps_full_pct": 100 * by_mode[Mode.FULL] / len(batches),
            "steps_piecewise_pct": 100 * by_mode[Mode.PIECEWISE] / len(batches),
            "steps_none_pct": 100 * by_mode[Mode.NONE] / len(batches),
            "max_err_vs_eager": worst,
        })
        print(f"{mode}: {rows[-1]['tokens_per_s']:.0f} tok/s", file=sys.stderr)
    kinds = {k: sum(s.kind == k for s in steps) for k in ("prefill", "mixed", "decode", "spec")}
    return {"env": env, "rows": rows, "trace": {"requests": num_requests, "seed": seed, "steps": len(steps),
                                                 "tokens": tokens_total, "step_kinds": kinds,
                                                 "max_batch_tokens": max_tokens},
            "config": {"model": "qwen2.5-0.5b-shape" if gpu else "tiny", "dtype": str(cfg.dtype), "attention": ATTENTION}}


COLUMNS = [("config", "configuration", "s"), ("tokens_per_s", "tokens/s", ".0f"), ("p50_ms", "p50 ms", ".3f"),
           ("p99_ms", "p99 ms", ".3f"), ("startup_s", "start-up s", ".2f"), ("graph_mib", "graph MiB", ".1f"),
           ("padding_waste_pct", "padding %", ".1f"), ("steps_full_pct", "FULL %", ".0f"),
           ("steps_piecewise_pct", "PIECEWISE %", ".0f"), ("steps_none_pct", "NONE %", ".0f"),
           ("max_err_vs_eager", "max err vs eager", ".3g")]


def render(result: dict) -> str:
    lines = []
    if not result["env"]["gpu"]:
        lines.append("**CPU-only machine: tiny model on the simulation backend. These timings are not GPU timings.**\n")
    t = result["trace"]
    lines.append(f"Trace: {t['requests']} requests (seed {t['seed']}), {t['steps']} steps, {t['tokens']} tokens, "
                 f"at most {t['max_batch_tokens']} tokens a step; step kinds {t['step_kinds']}.\n")
    lines.append(table(result["rows"], COLUMNS))
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = run(args.requests, args.seed)
    markdown = render(result)
    publish("serving", result, markdown)
    return result


if __name__ == "__main__":
    main()
