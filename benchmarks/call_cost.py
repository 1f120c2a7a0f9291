"""Where a graphify call's host time goes, beside a bare `CUDAGraph.replay()` of the same
graph: every variant timed interleaved (each call after a synchronize, the order rotating),
and the launch inside graphify's call timed from within it. Also what the check of tensors
read through a static object costs (`graphify.reads.reach`, run before every replay): the same
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
from graphify.call.hand_out import hand_out_for
from graphify.call.runtime import STATIC_PLAN
from graphify.models import DecoderConfig, decode_step, init_params, new_kv_cache

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


def weights_check_rows(device: str) -> list[dict]:
    """Host µs a call spends checking what its graphs read beyond the arguments, at the
    Llama-3-8B structure (32 layers: 291 parameters, 355 modules; small widths, since the
    check's cost follows the structure, not the sizes): graphify's check (`Watch.check`
    over the deep walk of the model's forward and the code one recorded forward ran),
    beside the check graphify made before it watched more than the parameters (a weights
    generation and the buffers' storage), and every tensor's storage compared (torch's C++
    comparison where the build has it, else Python)."""
    from graphify.reads.parameter_storage import generation
    from graphify.reads.code_ran import CodeRan
    from graphify.reads.reach import Reach
    from graphify.reads.code_names import global_hook_dicts
    from graphify.reads.dict_marks import WATCHERS
    from graphify.reads.watch import Watch

    model = _llama_8b_structure(device)
    ran = CodeRan()
    with ran.collecting(), ran.recording(), torch.no_grad():  # the code a capture's warm-up would see run
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
    watch = Watch("bench", Reach.walk({"forward": model.forward, **global_hook_dicts()}, deep=True, ran=ran))
    # the same model passed in as an argument (`graphify(lambda ids, model: model(ids))`): the
    # capture's deep walk starts from the function and the module the argument holds
    passed = Watch("bench", Reach.walk({"step": _call_model, "static model": model, **global_hook_dicts()},
                                       deep=True, ran=ran))
    tensors = list(model.parameters()) + list(model.buffers())
    ptrs, indices = [t.data_ptr() for t in tensors], list(range(len(tensors)))
    buffers = list(model.buffers())
    buffer_ptrs = [t.data_ptr() for t in buffers]
    mark = generation()
    every = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if every is None:
        def every(ts, ps, _):
            return list(map(torch.Tensor.data_ptr, ts)) == ps

    def before(i):  # the weights generation and the buffers' storage: what graphify checked until it watched more
        if generation() != mark or list(map(torch.Tensor.data_ptr, buffers)) != buffer_ptrs:
            raise AssertionError

    costs = host_costs_us({
        "graphify's check (Watch.check)": lambda i: watch.guard(),  # (the row keeps its name: earlier results)
        "graphify's check, the model passed as an argument": lambda i: passed.guard(),
        "graphify's check before (parameters' generation + buffers)": before,
        "every tensor's storage": lambda i: every(tensors, ptrs, indices),
    }, reps=2000)
    held = watch.held
    shape = (f"{len(list(model.parameters()))} parameters, {len(watch.marks.dicts)} dicts watched, "
             f"{len(held[0])} cells, {len(held[1])} lists, {len(held[2])} functions, {watch.reach.edges()} edges, "
             f"dict watchers: {WATCHERS}")
    return [{"batch": 0, "what": f"check alone, 8B structure: {what}", "us": us, "vs_replay": float("nan"),
             "structure": shape} for what, us in costs.items()]


def _call_model(model, ids):
    return model(input_ids=ids)


def _llama_8b_structure(device: str):
    """A transformers Llama with Llama-3-8B's layers and modules at tiny widths."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=32, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).to(device).eval()


def reach_check_us() -> float | None:
    """Median µs of one `Reach.changed()` over a Qwen2.5-0.5B-shaped StaticCache (72 tensors)."""
    try:
        import transformers
    except ImportError:
        return None
    from graphify.reads.reach import Reach

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
    parser.add_argument("--name", default="call-cost", help="the results file's name (a second run beside the first)")
    args = parser.parse_args(argv)
    result = run(tuple(args.batch_sizes))
    md = table(result["rows"], [("batch", "B", "d"), ("what", "call", "s"), ("us", "host µs", ".1f"),
                                ("vs_replay", "÷ replay", ".2f")])
    print(md)
    publish(args.name, result, md)
    return result


if __name__ == "__main__":
    main()
