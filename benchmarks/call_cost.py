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
from torch.utils.benchmark import Timer

from graphify import Options, graphify, persistent, tokens, vllm_sizes
from graphify import static as static_axis
from graphify._hand_out import hand_out_for
from graphify._runtime import STATIC_PLAN
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
            rows += _batch_rows(b, cfg, views, copies, (held, holder), cache)
    rows += weights_check_rows(device)
    check = reach_check_us()
    if check is not None:
        rows.append({"batch": 0, "what": "reach check alone: 24-layer transformers StaticCache", "us": check,
                     "vs_replay": float("nan")})
    return {"env": env, "rows": rows}


def _batch_rows(b: int, cfg, views, copies, held: tuple, cache) -> list[dict]:
    """Host µs of every call variant at batch size `b`, and each one's ratio to a bare replay."""
    device = cache.device
    held, holder = held
    ids = torch.randint(0, cfg.vocab_size, (b,), device=device)
    pos = torch.full((b,), cfg.max_seq_len - 1, dtype=torch.long, device=device)
    rows_ = torch.arange(1, b + 1, device=device)
    static = views.static_inputs(b)
    for dst, src in zip(static, (ids, pos, rows_)):
        dst.copy_(src)
    views(*static)
    runtime = views._runtime
    learnt = runtime.plans[STATIC_PLAN]
    plan, mode, n = learnt
    entry = next(e for e in views.table if e.key.num_tokens == b)
    inside: list[float] = []

    def timed_replay(replay=plan.replay):
        # a host clock by hand: the launch is timed from inside the call, which no timer wraps
        t0 = time.perf_counter()
        replay()
        inside.append((time.perf_counter() - t0) * 1e6)

    def with_plan(p):
        def call(i):
            runtime.plans[STATIC_PLAN] = (p, mode, n)
            try:
                return views(*static)
            finally:
                runtime.plans[STATIC_PLAN] = learnt
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
    if runtime.hand_out.checked:
        saved = runtime.hand_out
        calls["static + view (unchecked)"] = lambda i: (
            setattr(runtime, "hand_out", hand_out_for("", "view", None)), views(*static),
            setattr(runtime, "hand_out", saved))
    costs = host_costs_us(calls)
    costs["launch inside the call"] = sorted(inside)[len(inside) // 2] if inside else float("nan")
    return [{"batch": b, "what": name, "us": us, "vs_replay": us / costs["replay"]} for name, us in costs.items()]


class _Holder:
    """A static object holding the KV cache, as a transformers cache holds its tensors."""

    def __init__(self, kv):
        self.kv = kv


def _step_over(step):
    def step_held(ids, pos, rows, holder):
        return step(ids, pos, rows, holder.kv)

    return step_held


def weights_check_rows(device: str, tensors: int = 291) -> list[dict]:
    """Host µs a call spends checking a graphified model's weights (`ModuleWatch.check`: the
    weights generation and the buffers' storage) beside the alternatives: every tensor's
    storage (torch's C++ comparison where the build has it, else Python) and the first and
    last parameter's alone (graphify's check before), over `tensors` parameters (an 8B
    Llama has 291) and one buffer."""
    from graphify._params import ModuleWatch

    model = torch.nn.Module()
    model.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(1, device=device)) for _ in range(tensors))
    model.register_buffer("inv_freq", torch.empty(1, device=device))
    watch = ModuleWatch("bench", [model])
    flat = [t for _, t in watch.tensors]
    ptrs, indices = [t.data_ptr() for t in flat], list(range(len(flat)))
    every = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if every is None:
        def every(ts, ps, _):
            return list(map(torch.Tensor.data_ptr, ts)) == ps
    ends = (flat[0], flat[-2])

    def ends_only(i):
        for t, p in zip(ends, (ptrs[0], ptrs[-2])):
            if t.data_ptr() != p:
                raise AssertionError

    costs = host_costs_us({
        "graphify's check (generation + buffers)": lambda i: watch.check(),
        "every tensor's storage": lambda i: every(flat, ptrs, indices),
        "first and last parameter": ends_only,
    }, reps=2000)
    return [{"batch": 0, "what": f"weights check alone, {tensors} parameters: {what}", "us": us,
             "vs_replay": float("nan")} for what, us in costs.items()]


def reach_check_us() -> float | None:
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
    reach = Reach.walk({"past_key_values": cache})
    timer = Timer("reach.changed()", globals={"reach": reach}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=0.5).median * 1e6


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
