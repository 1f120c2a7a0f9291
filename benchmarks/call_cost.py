"""Where a graphify call's host time goes, beside a bare `CUDAGraph.replay()` of the same
graph: every variant timed interleaved (each call after a synchronize, the order rotating),
and the launch inside graphify's call timed from within it. Also what the check of tensors
read through a static object costs (`graphify._reach`, run before every replay): the same
step with its KV cache held by an object, and the check alone over a 24-layer transformers
StaticCache (the Qwen2.5-0.5B shape).

    python -m benchmarks.call_cost [--batch-sizes 1 8]
"""

from __future__ import annotations

import argparse
import time

import attrs
import torch

from graphify import Options, graphify, persistent, tokens, vllm_sizes
from graphify import static as static_axis
from models import DecoderConfig, decode_step, init_params, new_kv_cache

from ._report import environment, host_costs_us, publish, table


def run(batch_sizes=(1, 8)) -> dict:
    env = environment()
    device = "cuda" if env["gpu"] else "cpu"
    cfg = DecoderConfig.qwen2_5_0_5b() if env["gpu"] else DecoderConfig.tiny(max_seq_len=64)
    params = init_params(cfg, seed=0, device=device)
    cache = new_kv_cache(cfg, max(batch_sizes), device=device, seed=1)
    step = decode_step(cfg, params)
    axes = (tokens(), tokens(), tokens(), persistent())
    example = (torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device),
               torch.ones(1, dtype=torch.long, device=device), cache)
    views = graphify(step, mode="FULL", sizes=vllm_sizes(max(batch_sizes)), axes=axes, options=Options(outputs="view")).capture(*example)
    copies = graphify(step, mode="FULL", sizes=vllm_sizes(max(batch_sizes)), axes=axes).capture(*example)
    holder = _Holder(cache)
    held = graphify(_step_over(step), mode="FULL", sizes=vllm_sizes(max(batch_sizes)),
                    axes=(tokens(), tokens(), tokens(), static_axis())).capture(*example[:3], holder)
    rows = []
    with torch.inference_mode():
        for b in batch_sizes:
            ids = torch.randint(0, cfg.vocab_size, (b,), device=device)
            pos = torch.full((b,), cfg.max_seq_len - 1, dtype=torch.long, device=device)
            rows_ = torch.arange(1, b + 1, device=device)
            static = views.static_inputs(b)
            for dst, src in zip(static, (ids, pos, rows_)):
                dst.copy_(src)
            views(*static)
            runtime = views._runtime
            plan, mode, n = runtime.fast_plan
            entry = next(e for e in views.table if e.key.num_tokens == b)
            inside: list[float] = []

            def timed_replay(replay=plan.replay):
                t0 = time.perf_counter()
                replay()
                inside.append((time.perf_counter() - t0) * 1e6)

            def with_plan(p):
                def call(i):
                    runtime.fast_plan = (p, mode, n)
                    try:
                        return views(*static)
                    finally:
                        runtime.fast_plan = (plan, mode, n)
                return call

            calls = {
                "replay": lambda i: entry.replay(),
                "static + view (checked)": lambda i: views(*static),
                "static + view, Runtime.run": lambda i: runtime.run(static, views.stats),
                "static + view, launch stubbed": with_plan(attrs.evolve(plan, replay=lambda: None)),
                "static + view, launch timed inside": with_plan(attrs.evolve(plan, replay=timed_replay)),
                "copies inputs, view": lambda i: views(ids, pos, rows_, cache),
                "copies in and out (default)": lambda i: copies(ids, pos, rows_, cache),
                "copies in and out, cache held by an object (checked)": lambda i: held(ids, pos, rows_, holder),
            }
            if runtime.hand_out == runtime._checked_view:
                saved = runtime.hand_out
                calls["static + view (unchecked)"] = lambda i: (
                    setattr(runtime, "hand_out", runtime._view), views(*static), setattr(runtime, "hand_out", saved))
            costs = host_costs_us(calls)
            costs["launch inside the call"] = sorted(inside)[len(inside) // 2] if inside else float("nan")
            for name, us in costs.items():
                rows.append({"batch": b, "what": name, "us": us, "vs_replay": us / costs["replay"]})
    check = reach_check_us()
    if check is not None:
        rows.append({"batch": 0, "what": "reach check alone: 24-layer transformers StaticCache", "us": check,
                     "vs_replay": float("nan")})
    return {"env": env, "rows": rows}


class _Holder:
    """A static object holding the KV cache, as a transformers cache holds its tensors."""

    def __init__(self, kv):
        self.kv = kv


def _step_over(step):
    def step_held(ids, pos, rows, holder):
        return step(ids, pos, rows, holder.kv)

    return step_held


def reach_check_us(reps: int = 20000) -> float | None:
    """Median µs of one `Reach.changed()` over a Qwen2.5-0.5B-shaped StaticCache (72 tensors)."""
    try:
        import transformers
    except ImportError:
        return None
    from graphify._reach import Reach

    cfg = transformers.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=1000)
    cache = transformers.StaticCache(config=cfg, max_cache_len=64)
    cache.early_initialization(1, 2, 64, torch.float32, torch.device("cpu"))
    reach = Reach.walk({"past_key_values": cache}).freeze()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps // 5):
            reach.changed()
        samples.append((time.perf_counter() - t0) / (reps // 5) * 1e6)
    return sorted(samples)[2]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args(argv)
    result = run(tuple(args.batch_sizes))
    md = table(result["rows"], [("batch", "B", "d"), ("what", "call", "s"), ("us", "host µs", ".1f"),
                                ("vs_replay", "÷ replay", ".2f")])
    print(md)
    publish("call-cost", result, md)
    return result


if __name__ == "__main__":
    main()
